"""Several PipeTuneTrainer steps of a data- or tensor-parallel job (torchrun worker for
tests/integration/test_titan_scale_out.py): per step, this rank's whole weights before the step,
its whole gradients after it and its replica's batch, for comparison with an unsplit TorchTitan
model on the global batch. The weights are perturbed from TorchTitan's init first, so that every
parameter gets a gradient."""

import os
import sys
import zlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.config import ConfigManager


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def main() -> None:
    out, steps, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    trainer = ConfigManager().parse_args(argv).build()
    part = trainer.model_parts[0]
    with torch.no_grad():  # Muse Glimmer zero-initialises its norm weights: at init only the final norm would get a gradient
        for name, p in part.named_parameters():
            noise = 0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
            p.add_(distribute_tensor(noise, p.device_mesh, p.placements) if isinstance(p, DTensor) else noise)
    seen = []

    def batches():
        for batch in trainer.batch_generator(trainer.dataloader):
            seen.append(batch)
            yield batch

    it, saved = batches(), []
    for step in range(1, steps + 1):
        weights = {k: whole(v) for k, v in part.state_dict().items()}
        trainer.step = step
        trainer.train_step(it)
        grads = {n: whole(p.grad) for n, p in part.named_parameters() if p.grad is not None}
        saved.append({"weights": weights, "grads": grads, "batch": seen[-1]})
    torch.save(saved, os.path.join(out, f"rank{dist.get_rank()}.pt"))
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
