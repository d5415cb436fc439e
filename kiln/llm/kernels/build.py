"""Builds Kiln's CPU kernels into a shared library beside this file.

Run once at install time (`make` does): `python -m kiln.llm.kernels.build`.
Needs a C++20 compiler; without one (or on a CPU without AVX2/FMA) the build
is skipped and Kiln runs on PyTorch's own kernels (every AVX2 CPU also has
F16C, used for fp16 int4 scales). The library is loaded with
`torch.ops.load_library`, so nothing is compiled while a server starts.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

HERE = Path(__file__).resolve().parent
SOURCES = [HERE / "linear_f32.cpp", HERE / "paged_attention.cpp", HERE / "layer_ops.cpp", HERE / "decode_layer.cpp"]
LIBRARY = HERE / "_kiln_kernels.so"


def cpu_supported() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def compile_command(output: Path) -> list[str]:
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    lib_dirs = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        shutil.which("c++") or "g++", "-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++20", "-fopenmp", "-shared", "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, *map(str, SOURCES), "-o", str(output),
        *[f"-L{d}" for d in lib_dirs], *[f"-Wl,-rpath,{d}" for d in lib_dirs], "-lc10", "-ltorch_cpu",
    ]


def build() -> bool:
    if not cpu_supported():
        print("kiln kernels: CPU lacks AVX2/FMA; skipped (PyTorch kernels will be used)")
        return False
    if not (shutil.which("c++") or shutil.which("g++")):
        print("kiln kernels: no C++ compiler found; skipped (PyTorch kernels will be used)")
        return False
    started = time.perf_counter()
    tmp = LIBRARY.with_suffix(".tmp.so")
    subprocess.run(compile_command(tmp), check=True)
    tmp.replace(LIBRARY)  # atomic: a running server never sees half a library
    print(f"kiln kernels: built {LIBRARY.name} in {time.perf_counter() - started:.0f}s")
    return True


if __name__ == "__main__":
    sys.exit(0 if build() else 0)
