"""layernorm_scale_shift: bit-exact against eager F.layer_norm + modulate on GPU at FLUX.1's shapes with the fast
path verified (full-size FLUX.1-dev step included), and its guards, self-verification and fallbacks everywhere."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.normalization import FP32LayerNorm

import diffusers_fastpath as fp
from diffusers_fastpath.ops import Site, layernorm_scale_shift, layernorm_scale_shift_ref
from diffusers_fastpath.ops import _policy
from diffusers_fastpath.ops.layernorm_scale_shift import LAYERNORM_SCALE_SHIFT
from diffusers_fastpath.ops.modulate_scale_shift import MODULATE_SCALE_SHIFT, modulate_scale_shift_ref
from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs

# [B, L, D]: 1024x1024 image tokens, 512 text tokens, the single blocks' 4096 + 512, a CFG batch, 512x512 with CFG,
# short and odd sequences; FLUX.2-dev's D = 6144 (the widest row the kernel holds; its single blocks' 4096 + 512
# tokens), and widths whose last vectors leave threads idle (5120: Wan 14B; 3840: Z-Image; 4104).
SHAPES = [
    (1, 4096, 3072), (1, 512, 3072), (1, 4608, 3072), (2, 4096, 3072), (2, 1024, 3072), (2, 77, 3072), (1, 17, 64),
    (1, 4608, 6144), (2, 512, 6144), (1, 333, 5120), (1, 257, 3840), (1, 65, 4104),
]
DTYPES = [torch.bfloat16, torch.float16]
# How the adaLN modules hand over scale/shift: chunks of the linear's output (AdaLayerNormZero: 6 chunks,
# AdaLayerNormZeroSingle: 3), or one row broadcast over the batch.
LAYOUTS = ["chunk6", "chunk3", "broadcast_row"]


def make_inputs(shape, dtype, layout, device, seed):
    """A plain ``nn.LayerNorm`` as FLUX.1 has it, activations like a residual stream (per-row offset and spread, rare
    large outliers: the mean matters, not only the variance) and scale/shift laid out as the adaLN modules make them."""
    b, l, d = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    x = rnd(b, l, d) * (0.5 + 4 * torch.rand(b, l, 1, generator=gen, device=device)) + 3 * rnd(b, l, 1)
    x = torch.where(torch.rand(b, l, d, generator=gen, device=device) < 1e-3, 40 * x, x).to(dtype)
    if layout == "broadcast_row":
        scale, shift = rnd(1, d).to(dtype), rnd(1, d).to(dtype)
    else:
        chunks = 6 if layout == "chunk6" else 3
        shift, scale = rnd(b, chunks * d).to(dtype).chunk(chunks, dim=1)[:2]
    norm = torch.nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
    return norm, x, scale, shift


# --- GPU: the contract ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layernorm_scale_shift_matches_eager_bitwise_and_verifies(shape, dtype, layout):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    for seed in range(2):  # fresh inputs each round
        norm, x, scale, shift = make_inputs(shape, dtype, layout, "cuda", seed)
        if layout != "broadcast_row":
            assert scale.stride(0) == (6 if layout == "chunk6" else 3) * shape[2]  # views, not copies
        ref = layernorm_scale_shift_ref(norm, x, scale, shift)  # eager: F.layer_norm, then three kernels
        out = torch.full_like(x, float("nan"))  # poisoned: every element must be written
        torch.ops.diffusers_fastpath._layernorm_scale_shift_cuda_out(out, x, scale, shift, norm.eps)
        torch.cuda.synchronize()
        assert torch.equal(out, ref)

        site = Site("layernorm_scale_shift")
        assert torch.equal(layernorm_scale_shift(norm, x, scale, shift, site), ref)
        assert site.fast == 1 and not site.fallback, site  # the fast path ran and passed its own check
    key = (str(dtype).removeprefix("torch."), shape[2])
    assert LAYERNORM_SCALE_SHIFT.disabled is None and LAYERNORM_SCALE_SHIFT.verified == {key}
    assert LAYERNORM_SCALE_SHIFT.status == f"enabled, verified for {key[0]}/{key[1]}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layernorm_scale_shift_special_rows_match_eager(dtype):
    """Rows that are constant (variance 0: rstd = rsqrt(eps)), all zero, near the dtype's limits, or hold an inf or a
    NaN: every element has eager's bits, NaN in the same places (torch.equal can never hold for NaN)."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    norm, x, scale, shift = make_inputs((2, 64, 3072), dtype, "chunk6", "cuda", 7)
    big = torch.finfo(dtype).max / 4
    x[0, 0] = 1.5
    x[0, 1] = 0.0
    x[0, 2, ::2], x[0, 2, 1::2] = big, -big
    x[0, 3, 5] = float("inf")
    x[0, 4, 9] = float("nan")
    x[1, 5] = torch.finfo(dtype).tiny
    ref = layernorm_scale_shift_ref(norm, x, scale, shift)
    out = torch.full_like(x, 1.2345)
    torch.ops.diffusers_fastpath._layernorm_scale_shift_cuda_out(out, x, scale, shift, norm.eps)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.masked_fill(out.isnan(), 0), ref.masked_fill(ref.isnan(), 0))


@pytest.mark.gpu
def test_layernorm_opcheck_cuda():
    norm, x, scale, shift = make_inputs((2, 64, 3072), torch.bfloat16, "chunk6", "cuda", 0)
    torch.library.opcheck(torch.ops.diffusers_fastpath.layernorm_scale_shift.default, (x, scale, shift, norm.eps))


@pytest.mark.gpu
def test_compiled_patched_flux_runs_the_verified_op_exactly(unpatch_after):
    """Once a signature is verified in eager, fullgraph torch.compile (aot_eager keeps aten's kernels) emits the fused
    op at all 10 adaLN sites of the tiny FLUX, and the output stays bit-identical to unpatched eager."""
    model = build_flux_transformer("flux-tiny", torch.bfloat16, "cuda", seed=41)
    inputs = flux_transformer_inputs(model, batch=2, grid=(8, 8), txt_tokens=16, seed=42)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    with torch.no_grad():
        ref = model(**inputs).sample
        fp.patch(model)
        unpatch_after(model)
        assert torch.equal(model(**inputs).sample, ref)  # eager: verifies (bfloat16, 32)
        assert LAYERNORM_SCALE_SHIFT.verified == {("bfloat16", 32)} and LAYERNORM_SCALE_SHIFT.disabled is None
        out = torch.compile(model, fullgraph=True, backend=backend)(**inputs).sample
    assert torch.equal(out, ref)
    assert graphs[0].code.count("diffusers_fastpath.layernorm_scale_shift") == 10


@torch.no_grad()
@pytest.mark.gpu
def test_flux_dev_one_step_1024_uses_the_verified_fused_layernorm(unpatch_after):
    """Full-size FLUX.1-dev, one step at 1024x1024 (4096 image + 512 text tokens): patched == unpatched bit for bit,
    all 114 adaLN sites on the fused op, which verified itself and stayed enabled."""
    model = build_flux_transformer("flux-dev", torch.bfloat16, "cuda", seed=0)
    try:
        inputs = flux_transformer_inputs(model, grid=(64, 64), txt_tokens=512, seed=5)
        ref = model(**inputs).sample
        assert torch.isfinite(ref).all() and ref.std() > 0.01
        fp.patch(model)
        unpatch_after(model)
        assert torch.equal(model(**inputs).sample, ref)
        rep = fp.report(model)
        adaln = [s for s in rep.sites if s.op == "layernorm_scale_shift"]
        assert len(adaln) == 19 * 4 + 38, str(rep)
        assert all(s.fast == 1 and s.fallback == 0 for s in adaln), str(rep)
        assert LAYERNORM_SCALE_SHIFT.disabled is None and LAYERNORM_SCALE_SHIFT.verified == {("bfloat16", 3072)}
    finally:
        del model
        torch.cuda.empty_cache()


# --- CPU: reference, guards, self-verification ------------------------------------------------------------------


@pytest.fixture
def pretend_cuda(monkeypatch):
    """Tensors claim to be on CUDA, so the guard gets past the device check; the modulate op that the fallback calls
    then runs its own eager expression as its 'kernel' (exact by construction) instead of building the extension."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(MODULATE_SCALE_SHIFT, "kernel", modulate_scale_shift_ref)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("cpu", "device cpu"),
        ("fp32", "dtype float32"),
        ("mixed_dtypes", "mixed dtypes"),
        ("affine", "norm not a LayerNorm over the last dim without affine"),
        ("fp32_layer_norm", "norm not a LayerNorm over the last dim without affine"),
        ("wide", "D above 6144"),
        ("odd_dim", "D not a multiple of 8"),
        ("strided_x", "x not contiguous"),
        ("strided_scale", "scale/shift strided"),
        ("requires_grad", "requires grad"),
    ],
)
def test_guard_falls_back_to_exact_eager_with_reason(case, reason, request):
    dim = {"wide": 6152, "odd_dim": 36}.get(case, 64)
    norm, x, scale, shift = make_inputs((2, 24, dim), torch.bfloat16, "chunk6", "cpu", 1)
    if case != "cpu":
        request.getfixturevalue("pretend_cuda")
    if case == "fp32":
        x, scale, shift = x.float(), scale.float(), shift.float()
    elif case == "mixed_dtypes":
        scale = scale.half()
    elif case == "affine":
        norm = torch.nn.LayerNorm(dim, eps=1e-6).to(torch.bfloat16)
    elif case == "fp32_layer_norm":
        norm = FP32LayerNorm(dim, elementwise_affine=False, bias=False)
    elif case == "strided_x":
        x = torch.cat([x, x], dim=2)[..., ::2]
    elif case == "strided_scale":
        scale = torch.cat([scale, scale], dim=1)[:, ::2]
    elif case == "requires_grad":
        x = x.clone().requires_grad_()
    site = Site("layernorm_scale_shift")
    out = layernorm_scale_shift(norm, x, scale, shift, site)
    assert torch.equal(out, layernorm_scale_shift_ref(norm, x, scale, shift))
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}


def test_flux_layouts_pass_the_guard(pretend_cuda):
    layouts = [((1, 8, 3072), "chunk6"), ((2, 8, 3072), "chunk6"), ((2, 8, 3072), "chunk3"), ((1, 5, 32), "chunk6")]
    for shape, layout in layouts:
        norm, x, scale, shift = make_inputs(shape, torch.bfloat16, layout, "cpu", 0)
        assert LAYERNORM_SCALE_SHIFT.guard(norm, x, scale, shift) is None, (shape, layout)


@pytest.fixture
def guard_open(monkeypatch):
    monkeypatch.setattr(LAYERNORM_SCALE_SHIFT, "guard", lambda *a, **k: None)


def test_a_kernel_that_is_not_bit_exact_is_disabled_and_eager_returned(guard_open, monkeypatch, fastpath_log):
    def off_by_one_ulp(norm, x, scale, shift):
        out = layernorm_scale_shift_ref(norm, x, scale, shift)
        return (out.view(torch.int16) + 1).view(out.dtype)  # wrong in the last bit everywhere

    monkeypatch.setattr(LAYERNORM_SCALE_SHIFT, "kernel", off_by_one_ulp)
    site = Site("layernorm_scale_shift")
    for seed in range(3):
        norm, x, scale, shift = make_inputs((1, 40, 64), torch.bfloat16, "chunk6", "cpu", seed)
        ref = layernorm_scale_shift_ref(norm, x, scale, shift)
        assert torch.equal(layernorm_scale_shift(norm, x, scale, shift, site), ref)
    assert "not bit-exact against this platform's eager result for ('bfloat16', 64)" in LAYERNORM_SCALE_SHIFT.disabled
    assert not LAYERNORM_SCALE_SHIFT.verified and site.fast == 0
    assert dict(site.fallback) == {_policy.REASON_DISABLED: 3}
    warnings = [r for r in fastpath_log.records if "disabling the fused op 'layernorm_scale_shift'" in r.getMessage()]
    assert len(warnings) == 1 and "not bit-exact" in warnings[0].getMessage()


def test_a_bit_exact_kernel_is_verified_once_per_signature(guard_open, monkeypatch):
    calls = {"ref": 0}
    real_ref = LAYERNORM_SCALE_SHIFT.ref

    def counting_ref(*args):
        calls["ref"] += 1
        return real_ref(*args)

    monkeypatch.setattr(LAYERNORM_SCALE_SHIFT, "ref", counting_ref)
    monkeypatch.setattr(LAYERNORM_SCALE_SHIFT, "kernel", layernorm_scale_shift_ref)  # exact by construction
    site = Site("layernorm_scale_shift")
    for seed in range(3):
        layernorm_scale_shift(*make_inputs((2, 24, 64), torch.bfloat16, "chunk6", "cpu", seed), site)
    assert calls["ref"] == 1 and site.fast == 3  # verified on the first call only
    layernorm_scale_shift(*make_inputs((2, 24, 128), torch.bfloat16, "chunk3", "cpu", 3), site)
    layernorm_scale_shift(*make_inputs((2, 24, 64), torch.float16, "chunk3", "cpu", 4), site)
    assert calls["ref"] == 3 and site.fast == 5  # a new row length or dtype is a new signature
    assert LAYERNORM_SCALE_SHIFT.verified == {("bfloat16", 64), ("bfloat16", 128), ("float16", 64)}
    assert LAYERNORM_SCALE_SHIFT.status == "enabled, verified for bfloat16/64, bfloat16/128, float16/64"


def test_unverified_signatures_stay_eager_under_compile(guard_open, monkeypatch):
    monkeypatch.setattr(LAYERNORM_SCALE_SHIFT, "custom_op", lambda *a: (_ for _ in ()).throw(AssertionError("emitted")))
    norm, x, scale, shift = make_inputs((1, 40, 64), torch.bfloat16, "chunk6", "cpu", 3)
    fn = torch.compile(lambda *a: layernorm_scale_shift(*a), fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(norm, x, scale, shift), layernorm_scale_shift_ref(norm, x, scale, shift))


def test_verified_signatures_compile_to_the_custom_op(guard_open):
    LAYERNORM_SCALE_SHIFT.verified.add(("bfloat16", 64))
    norm, x, scale, shift = make_inputs((2, 40, 64), torch.bfloat16, "chunk6", "cpu", 4)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda *a: layernorm_scale_shift(*a), fullgraph=True, backend=backend)
    assert torch.equal(fn(norm, x, scale, shift), layernorm_scale_shift_ref(norm, x, scale, shift))
    assert graphs[0].code.count("diffusers_fastpath.layernorm_scale_shift") == 1


@pytest.mark.parametrize("batch, layout", [(1, "chunk6"), (2, "chunk3"), (2, "broadcast_row")])
def test_custom_op_opcheck_and_eager_fallback_cpu(batch, layout):
    norm, x, scale, shift = make_inputs((batch, 24, 64), torch.bfloat16, layout, "cpu", 0)
    op = torch.ops.diffusers_fastpath.layernorm_scale_shift.default
    torch.library.opcheck(op, (x, scale, shift, norm.eps))
    assert torch.equal(op(x, scale, shift, norm.eps), layernorm_scale_shift_ref(norm, x, scale, shift))


def test_patched_tiny_flux_with_the_fast_path_taken_matches_unpatched(monkeypatch, unpatch_after):
    """With the guard open and an exact stand-in for the kernel, every adaLN site of a patched FLUX takes the fast
    path (counted), the op verifies its one signature once, and the output equals unpatched diffusers bit for bit."""
    model = build_flux_transformer("flux-tiny", torch.bfloat16, seed=43)
    inputs = flux_transformer_inputs(model, batch=2, grid=(4, 6), txt_tokens=7, seed=44)
    with torch.no_grad():
        ref = model(**inputs).sample
        monkeypatch.setattr(LAYERNORM_SCALE_SHIFT, "guard", lambda *a, **k: None)
        monkeypatch.setattr(LAYERNORM_SCALE_SHIFT, "kernel", layernorm_scale_shift_ref)
        fp.patch(model)
        unpatch_after(model)
        out = model(**inputs).sample
    assert torch.equal(out, ref)
    rep = fp.report(model)
    adaln = [s for s in rep.sites if s.op == "layernorm_scale_shift"]
    assert len(adaln) == 10 and all(s.fast == 1 for s in adaln)
    assert LAYERNORM_SCALE_SHIFT.verified == {("bfloat16", 32)}


# --- layernorm_scale_shift_fp32: Wan's chain (an fp32 LayerNorm of the upcast stream, an fp32 modulate) -----------

# Wan 2.1 14B at 832x480x81 (32,760 tokens of D = 5120), a CFG batch at 480p, Wan 2.1 1.3B's D = 1536, a small case
WAN_SHAPES = [(1, 32760, 5120), (2, 1560, 5120), (1, 1000, 1536), (1, 17, 64)]


def make_wan_inputs(shape, dtype, device, seed):
    """Wan's adaLN site: diffusers' ``FP32LayerNorm`` without affine, activations like a residual stream, and fp32
    scale/shift rows of the ``[B, 6, D]`` table ``scale_shift_table + temb.float()`` (row batch stride 6D)."""
    from diffusers.models.normalization import FP32LayerNorm

    norm, x, _, _ = make_inputs(shape, dtype, "chunk6", device, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 100)
    table = torch.randn(shape[0], 6, shape[2], generator=gen, device=device)
    return FP32LayerNorm(shape[2], eps=1e-6, elementwise_affine=False), x, table[:, 1], table[:, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", WAN_SHAPES, ids=str)
def test_layernorm_scale_shift_fp32_matches_eager_bitwise_and_verifies(shape, dtype):
    from diffusers_fastpath.ops import layernorm_scale_shift_fp32, layernorm_scale_shift_fp32_ref
    from diffusers_fastpath.ops._build import load_extension
    from diffusers_fastpath.ops.layernorm_scale_shift import LAYERNORM_SCALE_SHIFT_FP32

    load_extension()
    for seed in range(2):
        norm, x, scale, shift = make_wan_inputs(shape, dtype, "cuda", seed)
        assert scale.stride(0) == 6 * shape[2]  # views of the table, not copies
        ref = layernorm_scale_shift_fp32_ref(norm, x, scale, shift)
        # diffusers' own line, with the [B, 1, D] chunks it takes
        assert torch.equal(ref, (norm(x.float()) * (1 + scale[:, None]) + shift[:, None]).type_as(x))
        out = torch.full_like(x, float("nan"))
        torch.ops.diffusers_fastpath._layernorm_scale_shift_cuda_out(out, x, scale, shift, norm.eps)
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
        site = Site("layernorm_scale_shift_fp32")
        assert torch.equal(layernorm_scale_shift_fp32(norm, x, scale, shift, site), ref)
        assert site.fast == 1 and not site.fallback, site
    key = (str(dtype).removeprefix("torch."), shape[2])
    assert LAYERNORM_SCALE_SHIFT_FP32.disabled is None and LAYERNORM_SCALE_SHIFT_FP32.verified == {key}


def test_fp32_chain_guards_apart_from_flux_chain():
    """Each op takes only its own chain's dtypes: fp32 rows go to the fp32 op, rows of x's dtype to FLUX's."""
    from diffusers_fastpath.ops.layernorm_scale_shift import LAYERNORM_SCALE_SHIFT_FP32

    norm, x, scale, shift = make_wan_inputs((2, 9, 64), torch.bfloat16, "cpu", 3)
    assert LAYERNORM_SCALE_SHIFT_FP32.guard(norm, x, scale, shift) == "device cpu"
    assert LAYERNORM_SCALE_SHIFT.guard(torch.nn.LayerNorm(64, elementwise_affine=False), x, scale, shift) == "mixed dtypes"
    assert LAYERNORM_SCALE_SHIFT_FP32.guard(norm, x, scale.bfloat16(), shift.bfloat16()) == "mixed dtypes"
    affine = FP32LayerNorm(64, eps=1e-6, elementwise_affine=True)  # Wan's norm2: an affine, not this chain
    assert LAYERNORM_SCALE_SHIFT_FP32.guard(affine, x, scale, shift).startswith("norm not a LayerNorm")


def test_fp32_chain_rounds_once():
    """Rounding the LayerNorm's output to bf16 before the modulate (FLUX's chain) is not Wan's: many outputs change."""
    from diffusers_fastpath.ops import layernorm_scale_shift_fp32_ref

    norm, x, scale, shift = make_wan_inputs((1, 64, 256), torch.bfloat16, "cpu", 4)
    rounded = (norm(x.float()).to(x.dtype).float() * (1 + scale[:, None]) + shift[:, None]).to(x.dtype)
    mismatch = (rounded != layernorm_scale_shift_fp32_ref(norm, x, scale, shift)).float().mean().item()
    assert mismatch > 0.05


def test_fp32_custom_op_opcheck_cpu():
    norm, x, scale, shift = make_wan_inputs((2, 9, 64), torch.bfloat16, "cpu", 5)
    op = torch.ops.diffusers_fastpath.layernorm_scale_shift_fp32.default
    torch.library.opcheck(op, (x, scale, shift, norm.eps))
    from diffusers_fastpath.ops import layernorm_scale_shift_fp32_ref

    assert torch.equal(op(x, scale, shift, norm.eps), layernorm_scale_shift_fp32_ref(norm, x, scale, shift))


# --- layernorm_affine_fp32: Wan's norm2 (an FP32LayerNorm with weight and bias of the upcast stream) ----------------


def make_norm2_inputs(shape, dtype, device, seed):
    """Wan's ``norm2``: an ``FP32LayerNorm`` with random weight and bias of the model's dtype (its forward upcasts
    them), activations like a residual stream."""
    from diffusers.models.normalization import FP32LayerNorm

    _, x, _, _ = make_inputs(shape, dtype, "chunk6", device, seed)
    norm = FP32LayerNorm(shape[2], eps=1e-6, elementwise_affine=True).to(device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 200)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(shape[2], generator=gen, device=device))
        norm.bias.copy_(0.1 * torch.randn(shape[2], generator=gen, device=device))
    return norm.requires_grad_(False), x


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", WAN_SHAPES, ids=str)
def test_layernorm_affine_fp32_matches_eager_bitwise_and_verifies(shape, dtype):
    from diffusers_fastpath.ops import layernorm_affine_fp32, layernorm_affine_fp32_ref
    from diffusers_fastpath.ops._build import load_extension
    from diffusers_fastpath.ops.layernorm_scale_shift import LAYERNORM_AFFINE_FP32

    load_extension()
    for seed in range(2):
        norm, x = make_norm2_inputs(shape, dtype, "cuda", seed)
        ref = layernorm_affine_fp32_ref(norm, x)
        assert torch.equal(ref, norm(x.float()).type_as(x))  # Wan's own line
        poison = torch.full_like(x, float("nan"))
        del poison  # its block is what the caching allocator hands the kernel's output next: NaN unless written
        raw = torch.ops.diffusers_fastpath._layernorm_affine_fp32_cuda(x, norm.weight.float(), norm.bias.float(), norm.eps)
        assert torch.equal(raw, ref)
        site = Site("layernorm_affine_fp32")
        assert torch.equal(layernorm_affine_fp32(norm, x, site), ref)
        assert site.fast == 1 and not site.fallback, site
    key = (str(dtype).removeprefix("torch."), shape[2])
    assert LAYERNORM_AFFINE_FP32.disabled is None and LAYERNORM_AFFINE_FP32.verified == {key}


@pytest.mark.parametrize(
    "case, reason",
    [("no_affine", "norm not an FP32LayerNorm over the last dim with weight and bias"),
     ("plain_layer_norm", "norm not an FP32LayerNorm over the last dim with weight and bias"),
     ("requires_grad", "requires grad"), ("fp32", "dtype float32"), ("cpu", "device cpu")],
)
def test_affine_fp32_guard_falls_back_to_exact_eager_with_reason(case, reason, request):
    from diffusers.models.normalization import FP32LayerNorm

    from diffusers_fastpath.ops import layernorm_affine_fp32, layernorm_affine_fp32_ref

    norm, x = make_norm2_inputs((2, 9, 64), torch.float32 if case == "fp32" else torch.bfloat16, "cpu", 6)
    if case == "no_affine":
        norm = FP32LayerNorm(64, eps=1e-6, elementwise_affine=False)
    elif case == "plain_layer_norm":
        norm = torch.nn.LayerNorm(64, eps=1e-6).requires_grad_(False)
    elif case == "requires_grad":
        norm.requires_grad_(True)
    if case != "cpu":
        request.getfixturevalue("pretend_cuda")
    site = Site("layernorm_affine_fp32")
    with torch.set_grad_enabled(case == "requires_grad"):
        out = layernorm_affine_fp32(norm, x, site)
        assert torch.equal(out, layernorm_affine_fp32_ref(norm, x))
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}


@pytest.mark.parametrize("case, reason", [
    ("weight_shape", "norm not an FP32LayerNorm over the last dim with weight and bias"),
    ("weight_device", "devices differ")])
def test_affine_fp32_guard_refuses_weights_the_kernel_cannot_read(case, reason, pretend_cuda):
    """A weight and bias other than x's ``[D]`` rows, or on another device than x: the kernel would read D elements
    of each on x's device; the guard refuses (eager raises on both, and so does the op, through eager)."""
    from diffusers_fastpath.ops import layernorm_affine_fp32, layernorm_affine_fp32_ref
    from diffusers_fastpath.ops.layernorm_scale_shift import LAYERNORM_AFFINE_FP32

    norm, x = make_norm2_inputs((2, 9, 64), torch.bfloat16, "cpu", 7)
    if case == "weight_shape":
        norm.weight, norm.bias = (torch.nn.Parameter(t[:1], requires_grad=False) for t in (norm.weight, norm.bias))
    else:
        norm.to("meta")
    with torch.no_grad():
        assert LAYERNORM_AFFINE_FP32.guard(norm, x) == reason
        site = Site("layernorm_affine_fp32")
        with pytest.raises(RuntimeError):
            layernorm_affine_fp32_ref(norm, x)
        with pytest.raises(RuntimeError):
            layernorm_affine_fp32(norm, x, site)
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}


def test_affine_fp32_custom_op_opcheck_cpu():
    from diffusers_fastpath.ops import layernorm_affine_fp32_ref

    norm, x = make_norm2_inputs((2, 9, 64), torch.bfloat16, "cpu", 7)
    op = torch.ops.diffusers_fastpath.layernorm_affine_fp32.default
    torch.library.opcheck(op, (x, norm.weight, norm.bias, norm.eps))
    assert torch.equal(op(x, norm.weight, norm.bias, norm.eps), layernorm_affine_fp32_ref(norm, x))


# --- gated: the residual update and the LayerNorm-modulate of the new stream ----------------------------------------


def make_gated_inputs(shape, dtype, layout, device, seed):
    """`make_inputs`'s norm, stream (as the residual) and scale/shift, an update like a branch output and the gate: the
    adaLN chunk after scale (``gate_msa.unsqueeze(1)``, a view) or one row for the batch."""
    norm, residual, scale, shift = make_inputs(shape, dtype, layout, device, seed)
    b, l, d = shape
    gen = torch.Generator(device=device).manual_seed(seed + 100)
    update = (torch.randn(b, l, d, generator=gen, device=device) * 2).to(dtype)
    if layout == "broadcast_row":
        gate = torch.randn(1, 1, d, generator=gen, device=device).to(dtype)
    else:
        gate = scale.as_strided((b, 1, d), (scale.stride(0), d, 1), scale.storage_offset() + d)  # the next chunk
    return norm, residual, gate, update, scale, shift


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gated_layernorm_scale_shift_matches_eager_bitwise_and_verifies(shape, dtype, layout):
    from diffusers_fastpath.ops._build import load_extension
    from diffusers_fastpath.ops.layernorm_scale_shift import (GATED_LAYERNORM_SCALE_SHIFT, gated_layernorm_scale_shift,
                                                              gated_layernorm_scale_shift_ref)

    load_extension()
    for seed in range(2):
        args = make_gated_inputs(shape, dtype, layout, "cuda", seed)
        norm, residual, gate, update, scale, shift = args
        x_ref, ref = gated_layernorm_scale_shift_ref(*args)  # eager: mul, add, F.layer_norm, three modulate kernels
        x_out, out = torch.full_like(residual, float("nan")), torch.full_like(residual, float("nan"))  # poisoned
        torch.ops.diffusers_fastpath._gated_layernorm_scale_shift_cuda_out(x_out, out, residual, gate, update, scale,
                                                                           shift, norm.eps)
        torch.cuda.synchronize()
        assert torch.equal(x_out, x_ref) and torch.equal(out, ref)
        site = Site("gated_layernorm_scale_shift")
        got = gated_layernorm_scale_shift(*args, site)
        assert torch.equal(got[0], x_ref) and torch.equal(got[1], ref)
        assert site.fast == 1 and not site.fallback, site
    key = (str(dtype).removeprefix("torch."), shape[2])
    assert GATED_LAYERNORM_SCALE_SHIFT.disabled is None and key in GATED_LAYERNORM_SCALE_SHIFT.verified


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_special_values_match_eager(dtype):
    """An inf or a NaN in the update, a product that overflows, a stream that cancels to a constant row: eager's bits
    in both outputs, NaN in the same places."""
    from diffusers_fastpath.ops.layernorm_scale_shift import gated_layernorm_scale_shift_ref

    norm, residual, gate, update, scale, shift = make_gated_inputs((2, 64, 3072), dtype, "chunk6", "cuda", 8)
    big = torch.finfo(dtype).max / 2
    update[0, 0, 3] = float("inf")
    update[0, 1, 7] = float("nan")
    update[1, 2] = big
    residual[1, 3], update[1, 3] = 1.0, 0.0
    refs = gated_layernorm_scale_shift_ref(norm, residual, gate, update, scale, shift)
    outs = torch.ops.diffusers_fastpath._gated_layernorm_scale_shift_cuda(residual, gate, update, scale, shift, norm.eps)
    for out, ref in zip(outs, refs):
        assert torch.equal(out.isnan(), ref.isnan())
        assert torch.equal(out.masked_fill(out.isnan(), 0), ref.masked_fill(ref.isnan(), 0))


@pytest.mark.gpu
def test_gated_opcheck_cuda():
    norm, residual, gate, update, scale, shift = make_gated_inputs((2, 64, 3072), torch.bfloat16, "chunk6", "cuda", 0)
    torch.library.opcheck(torch.ops.diffusers_fastpath.gated_layernorm_scale_shift.default,
                          (residual, gate, update, scale, shift, norm.eps))


@pytest.mark.parametrize("case, reason", [
    ("cpu", "device cpu"),
    ("full_gate", "gate not one row per sample"),
    ("affine", "norm not a LayerNorm over the last dim without affine"),
    ("requires_grad", "requires grad"),
    ("strided_update", "residual/update not contiguous"),
    ("float32", "dtype float32"),
])
def test_gated_guard_falls_back_to_the_two_ops_exactly(case, reason, request, monkeypatch):
    from diffusers_fastpath.ops.gated_residual import GATED_RESIDUAL, gated_residual_ref
    from diffusers_fastpath.ops.layernorm_scale_shift import (gated_layernorm_scale_shift,
                                                              gated_layernorm_scale_shift_ref)

    # the fallback's two ops, each exact: their eager expressions as their kernels (no extension on a CPU)
    monkeypatch.setattr(GATED_RESIDUAL, "kernel", gated_residual_ref)
    monkeypatch.setattr(LAYERNORM_SCALE_SHIFT, "kernel", layernorm_scale_shift_ref)

    norm, residual, gate, update, scale, shift = make_gated_inputs((2, 24, 64), torch.bfloat16, "chunk6", "cpu", 3)
    if case == "full_gate":
        gate = update.flip(1)
    elif case == "affine":
        norm = torch.nn.LayerNorm(64, eps=1e-6).requires_grad_(False)
    elif case == "requires_grad":
        update.requires_grad_(True)
    elif case == "strided_update":
        update = torch.randn(2, 48, 64).to(torch.bfloat16)[:, ::2]
    elif case == "float32":
        residual, gate, update, scale, shift = (t.float() for t in (residual, gate, update, scale, shift))
    if case != "cpu":
        request.getfixturevalue("pretend_cuda")
    site = Site("gated_layernorm_scale_shift")
    with torch.set_grad_enabled(case == "requires_grad"):
        got = gated_layernorm_scale_shift(norm, residual, gate, update, scale, shift, site)
        refs = gated_layernorm_scale_shift_ref(norm, residual, gate, update, scale, shift)
    assert all(map(torch.equal, got, refs))
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}
    assert GATED_RESIDUAL.disabled is None and LAYERNORM_SCALE_SHIFT.disabled is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gated_custom_op_opcheck_and_eager_fallback_cpu(layout):
    from diffusers_fastpath.ops.layernorm_scale_shift import gated_layernorm_scale_shift_ref

    norm, residual, gate, update, scale, shift = make_gated_inputs((2, 24, 64), torch.bfloat16, layout, "cpu", 5)
    op = torch.ops.diffusers_fastpath.gated_layernorm_scale_shift.default
    torch.library.opcheck(op, (residual, gate, update, scale, shift, norm.eps))
    got = op(residual, gate, update, scale, shift, norm.eps)
    assert all(map(torch.equal, got, gated_layernorm_scale_shift_ref(norm, residual, gate, update, scale, shift)))
