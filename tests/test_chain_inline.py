"""Helper-function inlining (`diffusers_fastpath.models._chain_inline`) and the fp32 forms cast back to a stream's
dtype (`_rewriter._cast_back_form`): Kandinsky 5's inline fp32 chains, Kandinsky 6's ``apply_scale_shift`` /
``apply_gate_sum`` helpers, AceStep's ``(x + y * g).type_as(x)``. Each form, rewritten, computes the same bits as
the forward as written (float32, bfloat16 and float64 streams; fp32, bf16 and float64 rows), with the emulated
kernels so that the fused paths run; and the calls whose inlining would not be exactly the call stay as written."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys

import pytest
import torch

from diffusers_fastpath._state import PatchState, sites_of
from diffusers_fastpath.models import _chains
from diffusers_fastpath.models._chain_calls import _ChainsNamespace as NS

HELPERS = '''import torch
import torch.nn.functional as F
from torch import Tensor


def apply_scale_shift(normed: Tensor, x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """Kandinsky 6's, as diffusers 0.42.1 writes it."""
    if x.ndim > 2 and scale.ndim == 2:
        shape = (scale.shape[0],) + (1,) * (x.ndim - 2) + (scale.shape[-1],)
        scale, shift = scale.reshape(shape), shift.reshape(shape)
    return (normed * (scale.float() + 1.0) + shift.float()).to(dtype=x.dtype)


def apply_gate_sum(x: Tensor, out: Tensor, gate: Tensor) -> Tensor:
    """Residual gate in fp32, cast back to ``x.dtype``."""
    if x.ndim > 2 and gate.ndim == 2:
        gate = gate.reshape((gate.shape[0],) + (1,) * (x.ndim - 2) + (gate.shape[-1],))
    return (x.float() + gate.float() * out.float()).to(dtype=x.dtype)


def other_gate_sum(x, out, gate):
    if x.ndim > 2 and gate.ndim == 2:
        gate = gate.reshape((gate.shape[0],) + (1,) * (x.ndim - 2) + (gate.shape[-1],))
    return (x.float() + gate.float() * out.float() * 2).to(dtype=x.dtype)


def gate_sum_twice(x, out, gate):  # reads `out` twice
    return (x.float() + gate.float() * out.float()).to(dtype=out.dtype)


def gate_sum_default(x, out, gate=None):
    return (x.float() + gate.float() * out.float()).to(dtype=x.dtype)


COUNT = 0


def gate_sum_global(x, out, gate):
    global COUNT
    COUNT += 1
    return (x.float() + gate.float() * out.float()).to(dtype=x.dtype)


def gate_sum_torch(x, out, gate):
    return (x.float() + gate.float() * torch.tanh(out.float())).to(dtype=x.dtype)


def gate_sum_random(x, out, gate):
    return (x.float() + gate.float() * F.dropout(out.float(), p=0.5)).to(dtype=x.dtype)


class Base(torch.nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.attn_norm = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.inner = torch.nn.Module()
        self.inner.ffn_norm = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.proj = torch.nn.Linear(dim, dim)
        self.calls = 0

    def writer(self, x):  # writes its input in place
        self.calls += 1
        return x.mul_(2)

    def counted(self, x):
        self.calls += 1
        return self.proj(x)


class Kandinsky6Like(Base):
    def forward(self, x, scale, shift, gate):
        x = apply_gate_sum(x, self.proj(apply_scale_shift(self.attn_norm(x.float()), x, scale, shift)), gate).type_as(x)
        y = apply_scale_shift(self.inner.ffn_norm(x.float()), x, scale, shift)
        return apply_gate_sum(x, self.proj(y), gate)


class Kandinsky5Like(Base):
    def forward(self, x, scale, shift, gate):
        s, t, g = scale[:, None], shift[:, None], gate[:, None]
        out = (self.attn_norm(x.float()) * (s.float() + 1.0) + t.float()).type_as(x)
        out = self.proj(out)
        x = (x.float() + g.float() * out.float()).type_as(x)
        out = ((1 + s.float()) * self.inner.ffn_norm(x.float()) + t.float()).to(x.dtype)
        gate_ff = g
        return (x.float() + out.float() * gate_ff.float()).type_as(x)


class AceStepLike(Base):
    def forward(self, x, scale, shift, gate):
        gate_msa = gate[:, None]
        out = self.proj(x)
        x = (x + out * gate_msa).type_as(x)
        return x
'''

UNSAFE = '''

class Unsafe{n}(Base):
    def forward(self, x, scale, shift, gate):
        g = gate[:, None]
        y = self.proj(x)
        x = (x.float() + g.float() * y.float()).type_as(x)  # fused: the forward is rewritten
        {line}
        return x
'''
UNSAFE_LINES = {
    "twice": "x = gate_sum_twice(x, self.counted(x), g)",  # a non-name argument read twice
    "default": "x = gate_sum_default(x, self.proj(x), g)",  # a parameter with a default
    "global": "x = gate_sum_global(x, self.proj(x), g)",  # a helper rebinding a global
    "shadowed": "torch = x\n        x = gate_sum_torch(x, self.proj(torch), g)",  # its `torch` the forward's local
    "random": "x = gate_sum_random(x, self.proj(x), g)",  # draws random numbers
    "walrus": "x = apply_gate_sum(x, self.proj(x) * (gate := gate * 2).mean(), gate)",  # an argument rebinding another's name
    "writes": "x = apply_gate_sum(x, self.writer(x), gate)",  # an argument writing what the body reads before it
    "writes_inline": "x = apply_gate_sum(x, x.mul_(2), gate)",
    "starred": "x = apply_gate_sum(*(x, self.proj(x), gate))",
}


@pytest.fixture
def module(tmp_path, monkeypatch):
    path = tmp_path / "inline_blocks.py"
    path.write_text(HELPERS + "".join(UNSAFE.format(n=n, line=line) for n, line in UNSAFE_LINES.items()))
    spec = importlib.util.spec_from_file_location("_fastpath_inline_blocks", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    return mod


def _rows(dtype, gen, batch=2, dim=16):
    return [torch.randn(batch, dim, generator=gen).to(dtype) * 0.5 for _ in range(3)]


def _compare(module, cls, x_dtype, row_dtype, seed=0):
    """The class rewritten and swapped in (with its sites) against the class as written, on fresh random inputs:
    the outputs, and the inputs (which a forward may write); returns the sites."""
    sub, found = _chains.fused_subclass(cls, f"Fused{cls.__name__}", module.__name__)
    assert found is not None, _chains.why_unrewritten(sub, cls)
    torch.manual_seed(seed)
    block = cls().to(torch.float64 if x_dtype is torch.float64 else torch.float32)
    fused = cls().to(block.proj.weight.dtype)
    fused.load_state_dict(block.state_dict())
    holder = torch.nn.Sequential(fused)
    state = PatchState("lossless")
    _chains.swap_rewritten(state, holder, {cls: (sub, found)})
    assert type(holder[0]) is sub
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 16, generator=gen).to(x_dtype)
    scale, shift, gate = _rows(row_dtype, gen)
    if block.proj.weight.dtype != x_dtype:  # a bf16 stream: the projection in bf16 too
        block.to(x_dtype)
        holder.to(x_dtype)
    with torch.no_grad():
        want = block(x.clone(), scale, shift, gate)
        got = holder[0](x.clone(), scale, shift, gate)
    assert want.dtype == got.dtype and torch.equal(want, got)
    return found, [s for m in holder.modules() for _, s in sites_of(m)]


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_kandinsky6_helpers_are_inlined_into_the_fp32_ops(module, x_dtype, row_dtype, emulated_kernels):
    found, sites = _compare(module, module.Kandinsky6Like, x_dtype, row_dtype)
    assert found.inlined == ["apply_gate_sum", "apply_scale_shift"]
    assert found.norms_fp32 == ["attn_norm", "inner.ffn_norm"] and found.gates_fp32 == ["gate", "gate_2"]
    assert sorted(s.op for s in sites) == ["gated_residual_fp32"] * 2 + ["layernorm_scale_shift_fp32"] * 2
    if x_dtype is torch.bfloat16:  # the kernels take a half stream, whatever the rows' dtype (they are upcast)
        assert all(s.fast == 1 and not s.fallback for s in sites), sites
    else:
        assert all(s.fast == 0 and sum(s.fallback.values()) == 1 for s in sites), sites


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_kandinsky5_fp32_forms_take_the_fp32_ops(module, x_dtype, row_dtype, emulated_kernels):
    found, sites = _compare(module, module.Kandinsky5Like, x_dtype, row_dtype)
    assert found.inlined == [] and found.norms_fp32 == ["attn_norm", "inner.ffn_norm"]
    # the gate on either side: by its name, or (two names, neither a gate's) by the operands' shapes per call
    assert found.gates_fp32 == ["g", "gate_ff"]
    source = inspect.getsource(_chains._NAMED[(module.__name__, "FusedKandinsky5Like")].forward)
    assert source.count("norm_modulate_float(") == 2 and source.count("gated_residual_float(") == 2
    if x_dtype is torch.bfloat16:
        assert all(s.fast == 1 for s in sites), sites


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_a_gated_residual_cast_back_is_the_gated_residual_form(module, x_dtype, emulated_kernels):
    found, sites = _compare(module, module.AceStepLike, x_dtype, x_dtype)
    assert found.gates == ["gate_msa"] and [s.op for s in sites] == ["gated_residual"]
    assert sites[0].fast == (x_dtype is torch.bfloat16)


# whole statements whose helper `_chain_inline_stmts` inlines exactly (its arguments evaluated first, once, in order)
EXACT_AS_STATEMENTS = {"default", "writes_inline", "twice", "random", "writes"}


@pytest.mark.parametrize("name", sorted(UNSAFE_LINES))
def test_calls_whose_inlining_is_not_the_call_stay_as_written(module, name, emulated_kernels):
    """As an expression, none of these calls is inlined; those whose statement inlining is exact may be inlined as
    statements (where that fuses more), and then compute the same bits as well."""
    cls = getattr(module, f"Unsafe{name}")
    sub, found = _chains.fused_subclass(cls, f"FusedUnsafe{name}", module.__name__)
    call = ast.unparse(ast.parse(UNSAFE_LINES[name].split("\n")[-1].strip()))
    helper = call.split("(", 1)[0].split("= ")[-1]
    assert found is not None and found.gates_fp32[0] == "g"
    source = inspect.getsource(sub.forward)
    if found.inlined:
        assert name in EXACT_AS_STATEMENTS and found.inlined == [helper] and "_fp0_" in source
        assert call not in source.split("return _fastpath_written_forward(", 1)[1].split("\n", 1)[1]
    else:
        assert found.gates_fp32 == ["g"] and call in source  # the call, as written
    torch.manual_seed(3)
    block, fused = cls().to(torch.bfloat16), cls().to(torch.bfloat16)
    fused.load_state_dict(block.state_dict())
    fused.__class__ = sub
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 16, generator=gen).to(torch.bfloat16)
    rows = _rows(torch.float32, gen)
    for _ in range(2):
        torch.manual_seed(5)
        with torch.no_grad():
            want = block(x.clone(), *rows)
        torch.manual_seed(5)
        with torch.no_grad():
            got = fused(x.clone(), *rows)
        assert torch.equal(want, got)
    assert block.calls == fused.calls


def test_a_helper_replaced_after_the_rewrite_runs_the_forward_as_written(module, monkeypatch, emulated_kernels):
    """The module holds another function under the helper's name after `patch` (or the same function with another
    code): the rewritten forward runs the forward as written, which calls what the module holds now."""
    cls = module.Kandinsky6Like
    sub, found = _chains.fused_subclass(cls, "FusedReplaced", module.__name__)
    assert "apply_gate_sum" in found.inlined
    torch.manual_seed(4)
    block, fused = cls().to(torch.bfloat16), cls().to(torch.bfloat16)
    fused.load_state_dict(block.state_dict())
    fused.__class__ = sub
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 16, generator=gen).to(torch.bfloat16)
    rows = _rows(torch.float32, gen)
    with torch.no_grad():
        before = fused(x, *rows)
        assert torch.equal(before, block(x, *rows))
        for replace in ("function", "code"):
            if replace == "function":
                monkeypatch.setattr(module, "apply_gate_sum", module.other_gate_sum)
            else:
                monkeypatch.setattr(module.apply_gate_sum, "__code__", module.other_gate_sum.__code__)
            got, want = fused(x, *rows), block(x, *rows)
            assert torch.equal(got, want) and not torch.equal(got, before)
            monkeypatch.undo()
        assert torch.equal(fused(x, *rows), before)  # the helper back: the rewrite runs again


def test_a_helper_replaced_before_the_rewrite_is_inlined_as_it_is_then(module, monkeypatch, emulated_kernels):
    """What is inlined is the function the module holds when the forward is rewritten (the same module's: its
    globals are the forward's); one of another module is not inlined."""
    monkeypatch.setattr(module, "apply_gate_sum", module.other_gate_sum)
    cls = module.Kandinsky6Like
    sub, found = _chains.fused_subclass(cls, "FusedReplacedBefore", module.__name__)
    assert "apply_gate_sum" in found.inlined and "* 2" in inspect.getsource(sub.forward)
    torch.manual_seed(4)
    block, fused = cls().to(torch.bfloat16), cls().to(torch.bfloat16)
    fused.load_state_dict(block.state_dict())
    fused.__class__ = sub
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 16, generator=gen).to(torch.bfloat16)
    rows = _rows(torch.float32, gen)
    with torch.no_grad():
        assert torch.equal(fused(x, *rows), block(x, *rows))

    def elsewhere(x, out, gate):  # this test module's: other globals
        return (x.float() + gate.float() * out.float()).to(dtype=x.dtype)

    monkeypatch.setattr(module, "apply_gate_sum", elsewhere)
    sub, found = _chains.fused_subclass(cls, "FusedReplacedElsewhere", module.__name__)
    assert found.inlined == ["apply_scale_shift"] and "apply_gate_sum(" in inspect.getsource(sub.forward)


def test_the_namespace_runs_the_written_expressions_where_the_ops_do_not_take_the_operands():
    """Per call: a gate product that is not the op's (a float64 update) or operands that are not tensors run the
    written expression; the written order of the sum and the product is kept."""
    from diffusers_fastpath.ops import Site

    site = Site("gated_residual_fp32")
    r = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    u, g = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 1, 8)
    assert torch.equal(NS.gated_residual_float(r, g, u, site, True), r.float() + g.float() * u.float())
    assert sum(site.fallback.values()) == 1

    class Two:  # not a tensor: the written expression
        def float(self):
            return 2.0

    assert NS.gated_residual_float(Two(), Two(), Two(), None) == 6.0
    norm = torch.nn.Identity()  # not a LayerNorm: as written, either way round
    x, s = torch.randn(2, 3, 8), torch.randn(2, 1, 8, dtype=torch.float64)
    assert torch.equal(NS.norm_modulate_float(norm, x, s, s, None, False, True, 1),
                       (1 + s.float()) * norm(x.float()) + s.float())


@pytest.mark.parametrize("name", sorted(UNSAFE_LINES))
def test_the_inliner_itself_refuses_the_unsafe_calls(module, name):
    """The inliner's own rules, apart from the patterns' proofs and the choice of the version that fuses more (which
    would also leave most of these as written): each unsafe call is not inlined, or ('writes', a module call that
    may write what the body read before it) only on the trust that a pattern fuses that module, which it does not."""
    import textwrap

    from diffusers_fastpath.models._chain_inline import Inliner
    from diffusers_fastpath._source import source_of
    from diffusers_fastpath.models._chain_proofs import Proofs

    fn = getattr(module, f"Unsafe{name}").forward
    function = ast.parse(textwrap.dedent(source_of(fn)[0])).body[0]
    inliner = Inliner(fn, function, Proofs(function, {"self"}), frozenset(), statements=False)
    inlined = inliner.run()
    helper = ast.parse(UNSAFE_LINES[name].split("\n")[-1].strip()).body[0].value.func.id
    if name == "writes":
        assert helper in inliner.helpers and inliner.trusted and not inliner.proven(inlined.body)
    else:
        assert helper not in inliner.helpers and inlined is function


def test_the_inliner_inlines_the_kandinsky6_helpers_on_trust_of_their_norms_only(module):
    """Kandinsky 6's ``apply_gate_sum(x, self.attn(apply_scale_shift(self.attn_norm(x.float()), ...)), gate)`` reads x
    before the attention once inlined: taken on the trust that the norm, which may write x under the proofs'
    model, is fused by a pattern (the proofs' trust in a fused op's norm)."""
    import textwrap

    from diffusers_fastpath.models._chain_inline import Inliner
    from diffusers_fastpath._source import source_of
    from diffusers_fastpath.models._chain_proofs import Proofs

    fn = module.Kandinsky6Like.forward
    function = ast.parse(textwrap.dedent(source_of(fn)[0])).body[0]
    inliner = Inliner(fn, function, Proofs(function, {"self"}), frozenset())
    inlined = inliner.run()
    assert sorted(inliner.helpers) == ["apply_gate_sum", "apply_scale_shift"]
    assert inliner.trusted == [ast.dump(ast.parse("self.attn_norm(x.float())", mode="eval").body)]
    assert not inliner.proven(inlined.body)  # as inlined, the norm is still there: the patterns must take it
    sub, found = _chains.fused_subclass(module.Kandinsky6Like, "FusedTrusted", module.__name__)
    assert found.inlined and "self.attn_norm(" not in inspect.getsource(sub.forward)
