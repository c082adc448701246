"""The 2-core CPU testbed: what makes pipetune's predictions meet its measurements on a machine
whose pipeline ranks share two CPU cores, switched on by the testbed job configs
(``pipetune_configs.config_registry.*_testbed``) that the benchmarks run. None of it is needed on GPUs.

* ``trainer``: ``TestbedTrainer``, a ``PipeTuneTrainer`` whose steps also run measurement runs
  (serial twins, size twins, tuned twins, side-by-side replays of other jobs' plans) and which
  keeps a heap reserve so that steps do not pay page faults while the heap grows;
* ``runs``: which runs a step executes and in which order (pure functions);
* ``learning``: the testbed's record type and its learner, which measures the contention kappa
  and the per-call overhead on those runs (``pipetune.calibrate.pairs``); the benchmarks replay
  records through it as the trainer fed it.

See ``docs/calibration-on-cpu.md``.
"""
