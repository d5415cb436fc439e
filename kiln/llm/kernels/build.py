"""Builds Kiln's CPU kernels into one shared library per ISA build, beside this file.

Run once at install time (`make` does): `python -m kiln.llm.kernels.build`.
Four builds (isa.py says which one a CPU loads), compiled in parallel:

    _kiln_kernels_avx2.so         -mavx2 -mfma -mf16c: the fp32, int8, int4
                                  kernels (int4 x int8 activations); bf16
                                  through fp32 arithmetic
    _kiln_kernels_avx512.so       the same sources with AVX-512 F/BW/VL/DQ
                                  (Skylake-SP; no VNNI, no BF16): int4
                                  above 8 rows and prompts, decode attention
                                  and gating sixteen lanes wide (the int4
                                  kernels give the avx2 build's bits)
    _kiln_kernels_avx512_vnni.so  the avx512 build plus AVX512_VNNI (Cascade
                                  Lake, Ice Lake): int8 weights on int8 dot
                                  products (`linear_w8a8`)
    _kiln_kernels_avx512_bf16.so  adds AVX-512 F/BW/VL/DQ, BF16 and VNNI:
                                  bf16 dot products (`vdpbf16ps`)

Every build the compiler can produce is built, whatever this CPU runs (an
image built here may run elsewhere). A library's file name carries a
fingerprint of what it was compiled from (`fingerprint`: the sources and
headers, the flags, the torch version), so a library left by older sources
is never loaded (its ops would take other arguments and fail at the first
call): it is not found, the current one is compiled on first use, and `make`
removes the stale files. Needs a C++20 compiler; without one,
or on a CPU without AVX2/FMA, nothing is built and Kiln runs on PyTorch's
own kernels. A compile error is reported and the exit status is 1; at run
time Kiln then loads the best build that exists, or none. The libraries are
loaded with `torch.ops.load_library`.

Where no library was built (a wheel installed with pip, not `make`), the
first process that wants one compiles the build its CPU loads
(`build_on_first_use`): beside this file if the package directory is
writable, else in the user's cache (`~/.cache/kiln/kernels/torch-<version>`),
under a file lock so concurrent processes compile it once. Without a
compiler that is a logged warning and Kiln runs on PyTorch's kernels.
"""
from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.llm.kernels import isa

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
COMMON_SOURCES = (
    "linear_f32.cpp", "linear_w4a8.cpp", "linear_q8_0a8.cpp", "paged_attention.cpp", "prefill_attention.cpp",
    "kv_write.cpp", "layer_ops.cpp", "decode_layer.cpp", "dequant_w4.cpp", "row_argmax.cpp", "linear_w4_panels.cpp",
)


@dataclass(frozen=True)
class Build:
    name: str
    flags: tuple[str, ...]
    sources: tuple[Path, ...]
    directory: Path = HERE  # where the library goes

    @property
    def library(self) -> Path:
        return self.directory / f"_kiln_kernels_{self.name}-{fingerprint(self)}.so"

    def stale_libraries(self) -> list[Path]:
        """This build's libraries in `directory` compiled from anything else (and the unfingerprinted name)."""
        unfingerprinted = self.directory / f"_kiln_kernels_{self.name}.so"
        found = [*self.directory.glob(f"_kiln_kernels_{self.name}-*.so"), unfingerprinted]
        current = self.library
        return sorted(p for p in found if p.exists() and p != current and ".tmp." not in p.name)


def fingerprint(build: Build) -> str:
    """12 hex digits of SHA-256 over what the library is compiled from: each
    source and every header beside the sources (name and bytes), the flags,
    and the torch version (the ops link against torch's ABI)."""
    digest = hashlib.sha256()
    headers = {h for s in build.sources for h in s.parent.glob("*.h")}
    for path in sorted(build.sources) + sorted(headers):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(build.flags).encode() + b"\0" + torch.__version__.encode())
    return digest.hexdigest()[:12]


AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
AVX512_FLAGS = (*AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-DKILN_AVX512=1")
AVX512_VNNI_FLAGS = (*AVX512_FLAGS, "-mavx512vnni", "-DKILN_VNNI=1")
AVX512_BF16_FLAGS = (*AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                     "-mavx512vnni", "-DKILN_AVX512_BF16=1", "-DKILN_VNNI=1")
BUILDS = {
    "avx2": Build("avx2", AVX2_FLAGS, tuple(HERE / s for s in COMMON_SOURCES)),
    "avx512": Build("avx512", AVX512_FLAGS, tuple(HERE / s for s in COMMON_SOURCES)),
    "avx512_vnni": Build("avx512_vnni", AVX512_VNNI_FLAGS,
                         tuple(HERE / s for s in (*COMMON_SOURCES, "linear_int8_vnni.cpp"))),
    "avx512_bf16": Build("avx512_bf16", AVX512_BF16_FLAGS, tuple(
        HERE / s for s in (*COMMON_SOURCES, "linear_bf16.cpp", "linear_w4l_bf16.cpp", "linear_bf16_lanes.cpp",
                          "linear_int8_vnni.cpp", "prefill_attention_bf16.cpp"))),
}
# Left by builds before the ISA split; removed so nothing loads it by mistake.
LEGACY_LIBRARY = HERE / "_kiln_kernels.so"


def library_path(name: str) -> Path:
    return BUILDS[name].library


def cache_directory() -> Path:
    """Where first-use builds go when the package directory is read-only (one per torch version: the
    libraries link against torch's)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kiln" / "kernels" / f"torch-{torch.__version__}"


def find_library(name: str) -> Path | None:
    """Build `name`'s library compiled from the current sources: beside this
    file (`make`), else from an earlier first-use build. Stale ones (other
    sources, flags or torch) are logged and never returned."""
    for directory in (HERE, cache_directory()):
        located = dataclasses.replace(BUILDS[name], directory=directory)
        if located.library.exists():
            return located.library
    for directory in (HERE, cache_directory()):
        for stale in dataclasses.replace(BUILDS[name], directory=directory).stale_libraries():
            log.warning("kiln kernels: %s was compiled from other kernel sources or another torch; not loaded",
                        stale)
    return None


def _writable(directory: Path) -> bool:
    return os.access(directory, os.W_OK)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@functools.cache
def _warn_no_compiler() -> None:
    log.warning(
        "kiln kernels: not built and no C++ compiler (c++ or g++) to build them; running on PyTorch's kernels "
        "(slower). Install a C++20 compiler with OpenMP (e.g. apt install g++) and restart, or run "
        "`python -m kiln.llm.kernels.build` once."
    )


def build_on_first_use(name: str) -> Path | None:
    """Compiles build `name` now (it exists nowhere); its library, or None
    (logged why): no compiler, or the compile failed."""
    if compiler() is None:
        _warn_no_compiler()
        return None
    directory = HERE if _writable(HERE) else cache_directory()
    directory.mkdir(parents=True, exist_ok=True)
    wanted = dataclasses.replace(BUILDS[name], directory=directory)
    with _locked(directory / ".kiln-kernels-build.lock"):
        if wanted.library.exists():  # another process built it while this one waited
            return wanted.library
        log.warning("kiln kernels: %s not built; compiling it now into %s (once; about a minute)",
                    wanted.library.name, directory)
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp_dir:
            status = build_all([wanted], Path(tmp_dir))
    for stale in wanted.stale_libraries():
        stale.unlink(missing_ok=True)  # a process that loaded it keeps its mapping
    if status != 0 or not wanted.library.exists():
        log.error("kiln kernels: compiling %s failed (compiler output above); running on PyTorch's kernels",
                  wanted.library.name)
        return None
    log.warning("kiln kernels: built %s in %.0fs", wanted.library.name, time.perf_counter() - started)
    return wanted.library


def cpu_supported() -> bool:
    """Whether this CPU can run any of Kiln's builds (AVX2, FMA, F16C)."""
    return isa.rank(isa.level_of(isa.read_cpu_flags())) >= isa.rank("avx2")


def compiler() -> str | None:
    return shutil.which("c++") or shutil.which("g++")


def unity_source(build: Build, directory: Path) -> Path:
    """One translation unit that includes every source of the build: the
    torch headers (most of the compile time) are parsed once, not per file.
    So names in the sources' anonymous namespaces must not collide."""
    unit = directory / f"kiln_kernels_{build.name}.cpp"
    unit.write_text("".join(f'#include "{source}"\n' for source in build.sources))
    return unit


def compile_command(build: Build, source: Path, output: Path) -> list[str]:
    from torch.utils import cpp_extension  # slow to import: not at run time, only when building

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    lib_dirs = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        # No contraction of a * b + c into an FMA at the compiler's choice: it
        # may choose differently per micro-kernel shape, and then a row's
        # bits would depend on M. Kernels write the FMAs they mean.
        compiler() or "g++", "-O3", "-ffp-contract=off", *build.flags, "-std=c++20", "-fopenmp", "-shared", "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(source), "-o", str(output),
        *[f"-L{d}" for d in lib_dirs], *[f"-Wl,-rpath,{d}" for d in lib_dirs], "-lc10", "-ltorch_cpu",
    ]


def compiler_accepts(flags: tuple[str, ...]) -> bool:
    """Whether the compiler takes these target flags (an old one may lack -mavx512bf16)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text("int main() { return 0; }\n")
        probe = [compiler() or "g++", *[f for f in flags if f.startswith("-m")], "-c", str(src), "-o", str(src) + ".o"]
        return subprocess.run(probe, capture_output=True).returncode == 0


def build() -> int:
    """Builds every library the compiler supports; returns the exit status
    (0: built, or skipped because nothing can be built here; 1: a compile failed)."""
    if not cpu_supported():
        print("kiln kernels: CPU lacks AVX2/FMA/F16C; skipped (PyTorch kernels will be used)")
        return 0
    if not compiler():
        print("kiln kernels: no C++ compiler found; skipped (PyTorch kernels will be used)")
        return 0
    LEGACY_LIBRARY.unlink(missing_ok=True)
    for build_ in BUILDS.values():
        for stale in build_.stale_libraries():
            stale.unlink()
    with tempfile.TemporaryDirectory() as tmp_dir:
        return build_all(list(BUILDS.values()), Path(tmp_dir))


def build_all(builds: list[Build], tmp_dir: Path) -> int:
    """Compiles the builds in parallel; 1 if any failed (the others are kept)."""
    started = time.perf_counter()
    jobs = {}
    for build_ in builds:
        if not compiler_accepts(build_.flags):
            print(f"kiln kernels: the compiler does not take {' '.join(build_.flags)}; {build_.name} not built")
            continue
        tmp = build_.library.with_suffix(f".{os.getpid()}.tmp.so")
        command = compile_command(build_, unity_source(build_, tmp_dir), tmp)
        jobs[build_.name] = (build_, tmp, time.perf_counter(), subprocess.Popen(command))
    count = len(jobs)
    status = 0
    while jobs:
        time.sleep(0.2)
        for name, (build_, tmp, begun, proc) in list(jobs.items()):
            if proc.poll() is None:
                continue
            del jobs[name]
            seconds = time.perf_counter() - begun
            if proc.returncode != 0:
                print(f"kiln kernels: building {build_.library.name} FAILED (exit {proc.returncode}); "
                      f"Kiln will load a lower build or PyTorch kernels")
                tmp.unlink(missing_ok=True)
                status = 1
                continue
            tmp.replace(build_.library)  # atomic: a running server never sees half a library
            print(f"kiln kernels: built {build_.library.name} in {seconds:.0f}s")
    print(f"kiln kernels: {count} builds in {time.perf_counter() - started:.0f}s (in parallel)")
    return status


if __name__ == "__main__":
    sys.exit(build())
