"""The executor's pieces for virtual stages and split backward, in one process: message tags,
``I`` / ``W`` through torch's ``stage_backward_input`` / ``stage_backward_weight``, and the
activation tracker."""

from collections import Counter

import pytest
import torch
from torch import nn

from pipetune.schedule import Action, Op
from pipetune.schedule.lowering import Direction, Post, lower_all
from pipetune.schedule.schedules import list_scheduled
from torchtitan_patches.runtime.executor import _tag, _WeightGrad
from torchtitan_patches.runtime.memory import SavedActivations, storage_bytes


@pytest.mark.parametrize("ranks,chunks", [(2, 2), (3, 2), (2, 3)])
def test_every_message_between_two_ranks_has_its_own_tag(ranks, chunks):
    """With two chunks per rank, chunk 1's forward activation and its input gradient ``I`` both go
    from rank 1 to rank 0 for the same micro-batch; tagged alike, gloo could hand one the other's
    buffer (same shape). Every message a rank posts to one peer must carry a distinct tag."""
    table = list_scheduled(ranks, chunks, [3, 0, 2, 1, 4], split_backward=True, encoder=True, encoder_trained=True)
    posted = [[t for s in steps if isinstance(s, Post) for t in s.transfers] for steps in lower_all(table)]
    assert any(t.direction is Direction.SEND and t.message.src.op is Op.BACKWARD_INPUT for ts in posted for t in ts)
    for r, transfers in enumerate(posted):
        tags = Counter((t.direction, t.peer, _tag(t.message)) for t in transfers)
        assert max(tags.values()) == 1, (r, [k for k, n in tags.items() if n > 1])


def _block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))


def _split_grads(x: torch.Tensor, *, loss: bool):
    """Gradients of the block's weights and of ``x`` by ``I`` then ``W``, and by one backward."""
    whole, split = _block(), _block()
    outs = []
    for m in (whole, split):
        xi = x.detach().requires_grad_(x.requires_grad)
        y = m(xi)
        y = y.square().sum() if loss else y
        grad = None if loss else torch.linspace(-1, 1, y.numel()).reshape(y.shape)
        outs.append((m, xi, y, grad))
    (m, xi, y, grad), (ms, xs, ys, grads) = outs
    torch.autograd.backward(y, grad)
    w = _WeightGrad.split(ys, grads, [xs] if xs.requires_grad else [], [p for p in ms.parameters()], where=Action(1, Op.BACKWARD_INPUT, 0))
    assert all(p.grad is None for p in ms.parameters())  # I leaves the weights alone
    x_grad_after_input = None if xs.grad is None else xs.grad.clone()
    w.run()
    return m, ms, xi, xs, x_grad_after_input


@pytest.mark.parametrize("loss", [False, True])
def test_input_then_weight_gradient_equals_one_backward(loss):
    """A middle chunk (output gradient given) and a last one (scalar loss): ``I`` gives the input's
    gradient and no weight gradient, ``W`` then every weight's, as one whole backward does."""
    m, ms, xi, xs, after_input = _split_grads(torch.randn(5, 16, requires_grad=True), loss=loss)
    torch.testing.assert_close(after_input, xi.grad)
    for p, q in zip(m.parameters(), ms.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_a_chunk_without_differentiable_inputs_runs_its_whole_backward_at_w():
    """Chunk 0 beside a frozen encoder: nothing needs an input gradient, so ``I`` computes nothing
    and ``W`` the whole backward (torch's parameter groups would capture no weight here)."""
    m, ms, _, _, after_input = _split_grads(torch.randn(5, 16), loss=False)
    assert after_input is None
    for p, q in zip(m.parameters(), ms.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_an_output_that_ignores_its_inputs_is_refused():
    """Were the output independent of every input, torch's parameter groups would hold no weight
    and ``W`` would add nothing: an error, not gradients silently missing."""
    block = _block()
    x = torch.randn(5, 16, requires_grad=True)
    y = block(torch.randn(5, 16))
    with pytest.raises(RuntimeError, match="does not depend on its inputs"):
        _WeightGrad.split(y, torch.ones_like(y), [x], list(block.parameters()), where=Action(1, Op.BACKWARD_INPUT, 0))


def test_saved_activations_follow_what_autograd_keeps_alive():
    """Each storage counted once, weights and excluded inputs left out; freed by a backward, kept
    by an input-gradient action until its weight-gradient action drops the graph."""
    block = _block()
    x = torch.randn(100, 16)
    with SavedActivations([*block.parameters(), x]) as saved:
        y = block(x.requires_grad_(False))
        hidden = 100 * 32 * 4
        alive = saved.live_bytes()
        assert 3 * hidden <= alive <= 4 * hidden + 100 * 8 * 4  # Linear out, GELU out, LayerNorm's normalised input and stats
        y.sum().backward()
        assert saved.live_bytes() == 0
        xr = torch.randn(100, 16, requires_grad=True)
        y = block(xr)
        before = saved.live_bytes()
        w = _WeightGrad.split(y, torch.ones_like(y), [xr], list(block.parameters()), where=Action(1, Op.BACKWARD_INPUT, 0))
        del y
        assert saved.live_bytes() == before  # the graph stays for W
        assert storage_bytes(w.held()) >= 100 * (32 + 8) * 4  # both linear layers' output gradients
        w.run()
        del w
        assert saved.live_bytes() == storage_bytes([xr])  # only the input, which this test still holds
