"""qk_norm_rotary_half: MiniMax-H3's QK norm of each head (``torch.nn.RMSNorm(D)``) and its partial rotate-half rotary
(``_apply_rotary_emb``: the first R channels rotated, the rest passed through) as one op. On the GPU the kernel against
the model's own chain at MiniMax-H3's full-size shapes (read from the zoo's published config: heads, head_dim, rotary
channels, eps, the packed sequence of its full-size inputs), poisoned outputs, bf16 and fp16, float32 tables and
tables of x's dtype, both the nvcc and the NVRTC way; the zoo model on CUDA. On a CPU: the arithmetic, the guard's
reasons with eager's result, hooks on the norm, the fallback keeping the rotary fused, the rewriter's call, the zoo
model patched == unpatched with the new sites fast and unpatch restoring its processors, the NVRTC launch."""

from __future__ import annotations

import importlib

import pytest
import torch
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from diffusers.models.transformers import transformer_minimax_h3
from torch import nn

import diffusers_fastpath as fp
from diffusers_fastpath.ops import Site, qk_norm_rotary_half, qk_norm_rotary_half_ref, rotary_half_partial_ref
from diffusers_fastpath.ops.qk_norm_rotary_half import QK_NORM_ROTARY_HALF
from diffusers_fastpath.testing import zoo
from test_nvrtc import both_ways, captured_launches  # noqa: F401 (fixtures)
from test_rms_norm_modulate_rows import _norm  # torch.nn.RMSNorm(dim) with a random weight around 1
from test_rotary_half import kernel_arithmetic
from test_rotary_half import partial_inputs as _inputs  # MiniMax-H3's [B, S, H, D] x, [S, R] tables

DTYPES = [torch.bfloat16, torch.float16]
PARTIAL = transformer_minimax_h3._apply_rotary_emb  # the model's own function
OP_MOD = importlib.import_module("diffusers_fastpath.ops.qk_norm_rotary_half")  # (ops binds the name to the function)


def _eager(norm, x, cos, sin):
    """MiniMax-H3's processor, as written: ``query = attn.norm_q(query)``, ``query = _apply_rotary_emb(query, ...)``."""
    with torch.no_grad():
        return PARTIAL(norm(x), cos, sin)


# --- GPU: the contract at MiniMax-H3's shapes -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_size():
    """MiniMax-H3's published config (the zoo's full-size entry: the class defaults) read from the model built on
    the meta device, and the packed sequence of its full-size inputs: (heads, head_dim, rotary channels, eps, fp32
    cos / sin of its 3-axis rotary over those positions, on CUDA)."""
    entry = zoo.ZOO["minimax-h3"]
    with torch.device("meta"):
        model = entry.cls(**entry.full_config)
    cfg = model.config
    positions = zoo.inputs("minimax-h3", zoo.build("minimax-h3", dtype=torch.float32), full=True)["position_ids"]
    rope = type(model.rope)(cfg.rope_freq_dim, cfg.rope_theta).to("cuda")
    cos, sin = rope(positions.to("cuda"))
    assert cos.dtype is torch.float32 and cos.shape == (positions.shape[0], 2 * 3 * cfg.rope_freq_dim)
    return cfg.num_attention_heads, cfg.attention_head_dim, cos.shape[1], cfg.qk_norm_eps, cos, sin


@pytest.mark.gpu
@pytest.mark.parametrize("tables", [torch.float32, None], ids=["fp32 tables", "tables of x's dtype"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch, seq", [(1, None), (2, 517), (1, 7)], ids=["full-size", "batch 2", "7 tokens"])
def test_kernel_matches_minimax_eager_bitwise(batch, seq, dtype, tables, full_size, both_ways):
    """The op (nvcc's raw op where a toolkit is there, else NVRTC's) and the NVRTC launcher against the model's chain,
    each output poisoned before the kernel writes it; the first call verifies the signature, fresh inputs after."""
    heads, dim, rot, eps, cos, sin = full_size
    seq = seq or cos.shape[0]  # None: the full-size packed sequence (~38k tokens of 56 heads x 128)
    cos, sin = cos[:seq].contiguous(), sin[:seq].contiguous()
    if tables is None:
        cos, sin = cos.to(dtype), sin.to(dtype)
    for seed in range(2):
        norm = _norm(dim, dtype, "cuda", seed, eps)
        x = _inputs(batch, seq, heads, dim, rot, dtype, "cuda", seed + 10)[0]
        ref = _eager(norm, x, cos, sin)
        assert ref.dtype is dtype and torch.isfinite(ref).all()
        torch.full((ref.numel() + 4096,), float("nan"), device="cuda", dtype=dtype)  # freed: the output's block next
        site, rope_site = Site("qk_norm_rotary_half"), Site("rotary_half_partial")
        with torch.no_grad():
            out = qk_norm_rotary_half(norm, x, cos, sin, site, rope_site, PARTIAL)
        assert torch.equal(out, ref) and out.is_contiguous() and out.shape == x.shape
        assert site.fast == 1 and not site.fallback and not (rope_site.fast or rope_site.fallback), site
        flat = x.view(-1, heads, dim)
        torch.full((ref.numel() + 4096,), float("nan"), device="cuda", dtype=dtype)
        nvrtc = OP_MOD._nvrtc_kernel(flat, norm.weight, eps, cos, sin)
        torch.full((ref.numel() + 4096,), float("nan"), device="cuda", dtype=dtype)
        raw = torch.ops.diffusers_fastpath._qk_norm_rotary_half_cuda(flat, norm.weight, eps, cos, sin)
        assert torch.equal(nvrtc.view(x.shape), ref) and torch.equal(raw.view(x.shape), ref)
    assert QK_NORM_ROTARY_HALF.disabled is None
    assert (str(dtype).removeprefix("torch."), dim, rot, "rotate-half") in QK_NORM_ROTARY_HALF.verified


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim, rot", [(128, 128), (128, 2), (128, 6), (96, 60), (64, 48), (8, 6), (4, 2)], ids=str)
def test_every_split_of_the_head_both_ways(dim, rot, dtype, both_ways):
    """Other head and rotary widths (R/2 not a multiple of 4: a quad on both sides of R/2, partners across lanes),
    through the NVRTC launcher and the raw op, against the model's function."""
    norm = _norm(dim, dtype, "cuda", 3)
    x, cos, sin = _inputs(2, 33, 5, dim, rot, dtype, "cuda", 4)
    ref = _eager(norm, x, cos, sin)
    torch.full((ref.numel() + 4096,), float("nan"), device="cuda", dtype=dtype)
    got = OP_MOD._nvrtc_kernel(x.view(-1, 5, dim), norm.weight, norm.eps, cos, sin).view(x.shape)
    assert torch.equal(got, ref)
    raw = torch.ops.diffusers_fastpath._qk_norm_rotary_half_cuda(x.view(-1, 5, dim), norm.weight, norm.eps, cos, sin)
    assert torch.equal(raw.view(x.shape), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_bitwise(dtype):
    """Zero heads (rstd = rsqrt(eps)), huge and tiny heads, infinities and NaNs in x and the tables: the bits of the
    model's chain."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    heads, dim, rot = 7, 128, 96
    norm = _norm(dim, dtype, "cuda", 5)
    x, cos, sin = _inputs(1, 64, heads, dim, rot, dtype, "cuda", 6)
    info = torch.finfo(dtype)
    x[0, ::5, 0] = 0.0
    x[0, 1::7, 1] = info.max
    x[0, 2::9, 2] = info.tiny
    x[0, 3::11, 3, ::13] = float("inf")
    x[0, 4::13, 4, 5] = float("nan")
    cos[::7, ::5], sin[3::11, 1::3] = -0.0, float("inf")
    ref = _eager(norm, x, cos, sin)
    out = torch.ops.diffusers_fastpath._qk_norm_rotary_half_cuda(x.view(-1, heads, dim), norm.weight, norm.eps, cos, sin)
    bits = torch.int16
    assert torch.equal(out.view(x.shape).view(bits), ref.view(bits))


@pytest.mark.gpu
def test_zoo_minimax_runs_its_qk_norms_fused_on_cuda():
    from test_generic_zoo import _check

    sites = _check("minimax-h3", "cuda")
    fused = [s for s in sites if s.op == "qk_norm_rotary_half"]
    assert sorted(s.fast for s in fused) == [0, 4, 4] and not any(s.fallback for s in fused), fused


@pytest.mark.gpu
def test_opcheck_cuda():
    norm = _norm(128, torch.bfloat16, "cuda", 0)
    x, cos, sin = _inputs(1, 13, 3, 128, 96, torch.bfloat16, "cuda", 0)
    torch.library.opcheck(torch.ops.diffusers_fastpath.qk_norm_rotary_half.default, (x, norm.weight, 1e-5, cos, sin))


# --- CPU: the arithmetic, the guard ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tables", [torch.float32, None], ids=["fp32 tables", "tables of x's dtype"])
def test_the_reference_and_the_kernels_rotary_are_the_models_chain_bit_for_bit(dtype, tables):
    norm = _norm(16, dtype, "cpu", 1)
    x, cos, sin = _inputs(2, 9, 3, 16, 10, dtype, "cpu", 2, tables or dtype)
    ref = _eager(norm, x, cos, sin)
    with torch.no_grad():
        assert torch.equal(qk_norm_rotary_half_ref(norm, x, cos, sin, None, PARTIAL), ref)
        assert torch.equal(qk_norm_rotary_half_ref(norm, x, cos, sin), ref)  # the custom op's stand-in
        y = norm(x)  # the kernel's rotary: tables rounded to x's dtype, each product and the sum rounded, rest copied
    c, s = cos.to(dtype)[None, :, None, :], sin.to(dtype)[None, :, None, :]
    assert torch.equal(torch.cat([kernel_arithmetic(y[..., :10], c, s), y[..., 10:]], dim=-1), ref)
    assert torch.equal(rotary_half_partial_ref(y, cos, sin), ref)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("fp32", "dtype float32"),
        ("wide_head", "D outside the reproduced reduction"),
        ("head_not_quads", "D outside the reproduced reduction"),
        ("fp32_weight", "norm weight dtype differs"),
        ("no_weight", "norm not a plain torch.nn.RMSNorm with weight"),
        ("diffusers_norm", "norm not a plain torch.nn.RMSNorm with weight"),
        ("fp64_tables", "cos/sin dtype"),
        ("odd_rot", "rotary dim odd or above head_dim"),
        ("strided", "strided"),
        ("requires_grad", "requires grad"),
        ("hooked", "RMSNorm has hooks"),
        ("cpu", "device cpu"),
    ],
)
def test_guard_refuses_with_reason_and_eager_runs(case, reason, monkeypatch):
    dim, rot, dtype = 16, 10, torch.bfloat16
    norm = _norm(dim, dtype, "cpu", 3)
    x, cos, sin = _inputs(2, 6, 3, dim, rot, dtype, "cpu", 4)
    if case == "fp32":
        x, norm = x.float(), norm.float()
    elif case == "wide_head":
        norm, x = _norm(256, dtype, "cpu", 3), _inputs(2, 6, 3, 256, rot, dtype, "cpu", 4)[0]
    elif case == "head_not_quads":
        norm, x = _norm(18, dtype, "cpu", 3), _inputs(2, 6, 3, 18, rot, dtype, "cpu", 4)[0]
    elif case == "fp32_weight":
        norm = norm.float()
    elif case == "no_weight":
        norm = nn.RMSNorm(dim, eps=1e-5, elementwise_affine=False)
    elif case == "diffusers_norm":
        norm = DiffusersRMSNorm(dim, eps=1e-5).to(dtype)
    elif case == "fp64_tables":
        cos, sin = cos.double(), sin.double()
    elif case == "odd_rot":
        cos, sin = cos[:, :9].contiguous(), sin[:, :9].contiguous()
    elif case == "strided":
        x = torch.cat([x, x], dim=-1)[..., ::2]
    elif case == "requires_grad":
        x = x.clone().requires_grad_()
    elif case == "hooked":
        norm.register_forward_hook(lambda module, args, out: None)
    if case != "cpu":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(QK_NORM_ROTARY_HALF, "kernel", lambda *a: pytest.fail("the kernel ran"))
    site, rope_site = Site("qk_norm_rotary_half"), Site("rotary_half_partial")
    with torch.set_grad_enabled(case == "requires_grad"):
        out = qk_norm_rotary_half(norm, x, cos, sin, site, rope_site, PARTIAL)
        ref = PARTIAL(norm(x), cos, sin)
    assert torch.equal(out, ref) and site.fast == 0 and dict(site.fallback) == {reason: 1}


def test_a_refused_norm_keeps_the_rotary_fused(emulated_kernels):
    """The fallback: the norm module as written (its hooks run), then the exact fused `rotary_half_partial`."""
    norm = _norm(16, torch.bfloat16, "cpu", 7)
    calls = []
    norm.register_forward_hook(lambda module, args, out: calls.append(1))
    x, cos, sin = _inputs(2, 6, 3, 16, 10, torch.bfloat16, "cpu", 8)
    site, rope_site = Site("qk_norm_rotary_half"), Site("rotary_half_partial")
    with torch.no_grad():
        out = qk_norm_rotary_half(norm, x, cos, sin, site, rope_site, PARTIAL)
    assert calls == [1]  # the fallback calls the module: its hook runs, once, as in eager
    assert torch.equal(out, _eager(norm, x, cos, sin))
    assert dict(site.fallback) == {"RMSNorm has hooks": 1} and rope_site.fast == 1 and not rope_site.fallback


def test_the_emulated_kernel_runs_and_verifies(emulated_kernels):
    norm = _norm(64, torch.bfloat16, "cpu", 9)
    x, cos, sin = _inputs(1, 11, 2, 64, 48, torch.bfloat16, "cpu", 10)
    site = Site("qk_norm_rotary_half")
    with torch.no_grad():
        out = qk_norm_rotary_half(norm, x, cos, sin, site, None, PARTIAL)
    assert torch.equal(out, _eager(norm, x, cos, sin)) and site.fast == 1 and not site.fallback


def test_custom_op_opcheck_cpu():
    norm = _norm(16, torch.bfloat16, "cpu", 11)
    x, cos, sin = _inputs(2, 5, 3, 16, 10, torch.bfloat16, "cpu", 12)
    op = torch.ops.diffusers_fastpath.qk_norm_rotary_half.default
    torch.library.opcheck(op, (x, norm.weight, norm.eps, cos, sin))
    assert torch.equal(op(x, norm.weight, norm.eps, cos, sin), _eager(norm, x, cos, sin))


# --- the rewriter's call ----------------------------------------------------------------------------------------------


def test_the_namespace_fuses_only_a_pending_torch_rmsnorm_before_the_known_function(emulated_kernels):
    from diffusers_fastpath.models._chain_calls import _ChainsNamespace
    from diffusers_fastpath.models._chain_pending import PARTIAL_UNFUSED

    ns = _ChainsNamespace
    x, cos, sin = _inputs(2, 6, 3, 16, 10, torch.bfloat16, "cpu", 13)
    norm = _norm(16, torch.bfloat16, "cpu", 14)
    ref = _eager(norm, x, cos, sin)
    site, qk_site = Site("rotary_half_partial"), Site("qk_norm_rotary_half")
    with torch.no_grad():
        out = ns.rotary_half_partial(PARTIAL, ns.norm_later(norm, x), (cos, sin), site, qk_site)
    assert torch.equal(out, ref) and qk_site.fast == 1 and site.fast == 0

    def other(y, c, s):  # another function: the norm and it, as written
        return y * 2

    with torch.no_grad():
        out = ns.rotary_half_partial(other, ns.norm_later(norm, x), (cos, sin), site, qk_site)
        assert torch.equal(out, norm(x) * 2)
    assert dict(qk_site.fallback) == {PARTIAL_UNFUSED: 1} and site.fast == 0
    diffusers_norm = DiffusersRMSNorm(16, eps=1e-5).to(torch.bfloat16)  # pending, but not torch's: as written, the
    with torch.no_grad():  # rotary still fused
        out = ns.rotary_half_partial(PARTIAL, ns.norm_later(diffusers_norm, x), (cos, sin), site, qk_site)
        assert torch.equal(out, PARTIAL(diffusers_norm(x), cos, sin))
    assert qk_site.fallback[PARTIAL_UNFUSED] == 2 and site.fast == 1
    with torch.no_grad():  # a tensor (the norm ran as written, or none): the rotary alone, as before
        assert torch.equal(ns.rotary_half_partial(PARTIAL, norm(x), (cos, sin), site, qk_site), ref)
    assert site.fast == 2 and qk_site.fast == 1


def test_zoo_minimax_patched_equals_unpatched_with_its_qk_norms_fused(emulated_kernels):
    """The tiny MiniMax-H3 (2 heads of 64, 48 rotated channels): patched == unpatched, torch.equal; the two blocks'
    attentions run their QK norms with the rotary (4 calls each: q and k, two forwards), the token refiner's (no table)
    runs them as written and counts nothing; unpatch gives every attention diffusers' processor back."""
    from test_generic_zoo import _check

    sites = _check("minimax-h3", "cpu")  # (patched == unpatched, verified once, unpatch restores the module classes)
    fused = [s for s in sites if s.op == "qk_norm_rotary_half"]
    assert sorted(s.fast for s in fused) == [0, 4, 4] and not any(s.fallback for s in fused), fused
    assert not any(s.fast or s.fallback for s in sites if s.op == "rotary_half_partial"), sites

    model = zoo.build("minimax-h3", dtype=torch.bfloat16)
    attentions = [m for m in model.modules() if isinstance(m, transformer_minimax_h3.MiniMaxH3Attention)]
    fp.patch(model)
    assert all(type(m.processor) is not transformer_minimax_h3.MiniMaxH3AttnProcessor for m in attentions)
    fp.unpatch(model)
    assert all(type(m.processor) is transformer_minimax_h3.MiniMaxH3AttnProcessor for m in attentions)
    assert not any(hasattr(m, "_fastpath_site_qk_norm_rotary_half") for m in attentions)


# --- the NVRTC launch -------------------------------------------------------------------------------------------------


def test_nvrtc_launcher_passes_what_bindings_rotary_cpp_passes(captured_launches):
    """The NVRTC launch, field by field, as bindings_rotary.cpp's qk_norm_rotary_half fills RotateHalfArgs: one block
    of 128 threads per row, the weight and eps set (rotary_half's launch leaves them null)."""
    x = _inputs(1, 6, 3, 128, 96, torch.bfloat16, "cpu", 15)[0].view(6, 3, 128)
    cos, sin = torch.randn(6, 96), torch.randn(6, 96)
    weight = torch.randn(128).bfloat16()
    out = OP_MOD._nvrtc_kernel(x, weight, 1e-5, cos, sin)
    kernel, key, grid, block, args = captured_launches[-1]
    a = args.a
    assert (kernel, key, grid, block) == (OP_MOD._NVRTC, torch.bfloat16, (6, 1, 1), (128, 1, 1))
    assert (a.out, a.x, a.cos, a.sin, a.rows, a.heads, a.dim, a.rot_dim, a.table_rows, a.tables_f32, a.dtype) == (
        out.data_ptr(), x.data_ptr(), cos.data_ptr(), sin.data_ptr(), 6, 3, 128, 96, 6, True, 1)
    assert a.weight == weight.data_ptr() and a.eps == pytest.approx(1e-5) and out.shape == x.shape
    half_mod = importlib.import_module("diffusers_fastpath.ops.rotary_half")
    half_mod._nvrtc_kernel(x, cos, sin)
    a = captured_launches[-1][-1].a
    assert (a.weight, a.eps) == (None, 0.0)  # the rotary alone: no norm
    assert OP_MOD._raw_guard(x, weight.float(), 1e-5, cos, sin) is not None  # a weight of another dtype refused
    assert OP_MOD._raw_guard(x[..., :126], weight[:126], 1e-5, cos, sin) is not None  # D not a multiple of 4
