"""Generates and imports the gRPC stubs for kserve_v2.proto.

The stubs are build output, never committed: `load_stubs()` runs
grpc_tools.protoc into `_gen/` beside this file (or a user cache dir when the
package is read-only) whenever they are missing or older than the .proto.

Two rewrites make the generated code safe to import next to other copies
of the same protocol (e.g. tritonclient's, in one test process):
- the messages live in a private descriptor pool, not protobuf's default one,
  so `inference.*` names cannot clash;
- the service module imports the messages relatively (`from . import`).
Run `python -m kiln.frontends.kserve.grpc.stubs` to generate them at build time.
"""
from __future__ import annotations

import importlib
import os
import sys
import tempfile
import types
from pathlib import Path

PROTO = Path(__file__).with_name("kserve_v2.proto")
MODULE = "kserve_v2"
PACKAGE = f"{__package__}._gen"
_FILES = (f"{MODULE}_pb2.py", f"{MODULE}_pb2_grpc.py")


def _targets() -> list[Path]:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kiln" / "grpc_gen"
    return [Path(__file__).with_name("_gen"), cache]


def _stamp() -> str:
    """Generated code depends on the protobuf and grpcio-tools versions too."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        tools = version("grpcio-tools")
    except PackageNotFoundError:
        tools = "none"
    return f"protobuf={version('protobuf')} grpcio-tools={tools}\n"


def _fresh(directory: Path) -> bool:
    proto_mtime = PROTO.stat().st_mtime
    stamp = directory / "STAMP"
    if not stamp.exists() or stamp.read_text() != _stamp():
        return False
    return all((directory / f).exists() and (directory / f).stat().st_mtime >= proto_mtime for f in _FILES)


def _generate(directory: Path) -> None:
    from grpc_tools import protoc

    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        include = Path(protoc.__file__).parent / "_proto"
        code = protoc.main([
            "grpc_tools.protoc", f"-I{PROTO.parent}", f"-I{include}",
            f"--python_out={tmp}", f"--grpc_python_out={tmp}", str(PROTO),
        ])
        if code != 0:
            raise RuntimeError(f"protoc failed on {PROTO.name} (exit {code})")
        _rewrite(Path(tmp))
        for name in _FILES:  # atomic per file: concurrent generators agree
            os.replace(Path(tmp) / name, directory / name)
    (directory / ".gitignore").write_text("*\n")
    (directory / "STAMP").write_text(_stamp())


def _rewrite(tmp: Path) -> None:
    pb2 = tmp / _FILES[0]
    text = pb2.read_text()
    text = text.replace(
        "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(",
        "POOL = _descriptor_pool.DescriptorPool()\nDESCRIPTOR = POOL.AddSerializedFile(",
    )
    pb2.write_text(text)
    service = tmp / _FILES[1]
    service.write_text(service.read_text().replace(f"import {MODULE}_pb2 as", f"from . import {MODULE}_pb2 as"))


def ensure_stubs() -> Path:
    """Generate the stubs if needed; return the directory holding them."""
    errors = []
    for directory in _targets():
        if _fresh(directory):
            return directory
        try:
            _generate(directory)
            return directory
        except ImportError:
            # No grpcio-tools here (a runtime-only install): use stubs built at install time.
            if all((directory / f).exists() for f in _FILES):
                return directory
            errors.append(f"{directory}: grpcio-tools is not installed and no stubs were built")
        except OSError as exc:
            errors.append(f"{directory}: {exc}")
    raise RuntimeError("cannot write the gRPC stubs: " + "; ".join(errors))


def load_stubs() -> tuple[types.ModuleType, types.ModuleType]:
    """(messages module, service module), generated on first use."""
    if f"{PACKAGE}.{MODULE}_pb2_grpc" in sys.modules:
        return sys.modules[f"{PACKAGE}.{MODULE}_pb2"], sys.modules[f"{PACKAGE}.{MODULE}_pb2_grpc"]
    directory = ensure_stubs()
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(directory)]
    sys.modules[PACKAGE] = package
    importlib.invalidate_caches()
    pb2 = importlib.import_module(f"{PACKAGE}.{MODULE}_pb2")
    pb2_grpc = importlib.import_module(f"{PACKAGE}.{MODULE}_pb2_grpc")
    return pb2, pb2_grpc


if __name__ == "__main__":
    print(ensure_stubs())
