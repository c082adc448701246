"""pipetune's entries in TorchTitan's checkpoints, and what a checkpoint without them means.

``PipeTuneTrainer`` checkpoints through TorchTitan's ``CheckpointManager`` (DCP) with two entries of
its own: the data position (``dataloader``, ``PipeTuneTitanDataLoader.KEY`` inside it) and the
planner's learning (``LEARNED_KEY``: calibration, per-mbs correction, guard), a top-level entry of
its own (``LearnedState``) so that ``--checkpoint.exclude_from_loading`` can leave it out.

DCP loads strictly: a checkpoint written by another trainer or dataloader (TorchTitan's stock one,
``StockTrainer``) fails inside ``dcp.load`` with "Missing key in checkpoint state_dict: <key>".
``explain_missing_entry`` turns that into one line saying which of pipetune's entries is missing
and which ``exclude_from_loading`` starts it afresh; ``checked_load`` applies it to a
``CheckpointManager.load``.
"""

from __future__ import annotations

import functools
import pickle
import re
from typing import Callable

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.tools.logging import logger

from pipetune.serve.learner import Learned, Learner
from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader

LEARNED_KEY = "pipetune_learned"

_MISSING = re.compile(r"Missing key in checkpoint state_dict: ([\w.]+?)\.?(?:\s|$)")
_AFRESH = {
    f"dataloader.{PipeTuneTitanDataLoader.KEY}": ("pipetune data position", "dataloader", "the data stream starts at step 0"),
    f"{LEARNED_KEY}.state": ("pipetune learned state", LEARNED_KEY, "calibration, per-mbs correction and guard start afresh"),
}


class LearnedState(Stateful):
    """The learned-state entry: every replica lead's learning (``Learner.state_dict``) by replica,
    with what it was learnt on (``on``: latency table and layout, not the data-parallel degree),
    alike on every rank (one all-gather over ``group`` per checkpoint), so that a job of another
    degree can load it. On load each lead takes its replica's, or with fewer replicas saved
    replica ``r mod saved``'s, and hands it to ``apply``; learning of another table or layout is
    dropped, with one line."""

    def __init__(self, learner: Learner | None, *, on: dict, replica: int, replicas: int, group, apply: Callable[[Learned], None]):
        self.learner, self.on, self.replica, self.replicas, self.group, self.apply = learner, on, replica, replicas, group, apply

    def state_dict(self) -> dict:
        mine = self.learner.state_dict() if self.learner is not None else None
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (self.replica, mine) if self.learner is not None else None, group=self.group)
        replicas = [state for _, state in sorted(x for x in every if x is not None)]
        return {"state": pickle.dumps({"on": self.on, "replicas": replicas})}

    def load_state_dict(self, state_dict: dict) -> None:
        saved, rank0 = pickle.loads(state_dict["state"]), dist.get_rank() == 0
        if saved["on"] != self.on:
            if rank0:
                logger.warning("pipetune: learned state reset (calibration, per-mbs correction, guard): the checkpoint's was learnt on "
                               f"another {', '.join(k for k in self.on if saved['on'].get(k) != self.on[k])}")
            return
        if rank0 and len(saved["replicas"]) != self.replicas:
            logger.info(f"pipetune: learned state of {len(saved['replicas'])} replicas carried over to {self.replicas}: replica r takes "
                        f"replica r mod {len(saved['replicas'])}'s")
        taken = saved["replicas"][self.replica % len(saved["replicas"])]
        if self.learner is not None and taken is not None:
            self.apply(self.learner.load_state_dict(taken))


def explain_missing_entry(error: BaseException, checkpoint: str = "the checkpoint") -> ValueError | None:
    """A one-line error for DCP's refusal of a checkpoint without one of pipetune's entries (None
    for any other error)."""
    found = _MISSING.search(str(error))
    if found is None or found.group(1) not in _AFRESH:
        return None
    what, entry, then = _AFRESH[found.group(1)]
    return ValueError(f"{checkpoint} holds no {what} ({found.group(1)}): another trainer or dataloader wrote it. Resume with the "
                      f"one that wrote it, or leave the entry out (--checkpoint.exclude_from_loading {entry}): {then}")


def checked_load(load: Callable[..., bool], folder: str) -> Callable[..., bool]:
    """``CheckpointManager.load`` whose refusal of a checkpoint without pipetune's entries is ``explain_missing_entry``'s."""

    @functools.wraps(load)
    def checked(*args, **kwargs) -> bool:
        try:
            return load(*args, **kwargs)
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            explained = explain_missing_entry(e, f"the checkpoint in {folder}")
            if explained is None:
                raise
            raise explained from None

    return checked
