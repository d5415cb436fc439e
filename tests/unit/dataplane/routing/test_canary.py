"""The canary controller on a fake clock: its schedule, holds and rollbacks."""

import pytest

from kiln.dataplane.routing.canary import COMPLETE, ROLLED_BACK, RUNNING, STOPPED, CanaryController
from kiln.dataplane.routing.route import Route
from kiln.dataplane.routing.spec import CanarySpec, RouteSpec
from kiln.errors import ConfigError


def spec(**overrides) -> CanarySpec:
    fields = dict(target="m@2", steps=(10, 50, 100), interval_s=60, min_requests=5,
                  max_error_rate_increase=0.1, max_latency_ratio=2.0, latency_quantile=0.5)
    return CanarySpec(**{**fields, **overrides})


def feed(canary: CanaryController, n: int, *, canary_ok=True, baseline_ok=True, canary_s=0.1, baseline_s=0.1):
    for _ in range(n):
        canary.record("m@2", canary_ok, canary_s)
        canary.record("m@1", baseline_ok, baseline_s)


def test_steps_up_on_schedule_then_completes():
    c = CanaryController(spec(), now=0.0)
    assert c.state == RUNNING and c.share == 10
    feed(c, 5)
    assert c.tick(59.9) is None
    step = c.tick(60.0)
    assert step.kind == "step" and step.share == 50 and c.stage == 1
    assert c.canary.requests == 0  # each stage is judged on its own requests
    feed(c, 5)
    assert c.tick(119.0) is None
    done = c.tick(120.0)
    assert done.kind == "complete" and done.share == 100 and c.state == COMPLETE
    assert "no baseline" in done.reason
    feed(c, 50, canary_ok=False)
    assert c.tick(1000.0) is None and c.share == 100  # complete: no more judging


def test_completes_after_surviving_a_last_stage_below_100():
    c = CanaryController(spec(steps=(20, 40)), now=0.0)
    feed(c, 5)
    assert c.tick(60).kind == "step"
    feed(c, 5)
    decision = c.tick(120)
    assert decision.kind == "complete" and c.share == 40 and c.state == COMPLETE


def test_holds_without_enough_requests_and_reports_it_once():
    c = CanaryController(spec(), now=0.0)
    feed(c, 4)
    hold = c.tick(60.0)
    assert hold.kind == "hold" and hold.share == 10 and "canary 4, baseline 4" in hold.reason
    assert c.tick(61.0) is None and c.tick(300.0) is None
    feed(c, 1)
    assert c.tick(301.0).kind == "step"


def test_injected_errors_roll_back_at_once_without_waiting_for_the_interval():
    c = CanaryController(spec(), now=0.0)
    feed(c, 4, canary_ok=False)
    assert c.tick(1.0) is None  # 4 < min_requests: not judged yet
    feed(c, 1, canary_ok=False)
    decision = c.tick(2.0)
    assert decision.kind == "rollback" and decision.share == 0 and c.state == ROLLED_BACK
    assert "error rate 1.000 exceeds the baseline's 0.000" in decision.reason
    assert c.tick(100.0) is None and c.share == 0


def test_error_rate_within_the_allowed_increase_passes():
    c = CanaryController(spec(max_error_rate_increase=0.1), now=0.0)
    for i in range(20):  # canary 2/20 = 0.10 errors, baseline 1/20 = 0.05: +0.05 <= 0.1
        c.record("m@2", i not in (3, 7), 0.1)
        c.record("m@1", i != 5, 0.1)
    assert c.violation() is None
    assert c.tick(60).kind == "step"


def test_error_rate_exactly_at_the_allowed_increase_passes():
    # 0.07 - 0.05 is 0.020000000000000004 in floats: the default 0.02 rolled this canary back.
    for canary_errors, baseline_errors, n, limit in ((7, 5, 100, 0.02), (8, 6, 10, 0.2)):
        c = CanaryController(spec(max_error_rate_increase=limit), now=0.0)
        for i in range(n):
            c.record("m@2", i >= canary_errors, 0.1)
            c.record("m@1", i >= baseline_errors, 0.1)
        assert c.violation() is None, (canary_errors, baseline_errors, n, limit)
        c.record("m@2", False, 0.1)  # one more canary error: now above the limit
        assert "exceeds the baseline's" in c.violation()


def test_client_errors_count_as_requests_not_errors_nor_latency():
    c = CanaryController(spec(), now=0.0)
    for _ in range(5):
        c.record("m@2", True, None)
        c.record("m@1", True, 0.1)
    assert (c.canary.requests, c.canary.errors, list(c.canary.latencies)) == (5, 0, [])
    assert c.tick(60).kind == "step"  # judged on min_requests = 5 a side


def test_slow_canary_rolls_back_on_latency():
    c = CanaryController(spec(max_latency_ratio=2.0), now=0.0)
    feed(c, 5, canary_s=0.21, baseline_s=0.1)
    decision = c.tick(10.0)
    assert decision.kind == "rollback" and "2.10x the baseline's" in decision.reason


def test_latency_rule_can_be_off():
    c = CanaryController(spec(max_latency_ratio=None), now=0.0)
    feed(c, 5, canary_s=10.0, baseline_s=0.1)
    assert c.tick(60).kind == "step"


def test_quantile_is_nearest_rank():
    c = CanaryController(spec(), now=0.0)
    for s in (0.4, 0.1, 0.3, 0.2):
        c.record("m@2", True, s)
    assert c.canary.quantile(0.5) == 0.2 and c.canary.quantile(1.0) == 0.4 and c.canary.quantile(0.01) == 0.1


def test_route_weights_follow_the_canary_share():
    route = Route("chat", RouteSpec(targets={"m@1": 3, "x": 1, "m@2": 0},
                                    canary=spec(steps=(10, 50), min_requests=1)), now=0.0)
    assert route.weights() == pytest.approx({"m@1": 67.5, "x": 22.5, "m@2": 10.0})
    route.record(route.targets["m@2"], True, 0.1)
    route.record(route.targets["m@1"], True, 0.1)
    assert route.tick(60.0).kind == "step"
    assert route.weights() == pytest.approx({"m@1": 37.5, "x": 12.5, "m@2": 50.0})
    assert route.chooser.weights == pytest.approx({"m@1": 37.5, "x": 12.5, "m@2": 50.0})
    route.record(route.targets["m@2"], False, 0.1)
    route.record(route.targets["m@1"], True, 0.1)
    assert route.tick(61.0).kind == "rollback"
    assert route.weights() == pytest.approx({"m@1": 75.0, "x": 25.0, "m@2": 0.0})
    assert "m@2" not in route.chooser.weights


def test_manual_weights_stop_the_canary():
    route = Route("chat", RouteSpec(targets={"m@1": 1, "m@2": 0}, canary=spec()), now=0.0)
    route.set_weights({"m@2": 30})
    assert route.canary.state == STOPPED
    assert route.weights() == {"m@1": 90.0, "m@2": 30.0}
    feed(route.canary, 50, canary_ok=False)
    assert route.tick(1000.0) is None


@pytest.mark.parametrize("finish", ["rollback", "complete"])
def test_manual_weights_act_on_a_finished_canary_too(finish):
    # Rolled back (the docs: at 0 "until someone acts ... or PATCH its weights") or
    # complete, the canary's share overrode every later PATCH: a 200 that changed nothing.
    route = Route("chat", RouteSpec(targets={"m@1": 1, "m@2": 0}, canary=spec(steps=(50, 100), min_requests=1)),
                  now=0.0)
    feed(route.canary, 1, canary_ok=finish != "rollback")
    for now in (60.0, 120.0):
        route.tick(now)
    assert route.canary.state == (ROLLED_BACK if finish == "rollback" else COMPLETE)
    route.set_weights({"m@1": 1, "m@2": 3})
    assert route.canary.state == STOPPED and route.weights() == {"m@1": 1.0, "m@2": 3.0}
    assert route.chooser.weights == {"m@1": 1.0, "m@2": 3.0}


def test_a_canary_at_100_with_no_baseline_weight_left():
    # steps [100] completes at once; a baseline at weight 0 divided by zero on the next change.
    route = Route("c2", RouteSpec(targets={"fast": 1, "slow": 0}, canary=spec(target="slow", steps=(100,))), now=0.0)
    assert route.weights() == {"fast": 0.0, "slow": 100.0}
    route.set_weights({"slow": 100})
    assert route.weights() == {"fast": 0.0, "slow": 100.0} and route.canary.state == STOPPED
    with pytest.raises(ConfigError, match="cannot be both a target and a shadow"):
        Route("ab", RouteSpec(targets={"m@1": 1}, shadow={"m@3": 1.0}), now=0.0).set_weights({"m@3": 5})
