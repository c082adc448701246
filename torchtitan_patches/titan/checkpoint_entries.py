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
import re
from typing import Callable

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan_patches.titan.dataloader import PipeTuneTitanDataLoader

LEARNED_KEY = "pipetune_learned"

_MISSING = re.compile(r"Missing key in checkpoint state_dict: ([\w.]+?)\.?(?:\s|$)")
_AFRESH = {
    f"dataloader.{PipeTuneTitanDataLoader.KEY}": ("pipetune data position", "dataloader", "the data stream starts at step 0"),
    f"{LEARNED_KEY}.state": ("pipetune learned state", LEARNED_KEY, "calibration, per-mbs correction and guard start afresh"),
}


class LearnedState(Stateful):
    """The learned-state entry: ``save()`` gives its bytes (alike on every rank), ``load(bytes)`` takes them."""

    def __init__(self, save: Callable[[], bytes], load: Callable[[bytes], None]):
        self._save, self._load = save, load

    def state_dict(self) -> dict:
        return {"state": self._save()}

    def load_state_dict(self, state_dict: dict) -> None:
        self._load(state_dict["state"])


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
