"""torch's ``nn.RMSNorm`` and the modulate of its ``index_select``-picked rows (MiniMax-H3's ``N = self.norm1(x)`` then
``N * (1.0 + s.index_select(0, rows)) + t.index_select(0, rows)``, and its output norm's ``return``) as the fused
`rms_norm_modulate_rows`: on the GPU the kernel against eager at MiniMax-H3's shapes (poisoned outputs, fresh inputs,
bf16 and fp16) and the zoo model patched on CUDA; on a CPU the rewriter's pair form and the forms it leaves alone,
the guard with every fallback eager's, hooks on the norm, the NVRTC launch, through the emulated kernels."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import diffusers_fastpath as fp
from diffusers_fastpath._state import sites_of
from diffusers_fastpath.models import _chains
from diffusers_fastpath.ops import Site, rms_norm_modulate_rows, rms_norm_modulate_rows_ref
from diffusers_fastpath.ops.rms_norm_modulate_rows import NOT_INDEXED, RMS_NORM_MODULATE_ROWS, _guard
from diffusers_fastpath.ops.selected_rows import IndexedRows, materialized
from diffusers_fastpath.testing import zoo
from test_index_rows import make_index, make_tables
from test_nvrtc import captured_launches  # noqa: F401 (the fixture: the NVRTC launchers run on CPU tensors)
from test_zero_centred_modulate import row_norm_launch

DTYPES = [torch.bfloat16, torch.float16]
OP = "rms_norm_modulate_rows"
SITE = "norm_modulate"  # the site's name on the norm (`_rewriter_norms.NORM_MODULATE_LATER`)


def _norm(dim, dtype, device, seed, eps=1e-6):
    """``torch.nn.RMSNorm(dim)`` of `dtype` with a random weight around 1 (ones in a fresh module)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    norm = nn.RMSNorm(dim, eps=eps).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=gen, device=device))
    return norm.requires_grad_(False)


def _x(shape, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    scale = torch.rand(shape[-1], generator=gen, device=device) * 8 + 0.1  # channels of very different sizes
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


def _rows(tables, n, dim, dtype, device, seed):
    """MiniMax-H3's scale and shift rows: two of the six ``[tables, D]`` chunks of one projection, one index."""
    shift, scale = make_tables(tables, dim, dtype, device, seed)[:2]
    index = make_index(n, tables, device, seed + 1)
    return IndexedRows(scale, index), IndexedRows(shift, index)


def _eager(norm, x, scale, shift):
    return norm(x) * (1.0 + scale.params.index_select(0, scale.indices)) + shift.params.index_select(0, shift.indices)


# ([1, N, D], tables): MiniMax-H3 at 1344x768x124 with audio (~38k packed tokens, 5376 wide, 2 timesteps x 3 rows),
# its output norm (one row per timestep), LTX-Video's and Wan's row-norm widths, a width that is not a multiple of 128,
# the kernel's widest row, the tiny zoo model's width (a warp a row, as the next: rotary.cu's narrow_row_norm_kernel)
CASES = [((1, 38000, 5376), 6), ((1, 4096, 5376), 2), ((1, 1037, 2048), 6), ((1, 513, 5120), 3),
         ((1, 77, 1028), 3), ((1, 9, 8192), 6), ((1, 33, 128), 6), ((1, 1037, 96), 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, tables", CASES, ids=str)
def test_rms_norm_modulate_rows_matches_eager_bitwise(shape, tables, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()  # the raw op: the nvcc extension's, else NVRTC's
    for seed in range(2):  # fresh inputs, weights and rows each round
        norm, x = _norm(shape[-1], dtype, "cuda", seed), _x(shape, dtype, "cuda", seed + 10)
        scale, shift = _rows(tables, shape[1], shape[-1], dtype, "cuda", seed + 20)
        with torch.no_grad():
            ref = _eager(norm, x, scale, shift)
        assert ref.dtype is dtype and torch.isfinite(ref).all() and ref.float().std() > 0.1
        torch.full((ref.numel() + 4096,), float("nan"), device="cuda", dtype=dtype)  # freed: the output's block next
        raw = torch.ops.diffusers_fastpath._rms_norm_modulate_rows_cuda(x, norm.weight, scale.table(), shift.table(),
                                                                        scale.index(), norm.eps, 0)
        torch.cuda.synchronize()
        assert torch.equal(raw, ref)
        torch.full((ref.numel() + 4096,), float("nan"), device="cuda", dtype=dtype)
        site = Site(OP)
        with torch.no_grad():
            out = rms_norm_modulate_rows(norm, x, scale, shift, site)
        assert torch.equal(out, ref) and out.is_contiguous()
        assert site.fast == 1 and not site.fallback, site
    assert RMS_NORM_MODULATE_ROWS.disabled is None
    assert (str(dtype).removeprefix("torch."), shape[-1], "rms_norm modulate rows") in RMS_NORM_MODULATE_ROWS.verified


@pytest.mark.gpu
def test_minimax_h3_zoo_model_runs_its_norm_modulates_fused_on_cuda():
    from test_generic_zoo import _check

    sites = _check("minimax-h3", "cuda")
    fused = [s for s in sites if s.op == OP]
    assert len(fused) == 5 and all(s.fast > 0 for s in fused) and not any(s.fallback for s in fused), fused
    assert not any(s.op == "modulate_scale_shift" for s in sites), sites


# --- the rewriter's pair form ----------------------------------------------------------------------------------------


class Pair(nn.Module):
    """MiniMax-H3's block form, its output norm's ``return`` form, and the near misses the pair form must leave."""

    def __init__(self, dim=64):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, eps=1e-6)
        self.norm2 = nn.RMSNorm(dim, eps=1e-6)
        self.norm3 = nn.RMSNorm(dim, eps=1e-6)

    def forward(self, x, s, t, idx):
        n = self.norm1(x)
        n = n * (1.0 + s.index_select(0, idx)) + t.index_select(0, idx)      # the block's pair: fused
        m = self.norm2(x)
        m = m * (1.0 + s.index_select(0, idx) * 2) + t.index_select(0, idx)  # near miss: a scale computed
        k = self.norm3(x)
        j = k * (1.0 + s.index_select(0, idx)) + t.index_select(0, idx)      # near miss: k is read again below
        return n + m + j + k


class PairOut(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-6)

    def forward(self, x, s, t, idx):
        x = self.norm(x)
        return x * (1.0 + s.index_select(0, idx)) + t.index_select(0, idx)  # the output norm's form: fused


class PairViews(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-6)

    def forward(self, x, s, t):
        n = self.norm(x)
        n = n * (1.0 + s) + t  # rows that are names (views): the norm may wait; not read through an index
        return n


def _ns(name):
    return f"_diffusers_fastpath_chains.{name}"


def test_pair_form_joins_the_norm_and_hands_over_the_rows_unpicked():
    sub, found = _chains.fused_subclass(Pair, "FusedPair", __name__)
    source = inspect.getsource(sub.forward)
    assert found.norm_modulates == [("norm1", "n")]
    assert found.index_rows == 2  # the pair's rows, and j's (the modulate-rows form of an earlier norm's result)
    assert f"n = {_ns('norm_modulate_picked')}(self.norm1, x, s, idx, t, idx, " in source
    assert "self.norm1(x)" not in source and "s.index_select" not in source.split("m = ")[0]  # the op's to make
    # the near misses: each norm as written, then the modulate of the rows as before
    assert "m = self.norm2(x)" in source and "k = self.norm3(x)" in source
    assert source.count(_ns("modulate_rows")) == 2
    sub, found = _chains.fused_subclass(PairOut, "FusedPairOut", __name__)
    source = inspect.getsource(sub.forward)
    assert found.norm_modulates == [("norm", "x")]
    assert f"return {_ns('norm_modulate_picked')}(self.norm, x, s, idx, t, idx, " in source
    sub, found = _chains.fused_subclass(PairViews, "FusedPairViews", __name__)
    source = inspect.getsource(sub.forward)
    assert f"n = {_ns('norm_modulate_later')}(self.norm, x, s, t," in source and "index_rows" not in source


def _run(cls, name, *args):
    torch.manual_seed(0)
    ref_block = cls().to(torch.bfloat16)
    for p in ref_block.parameters():
        p.data.copy_(1 + 0.3 * torch.randn_like(p))
    sub, found = _chains.fused_subclass(cls, name, __name__)
    block = sub().to(torch.bfloat16)
    block.load_state_dict(ref_block.state_dict())
    sites = {}
    for attr, _ in found.norm_modulates:
        sites[attr] = Site(OP)
        setattr(getattr(block, attr), f"_fastpath_site_{SITE}", sites[attr])
    with torch.no_grad():
        return ref_block(*args), block(*args), sites


def test_pair_forms_run_bit_identical_and_fused(emulated_kernels):
    s, t = make_tables(6, 64, torch.bfloat16, "cpu", 0)[1:3]
    idx = make_index(40, 6, "cpu", 1)
    x = _x((1, 40, 64), torch.bfloat16, "cpu", 2)
    for cls, name in ((Pair, "FusedPairRun"), (PairOut, "FusedPairOutRun")):
        ref, got, sites = _run(cls, name, x, s, t, idx)
        assert torch.equal(got, ref)
        assert all(site.fast == 1 and not site.fallback for site in sites.values()), sites
    # rows that are views, not picked through an index: the norm's call, then the modulate (counted on the norm)
    ref, got, sites = _run(PairViews, "FusedPairViewsRun", x, s[:1].unsqueeze(0), t[:1].unsqueeze(0))
    assert torch.equal(got, ref)
    assert sites["norm"].fast == 0 and sites["norm"].fallback == {NOT_INDEXED: 1}


# --- the guard, the fallbacks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case, reason", [
    ("tensor_rows", NOT_INDEXED),
    ("batch_two", "rows shape"),
    ("other_indices", "rows of other indices"),
    ("float32_weight", "norm weight dtype differs"),
    ("no_weight", "norm not a plain torch.nn.RMSNorm with weight"),
    ("default_eps", "norm not a plain torch.nn.RMSNorm with weight"),
    ("too_wide", "D outside the reproduced reduction"),
    ("transposed", "x not contiguous"),
    ("strided_table", "scale/shift strided"),
    ("float32", "dtype float32"),
    ("requires_grad", "requires grad"),
    ("cpu", "device cpu"),
])
def test_guard_refuses_with_reason_and_the_fallback_is_eager(case, reason):
    dim = 8196 if case == "too_wide" else 64  # (a width of no multiple of 4 has no 16-byte table rows: refused first)
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    norm, x = _norm(dim, dtype, "cpu", 0), _x((1, 40, dim), dtype, "cpu", 1)
    scale, shift = _rows(6, 40, dim, dtype, "cpu", 2)
    if case == "tensor_rows":
        scale, shift = scale.materialize(), shift.materialize()
    elif case == "batch_two":
        x = _x((2, 40, dim), dtype, "cpu", 1)
    elif case == "other_indices":
        shift = IndexedRows(shift.params, shift.indices.clone())
    elif case == "float32_weight":
        norm = norm.float()
    elif case == "no_weight":
        norm = nn.RMSNorm(dim, eps=1e-6, elementwise_affine=False)
    elif case == "default_eps":
        norm = nn.RMSNorm(dim).to(dtype)
    elif case == "transposed":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    elif case == "strided_table":
        table = torch.randn(6, dim + 2).to(dtype)[:, :dim]  # rows 132 bytes apart: not whole 16-byte vectors
        scale, shift = IndexedRows(table, scale.indices), IndexedRows(table, scale.indices)
    elif case == "requires_grad":
        x = x.clone().requires_grad_()
    guard_reason = _guard(norm, x, scale, shift, check_pointers=False)
    assert guard_reason == reason
    site = Site(OP)
    with torch.set_grad_enabled(case == "requires_grad"):
        expected = norm(x) * (1.0 + materialized(scale)) + materialized(shift)
        out = rms_norm_modulate_rows(norm, x, scale, shift, site)
    assert torch.equal(out, expected) and out.dtype == expected.dtype
    assert site.fast == 0 and reason in site.fallback


def test_ref_and_the_emulated_kernel_agree_and_count(emulated_kernels):
    norm, x = _norm(64, torch.bfloat16, "cpu", 3), _x((1, 40, 64), torch.bfloat16, "cpu", 4)
    scale, shift = _rows(6, 40, 64, torch.bfloat16, "cpu", 5)
    site = Site(OP)
    with torch.no_grad():
        out = rms_norm_modulate_rows(norm, x, scale, shift, site)
        assert torch.equal(out, rms_norm_modulate_rows_ref(norm, x, scale, shift))
        assert torch.equal(out, _eager(norm, x, scale, shift))
        # [N, D] activations (no batch dimension) read the same rows
        assert torch.equal(rms_norm_modulate_rows(norm, x[0], scale, shift, site), out[0])
    assert site.fast == 2 and not site.fallback


# --- the model: hooks on a norm -------------------------------------------------------------------------------------


def _sample(model, kwargs):
    with torch.no_grad():
        out = model(**kwargs)
    while isinstance(out, (list, tuple)):
        out = out[0]
    return out.clone()


@pytest.mark.parametrize("before_patch", [False, True])
def test_hooks_on_norm1_run_and_refuse_the_fused_call(emulated_kernels, unpatch_after, before_patch):
    model = zoo.build("minimax-h3", dtype=torch.bfloat16)
    kwargs = zoo.inputs("minimax-h3", model)
    norm1 = model.transformer_blocks[0].norm1
    calls = []

    def hook(module, args, out):
        calls.append(module)
        return out * 2  # changes what the modulate reads: the fused kernel must not run in its place

    def sample():
        return _sample(model, kwargs)

    if before_patch:
        norm1.register_forward_hook(hook)
    ref = sample()
    # (no whole-model verification: with a hook it runs the model as written, and the sites would count nothing)
    unpatch_after(fp.patch(model, verify=False))
    if not before_patch:  # a hook added to the patched model; the reference: the unpatched model with it
        norm1.register_forward_hook(hook)
        fp.unpatch(model)
        ref = sample()
        fp.patch(model, verify=False)
    calls.clear()
    assert torch.equal(sample(), ref)
    assert calls  # the hook ran, on the norm's own call
    sites = {(name, n): s for name, m in model.named_modules() for n, s in sites_of(m)}
    site = sites[("transformer_blocks.0.norm1", SITE)]
    assert site.op == OP and site.fast == 0 and "RMSNorm has hooks" in site.fallback, site
    assert sites[("transformer_blocks.0.norm2", SITE)].fast > 0  # the other norms are fused still
    assert sites[("norm_out.norm", SITE)].fast > 0


def test_unpatch_restores_the_written_forwards(emulated_kernels):
    model = zoo.build("minimax-h3", dtype=torch.bfloat16)
    forwards = {type(m): type(m).forward for m in model.modules()}
    fp.patch(model)
    assert any(n == SITE for m in model.modules() for n, _ in sites_of(m))
    fp.unpatch(model)
    assert not any(sites_of(m) for m in model.modules())
    assert all(type(m).forward is forwards[type(m)] for m in model.modules())


# --- the NVRTC launch ------------------------------------------------------------------------------------------------


def test_nvrtc_launcher_passes_what_bindings_rotary_cpp_passes(captured_launches):
    """The NVRTC launch, field by field, as bindings_rotary.cpp's zero_centred_launch fills RotaryArgs for
    rms_norm_modulate_rows (the kernel's kNormModulateRows form: the weight of x's dtype, the tables' row strides
    whatever their row count, the index and the tables' rows)."""
    import importlib

    op_mod = importlib.import_module("diffusers_fastpath.ops.rms_norm_modulate_rows")  # (the package's: a function)
    x, weight = _x((1, 33, 128), torch.bfloat16, "cpu", 0), torch.randn(128).bfloat16()
    shift, scale = make_tables(6, 128, torch.bfloat16, "cpu", 1)[:2]  # [6, 128] views of [6, 768]: row stride 768
    index = make_index(33, 6, "cpu", 2).int()
    out = op_mod._nvrtc_kernel(x, weight, scale, shift, index, 1e-6, 0)
    a = row_norm_launch(captured_launches, 5, x, weight, out, 1e-6, float_weight=False)
    assert (a.mod_scale, a.mod_shift, a.mod_scale_stride_b, a.mod_shift_stride_b, a.mod_index, a.mod_table_rows) == (
        scale.data_ptr(), shift.data_ptr(), 768, 768, index.data_ptr(), 6)
    op_mod._nvrtc_kernel(x, weight, scale[:1], shift[:1], index.zero_(), 1e-6, 0)  # one table row: its stride kept
    a = captured_launches[-1][-1].a
    assert (a.mod_scale_stride_b, a.mod_shift_stride_b, a.mod_table_rows) == (768, 768, 1)
    assert op_mod._raw_guard(x, weight, scale, shift, index.long(), 1e-6, 0) is not None  # an int64 index refused


def test_the_pair_under_torch_compile_is_eager_order_and_bit_identical():
    """While compiling, the rows are written out after the norm's call (as eager writes them) and the modulate is
    the registered op's: the tiny MiniMax-H3 patched, its blocks compiled whole (fullgraph), equals unpatched."""
    model = zoo.build("minimax-h3", dtype=torch.bfloat16)
    kwargs = zoo.inputs("minimax-h3", model)

    def sample():
        return _sample(model, kwargs)

    ref = sample()
    fp.patch(model, verify=False)
    try:
        model.compile_repeated_blocks(backend="eager", fullgraph=True)
        assert torch.equal(sample(), ref)
    finally:
        fp.unpatch(model)
