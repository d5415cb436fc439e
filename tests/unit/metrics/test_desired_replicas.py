"""The desired-replicas hint: exact values on deterministic load, and a
closed-loop queue trace (ramps, steps, bursts, idle) that must neither flap
nor lag beyond the bounds docs/scaling.md states."""

from __future__ import annotations

import math

import pytest

from kiln.metrics.desired_replicas import DesiredReplicas, HintConfig, LoadSample
from tests.unit.metrics.queue_sim import Cluster, Phase, changes, episodes, first_time


def steady(hint: DesiredReplicas, seconds: int, rate: int, service_s: int, start: float = 0.0) -> float:
    """Feed `seconds` of a steady load: `rate` arrivals/s, each in service `service_s` seconds, no queue."""
    arrivals = finished = 0
    for t in range(seconds + 1):
        arrivals = rate * t
        finished = max(0, rate * (t - service_s))
        hint.update(LoadSample(start + t, arrivals, finished, finished * service_s, 0, arrivals - finished))
    return hint.value


def test_steady_load_gives_littles_law():
    # 4 requests/s, 2 s each: 8 in service; target 8 per replica -> exactly 1 replica.
    hint = DesiredReplicas(HintConfig(target_requests=8, smoothing_s=5, downscale_window_s=0))
    assert steady(hint, 300, rate=4, service_s=2) == pytest.approx(1.0, rel=1e-3)
    assert hint.smoothed.service_s() == pytest.approx(2.0, rel=1e-3)
    assert hint.smoothed.arrival_rate == pytest.approx(4.0, rel=1e-6)


def test_target_scales_the_hint():
    hint = DesiredReplicas(HintConfig(target_requests=2, smoothing_s=5, downscale_window_s=0))
    assert steady(hint, 300, rate=4, service_s=2) == pytest.approx(4.0, rel=1e-3)


def test_backlog_adds_what_drains_it_in_time():
    config = HintConfig(target_requests=8, smoothing_s=5, downscale_window_s=0, backlog_drain_s=10)
    hint = DesiredReplicas(config)
    steady(hint, 300, rate=4, service_s=2)
    # 40 more wait in the queue for a long time (no new arrivals beyond the steady ones):
    for t in range(301, 601):
        arrivals, finished = 4 * t + 40, 4 * (t - 2)
        hint.update(LoadSample(t, arrivals, finished, finished * 2, 40, arrivals - finished))
    # (4 + 40 / 10) req/s * 2 s / 8 = 2 replicas
    assert hint.raw == pytest.approx(2.0, rel=1e-2)


def test_before_anything_finishes_in_flight_per_target():
    hint = DesiredReplicas(HintConfig(target_requests=4, smoothing_s=1, downscale_window_s=0))
    for t in range(60):
        hint.update(LoadSample(t, 12, 0, 0.0, 4, 12))
    assert hint.smoothed.service_s() is None
    assert hint.value == pytest.approx(12 / 4, rel=1e-3)


def test_hint_falls_only_after_the_window():
    hint = DesiredReplicas(HintConfig(target_requests=8, smoothing_s=2, downscale_window_s=30))
    high = steady(hint, 100, rate=8, service_s=2)
    assert high == pytest.approx(2.0, rel=1e-2)
    # Load stops at t=100: raw drops at once, the hint holds for the window.
    for t in range(101, 131):
        hint.update(LoadSample(t, 800, 800, 1600.0, 0, 0))
        assert hint.value >= high * 0.999, t
    for t in range(131, 160):
        hint.update(LoadSample(t, 800, 800, 1600.0, 0, 0))
    assert hint.value < 0.01


def test_a_reloaded_model_restarts_its_totals():
    hint = DesiredReplicas(HintConfig(target_requests=8, smoothing_s=5, downscale_window_s=0))
    steady(hint, 200, rate=4, service_s=2)
    # Totals restart near zero (a new model version), the load goes on.
    value = steady(hint, 200, rate=4, service_s=2, start=201)
    assert value == pytest.approx(1.0, rel=1e-2)
    assert hint.smoothed.arrival_rate < 5  # no negative or huge rate from the reset


@pytest.mark.parametrize("field", ["target_requests", "smoothing_s", "backlog_drain_s"])
def test_config_rejects_non_positive(field):
    with pytest.raises(ValueError, match=field):
        HintConfig(**{field: 0})


# ---- the closed-loop trace ------------------------------------------------------

SERVICE_S, SLOTS = 2.0, 8
CONFIG = HintConfig(target_requests=SLOTS, smoothing_s=10, downscale_window_s=60, backlog_drain_s=30)
TRACE = [
    Phase(60, 0.5),  # idle
    Phase(60, 0.5, end_rate=10.0),  # ramp
    Phase(240, 10.0),  # steady: needs ceil(10 * 2 / 8) = 3
    Phase(120, 0.5),  # step down to idle
    Phase(120, 0.5, burst=30),  # one burst of 30 requests at once
    Phase(180, 14.0),  # step up: needs ceil(14 * 2 / 8) = 4
    Phase(200, 2.0),  # step down: needs 1
    Phase(120, 0.0),  # nothing at all
]
STARTS = [sum(p.seconds for p in TRACE[:i]) for i in range(len(TRACE))]


def need(rate: float) -> int:
    return max(1, math.ceil(rate * SERVICE_S / SLOTS))


@pytest.fixture(scope="module", params=range(5), ids=lambda s: f"seed{s}")
def trace(request):
    return Cluster(service_s=SERVICE_S, slots=SLOTS, startup_s=15.0, hint=CONFIG, seed=request.param).run(TRACE)


def at(ticks, start: float, end: float):
    return [k for k in ticks if start <= k.t < end]


def test_no_decrease_within_a_window_of_an_increase(trace):
    moves = changes(trace)
    for (t0, a0, b0), (t1, a1, b1) in zip(moves, moves[1:], strict=False):
        if b0 > a0 and b1 < a1:
            assert t1 - t0 >= CONFIG.downscale_window_s, (t0, t1)


def test_one_scaling_move_per_change_of_load_at_most(trace):
    # 7 changes of load (idle, ramp, steady, step, burst, step, step, stop): up or down once
    # each, plus at most one correction inside the long steady phase.
    assert episodes(trace) <= len(TRACE)


def test_steady_phase_settles_at_what_it_needs(trace):
    settled = STARTS[2] + CONFIG.downscale_window_s + 3 * CONFIG.smoothing_s
    wanted = {k.wanted for k in at(trace, settled, STARTS[3])}
    assert wanted <= {need(10.0), need(10.0) + 1}
    assert len(changes(at(trace, settled, STARTS[3]))) <= 2


def test_step_up_reaches_its_need_within_two_smoothing_times(trace):
    lag = first_time(trace, STARTS[5], lambda k: k.wanted >= need(14.0))
    assert lag is not None and lag <= 2 * CONFIG.smoothing_s
    assert max(k.wanted for k in at(trace, STARTS[5], STARTS[6])) <= need(14.0) + 2  # bounded overshoot


def test_step_down_follows_within_window_plus_four_smoothing_times(trace):
    bound = CONFIG.downscale_window_s + 4 * CONFIG.smoothing_s
    for phase in (3, 6):
        lag = first_time(trace, STARTS[phase], lambda k, p=phase: k.wanted <= need(TRACE[p].rate))
        assert lag is not None and lag <= bound, (phase, lag)


def test_a_burst_one_replica_absorbs_scales_nothing(trace):
    # 30 requests at once = 30 * 2 s of work: one replica of 8 slots drains it in 8 s.
    assert {k.wanted for k in at(trace, STARTS[4] + CONFIG.downscale_window_s + 10, STARTS[5])} == {1}
    assert max(k.wanted for k in at(trace, STARTS[4], STARTS[5])) == 1


def test_idle_goes_to_the_minimum(trace):
    assert trace[-1].wanted == 1 and trace[-1].hint < 0.05


@pytest.mark.parametrize(("option", "value"), [
    ("autoscale_downscale_window_s", float("nan")),  # accepted: the hint then never came down
    ("autoscale_smoothing_s", float("inf")),
    ("shutdown_timeout", float("nan")),
    ("timeout_idle_s", float("inf")),
    ("timeout_body_s", float("nan")),
])
def test_server_options_refuse_nan_and_infinity(option, value):
    from kiln.config import ServerConfig
    from kiln.errors import ConfigError
    with pytest.raises(ConfigError, match=f"{option} must be a"):
        ServerConfig(**{option: value})
