"""A pipetune TorchTitan job whose tuned plans are slowed down on purpose (``--module
titan_slowed_job --config slowed_muse_glimmer_mm``): every stage forward of a ``pipetune`` plan
sleeps ``slow_s`` while the batch step is in ``[slow_from, slow_to)``; baseline plans run at full
speed. The guard test uses it to check that the guard notices and comes back."""

import dataclasses
import time
from dataclasses import dataclass

from pipetune.plan import Mode
from pipetune_configs import config_registry
from torchtitan_patches.trainer import PipeTuneTrainer


class SlowedTrainer(PipeTuneTrainer):
    @dataclass(kw_only=True, slots=True)
    class Config(PipeTuneTrainer.Config):
        slow_from: int = 0
        slow_to: int = 0
        slow_s: float = 0.0

    def _build_pipetune(self, config):
        super()._build_pipetune(config)
        self.slowed = False
        stage, run = self.executor.stages[self.stage], self.executor.run

        def forward(*args, _forward=stage.forward, **kwargs):
            if self.slowed:
                time.sleep(config.slow_s)
            return _forward(*args, **kwargs)

        def slowed_run(batch, plan):
            self.slowed = plan.mode is Mode.PIPETUNE and config.slow_from <= batch.step < config.slow_to
            return run(batch, plan)

        stage.forward = forward
        self.executor.run = slowed_run


def slowed_muse_glimmer_mm() -> SlowedTrainer.Config:
    base = config_registry.muse_glimmer_mm()
    return SlowedTrainer.Config(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
