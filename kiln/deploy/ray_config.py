"""Options of a Kiln deployment on Ray Serve (`kiln serve --ray`, or the
`serve run kiln.deploy.ray_serve:build` builder). Imports no Ray, so the
CLI can list them cheaply."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any

from kiln.config import ServerConfig, option
from kiln.errors import ConfigError

AUTOSCALING_POLICIES = ("ongoing", "kiln-hint")


@dataclass(frozen=True)
class RayServeConfig:
    ray_address: str | None = option(None, "Ray cluster to join (default: start a local one)")
    ray_app_name: str = option("kiln", "Ray Serve application name")
    ray_route_prefix: str = option("/", "HTTP route prefix of the application on Ray Serve's proxy")
    ray_min_replicas: int = option(1, "fewest replicas (0: scale to zero when idle)")
    ray_max_replicas: int = option(4, "most replicas")
    ray_initial_replicas: int | None = option(None, "replicas at start (default: the minimum)")
    ray_max_ongoing_requests: int | None = option(
        None, "most requests Ray sends one replica at once; more wait in Ray's queue (default: 2 x the target)"
    )
    ray_upscale_delay_s: float = option(30.0, "seconds the load must call for more replicas before they start")
    ray_downscale_delay_s: float = option(600.0, "seconds the load must call for fewer replicas before they stop")
    ray_look_back_period_s: float = option(30.0, "seconds over which Ray averages the load it scales on")
    ray_autoscaling_policy: str = option(
        "ongoing",
        "ongoing: Ray's policy on ongoing requests per replica (target: --autoscale-target-requests); "
        "kiln-hint: the sum of the replicas' kiln:desired_replicas",
        AUTOSCALING_POLICIES,
    )
    ray_replica_num_cpus: float = option(1.0, "CPUs Ray reserves per replica and per tensor/pipeline rank")
    ray_replica_num_gpus: float = option(0.0, "GPUs Ray reserves per replica and per tensor/pipeline rank")

    def __post_init__(self) -> None:
        if self.ray_min_replicas < 0:
            raise ConfigError("ray_min_replicas must be non-negative", param="ray_min_replicas")
        if self.ray_max_replicas < max(1, self.ray_min_replicas):
            raise ConfigError("ray_max_replicas must be at least 1 and at least ray_min_replicas",
                              param="ray_max_replicas")
        initial = self.ray_initial_replicas
        if initial is not None and not self.ray_min_replicas <= initial <= self.ray_max_replicas:
            raise ConfigError("ray_initial_replicas must lie between the minimum and the maximum",
                              param="ray_initial_replicas")
        if self.ray_max_ongoing_requests is not None and self.ray_max_ongoing_requests < 1:
            raise ConfigError("ray_max_ongoing_requests must be positive", param="ray_max_ongoing_requests")
        for name in ("ray_upscale_delay_s", "ray_downscale_delay_s", "ray_replica_num_cpus", "ray_replica_num_gpus"):
            if not 0 <= getattr(self, name) < math.inf:  # NaN and inf failed inside Ray, after it started
                raise ConfigError(f"{name} must be a non-negative number, got {getattr(self, name)}", param=name)
        if not 0 < self.ray_look_back_period_s < math.inf:
            raise ConfigError(f"ray_look_back_period_s must be a positive number, got {self.ray_look_back_period_s}",
                              param="ray_look_back_period_s")
        if self.ray_autoscaling_policy not in AUTOSCALING_POLICIES:
            raise ConfigError(f"ray_autoscaling_policy must be one of {AUTOSCALING_POLICIES}",
                              param="ray_autoscaling_policy")
        if not self.ray_route_prefix.startswith("/"):
            raise ConfigError("ray_route_prefix must start with '/'", param="ray_route_prefix")


HINT_METRIC = "kiln_desired_replicas"  # the replicas' record_autoscaling_stats key
HINT_POLICY = "kiln.deploy.ray_policy:desired_replicas_policy"


def deployment_options(ray: RayServeConfig, server: ServerConfig, world_size: int = 1) -> dict[str, Any]:
    """Keyword arguments of `serve.deployment(...).options(...)` for Kiln replicas.

    A replica runs every tensor/pipeline rank of its engine as a child
    process on its own node, so it holds one bundle with all their resources
    (STRICT_PACK): Ray then schedules nothing else on them, and on CUDA the
    replica sees every GPU its ranks use.
    """
    target = server.autoscale_target_requests
    autoscaling: dict[str, Any] = {
        "min_replicas": ray.ray_min_replicas,
        "max_replicas": ray.ray_max_replicas,
        "initial_replicas": ray.ray_initial_replicas,
        "target_ongoing_requests": target,
        "upscale_delay_s": ray.ray_upscale_delay_s,
        "downscale_delay_s": ray.ray_downscale_delay_s,
        "look_back_period_s": ray.ray_look_back_period_s,
    }
    if ray.ray_autoscaling_policy == "kiln-hint":
        autoscaling["policy"] = {"policy_function": HINT_POLICY}
    resources = {"CPU": ray.ray_replica_num_cpus * world_size, "GPU": ray.ray_replica_num_gpus * world_size}
    options: dict[str, Any] = {
        "autoscaling_config": autoscaling,
        "max_ongoing_requests": ray.ray_max_ongoing_requests or max(1, math.ceil(2 * target)),
        "graceful_shutdown_timeout_s": float(server.shutdown_timeout),
        "ray_actor_options": {"num_cpus": resources["CPU"], "num_gpus": resources["GPU"]},
    }
    if world_size > 1:
        options["placement_group_bundles"] = [{k: v for k, v in resources.items() if v > 0}]
        options["placement_group_strategy"] = "STRICT_PACK"
    return options


def typed_options(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """The fields of `cls` among `options`, strings converted to each field's type
    (`serve run module:build key=value` passes every value as a string)."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    return {key: _convert(key, value, hints[key]) for key, value in options.items() if key in names}


def _convert(name: str, value: Any, hint: Any) -> Any:
    if not isinstance(value, str):
        return value
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if type(None) in typing.get_args(hint) and value.lower() in ("none", "null", ""):
        return None
    kind = kinds[0]
    try:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes", "on")
        return kind(value)
    except ValueError:
        raise ConfigError(f"{name} must be {kind.__name__}, got {value!r}", param=name) from None
