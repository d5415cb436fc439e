"""Ensemble graph checks, done once at load time.

Tensors are named edges: ensemble inputs and step outputs produce them, step
inputs and ensemble outputs consume them. A valid ensemble has every
consumed tensor produced exactly once, matching datatypes on each edge, all
required step inputs mapped, and no cycle between steps.
"""
from __future__ import annotations

from collections.abc import Callable

from kiln.errors import ConfigError
from kiln.serving.repository.config import RepositoryModelConfig, TensorSpec

# (model, version or None for its highest) -> that version's config, or None where there is none.
ConfigLookup = Callable[[str, int | None], RepositoryModelConfig | None]


def _fail(ensemble: str, message: str) -> ConfigError:
    return ConfigError(f"ensemble '{ensemble}': {message}")


def _producers(
    config: RepositoryModelConfig, members: list[RepositoryModelConfig]
) -> dict[str, tuple[int, TensorSpec]]:
    """tensor name -> (step index or -1 for an ensemble input, its spec)."""
    produced: dict[str, tuple[int, TensorSpec]] = {s.name: (-1, s) for s in config.inputs}
    for index, step in enumerate(config.steps):
        member = members[index]
        for model_output, tensor in step.output_map.items():
            spec = member.output(model_output)
            if spec is None:
                raise _fail(config.name, f"step {index} ({step.model}) has no output '{model_output}'")
            if tensor in produced:
                raise _fail(config.name, f"tensor '{tensor}' is produced more than once")
            produced[tensor] = (index, spec)
    return produced


def _check_edge(ensemble: str, tensor: str, source: TensorSpec, target: TensorSpec, where: str) -> None:
    if source.datatype != target.datatype:
        raise _fail(ensemble, f"type mismatch on tensor '{tensor}': produced as {source.datatype}, "
                              f"{where} expects {target.datatype}")


def validate_ensemble(config: RepositoryModelConfig, lookup: ConfigLookup) -> list[list[int]]:
    """Check the DAG; return each step's list of prerequisite steps."""
    members: list[RepositoryModelConfig] = []
    for index, step in enumerate(config.steps):
        if step.model == config.name:
            raise _fail(config.name, f"step {index} uses the ensemble itself")
        member = lookup(step.model, step.version)
        if member is None and step.version is not None and lookup(step.model, None) is not None:
            raise _fail(config.name, f"step {index} uses version {step.version} of '{step.model}', which it "
                                     "does not have (or has not loaded)")
        if member is None:
            raise _fail(config.name, f"step {index} uses unknown model '{step.model}'")
        members.append(member)
    produced = _producers(config, members)
    depends: list[list[int]] = []
    for index, step in enumerate(config.steps):
        member = members[index]
        needs: set[int] = set()
        for model_input, tensor in step.input_map.items():
            target = member.input(model_input)
            if target is None:
                raise _fail(config.name, f"step {index} ({step.model}) has no input '{model_input}'")
            if tensor not in produced:
                raise _fail(config.name, f"step {index} ({step.model}) needs tensor '{tensor}', which nothing produces")
            source_step, source = produced[tensor]
            _check_edge(config.name, tensor, source, target, f"step {index} ({step.model}) input '{model_input}'")
            if source_step >= 0:
                needs.add(source_step)
        missing = [s.name for s in member.inputs if not s.optional and s.name not in step.input_map]
        if missing:
            raise _fail(config.name, f"step {index} ({step.model}) leaves required input(s) {missing} unmapped")
        depends.append(sorted(needs))
    for spec in config.outputs:
        if spec.name not in produced:
            raise _fail(config.name, f"output '{spec.name}' is not produced by any step")
        _check_edge(config.name, spec.name, produced[spec.name][1], spec, f"ensemble output '{spec.name}'")
    _check_acyclic(config.name, depends)
    return depends


def _check_acyclic(ensemble: str, depends: list[list[int]]) -> None:
    remaining = {i: set(d) for i, d in enumerate(depends)}
    while remaining:
        ready = [i for i, d in remaining.items() if not d]
        if not ready:
            raise _fail(ensemble, f"steps {sorted(remaining)} form a cycle")
        for i in ready:
            del remaining[i]
        for d in remaining.values():
            d.difference_update(ready)
