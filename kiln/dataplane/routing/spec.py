"""The routes file (`routes.yaml` beside the models) and the admin API's
bodies: frozen pydantic models, unknown keys rejected.

    routes:
      chat:
        targets: {smollm2@1: 90, smollm2@2: 10}   # target -> relative weight (>= 0)
        shadow: {smollm2@3: 1.0}                   # target -> fraction of requests copied
        canary:                                    # optional; see canary.py
          target: smollm2@2
          steps: [5, 25, 50, 100]                  # percent of the route's traffic, stage by stage
          interval_s: 300

A spec that validates here is consistent in itself; whether its targets
exist is checked against the served models (`validate.py`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.config_text import load_yaml
from kiln.dataplane.routing.target import Target
from kiln.errors import ConfigError
from kiln.serving.repository.config import NAME_RE, format_validation_error

ROUTES_FILE = "routes.yaml"
MAX_ROUTES_BYTES = 1 << 20
MAX_WEIGHT = 1e6


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _targets(value: dict[str, Any], what: str) -> dict[str, float]:
    out = {}
    for text, number in value.items():
        try:
            target = str(Target.parse(text))
        except ConfigError as exc:
            raise ValueError(exc.message) from None
        if target in out:  # "dbl@1" and "dbl@01": one weight would silently win
            raise ValueError(f"{text!r} names the same target as another entry ({target!r}): give each once")
        out[target] = _number(number, f"the {what} of {text!r}")
    return out


class CanarySpec(_Frozen):
    """Step `target`'s share of traffic through `steps` (percent), one stage
    per `interval_s`, while it stays within bounds of the baseline (the
    route's other targets); back to 0 when it does not."""

    target: str
    steps: tuple[float, ...] = Field(min_length=1, max_length=100)
    interval_s: float = Field(default=300.0, gt=0, le=7 * 86400)
    min_requests: int = Field(default=20, ge=1)
    max_error_rate_increase: float = Field(default=0.02, ge=0, le=1)
    max_latency_ratio: float | None = Field(default=1.5, gt=0)
    latency_quantile: float = Field(default=0.9, gt=0, le=1)

    @field_validator("target")
    @classmethod
    def _target(cls, value: str) -> str:
        try:
            return str(Target.parse(value))
        except ConfigError as exc:
            raise ValueError(exc.message) from None

    @field_validator("steps")
    @classmethod
    def _steps(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0 < s <= 100 for s in value):
            raise ValueError("canary steps are percents in (0, 100]")
        if any(b <= a for a, b in zip(value, value[1:], strict=False)):
            raise ValueError("canary steps must increase")
        return value


class RouteSpec(_Frozen):
    targets: dict[str, Any] = Field(min_length=1, max_length=64)
    shadow: dict[str, Any] = Field(default={}, max_length=8)
    canary: CanarySpec | None = None

    @field_validator("targets")
    @classmethod
    def _weights(cls, value: dict[str, Any]) -> dict[str, float]:
        weights = _targets(value, "weight")
        if any(not 0 <= w <= MAX_WEIGHT for w in weights.values()):
            raise ValueError(f"weights must be in [0, {MAX_WEIGHT:g}]")
        return weights

    @field_validator("shadow")
    @classmethod
    def _fractions(cls, value: dict[str, Any]) -> dict[str, float]:
        fractions = _targets(value, "fraction")
        if any(not 0 < f <= 1 for f in fractions.values()):
            raise ValueError("a shadow fraction (the share of requests copied) must be in (0, 1]")
        return fractions

    @model_validator(mode="after")
    def _consistent(self) -> RouteSpec:
        both = sorted(set(self.targets) & set(self.shadow))
        if both:
            raise ValueError(f"{both} cannot be both a target and a shadow of one route")
        canary = self.canary
        if canary is None:
            if not any(w > 0 for w in self.targets.values()):
                raise ValueError("at least one target needs a positive weight")
            return self
        if canary.target not in self.targets:
            raise ValueError(f"the canary target {canary.target!r} must be one of the route's targets")
        if not any(w > 0 for t, w in self.targets.items() if t != canary.target):
            raise ValueError("a canary needs a baseline: another target with a positive weight")
        return self


class WeightsPatch(_Frozen):
    """PATCH /admin/routes/{name}: new weights of some targets (others keep theirs)."""

    weights: dict[str, Any] = Field(min_length=1, max_length=64)

    @field_validator("weights")
    @classmethod
    def _weights(cls, value: dict[str, Any]) -> dict[str, float]:
        weights = _targets(value, "weight")
        if any(not 0 <= w <= MAX_WEIGHT for w in weights.values()):
            raise ValueError(f"weights must be in [0, {MAX_WEIGHT:g}]")
        return weights


class RoutesFile(_Frozen):
    routes: dict[str, RouteSpec] = {}

    @field_validator("routes", mode="before")
    @classmethod
    def _empty(cls, value: Any) -> Any:
        return {} if value is None else value  # `routes:` with nothing under it: no routes

    @field_validator("routes")
    @classmethod
    def _names(cls, value: dict[str, RouteSpec]) -> dict[str, RouteSpec]:
        for name in value:
            check_route_name_value(name)
        return value


def check_route_name_value(name: str) -> None:
    if not NAME_RE.match(name) or ".." in name:
        raise ValueError(f"invalid route name {name!r}: use letters, digits, '_', '-', '.'")


def check_route_name(name: str) -> str:
    try:
        check_route_name_value(name)
    except ValueError as exc:
        raise ConfigError(str(exc), param="name") from None
    return name


def parse_route(data: Any, name: str) -> RouteSpec:
    check_route_name(name)
    try:
        return RouteSpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid route '{name}': {format_validation_error(exc)}") from None


def parse_weights(data: Any) -> dict[str, float]:
    try:
        return dict(WeightsPatch.model_validate(data).weights)
    except ValidationError as exc:
        raise ConfigError(f"invalid weights: {format_validation_error(exc)}") from None


def parse_routes(data: Any, source: str = ROUTES_FILE) -> dict[str, RouteSpec]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must be a mapping with a 'routes' key, got {type(data).__name__}")
    try:
        return dict(RoutesFile.model_validate(data).routes)
    except ValidationError as exc:
        raise ConfigError(f"invalid {source}: {format_validation_error(exc)}") from None


def read_routes_file(path: Path) -> dict[str, RouteSpec]:
    """The routes of a routes.yaml; ConfigError naming every problem."""
    if not path.is_file():
        raise ConfigError(f"routes file {str(path)!r} does not exist")
    if path.stat().st_size > MAX_ROUTES_BYTES:
        raise ConfigError(f"{path.name} is larger than {MAX_ROUTES_BYTES} bytes")
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path.name} is not valid YAML: {exc}") from None
    return parse_routes(data, path.name)
