"""Every dtype the fast kernels refuse gets the expression exactly as diffusers writes it (issue 43, item 4): each
family's tiny model in float64 and float32, patched, is `torch.equal` to unpatched; and each rewritten statement's
call, on operands of every mix of dtypes, computes that statement's own result (Wan's ``attn_output * gate_msa``
times a float32 gate is a float64 product where the update is float64, not the update rounded to float32 first;
Lumina2's ``FP32SiLU`` rounds through float32, which ``F.silu`` in float64 does not).

The ops' guards take the CPU tensors as CUDA ones (`emulated_kernels`), so every place where a guard says yes to a
dtype runs the kernel's arithmetic and every refusal runs the fallback.
"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import textwrap

import pytest
import torch
from diffusers.models.activations import FP32SiLU
from diffusers.models.normalization import FP32LayerNorm, RMSNorm
from diffusers.models.transformers.transformer_flux2 import Flux2SwiGLU
from diffusers.models.transformers.transformer_wan import WanTransformerBlock
from torch import nn

import diffusers_fastpath as fp
import diffusers_fastpath.testing as T
from diffusers_fastpath.models._chain_calls import SWIGLU_MODULES
from diffusers_fastpath.models._chain_calls import _ChainsNamespace as ns
from diffusers_fastpath.models._chain_syntax import _fp32_gated_of
from diffusers_fastpath.ops import OPS, Site
from diffusers_fastpath.testing.checks import outputs_equal

FAMILIES = {
    "flux": (T.build_flux_transformer, T.flux_transformer_inputs),
    "chroma": (T.build_chroma_transformer, T.chroma_transformer_inputs),
    "flux2": (T.build_flux2_transformer, T.flux2_transformer_inputs),
    **{name: (functools.partial(T.build_flux_clone, name), T.flux_clone_inputs) for name in T.FLUX_CLONE_CONFIGS},
    "sd3": (T.build_sd3_transformer, T.sd3_transformer_inputs),
    "qwenimage": (T.build_qwenimage_transformer, T.qwenimage_transformer_inputs),
    "hunyuan": (T.build_hunyuan_transformer, T.hunyuan_transformer_inputs),
    "hunyuan-video-1.5": (T.build_hunyuan_video15_transformer, T.hunyuan_video15_transformer_inputs),
    "zimage": (T.build_zimage_transformer, T.zimage_transformer_inputs),
    "lumina2": (T.build_lumina2_transformer, T.lumina2_transformer_inputs),
    "ltx": (T.build_ltx_transformer, T.ltx_transformer_inputs),
    "wan": (T.build_wan_transformer, T.wan_transformer_inputs),
    "ernie-image": (T.build_ernie_image_transformer, T.ernie_image_inputs),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_in_float64_and_float32_is_exact(family, dtype, emulated_kernels):
    build, make_inputs = FAMILIES[family]
    ref_model, model = build(dtype=dtype, seed=1), build(dtype=dtype, seed=1)
    inputs = make_inputs(model, seed=2)
    with torch.no_grad():
        ref = ref_model(**inputs).sample
        fp.patch(model)
        try:
            assert outputs_equal(model(**inputs).sample, ref)
        finally:
            fp.unpatch(model)


# --- each rewritten statement's call against the statement, on every mix of dtypes --------------------------------

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
D = 640  # a row every kernel takes (the RMSNorm ones: a multiple of 128 above 512), 16 rows


def _rand(*shape, dtype):
    return torch.randn(shape).to(dtype)


def _same(got, expected) -> bool:
    return got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)


def _mixes(n: int):
    """Every dtype for every operand would be 4**n mixes; all-equal ones, each operand alone in another dtype, and the
    float32-gate forms cover every promotion the statements meet."""
    mixes = {(d,) * n for d in DTYPES}
    for i, (base, other) in itertools.product(range(n), itertools.permutations(DTYPES, 2)):
        mixes.add(tuple(other if j == i else base for j in range(n)))
    return sorted(mixes, key=str)


@pytest.mark.parametrize("update_float", [False, True], ids=["E*G", "E.float()*G"])
@pytest.mark.parametrize("dtypes", _mixes(3), ids=str)
def test_wan_gated_residual_is_the_statement_as_written(dtypes, update_float, emulated_kernels):
    r_dtype, u_dtype, g_dtype = dtypes
    residual, update = _rand(1, 16, D, dtype=r_dtype), _rand(1, 16, D, dtype=u_dtype)
    for gate in (_rand(1, 1, D, dtype=g_dtype), _rand(1, 16, D, dtype=g_dtype), _rand(dtype=g_dtype)):
        expected = (residual.float() + (update.float() if update_float else update) * gate).type_as(residual)
        call = (residual, gate, update, Site("gated_residual_fp32"), *([True] if update_float else []))  # as rewritten
        assert _same(ns.gated_residual_fp32(*call), expected)


def test_wan_fp32_gated_residual_fast_where_the_two_forms_agree(emulated_kernels):
    residual, update, gate = _rand(1, 16, D, dtype=torch.bfloat16), _rand(1, 16, D, dtype=torch.bfloat16), \
        torch.randn(1, 1, D)
    site = Site("gated_residual_fp32")
    for update_float in (False, True):
        ns.gated_residual_fp32(residual, gate, update, site, update_float)
    assert site.fast == 2 and not site.fallback
    ns.gated_residual_fp32(residual.double(), gate, update.double(), site, True)
    assert site.fast == 2
    assert list(site.fallback) == ["update.float() * gate is another product (float64 update, float32 gate)"]


def test_wan_rewrite_tells_the_two_gated_forms_apart():
    """Wan's attention line multiplies the update as it is, its FFN line ``ff_output.float()``: the rewriter hands the
    namespace that difference (a float64 update makes the two different products)."""
    forms = {}
    source = textwrap.dedent(inspect.getsource(WanTransformerBlock.forward))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and (found := _fp32_gated_of(node.value)) is not None:
            forms[ast.unparse(found[1])] = found[3]
    assert forms == {"attn_output": False, "ff_output": True}


@pytest.mark.parametrize("act", [None, "silu", "silu-inplace", "fp32silu"])
@pytest.mark.parametrize("dtypes", _mixes(2), ids=str)
def test_silu_product_is_the_statement_as_written(dtypes, act, emulated_kernels):
    module = {None: None, "silu": nn.SiLU(), "silu-inplace": nn.SiLU(inplace=True), "fp32silu": FP32SiLU()}[act]
    x, y = _rand(1, 16, D, dtype=dtypes[0]), _rand(1, 16, D, dtype=dtypes[1])
    x_ref = x.clone()
    expected = (torch.nn.functional.silu if module is None else module)(x_ref) * y
    got = ns.silu_mul(module, x, y, Site("silu_mul"))
    assert _same(got, expected) and torch.equal(x, x_ref)  # an in-place SiLU writes its input as eager does


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_cat_with_an_fp32_silu_gate_is_the_statements_as_written(dtype, emulated_kernels, monkeypatch):
    from diffusers_fastpath.models import flux2

    monkeypatch.setitem(SWIGLU_MODULES, flux2.FastpathFlux2SwiGLU, "gate_fn")  # as `patch` registers it
    act = flux2.FastpathFlux2SwiGLU()
    act.gate_fn = FP32SiLU()  # a gate `swiglu_in_cat` takes, which is not F.silu in float64
    attn, x = _rand(1, 16, 128, dtype=dtype), _rand(1, 16, 2 * D, dtype=dtype)
    site = Site("swiglu_cat")
    assert ns.swiglu_in_cat(act, site)
    assert _same(ns.swiglu_cat(act, attn, x, site), torch.cat([attn, Flux2SwiGLU.forward(act, x)], dim=-1))


def _norms(dtype):
    layer = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
    fp32_affine = FP32LayerNorm(D, eps=1e-6).to(dtype)
    rms = RMSNorm(D, eps=1e-6).to(dtype)
    for p in (*fp32_affine.parameters(), *rms.parameters()):
        p.data.normal_()
    return layer, fp32_affine, rms


@pytest.mark.parametrize("dtypes", _mixes(3), ids=str)
def test_norm_statements_are_as_written(dtypes, emulated_kernels):
    """The LayerNorm and RMSNorm statements the rewriter takes, on every mix of the stream's, the modulation's and
    the norm weight's dtypes (the norm weights in the third)."""
    x_dtype, row_dtype, w_dtype = dtypes
    layer, fp32_affine, rms = _norms(w_dtype)
    x = _rand(1, 16, D, dtype=x_dtype)
    scale, shift = _rand(1, D, dtype=row_dtype), _rand(1, D, dtype=row_dtype)
    rows = (scale[:, None], shift[:, None])
    site = Site("norm")
    with torch.no_grad():
        cases = [
            (ns.norm_modulate(layer, x, scale, shift, site), layer(x) * (1 + scale[:, None]) + shift[:, None]),
            (ns.norm_modulate_rows(layer, x, *rows, site), layer(x) * (1 + rows[0]) + rows[1]),
            (ns.norm_modulate_rows(rms, x, *rows, site), rms(x) * (1 + rows[0]) + rows[1]),
            (ns.norm_modulate_fp32(layer, x, *rows, site), (layer(x.float()) * (1 + rows[0]) + rows[1]).type_as(x)),
            (ns.norm_affine_fp32(fp32_affine, x, site), fp32_affine(x.float()).type_as(x)),
            (ns.modulate(x, scale, shift, site), x * (1 + scale[:, None]) + shift[:, None]),
            (ns.rms_scale(rms, x, rows[0], site), rms(x) * rows[0]),
            (ns.rms_gated_residual(rms, x, rows[0], x, site), x + rows[0] * rms(x)),
            (ns.gated_residual(x, rows[0], x, site), x + rows[0] * x),
        ]
    for i, (got, expected) in enumerate(cases):
        assert _same(got, expected), i


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_every_family_in_float64_and_float32_is_exact(family, dtype):
    """The same on the GPU, where the real guards refuse these dtypes and the fallbacks run with CUDA's kernels."""
    build, make_inputs = FAMILIES[family]
    ref_model, model = build(dtype=dtype, device="cuda", seed=1), build(dtype=dtype, device="cuda", seed=1)
    inputs = make_inputs(model, seed=2)
    with torch.no_grad():
        ref = ref_model(**inputs).sample
        fp.patch(model)
        try:
            assert outputs_equal(model(**inputs).sample, ref)
            assert all(op.disabled is None for op in OPS.values())
        finally:
            fp.unpatch(model)
