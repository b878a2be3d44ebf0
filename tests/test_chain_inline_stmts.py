"""Statement inlining (`diffusers_fastpath.models._chain_inline_stmts`): a helper of the forward's module called as a
whole statement, with statements, module calls and writes of its own (Qwen-Image 2.1's ``_qwenimage21_prepare_qkv``),
is replaced by its statements, its arguments evaluated first, its locals renamed; the rewritten forward computes the
same bits and writes its inputs the same way, the patterns then reach the chains inside it, and a helper replaced
after the rewrite makes the forward run as written. Calls whose inlining would not be the call stay as written."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
import textwrap

import pytest
import torch

from diffusers_fastpath._state import PatchState, sites_of
from diffusers_fastpath.models import _chains
from diffusers_fastpath.models._chain_inline_stmts import StatementInliner

HELPERS = '''import torch
from torch import nn

SCALE = 2


def prepare(block, x, rows, extra=None):
    """Statements, module calls, an ``if``, a chain and an in-place write of an argument (what the call's order
    decides)."""
    h = block.proj(x)
    h.mul_(SCALE)  # writes a fresh tensor
    scale, shift = rows.chunk(2, dim=-1)
    if extra is not None:
        h = h + extra
    y = block.norm(h) * (1 + scale[:, None]) + shift[:, None]
    x.add_(1)  # writes its argument: statements after the call see it
    return y, scale


def gate_twice(x, y, g):
    for _ in range(2):
        y = y * g
    return x + y


def early(x):
    if x.sum() > 0:
        return x
    return -x


def guarded(x):
    try:
        y = x * 2
    except RuntimeError:
        y = x
    return y


def nested(x):
    f = lambda t: t * 2  # noqa: E731
    return f(x)


def default_tensor(x, y=torch.ones(1)):
    return x + y


def reads_z(x):
    return x + z  # noqa: F821 - a free name the forward binds


def dynamic(x):
    return locals()["x"]


class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, rows, gate):
        y, scale = prepare(self, x * 1, rows)  # an argument computed before the body's writes
        prepare(self, x, rows, extra=y)  # a statement of its own: x written in place
        return x + gate[:, None] * y * scale[:, None]


class Refused(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, rows, gate):
        scale, shift = rows.chunk(2, dim=-1)
        y = self.norm(x) * (1 + scale[:, None]) + shift[:, None]  # fused: the forward is rewritten
        z = x
        a = early(y)
        b = guarded(y)
        c = nested(y)
        d = default_tensor(y)
        e = reads_z(y)
        f = dynamic(y)
        g = gate_twice(y, y, 2) + early(y)  # a call inside an expression
        return x + gate[:, None] * (a + b + c + d + e + f + g)
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    path = tmp_path / "inline_stmt_blocks.py"
    path.write_text(HELPERS)
    spec = importlib.util.spec_from_file_location("_fastpath_inline_stmt_blocks", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    return mod


def _run(module, cls, sub, seed=0):
    torch.manual_seed(seed)
    block = cls().to(torch.bfloat16)  # the kernels' dtype
    fused = cls().to(torch.bfloat16)
    fused.load_state_dict(block.state_dict())
    holder = torch.nn.Sequential(fused)
    state = PatchState("lossless")
    _chains.swap_rewritten(state, holder, {cls: (sub, _chains.rewrite_of(sub))})
    assert type(holder[0]) is sub
    gen = torch.Generator().manual_seed(seed)
    x, rows, gate = (torch.randn(*shape, generator=gen).to(torch.bfloat16) for shape in ((2, 5, 16), (2, 32), (2, 16)))
    xs = [x.clone(), x.clone()]
    with torch.no_grad():
        want = block(xs[0], rows, gate)
        got = holder[0](xs[1], rows, gate)
    assert torch.equal(want, got) and torch.equal(xs[0], xs[1])  # the outputs, and the input written the same way
    return [s for m in holder.modules() for _, s in sites_of(m)]


def test_a_statement_helper_is_inlined_and_its_chains_fused(module, emulated_kernels):
    sub, found = _chains.fused_subclass(module.Block, "FusedStmtBlock", module.__name__)
    assert found is not None and found.inlined == ["prepare"] and found.norms == ["norm"]
    source = inspect.getsource(sub.forward)
    assert "prepare(" not in source.split("stale(", 1)[1].split("\n", 2)[2]  # past the stale check's fallback
    assert "_fp0_x = x * 1" in source  # the argument evaluated first, into a fresh local
    assert "_fp0_h = self.proj(_fp0_x)" in source and "_fp1_h = self.proj(x)" in source  # a name stands for itself
    assert "if y is not None:" in source and "_fp1_extra" not in source  # ... a keyword argument too
    sites = _run(module, module.Block, sub)
    assert [s.op for s in sites] == ["layernorm_scale_shift"] and sites[0].fast == 2


def test_a_statement_helper_replaced_after_the_rewrite_runs_the_forward_as_written(module, monkeypatch,
                                                                                 emulated_kernels):
    sub, found = _chains.fused_subclass(module.Block, "FusedStmtReplaced", module.__name__)
    assert found.inlined == ["prepare"]
    torch.manual_seed(1)
    block, fused = module.Block(), module.Block()
    fused.load_state_dict(block.state_dict())
    fused.__class__ = sub
    x, rows, gate = torch.randn(2, 5, 16), torch.randn(2, 32), torch.randn(2, 16)
    original = module.prepare

    def other(block, x, rows, extra=None):
        y, scale = original(block, x, rows, extra)
        return y * 3, scale

    with torch.no_grad():
        before = fused(x.clone(), rows, gate)
        assert torch.equal(before, block(x.clone(), rows, gate))
        monkeypatch.setattr(module, "prepare", other)
        got, want = fused(x.clone(), rows, gate), block(x.clone(), rows, gate)
        assert torch.equal(got, want) and not torch.equal(got, before)


def _inlined(module, cls) -> tuple[set[str], str]:
    fn = cls.forward
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    args = tree.args
    locals_ = {a.arg for a in args.args} | {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
                                             and isinstance(n.ctx, ast.Store)}
    inliner = StatementInliner(fn, locals_, frozenset())
    inliner.run(tree)
    return set(inliner.helpers), ast.unparse(tree)


def test_calls_whose_statement_inlining_is_not_the_call_stay_as_written(module):
    helpers, source = _inlined(module, module.Refused)
    assert helpers == set(), source
    for call in ("early(y)", "guarded(y)", "nested(y)", "default_tensor(y)", "reads_z(y)", "dynamic(y)",
                 "gate_twice(y, y, 2) + early(y)"):
        assert call in source, call


def test_the_inlined_statements_bind_arguments_defaults_and_release_the_helpers_locals(module):
    helpers, source = _inlined(module, module.Block)
    assert helpers == {"prepare"}
    lines = [line.strip() for line in source.splitlines()]
    first = lines.index("_fp0_x = x * 1")
    assert lines[first + 1] == "_fp0_extra = None"  # the constant default, bound where the call gave none
    assert lines[first + 2] == "_fp0_h = self.proj(_fp0_x)"  # then the body
    assert "y, scale = (_fp0_y, _fp0_scale)" in lines
    released = [line for line in lines if line.endswith("= None") and line.count("=") > 2 and "_fp0_" in line]
    assert len(released) == 1 and all(f"_fp0_{n} =" in released[0] for n in ("x", "extra", "h", "y", "shift"))


def test_a_qk_norm_cast_to_a_dtype_waits_only_where_the_cast_is_none():
    """Qwen-Image 2.1's ``attn.norm_q(q).to(value.dtype)``: the norm waits for its rotary (``rmsnorm_rope_complex``)
    only where the cast returns the norm's very result (x and the weight of the target dtype); otherwise it runs here,
    cast as written (an fp32 weight makes an fp32 result, which the cast rounds)."""
    from diffusers.models.normalization import RMSNorm

    from diffusers_fastpath.models._chain_calls import _ChainsNamespace as NS
    from diffusers_fastpath.models._chain_pending import _materialize, _NormLater

    x = torch.randn(2, 5, 4, 16).to(torch.bfloat16)
    for weight_dtype, x_dtype, dtype, waits in ((torch.bfloat16, torch.bfloat16, torch.bfloat16, True),
                                                (torch.float32, torch.bfloat16, torch.bfloat16, False),
                                                (torch.bfloat16, torch.bfloat16, torch.float16, False),
                                                (torch.float32, torch.float32, torch.float32, False)):
        norm = RMSNorm(16, eps=1e-6).to(weight_dtype)
        norm.weight.data.normal_(1, 0.5)
        xi = x.to(x_dtype)
        out = NS.norm_later_to(norm, xi, dtype)
        want = norm(xi).to(dtype)
        assert isinstance(out, _NormLater) is waits, (weight_dtype, x_dtype, dtype)
        got = _materialize(out)
        assert got.dtype == want.dtype and torch.equal(got, want)
