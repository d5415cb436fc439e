"""`kiln repo validate` checks routes.yaml against the repository's models."""

from kiln.cli.main import main
from kiln.dataplane.routing.validate import validate_routes_file
from tests.unit.dataplane.routing.models import versioned_config, versioned_repository
from tests.unit.serving.models import write_model


def test_a_valid_routes_file_passes(tmp_path, capsys):
    versioned_repository(tmp_path, routes={"r": {"targets": {"m@1": 9, "m@3": 1}, "shadow": {"m": 1}}})
    assert main(["repo", "validate", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "all models valid" in out and "routes.yaml valid" in out


def test_every_route_problem_is_reported(tmp_path, capsys):
    repo = versioned_repository(tmp_path, versions=(1, 2), routes={
        "m": {"targets": {"m@1": 1}},
        "r": {"targets": {"m@5": 1, "ghost": 1}, "shadow": {"m@2": 1}},
    })
    write_model(repo, "latest_only", {**versioned_config(), "version_policy": {"latest": 1}},
                {1: {"model.py": "x"}, 2: {"model.py": "x"}})
    (repo / "routes.yaml").write_text((repo / "routes.yaml").read_text() + "  old:\n    targets: {latest_only@1: 1}\n")
    assert main(["repo", "validate", str(repo)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "routes.yaml: route 'm' has the name of a model; a route needs a name of its own",
        "routes.yaml: route 'r': target 'ghost' names no served model",  # in the file's order (yaml sorted it)
        "routes.yaml: route 'r': model 'm' serves versions [1, 2], not 5 (see its version_policy)",
        "routes.yaml: route 'old': model 'latest_only' serves versions [2], not 1 (see its version_policy)",
    ]


def test_a_malformed_routes_file_is_one_problem(tmp_path):
    versioned_repository(tmp_path)
    (tmp_path / "routes.yaml").write_text("routes:\n  r: {targets: {m: -1}}\n")
    (problem,) = validate_routes_file(tmp_path)
    assert problem.startswith("routes.yaml: invalid routes.yaml: routes.r.targets") and "weights must be in" in problem
    assert validate_routes_file(tmp_path / "absent") == []
