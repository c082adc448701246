"""Per-iteration planning: search, iteration plans, asynchronous planning."""

from pipetune.plan.plan import IterationPlan, PlanError
from pipetune.plan.search import Mode, Planner, PlannerConfig

__all__ = ["IterationPlan", "Mode", "PlanError", "Planner", "PlannerConfig"]
