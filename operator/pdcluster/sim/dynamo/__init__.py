"""NVIDIA Dynamo's SLA planner, re-implemented as a baseline for the fleet simulator:
throughput-based (`Dynamo`, throughput.py) and with its load-based mode on top
(`DynamoLoad`, load.py); its load predictors are in predictors.py."""

from __future__ import annotations

from pdcluster.sim.dynamo.load import (
    INDEPENDENT,
    UP_EITHER_DOWN_BOTH,
    DynamoLoad,
    LoadRegression,
    one_step,
)
from pdcluster.sim.dynamo.predictors import PREDICTORS, ArimaPredictor, ConstantPredictor
from pdcluster.sim.dynamo.throughput import DecodeInterpolator, Dynamo

__all__ = [
    "INDEPENDENT",
    "PREDICTORS",
    "UP_EITHER_DOWN_BOTH",
    "ArimaPredictor",
    "ConstantPredictor",
    "DecodeInterpolator",
    "Dynamo",
    "DynamoLoad",
    "LoadRegression",
    "one_step",
]
