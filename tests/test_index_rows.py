"""MiniMax-H3's ``index_select``-picked modulation rows read through the index (`ops/selected_rows.IndexedRows`):
the rows object (its int32 index, bounds kept), the rewriter's pass (`_chain_index_rows.lazy_index_rows`), the two
fused ops that read the rows (`modulate_scale_shift_rows`, `gated_residual_rows`: guards, fallbacks), the tiny
``minimax-h3`` model patched == unpatched with them fast and the written-out rows path gone (emulated kernels), an
out-of-range index failing patched as unpatched; on the GPU both raw kernels and both ops at MiniMax-H3's full-size
shapes with poisoned outputs, and an out-of-range index trapping (in a subprocess: it poisons the CUDA context)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath._state import sites_of
from diffusers_fastpath.models._chain_index_rows import lazy_index_rows
from diffusers_fastpath.ops import Site
from diffusers_fastpath.ops.gated_residual import GATED_RESIDUAL, GATED_RESIDUAL_ROWS, gated_residual_rows
from diffusers_fastpath.ops.modulate_scale_shift import (MODULATE_SCALE_SHIFT, MODULATE_SCALE_SHIFT_ROWS,
                                                         modulate_scale_shift_rows)
from diffusers_fastpath.ops.rms_norm_modulate_rows import RMS_NORM_MODULATE_ROWS
from diffusers_fastpath.ops.selected_rows import IndexedRows
from diffusers_fastpath.testing import zoo

DTYPES = [torch.bfloat16, torch.float16]


def make_tables(tables, dim, dtype, device, seed):
    """Six ``[tables, D]`` chunks of one ``[tables, 6D]`` projection (strided views, as MiniMax-H3's ``chunk(6)``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(tables, 6 * dim, generator=gen, device=device) * 2).to(dtype).chunk(6, dim=-1)


def make_index(n, tables, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    index = torch.randint(0, tables, (n,), generator=gen, device=device)
    index[: n // 3] = 1  # long runs of one row (text, audio, video), then any row
    return index


def _sample(out):
    while isinstance(out, (list, tuple)):
        out = out[0]
    return out


# --- the rows object -----------------------------------------------------------------------------------------------


def test_index_is_int32_and_keeps_bad_values_out_of_range():
    table = torch.randn(6, 16)
    rows = IndexedRows(table, torch.tensor([0, 5, 2, -1, 6, 2 ** 33 + 1, -(2 ** 40)]))
    assert rows.index().dtype is torch.int32
    assert rows.index().tolist() == [0, 5, 2, -1, 6, 6, -1]  # (2**33 + 1 would wrap to 1 in a plain cast)
    assert torch.equal(IndexedRows(table, torch.tensor([1, 2])).materialize(), table.index_select(0, torch.tensor([1, 2])))
    assert IndexedRows(table, torch.tensor([1, 2], dtype=torch.int32)).index().tolist() == [1, 2]


def test_reason_admits_only_the_broadcast_of_one_row_per_token():
    table, index = torch.randn(6, 16), torch.tensor([0, 1, 2])
    rows = IndexedRows(table, index)
    assert rows.reason(torch.randn(1, 3, 16)) is None and rows.reason(torch.randn(3, 16)) is None
    assert rows.reason(torch.randn(2, 3, 16)) == "rows shape"  # the [N, D] rows broadcast over a batch of 2
    assert rows.reason(torch.randn(1, 4, 16)) == "rows shape"
    assert rows.reason(torch.randn(1, 3, 16, dtype=torch.float64)) == "mixed dtypes"
    assert IndexedRows(table, index.float()).reason(torch.randn(1, 3, 16)) == "rows shape"
    assert IndexedRows([1], index).reason(torch.randn(1, 3, 16)) == "rows operand not a tensor"


# --- the rewriter's pass -------------------------------------------------------------------------------------------


def _pass(src):
    body = ast.parse(textwrap.dedent(src)).body
    return lazy_index_rows(body, "ns"), ast.unparse(ast.Module(body=body, type_ignores=[]))


def test_pass_takes_the_index_select_operands_of_the_fused_calls():
    count, out = _pass("""
        y = ns.modulate_rows(n, s.index_select(0, i), t.index_select(0, i), getattr(self, 'a', None), 1.0, True)
        h = ns.gated_residual(r, g.index_select(0, i), e, getattr(self, 'b', None))
    """)
    assert count == 2
    assert "ns.modulate_rows(n, ns.index_rows(s, i), ns.index_rows(t, i)" in out
    assert "ns.gated_residual_rows(r, ns.index_rows(g, i), e" in out and "index_select" not in out


@pytest.mark.parametrize("src", [
    "y = ns.modulate_rows(n, s.index_select(0, i), t, site, 1.0, True)",  # a shift of another form
    "y = ns.modulate_rows(n, s.index_select(1, i), t.index_select(1, i), site, 1.0, True)",  # another dimension
    "y = ns.modulate_rows(s.index_select(0, i), n, t.index_select(0, i), site, 1.0, False)",  # the scale first
    "y = ns.modulate_rows(n, s.index_select(0, i), t.index_select(0, i + 1), site, 1.0, True)",
    "y = ns.modulate_rows(n, s.index_select(0, i), t.index_select(0, i), f(), 1.0, True)",  # a later call may write
    "h = ns.gated_residual(r, g.index_select(0, i), self.attn(x), site)",  # the update computed after the rows
    "h = ns.gated_residual(r, g.index_select(0, index=i), e, site)",
    "h = ns.gated_residual(r, g.index_select(0, i).tanh(), e, site)",  # the rows read by another op first
    "h = other.gated_residual(r, g.index_select(0, i), e, site)",
])
def test_pass_keeps_every_other_form(src):
    count, out = _pass(src)
    assert count == 0 and out == ast.unparse(ast.parse(src))


# --- the ops: guards and fallbacks (kernels emulated) ----------------------------------------------------------------


def test_ops_read_the_rows_through_the_index(emulated_kernels):
    shift, scale, gate = make_tables(6, 64, torch.bfloat16, "cpu", 0)[:3]
    index = make_index(40, 6, "cpu", 1)
    x, update = torch.randn(1, 40, 64).bfloat16(), torch.randn(1, 40, 64).bfloat16()
    site = Site("modulate_scale_shift")
    out = modulate_scale_shift_rows(x, IndexedRows(scale, index), IndexedRows(shift, index), site)
    assert torch.equal(out, x * (1.0 + scale.index_select(0, index)) + shift.index_select(0, index))
    got = gated_residual_rows(x, IndexedRows(gate, index), update, site)
    assert torch.equal(got, x + gate.index_select(0, index) * update)
    assert site.fast == 2 and not site.fallback


@pytest.mark.parametrize("case", ["float32 table", "other indices", "x transposed", "batch 2", "int32 indices"])
def test_fallbacks_are_the_models_expression(case, emulated_kernels):
    shift, scale, gate = make_tables(6, 64, torch.bfloat16, "cpu", 2)[:3]
    index = make_index(40, 6, "cpu", 3)
    x = torch.randn(1, 40, 64).bfloat16()
    other = index
    if case == "float32 table":
        scale = scale.float()
    elif case == "other indices":
        other = index.clone()
    elif case == "x transposed":
        x = torch.randn(1, 64, 40).bfloat16().transpose(1, 2)
    elif case == "batch 2":
        x = torch.randn(2, 40, 64).bfloat16()
    elif case == "int32 indices":
        index = other = index.int()
    site = Site("modulate_scale_shift")
    out = MODULATE_SCALE_SHIFT_ROWS(site, x, IndexedRows(scale, index),
                                    IndexedRows(shift, other))
    assert torch.equal(out, x * (1.0 + scale.index_select(0, index)) + shift.index_select(0, other))
    assert (site.fast == 1) == (case == "int32 indices")


# --- the model --------------------------------------------------------------------------------------------------


def _counted(monkeypatch, *ops):
    calls = {op.name: 0 for op in ops}
    for op in ops:
        def kernel(*args, _op=op, _kernel=op.kernel):
            calls[_op.name] += 1
            return _kernel(*args)
        monkeypatch.setattr(op, "kernel", kernel)
    return calls


def test_zoo_model_patched_equal_unpatched_rows_never_written(emulated_kernels, monkeypatch):
    model = zoo.build("minimax-h3", dtype=torch.bfloat16)
    kwargs = zoo.inputs("minimax-h3", model)
    with torch.no_grad():
        ref = _sample(model(**kwargs)).clone()
    classes = [type(m) for m in model.modules()]
    calls = _counted(monkeypatch, MODULATE_SCALE_SHIFT, MODULATE_SCALE_SHIFT_ROWS, GATED_RESIDUAL, GATED_RESIDUAL_ROWS,
                     RMS_NORM_MODULATE_ROWS)
    fp.patch(model)
    try:
        for _ in range(2):  # verified, then trusted
            with torch.no_grad():
                assert torch.equal(_sample(model(**kwargs)), ref)
        blocks = [m for m in model.modules() if type(m).__name__.endswith("MiniMaxH3TransformerBlock")]
        gates = [s for b in blocks for _, s in sites_of(b)]
        assert len(gates) == 2 * len(blocks) and all(s.op == "gated_residual" for s in gates)
        # each block's norm1 / norm2 and the output norm: the norm and the modulate of its rows as one kernel
        norms = [s for b in blocks for n in ("norm1", "norm2") for _, s in sites_of(getattr(b, n))]
        norms += [s for _, s in sites_of(model.norm_out.norm)]
        assert len(norms) == 2 * len(blocks) + 1 and all(s.op == "rms_norm_modulate_rows" for s in norms)
        assert all(s.fast >= 1 and not s.fallback for s in gates + norms), gates + norms
        # the old paths (the [N, D] rows written out, then the plain kernels; the norm, then the rows' modulate) gone
        assert calls["modulate_scale_shift"] == 0 and calls["gated_residual"] == 0
        assert calls["modulate_scale_shift_rows"] == 0
        assert calls["rms_norm_modulate_rows"] > 0 and calls["gated_residual_rows"] > 0
    finally:
        fp.unpatch(model)
    assert [type(m) for m in model.modules()] == classes


def test_out_of_range_index_fails_patched_as_unpatched(emulated_kernels):
    model = zoo.build("minimax-h3", dtype=torch.bfloat16)
    block = model.transformer_blocks[0]
    kwargs = zoo.inputs("minimax-h3", model)
    n, dim = kwargs["position_ids"].shape[0], block.norm1.normalized_shape[0]
    x = torch.randn(1, n, dim).bfloat16()
    temb = torch.randn(1, model.transformer_blocks[0].adaln_proj.linear.in_features)
    rotary = model.rope(kwargs["position_ids"])
    for bad in (6, -1 - 6, 2 ** 33 + 1):
        index = torch.zeros(n, dtype=torch.int64)
        index[n // 2] = bad
        with pytest.raises(IndexError), torch.no_grad():
            block(x, temb, index, rotary)
        fp.patch(model)
        try:
            with pytest.raises(IndexError), torch.no_grad():
                model.transformer_blocks[0](x, temb, index, rotary)
        finally:
            fp.unpatch(model)


# --- the GPU -------------------------------------------------------------------------------------------------------

FULL = (38000, 5376, 6)  # MiniMax-H3 at 1344x768x124 + audio: ~38k packed tokens, 5376 wide, 2 timesteps x 3 tables


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_raw_kernels_match_eager_bitwise_on_the_gpu(dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    ops = torch.ops.diffusers_fastpath
    n, d, t = FULL
    for seed in range(2):
        shift, scale, gate = make_tables(t, d, dtype, "cuda", seed)[:3]
        index = make_index(n, t, "cuda", seed + 1)
        rows = IndexedRows(scale, index)
        gen = torch.Generator(device="cuda").manual_seed(seed + 10)
        x = (torch.randn(1, n, d, generator=gen, device="cuda") * 3 + 1).to(dtype)
        update = torch.randn(1, n, d, generator=gen, device="cuda").to(dtype)
        out = torch.full_like(x, float("nan"))
        out.copy_(ops._modulate_scale_shift_rows_cuda(x, scale, shift, rows.index()))
        assert torch.equal(out, x * (1.0 + scale.index_select(0, index)) + shift.index_select(0, index))
        out = torch.full_like(x, float("nan"))
        out.copy_(ops._gated_residual_rows_cuda(x, gate, rows.index().view(1, n), update))
        assert torch.equal(out, x + gate.index_select(0, index) * update)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ops_are_fast_and_verified_on_the_gpu(dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    n, d, t = FULL
    shift, scale, gate = make_tables(t, d, dtype, "cuda", 7)[:3]
    index = make_index(n, t, "cuda", 8)
    gen = torch.Generator(device="cuda").manual_seed(9)
    x, update = (torch.randn(2, 1, n, d, generator=gen, device="cuda").to(dtype)).unbind(0)
    site = Site("modulate_scale_shift")
    with torch.no_grad():
        out = modulate_scale_shift_rows(x, IndexedRows(scale, index), IndexedRows(shift, index), site)
        got = gated_residual_rows(x, IndexedRows(gate, index), update, site)
    assert torch.equal(out, x * (1.0 + scale.index_select(0, index)) + shift.index_select(0, index))
    assert torch.equal(got, x + gate.index_select(0, index) * update)
    assert site.fast == 2 and MODULATE_SCALE_SHIFT_ROWS.disabled is None and GATED_RESIDUAL_ROWS.disabled is None
    key = str(dtype).removeprefix("torch.")
    assert (key,) in MODULATE_SCALE_SHIFT_ROWS.verified and (key, "IndexedRows", False) in GATED_RESIDUAL_ROWS.verified


_TRAP = """
import sys, torch
from diffusers_fastpath.ops._build import load_extension
from diffusers_fastpath.ops.selected_rows import IndexedRows
load_extension()
ops = torch.ops.diffusers_fastpath
which, bad = sys.argv[1], int(sys.argv[2])
n, d = 38000, 5376
table = torch.randn(6, d, device="cuda").bfloat16()
x = torch.randn(1, n, d, device="cuda").bfloat16()
index = torch.zeros(n, dtype=torch.int64, device="cuda")
index[n - 7] = bad
rows = IndexedRows(table, index)
try:
    if which == "modulate":
        out = ops._modulate_scale_shift_rows_cuda(x, table, table, rows.index())
    elif which == "norm":  # torch.nn.RMSNorm + the modulate of the rows (rms_norm_modulate_rows)
        weight = torch.ones(d, device="cuda").bfloat16()
        out = ops._rms_norm_modulate_rows_cuda(x, weight, table, table, rows.index(), 1e-6, 0)
    else:
        out = ops._gated_residual_rows_cuda(x, table, rows.index().view(1, n), x)
    torch.cuda.synchronize()
except RuntimeError as exc:
    print("FAILED:", exc)
    sys.exit(3)
print("NO FAILURE")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["modulate", "gated", "norm"])
@pytest.mark.parametrize("bad", [6, -1, 2 ** 33 + 1])
def test_out_of_range_index_traps_on_the_gpu(which, bad):
    """An index outside the table fails the launch (the kernel traps, as eager's index_select device-asserts) rather
    than reading another row or memory past the table; a subprocess, since the trap poisons its CUDA context."""
    done = subprocess.run([sys.executable, "-c", _TRAP, which, str(bad)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stdout + done.stderr
