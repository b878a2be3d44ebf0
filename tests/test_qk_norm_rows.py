"""qk_norm_rows_rope: LTX-Video's and Wan's QK norms across all heads (``torch.nn.RMSNorm(C)``) with their rotary, in
the rotary kernel's row norm (self-verified): bit-exact on the GPU at LTX-Video's and Wan 14B's shapes with the fast
path verified, the order the probe names, and the guards, verification and fallbacks everywhere."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from test_rotary import activations, ltx_tables, norm_of, rope_tables, wan_tables

from diffusers_fastpath.ops import (Site, qk_norm_rows_rope, qk_norm_rows_rope_pair, qk_norm_rows_rope_pair_ref,
                                    qk_norm_rows_rope_ref, rotary_emb_rows_ref, rotary_emb_wan_ref)
from diffusers_fastpath.ops import _policy
from diffusers_fastpath.ops.qk_norm_rope import QK_NORM_ROWS_ROPE, QK_NORM_ROWS_ROPE_PAIR, ROW_NORM_FINAL, _rows_kernel
from diffusers_fastpath.ops.rotary import ROTARY_EMB_ROWS, ROTARY_EMB_WAN

DTYPES = [torch.bfloat16, torch.float16]


def rows_inputs(batch, seq, channels, dtype, device, seed, heads=0, table_batch=1, strided=False, grid=None):
    """A QK norm of `channels`, ``[B, S, C]`` activations (a fused-qkv view with `strided`) and the tables: LTX-Video's
    ``[table_batch, S, C]`` (``heads=0``), or Wan's ``[1, S, 1, C / heads]`` (its own for a latent `grid`, else
    random)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    norm = norm_of(channels, dtype, device, gen)
    h = heads or channels // 4
    x = activations((batch, seq, h, channels // h), dtype, device, gen, strided).flatten(2)
    if not heads:
        cos, sin = ltx_tables(table_batch, seq, channels, device, seed)
    elif grid is not None:
        cos, sin = wan_tables(grid, device)
    else:
        cos, sin = (t.view(1, seq, 1, channels // heads) for t in rope_tables(seq, channels // heads, device, seed))
    return norm, x, cos, sin, heads


def _bits(t):
    return t.view(torch.int16)


# --- GPU: the contract ---------------------------------------------------------------------------------------

# (batch, seq, C, heads, table batch, Wan grid): LTX-Video 768x512x121 (6,144 tokens, C = 2048; a CFG batch with a
# table per sample and with one for both), Wan 2.1 14B at 832x480x81 (32,760 tokens, C = 5120, 40 heads of 128, its
# own tables), a small Wan-like batch (C = 1536: not a power of two), odd small LTX-like rows (C = 200, 12)
ROWS_CASES = [(1, 6144, 2048, 0, 1, None), (2, 6144, 2048, 0, 2, None), (2, 6144, 2048, 0, 1, None),
              (1, 32760, 5120, 40, 1, (21, 30, 52)), (2, 105, 1536, 12, 1, (3, 5, 7)), (2, 37, 200, 0, 2, None),
              (1, 5, 12, 0, 1, None)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ROWS_CASES, ids=str)
def test_qk_norm_rows_rope_matches_eager_bitwise_and_verifies(case, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    batch, seq, channels, heads, table_batch, grid = case
    for seed, strided in [(0, False), (1, True)]:  # fresh inputs each round; the second a view of a qkv projection
        norm, x, cos, sin, heads = rows_inputs(batch, seq, channels, dtype, "cuda", seed, heads, table_batch, strided,
                                               grid)
        ref = qk_norm_rows_rope_ref(norm, x, cos, sin, heads)
        assert torch.isfinite(ref).all() and ref.float().std() > 0.1
        poison = torch.full_like(ref, float("nan"))
        del poison  # its block is what the caching allocator hands the kernel's output next: NaN unless written
        site, rope_site = Site("qk_norm_rows_rope"), Site("rotary_emb")
        assert torch.equal(qk_norm_rows_rope(norm, x, cos, sin, heads, site, rope_site), ref)
        # the fused path really ran, verified itself against eager and stayed enabled
        assert site.fast == 1 and not site.fallback and rope_site.fast == 0
    key = (str(dtype).removeprefix("torch."), channels, "wan" if heads else "rows")
    assert QK_NORM_ROWS_ROPE.disabled is None and key in QK_NORM_ROWS_ROPE.verified


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_norm_rows_rope_special_values_bitwise(dtype):
    """NaN, infinities, signed zeros and subnormals in some rows (a row with one of them normalises to NaN or zeros in
    eager too): the same bits as eager, row by row."""
    norm, x, cos, sin, _ = rows_inputs(2, 64, 2048, dtype, "cuda", 9)
    info = torch.finfo(dtype)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, info.tiny / 4, info.max],
                            dtype=dtype, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(9)
    hit = torch.rand(x.shape, generator=gen, device="cuda") < 0.002
    x = torch.where(hit, specials[torch.randint(0, len(specials), x.shape, generator=gen, device="cuda")], x)
    x[0, 3] = 0.0  # a zero row: rstd = rsqrt(eps)
    ref = qk_norm_rows_rope_ref(norm, x, cos, sin)
    assert ref.isnan().any()
    assert torch.equal(_bits(qk_norm_rows_rope(norm, x, cos, sin)), _bits(ref))


@pytest.mark.gpu
def test_the_production_row_norm_is_the_order_that_matches():
    """Each of the kernel's ways of turning the sum of squares into the mean square, against eager at C = 5120 (not a
    power of two: they differ there): the one the op runs matches every row."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    norm, x, cos, sin, heads = rows_inputs(1, 4096, 5120, torch.bfloat16, "cuda", 4, heads=40)
    ref = qk_norm_rows_rope_ref(norm, x, cos, sin, heads)
    matching = [final for final in (0, 1, 2)
                if torch.equal(_rows_kernel(norm, x, cos, sin, heads, norm_final=final), ref)]
    assert matching == [ROW_NORM_FINAL], matching


@pytest.mark.gpu
def test_qk_norm_rows_rope_fallback_keeps_the_fused_rope_on_cuda(monkeypatch):
    """A norm kernel that fails verification: eager result, the op disabled once, the exact rotary kernel still runs."""
    def off_by_one_ulp(*args):
        out = qk_norm_rows_rope_ref(*args[:5])
        return (out.view(torch.int16) + 1).view(out.dtype)

    monkeypatch.setattr(QK_NORM_ROWS_ROPE, "kernel", off_by_one_ulp)
    args = rows_inputs(1, 512, 2048, torch.bfloat16, "cuda", 5)
    ref = qk_norm_rows_rope_ref(*args)
    site, rope_site = Site("qk_norm_rows_rope"), Site("rotary_emb")
    for _ in range(2):
        assert torch.equal(qk_norm_rows_rope(*args, site, rope_site), ref)
    assert QK_NORM_ROWS_ROPE.disabled and site.fast == 0 and rope_site.fast == 2 and not rope_site.fallback


@pytest.mark.gpu
def test_qk_norm_rows_rope_opcheck_cuda():
    ops = torch.ops.diffusers_fastpath
    for heads in (0, 4):
        norm, x, cos, sin, heads = rows_inputs(2, 13, 512, torch.bfloat16, "cuda", 0, heads)
        torch.library.opcheck(ops.qk_norm_rows_rope.default, (x, norm.weight, norm.eps, cos, sin, heads))


def pair_inputs(batch, seq, channels, dtype, device, seed, table_batch=1, strided=False):
    """LTX-Video's q and k (each its own norm; with `strided` views of one fused qkv projection) and one pair of
    ``[table_batch, S, C]`` tables."""
    norm_q, q, cos, sin, _ = rows_inputs(batch, seq, channels, dtype, device, seed, 0, table_batch, strided)
    norm_k, k, _, _, _ = rows_inputs(batch, seq, channels, dtype, device, seed + 100, 0, table_batch, strided)
    return norm_q, q, norm_k, k, cos, sin


# (batch, seq, C, table batch): LTX-Video 768x512x121 and its CFG batch (a table per sample, one for both), odd small
PAIR_CASES = [(1, 6144, 2048, 1), (2, 6144, 2048, 2), (2, 6144, 2048, 1), (2, 37, 200, 2), (1, 5, 12, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PAIR_CASES, ids=str)
def test_qk_norm_rows_rope_pair_matches_eager_bitwise_and_verifies(case, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    batch, seq, channels, table_batch = case
    for seed, strided in [(0, False), (1, True)]:
        args = pair_inputs(batch, seq, channels, dtype, "cuda", seed, table_batch, strided)
        ref = qk_norm_rows_rope_pair_ref(*args)
        assert all(torch.isfinite(r).all() and r.float().std() > 0.1 for r in ref)
        poison = torch.full((2, *ref[0].shape), float("nan"), dtype=dtype, device="cuda")
        del poison  # its block is what the caching allocator hands the kernel's output next: NaN unless written
        site, rope_site = Site("qk_norm_rows_rope_pair"), Site("rotary_emb")
        got = qk_norm_rows_rope_pair(*args, site, rope_site)
        for g, r in zip(got, ref):
            assert torch.equal(g, r) and g.stride() == r.stride()
        assert site.fast == 1 and not site.fallback and rope_site.fast == 0
    assert (str(dtype).removeprefix("torch."), channels, "rows-pair") in QK_NORM_ROWS_ROPE_PAIR.verified


@pytest.mark.gpu
def test_qk_norm_rows_rope_pair_opcheck_cuda():
    norm_q, q, norm_k, k, cos, sin = pair_inputs(2, 13, 512, torch.bfloat16, "cuda", 0, 2)
    torch.library.opcheck(torch.ops.diffusers_fastpath.qk_norm_rows_rope_pair.default,
                          (q, norm_q.weight, norm_q.eps, k, norm_k.weight, norm_k.eps, cos, sin))


# --- CPU: references, guards, self-verification, fallbacks --------------------------------------------------------


@pytest.mark.parametrize("case, reason", [("k_hooked", "RMSNorm has hooks"),
                                          ("shapes_differ", "q and k differ in shape or dtype"),
                                          ("wide", "C above the pair's registers")])
def test_the_pair_falls_back_to_each_on_its_own(case, reason, monkeypatch):
    """A refused pair: its reason counted, each of q and k through `qk_norm_rows_rope` (itself fused where it can:
    here with its kernel standing in), the results eager's."""
    channels = 4104 if case == "wide" else 48
    norm_q, q, norm_k, k, cos, sin = pair_inputs(2, 11, channels, torch.bfloat16, "cpu", 4, 2)
    if case == "k_hooked":
        norm_k.register_forward_hook(lambda m, i, o: o)
    elif case == "shapes_differ":
        k = k[:, :, :44]
        norm_k = torch.nn.RMSNorm(44, eps=1e-6).to(torch.bfloat16).requires_grad_(False)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(QK_NORM_ROWS_ROPE, "kernel", lambda *a, **k: qk_norm_rows_rope_ref(*a[:5]))
    monkeypatch.setattr(ROTARY_EMB_ROWS, "kernel", rotary_emb_rows_ref)
    site = Site("qk_norm_rows_rope_pair")
    if case == "shapes_differ":  # eager rotates k with tables of q's width: it raises, and so does the op
        with pytest.raises(RuntimeError):
            qk_norm_rows_rope_pair(norm_q, q, norm_k, k, cos, sin, site)
        assert dict(site.fallback) == {reason: 1}
        return
    with torch.no_grad():
        got = qk_norm_rows_rope_pair(norm_q, q, norm_k, k, cos, sin, site)
        ref = qk_norm_rows_rope_pair_ref(norm_q, q, norm_k, k, cos, sin)
    assert all(torch.equal(g, r) for g, r in zip(got, ref))
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}


def test_the_pair_refuses_tables_requiring_grad(monkeypatch):
    """Under grad mode, tables that require grad (a learned rotary) make eager's q and k record their gradient, the
    kernel's nothing: the pair refuses, and so does each single op it falls back to; the gradient reaches the tables."""
    norm_q, q, norm_k, k, cos, sin = pair_inputs(2, 11, 48, torch.bfloat16, "cpu", 6, 2)
    cos = cos.clone().requires_grad_()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    for op, ref in ((QK_NORM_ROWS_ROPE_PAIR, qk_norm_rows_rope_pair_ref), (QK_NORM_ROWS_ROPE, qk_norm_rows_rope_ref),
                    (ROTARY_EMB_ROWS, rotary_emb_rows_ref)):  # raw kernels: values without autograd history
        monkeypatch.setattr(op, "kernel", lambda *a, ref=ref, **kw: torch.no_grad()(ref)(*a))
    site = Site("qk_norm_rows_rope_pair")
    got = qk_norm_rows_rope_pair(norm_q, q, norm_k, k, cos, sin, site)
    ref = qk_norm_rows_rope_pair_ref(norm_q, q, norm_k, k, cos, sin)
    assert all(torch.equal(g, r) and g.requires_grad for g, r in zip(got, ref))
    assert site.fast == 0 and dict(site.fallback) == {"requires grad": 1}
    sum(g.float().sum() for g in got).backward()
    assert cos.grad is not None


def test_the_pair_verifies_once_and_is_the_custom_op_under_compile(monkeypatch):
    for op in (QK_NORM_ROWS_ROPE_PAIR, QK_NORM_ROWS_ROPE, ROTARY_EMB_ROWS):
        monkeypatch.setattr(op, "guard", lambda *a, **k: None)
    calls, real_ref = _exact_kernel_counting_refs(monkeypatch, QK_NORM_ROWS_ROPE_PAIR, 6)
    site = Site("qk_norm_rows_rope_pair")
    with torch.no_grad():
        for seed in range(3):
            qk_norm_rows_rope_pair(*pair_inputs(2, 11, 48, torch.bfloat16, "cpu", seed, 2), site)
    assert calls["ref"] == 1 and site.fast == 3 and QK_NORM_ROWS_ROPE_PAIR.verified == {("bfloat16", 48, "rows-pair")}
    emitted = []
    monkeypatch.setattr(QK_NORM_ROWS_ROPE_PAIR, "custom_op", lambda *a: emitted.append(1) or real_ref(*a[:6]))
    args = pair_inputs(2, 11, 48, torch.bfloat16, "cpu", 5, 2)
    fn = torch.compile(lambda *a: qk_norm_rows_rope_pair(*a), fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert all(torch.equal(g, r) for g, r in zip(fn(*args), qk_norm_rows_rope_pair_ref(*args))) and emitted


def test_pair_custom_op_opcheck_cpu():
    norm_q, q, norm_k, k, cos, sin = pair_inputs(2, 11, 48, torch.bfloat16, "cpu", 0, 2)
    op = torch.ops.diffusers_fastpath.qk_norm_rows_rope_pair
    torch.library.opcheck(op.default, (q, norm_q.weight, norm_q.eps, k, norm_k.weight, norm_k.eps, cos, sin))
    with torch.no_grad():
        out = op(q, norm_q.weight, norm_q.eps, k, norm_k.weight, norm_k.eps, cos, sin)
        ref = qk_norm_rows_rope_pair_ref(norm_q, q, norm_k, k, cos, sin)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@pytest.mark.parametrize("heads", [0, 4])
def test_the_reference_is_the_norm_then_the_models_rotary(heads):
    norm, x, cos, sin, heads = rows_inputs(2, 9, 64, torch.bfloat16, "cpu", 1, heads)
    with torch.no_grad():
        y = norm(x)
        expect = rotary_emb_wan_ref(y.unflatten(2, (heads, -1)), cos, sin) if heads else rotary_emb_rows_ref(y, cos, sin)
        assert torch.equal(qk_norm_rows_rope_ref(norm, x, cos, sin, heads), expect)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("fp32", "dtype float32"),
        ("heads_do_not_divide", "shape"),
        ("wan_head_dim_96", "head_dim does not divide 512"),
        ("no_weight", "norm not a plain torch.nn.RMSNorm with weight"),
        ("diffusers_rmsnorm", "norm not a plain torch.nn.RMSNorm with weight"),
        ("eps_none", "norm not a plain torch.nn.RMSNorm with weight"),
        ("hooked", "RMSNorm has hooks"),  # the policy refuses a hooked module before the guard
        ("per_head_norm", "norm not a plain torch.nn.RMSNorm with weight"),
        ("fp32_weight", "norm weight dtype differs"),
        ("strided_x", "x strided"),
        ("per_sample_wan_tables", "cos/sin shape"),
        ("requires_grad", "requires grad"),
        ("tables_requiring_grad", "requires grad"),
        ("wan_tables_requiring_grad", "requires grad"),
        ("cpu", "device cpu"),
    ],
)
def test_qk_norm_rows_rope_guard_falls_back_to_the_fused_rope(case, reason, monkeypatch):
    """Each refusal: the eager result, the reason counted, and the rotary part still on its (exact) fast path."""
    wan = case in ("heads_do_not_divide", "per_sample_wan_tables", "wan_head_dim_96", "wan_tables_requiring_grad")
    grad = case in ("requires_grad", "tables_requiring_grad", "wan_tables_requiring_grad")
    channels, heads = (192, 2) if case == "wan_head_dim_96" else (48, 4 if wan else 0)
    norm, x, cos, sin, heads = rows_inputs(2, 11, channels, torch.bfloat16, "cpu", 2, heads=heads)
    if case == "fp32":
        norm, x = norm.float(), x.float()
    elif case == "heads_do_not_divide":
        heads = 5
    elif case == "no_weight":
        norm = torch.nn.RMSNorm(channels, eps=1e-6, elementwise_affine=False)
    elif case == "diffusers_rmsnorm":
        norm = DiffusersRMSNorm(channels, eps=1e-6).to(torch.bfloat16).requires_grad_(False)
    elif case == "eps_none":
        norm = torch.nn.RMSNorm(channels).to(torch.bfloat16).requires_grad_(False)
    elif case == "hooked":
        norm.register_forward_hook(lambda m, i, o: o)
    elif case == "per_head_norm":  # a norm over the last two dims: not this chain
        norm = torch.nn.RMSNorm((11, 48), eps=1e-6).to(torch.bfloat16).requires_grad_(False)
    elif case == "fp32_weight":
        norm = norm.float()
    elif case == "strided_x":
        x = torch.cat([x, x], dim=2)[..., ::2]
    elif case == "per_sample_wan_tables":
        cos, sin = cos.expand(2, -1, -1, -1), sin.expand(2, -1, -1, -1)
    elif case == "requires_grad":
        x = x.clone().requires_grad_()
    elif case in ("tables_requiring_grad", "wan_tables_requiring_grad"):  # eager records their gradient, the kernel not
        cos = cos.clone().requires_grad_()
    if case != "cpu":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
        monkeypatch.setattr(ROTARY_EMB_ROWS, "kernel", rotary_emb_rows_ref)  # stand in for the exact CUDA kernels
        monkeypatch.setattr(ROTARY_EMB_WAN, "kernel", rotary_emb_wan_ref)
    site, rope_site = Site("qk_norm_rows_rope"), Site("rotary_emb")
    if case == "heads_do_not_divide":  # eager raises on these: so does the op, as eager
        with pytest.raises(RuntimeError):
            qk_norm_rows_rope_ref(norm, x, cos, sin, heads)
        with pytest.raises(RuntimeError):
            qk_norm_rows_rope(norm, x, cos, sin, heads, site, rope_site)
        assert site.fast == 0 and dict(site.fallback) == {reason: 1}
        return
    with torch.no_grad() if not grad else torch.enable_grad():
        out = qk_norm_rows_rope(norm, x, cos, sin, heads, site, rope_site)
        assert torch.equal(out, qk_norm_rows_rope_ref(norm, x, cos, sin, heads)) and out.requires_grad == grad
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}
    rope_fast = not grad and case not in ("cpu", "fp32", "per_sample_wan_tables")  # the rotary guards' refusals
    assert rope_site.fast == int(rope_fast) and sum(rope_site.fallback.values()) == int(not rope_fast)


@pytest.fixture
def guards_open(monkeypatch):
    for op in (QK_NORM_ROWS_ROPE, ROTARY_EMB_ROWS, ROTARY_EMB_WAN):
        monkeypatch.setattr(op, "guard", lambda *a, **k: None)
    monkeypatch.setattr(ROTARY_EMB_ROWS, "kernel", rotary_emb_rows_ref)  # exact by construction, like the kernels
    monkeypatch.setattr(ROTARY_EMB_WAN, "kernel", rotary_emb_wan_ref)


def test_a_row_norm_that_is_not_bit_exact_is_disabled_and_the_fused_rope_kept(guards_open, monkeypatch,
                                                                               fastpath_log):
    def off_by_one_ulp(*args):
        out = qk_norm_rows_rope_ref(*args[:5])
        return (out.view(torch.int16) + 1).view(out.dtype)  # wrong in the last bit everywhere

    monkeypatch.setattr(QK_NORM_ROWS_ROPE, "kernel", off_by_one_ulp)
    args = rows_inputs(2, 11, 48, torch.bfloat16, "cpu", 3, heads=4)
    ref = qk_norm_rows_rope_ref(*args)
    site, rope_site = Site("qk_norm_rows_rope"), Site("rotary_emb")
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(qk_norm_rows_rope(*args, site, rope_site), ref)
    assert "not bit-exact against this platform's eager result for ('bfloat16', 48, 'wan')" in QK_NORM_ROWS_ROPE.disabled
    assert not QK_NORM_ROWS_ROPE.verified and site.fast == 0 and dict(site.fallback) == {_policy.REASON_DISABLED: 3}
    assert rope_site.fast == 3 and not rope_site.fallback  # the rotary embedding stayed fused
    warnings = [r for r in fastpath_log.records if "disabling the fused op 'qk_norm_rows_rope'" in r.getMessage()]
    assert len(warnings) == 1


def _exact_kernel_counting_refs(monkeypatch, op, operands: int):
    """`op`'s kernel replaced by its reference (exact) of the first `operands` arguments, and the reference the
    verification runs counted: returns the counter and the real reference."""
    calls, real_ref = {"ref": 0}, op.ref

    def counting_ref(*args):
        calls["ref"] += 1
        return real_ref(*args)

    monkeypatch.setattr(op, "ref", counting_ref)
    monkeypatch.setattr(op, "kernel", lambda *a, **k: real_ref(*a[:operands]))
    return calls, real_ref


def test_verified_once_per_signature_and_the_custom_op_under_compile(guards_open, monkeypatch):
    calls, real_ref = _exact_kernel_counting_refs(monkeypatch, QK_NORM_ROWS_ROPE, 5)
    site = Site("qk_norm_rows_rope")
    with torch.no_grad():
        for seed, heads in [(0, 0), (1, 0), (2, 4), (3, 4)]:
            qk_norm_rows_rope(*rows_inputs(2, 11, 48, torch.bfloat16, "cpu", seed, heads), site)
    assert calls["ref"] == 2 and site.fast == 4
    assert QK_NORM_ROWS_ROPE.verified == {("bfloat16", 48, "rows"), ("bfloat16", 48, "wan")}
    emitted = []
    monkeypatch.setattr(QK_NORM_ROWS_ROPE, "custom_op", lambda *a: emitted.append(1) or real_ref(*a[:5]))
    args = rows_inputs(2, 11, 48, torch.bfloat16, "cpu", 5, heads=4)
    fn = torch.compile(lambda *a: qk_norm_rows_rope(*a), fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(fn(*args), qk_norm_rows_rope_ref(*args)) and emitted


@pytest.mark.parametrize("heads", [0, 4])
def test_custom_op_opcheck_cpu(heads):
    norm, x, cos, sin, heads = rows_inputs(2, 11, 48, torch.bfloat16, "cpu", 0, heads)
    op = torch.ops.diffusers_fastpath.qk_norm_rows_rope
    torch.library.opcheck(op.default, (x, norm.weight, norm.eps, cos, sin, heads))
    with torch.no_grad():
        assert torch.equal(op(x, norm.weight, norm.eps, cos, sin, heads), qk_norm_rows_rope_ref(norm, x, cos, sin, heads))
