"""Dynamo's load predictors (load_predictor.py): what the throughput planner expects the
next interval's request count, ISL and OSL to be."""

from __future__ import annotations

import math

import numpy as np


class ConstantPredictor:
    """Next value = last value (Dynamo's ConstantPredictor, with BasePredictor's data rules)."""

    minimum_points = 1

    def __init__(self) -> None:
        self.data: list[float] = []
        self._seen_nonzero = False

    def add(self, value: float) -> None:
        value = 0.0 if value is None or math.isnan(value) else float(value)
        # Leading zeros (an idle deployment) are skipped until traffic shows up.
        if value == 0.0 and not self._seen_nonzero:
            return
        self._seen_nonzero = True
        self.data.append(value)

    def last(self) -> float:
        return self.data[-1] if self.data else 0.0

    def predict(self) -> float:
        return self.last()


class ArimaPredictor(ConstantPredictor):
    """Auto-ARIMA(p, d, 0), p in 0..2, d in 0..1, picked by AIC, fitted by least squares.

    Like Dynamo's ARIMAPredictor: fewer than 5 points or a constant series return the
    last value, forecasts are clipped at 0, and a failed fit falls back to the last
    value. Unlike pmdarima's auto_arima it fits no moving-average terms.
    """

    minimum_points = 5
    window = 50

    def predict(self) -> float:
        y = np.asarray(self.data[-self.window :], dtype=float)
        if len(y) < self.minimum_points or np.all(y == y[0]):
            return self.last()
        try:
            forecast = _auto_arima_forecast(y)
        except (np.linalg.LinAlgError, ValueError):
            return self.last()
        return max(0.0, forecast) if math.isfinite(forecast) else self.last()


def _auto_arima_forecast(y: np.ndarray) -> float:
    best: tuple[float, float] | None = None
    skip = 3  # the same fitted span for every order, so AICs compare
    for d in (0, 1):
        series = np.diff(y, n=d) if d else y
        for p in (0, 1, 2):
            rows = len(series) - max(p, skip - d)
            if rows < p + 2:
                continue
            target = series[-rows:]
            columns = [np.ones(rows)] + [series[-rows - k : len(series) - k] for k in range(1, p + 1)]
            x = np.column_stack(columns)
            coef, *_ = np.linalg.lstsq(x, target, rcond=None)
            rss = float(np.sum((target - x @ coef) ** 2))
            aic = rows * math.log(max(rss / rows, 1e-12)) + 2 * (p + 1)
            nxt = coef[0] + sum(coef[k] * series[-k] for k in range(1, p + 1))
            forecast = float(y[-1] + nxt) if d else float(nxt)
            if best is None or aic < best[0]:
                best = (aic, forecast)
    if best is None:
        raise ValueError("too few points")
    return best[1]


PREDICTORS = {"constant": ConstantPredictor, "arima": ArimaPredictor}
