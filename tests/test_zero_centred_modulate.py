"""Krea 2's zero-centred float32 RMSNorm and the modulate that reads it (``(1.0 + s) * self.norm1(x) + t``) as the fused
`zero_centred_modulate`: on the GPU the kernel against eager at Krea 2's shapes (the blocks' and the final layer's
rows, poisoned outputs, fresh inputs, bf16 and fp16); on a CPU the guard, the rewriter's form (patched == unpatched,
the new sites counted fast and the separate modulate sites gone, hooks on the norm, a norm that is not Krea 2's,
unpatch) through the emulated kernels."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_krea2 import Krea2RMSNorm
from torch import nn

import diffusers_fastpath as fp
from diffusers_fastpath._state import sites_of
from diffusers_fastpath.models._chain_calls import _ChainsNamespace
from diffusers_fastpath.ops import Site, zero_centred_modulate, zero_centred_modulate_ref
from diffusers_fastpath.ops.zero_centred_modulate import ZERO_CENTRED_MODULATE, _guard
from diffusers_fastpath.testing import zoo
from test_nvrtc import both_ways, captured_launches  # noqa: F401 (fixtures: both ways; the launchers on CPU tensors)
from test_zero_centred_rmsnorm import _norm, _x  # (a swapped Krea 2 norm with random weights; activations)

DTYPES = [torch.bfloat16, torch.float16]
OP = "zero_centred_modulate"
SITE = "norm_modulate"  # the name of the site on the norm (`_rewriter_norms.NORM_MODULATE_LATER`), its op OP


def _rows(batch: int, dim: int, dtype, device, seed, final: bool = False):
    """``(scale, shift)`` as Krea 2 makes them: the block's ``(temb.unflatten(-1, (6, -1)) + table).unbind(-2)``
    (``[B, 1, D]`` views, batch stride 6 D) or the final layer's ``(temb + table).chunk(2, dim=1)`` (stride 2 D)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if final:
        modulation = 0.5 * torch.randn(batch, 2, dim, generator=gen, device=device).to(dtype)
        return modulation.chunk(2, dim=1)
    modulation = 0.5 * torch.randn(batch, 1, 6, dim, generator=gen, device=device).to(dtype)
    prescale, preshift, *_ = modulation.unbind(-2)
    return prescale, preshift


# ([B, S, D], rows' batch, the final layer's rows): Krea 2 at 1024x1024 (512 text + 4096 image tokens, 6144 wide; the
# output's 4096 image tokens), a batch of two (CFG in one batch), rows broadcast over a batch, a width that is not a
# multiple of 128, the kernel's widest row
CASES = [((1, 4608, 6144), 1, False), ((1, 4096, 6144), 1, True), ((2, 1037, 6144), 2, False),
         ((2, 77, 6144), 1, False), ((2, 33, 1028), 2, True), ((1, 9, 8192), 1, False)]
# rows of at most 128 (rotary.cu's narrow_row_norm_kernel, a warp a row): rows per sample that end a warp's four rows
# and a block's 32 within a sample, one row for both samples, widths whose last lanes hold no data
NARROW = [((2, 77, 128), 2, False), ((2, 33, 64), 1, True), ((3, 1029, 96), 3, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, rows, final", CASES + NARROW, ids=str)
def test_zero_centred_modulate_matches_eager_bitwise(shape, rows, final, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()  # the raw op: the nvcc extension's, else NVRTC's
    for seed in range(2):  # fresh inputs, weights and rows each round
        norm, x = _norm(shape[-1], "cuda", seed), _x(shape, dtype, "cuda", seed + 10)
        scale, shift = _rows(rows, shape[-1], dtype, "cuda", seed + 20, final)
        ref = zero_centred_modulate_ref(norm, x, scale, shift)
        assert ref.dtype is dtype and ref.shape == shape and torch.isfinite(ref).all() and ref.float().std() > 0.1
        torch.full((ref.numel() + 4096,), float("nan"), device="cuda", dtype=dtype)  # freed: the output's block next
        raw = torch.ops.diffusers_fastpath._zero_centred_modulate_cuda(x, norm.weight + 1.0, scale.squeeze(1),
                                                                       shift.squeeze(1), norm.eps, 0)
        torch.cuda.synchronize()
        assert torch.equal(raw, ref)
        torch.full((ref.numel() + 4096,), float("nan"), device="cuda", dtype=dtype)
        site = Site(OP)
        out = zero_centred_modulate(norm, x, scale, shift, site)
        assert torch.equal(out, ref) and out.is_contiguous()
        assert site.fast == 1 and not site.fallback, site
    assert ZERO_CENTRED_MODULATE.disabled is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, rows, final", NARROW + CASES[2:3], ids=str)
def test_nvrtc_and_nvcc_kernels_equal_eager(shape, rows, final, dtype, both_ways):
    """The NVRTC launcher (and the nvcc extension's op where a toolkit built it) on the narrow rows and a wide row."""
    import importlib

    modulate_mod = importlib.import_module("diffusers_fastpath.ops.zero_centred_modulate")  # (the package's: the op)
    for seed in range(2):
        norm, x = _norm(shape[-1], "cuda", seed), _x(shape, dtype, "cuda", seed + 10)
        scale, shift = _rows(rows, shape[-1], dtype, "cuda", seed + 20, final)
        ref = zero_centred_modulate_ref(norm, x, scale, shift)
        assert torch.isfinite(ref).all() and ref.float().std() > 0.1
        ways = [modulate_mod._nvrtc_kernel] + ([torch.ops.diffusers_fastpath._zero_centred_modulate_cuda] if both_ways
                                               else [])
        for way in ways:
            torch.full((ref.numel() + 4096,), float("nan"), device="cuda", dtype=dtype)  # the output's block next
            out = way(x, norm.weight + 1.0, scale.squeeze(1), shift.squeeze(1), norm.eps, 0)
            torch.cuda.synchronize()
            assert torch.equal(out, ref), way


@pytest.mark.gpu
def test_krea2_zoo_model_runs_the_norm_modulates_fused_on_cuda():
    from test_generic_zoo import _check

    sites = _check("krea2", "cuda")
    fused = [s for s in sites if s.op == OP]
    assert fused and all(s.fast > 0 for s in fused) and not any(s.fallback for s in fused), fused
    assert not any(s.op == "modulate_scale_shift" for s in sites), sites


@pytest.mark.parametrize("case, reason", [
    ("float32_rows", "rows not of x's dtype"),
    ("per_token_rows", "rows not [B or 1, 1, D]"),
    ("more_rows_than_x", "rows not [B or 1, 1, D]"),
    ("one_row_odd_batch_stride", "rows strided"),
    ("python_shift", "operand not a tensor"),
    ("two_dims", "x not [B, S, D] with B <= 65535"),
    ("transposed", "x not contiguous"),
    ("unswapped", "Krea2RMSNorm is not a checked zero-centred RMSNorm"),
    ("cpu", "device cpu"),
])
def test_guard_refuses_with_reason_and_the_fallback_is_eager(case, reason):
    norm, x = _norm(64, "cpu", 0), _x((2, 5, 64), torch.bfloat16, "cpu", 1)
    scale, shift = _rows(2, 64, torch.bfloat16, "cpu", 2)
    if case == "float32_rows":
        scale, shift = scale.float(), shift.float()
    elif case == "per_token_rows":
        scale = scale.expand(2, 5, 64)
    elif case == "more_rows_than_x":
        x = x[:1]
    elif case == "one_row_odd_batch_stride":  # bindings_rotary.cpp refuses it (its launch would raise): so does the guard
        x, scale = x[:1], torch.randn(1, 1, 66).to(torch.bfloat16)[..., :64]
        shift = shift[:1]
    elif case == "python_shift":
        shift = 0.5
    elif case == "two_dims":
        x = x[0]
    elif case == "transposed":
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    elif case == "unswapped":
        norm.__class__ = Krea2RMSNorm
    assert _guard(norm, x, scale, shift, check_pointers=False) == reason
    site = Site(OP)
    expected = (1.0 + scale) * Krea2RMSNorm.forward(norm, x) + shift
    out = zero_centred_modulate(norm, x, scale, shift, site)
    assert torch.equal(out, expected) and out.dtype == expected.dtype
    assert site.fast == 0 and reason in site.fallback


def _krea2():
    model = zoo.build("krea2", dtype=torch.bfloat16, device="cpu")
    return model, zoo.inputs("krea2", model)


def _sites(model):
    return {(name, n): s for name, m in model.named_modules() for n, s in sites_of(m)}


def test_krea2_patched_runs_its_norm_modulates_fused_and_unpatch_restores(emulated_kernels):
    model, kwargs = _krea2()
    with torch.no_grad():
        ref = model(**kwargs)[0].clone()
    forwards = {type(m): type(m).forward for m in model.modules()}
    fp.patch(model)
    with torch.no_grad():
        assert torch.equal(model(**kwargs)[0], ref) and torch.equal(model(**kwargs)[0], ref)
    sites = _sites(model)
    fused = {name for (name, n), s in sites.items() if s.op == OP}
    layers = len(model.transformer_blocks)
    assert fused == {f"transformer_blocks.{i}.norm{k}" for i in range(layers) for k in (1, 2)} | {"final_layer.norm"}
    assert all(s.fast > 0 and not s.fallback for s in sites.values() if s.op == OP), sites
    # the separate modulates are gone, and the pre-norms no longer run on their own
    assert not any(s.op == "modulate_scale_shift" for s in sites.values()), sites
    assert all(sites[(name, None)].fast == 0 for name in fused), sites
    fp.unpatch(model)
    assert not _sites(model)
    assert all(type(m).forward is forwards[type(m)] for m in model.modules())
    assert all(type(m) is Krea2RMSNorm for m in model.modules() if isinstance(m, Krea2RMSNorm))
    with torch.no_grad():
        assert torch.equal(model(**kwargs)[0], ref)


@pytest.mark.parametrize("before_patch", [False, True])
def test_hooks_on_norm1_run_and_refuse_the_fused_call(emulated_kernels, unpatch_after, before_patch):
    model, kwargs = _krea2()
    norm1 = model.transformer_blocks[0].norm1
    calls = []

    def hook(module, args, out):
        calls.append(module)
        return out * 2  # changes what the modulate reads: the fused kernel must not run in its place

    if before_patch:
        norm1.register_forward_hook(hook)
    with torch.no_grad():
        ref = model(**kwargs)[0].clone()
    # (no whole-model verification: with a hook it runs the model as written, and the sites would count nothing)
    unpatch_after(fp.patch(model, verify=False))
    if not before_patch:  # a hook added to the patched model; the reference: the unpatched model with it
        norm1.register_forward_hook(hook)
        fp.unpatch(model)
        with torch.no_grad():
            ref = model(**kwargs)[0].clone()
        fp.patch(model, verify=False)
    calls.clear()
    with torch.no_grad():
        assert torch.equal(model(**kwargs)[0], ref)
    assert calls  # the hook ran, on the norm's own call
    sites = _sites(model)
    site = sites[("transformer_blocks.0.norm1", SITE)]
    assert site.fast == 0 and "FastpathKrea2RMSNorm has hooks" in site.fallback, site
    assert sites[("transformer_blocks.0.norm2", SITE)].fast > 0  # the other norms are fused still


def test_a_norm_forward_replaced_after_patching_runs_as_replaced(emulated_kernels, monkeypatch):
    norm, x = _norm(64, "cpu", 0), _x((2, 5, 64), torch.bfloat16, "cpu", 1)
    scale, shift = _rows(2, 64, torch.bfloat16, "cpu", 2)
    site = Site(OP)
    assert torch.equal(zero_centred_modulate(norm, x, scale, shift, site),
                       zero_centred_modulate_ref(norm, x, scale, shift)) and site.fast == 1

    def replaced(self, hidden_states):
        return hidden_states * 2

    monkeypatch.setattr(Krea2RMSNorm, "forward", replaced)
    out = _ChainsNamespace.norm_modulate_later(norm, x, scale, shift, site, None, 1.0, False)
    assert torch.equal(out, (1.0 + scale) * (x * 2) + shift)
    assert site.fast == 1  # (is_zero_centred: no longer the checked norm; it runs as written)


def test_the_form_with_a_norm_that_is_not_zero_centred_runs_the_norm_then_the_modulate(emulated_kernels):
    norm, x = nn.LayerNorm(64, elementwise_affine=False, eps=1e-6), _x((2, 5, 64), torch.bfloat16, "cpu", 1)
    scale, shift = _rows(2, 64, torch.bfloat16, "cpu", 2)
    site, modulate_site = Site(OP), Site("modulate_scale_shift")
    for normed_left in (False, True):
        out = _ChainsNamespace.norm_modulate_later(norm, x, scale, shift, site, modulate_site, 1.0, normed_left)
        written = norm(x) * (1.0 + scale) + shift if normed_left else (1.0 + scale) * norm(x) + shift
        assert torch.equal(out, written)
    assert site.fast == 0 and not site.fallback  # never asked: not a zero-centred norm
    assert modulate_site.fast == 2 and not modulate_site.fallback, modulate_site


def row_norm_launch(captured_launches, form: int, x, weight, out, eps: float, float_weight: bool):
    """The last launch's RotaryArgs, checked as bindings_rotary.cpp's zero_centred_launch fills them for rotary.cu's row
    norm without a rotary in `form` (kNoRotaryModulate 4, kNormModulateRows 5) over x ``[batch, seq, C]``, and its
    kernel as rotary.cu's launch() picks it: a block of 128 threads a row, a warp a row (32 rows a block of 256) for
    C <= 128."""
    import importlib

    rotary_mod = importlib.import_module("diffusers_fastpath.ops.rotary")  # (the package's `rotary` is a function)
    batch, seq, dim = x.shape
    kernel, key, grid, block, params = captured_launches[-1]
    a = params.a
    if dim <= 128:
        assert (kernel, key, grid, block) == (rotary_mod._NVRTC_NARROW_ROWS, (x.dtype, form),
                                              (-(-batch * seq // 32), 1, 1), (256, 1, 1))
    else:
        assert (kernel, key, grid, block) == (rotary_mod._NVRTC_ROWS, (x.dtype, form, False), (seq, batch, 1),
                                              (128, 1, 1))
    assert out.shape == x.shape and out.is_contiguous()
    assert (a.out, a.img.ptr, a.img.stride_b, a.img.stride_s, a.img.stride_h, a.img.seq, a.img.weight) == (
        out.data_ptr(), x.data_ptr(), seq * dim, dim, dim, seq, weight.data_ptr())
    assert a.img.eps == pytest.approx(eps) and not a.txt.ptr and a.txt.seq == 0 and not a.cos and not a.sin
    assert (a.batch, a.heads, a.dim, a.norm, a.wan, a.norm_rows, a.norm_fp32, a.norm_f32w, a.norm_final) == (
        batch, 1, dim, False, False, True, False, float_weight, 0)
    return a


def test_nvrtc_launcher_passes_what_bindings_rotary_cpp_passes(captured_launches):
    """The NVRTC launch, field by field, as bindings_rotary.cpp's zero_centred_launch fills RotaryArgs (the kernel's
    kNoRotaryModulate form; kNoRotary, its mod_* null, for the norm alone)."""
    import importlib

    rotary_mod, modulate_mod, norm_mod = (importlib.import_module(f"diffusers_fastpath.ops.{name}") for name in (
        "rotary", "zero_centred_modulate", "zero_centred_rmsnorm"))  # (the package's names are the op functions)

    for dim in (256, 128):  # a block a row; a warp a row
        x, weight = _x((2, 33, dim), torch.bfloat16, "cpu", 0), torch.randn(dim)
        scale, shift = _rows(2, dim, torch.bfloat16, "cpu", 1)  # [2, 1, C] views of [2, 1, 6, C]: batch stride 6 C
        out = modulate_mod._nvrtc_kernel(x, weight, scale.squeeze(1), shift.squeeze(1), 1e-5, 0)
        a = row_norm_launch(captured_launches, 4, x, weight, out, 1e-5, float_weight=True)
        assert (a.mod_scale, a.mod_shift, a.mod_scale_stride_b, a.mod_shift_stride_b) == (
            scale.data_ptr(), shift.data_ptr(), 6 * dim, 6 * dim)
        modulate_mod._nvrtc_kernel(x, weight, scale[:1].squeeze(1), shift[:1].squeeze(1), 1e-5, 0)  # one row for all
        a = captured_launches[-1][-1].a
        assert (a.mod_scale_stride_b, a.mod_shift_stride_b) == (0, 0)
        norm_mod._nvrtc_kernel(x.view(-1, dim), weight, 1e-5, 0)  # the norm alone: the rows as one sample, no modulate
        kernel, key, grid, block, params = captured_launches[-1]
        a = params.a
        assert (kernel, key, grid, block) == ((rotary_mod._NVRTC_ROWS, (torch.bfloat16, 3, False), (66, 1, 1),
                                               (128, 1, 1)) if dim > 128 else
                                              (rotary_mod._NVRTC_NARROW_ROWS, (torch.bfloat16, 3), (3, 1, 1),
                                               (256, 1, 1)))
        assert (a.batch, a.img.seq, a.img.stride_b, a.dim) == (1, 66, 66 * dim, dim)
        assert not a.mod_scale and not a.mod_shift and (a.mod_scale_stride_b, a.mod_shift_stride_b) == (0, 0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_custom_op_opcheck_and_its_value(device):
    """The op torch.compile sees: its schema, fake and registrations (`opcheck`), and its value: eager's."""
    norm, x = _norm(256, device, 0), _x((2, 17, 256), torch.bfloat16, device, 1)
    scale, shift = _rows(2, 256, torch.bfloat16, device, 2)
    op = torch.ops.diffusers_fastpath.zero_centred_modulate.default
    torch.library.opcheck(op, (x, norm.weight, scale, shift, norm.eps))
    assert torch.equal(op(x, norm.weight, scale, shift, norm.eps), zero_centred_modulate_ref(norm, x, scale, shift))
