"""Several PipeTuneTrainer steps of a data- or tensor-parallel job (torchrun worker for
tests/integration/test_titan_scale_out.py): per step, this rank's weights before the step, its
gradients after it, the gradient norm the trainer clipped by and its replica's batch, with the
rank's place (pipeline stage, tensor-parallel rank, replica), the modules activation
checkpointing wraps and the share of their forward it recomputes (as ``hfu(%)`` counts it), for comparison with an unsplit TorchTitan model on the global batch.
FSDP-sharded tensors are saved whole, tensor-parallel shards as they are (the test joins them);
names are the unsplit model's. The weights are perturbed from TorchTitan's init first, so that
every parameter gets a gradient. With ``KILL_PLANNER_OF_REPLICA=d`` in the environment, replica
``d``'s lead kills its planner process before the first step (as an OOM killer would)."""

import os
import signal
import sys
import zlib

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX, CheckpointWrapper
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.config import ConfigManager


def fqn(name: str) -> str:
    """A name as the unsplit model has it: without activation checkpointing's wrapper."""
    return name.replace(_CHECKPOINT_PREFIX, "")


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def main() -> None:
    out, steps, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    trainer = ConfigManager().parse_args(argv).build()
    if trainer.async_planner is not None and str(trainer.replica) == os.environ.get("KILL_PLANNER_OF_REPLICA"):
        os.kill(trainer.async_planner._proc.pid, signal.SIGKILL)
    parts = trainer.model_parts  # with virtual stages, one per backbone chunk of this rank
    named = [(fqn(name), p) for part in parts for name, p in part.named_parameters()]
    checkpointed = [fqn(name) for part in parts for name, m in part.named_modules() if isinstance(m, CheckpointWrapper)]
    tp = trainer.parallel_dims.get_optional_mesh("tp")
    tp_rank = tp.get_local_rank() if tp is not None else 0
    with torch.no_grad():  # Muse Glimmer zero-initialises its norm weights: at init only the final norm would get a gradient
        for name, p in named:  # TP shards get their own noise: TorchTitan initialises every TP rank's shard alike
            seed = zlib.crc32(name.encode()) + (tp_rank if trainer.tp_grads.copies.get(p) == 1 else 0)
            noise = 0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
            p.add_(distribute_tensor(noise, p.device_mesh, p.placements) if isinstance(p, DTensor) else noise)
    seen, norms = [], []

    def batches():
        for batch in trainer.batch_generator(trainer.dataloader):
            seen.append(batch)
            yield batch

    clip = trainer.clip_gradients

    def clip_gradients():
        norms.append(float(clip()))
        return torch.tensor(norms[-1])

    trainer.clip_gradients = clip_gradients
    place = {"stage": trainer.stage, "tp_rank": tp_rank, "replica": trainer.replica}
    it, saved = batches(), []
    for step in range(1, steps + 1):
        weights = {k: whole(v) for part in parts for k, v in part.state_dict().items()}
        trainer.step = step
        trainer.train_step(it)
        grads = {n: whole(p.grad) for n, p in named if p.grad is not None}
        share = trainer.metrics_processor.recompute_share  # hfu(%)'s recomputed share of each block part, once counted
        saved.append({"weights": weights, "grads": grads, "batch": seen[-1], "grad_norm": norms[-1], "checkpointed": checkpointed,
                      "recompute_share": None if share is None else share.tolist(), **place})
    torch.save(saved, os.path.join(out, f"rank{dist.get_rank()}.pt"))
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
