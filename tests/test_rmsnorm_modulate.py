"""rmsnorm_modulate (LTX-Video's adaLN sites: a weightless diffusers RMSNorm, then ``* (1 + scale) + shift`` in the
storage dtype over per-token rows): the reference is the block's chain, the bit-exact contract on the GPU at
LTX-Video's shapes (weightless and weighted, per-token and broadcast rows, both ways of building the kernels),
guards, fallback and custom op everywhere."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.normalization import RMSNorm

from diffusers_fastpath.ops import Site, rmsnorm_modulate, rmsnorm_modulate_ref
from diffusers_fastpath.ops.rmsnorm_modulate import RMSNORM_MODULATE

DTYPES = [torch.bfloat16, torch.float16]
# [batch, tokens, dim]: LTX-Video at 768x512x121 (6,144 tokens of 2048), a CFG batch at a smaller size, a short row
SHAPES = [(1, 6144, 2048), (2, 1536, 2048), (1, 40, 640)]


def make(shape, dtype, device, seed, weight=False, per_token=True):
    """A diffusers RMSNorm (weightless as LTX-Video's, or with a weight around 1), x, and scale/shift rows laid out
    as the block has them: ``[B, T, D]`` views of one ``[B, T, 6, D]`` adaLN table (or ``[B, 1, D]`` rows)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s, std=1.0: (torch.randn(*s, generator=gen, device=device) * std).to(dtype)  # noqa: E731
    batch, tokens, dim = shape
    norm = RMSNorm(dim, eps=1e-6, elementwise_affine=weight).to(device=device, dtype=dtype)
    if weight:
        with torch.no_grad():
            norm.weight.copy_(1 + rnd(dim, std=0.3))
    table = rnd(batch, tokens if per_token else 1, 6, dim, std=0.5)
    shift, scale = table.unbind(dim=2)[:2]
    return norm, rnd(*shape, std=3.0), scale, shift


def block_chain(norm, x, scale, shift):
    """LTX-Video's block, as written: ``norm_hidden_states = self.norm1(h) * (1 + scale_msa) + shift_msa``."""
    return norm(x) * (1 + scale) + shift


def test_reference_is_the_block_chain():
    for dtype in DTYPES:
        for weight in (False, True):
            norm, x, scale, shift = make((2, 20, 640), dtype, "cpu", 0, weight)
            with torch.no_grad():
                assert torch.equal(rmsnorm_modulate_ref(norm, x, scale, shift), block_chain(norm, x, scale, shift))


@pytest.mark.gpu
@pytest.mark.parametrize("per_token", [True, False], ids=["per_token", "broadcast_rows"])
@pytest.mark.parametrize("weight", [False, True], ids=["weightless", "weighted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_eager_bitwise_on_the_gpu(shape, dtype, weight, per_token):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    with torch.no_grad():
        for seed in range(2):
            norm, x, scale, shift = make(shape, dtype, "cuda", seed, weight, per_token)
            ref = block_chain(norm, x, scale, shift)
            rows = (scale, shift) if per_token else (scale.expand(shape), shift.expand(shape))
            poisoned = torch.full_like(x, float("nan"))
            torch.ops.diffusers_fastpath._rmsnorm_modulate_cuda_out(poisoned, x, norm.weight, *rows, norm.eps)
            torch.cuda.synchronize()
            assert torch.equal(poisoned, ref)
            site = Site("rmsnorm_modulate")
            got = rmsnorm_modulate(norm, x, scale, shift, site)
            assert torch.equal(got, ref) and site.fast == 1 and not site.fallback, site
    assert RMSNORM_MODULATE.disabled is None


@pytest.mark.parametrize("case, reason", [
    ("fp32", "dtype float32"), ("weight", "mixed dtypes"), ("dim", "D outside the reproduced reduction"),
    ("few", "fewer than 16 rows"), ("strided", "x not contiguous"), ("rows", "operands strided or mismatched"),
    ("bias", "norm without weight or with bias"), ("cpu", "device cpu"), ("scalars", "operand not a tensor"),
    ("torch_rmsnorm", "norm not diffusers' RMSNorm"), ("weight_shape", "norm weight shape")])
def test_guard_falls_back_with_reason(case, reason):
    norm, x, scale, shift = make((1, 20, 640), torch.bfloat16, "cpu", 1)
    if case == "fp32":
        norm, x, scale, shift = norm.float(), x.float(), scale.float(), shift.float()
    elif case == "weight":
        norm = RMSNorm(640, eps=1e-6).float()
    elif case == "dim":
        norm, x, scale, shift = make((1, 20, 512), torch.bfloat16, "cpu", 1)
    elif case == "few":
        norm, x, scale, shift = make((1, 7, 640), torch.bfloat16, "cpu", 1)
    elif case == "strided":
        x = torch.randn(1, 640, 20).to(torch.bfloat16).transpose(1, 2)
    elif case == "rows":
        scale = scale[:, :10]  # ten rows for twenty tokens
    elif case == "bias":
        norm = RMSNorm(640, eps=1e-6, bias=True).to(torch.bfloat16)
    elif case == "scalars":
        scale, shift = 0.5, 0.25  # Python numbers: eager takes them; the guard refuses them without raising
    elif case == "torch_rmsnorm":  # torch's own RMSNorm computes in another order: its numbers differ
        norm = torch.nn.RMSNorm(640, eps=1e-6).to(torch.bfloat16)
    elif case == "weight_shape":  # a [1] weight: eager broadcasts it over the row, the kernel would read [D]
        norm = RMSNorm(1, eps=1e-6).to(torch.bfloat16)
    site = Site("rmsnorm_modulate")
    with torch.no_grad():
        assert RMSNORM_MODULATE.guard(norm, x, scale, shift) == reason
        if case != "rows":
            assert torch.equal(rmsnorm_modulate(norm, x, scale, shift, site), block_chain(norm, x, scale, shift))
    if case != "rows":
        assert site.fast == 0 and site.fallback == {reason: 1}


def test_requires_grad_falls_back_and_keeps_the_graph():
    norm, x, scale, shift = make((1, 20, 640), torch.bfloat16, "cpu", 2, weight=True)
    x = x.detach().requires_grad_()
    site = Site("rmsnorm_modulate")
    out = rmsnorm_modulate(norm, x, scale, shift, site)
    out.float().sum().backward()
    assert site.fallback == {"requires grad": 1} and x.grad is not None and norm.weight.grad is not None


@pytest.mark.parametrize("weight", [False, True], ids=["weightless", "weighted"])
def test_custom_op_opcheck_cpu(weight):
    norm, x, scale, shift = make((1, 20, 640), torch.bfloat16, "cpu", 3, weight)
    w = None if norm.weight is None else norm.weight.detach()
    torch.library.opcheck(torch.ops.diffusers_fastpath.rmsnorm_modulate.default, (x, w, scale, shift, 1e-6))
    with torch.no_grad():
        got = torch.ops.diffusers_fastpath.rmsnorm_modulate(x, w, scale, shift, 1e-6)
        assert torch.equal(got, block_chain(norm, x, scale, shift))
