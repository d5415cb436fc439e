"""Ray Serve deployment options, the `serve run` builder's arguments, and the
kiln-hint autoscaling policy (no cluster needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kiln.config import ServerConfig
from kiln.deploy.ray_config import HINT_METRIC, HINT_POLICY, RayServeConfig, deployment_options, typed_options
from kiln.errors import ConfigError, KilnError


def test_autoscaling_options_come_from_kiln_options():
    ray = RayServeConfig(ray_min_replicas=2, ray_max_replicas=6, ray_upscale_delay_s=5, ray_downscale_delay_s=90)
    server = ServerConfig(autoscale_target_requests=4, shutdown_timeout=45)
    options = deployment_options(ray, server)
    assert options["autoscaling_config"] == {
        "min_replicas": 2, "max_replicas": 6, "initial_replicas": None, "target_ongoing_requests": 4,
        "upscale_delay_s": 5, "downscale_delay_s": 90, "look_back_period_s": 30.0,
    }
    assert options["max_ongoing_requests"] == 8  # 2 x the target
    assert options["graceful_shutdown_timeout_s"] == 45.0  # Ray drains a replica as long as kiln serve would
    assert "placement_group_bundles" not in options


def test_a_parallel_engine_holds_every_rank_in_one_bundle():
    ray = RayServeConfig(ray_replica_num_cpus=2, ray_replica_num_gpus=1)
    options = deployment_options(ray, ServerConfig(), world_size=4)
    assert options["ray_actor_options"] == {"num_cpus": 8, "num_gpus": 4}
    assert options["placement_group_bundles"] == [{"CPU": 8, "GPU": 4}]
    assert options["placement_group_strategy"] == "STRICT_PACK"


def test_ray_accepts_the_options():
    serve = pytest.importorskip("ray.serve")
    from kiln.deploy.ray_serve import KilnReplica

    ray = RayServeConfig(ray_autoscaling_policy="kiln-hint", ray_initial_replicas=2)
    options = deployment_options(ray, ServerConfig(), world_size=2)
    deployment = serve.deployment(KilnReplica).options(name="kiln", **options)
    config = deployment._deployment_config.autoscaling_config
    assert (config.min_replicas, config.initial_replicas, config.max_replicas) == (1, 2, 4)
    assert config.policy.policy_function == HINT_POLICY


@pytest.mark.parametrize("bad", [
    {"ray_min_replicas": -1}, {"ray_max_replicas": 0}, {"ray_min_replicas": 3, "ray_max_replicas": 2},
    {"ray_initial_replicas": 9}, {"ray_max_ongoing_requests": 0}, {"ray_upscale_delay_s": -1},
    {"ray_look_back_period_s": 0}, {"ray_autoscaling_policy": "cpu"}, {"ray_route_prefix": "v1"},
])
def test_bad_ray_options_are_config_errors(bad):
    with pytest.raises(ConfigError):
        RayServeConfig(**bad)


def test_serve_run_arguments_are_typed_from_strings():
    args = {"ray_max_replicas": "6", "ray_upscale_delay_s": "2.5", "ray_initial_replicas": "none", "port": "9000"}
    assert typed_options(RayServeConfig, args) == {
        "ray_max_replicas": 6, "ray_upscale_delay_s": 2.5, "ray_initial_replicas": None,
    }
    assert typed_options(ServerConfig, {"strict_readiness": "false", "port": "9000"}) == {
        "strict_readiness": False, "port": 9000,
    }
    with pytest.raises(ConfigError, match="ray_max_replicas must be int"):
        typed_options(RayServeConfig, {"ray_max_replicas": "many"})


def test_the_builder_refuses_unknown_keys_and_builds_an_application(tmp_path):
    pytest.importorskip("ray.serve")
    from kiln.deploy.ray_serve import build

    with pytest.raises(KilnError, match="max_replica"):
        build({"max_replica": "3"})
    app = build({"model": str(tmp_path), "kv_cache_memory_gib": "0.05", "ray_max_replicas": "2"})
    deployment = app._bound_deployment
    server, llm = deployment.init_args
    assert llm.model.model == str(tmp_path) and llm.cache.kv_cache_memory_gib == 0.05
    assert server.grpc_port is None  # the replica turns gRPC off itself
    assert deployment._deployment_config.autoscaling_config.max_replicas == 2


def context(reports: dict | None, ongoing: float = 0.0, target: float = 2.0):
    config = SimpleNamespace(get_target_ongoing_requests=lambda: target)
    return SimpleNamespace(aggregated_metrics={HINT_METRIC: reports} if reports is not None else {},
                           total_num_requests=ongoing, config=config)


def test_the_hint_policy_sums_the_replicas_hints():
    from kiln.deploy.ray_policy import desired_replicas_policy

    assert desired_replicas_policy(context({"r1": 1.25, "r2": 0.5, "r3": 0.75})) == (2.5, {})


def test_the_hint_policy_falls_back_to_ongoing_requests_before_any_report():
    from kiln.deploy.ray_policy import desired_replicas_policy

    assert desired_replicas_policy(context(None, ongoing=7, target=2)) == (3.5, {})
