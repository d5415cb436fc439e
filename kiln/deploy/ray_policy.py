"""Ray Serve autoscaling policy on Kiln's own hint (`--ray-autoscaling-policy kiln-hint`).

Each replica reports its kiln:desired_replicas (record_autoscaling_stats);
replicas see shares of one traffic, so the deployment needs their sum. Ray
averages each replica's reports over look_back_period_s, then applies the
replica bounds, the up/down delays and the rounding up. Before any replica
reported, it falls back to Ray's rule: ongoing requests / target per replica.
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingContext

from kiln.deploy.ray_config import HINT_METRIC


def desired_replicas_policy(ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
    reports = (ctx.aggregated_metrics or {}).get(HINT_METRIC)
    if reports:
        return float(sum(reports.values())), {}
    target = ctx.config.get_target_ongoing_requests() if ctx.config is not None else 1.0
    return ctx.total_num_requests / target, {}
