"""Qwen-Image 2.1's where-picked modulation rows read through an index (`ops/selected_rows.py`): the rows object
(its index, table and the model's own expression), the rewriter's proof that a gate is read only as ``G.tanh()`` by
one gated residual (`_norm_methods.lazy_gates`), the two fused ops that read the rows (`layernorm_scale_rows`,
`gated_residual_rows`: guards, fallbacks, the snapshot of the gate's rows), the tiny model patched == unpatched with
them fast (emulated kernels); on the GPU both raw kernels and both ops at Qwen-Image 2.1's shapes with poisoned
outputs, and the full-size block."""

from __future__ import annotations

import ast
import textwrap

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import (QwenImage21TransformerBlock,
                                                                   _select_modulation_rows)

import diffusers_fastpath as fp
from diffusers_fastpath._state import sites_of
from diffusers_fastpath.models import _norm_methods
from diffusers_fastpath.models._chain_proofs import Proofs
from diffusers_fastpath.models._norm_methods import LATER, lazy_gates, modulate_scale_rows, norm_method_hints
from diffusers_fastpath.ops import Site
from diffusers_fastpath.ops.gated_layernorm_scale_rows import GATED_LAYERNORM_SCALE_ROWS
from diffusers_fastpath.ops.gated_residual import GATED_RESIDUAL_ROWS, gated_residual_rows, gated_residual_rows_ref
from diffusers_fastpath.ops.layernorm_modulate import LAYERNORM_SCALE_ROWS, layernorm_scale_rows
from diffusers_fastpath.ops.selected_rows import SelectedRows, tanh_rows, where_index
from diffusers_fastpath.testing import zoo

DTYPES = [torch.bfloat16, torch.float16]


def make_rows(batch, seq, dim, dtype, device, seed, text=5, tanh=False):
    """A ``[B + 1, 2D]`` modulation chunk's gate-like half (a strided view, as the model's) and a mask whose first
    `text` tokens take the t = 0 row."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = (torch.randn(batch + 1, 4 * dim, generator=gen, device=device) * 2).to(dtype)[:, dim:2 * dim]
    mask = torch.ones(seq, dtype=torch.bool, device=device)
    mask[:text] = False
    mask[seq // 2: seq // 2 + 3] = False  # not only a prefix: any token may take either row
    rows = SelectedRows(_select_modulation_rows, params, mask)
    return rows.tanh_rows() if tanh else rows


def test_rows_index_table_and_materialize_are_the_models_rows():
    rows = make_rows(2, 24, 64, torch.bfloat16, "cpu", 0)
    eager = _select_modulation_rows(rows.params, rows.mask)
    assert torch.equal(rows.materialize(), eager)
    index = rows.index()
    assert index.dtype is torch.int32 and index.shape == (2, 24) and index.is_contiguous()
    assert torch.equal(index[:, :5], torch.full((2, 5), 2, dtype=torch.int32))
    assert torch.equal(index[1, 5:12], torch.ones(7, dtype=torch.int32))
    assert torch.equal(rows.table()[index.long()], eager) and rows.table() is rows.params
    gate = tanh_rows(rows)
    assert gate.tanh and gate.cached_index is index and torch.equal(gate.materialize(), eager.tanh())
    assert torch.equal(gate.table(), rows.params.tanh())
    plain = torch.randn(3, 4)
    assert torch.equal(tanh_rows(plain), plain.tanh())


@pytest.mark.parametrize("case, reason", [
    ("ok", None), ("batch", "rows shape"), ("seq", "rows shape"), ("dim", "rows shape"), ("one-row", "rows shape"),
    ("mask-int", "rows shape"), ("dtype", "mixed dtypes"), ("x-2d", "rows shape")])
def test_rows_reason(case, reason):
    rows = make_rows(2, 24, 64, torch.bfloat16, "cpu", 1)
    x = torch.randn(2, 24, 64).to(torch.bfloat16)
    if case == "batch":
        x = x[:1]
    elif case == "seq":
        x = x[:, :20]
    elif case == "dim":
        x = x[..., :32]
    elif case == "one-row":
        rows = SelectedRows(_select_modulation_rows, rows.params[:1], rows.mask)
        x = x[:0]
    elif case == "mask-int":
        rows = SelectedRows(_select_modulation_rows, rows.params, rows.mask.int())
    elif case == "dtype":
        x = x.half()
    elif case == "x-2d":
        x = x[0]
    assert rows.reason(x) == reason


# --- the rewriter's proof -------------------------------------------------------------------------------------------


def _marked(source: str):
    body = ast.parse(textwrap.dedent(source)).body[0].body
    count = lazy_gates(body, "_m", "gated_residual", "ns")
    return count, "\n".join(ast.unparse(s) for s in body)


FORWARD = """
def forward(self, x, mod, mask):
    a, g = self._m(self.n, x, mod, mask)
    y = self.f(a)
    x = ns.gated_residual(x, g.tanh(), y, site)
    {extra}
    return x
"""


def test_lazy_gate_marked_when_read_only_as_the_residuals_tanh():
    count, text = _marked(FORWARD.format(extra="pass"))
    assert count == 1
    assert "self._m(self.n, x, mod, mask, _fastpath_lazy_gate=True)" in text
    assert "ns.gated_residual_rows(x, ns.tanh_rows(g), y, site)" in text


@pytest.mark.parametrize("extra", [
    "z = g", "x = ns.gated_residual(x, g.tanh(), y, site)", "g = x", "del g", "print(locals())", "global g",
    "for g in (x,): pass", "x = x + g.sigmoid()", "(g := x)"])
def test_lazy_gate_not_marked_when_the_gate_is_read_or_bound_elsewhere(extra):
    count, text = _marked(FORWARD.format(extra=extra))
    assert count == 0 and "_fastpath_lazy_gate" not in text and "gated_residual_rows" not in text


def test_lazy_gate_not_marked_for_another_gate_form_or_method():
    count, _ = _marked(FORWARD.format(extra="pass").replace("g.tanh()", "g.tanh().float()"))
    assert count == 0
    count, _ = _marked(FORWARD.format(extra="pass").replace("self._m(", "self._other("))
    assert count == 0
    count, _ = _marked(FORWARD.format(extra="pass").replace("g.tanh()", "g.tanh(1)"))
    assert count == 0


PROVEN = """
def forward(self, x, mod, mask):
    a, g = self._m(self.n, x, mod, mask)
    {before}
    y = self.f(a)
    x = ns.gated_residual(x, g.tanh(), {update}, site)
    {after}
    return x
"""


def _marked_with_proofs(before="pass", update="y", after="pass"):
    import copy

    written = ast.parse(textwrap.dedent(PROVEN.format(before=before, update=update, after=after))).body[0]
    proofs = Proofs(written, {"self"})
    body = copy.deepcopy(written.body)
    proofs.tag(body)
    count = lazy_gates(body, "_m", "gated_residual", "ns", proofs)
    return count, "\n".join(ast.unparse(s) for s in body)


@pytest.mark.parametrize("case", ["plain", "rebound", "update-call", "joined"])
def test_lazy_gate_read_later_where_nothing_writes_the_modulation_before_the_residual(case):
    """The proofs show the modulation operand unwritten from the method's call to the residual's kernel: the mark is
    ``LATER`` (the rows read there, their tanh taken by the kernel); rebinding the name changes nothing (the rows are
    the object taken at the call); the residual's update and a joinable next method call write other tensors."""
    kwargs = {"plain": {}, "rebound": dict(before="mod = x"), "update-call": dict(update="self.f(y)"),
              "joined": dict(after="b, h = self._m(self.n2, x, mod, mask)")}[case]
    count, text = _marked_with_proofs(**kwargs)
    assert count == 1 and f"self._m(self.n, x, mod, mask, _fastpath_lazy_gate={LATER!r})" in text, text
    assert "ns.gated_residual_rows(x, ns.tanh_rows(g), " in text


@pytest.mark.parametrize("kwargs", [dict(before="mod.mul_(2)"), dict(before="self.g(mod)"),
                                    dict(before="m = mod[0]\n    m.zero_()"), dict(update="self.f(mod)"),
                                    dict(after="b, h = self._m(self.n2, x, mod.add_(1), mask)")],
                         ids=["in-place", "call", "view-written", "update-writes", "joined-writes"])
def test_lazy_gate_taken_at_the_call_where_the_modulation_may_be_written(kwargs):
    """Anything that may write the modulation between the call and the kernel's read (an in-place method, a call that
    takes it, a write through a view, the residual's own operand, the operands of the method call the residual may
    be joined with): the gate stays lazy with its tanh taken at the call (``True``)."""
    count, text = _marked_with_proofs(**kwargs)
    assert count == 1 and "self._m(self.n, x, mod, mask, _fastpath_lazy_gate=True)" in text, text


def test_lazy_gate_without_proofs_is_taken_at_the_call():
    count, text = _marked(FORWARD.format(extra="pass"))
    assert count == 1 and "_fastpath_lazy_gate=True" in text


def test_qwen21_zoo_forward_reads_both_gates_later():
    model = zoo.build("qwen-image-21", dtype=torch.bfloat16)
    fp.patch(model)
    try:
        import inspect

        source = inspect.getsource(type(model.transformer_blocks[0]).forward)
    finally:
        fp.unpatch(model)
    assert source.count(f"_fastpath_lazy_gate={LATER!r}") == 2 and "_fastpath_lazy_gate=True" not in source


class _Launches:
    """Records the aten ops that would launch a kernel (views and aliases left out) into `seen` while entered."""

    _VIEWS = ("slice", "view", "select", "unsqueeze", "detach", "alias")

    def __init__(self, seen: list):
        from torch.utils._python_dispatch import TorchDispatchMode

        views = self._VIEWS

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket.__name__ not in views:
                    seen.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        self._mode = Ops()

    def __enter__(self):
        return self._mode.__enter__()

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def test_read_later_rows_run_no_kernel_at_the_call_and_fall_back_to_the_models_expression():
    """`SelectedRows.read_later`: nothing runs at the call (the rows a view, the mask's values the index's); the rows
    are the gate's tanh (`tanh_rows` returns them); the kernels may fold the tanh until aten's table is made; the
    fallback is the model's ``where(...).tanh()`` of the rows as they are (the rewriter proved them unwritten)."""
    gen = torch.Generator().manual_seed(4)
    mod = (torch.randn(3, 4 * 64, generator=gen) * 2).to(torch.bfloat16)
    gate_view = mod[:, 64:128]
    mask = torch.ones(24, dtype=torch.bool)
    mask[:5] = False
    eager = _select_modulation_rows(gate_view, mask).tanh()
    scale = SelectedRows(_select_modulation_rows, mod[:, :64], mask)
    scale.index()
    seen = []
    with _Launches(seen):
        gate = _norm_methods._gate_rows(_select_modulation_rows, gate_view, mask, scale, LATER)
    assert seen == [] and gate.params is gate_view and gate.tanh and tanh_rows(gate) is gate and gate.folds_tanh
    mask[:] = True  # (written after the call: the index holds the values the where read)
    x = torch.randn(2, 24, 64, generator=gen).to(torch.bfloat16)
    assert gate.reason(x) is None and torch.equal(gate.materialize(), eager)
    assert torch.equal(gate.table()[gate.index().long()], eager) and not gate.folds_tanh  # aten's table made


# --- the method and the ops on a CPU (emulated kernels) -------------------------------------------------------------


def _block(dim=64, seed=0):
    torch.manual_seed(seed)
    block = QwenImage21TransformerBlock(dim, 2, dim // 2).to(torch.bfloat16).requires_grad_(False)
    assert norm_method_hints(type(block)) == (("_modulate", "scale_rows"),)
    return block


def test_lazy_gate_holds_the_rows_as_they_were_at_the_call(emulated_kernels):
    """The gate returned as rows is a copy of the rows and the mask at the method's call (what eager's ``where``
    reads then): writes to the modulation afterwards change nothing, as in eager."""
    block, dim = _block(), 64
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 24, dim, generator=gen).to(torch.bfloat16)
    mod = torch.randn(3, 2 * dim, generator=gen).to(torch.bfloat16)
    mask = torch.ones(24, dtype=torch.bool)
    mask[:5] = False
    update = torch.randn(2, 24, dim, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        ref_out, ref_gate = block._modulate(block.img_norm1(x), mod, mask)
        ref = x + ref_gate.tanh() * update
        out, gate = modulate_scale_rows(block, block.img_norm1, x, mod, mask, _fastpath_lazy_gate=True)
        assert isinstance(gate, SelectedRows) and torch.equal(out, ref_out)
        mod.mul_(3)
        mask[:] = True
        site = Site("gated_residual")
        got = gated_residual_rows(x, tanh_rows(gate), update, site)
    assert torch.equal(got, ref) and site.fast == 1 and not site.fallback


@pytest.mark.parametrize("indexed, grad", [(True, False), (False, False), (True, True)],
                         ids=["index", "no-index", "grad"])
def test_lazy_gate_is_one_tanh_and_its_fallback_reads_the_rows_and_mask_as_they_were(indexed, grad):
    """The lazy gate costs one kernel (the tanh of the rows' strided view into a table of its own; no copy of the rows
    or of the mask, whose values the scale's index holds): the rows as the block reads them, ``where(...).tanh()``,
    also written out by the fallback after the modulation and the mask were written in place (without an index, a
    copy of the mask, as before; rows that require grad: copies of both, the tanh in the model's order)."""
    gen = torch.Generator().manual_seed(4)
    mod = (torch.randn(3, 4 * 64, generator=gen) * 2).to(torch.bfloat16)
    if grad:
        mod.requires_grad_(True)
    gate_view = mod[:, 64:128]  # the model's chunk of the modulation: a strided view
    mask = torch.ones(24, dtype=torch.bool)
    mask[:5] = False
    mask[12:15] = False
    eager = _select_modulation_rows(gate_view, mask).tanh()
    scale = SelectedRows(_select_modulation_rows, mod[:, :64], mask)
    if indexed:
        scale.index()
    seen = []
    with _Launches(seen):
        gate = _norm_methods._gate_rows(_select_modulation_rows, gate_view, mask, scale, True)
    assert seen == (["clone", "clone"] if grad else ["tanh"] if indexed else ["tanh", "clone"])
    assert (tanh_rows(gate) is gate) != grad and gate.tanh != grad and gate.cached_index is scale.cached_index
    gate = tanh_rows(gate)
    with torch.no_grad():
        mod.mul_(3)  # written in place after the method's call: eager's rows were copied before
    mask[:] = True
    x = torch.randn(2, 24, 64, generator=gen).to(torch.bfloat16)
    assert gate.reason(x) is None
    assert torch.equal(gate.materialize(), eager)  # the fallback's rows
    assert torch.equal(gate.table()[gate.index().long()], eager)  # the kernels' rows
    assert gate.reason(x[:, :20]) == "rows shape"


def test_rows_ops_fall_back_to_the_models_expression_with_reasons():
    """Without kernels (a CPU): every call the exact eager result, the refusal counted."""
    block, dim = _block(), 64
    rows = make_rows(2, 24, dim, torch.bfloat16, "cpu", 4)
    x = torch.randn(2, 24, dim).to(torch.bfloat16)
    site = Site("layernorm_scale_rows")
    with torch.no_grad():
        got = layernorm_scale_rows(block.img_norm1, x, rows, site)
        assert torch.equal(got, block.img_norm1(x) * (1 + rows.materialize()))
        assert site.fallback == {"device cpu": 1}
        gate, site = rows.tanh_rows(), Site("gated_residual")
        assert torch.equal(gated_residual_rows(x, gate, x, site), x + rows.materialize().tanh() * x)
        assert site.fallback == {"device cpu": 1}
        short = torch.randn(2, 20, dim).to(torch.bfloat16)  # the rows' shape is not x's: the model's broadcast
        assert torch.equal(gated_residual_rows_ref(x, gate, x), x + gate.materialize() * x)
        assert GATED_RESIDUAL_ROWS.guard(short, gate, short, check_pointers=False) == "rows shape"
        assert LAYERNORM_SCALE_ROWS.guard(block.img_norm1, short, rows, check_pointers=False) == "rows shape"


def test_rows_ops_without_rows_are_the_tensor_ops():
    block = _block()
    x, scale = torch.randn(1, 8, 64).to(torch.bfloat16), torch.randn(1, 8, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(layernorm_scale_rows(block.img_norm1, x, scale), block.img_norm1(x) * (1 + scale))
        assert torch.equal(gated_residual_rows(x, scale, x), x + scale * x)


def test_zoo_model_patched_equals_unpatched_with_rows_fast(emulated_kernels, monkeypatch):
    """The tiny Qwen-Image 2.1 (a mask: causal_condition on) patched: every block's norms and gates read their rows
    through the index (the rows ops' kernels ran, no fallback), the attention's update and norm2 as one kernel
    (`gated_layernorm_scale_rows`: norm1 and the FFN's update alone run the rows ops), the output equal to unpatched;
    the index made once per forward for all its blocks (kept on the forward's mask); unpatch restores."""
    made = []
    monkeypatch.setattr(_norm_methods, "where_index", lambda *a: made.append(a) or where_index(*a))
    model = zoo.build("qwen-image-21", dtype=torch.bfloat16)
    model.register_to_config(causal_condition=True)
    kwargs = zoo.inputs("qwen-image-21", model)
    with torch.no_grad():
        ref = model(**kwargs)[0].clone()
    fp.patch(model)
    try:
        calls = {"ln": 0, "gate": 0, "gated": 0}
        ops = {"ln": LAYERNORM_SCALE_ROWS, "gate": GATED_RESIDUAL_ROWS, "gated": GATED_LAYERNORM_SCALE_ROWS}
        kernels = {k: op.kernel for k, op in ops.items()}

        def counted(key):
            def kernel(*a):
                calls[key] += 1
                return kernels[key](*a)
            return kernel

        for key, op in ops.items():
            op.kernel = counted(key)
        try:
            with torch.no_grad():
                assert torch.equal(model(**kwargs)[0], ref)
        finally:
            for key, op in ops.items():
                op.kernel = kernels[key]
        blocks = len(model.transformer_blocks)
        assert calls == {"ln": blocks, "gate": blocks, "gated": blocks}
        assert blocks >= 2 and len(made) == 1, len(made)  # one index for the forward's 2 * blocks rows
        gates = [s for b in model.transformer_blocks for n, s in sites_of(b) if s.op == "gated_residual"]
        assert len(gates) == 2 * blocks and all(s.fast == 1 and not s.fallback for s in gates)
        norms = [dict(sites_of(b.img_norm2)) for b in model.transformer_blocks]
        assert all(n["gated"].op == "gated_layernorm_scale_rows" and n["gated"].fast == 1 and not n["gated"].fallback
                   and n[None].op == "layernorm_scale_rows" and n[None].fast == 1 for n in norms)
    finally:
        fp.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(**kwargs)[0], ref)


# --- the GPU ------------------------------------------------------------------------------------------------------

SHAPES = [(1, 4352, 3072), (2, 4352, 3072), (1, 1024, 3072), (3, 77, 1024)]  # 1024² + text 256, CFG, cached, odd


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_raw_rows_kernels_match_eager_bitwise_on_the_gpu(shape, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    ops = torch.ops.diffusers_fastpath
    b, s, d = shape
    norm = torch.nn.LayerNorm(d, elementwise_affine=False, eps=1e-6).cuda()
    for seed in range(2):
        rows = make_rows(b, s, d, dtype, "cuda", seed, text=min(256, s // 4))
        gen = torch.Generator(device="cuda").manual_seed(seed + 10)
        x = (torch.randn(b, s, d, generator=gen, device="cuda") * 3 + 1).to(dtype)
        update = torch.randn(b, s, d, generator=gen, device="cuda").to(dtype)
        torch.cuda.synchronize()
        out = torch.full_like(x, float("nan"))
        out.copy_(ops._layernorm_modulate_rows_cuda(x, rows.table(), None, rows.index(), None, None, 1e-6))
        assert torch.equal(out, norm(x) * (1 + rows.materialize()))
        gate = rows.tanh_rows()
        out = torch.full_like(x, float("nan"))
        out.copy_(ops._gated_residual_rows_cuda(x, gate.table(), gate.index(), update))
        assert torch.equal(out, x + rows.materialize().tanh() * update)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_raw_rows_kernels_fold_the_gate_tanh_bitwise_on_the_gpu(shape, dtype):
    """The raw ops with ``tanh_gate``: the table the rows before their tanh (a strided view of the modulation, as the
    model's chunk is), the kernel's tanh of each value: eager's ``x + where(...).tanh() * update``, and the gated
    LayerNorm's written stream the same."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    ops = torch.ops.diffusers_fastpath
    b, s, d = shape
    for seed in range(2):
        gen = torch.Generator(device="cuda").manual_seed(seed + 20)
        mod = (torch.randn(b + 1, 2 * d, generator=gen, device="cuda") * 3).to(dtype)
        mask = torch.ones(s, dtype=torch.bool, device="cuda")
        mask[:min(256, s // 4)] = False
        rows = SelectedRows(_select_modulation_rows, mod[:, d:], mask)
        scale = SelectedRows(_select_modulation_rows, mod[:, :d], mask)
        x = (torch.randn(b, s, d, generator=gen, device="cuda") * 3 + 1).to(dtype)
        update = torch.randn(b, s, d, generator=gen, device="cuda").to(dtype)
        want = x + rows.materialize().tanh() * update
        torch.cuda.synchronize()
        out = torch.full_like(x, float("nan"))
        out.copy_(ops._gated_residual_rows_cuda(x, rows.params, rows.index(), update, True))
        assert torch.equal(out, want)
        if d <= 6144 and d % 8 == 0:
            got, _ = ops._gated_layernorm_modulate_rows_cuda(x, rows.params, rows.index(), update, scale.table(), None,
                                                             scale.index(), None, None, 1e-6, True)
            assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_folded_tanh_is_proven_on_every_value_on_the_gpu(dtype):
    """Both kernels' tanh of the gate equal aten's on all 65536 values of the dtype (`FoldedProof`), NaNs, infinities
    and subnormals included; the answer kept per device and dtype."""
    import importlib

    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    device = torch.device("cuda", torch.cuda.current_device())
    for name in ("gated_residual", "gated_layernorm_scale_rows"):
        proof = importlib.import_module(f"diffusers_fastpath.ops.{name}").TANH_FOLDED
        proof.results.pop((device, dtype), None)
        assert proof.holds(device, dtype) is True and proof.results[(device, dtype)] is True, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", [True, LATER], ids=["tanh-at-call", "later"])
def test_rows_ops_are_fast_and_verified_on_the_gpu(dtype, mode):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    block = _block(3072).cuda().to(dtype)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(2, 4352, 3072, generator=gen, device="cuda").to(dtype)
    mod = torch.randn(3, 2 * 3072, generator=gen, device="cuda").to(dtype)
    mask = torch.ones(4352, dtype=torch.bool, device="cuda")
    mask[:256] = False
    update = torch.randn_like(x)
    with torch.no_grad():
        ref_out, ref_gate = block._modulate(block.img_norm1(x), mod, mask)
        out, gate = modulate_scale_rows(block, block.img_norm1, x, mod, mask, _fastpath_lazy_gate=mode)
        site = Site("gated_residual")
        got = gated_residual_rows(x, tanh_rows(gate), update, site)
    assert torch.equal(out, ref_out) and torch.equal(got, x + ref_gate.tanh() * update)
    assert site.fast == 1 and LAYERNORM_SCALE_ROWS.disabled is None and GATED_RESIDUAL_ROWS.disabled is None
    key = str(dtype).removeprefix("torch.")
    assert (key, "SelectedRows", True, "tanh in kernel" if mode == LATER else "") in GATED_RESIDUAL_ROWS.verified
    assert any(k[0] == key and k[1] == 3072 for k in LAYERNORM_SCALE_ROWS.verified)


def test_zoo_model_kv_cached_steps_patched_equal_unpatched(emulated_kernels):
    """The pipeline's later steps: a prefill ("extract") then "cached" steps, where only the target image's tokens
    run and the mask the rows are picked by is a slice; patched == unpatched at each, the rows read through the
    index (the kernels ran)."""
    model = zoo.build("qwen-image-21", dtype=torch.bfloat16)
    kwargs = zoo.inputs("qwen-image-21", model)
    latents = [torch.randn_like(kwargs["hidden_states"]) for _ in range(2)]

    def run():
        return zoo.kv_cached_steps(model, kwargs, latents)

    ref = run()
    fp.patch(model)
    try:
        calls, gated = [], []
        kernel, gated_kernel = GATED_RESIDUAL_ROWS.kernel, GATED_LAYERNORM_SCALE_ROWS.kernel
        GATED_RESIDUAL_ROWS.kernel = lambda *a: calls.append(a[1].index().shape) or kernel(*a)
        # (the attention's update, joined with norm2: its gate's and its scale's indices)
        GATED_LAYERNORM_SCALE_ROWS.kernel = lambda *a: gated.append((a[2].index().shape, a[4].index().shape)) or (
            gated_kernel(*a))
        try:
            got = run()
        finally:
            GATED_RESIDUAL_ROWS.kernel, GATED_LAYERNORM_SCALE_ROWS.kernel = kernel, gated_kernel
        assert all(torch.equal(g, r) for g, r in zip(got, ref))
        blocks = len(model.transformer_blocks)
        target = kwargs["hidden_states"].shape[1]  # the cached steps' tokens: the target image's alone
        assert len(calls) == 2 * blocks and calls[-1][1] == target and calls[0][1] > target
        assert len(gated) == 2 * blocks and gated[-1] == (calls[-1], calls[-1]) and gated[0] == (calls[0], calls[0])
    finally:
        fp.unpatch(model)
