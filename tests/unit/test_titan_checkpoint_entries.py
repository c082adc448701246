"""A checkpoint without pipetune's entries (another trainer or dataloader wrote it) is refused by
DCP's strict load; the trainer's load says which entry is missing and how to start it afresh."""

import pytest
import torch.distributed.checkpoint as dcp

from torchtitan_patches.titan.checkpoint_entries import LEARNED_KEY, checked_load


class Entry:
    def __init__(self, state):
        self.state, self.loaded = state, None

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.loaded = state


@pytest.mark.parametrize("written, missing, exclude", [
    ({"dataloader": Entry({"dp_rank_0": b"stock"}), LEARNED_KEY: Entry({"state": b"l"})},
     "pipetune data position (dataloader.pipetune_loader)", "dataloader"),
    ({"dataloader": Entry({"pipetune_loader": b"d"})}, "pipetune learned state (pipetune_learned.state)", LEARNED_KEY),
])
def test_a_checkpoint_without_an_entry_is_refused_naming_it_and_what_to_leave_out(tmp_path, written, missing, exclude):
    dcp.save(written, checkpoint_id=tmp_path, no_dist=True)
    wanted = {"dataloader": Entry({"pipetune_loader": b""}), LEARNED_KEY: Entry({"state": b""})}  # as PipeTuneTrainer's entries
    load = checked_load(lambda: dcp.load(wanted, checkpoint_id=tmp_path, no_dist=True), "ckpt")
    with pytest.raises(ValueError) as err:
        load()
    assert str(err.value).startswith(f"the checkpoint in ckpt holds no {missing}: another trainer or dataloader wrote it")
    assert f"--checkpoint.exclude_from_loading {exclude}" in str(err.value)
    # leaving the entry out (what the option does) loads the rest
    dcp.load({k: v for k, v in wanted.items() if k != exclude}, checkpoint_id=tmp_path, no_dist=True)


def test_other_errors_pass_through():
    def fails():
        raise FileNotFoundError("--checkpoint.load_step=7 not found")

    with pytest.raises(FileNotFoundError, match="load_step=7"):
        checked_load(fails, "ckpt")()
