"""The torch 2.13 gaps TorchTitan 0.3.0 meets, filled: its micro-batch form of a pipeline schedule's
``step`` trains exactly as the whole-batch form does (one process, one stage)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from torchtitan_patches.compat.torch_compat import add_missing_torch_apis


@pytest.fixture(scope="module")
def world_of_one():
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _grads(schedule_class, micro_batch_form: bool) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    schedule = schedule_class(PipelineStage(model, 0, 1, torch.device("cpu")), n_microbatches=3,
                              loss_fn=lambda out, target, scale=1.0: scale * ((out - target) ** 2).sum(), scale_grads=False)
    losses = []
    if micro_batch_form:
        schedule.step(arg_mbs=[(c,) for c in x.chunk(3)], kwarg_mbs=[{}] * 3, target_mbs=list(y.chunk(3)), losses=losses,
                      loss_kwargs={"scale": 0.5}, return_outputs=False)
    else:
        schedule.step(x, target=y, losses=losses, loss_kwargs={"scale": 0.5}, return_outputs=False)
    return [float(v.detach()) for v in losses], {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("schedule_class", [Schedule1F1B, ScheduleGPipe])
def test_the_micro_batch_form_of_step_trains_as_the_whole_batch_form(world_of_one, schedule_class):
    add_missing_torch_apis()
    add_missing_torch_apis()  # idempotent: wraps once
    whole_losses, whole = _grads(schedule_class, micro_batch_form=False)
    split_losses, split = _grads(schedule_class, micro_batch_form=True)
    assert split_losses == whole_losses and len(split_losses) == 3
    for name in whole:
        assert torch.equal(split[name], whole[name]), name
    assert hasattr(dist, "set_timeout")
