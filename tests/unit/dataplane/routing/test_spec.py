"""routes.yaml: the schema accepts what docs/operations.md shows and names every mistake."""

import pytest

from kiln.dataplane.routing.spec import parse_route, parse_routes, parse_weights, read_routes_file
from kiln.dataplane.routing.target import Target
from kiln.errors import ConfigError

EXAMPLE = """
routes:
  chat:
    targets: {smollm2@1: 90, smollm2@2: 10}
    shadow: {smollm2@3: 0.5}
    canary:
      target: smollm2@2
      steps: [10, 25, 50, 100]
      interval_s: 120
      min_requests: 50
      max_error_rate_increase: 0.01
      max_latency_ratio: 1.3
      latency_quantile: 0.95
  scorer:
    targets: {ranker: 1, ranker_v2@4: 3}
"""


def test_the_documented_example_parses(tmp_path):
    (tmp_path / "routes.yaml").write_text(EXAMPLE)
    routes = read_routes_file(tmp_path / "routes.yaml")
    chat = routes["chat"]
    assert chat.targets == {"smollm2@1": 90.0, "smollm2@2": 10.0}
    assert chat.shadow == {"smollm2@3": 0.5}
    assert chat.canary is not None and chat.canary.steps == (10, 25, 50, 100) and chat.canary.interval_s == 120
    assert routes["scorer"].targets == {"ranker": 1.0, "ranker_v2@4": 3.0} and routes["scorer"].canary is None


def test_targets_parse_and_print_back():
    assert Target.parse("smollm2@2") == Target("smollm2", 2) and str(Target("smollm2", 2)) == "smollm2@2"
    assert Target.parse("smollm2") == Target("smollm2") and Target("m").version_str == ""
    for bad in ("", "a@", "a@0", "a@x", "../a", "a@1@2", "@1", "a@²", "a@٣"):
        with pytest.raises(ConfigError, match="invalid route target"):
            Target.parse(bad)


@pytest.mark.parametrize(("route", "message"), [
    ({"targets": {"a": 1}, "weights": {}}, "weights: Extra inputs are not permitted"),
    ({"targets": {}}, "targets"),
    ({"targets": {"a": -1}}, "weights must be in"),
    ({"targets": {"a": 0, "b": 0}}, "at least one target needs a positive weight"),
    ({"targets": {"a": True}}, "must be a finite number"),
    ({"targets": {"a": float("inf")}}, "must be a finite number"),
    ({"targets": {"a@0": 1}}, "invalid route target"),
    ({"targets": {"a@1": 1, "a@01": 5}}, "'a@01' names the same target as another entry"),  # one weight won
    ({"targets": {"a": 1}, "shadow": {"a": 1}}, "both a target and a shadow"),
    ({"targets": {"a": 1}, "shadow": {"b": 0}}, "shadow fraction"),
    ({"targets": {"a": 1}, "canary": {"target": "b", "steps": [10]}}, "must be one of the route's targets"),
    ({"targets": {"a": 0, "b": 1}, "canary": {"target": "b", "steps": [10]}}, "needs a baseline"),
    ({"targets": {"a": 1, "b": 0}, "canary": {"target": "b", "steps": [50, 20]}}, "steps must increase"),
    ({"targets": {"a": 1, "b": 0}, "canary": {"target": "b", "steps": [0, 20]}}, "percents in"),
    ({"targets": {"a": 1, "b": 0}, "canary": {"target": "b", "steps": [10], "interval_s": 0}}, "interval_s"),
    ({"targets": {"a": 1, "b": 0}, "canary": {"target": "b", "steps": [10], "pause": 1}}, "pause"),
])
def test_bad_routes_are_refused_with_the_reason(route, message):
    with pytest.raises(ConfigError, match=message):
        parse_routes({"routes": {"r": route}})


def test_file_level_mistakes(tmp_path):
    with pytest.raises(ConfigError, match="routes: Extra|routez"):
        parse_routes({"routez": {}})
    with pytest.raises(ConfigError, match="invalid route name"):
        parse_routes({"routes": {"bad/name": {"targets": {"a": 1}}}})
    with pytest.raises(ConfigError, match="must be a mapping"):
        parse_routes(["routes"])
    assert parse_routes(None) == {}
    assert parse_routes({"routes": None}) == {}  # `routes:` with nothing under it ("valid dictionary" before)
    (tmp_path / "routes.yaml").write_text("routes: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_routes_file(tmp_path / "routes.yaml")
    (tmp_path / "routes.yaml").write_text("routes:\n  r:\n    targets: {m@1: 1, m@2: 1, m@1: 0}\n")
    with pytest.raises(ConfigError, match=r"line 3, column 31: found the key 'm@1' twice"):
        read_routes_file(tmp_path / "routes.yaml")  # was {m@1: 0, m@2: 1}, the last m@1 winning


def test_admin_bodies():
    assert parse_route({"targets": {"a@1": 3}}, "r").targets == {"a@1": 3.0}
    assert parse_weights({"weights": {"a@1": 0, "a@2": 5}}) == {"a@1": 0.0, "a@2": 5.0}
    with pytest.raises(ConfigError, match="invalid weights"):
        parse_weights({"weights": {"a": -3}})
    with pytest.raises(ConfigError, match="invalid route name"):
        parse_route({"targets": {"a": 1}}, "..")
