"""layernorm_modulate: the LayerNorm + modulate forms `layernorm_scale_shift` does not take (FLUX.3's per-token rows,
affine nn.LayerNorms, diffusers' FP32LayerNorm), bit-exact against eager on the GPU at the families' shapes with
poisoned outputs; on CPU its guards (every refusal runs the exact eager expression, counted), its self-verification
per form, its custom op, and the zoo classes whose LayerNorm sites it makes fast."""

from __future__ import annotations

import inspect

import pytest
import torch
from diffusers.models.normalization import FP32LayerNorm

import diffusers_fastpath as fp
from diffusers_fastpath._state import sites_of
from diffusers_fastpath.models import _chains
from diffusers_fastpath.models._norm_methods import modulate_scale_rows, norm_method_hints
from diffusers_fastpath.ops import (Site, _policy, layernorm_modulate, layernorm_modulate_ref, layernorm_scale,
                                    layernorm_scale_ref)
from diffusers_fastpath.ops.layernorm_modulate import LAYERNORM_MODULATE, LAYERNORM_SCALE
from diffusers_fastpath.testing import zoo

DTYPES = [torch.bfloat16, torch.float16]
# the norms the op takes: FLUX.3's plain LayerNorm, an affine one of the model's dtype (CogVideoX, ConsisID,
# EasyAnimate's norm_out), FP32LayerNorm without affine (AuraFlow) and with (EasyAnimate's blocks; fp32 weights too)
NORMS = ["plain", "affine", "fp32", "fp32_affine", "fp32_affine_fp32_weights"]


def make_norm(kind: str, dim: int, dtype, device, seed: int) -> torch.nn.Module:
    """A norm of `kind` with random weight and bias (never ones and zeros, so the affine epilogue is exercised)."""
    affine = "affine" in kind
    cls = FP32LayerNorm if kind.startswith("fp32") else torch.nn.LayerNorm
    norm = cls(dim, eps=1e-5 if cls is FP32LayerNorm else 1e-6, elementwise_affine=affine)
    norm = norm.to(device=device, dtype=torch.float32 if kind.endswith("fp32_weights") else dtype)
    if affine:
        gen = torch.Generator(device=device).manual_seed(seed + 300)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=gen, device=device))
            norm.bias.copy_(0.2 * torch.randn(dim, generator=gen, device=device))
    return norm.requires_grad_(False)


def make_inputs(shape, dtype, rows: str, device, seed, norm: str = "plain"):
    """x like a residual stream (per-row offset and spread, rare outliers) and scale/shift as the models hand them:
    ``per_token``: FLUX.3's chunks of a per-token ``[B, S, 3D]`` modulation (views, seq stride 3D); ``per_sample``:
    ``[B, 1, D]`` views of a ``[B, 6D]`` adaLN output (CogVideoX / AuraFlow after ``[:, None]``)."""
    b, s, d = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *size: torch.randn(*size, generator=gen, device=device)  # noqa: E731
    x = rnd(b, s, d) * (0.5 + 4 * torch.rand(b, s, 1, generator=gen, device=device)) + 3 * rnd(b, s, 1)
    x = torch.where(torch.rand(b, s, d, generator=gen, device=device) < 1e-3, 40 * x, x).to(dtype)
    if rows == "per_token":
        shift, scale, _ = rnd(b, s, 3 * d).to(dtype).chunk(3, dim=-1)
    else:
        shift, scale = (t[:, None] for t in rnd(b, 6 * d).to(dtype).chunk(6, dim=1)[:2])
    return make_norm(norm, d, dtype, device, seed), x, scale, shift


def qwen21_scale_rows(batch, seq, dim, dtype, device, seed, text=256):
    """Qwen-Image 2.1's scale rows: a ``[B + 1, 2D]`` modulation chunk (the extra row from t = 0), its scale half
    through the model's own ``_select_modulation_rows`` with the target-token mask (text tokens take the t = 0 row):
    a fresh ``[B, S, D]`` tensor."""
    from diffusers.models.transformers.transformer_qwenimage21 import _select_modulation_rows

    gen = torch.Generator(device=device).manual_seed(seed + 500)
    params = torch.randn(batch + 1, 2 * dim, generator=gen, device=device).to(dtype)
    mask = torch.ones(seq, dtype=torch.bool, device=device)
    mask[:min(text, seq // 2)] = False
    return _select_modulation_rows(params.chunk(2, dim=-1)[0], mask)


# --- GPU: the contract ----------------------------------------------------------------------------------------------

# FLUX.3 (D = 3072): the image tokens of 1024x1024 (4096), its text (160), both joined, and a CFG batch
FLUX3_SHAPES = [(1, 4096, 3072), (1, 160, 3072), (1, 4096 + 160, 3072), (2, 4096, 3072)]
# the affine / FP32LayerNorm families: AuraFlow and EasyAnimate (3072), CogVideoX-2b and ConsisID (1920; 226 text)
AFFINE_SHAPES = [(1, 4096, 3072), (2, 1350, 1920), (1, 226, 1920)]


@pytest.fixture
def cuda_kernels():
    from diffusers_fastpath.ops._build import load_extension

    load_extension()


def _check_on_gpu(norm, x, scale, shift):
    """The raw op (into a poisoned block) and the fused op (fast, self-verified) against eager; shift None: the
    scale-only op."""
    from diffusers_fastpath.ops.layernorm_modulate import _affine_rows

    ref = layernorm_scale_ref(norm, x, scale) if shift is None else layernorm_modulate_ref(norm, x, scale, shift)
    poison = torch.full_like(x, float("nan"))
    del poison  # its block is what the caching allocator hands the kernel's output next: NaN unless written
    raw = torch.ops.diffusers_fastpath._layernorm_modulate_cuda(x, scale, shift, *_affine_rows(norm), norm.eps)
    torch.cuda.synchronize()
    assert torch.equal(raw, ref)
    site = Site("layernorm_modulate")
    fused = layernorm_scale(norm, x, scale, site) if shift is None else layernorm_modulate(norm, x, scale, shift, site)
    assert torch.equal(fused, ref)
    assert site.fast == 1 and not site.fallback, site  # the fast path ran and passed its own check


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX3_SHAPES, ids=str)
def test_flux3_per_token_rows_match_eager_bitwise_and_verify(shape, dtype, cuda_kernels):
    for seed in range(2):
        norm, x, scale, shift = make_inputs(shape, dtype, "per_token", "cuda", seed)
        assert scale.stride()[1:] == (3 * shape[2], 1)  # views of the modulation, not copies
        # FLUX.3's own line, `(1 + mod_scale) * norm(x) + mod_shift`: the reference's bits
        assert torch.equal((1 + scale) * norm(x) + shift, layernorm_modulate_ref(norm, x, scale, shift))
        _check_on_gpu(norm, x, scale, shift)
    assert LAYERNORM_MODULATE.disabled is None
    key = (str(dtype).removeprefix("torch."), shape[2], "LayerNorm", False, "per-token")
    assert LAYERNORM_MODULATE.verified == {key}


@pytest.mark.gpu
@pytest.mark.parametrize("norm_kind", NORMS[1:])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", AFFINE_SHAPES, ids=str)
def test_affine_and_fp32_norms_match_eager_bitwise_and_verify(shape, dtype, norm_kind, cuda_kernels):
    for seed in range(2):
        for rows in ("per_sample", "per_token"):
            _check_on_gpu(*make_inputs(shape, dtype, rows, "cuda", seed, norm_kind))
    assert LAYERNORM_MODULATE.disabled is None and len(LAYERNORM_MODULATE.verified) == 2  # per sample and per token


@pytest.mark.gpu
@pytest.mark.parametrize("norm_kind", NORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_rows_match_eager(dtype, norm_kind, cuda_kernels):
    """Constant rows (variance 0), zeros, values near the dtype's limits, an inf, a NaN: eager's bits everywhere, NaN
    in the same places."""
    from diffusers_fastpath.ops.layernorm_modulate import _affine_rows

    norm, x, scale, shift = make_inputs((2, 64, 3072), dtype, "per_token", "cuda", 7, norm_kind)
    big = torch.finfo(dtype).max / 4
    x[0, 0] = 1.5
    x[0, 1] = 0.0
    x[0, 2, ::2], x[0, 2, 1::2] = big, -big
    x[0, 3, 5] = float("inf")
    x[0, 4, 9] = float("nan")
    x[1, 5] = torch.finfo(dtype).tiny
    ref = layernorm_modulate_ref(norm, x, scale, shift)
    out = torch.ops.diffusers_fastpath._layernorm_modulate_cuda(x, scale, shift, *_affine_rows(norm), norm.eps)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.masked_fill(out.isnan(), 0), ref.masked_fill(ref.isnan(), 0))


# Qwen-Image 2.1 (D = 4096): 1024x1024's 4096 image tokens with 256 text tokens, and a CFG batch
QWEN21_SHAPES = [(1, 4096 + 256, 4096), (2, 1024 + 256, 4096), (1, 17, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", QWEN21_SHAPES, ids=str)
def test_qwen21_scale_only_matches_eager_bitwise_and_verifies(shape, dtype, cuda_kernels):
    for seed in range(2):
        norm, x, _, _ = make_inputs(shape, dtype, "per_token", "cuda", seed)
        _check_on_gpu(norm, x, qwen21_scale_rows(shape[0], shape[1], shape[2], dtype, "cuda", seed), None)
        # without a mask, one row per sample ([B, 1, D] views of the modulation)
        _check_on_gpu(norm, x, torch.randn(shape[0], 4 * shape[2], device="cuda").to(dtype)[:, None, :shape[2]], None)
    assert LAYERNORM_SCALE.disabled is None and len(LAYERNORM_SCALE.verified) == 2


@pytest.mark.gpu
def test_layernorm_modulate_opcheck_cuda():
    norm, x, scale, shift = make_inputs((2, 64, 3072), torch.bfloat16, "per_token", "cuda", 0, "affine")
    torch.library.opcheck(torch.ops.diffusers_fastpath.layernorm_modulate.default,
                          (x, scale, shift, norm.weight, norm.bias, norm.eps, False))


# --- CPU: reference, guards, self-verification -----------------------------------------------------------------------


@pytest.fixture
def pretend_cuda(monkeypatch):
    """Tensors claim to be on CUDA, so the guard gets past the device check."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))


def test_the_families_layouts_pass_the_guard(pretend_cuda):
    for norm_kind in NORMS:
        for rows in ("per_token", "per_sample"):
            for shape in ((1, 24, 3072), (2, 24, 64)):
                norm, x, scale, shift = make_inputs(shape, torch.bfloat16, rows, "cpu", 0, norm_kind)
                with torch.no_grad():
                    assert LAYERNORM_MODULATE.guard(norm, x, scale, shift) is None, (norm_kind, rows, shape)
    norm, x, scale, shift = make_inputs((2, 24, 64), torch.bfloat16, "per_token", "cpu", 0)
    with torch.no_grad():  # one row for the whole batch, or one per token shared by the batch
        assert LAYERNORM_MODULATE.guard(norm, x, scale[:1, :1], shift[:1]) is None


def _unaligned_weight(norm):
    big = torch.nn.Parameter(torch.cat([norm.weight.detach()[:1], norm.weight.detach()]), requires_grad=False)
    norm.weight = torch.nn.Parameter(big[1:], requires_grad=False)  # 2 bytes past a 16-byte boundary
    return norm


@pytest.mark.parametrize(
    "case, reason",
    [
        ("cpu", "device cpu"),
        ("fp32", "dtype float32"),
        ("mixed_dtypes", "mixed dtypes"),
        ("rms_norm", "norm not a LayerNorm over the last dim"),
        ("subclass", "norm not a LayerNorm over the last dim"),
        ("weight_alone", "norm with a weight or a bias alone"),
        ("weight_dtype", "norm weight of another dtype"),
        ("weight_unaligned", "norm weight not 16-byte aligned"),
        ("wide", "D above 6144"),
        ("odd_dim", "D not a multiple of 8"),
        ("strided_x", "x not contiguous"),
        ("seq_stride", "scale/shift seq dim"),
        ("rows_shape", "shape"),
        ("two_dim_rows", "shape"),
        ("python_scalars", "operand not a tensor"),
        ("requires_grad", "requires grad"),
    ],
)
def test_guard_falls_back_to_exact_eager_with_reason(case, reason, request):
    dim = {"wide": 6152, "odd_dim": 36}.get(case, 64)
    norm_kind = {"weight_dtype": "affine", "weight_unaligned": "affine"}.get(case, "plain")
    norm, x, scale, shift = make_inputs((2, 24, dim), torch.bfloat16, "per_token", "cpu", 1, norm_kind)
    if case != "cpu":
        request.getfixturevalue("pretend_cuda")
    if case == "fp32":
        x, scale, shift = x.float(), scale.float(), shift.float()
    elif case == "mixed_dtypes":
        scale = scale.half()
    elif case == "rms_norm":
        norm = torch.nn.RMSNorm(dim, eps=1e-6).to(torch.bfloat16)
    elif case == "subclass":
        norm = type("MyLayerNorm", (torch.nn.LayerNorm,), {})(dim, elementwise_affine=False)
    elif case == "weight_alone":
        norm = torch.nn.LayerNorm(dim, bias=False).to(torch.bfloat16).requires_grad_(False)
    elif case == "weight_dtype":
        norm.float()  # an nn.LayerNorm's fp32 weight on a bf16 stream: another aten instantiation
    elif case == "weight_unaligned":
        norm = _unaligned_weight(norm)
    elif case == "strided_x":
        x = torch.cat([x, x], dim=2)[..., ::2]
    elif case == "seq_stride":  # rows 4 elements apart: not 16-byte aligned
        scale = torch.randn(2, 24, dim + 4).to(torch.bfloat16)[..., :dim]
    elif case == "rows_shape":
        scale = scale[:, :, :1]
    elif case == "two_dim_rows":
        scale, shift = scale[0], shift[0]  # [S, D]: broadcast as eager does, not the kernel's
    elif case == "python_scalars":
        scale, shift = 0.5, 0.25  # Python numbers: eager takes them; the guard refuses them without raising
    site = Site("layernorm_modulate")
    with torch.set_grad_enabled(case == "requires_grad"):
        if case == "requires_grad":
            x = x.clone().requires_grad_()
        out = layernorm_modulate(norm, x, scale, shift, site)
        assert torch.equal(out, layernorm_modulate_ref(norm, x, scale, shift))
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}


def test_a_hooked_norm_runs_its_hook_and_is_refused(pretend_cuda):
    norm, x, scale, shift = make_inputs((2, 24, 64), torch.bfloat16, "per_token", "cpu", 2, "affine")
    calls = []
    norm.register_forward_hook(lambda *a: calls.append(1))
    site = Site("layernorm_modulate")
    with torch.no_grad():
        out = layernorm_modulate(norm, x, scale, shift, site)
    assert calls == [1] and site.fast == 0 and sum(site.fallback.values()) == 1
    assert torch.equal(out, layernorm_modulate_ref(norm, x, scale, shift))


@pytest.fixture
def guard_open(monkeypatch):
    monkeypatch.setattr(LAYERNORM_MODULATE, "guard", lambda *a, **k: None)


def test_each_form_is_verified_on_its_own(guard_open, monkeypatch):
    """A signature is the aten instantiation (dtype, the norm's class), its epilogue (affine), the row length and the
    rows' addressing: a verified per-sample call does not vouch for per-token rows, nor a LayerNorm for an
    FP32LayerNorm."""
    monkeypatch.setattr(LAYERNORM_MODULATE, "kernel", layernorm_modulate_ref)  # exact by construction
    site = Site("layernorm_modulate")
    with torch.no_grad():
        for norm_kind in NORMS:
            for rows in ("per_token", "per_sample"):
                for seed in range(2):
                    layernorm_modulate(*make_inputs((2, 24, 64), torch.bfloat16, rows, "cpu", seed, norm_kind), site)
    assert site.fast == 20 and LAYERNORM_MODULATE.verified == {
        ("bfloat16", 64, cls, affine, rows) for cls, affine in
        (("LayerNorm", False), ("LayerNorm", True), ("FP32LayerNorm", False), ("FP32LayerNorm", True))
        for rows in ("per-token", "per-sample")}


def test_a_kernel_that_is_not_bit_exact_is_disabled_and_eager_returned(guard_open, monkeypatch, fastpath_log):
    def off_by_one_ulp(norm, x, scale, shift):
        out = layernorm_modulate_ref(norm, x, scale, shift)
        return (out.view(torch.int16) + 1).view(out.dtype)

    monkeypatch.setattr(LAYERNORM_MODULATE, "kernel", off_by_one_ulp)
    site = Site("layernorm_modulate")
    with torch.no_grad():
        for seed in range(3):
            args = make_inputs((1, 40, 64), torch.bfloat16, "per_token", "cpu", seed, "affine")
            assert torch.equal(layernorm_modulate(*args, site), layernorm_modulate_ref(*args))
    assert "not bit-exact" in LAYERNORM_MODULATE.disabled and not LAYERNORM_MODULATE.verified
    assert site.fast == 0 and dict(site.fallback) == {_policy.REASON_DISABLED: 3}


def test_the_affine_epilogue_must_round_once():
    """aten's affine epilogue rounds ``weight * y + bias`` once (the kernel: ``round(fma(w, y, b))``); rounding the
    normalised value first, as the plain LayerNorm's output is, then applying the affine, gives other bits on random
    data: so the affine cannot be left to a separate step after `layernorm_scale_shift`'s rounding point."""
    norm, x, _, _ = make_inputs((2, 256, 512), torch.bfloat16, "per_token", "cpu", 5, "fp32_affine")
    w, b = norm.weight.double(), norm.bias.double()
    y = torch.nn.functional.layer_norm(x.float(), (512,), None, None, norm.eps)
    once = (y.double() * w + b).float().to(x.dtype)  # the product exact in float64; one fp32 rounding, then T
    twice = (y.to(x.dtype).double() * w + b).float().to(x.dtype)
    assert (once != twice).float().mean() > 0.01


@pytest.mark.parametrize("norm_kind", NORMS)
@pytest.mark.parametrize("rows", ["per_token", "per_sample"])
def test_custom_op_opcheck_and_eager_fallback_cpu(norm_kind, rows):
    norm, x, scale, shift = make_inputs((2, 24, 64), torch.bfloat16, rows, "cpu", 0, norm_kind)
    op = torch.ops.diffusers_fastpath.layernorm_modulate.default
    args = (x, scale, shift, norm.weight, norm.bias, norm.eps, type(norm) is FP32LayerNorm)
    torch.library.opcheck(op, args)
    with torch.no_grad():
        assert torch.equal(op(*args), layernorm_modulate_ref(norm, x, scale, shift))


def test_scale_only_guard_and_fallback(pretend_cuda):
    norm, x, _, _ = make_inputs((2, 24, 64), torch.bfloat16, "per_token", "cpu", 3)
    scale = qwen21_scale_rows(2, 24, 64, torch.bfloat16, "cpu", 3, text=5)
    with torch.no_grad():
        assert LAYERNORM_SCALE.guard(norm, x, scale) is None and LAYERNORM_SCALE.guard(norm, x, scale[:, :1]) is None
        site = Site("layernorm_scale")
        out = layernorm_scale(norm, x, scale.float(), site)  # eager promotes to fp32: the kernel does not take it
        assert out.dtype is torch.float32 and torch.equal(out, layernorm_scale_ref(norm, x, scale.float()))
    assert dict(site.fallback) == {"mixed dtypes": 1}


def test_scale_only_custom_op_opcheck_cpu():
    norm, x, _, _ = make_inputs((2, 24, 64), torch.bfloat16, "per_token", "cpu", 3)
    scale = qwen21_scale_rows(2, 24, 64, torch.bfloat16, "cpu", 3, text=5)
    op = torch.ops.diffusers_fastpath.layernorm_modulate.default
    torch.library.opcheck(op, (x, scale, None, None, None, norm.eps, False))
    assert torch.equal(op(x, scale, None, None, None, norm.eps, False), layernorm_scale_ref(norm, x, scale))


def test_verified_signatures_compile_to_the_custom_op(guard_open):
    norm, x, scale, shift = make_inputs((2, 40, 64), torch.bfloat16, "per_token", "cpu", 4, "fp32_affine")
    LAYERNORM_MODULATE.verified.add(("bfloat16", 64, "FP32LayerNorm", True, "per-token"))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda *a: layernorm_modulate(*a), fullgraph=True, backend=backend)
    with torch.no_grad():
        assert torch.equal(fn(norm, x, scale, shift), layernorm_modulate_ref(norm, x, scale, shift))
    assert graphs[0].code.count("diffusers_fastpath.layernorm_modulate") == 1


# --- the zoo classes whose LayerNorm sites this op reaches ----------------------------------------------------------

# class -> the fallback reasons its LayerNorm sites may still count (EasyAnimate's image stream is a strided view)
REACHED = {"flux3": set(), "auraflow": set(), "cogvideox": set(), "consisid": set(),
           "easyanimate": {"x not contiguous"}, "qwen-image-21": set(), "cogview3plus": set()}
LN_OPS = ("layernorm_scale_shift", "layernorm_modulate", "layernorm_scale", "layernorm_scale_rows")
# class -> LayerNorm sites per op after a forward (each site named after the op its calls ran): the output norms
# returned (FLUX.3, Qwen-Image 2.1), CogVideoX's / ConsisID's ``(1 + S)[:, None, :]`` block norms, CogView3Plus's
# norm1 modulated into another name; Qwen-Image 2.1's block norms read their where-picked rows through an index
LN_SITES = {"flux3": {"layernorm_modulate": 5}, "qwen-image-21": {"layernorm_scale": 1, "layernorm_scale_rows": 4},
            "cogvideox": {"layernorm_modulate": 5}, "consisid": {"layernorm_modulate": 5},
            "cogview3plus": {"layernorm_scale_shift": 9}}


@pytest.mark.parametrize("name", sorted(REACHED))
def test_zoo_layernorm_sites_are_fast_and_patched_equals_unpatched(name, emulated_kernels):
    _zoo_layernorm_sites(name, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(REACHED))
def test_zoo_layernorm_sites_are_fast_and_patched_equals_unpatched_on_cuda(name, cuda_kernels):
    _zoo_layernorm_sites(name, "cuda")  # the real kernels, self-verified on their first call


def _zoo_layernorm_sites(name, device):
    entry = zoo.ZOO[name]
    dtype = (entry.cpu_dtype or torch.bfloat16) if device == "cpu" else torch.bfloat16
    model = zoo.build(name, dtype=dtype, device=device)
    kwargs = zoo.inputs(name, model)
    sample = lambda out: out[0] if isinstance(out, tuple) else out.sample  # noqa: E731
    with torch.no_grad():
        ref = sample(model(**kwargs)).clone()
    fp.patch(model)
    try:
        with torch.no_grad():
            first, second = sample(model(**kwargs)).clone(), sample(model(**kwargs))
        assert torch.equal(first, ref) and torch.equal(second, ref)
        sites = [s for m in model.modules() for _, s in sites_of(m) if s.op in LN_OPS]
        assert sites and all(s.fast > 0 for s in sites), sites
        if name in LN_SITES:  # as `report` shows them
            rows = [r for r in fp.report(model).sites if r.op in LN_OPS]
            assert {op: sum(r.op == op for r in rows) for op in {r.op for r in rows}} == LN_SITES[name], rows
        assert set().union(*(s.fallback for s in sites)) <= REACHED[name], sites
    finally:
        fp.unpatch(model)


# --- the LayerNorm into Qwen-Image 2.1's modulate method --------------------------------------------------------------


class NestedMethodBlock(torch.nn.Module):
    """Qwen-Image 2.1's style: a modulate method handed the LayerNorm's output inline."""

    def __init__(self, dim=8):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm2 = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def _mod(self, x, params, index=None):
        scale, gate = params.chunk(2, dim=-1)
        return x * (1 + scale.unsqueeze(1)), gate.unsqueeze(1)

    def forward(self, x, params, index=None):
        a, g = self._mod(self.norm1(x), params, index)  # fused
        b, h = self._mod(self.norm2(x), params + x.mul_(1)[:, 0, :1], index)  # near miss: an argument writes x
        c, k = self._mod(self.norm1(x), *(params,))  # near miss: a starred argument
        return a * g + b * h + c * k


def _fused_mod(self, norm, x, params, index=None):
    norm._fastpath_site.fast += 1
    return self._mod(norm(x), params, index)


def test_a_layernorm_handed_inline_to_a_modulate_method_joins_its_fused_counterpart():
    sub, found = _chains.fused_subclass(NestedMethodBlock, "FusedNestedMethodBlock", __name__,
                                        norm_methods={"_mod": ("_mod_norm", _fused_mod)})
    assert found.norms == ["norm1"]
    source = inspect.getsource(sub.forward)
    assert "a, g = self._mod_norm(self.norm1, x, params, index)" in source
    assert "b, h = self._mod(self.norm2(x), params + x.mul_(1)[:, 0, :1], index)" in source
    assert "c, k = self._mod(self.norm1(x), *(params,))" in source
    torch.manual_seed(3)
    block = sub().to(torch.bfloat16)
    block.norm1._fastpath_site = Site("layernorm_scale_shift")
    x, params = torch.randn(2, 5, 8).to(torch.bfloat16), torch.randn(2, 16).to(torch.bfloat16)
    ref = NestedMethodBlock.forward(block, x.clone(), params)
    assert torch.equal(block(x, params), ref) and block.norm1._fastpath_site.fast == 1


def test_qwen21_modulate_is_known_by_its_code(monkeypatch):
    from diffusers.models.transformers import transformer_qwenimage21 as qwen21

    block_cls = qwen21.QwenImage21TransformerBlock
    assert norm_method_hints(block_cls) == (("_modulate", "scale_rows"),)
    changed = type("Changed", (block_cls,), {"_modulate": lambda self, h, m, t: block_cls._modulate(self, h, m, t)})
    assert norm_method_hints(changed) == ()  # another method's code: not known
    block = block_cls(64, 1, 64).to(torch.bfloat16).requires_grad_(False)
    x, params = torch.randn(1, 6, 64).to(torch.bfloat16), torch.randn(2, 128).to(torch.bfloat16)
    mask = torch.tensor([False, False, True, True, True, True])
    site = Site("layernorm_scale_shift")
    block.img_norm1._fastpath_site = site
    with torch.no_grad():
        expected = block._modulate(block.img_norm1(x), params, mask)
        got = modulate_scale_rows(block, block.img_norm1, x, params, mask)
        assert all(map(torch.equal, got, expected)) and dict(site.fallback) == {"device cpu": 1}
        # the row selection the method calls replaced after patching: the fused counterpart runs the method itself
        monkeypatch.setattr(qwen21, "_select_modulation_rows", lambda p, m: torch.zeros_like(p).unsqueeze(1))
        site.fallback.clear()
        got = modulate_scale_rows(block, block.img_norm1, x, params, mask)
        assert all(map(torch.equal, got, block._modulate(block.img_norm1(x), params, mask)))
        assert not site.fallback and site.fast == 0  # the method ran as installed, no op call
        monkeypatch.undo()
        # the method itself replaced on the class after patching (27b1138 ran the checked one's arithmetic)
        modulate = block_cls._modulate
        monkeypatch.setattr(block_cls, "_modulate", lambda self, h, m, t: modulate(self, h * 2, m, t))
        got = modulate_scale_rows(block, block.img_norm1, x, params, mask)
        assert all(map(torch.equal, got, block._modulate(block.img_norm1(x), params, mask)))
        assert not torch.equal(got[0], expected[0])
    assert not site.fallback and site.fast == 0


# --- the one-expression forms: returned, CogVideoX's indexed sum, a scale alone; the site named after its op --------


class OutputNorms(torch.nn.Module):
    """FLUX.3's and Qwen-Image 2.1's output norms (returned), CogVideoX's block norm, CogView3Plus's norm1 (into
    another name), and near misses."""

    def __init__(self, dim=8):
        super().__init__()
        self.plain = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.affine = torch.nn.LayerNorm(dim, eps=1e-5)
        self.tokens = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.scaled = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, rows, mod, which):
        scale, shift = rows.chunk(2, dim=1)
        token_scale, token_shift = mod.chunk(2, dim=-1)
        a = self.affine(x) * (1 + scale)[:, None, :] + shift[:, None, :]  # CogVideoX
        normed = self.plain(x)
        b = normed * (1 + scale[:, None]) + shift[:, None]  # CogView3Plus: into another name
        c = self.affine(x) * (1 + scale)[:, None] + shift[:, None, :]  # near miss: one operand indexed otherwise
        if which == 0:
            return self.tokens(x) * (1 + token_scale) + token_shift  # FLUX.3
        if which == 1:
            return self.scaled(x) * (1 + token_scale)  # Qwen-Image 2.1
        return a + b + c + self.scaled(x) * (1 + x.mul_(0.5))  # near miss: the scale writes x


def test_returned_indexed_and_scale_only_norms_are_fused_and_their_sites_named_after_the_op_that_ran(
        emulated_kernels):
    sub, found = _chains.fused_subclass(OutputNorms, "FusedOutputNorms", __name__)
    source = inspect.getsource(sub.forward)
    assert "return _diffusers_fastpath_chains.norm_modulate_rows(self.tokens, x, token_scale, token_shift" in source
    assert "return _diffusers_fastpath_chains.norm_scale(self.scaled, x, token_scale" in source
    assert "a = _diffusers_fastpath_chains.norm_modulate_indexed(self.affine, x, scale, shift" in source
    assert "b = _diffusers_fastpath_chains.norm_modulate(self.plain, x, scale, shift" in source
    assert "normed = " not in source  # the LayerNorm runs at the modulate
    assert "c = self.affine(x) * (1 + scale)[:, None] + shift[:, None, :]" in source
    assert "self.scaled(x) * (1 + x.mul_(0.5))" in source
    assert sorted(found.norms) == ["affine", "plain", "scaled", "tokens"]
    torch.manual_seed(5)
    block = OutputNorms().to(torch.bfloat16)
    with torch.no_grad():
        block.affine.weight.normal_(1.0, 0.2)
        block.affine.bias.normal_(0.0, 0.2)
    fused = OutputNorms().to(torch.bfloat16)
    fused.load_state_dict(block.state_dict())
    fused.__class__ = sub
    _chains.add_chain_sites(fp._state.PatchState("lossless"), fused, found)
    site = lambda norm: norm._fastpath_site  # noqa: E731
    # named at patch time by the norm's kind
    assert [site(m).op for m in (fused.plain, fused.affine, fused.tokens, fused.scaled)] == [
        "layernorm_scale_shift", "layernorm_modulate", "layernorm_scale_shift", "layernorm_scale_shift"]
    x, rows, mod = (torch.randn(*shape).to(torch.bfloat16) for shape in ((2, 4, 8), (2, 16), (2, 4, 16)))
    with torch.no_grad():
        for which in (0, 1, 2):
            want = block(x.clone(), rows, mod, which)
            got = fused(x.clone(), rows, mod, which)
            assert torch.equal(got, want), which
    # ... and then after the op their calls ran: per-token rows and a scale alone run other ops than their kind's
    assert [site(m).op for m in (fused.plain, fused.affine, fused.tokens, fused.scaled)] == [
        "layernorm_scale_shift", "layernorm_modulate", "layernorm_modulate", "layernorm_scale"]
    assert all(site(m).fast > 0 and not site(m).fallback for m in (fused.plain, fused.affine, fused.tokens, fused.scaled))


class WritesItsInput(torch.nn.Module):
    """A module standing where a LayerNorm would (the forms take any ``self.A``) that writes its input in place."""

    def forward(self, x):
        return x.mul_(2)


class ModuleBeforeRows(torch.nn.Module):
    """``self.A(X)`` evaluated before its rows as written: rows computed from X (a copy, an arithmetic) would be
    computed before the call once the call moves into the fused one; rows that are views see its write either way."""

    def __init__(self):
        super().__init__()
        self.act = WritesItsInput()
        self.norm = WritesItsInput()

    def forward(self, x, t):
        a = self.act(x) * (1 + x.sum(1)[:, None]) + t[:, None]  # rows computed from x: the call must stay first
        s = x[:, 0]
        b = self.norm(x) * (1 + s[:, None]) + t[:, None]  # a view of x: the call may move after it
        return a + b


def test_a_module_that_writes_its_input_keeps_its_place_before_rows_computed_from_it(emulated_kernels):
    sub, found = _chains.fused_subclass(ModuleBeforeRows, "FusedModuleBeforeRows", __name__)
    source = inspect.getsource(sub.forward)
    assert "norm_modulate(self.act" not in source  # at 4daa63d: the call moved after x.sum(1), another number
    assert "b = _diffusers_fastpath_chains.norm_modulate(self.norm, x, s, t, " in source
    block, fused = ModuleBeforeRows(), ModuleBeforeRows()
    fused.__class__ = sub
    _chains.add_chain_sites(fp._state.PatchState("lossless"), fused, found)
    x, t = torch.randn(2, 3, 8), torch.randn(2, 8)
    assert torch.equal(fused(x.clone(), t), block(x.clone(), t))


class ModuleBeforeReaders(torch.nn.Module):
    """The two-statement form with statements between the norm and its modulate: the norm (here a module that writes
    its input in place) runs at the modulate once fused, so statements that read X (or a view of it) must stop it."""

    def __init__(self):
        super().__init__()
        self.norm_a, self.norm_b, self.norm_c = WritesItsInput(), WritesItsInput(), WritesItsInput()

    def forward(self, x, y, t):
        n = self.norm_a(x)
        copied = x * 3  # reads x: the norm stays before it
        n = n * (1 + t[:, None]) + t[:, None]
        v = y[:, 0]
        m = self.norm_b(y)
        first = v + 1  # reads a view of y
        m = m * (1 + t[:, None]) + t[:, None]
        k = self.norm_c(x)
        other = t * 2  # reads nothing x may hold: the norm may move after it
        k = k * (1 + other[:, None]) + t[:, None]
        return n + copied + m + first[:, None] + k


def test_a_module_that_writes_its_input_keeps_its_place_before_statements_reading_it(emulated_kernels):
    sub, found = _chains.fused_subclass(ModuleBeforeReaders, "FusedModuleBeforeReaders", __name__)
    source = inspect.getsource(sub.forward)
    assert "norm_modulate(self.norm_a" not in source and "norm_modulate(self.norm_b" not in source  # 27b1138: moved
    assert "norm_modulate(self.norm_c, x, other, t, " in source
    block, fused = ModuleBeforeReaders(), ModuleBeforeReaders()
    fused.__class__ = sub
    _chains.add_chain_sites(fp._state.PatchState("lossless"), fused, found)
    x, y, t = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(2, 8)
    assert torch.equal(fused(x.clone(), y.clone(), t), block(x.clone(), y.clone(), t))


def test_rows_form_of_another_norm_runs_as_written_and_counts_why():
    """The rows form's call with a norm no fused op takes (here a GroupNorm-like module): the written expression,
    counted on the site, so that `report` does not show a site that silently never ran fused."""
    from diffusers_fastpath.models._chain_calls import _ChainsNamespace

    norm = torch.nn.Identity()
    x, scale, shift = torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    site = Site("layernorm_scale_shift")
    out = _ChainsNamespace.norm_modulate_rows(norm, x, scale, shift, site)
    assert torch.equal(out, x * (1 + scale) + shift) and site.fast == 0
    assert dict(site.fallback) == {"norm not a LayerNorm or diffusers RMSNorm, or rows not tensors": 1}
