"""Routes checked against the models they name.

A route's name must not be a model's (a public name means one thing); each
target and shadow must name a served model, and a version that model serves
(its config's version policy decides which). `kiln repo validate` runs
`validate_routes_file` on a repository; the server runs `route_problems` at
start-up and on every change through the admin API.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from kiln.dataplane.routing.spec import ROUTES_FILE, RouteSpec, read_routes_file
from kiln.dataplane.routing.target import Target
from kiln.errors import ConfigError, KilnError
from kiln.serving.repository.loader import list_models, read_model

# model name -> the versions it serves (None: exists, but its versions are unknown)
Catalog = Mapping[str, Sequence[int] | None]


def route_problems(name: str, spec: RouteSpec, catalog: Catalog) -> list[str]:
    problems = []
    if name in catalog:
        problems.append(f"route '{name}' has the name of a model; a route needs a name of its own")
    return problems + target_problems(name, [*spec.targets, *spec.shadow], catalog)


def target_problems(name: str, targets: Sequence[str], catalog: Catalog) -> list[str]:
    """Targets of route `name` that name no served model, or a version it does not serve."""
    problems = []
    for text in targets:
        target = Target.parse(text)
        if target.model not in catalog:
            problems.append(f"route '{name}': target '{target}' names no served model")
            continue
        versions = catalog[target.model]
        if target.version is not None and versions is not None and target.version not in versions:
            problems.append(
                f"route '{name}': model '{target.model}' serves versions {list(versions)}, not {target.version} "
                "(see its version_policy)"
            )
    return problems


def check_routes(specs: Mapping[str, RouteSpec], catalog: Catalog) -> None:
    """ConfigError listing every problem of every route."""
    problems = [p for name, spec in specs.items() for p in route_problems(name, spec, catalog)]
    if problems:
        raise ConfigError("; ".join(problems))


def repository_catalog(repository: Path) -> dict[str, list[int] | None]:
    catalog: dict[str, list[int] | None] = {}
    for model in list_models(repository):
        try:
            catalog[model] = sorted(read_model(repository, model).versions)
        except KilnError:
            catalog[model] = None  # the model's own problem is reported on its own line
    return catalog


def validate_routes_file(repository: str | Path) -> list[str]:
    """Problems of `<repository>/routes.yaml`, as '<file>: <message>' lines (none if absent)."""
    path = Path(repository) / ROUTES_FILE
    if not path.exists():
        return []
    try:
        specs = read_routes_file(path)
        catalog = repository_catalog(Path(repository))
    except KilnError as exc:
        return [f"{ROUTES_FILE}: {exc.message}"]
    return [f"{ROUTES_FILE}: {p}" for name, spec in specs.items() for p in route_problems(name, spec, catalog)]
