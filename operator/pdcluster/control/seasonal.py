"""The seasonal forecast in the laws: per role, the demand seen by time of day
(forecast.py), and how much more of it the forecast expects one engine start-up ahead.

The horizon is the role's start-up (measured, else the default; context.py) plus half a
metrics window, the lag of what the law sees: engines asked for now serve the load of
then. With no memory of the hours ahead (the first day) the growth is 1 and the law is
as reactive as without a forecast. A forecast never shrinks a need: a falling load is
left to the scale-down's own evidence.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdcluster.api.v1alpha1 import SeasonalMemory
from pdcluster.control.context import Context, Role
from pdcluster.control.forecast import SeasonalForecast

# A day moves 2.6-11x over hours (docs/benchmarks.md); within one start-up far less. A
# larger factor is a memory of a burst, not of a day's shape.
MAX_AHEAD = 3.0

Forecasts = dict[Role, SeasonalForecast]


def load_forecasts(ctx: Context, roles: Iterable[Role]) -> Forecasts:
    kept = ctx.prev.forecast or {}
    return {r: SeasonalForecast.from_status(kept.get(r.value)) for r in roles}


def observed(ctx: Context, forecasts: Forecasts, demand: dict[Role, float]) -> Forecasts:
    """The forecasts with this run's demand added (copies: the inputs stay as read)."""
    out = {}
    for role, kept in forecasts.items():
        fresh = SeasonalForecast(list(kept.profile), kept.bucket, kept.total, kept.samples, kept.first)
        fresh.observe(ctx.now.timestamp(), demand[role])
        out[role] = fresh
    return out


def horizon_s(ctx: Context, role: Role) -> float:
    return ctx.startup_s(role) + ctx.auto.window_seconds / 2.0


def ahead(ctx: Context, forecasts: Forecasts, demand: dict[Role, float]) -> dict[Role, float]:
    """Per role: the most demand the forecast expects within its horizon over the demand
    now, at least 1 (1 without memory of the horizon)."""
    out = {}
    for role, forecast in forecasts.items():
        now = demand[role]
        predicted = forecast.predict(ctx.now.timestamp(), horizon_s(ctx, role), now) if now > 0 else None
        out[role] = 1.0 if predicted is None else min(max(predicted / now, 1.0), MAX_AHEAD)
    return out


def forecast_status(forecasts: Forecasts) -> dict[str, SeasonalMemory] | None:
    return {r.value: f.to_status() for r, f in forecasts.items()} or None
