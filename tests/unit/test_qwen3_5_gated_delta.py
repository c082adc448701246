"""The CPU path of Qwen3.5's Gated DeltaNet (``torchtitan_patches.models.qwen3_5.gated_delta_cpu``) against
fla's own torch reference (``naive_recurrent_gated_delta_rule``, token by token) and torch's
``conv1d``, one document at a time: values and gradients, on packed documents whose states must
not leak from one document into the next."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from torchtitan_patches.models.qwen3_5.gated_delta_cpu import causal_conv1d, gated_delta_rule, l2norm

with warnings.catch_warnings():  # fla warns that Triton has no CPU backend
    warnings.simplefilter("ignore")
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

BOUNDS = [0, 70, 71, 200, 203, 330]  # documents longer than a chunk, of one token, cut mid-chunk


def _inputs(T=330, H=3, K=32, V=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen)
    g = -torch.rand(1, T, H, generator=gen) * 0.5
    beta = torch.rand(1, T, H, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _reference(q, k, v, g, beta, bounds):
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        o, _ = naive_recurrent_gated_delta_rule(l2norm(q[:, a:b]), l2norm(k[:, a:b]), v[:, a:b], beta[:, a:b], g[:, a:b])
        outs.append(o)
    return torch.cat(outs, 1)


def _max_rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("chunk", [16, 64])
def test_gated_delta_rule_equals_fla_reference_per_document(chunk):
    inputs = _inputs()
    out = gated_delta_rule(*inputs, bounds=BOUNDS, chunk=chunk)
    ref = _reference(*inputs, BOUNDS)
    assert _max_rel(out, ref) < 1e-5
    weight = torch.randn_like(ref)
    got = torch.autograd.grad((out * weight).sum(), inputs)
    want = torch.autograd.grad((ref * weight).sum(), inputs)
    for name, a, b in zip("q k v g beta".split(), got, want):
        assert _max_rel(a, b) < 1e-4, name


def test_no_state_crosses_a_document_boundary():
    """Changing document 0's inputs changes nothing in the later documents, values or gradients."""
    q, k, v, g, beta = _inputs()
    base = gated_delta_rule(q, k, v, g, beta, bounds=BOUNDS)
    v2 = v.detach().clone()
    v2[:, :70] += 1.0
    other = gated_delta_rule(q, k, v2, g, beta, bounds=BOUNDS)
    assert not torch.allclose(base[:, :70], other[:, :70])
    assert torch.equal(base[:, 70:], other[:, 70:])
    (grad_v,) = torch.autograd.grad(base[:, 70:].sum(), [v])
    assert grad_v[:, :70].abs().max() == 0


def test_causal_conv1d_restarts_at_every_document():
    """Per document, TorchTitan's own fixed-length path: left-pad, depthwise ``conv1d``, silu."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 330, 24, generator=gen, requires_grad=True)
    w = torch.randn(24, 1, 4, generator=gen, requires_grad=True)
    out = causal_conv1d(x, w, bounds=BOUNDS)
    ref = torch.cat([F.silu(F.conv1d(F.pad(x[:, a:b].transpose(1, 2), [3, 0]), w, groups=24)).transpose(1, 2)
                     for a, b in zip(BOUNDS[:-1], BOUNDS[1:])], 1)
    assert _max_rel(out, ref) < 1e-6
    weight = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((out * weight).sum(), [x, w]), torch.autograd.grad((ref * weight).sum(), [x, w])):
        assert _max_rel(a, b) < 1e-5


def test_bounds_that_do_not_tile_the_tokens_are_refused():
    with pytest.raises(ValueError, match="do not tile the 330 tokens"):
        gated_delta_rule(*_inputs(), bounds=[0, 100, 300])
    with pytest.raises(ValueError, match="batch 1"):
        gated_delta_rule(*(t.expand(2, *t.shape[1:]) for t in _inputs()), bounds=[0, 330])
