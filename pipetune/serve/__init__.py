"""Serving plans to a running job: the planner in its own process (``async_planner``,
``plan_worker``), the plan each step runs (``plan_source``), what the job learns from its steps
(``learner``) and the guard that falls back to the baseline."""
