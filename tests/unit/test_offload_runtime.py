"""Activation offload in one process (``torchtitan_patches.runtime.offload``): a backbone stage's saved
tensors go to the host at ``O`` and come back at ``R``, with the gradients of the stage run without
offload, with and without activation checkpointing inside the stage."""

from functools import partial

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from pipetune.config import load_model_config
from pipetune.schedule import Action, Op
from torchtitan_patches.models.packed_attention import varlen_metadata
from torchtitan_patches.models.reference.vlm import build_stages
from torchtitan_patches.runtime.memory import SavedActivations
from torchtitan_patches.runtime.offload import ActivationCopies
from torchtitan_patches.runtime.timing import Clock

TOKENS = 96


def _stage(checkpoint: str):
    """The tiny model's middle stage (two decoder layers), each layer under ``checkpoint``: none,
    TorchTitan's full activation checkpointing (non-reentrant ``checkpoint_wrapper``) or selective
    (matrix products kept)."""
    model = load_model_config("tiny")
    _, stages = build_stages(model, [(0, 1), (1, 3), (3, 4)], [1], max_seq_len=256, seed=0, attention_backend="sdpa")
    stage = stages[1]
    if checkpoint != "none":
        policy = partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default]) if checkpoint == "selective" else None
        for k, layer in enumerate(stage.layers):
            stage.layers[k] = checkpoint_wrapper(layer, **({"context_fn": policy} if policy else {}))
    return model, stage


def _inputs(model):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, TOKENS, model.backbone.dim, generator=g)
    cu = torch.tensor([0, 40, 70, TOKENS])
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])[None]
    return x, {"positions": positions, "masks": varlen_metadata(cu, "cpu")}, torch.randn(1, TOKENS, model.backbone.dim, generator=g)


def _grads(stage, x) -> dict[str, torch.Tensor]:
    return {"x": x.grad, **{n: p.grad for n, p in stage.named_parameters()}}


def _forward(stage, x, kwargs, bf16: bool) -> torch.Tensor:
    """As the executor runs a chunk: in bf16, a bf16 message into an fp32 residual stream under autocast."""
    if not bf16:
        return stage(x, **kwargs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return stage(x.float(), **kwargs)


@pytest.mark.parametrize("checkpoint,bf16", [("none", False), ("full", False), ("selective", False), ("none", True)])
def test_offloaded_stage_gives_the_gradients_of_the_stage_kept_on_the_device(checkpoint, bf16):
    """The stage's forward under the offload hooks, ``O`` (host copies, device storages dropped),
    ``R``, backward: bitwise the gradients of the same forward and backward without offload (the
    chunk's input, a leaf, included). No parameter or input storage is offloaded. The activation
    tracker (hooks outside the offload's) sees the forward's saved storages, none after ``O`` and as
    many bytes again after ``R`` (under checkpointing, it and the offload see the checkpointed layers'
    inputs only; selective checkpointing keeps the matrix products itself, on the device). In bf16
    the input is not saved (its fp32 copy is) but moves all the same."""
    model, stage = _stage(checkpoint)
    x0, kwargs, grad = _inputs(model)
    x0 = x0.bfloat16() if bf16 else x0
    x = x0.clone().requires_grad_()
    _forward(stage, x, kwargs, bf16).backward(grad)
    want = {n: g.clone() for n, g in _grads(stage, x).items()}
    stage.zero_grad(set_to_none=True)

    keep = [*stage.parameters(), *stage.buffers(), kwargs["positions"], kwargs["masks"].cu_seq_q]
    x = x0.clone().requires_grad_()
    timeline = Clock(torch.device("cpu")).timeline()
    timeline.start()
    with SavedActivations(keep) as tracker:
        copies = ActivationCopies(frozenset({(1, 0)}), torch.device("cpu"), None, tracker)
        with copies.capture((1, 0), keep, received=x):
            y = _forward(stage, x, kwargs, bf16)
        saved = copies.saved[1, 0]
        assert saved.storages and not {t.untyped_storage().data_ptr() for t in keep} & set(saved.storages)
        assert x.untyped_storage().data_ptr() in saved.storages
        before = tracker.live_bytes()
        copies.run(Action(1, Op.OFFLOAD, 0), timeline)
        assert x.numel() == 0  # the input leaf emptied, refilled by R
        after_offload = tracker.live_bytes()
        with pytest.raises(RuntimeError, match="R must come before"):
            saved.unpack(0)
        copies.run(Action(1, Op.RELOAD, 0), timeline)
        after_reload = tracker.live_bytes()
        copies.ready((1, 0))
        y.backward(grad)
        del saved, copies
    got = _grads(stage, x)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want), \
        [n for n in want if not torch.equal(got[n], want[n])]
    assert before > 0 and after_offload == 0 and after_reload == before
    assert len(timeline.finish()[0]) == 2


def test_the_backward_reads_the_reloaded_copies():
    """Control: host copies changed between ``O`` and ``R`` change every gradient (the backward
    reads what ``R`` brought back, not a device tensor that survived the ``O``)."""
    model, stage = _stage("none")
    x0, kwargs, grad = _inputs(model)
    stage(x0.clone().requires_grad_(), **kwargs).backward(grad)
    want = {n: p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    timeline = Clock(torch.device("cpu")).timeline()
    timeline.start()
    copies = ActivationCopies(frozenset({(1, 0)}), torch.device("cpu"), None, None)
    x = x0.clone().requires_grad_()
    with copies.capture((1, 0), [*stage.parameters(), kwargs["positions"]], received=x):
        y = stage(x, **kwargs)
    copies.run(Action(1, Op.OFFLOAD, 0), timeline)
    for host in copies.saved[1, 0].storages.values():
        host.add_(1)  # every byte of every saved tensor
    copies.run(Action(1, Op.RELOAD, 0), timeline)
    copies.ready((1, 0))
    y.backward(grad)
    assert all(not torch.equal(p.grad, want[n]) for n, p in stage.named_parameters())
