"""Per-iteration planning: search, iteration plans, asynchronous planning."""

from pipetune.plan.mode import Mode
from pipetune.plan.plan import IterationPlan, PlanError
from pipetune.plan.planner import Planner
from pipetune.plan.planner_config import PlannerConfig

__all__ = ["IterationPlan", "Mode", "PlanError", "Planner", "PlannerConfig"]
