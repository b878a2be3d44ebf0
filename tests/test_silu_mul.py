"""silu_mul (SwiGLU's ``F.silu(gate) * up``): the bit-exact contract and the proof on every value on the GPU, its
guards, fallback and custom op everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffusers_fastpath.ops import Site, silu_mul, silu_mul_ref
from diffusers_fastpath.ops.silu_mul import SILU_MUL

# [B, L, 2D] projections whose chunk(2, dim=-1) halves feed the op: FLUX.2-dev's feed-forward at 1024x1024 (4096 image
# tokens, D = 18432) and its single blocks' MLP (4608 joint tokens), a CFG batch, FLUX.2-klein's width, a small case
SHAPES = [(1, 4096, 2 * 18432), (1, 4608, 2 * 18432), (2, 512, 2 * 18432), (1, 4608, 2 * 9216), (1, 17, 128)]
DTYPES = [torch.bfloat16, torch.float16]


def make_inputs(shape, dtype, device, seed, layout="chunk"):
    """The two halves of one projection (``x.chunk(2, dim=-1)``: row stride 2D, no copy), or two contiguous tensors
    (a feed-forward with separate gate and up projections)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(shape, generator=gen, device=device) * 3).to(dtype)
    if layout == "chunk":
        return x.chunk(2, dim=-1)
    half = shape[2] // 2
    return x[..., :half].contiguous(), x[..., half:].contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["chunk", "separate"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_silu_mul_matches_eager_bitwise_and_is_proven(shape, dtype, layout):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    for seed in range(2):
        gate, up = make_inputs(shape, dtype, "cuda", seed, layout)
        ref = silu_mul_ref(gate, up)
        out = torch.full_like(ref, float("nan"))  # poisoned: every element must be written
        torch.ops.diffusers_fastpath._silu_mul_cuda_out(out, gate, up)
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
        site = Site("silu_mul")
        assert torch.equal(silu_mul(gate, up, site), ref)
        assert site.fast == 1 and not site.fallback, site  # the proof on all 65536 values passed
    assert SILU_MUL.disabled is None and SILU_MUL.verified == {(str(dtype).removeprefix("torch."),)}


def test_rounding_the_silu_matters():
    """Keeping the SiLU in fp32 into the product (skipping its rounding) changes many outputs: only a kernel with
    eager's two rounding points passes the GPU test above."""
    gate, up = make_inputs((1, 64, 512), torch.bfloat16, "cpu", 0)
    unrounded = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)
    assert (unrounded != silu_mul_ref(gate, up)).float().mean().item() > 0.05


@pytest.mark.parametrize("case, reason", [
    ("fp32", "dtype float32"), ("mixed", "mixed dtypes"), ("2d", "shape"), ("odd", "D not a multiple of 8"),
    ("strided", "rows strided"), ("cpu", "device cpu")])
def test_guard_falls_back_with_reason(case, reason):
    gate, up = make_inputs((2, 9, 128), torch.bfloat16, "cpu", 1)
    args = {
        "fp32": (gate.float(), up.float()), "mixed": (gate, up.half()), "2d": (gate[0], up[0]),
        "odd": (gate[..., :60], up[..., :60]), "strided": (gate[..., ::2], up[..., ::2]), "cpu": (gate, up),
    }[case]
    assert SILU_MUL.guard(*args) == reason
    site = Site("silu_mul")
    assert torch.equal(silu_mul(*args, site), silu_mul_ref(*args))
    assert site.fast == 0 and site.fallback == {reason: 1}


@pytest.mark.parametrize("layout", ["chunk", "separate"])
def test_custom_op_opcheck_cpu(layout):
    gate, up = make_inputs((2, 9, 128), torch.bfloat16, "cpu", 2, layout)
    torch.library.opcheck(torch.ops.diffusers_fastpath.silu_mul.default, (gate, up))
    assert torch.equal(torch.ops.diffusers_fastpath.silu_mul(gate, up), silu_mul_ref(gate, up))


def test_flux2_swiglu_is_rewritten_and_hooks_keep_it_as_written(emulated_kernels):
    """FLUX.2's Flux2SwiGLU goes through the op (kernel emulated here); an activation with a hook runs as written."""
    from diffusers.models.transformers.transformer_flux2 import Flux2SwiGLU

    from diffusers_fastpath.models.flux2 import FastpathFlux2SwiGLU

    ref, fused = Flux2SwiGLU(), Flux2SwiGLU()
    fused.__class__ = FastpathFlux2SwiGLU
    fused._fastpath_site_silu_mul = Site("silu_mul")
    x = torch.randn(2, 9, 256).bfloat16()
    with torch.no_grad():
        assert torch.equal(fused(x), ref(x))
        assert fused._fastpath_site_silu_mul.fast == 1
        fused.gate_fn.register_forward_hook(lambda m, i, o: o * 2)
        ref.gate_fn.register_forward_hook(lambda m, i, o: o * 2)
        assert torch.equal(fused(x), ref(x))
    assert fused._fastpath_site_silu_mul.fast == 1  # the hooked call did not take the fused path
