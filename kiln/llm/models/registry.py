"""The model families Kiln runs, keyed on what a checkpoint says it is.

A family is one module in kiln/llm/models/families/ that defines `FAMILY`:
the Hugging Face `architectures` names and the GGUF `general.architecture`
names it reads, how it reads each format's hyper-parameters into a
`ModelArch`, its weight naming (`WeightMap`, and its GGUF tensor names), and
its model class. Adding a family is one such file (and its test): the
modules are found by listing the package, and imported on first use.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.errors import ModelLoadError
from kiln.llm.models.arch import ModelArch
from kiln.llm.models.weight_map import WeightMap

if TYPE_CHECKING:
    from kiln.llm.models.gguf_meta import GGUFMeta, GGUFNaming
    from kiln.llm.models.llama import LlamaModel

FAMILIES_PACKAGE = "kiln.llm.models.families"


@dataclass(frozen=True)
class Family:
    name: str  # ModelArch.family of the archs it builds
    hf_architectures: tuple[str, ...]
    # config.json (parsed) and its path, generation_config.json's extra eos ids -> arch
    arch_from_hf: Callable[[dict[str, Any], str, tuple[int, ...]], ModelArch]
    weight_map: Callable[[ModelArch], WeightMap]
    model_class: type[LlamaModel]
    gguf_architectures: tuple[str, ...] = ()
    arch_from_gguf: Callable[[GGUFMeta], ModelArch] | None = None
    gguf_naming: Callable[[ModelArch], GGUFNaming] | None = None
    # Sharded with tensor parallelism (kiln.llm.parallel): only Llama's layer is.
    tensor_parallel: bool = False


@functools.cache
def all_families() -> tuple[Family, ...]:
    package = importlib.import_module(FAMILIES_PACKAGE)
    found = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{FAMILIES_PACKAGE}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if isinstance(family, Family):
            found.append(family)
    return tuple(found)


def supported_hf_architectures() -> list[str]:
    return sorted(a for f in all_families() for a in f.hf_architectures)


def supported_gguf_architectures() -> list[str]:
    return sorted({a for f in all_families() for a in f.gguf_architectures})


def family_for_hf(architectures: list[str], source: str) -> Family:
    """The family of a config.json's `architectures` (its first entry decides)."""
    if not architectures:
        raise ModelLoadError(
            f"no architectures in {source}; supported: {', '.join(supported_hf_architectures())}"
        )
    for family in all_families():
        if architectures[0] in family.hf_architectures:
            return family
    raise ModelLoadError(
        f"unsupported architecture {architectures[0]} in {source}; "
        f"supported: {', '.join(supported_hf_architectures())}"
    )


def family_for_gguf(name: str, source: str) -> Family:
    for family in all_families():
        if name in family.gguf_architectures and family.arch_from_gguf is not None:
            return family
    raise ModelLoadError(
        f"unsupported GGUF architecture {name!r} in {source}; "
        f"supported: {', '.join(supported_gguf_architectures())}"
    )


def family_named(name: str) -> Family:
    for family in all_families():
        if family.name == name:
            return family
    raise ModelLoadError(f"unknown model family {name!r}; known: {', '.join(f.name for f in all_families())}")


def family_of(arch: ModelArch) -> Family:
    return family_named(arch.family)


def expected_weight_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor a model of `arch` reads."""
    return family_of(arch).weight_map(arch).checkpoint_shapes()


def build_model(arch: ModelArch, max_positions: int) -> LlamaModel:
    """An empty (unloaded) model of `arch`'s family."""
    family = family_of(arch)
    return family.model_class(arch, max_positions, weight_map=family.weight_map(arch))
