"""``Mode``: which planner made a plan (the paper's ablation, see ``pipetune.plan.search.planner``).

It lives apart from the planner because every ``IterationPlan`` carries it: the runtime, the
guard and the step records read it without importing the search."""

from enum import StrEnum


class Mode(StrEnum):
    ORIGINAL = "original"
    BALANCED = "balanced"
    REORDER = "reorder"
    PIPETUNE = "pipetune"
