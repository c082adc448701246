"""Which layout a job runs and which planner plans it: the planner's settings (``PlannerConfig``,
whose ``build`` picks the planner for a layout), the stage-layout search, and the fixed
configurations pipetune is compared with."""
