"""Routes through the data plane over real (python-backend) model versions:
the split, stickiness, shadows, canary rollback, weight changes under load."""

import asyncio
import logging
import math

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kiln.dataplane.routed import TARGET_PARAMETER
from kiln.errors import ConfigError, InvalidRequestError, KilnError
from kiln.serving.types import InferRequest
from tests.unit.dataplane.planes import repository_plane
from tests.unit.dataplane.routing.models import request, served_version, versioned_config, versioned_repository


def run(coro):
    return asyncio.run(coro)


def metric(plane, name: str, **labels) -> float:
    text = generate_latest(plane.registry).decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def shadows_done(plane, n: int) -> None:
    """Wait (up to ~1 s) until route r's shadow copies, which finish in the background, number n."""
    for _ in range(100):
        if metric(plane, "kiln:route_shadow_requests_total", route="r") == n:
            return
        await asyncio.sleep(0.01)


async def started(repo, **config):
    plane = repository_plane(repo, **config)
    plane.load_routes()
    errors = await plane.start()
    assert errors == {}
    return plane


def test_split_matches_the_weights_and_the_response_names_route_and_target(tmp_path):
    repo = versioned_repository(tmp_path, routes={"r": {"targets": {"m@1": 80, "m@2": 20}}})
    n = 500

    async def main():
        plane = await started(repo)
        responses = [await plane.infer(request()) for _ in range(n)]
        counts = {t: metric(plane, "kiln:route_requests_total", route="r", target=t) for t in ("m@1", "m@2")}
        await plane.shutdown()
        return responses, counts

    responses, counts = run(main())
    twos = sum(served_version(r) == 2 for r in responses)
    assert abs(twos - n * 0.2) <= 4.5 * math.sqrt(n * 0.2 * 0.8)
    for r in responses:
        assert r.model_name == "r"
        assert r.parameters[TARGET_PARAMETER] == f"m@{served_version(r)}" and r.model_version == str(served_version(r))
    assert counts == {"m@1": n - twos, "m@2": twos}


def test_sticky_keys_never_move_while_the_weights_stand(tmp_path):
    repo = versioned_repository(tmp_path, routes={"r": {"targets": {"m@1": 1, "m@2": 1, "m@3": 1}}})

    async def main():
        plane = await started(repo)
        seen = {}
        for _ in range(3):
            for i in range(60):
                response = await plane.infer(request(), route_key=f"user-{i}")
                seen.setdefault(i, set()).add(served_version(response))
        await plane.shutdown()
        return seen

    seen = run(main())
    assert all(len(versions) == 1 for versions in seen.values())
    assert {v for versions in seen.values() for v in versions} == {1, 2, 3}  # the keys spread over all


def test_a_failing_shadow_is_invisible_to_the_caller_and_recorded(tmp_path):
    repo = versioned_repository(tmp_path, routes={"r": {"targets": {"m@1": 1}, "shadow": {"m@2": 1.0}}},
                                fail_version=2)

    async def main():
        plane = await started(repo)
        responses = [await plane.infer(request()) for _ in range(20)]
        await shadows_done(plane, 20)
        out = {name: metric(plane, name, route="r") for name in (
            "kiln:route_shadow_requests_total", "kiln:route_shadow_errors_total", "kiln:route_errors_total",
            "kiln:route_requests_total")}
        await plane.shutdown()
        return responses, out

    responses, out = run(main())
    assert [served_version(r) for r in responses] == [1] * 20
    assert out == {"kiln:route_shadow_requests_total": 20, "kiln:route_shadow_errors_total": 20,
                   "kiln:route_errors_total": 0, "kiln:route_requests_total": 20}


def test_canary_rolls_back_on_injected_errors(tmp_path, caplog):
    canary = {"target": "m@2", "steps": [50, 100], "interval_s": 60, "min_requests": 5}
    repo = versioned_repository(tmp_path, routes={"r": {"targets": {"m@1": 1, "m@2": 0}, "canary": canary}},
                                fail_version=2)
    clock = [1000.0]

    async def main():
        plane = repository_plane(repo)
        plane.router.clock = lambda: clock[0]
        plane.load_routes()
        await plane.start()
        outcomes = []
        for _ in range(40):
            try:
                outcomes.append(served_version(await plane.infer(request())))
            except KilnError as exc:
                assert exc.http_status == 500 and "injected" in exc.message
                outcomes.append("error")
        clock[0] += 1  # well within the interval: errors roll back at once
        with caplog.at_level(logging.WARNING, logger="kiln.routes"):
            decisions = plane.router.tick()
        after = [served_version(await plane.infer(request())) for _ in range(30)]
        route = plane.router.route("r").describe()
        values = {name: metric(plane, name, route="r", target="m@2") for name in (
            "kiln:canary_rollback_total", "kiln:route_weight", "kiln:route_errors_total")}
        await plane.shutdown()
        return outcomes, decisions, after, route, values

    outcomes, decisions, after, route, values = run(main())
    assert outcomes.count("error") >= 5 and set(outcomes) <= {1, "error"}
    assert [d.kind for _, d in decisions] == ["rollback"]
    assert after == [1] * 30
    assert route["canary"]["state"] == "rolled_back" and route["canary"]["share"] == 0
    assert values["kiln:canary_rollback_total"] == 1 and values["kiln:route_weight"] == 0
    assert values["kiln:route_errors_total"] == outcomes.count("error")
    assert "canary m@2 rolled back to 0%" in caplog.text


def test_weight_changes_under_load_lose_no_request(tmp_path):
    repo = versioned_repository(tmp_path, routes={"r": {"targets": {"m@1": 1, "m@2": 1}}}, delay_ms=1)

    async def main():
        plane = await started(repo)
        stop = asyncio.Event()

        async def client(i):
            versions = []
            for j in range(40):
                versions.append(served_version(await plane.infer(request(), route_key=f"{i}-{j}")))
            return versions

        async def operator():
            weights = [{"m@1": 0, "m@2": 1}, {"m@1": 1, "m@2": 0}, {"m@1": 3, "m@2": 1}]
            changes = 0
            while not stop.is_set():
                plane.router.patch("r", weights[changes % len(weights)])
                changes += 1
                await asyncio.sleep(0.005)
            return changes

        changer = asyncio.create_task(operator())
        results = await asyncio.gather(*(client(i) for i in range(8)))
        stop.set()
        changes = await changer
        await plane.shutdown()
        return results, changes

    results, changes = run(main())
    served = [v for versions in results for v in versions]
    assert len(served) == 320 and set(served) == {1, 2}  # every request answered, both targets used
    assert changes >= 5


def test_a_request_in_flight_finishes_on_its_target_when_the_weights_change(tmp_path):
    repo = versioned_repository(tmp_path, routes={"r": {"targets": {"m@2": 1}}}, delay_ms=200)

    async def main():
        plane = await started(repo)
        in_flight = asyncio.create_task(plane.infer(request()))
        await asyncio.sleep(0.05)
        plane.router.patch("r", {"m@1": 1, "m@2": 0})
        later = await plane.infer(request())
        first = await in_flight
        await plane.shutdown()
        return first, later

    first, later = run(main())
    assert served_version(first) == 2 and served_version(later) == 1


def test_route_names_and_targets_are_checked_against_the_models(tmp_path):
    for i, (routes, message) in enumerate((
        ({"m": {"targets": {"m@1": 1}}}, "route 'm' has the name of a model"),
        ({"r": {"targets": {"nope": 1}}}, "target 'nope' names no served model"),
        ({"r": {"targets": {"m@7": 1}}}, r"serves versions \[1, 2\], not 7"),
    )):
        repo = versioned_repository(tmp_path / str(i), routes=routes, versions=(1, 2))
        with pytest.raises(ConfigError, match=message):
            repository_plane(repo).load_routes()


def test_kserve_on_a_route(tmp_path):
    repo = versioned_repository(tmp_path, routes={"r": {"targets": {"m@1": 0, "m@2": 1}}})

    async def main():
        plane = await started(repo)
        ready, config, versions = plane.model_ready("r"), plane.model_config("r"), plane.model_versions("r")
        with pytest.raises(InvalidRequestError, match="'r' is a route"):
            await plane.infer(request(version="2"))
        with pytest.raises(InvalidRequestError, match="'r' is a route"):  # ready said yes to any version
            plane.model_ready("r", "99")
        streamed = [r async for r in plane.stream_infer(request(), route_key="k")]
        with pytest.raises(ConfigError, match="is a route"):
            await plane.load_model("r")
        await plane.shutdown()
        return ready, config, versions, streamed

    ready, config, versions, streamed = run(main())
    assert ready and config.name == "r" and [i.name for i in config.inputs] == ["IN"] and versions == []
    (only,) = streamed
    assert served_version(only) == 2 and only.model_name == "r" and only.parameters[TARGET_PARAMETER] == "m@2"


def test_usage_and_cost_of_routed_traffic(tmp_path):
    repo = versioned_repository(tmp_path, routes={"r": {"targets": {"m@1": 1, "m@2": 1}}}, delay_ms=2)

    async def main():
        plane = await started(repo, price_per_hour=3.6)
        plane.costs.sample()
        responses = [await plane.infer(request()) for _ in range(40)]
        usage = plane._usage()
        text = generate_latest(plane.registry).decode()
        await plane.shutdown()
        return responses, usage, text

    responses, usage, text = run(main())
    for v in (1, 2):
        reading = usage[("m", str(v))]
        assert reading.requests == sum(served_version(r) == v for r in responses)
        assert reading.busy_s >= 0.002 * reading.requests  # each execution sleeps 2 ms
    assert 'kiln:cost_per_1k_requests_usd{model="m",version="1"}' in text
    assert 'kiln:route_cost_per_1k_requests_usd{route="r",target="m@2"}' in text
    assert "kiln:process_cpu_utilisation" in text


def test_price_scope_device_prices_each_gpu_found(tmp_path):
    plane = repository_plane(versioned_repository(tmp_path), price_per_hour=2.0, price_scope="device")
    plane.device_metrics.read = lambda: ["gpu0", "gpu1", "gpu2"]
    assert plane._server_price() == 6.0
    plane.device_metrics.read = None  # no GPU: the machine is one device
    assert plane._server_price() == 2.0
    server = repository_plane(versioned_repository(tmp_path / "s"), price_per_hour=2.0)
    server.device_metrics.read = lambda: ["gpu0", "gpu1"]
    assert server._server_price() == 2.0


def test_a_target_a_reload_removed_is_a_server_error_the_canary_counts_and_can_be_zeroed(tmp_path):
    # It was a 404 "unknown model" (a client error): the canary never rolled back, and the
    # PATCH to weight 0 was refused ("serves versions [1, 2], not 3").
    canary = {"target": "m@3", "steps": [50, 100], "interval_s": 60, "min_requests": 5}
    repo = versioned_repository(tmp_path, routes={"r": {"targets": {"m@1": 1, "m@3": 0}, "canary": canary}})
    config = versioned_config()
    config["version_policy"] = {"specific": [1, 2]}

    async def main():
        plane = await started(repo)
        await plane.load_model("m", {"config": config})
        statuses = []
        for _ in range(40):
            try:
                served_version(await plane.infer(request()))
                statuses.append(200)
            except KilnError as exc:
                assert "route target 'm@3' is not served now" in exc.message, exc.message
                statuses.append(exc.http_status)
        decisions = plane.router.tick()
        route = plane.router.patch("r", {"m@3": 0}).describe()
        after = {served_version(await plane.infer(request())) for _ in range(20)}
        await plane.shutdown()
        return statuses, decisions, route, after

    statuses, decisions, route, after = run(main())
    assert set(statuses) == {200, 503}
    assert [d.kind for _, d in decisions] == ["rollback"]
    assert route["canary"]["state"] == "stopped" and after == {1}


def test_one_target_down_neither_blocks_patching_the_others_nor_the_route_metadata(tmp_path):
    repo = versioned_repository(tmp_path, routes={"r": {"targets": {"m@1": 1, "m@2": 1, "m@3": 2}}})
    config = versioned_config()
    config["version_policy"] = {"specific": [1, 2]}

    async def main():
        plane = await started(repo)
        await plane.load_model("m", {"config": config})
        plane.router.patch("r", {"m@2": 10})  # was "target 'm@3' cannot take traffic"
        with pytest.raises(ConfigError, match=r"serves versions \[1, 2\], not 3"):
            plane.router.patch("r", {"m@3": 5})  # giving the removed target traffic still is refused
        meta = plane.model_config("r")  # was a 503 from m@3, the heaviest
        stats = plane.model_statistics("r")  # was a 404 "unknown model"
        await plane.shutdown()
        return meta, stats

    meta, stats = run(main())
    assert meta.name == "r"
    assert [(s.name, s.version) for s in stats] == [("m", "1"), ("m", "2")]


def test_the_shadow_copy_of_a_bad_request_is_not_a_shadow_error(tmp_path):
    # kiln:route_shadow_errors_total counted 4xx copies; route_errors_total does not count 4xx.
    repo = versioned_repository(tmp_path, routes={"r": {"targets": {"m@1": 1}, "shadow": {"m@2": 1.0}}})
    bad = InferRequest("r", {"NOPE": np.ones((1, 2), np.float32)})

    async def main():
        plane = await started(repo)
        for _ in range(5):
            with pytest.raises(InvalidRequestError):
                await plane.infer(bad)
        await shadows_done(plane, 5)
        out = {name: metric(plane, name, route="r") for name in (
            "kiln:route_shadow_requests_total", "kiln:route_shadow_errors_total", "kiln:route_errors_total",
            "kiln:route_shadow_latency_seconds_count")}
        await plane.shutdown()
        return out

    assert run(main()) == {"kiln:route_shadow_requests_total": 5, "kiln:route_shadow_errors_total": 0,
                           "kiln:route_errors_total": 0, "kiln:route_shadow_latency_seconds_count": 0}
