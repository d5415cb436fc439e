"""A built wheel carries everything Kiln needs at run time, and `kiln serve`
runs from it: installed (not editable) into a fresh virtual environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.integration.openai.live import free_port

ROOT = Path(__file__).resolve().parents[3]
RUNTIME_SOURCES = ("kiln/frontends/kserve/grpc/kserve_v2.proto", "kiln/llm/kernels/simd.h")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the files git knows (as a clean clone has them), not the work tree's build output."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    git = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    files = subprocess.check_output(git, cwd=ROOT, text=True)
    for name in files.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        check=True,
        cwd=source,
    )
    return next(out.glob("kiln-*.whl"))


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A new venv with the wheel installed; its dependencies come from this
    test's environment through a .pth file (no download, no second torch)."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    site = Path(subprocess.check_output(
        [str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip())
    (site / "kiln_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True)
    return root


def test_wheel_holds_kernel_sources_and_proto(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(RUNTIME_SOURCES) <= names
    assert {"kiln/llm/kernels/linear_f32.cpp", "kiln/llm/kernels/paged_attention.cpp"} <= names
    assert not any(n.endswith(".so") or "/_gen/" in n for n in names), "build output in the wheel"


def test_installed_package_is_the_wheel_and_finds_its_data(venv, tmp_path):
    code = (
        "import kiln, pathlib; from kiln.frontends.kserve.grpc.stubs import load_stubs; "
        "pb2, _ = load_stubs(); print(pathlib.Path(kiln.__file__).parent); print(pb2.ModelInferRequest.__name__)"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": ""}
    out = subprocess.check_output([str(venv / "bin" / "python"), "-c", code], text=True, env=env, cwd=tmp_path)
    package_dir, message = out.split()
    assert Path(package_dir).is_relative_to(venv) and message == "ModelInferRequest"


def test_kiln_serve_from_the_wheel_answers(venv, tiny_llama_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": "", "KILN_KERNELS": "0", "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp_path)}
    cmd = [str(venv / "bin" / "kiln"), "serve", str(tiny_llama_dir), "--port", str(port), "--num-blocks", "64",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            if proc.poll() is not None:
                pytest.fail(f"kiln serve exited: {proc.stdout.read().decode() if proc.stdout else ''}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)
