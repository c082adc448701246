"""Packed micro-batches -> stage latencies and memory: latency tables, presets, the cost model."""

from pipetune.cost.analytical import analytical_table
from pipetune.cost.cost_model import CostModel, MicroBatchShapes, StageCosts
from pipetune.cost.latency_table import LatencyTable, LatencyTableError, load_latency_table
from pipetune.cost.stage_layout import StageLayout

__all__ = [
    "CostModel",
    "LatencyTable",
    "LatencyTableError",
    "MicroBatchShapes",
    "StageCosts",
    "StageLayout",
    "analytical_table",
    "load_latency_table",
]
