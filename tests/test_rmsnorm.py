"""rmsnorm (diffusers' RMSNorm alone: SD3 and SD3.5's QK norms over short rows; the generic path's pre-norms over wide
rows): the reference is diffusers' forward, the bit-exact contract on the GPU at SD3.5's shapes (the [B, H, S, D] views
of its projections, the result in their strides) and at wide rows, guards, fallback and custom op everywhere."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.normalization import RMSNorm

from diffusers_fastpath.ops import Site, rmsnorm, rmsnorm_ref
from diffusers_fastpath.ops.rmsnorm import RMSNORM

DTYPES = [torch.bfloat16, torch.float16]
# [B, S, H, D] projections seen as [B, H, S, D]: SD3.5-large at 1024x1024 (38 heads of 64; 4096 image tokens, 333
# text), a CFG batch, Lumina2's head_dim 96, the vectorised 128, a small odd one
SHAPES = [(1, 4096, 38, 64), (2, 333, 38, 64), (1, 4096, 24, 96), (1, 1024, 24, 128), (1, 7, 3, 64), (2, 5, 4, 32)]


def make(shape, dtype, device, seed, transposed=True):
    gen = torch.Generator(device=device).manual_seed(seed)
    dim = shape[-1]
    norm = RMSNorm(dim, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=gen, device=device))  # not ones: the weight matters
    x = (torch.randn(shape, generator=gen, device=device) * 3).to(dtype)
    return norm, (x.transpose(1, 2) if transposed else x)


def test_reference_is_diffusers_forward():
    for dtype in DTYPES:
        norm, x = make((2, 9, 3, 64), dtype, "cpu", 0)
        with torch.no_grad():
            ref = rmsnorm_ref(norm, x)
            assert torch.equal(ref, norm(x)) and ref.stride() == x.stride()


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [True, False], ids=["BHSD_view", "contiguous"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_eager_bitwise_on_the_gpu(shape, dtype, transposed):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    with torch.no_grad():
        for seed in range(2):
            norm, x = make(shape, dtype, "cuda", seed, transposed)
            ref = norm(x)
            rows = x.permute(0, 2, 1, 3) if transposed else x  # the memory order
            poisoned = torch.full_like(rows.reshape(-1, 1, shape[-1]), float("nan"))
            poisoned.copy_(torch.ops.diffusers_fastpath._rmsnorm_plain_cuda(rows.reshape(-1, 1, shape[-1]),
                                                                             norm.weight, norm.eps))
            torch.cuda.synchronize()
            assert torch.equal(poisoned.view(rows.shape), ref.permute(0, 2, 1, 3) if transposed else ref)
            site = Site("rmsnorm")
            got = rmsnorm(norm, x, site)
            assert torch.equal(got, ref) and got.stride() == ref.stride() == x.stride()
            assert site.fast == 1 and not site.fallback, site
    assert RMSNORM.disabled is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 4429, 4096), (2, 1024, 3072), (1, 300, 640), (1, 17, 7936), (3, 77, 5120),
                                   (1, 4096, 18, 256), (2, 333, 4, 384), (1, 999, 512),
                                   # a multiple of 4, no multiple of 128: lanes with one quad fewer (Sana-Video's 2240)
                                   (1, 4725, 2240), (2, 77, 1028), (1, 300, 132), (2, 64, 4, 192), (1, 33, 8160)],
             ids=str)
def test_wide_rows_match_eager_bitwise_on_the_gpu(shape, dtype):
    """Rows longer than 128, a multiple of 4 below 8192: pre-norms across a whole row (Cosmos 3's hidden 4096),
    Ideogram 4's QK norms at head_dim 256, 384 and 512, Sana-Video's 2240 and widths no multiple of 128: the kernel's output poisoned, every element written and equal
    to diffusers' forward; through the op, fast and verified for (dtype, D)."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    with torch.no_grad():
        for seed in range(2):
            norm, x = make(shape, dtype, "cuda", seed, transposed=False)
            ref = norm(x)
            out = torch.full_like(x.reshape(-1, 1, shape[-1]), float("nan"))
            out.copy_(torch.ops.diffusers_fastpath._rmsnorm_plain_cuda(x.reshape(-1, 1, shape[-1]), norm.weight,
                                                                       norm.eps))
            assert torch.equal(out.view(shape), ref)
            site = Site("rmsnorm")
            assert torch.equal(rmsnorm(norm, x, site), ref)
            assert site.fast == 1 and not site.fallback, site
    assert RMSNORM.disabled is None and (str(dtype).removeprefix("torch."), shape[-1]) in RMSNORM.verified


@pytest.mark.parametrize("case, reason", [
    ("fp32", "dtype float32"), ("weight", "mixed dtypes"), ("dim", "D outside the reproduced reduction"),
    ("wide", "device cpu"), ("wide-256", "device cpu"), ("wide-8192", "D outside the reproduced reduction"),
    ("wide-odd", "D outside the reproduced reduction"),
    ("wide-8164", "D outside the reproduced reduction"),
    ("odd", "D outside the reproduced reduction"), ("few", "fewer than 16 rows"), ("strided", "x not dense"),
    ("bias", "norm without weight or with bias"), ("weightless", "device cpu"), ("cpu", "device cpu")])
def test_guard_falls_back_with_reason(case, reason):
    norm, x = make((1, 9, 4, 64), torch.bfloat16, "cpu", 1)
    if case == "fp32":
        norm, x = norm.float(), x.float()
    elif case == "weight":
        norm = norm.float()
    elif case == "dim":
        norm, x = make((1, 9, 4, 194), torch.bfloat16, "cpu", 1)
    elif case == "odd":
        norm, x = make((1, 9, 4, 66), torch.bfloat16, "cpu", 1)
    elif case.startswith("wide"):  # a pre-norm's [B, S, D]: wide rows, a multiple of 4 with 128 < D < 8192
        dim = {"wide": 1024, "wide-256": 256, "wide-8192": 8192, "wide-odd": 1002, "wide-8164": 8164}[case]
        norm, x = make((1, 20, dim), torch.bfloat16, "cpu", 1, transposed=False)
    elif case == "few":
        norm, x = make((1, 3, 2, 64), torch.bfloat16, "cpu", 1)
    elif case == "strided":
        x = x[:, :, ::2]  # every other token: not dense
    elif case == "bias":
        norm = RMSNorm(64, eps=1e-6, bias=True).to(torch.bfloat16)
    elif case == "weightless":  # elementwise_affine=False: taken (a unit weight stands in), only the CPU refuses
        norm = RMSNorm(64, eps=1e-6, elementwise_affine=False)
    site = Site("rmsnorm")
    with torch.no_grad():  # the norm's weight is a parameter: with grad enabled the guard says "requires grad"
        assert RMSNORM.guard(norm, x) == reason
        assert torch.equal(rmsnorm(norm, x, site), norm(x))
    assert site.fast == 0 and site.fallback == {reason: 1}


def test_requires_grad_falls_back_and_keeps_the_graph():
    norm, x = make((1, 9, 4, 64), torch.bfloat16, "cpu", 2)
    x = x.detach().requires_grad_()
    site = Site("rmsnorm")
    out = rmsnorm(norm, x, site)
    out.float().sum().backward()
    assert site.fallback == {"requires grad": 1} and x.grad is not None and norm.weight.grad is not None


def test_custom_op_opcheck_cpu():
    norm, x = make((1, 9, 4, 64), torch.bfloat16, "cpu", 3)
    torch.library.opcheck(torch.ops.diffusers_fastpath.rmsnorm.default, (x, norm.weight.detach(), 1e-6))
    with torch.no_grad():
        got = torch.ops.diffusers_fastpath.rmsnorm(x, norm.weight, 1e-6)
        assert torch.equal(got, norm(x)) and got.stride() == x.stride()


def test_kernel_wrapper_runs_the_rows_in_memory_order_and_returns_x_strides(emulated_kernels):
    """The wrapper around the launch (emulated here: the eager norm of the rows it is given): any dense layout goes
    in as its rows in memory order and comes back in its own strides, equal to eager."""
    for shape, perm in (((2, 9, 4, 64), (0, 2, 1, 3)), ((3, 4, 5, 32), (2, 0, 1, 3)), ((1, 16, 64), (1, 0, 2))):
        norm, x = make(shape, torch.bfloat16, "cpu", 4, transposed=False)
        x = x.permute(perm)
        site = Site("rmsnorm")
        with torch.no_grad():
            got = rmsnorm(norm, x, site)
            assert torch.equal(got, norm(x)) and got.stride() == x.stride()
        assert site.fast == 1, site


def test_weightless_norm_runs_the_kernel_with_a_unit_weight_of_x_dtype(emulated_kernels, monkeypatch):
    """A weightless norm (LTX-2's ``norm2``, ``elementwise_affine=False``: ``(x * rstd).to(T)``) goes to the plain
    kernel with a weight of ones in x's dtype (``round_T(round_T(x * rstd) * 1)`` rounds nothing more), made once per
    (device, dtype, D) and kept; equal to diffusers' weightless forward."""
    import sys

    module = sys.modules["diffusers_fastpath.ops.rmsnorm"]
    module._UNIT_WEIGHTS.clear()
    launched = []

    def launch(x, weight, eps):
        launched.append(weight)
        return module._rms_norm(x, weight, eps).contiguous()

    monkeypatch.setattr(module, "_launch", launch)
    for dtype in DTYPES:
        norm = RMSNorm(1024, eps=1e-6, elementwise_affine=False)
        x = (torch.randn(1, 40, 1024, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
        site = Site("rmsnorm")
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(rmsnorm(norm, x, site), norm(x))
        assert site.fast == 2 and not site.fallback, site
        first, second = launched[-2:]
        assert first is second and first.dtype == dtype and first.shape == (1024,) and bool((first == 1).all())


def test_unit_weight_made_inside_a_capture_is_not_kept(monkeypatch):
    """Inside a CUDA graph capture a new tensor's fill is captured and runs only at replay: a unit weight made there
    serves that call and is not kept for calls outside the graph."""
    import sys

    module = sys.modules["diffusers_fastpath.ops.rmsnorm"]
    module._UNIT_WEIGHTS.clear()
    norm, x = RMSNorm(256, eps=1e-6, elementwise_affine=False), torch.randn(2, 20, 256).to(torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    w = module._weight(norm, x)
    assert bool((w == 1).all()) and w.dtype == torch.bfloat16 and not module._UNIT_WEIGHTS
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert module._weight(norm, x) is module._weight(norm, x) and len(module._UNIT_WEIGHTS) == 1
    weighted = make((1, 20, 256), torch.bfloat16, "cpu", 6, transposed=False)[0]
    assert module._weight(weighted, x) is weighted.weight


def test_custom_op_takes_a_weightless_norm():
    norm = RMSNorm(64, eps=1e-6, elementwise_affine=False)
    x = torch.randn(1, 9, 4, 64).to(torch.bfloat16).transpose(1, 2)
    torch.library.opcheck(torch.ops.diffusers_fastpath.rmsnorm.default, (x, None, 1e-6))
    got = torch.ops.diffusers_fastpath.rmsnorm(x, None, 1e-6)
    assert torch.equal(got, norm(x)) and got.stride() == x.stride()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 6144, 4096), (1, 126, 2048), (2, 333, 3072), (1, 4096, 24, 128)], ids=str)
def test_weightless_norm_matches_eager_bitwise_on_the_gpu(shape, dtype):
    """LTX-2's weightless pre-norms (video 4096 wide over 768x512x121's 6144 tokens, audio 2048; a CFG batch; a
    head-wide one): the kernel with a unit weight, its output poisoned, equal to diffusers' weightless forward; fast
    through the op; and inside a CUDA graph whose capture made the unit weight, equal on replay."""
    import sys

    from diffusers_fastpath.ops._build import load_extension

    module = sys.modules["diffusers_fastpath.ops.rmsnorm"]
    load_extension()
    with torch.no_grad():
        for seed in range(2):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            norm = RMSNorm(shape[-1], eps=1e-6, elementwise_affine=False)
            x = (torch.randn(shape, generator=gen, device="cuda") * 3).to(dtype)
            ref = norm(x)
            rows = x.reshape(-1, 1, shape[-1])
            out = torch.full_like(rows, float("nan"))
            unit = torch.ones(shape[-1], dtype=dtype, device="cuda")
            out.copy_(torch.ops.diffusers_fastpath._rmsnorm_plain_cuda(rows, unit, 1e-6))
            assert torch.equal(out.view(shape), ref)
            site = Site("rmsnorm")
            assert torch.equal(rmsnorm(norm, x, site), ref)
            assert site.fast == 1 and not site.fallback, site
        static = x.clone()  # (the self-verification of this (dtype, D) ran above, outside the capture)
        module._UNIT_WEIGHTS.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = rmsnorm(norm, static)
        assert not module._UNIT_WEIGHTS
        static.copy_((torch.randn(shape, device="cuda") * 2).to(dtype))
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, norm(static))
    assert RMSNORM.disabled is None
