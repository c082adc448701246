"""Planning one iteration, by concern: the plan itself (``plan``: ``IterationPlan``, the IR the
runtime executes; ``mode``), the per-iteration search (``search``), DIP's separated layout
(``separated``), which layout and planner a job runs and the fixed baselines (``layout``), and the
split of a global batch over data-parallel replicas (``data_parallel``). Serving plans to a running
job is ``pipetune.serve``."""

from pipetune.plan.mode import Mode
from pipetune.plan.plan import IterationPlan, PlanError

__all__ = ["IterationPlan", "Mode", "PlanError"]
