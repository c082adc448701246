"""One PipeTuneTrainer step through TorchTitan's config system (torchrun worker for
tests/test_titan_trainer.py): saves this rank's initial weights, its gradients after the step and
the step's batch, for comparison with an unsplit TorchTitan model. The weights are perturbed
from TorchTitan's init first, so that every parameter gets a gradient."""

import os
import sys
import zlib

import torch
import torch.distributed as dist
from torchtitan.config import ConfigManager


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    trainer = ConfigManager().parse_args(argv).build()
    parts = trainer.model_parts  # several with an interleaved schedule; their names are the whole model's
    with torch.no_grad():  # Muse Glimmer zero-initialises its norm weights: at init only the final norm would get a gradient
        for name, p in (np for part in parts for np in part.named_parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))), alpha=0.05)
    weights = {k: v.detach().clone() for part in parts for k, v in part.state_dict().items()}
    seen = []

    def batches():
        for batch in trainer.batch_generator(trainer.dataloader):
            seen.append(batch)
            yield batch

    trainer.step = 1
    trainer.train_step(batches())
    grads = {n: p.grad.detach().clone() for part in parts for n, p in part.named_parameters() if p.grad is not None}
    torch.save({"weights": weights, "grads": grads, "batch": seen[0]}, os.path.join(out, f"rank{dist.get_rank()}.pt"))
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
