"""The chain rewriter's property: whatever a block forward does, the rewritten forward computes the same bits.

Random block forwards are written as Python source from the statement forms the patterns match (gated residuals in
one and two statements, with gates computed as written or roles told by the shapes, LayerNorm + modulate inline, in
two statements and deferred past others (into the same name or another), returned or assigned with rows per sample
or per token, CogVideoX's ``(1 + S)[:, None, :]``, a scale without a shift, a modulate of a normalised tensor, with rows per sample or per token
anywhere in a statement, GELU + concatenation, a SiLU-gated product either way round, the fp32 forms cast back, calls
of helper functions of the module that inlining takes or must leave, with arguments that write the streams), mixed
with what a rewrite must not be fooled by: reads and writes of the names it moves or drops, in the same block, after an enclosing ``if`` or ``for`` and in the
next iteration of a loop; writes in place through ``x.add_()``, ``out=``, ``inplace=True``, ``+=``, a subscript
store and a view of the tensor; rebinding; a walrus; ``del``. Each forward is the ``forward`` of a small
``nn.Module`` in a module written to disk and imported (so that the rewriter reads its source as it reads diffusers'),
rewritten by `fused_subclass`, and run both ways on random inputs, with the emulated kernels (conftest) so that the
fused paths run too: every output and every input (the forwards write some in place) must be ``torch.equal``.

A fixed seed and a bounded count: a few seconds of CPU. At ed203a0 this finds the deferred LayerNorm moved past an
``out=`` / ``inplace=True`` write of its input, and the gated residual whose dropped product is read after the
``if`` it sits in (issue 43, item 7)."""

from __future__ import annotations

import copy
import importlib.util
import linecache
import random
import sys

import torch

from diffusers_fastpath._state import PatchState
from diffusers_fastpath.models import _chains

SEED = 43
MODULES, PER_MODULE = 5, 40  # 200 forwards
STREAMS = ["x", "c", "h", "k", "u", "v", "n"]  # [B, S, D] tensors: x and c are parameters, the rest locals
LOCALS = STREAMS[2:]
ROWS = ["gate_a", "gate_b", "scale", "shift"]  # [B, D] parameters
NORMS = ["self.norm1", "self.norm2"]
B, S, D = 2, 3, 8
AUX = random.Random()  # draws that later forms added, apart from the seeded stream (reseeded by the test)

HEADER = '''import torch
import torch.nn.functional as F


def apply_scale_shift(normed, x, scale, shift):
    if x.ndim > 2 and scale.ndim == 2:
        shape = (scale.shape[0],) + (1,) * (x.ndim - 2) + (scale.shape[-1],)
        scale, shift = scale.reshape(shape), shift.reshape(shape)
    return (normed * (scale.float() + 1.0) + shift.float()).to(dtype=x.dtype)


def apply_gate_sum(x, out, gate):
    if x.ndim > 2 and gate.ndim == 2:
        gate = gate.reshape((gate.shape[0],) + (1,) * (x.ndim - 2) + (gate.shape[-1],))
    return (x.float() + gate.float() * out.float()).to(dtype=x.dtype)


def gate_sum_twice(x, out, gate):
    return (x.float() + gate[:, None].float() * out.float()).to(dtype=out.dtype)


class Base(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(8, elementwise_affine=False, eps=1e-6)
        self.norm2 = torch.nn.LayerNorm(8, eps=1e-6)
        self.proj = torch.nn.Linear(8, 8)
        self.proj_mlp = torch.nn.Linear(8, 8)
        self.act_mlp = torch.nn.GELU(approximate="tanh")
        self.act = torch.nn.SiLU()
        self.act_inplace = torch.nn.ReLU(inplace=True)  # a module writing its input
'''


class Forward:
    """One random forward body, as lines of source (four spaces a level)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.lines: list[str] = []

    def pick(self, names):
        return self.rng.choice(names)

    def emit(self, depth: int, line: str) -> None:
        self.lines.append("    " * depth + line)

    # --- what a rewrite must not be fooled by ---------------------------------------------------------------
    def filler(self, depth: int, plain: bool = False) -> None:
        """One statement that reads, writes or rebinds the streams (`plain`: an assignment to a name, the only kind
        the deferred form lets through)."""
        a, b, c = self.pick(LOCALS), self.pick(STREAMS), self.pick(STREAMS)
        forms = [
            f"{a} = {b} * 0.5",
            f"{a} = {b} + {c}",
            f"{a} = {b}.add_(0.25)",
            f"{a} = torch.add({b}, {c}, out={b})",
            f"{a} = F.relu({b}, inplace=True)",
            f"{a} = F.relu({b}, True) * 2",
            f"{a} = {b}.view({b}.shape)",
            f"{a} = self.proj({b})",
            f"{a} = {b}.clone()",
            f"{a} = ({b} := {c} * 1.5) - 1",
            f"{a} = torch.mul({b}, -1, out={b}) * 0 + {c}",
        ]
        if not plain:
            forms += [
                f"{b}.mul_(-1.5)",
                f"{b} += {c}",
                f"{b}[:, 0] = {c}[:, 1]",
                f"{b}.relu_()",
                f"del {a}\n{'    ' * depth}{a} = {b} * 1",
                f"{self.pick(ROWS)}.mul_(0.5)",
            ]
        for line in self.pick(forms).split("\n"):
            self.lines.append(line if line.startswith(" ") else "    " * depth + line)

    # --- the patterns' forms -------------------------------------------------------------------------------
    def gated_two(self, depth: int) -> None:
        u, h, r, e, g = self.pick(LOCALS), self.pick(STREAMS), self.pick(STREAMS), self.pick(STREAMS), self.pick(ROWS)
        self.emit(depth, self.pick([f"{u} = {g}.unsqueeze(1) * {e}", f"{u} = {e} * {g}.unsqueeze(1)"]))
        self.emit(depth, self.pick([f"{h} = {r} + {u}", f"{h} = {u} + {r}"]))

    def gated_one(self, depth: int) -> None:
        h, r, e, g = self.pick(STREAMS), self.pick(STREAMS), self.pick(STREAMS), self.pick(ROWS)
        self.emit(depth, self.pick([f"{h} = {r} + {g}.unsqueeze(1) * {e}", f"{h} = {r} + {e} * {g}.unsqueeze(1)"]))

    def modulate(self, depth: int) -> None:
        n, x, norm, s, t = self.pick(LOCALS), self.pick(STREAMS), self.pick(NORMS), self.pick(ROWS), self.pick(ROWS)
        shape = self.rng.random() < 0.5
        mod = f"{n} * (1 + {s}[:, None]) + {t}[:, None]" if shape else f"(1 + {s}.unsqueeze(1)) * {n} + {t}.unsqueeze(1)"
        kind = self.rng.randrange(3)
        if kind == 0:  # inline
            self.emit(depth, f"{n} = " + mod.replace(f"{n} *", f"{norm}({x}) *", 1).replace(f"* {n} +", f"* {norm}({x}) +", 1))
            return
        self.emit(depth, f"{n} = {norm}({x})")
        for _ in range(kind - 1 + self.rng.randrange(3) if kind == 2 else 0):  # deferred: others in between
            self.filler(depth, plain=True)
        # into another name (CogView3Plus: ``x = normed_x * ...``): N no longer bound, which a later read tells
        self.emit(depth, f"{self.pick([n, n, self.pick(STREAMS)])} = {mod}")

    def norm_returned(self, depth: int) -> None:
        """The one-expression LayerNorm + modulate forms returned (FLUX.3's and Qwen-Image 2.1's output norms) or
        assigned: rows per sample or per token, CogVideoX's ``(1 + S)[:, None, :]``, a scale without a shift; and
        their near misses (another constant or operator, the indexing of one operand only, a row whose evaluation
        writes what the norm reads)."""
        norm, x, h = self.pick(NORMS), self.pick(STREAMS), self.pick(STREAMS)
        a, b, k, m = self.pick(ROWS), self.pick(ROWS), self.pick(STREAMS), self.pick(STREAMS)
        s = self.pick([f"{a}.unsqueeze(1)", f"{a}[:, None]", k, f"{k}[0]"])
        t = self.pick([f"{b}.unsqueeze(1)", f"{b}[:, None]", m, f"{m}[1]"])
        normed = f"{norm}({x})"
        value = self.pick([
            f"{normed} * (1 + {s}) + {t}", f"(1 + {s}) * {normed} + {t}", f"{normed} * (1 + {s})",
            f"{normed} * (1 + {a})[:, None, :] + {b}[:, None, :]", f"{normed} * (1 + {k})[:, None, :] + {m}[:, None, :]",
            # near misses
            f"{normed} * (2 + {s}) + {t}", f"{normed} * (1 + {s}) - {t}", f"{normed} * (1 - {s})",
            f"{normed} * (1 + {a})[:, None] + {b}[:, None, :]", f"{normed} * (1 + {x}.add_(0.25)) + {t}",
            f"{normed} * (1 + {s}) + {x}.mul_(2)", f"{normed} * (1 + ({x} := {k} * 2))", f"{normed} * {s}",
        ])
        if self.rng.random() < 0.5:
            self.emit(depth, f"{h} = {value}")
            return
        self.emit(depth, self.pick(["if flag:", "if not flag:"]))
        self.emit(depth + 1, f"return {value}")

    def modulate_only(self, depth: int) -> None:
        h, n, s, t = self.pick(STREAMS), self.pick(STREAMS), self.pick(ROWS), self.pick(ROWS)
        self.emit(depth, f"{h} = {n} * (1 + {s}[:, None]) + {t}[:, None]")

    def modulate_rows(self, depth: int) -> None:
        """The modulate-rows form: ``1`` or ``1.0``, the product either way round, rows per sample, per token (a
        stream), ``[S, D]`` rows (per token at batch 1 only: here as written), anywhere in a statement, of a name or
        of a module's call (a norm's, or one writing its input in place)."""
        h, n, x, norm = self.pick(STREAMS), self.pick(STREAMS), self.pick(STREAMS), self.pick(NORMS)
        s, t = self.pick([(f"{a}.unsqueeze(1)", f"{b}[:, None]") for a in ROWS for b in ROWS]
                         + [(a, b) for a in STREAMS for b in STREAMS] + [(f"{a}[0]", f"{a}[1]") for a in STREAMS])
        one, normed = self.pick(["1", "1.0"]), self.pick([n, f"{norm}({x})", f"{n}.add_(0.25)"])
        if normed == f"{norm}({x})" and AUX.random() < 0.4:  # (a draw of its own: the other forms' draws stay)
            normed = f"self.act_inplace({x})"  # a module that writes its input in place, where the norm is
        mod = self.pick([f"{normed} * ({one} + {s}) + {t}", f"({one} + {s}) * {normed} + {t}"])
        self.emit(depth, self.pick([f"{h} = {mod}", f"{h} = self.proj({mod})", f"{h} = self.proj({mod}) * {x}"]))

    def gated_expr(self, depth: int) -> None:
        """Gated residuals whose gate is an expression computed as written (``g.tanh()``, a per-token ``[S, D]``
        gate), or whose roles only the shapes tell (``R + E * torch.sigmoid(1 - g).unsqueeze(1)``)."""
        h, r, e, g, k = self.pick(STREAMS), self.pick(STREAMS), self.pick(STREAMS), self.pick(ROWS), self.pick(STREAMS)
        self.emit(depth, self.pick([f"{h} = {r} + {g}.unsqueeze(1).tanh() * {e}",
                                    f"{h} = {r} + {k}[0].tanh() * {e}",
                                    f"{h} = {r} + {k}[0] * {e}",
                                    f"{h} = {r} + {e} * torch.sigmoid(1 - {g}).unsqueeze(1)",
                                    f"{h} = {r} + {g}.add_(0.5).unsqueeze(1).tanh() * {e}"]))

    def gelu_cat(self, depth: int) -> None:
        x, a = self.pick(STREAMS), self.pick(STREAMS)  # the projection's own name, read by the concatenation only
        self.emit(depth, f"mlp = self.act_mlp(self.proj_mlp({x}))")
        for _ in range(self.rng.randrange(3)):
            if self.rng.random() < 0.3:
                self.emit(depth, self.pick([f"mlp = {x} * 2", f"mlp += {a}", f"mlp.mul_(2)"]))
            else:
                self.filler(depth)
        self.emit(depth, f"o = torch.cat([{a}, mlp], dim=2)")

    def silu(self, depth: int) -> None:
        h, e, f = self.pick(STREAMS), self.pick(STREAMS), self.pick(STREAMS)
        self.emit(depth, self.pick([f"{h} = self.act({e}) * {f}", f"{h} = self.proj(self.act({e}) * {f})",
                                    f"{h} = {f} * self.act({e})", f"{h} = self.proj({f} * F.silu({e}))",
                                    f"{h} = {f}[0] * self.act({e}[0])", f"{h} = {f}.add_(1) * self.act({f})"]))

    def helper(self, depth: int) -> None:
        """A call of a helper function of the module (inlined where that is exact) with arguments that are names,
        module calls, or expressions writing a stream in place."""
        h, r, b, x = self.pick(STREAMS), self.pick(STREAMS), self.pick(STREAMS), self.pick(STREAMS)
        g, s, t, norm = self.pick(ROWS), self.pick(ROWS), self.pick(ROWS), self.pick(NORMS)
        modulated = f"apply_scale_shift({norm}({x}.float()), {x}, {s}, {t})"
        out = self.pick([b, f"self.proj({b})", f"{b}.add_(0.25)", f"{b} * 2", f"self.proj({b}.mul_(2))",
                         f"self.proj(self.act_inplace({r}))", f"self.proj({modulated}) + {r}.add_(0.25)",
                         f"self.proj({modulated}) * ({g} := {g} * 2).mean()"])
        cast = self.pick(["", f".type_as({r})"])
        self.emit(depth, self.pick([
            f"{h} = apply_gate_sum({r}, {out}, {g}){cast}",
            f"{h} = apply_gate_sum({r}, self.proj({modulated}), {g}){cast}",
            f"{h} = {modulated}",
            f"{h} = self.proj({modulated})",
            f"{h} = gate_sum_twice({r}, {out}, {g})",
        ]))

    def fp32_forms(self, depth: int) -> None:
        """Kandinsky 5's fp32 chains cast back, and AceStep's gated residual cast back."""
        h, r, e, x = self.pick(STREAMS), self.pick(STREAMS), self.pick(STREAMS), self.pick(STREAMS)
        g, s, t, norm = self.pick(ROWS), self.pick(ROWS), self.pick(ROWS), self.pick(NORMS)
        one = self.pick(["1.0", "1"])
        scale = self.pick([f"({s}[:, None].float() + {one})", f"({one} + {s}[:, None].float())"])
        normed = f"{norm}({x}.float())"
        product = self.pick([f"{normed} * {scale}", f"{scale} * {normed}"])
        cast = self.pick([f".type_as({{0}})", f".to({{0}}.dtype)", f".to(dtype={{0}}.dtype)"])
        self.emit(depth, self.pick([
            f"{h} = ({product} + {t}[:, None].float())" + cast.format(x),
            f"{h} = ({r}.float() + {g}[:, None].float() * {e}.float())" + cast.format(r),
            f"{h} = ({r}.float() + {e}.float() * {g}.unsqueeze(1).float())" + cast.format(r),
            f"{h} = ({r} + {e} * {g}.unsqueeze(1))" + cast.format(r),
        ]))

    def read(self, depth: int) -> None:
        self.emit(depth, f"{self.pick(LOCALS)} = {self.pick(STREAMS)} * 1")

    # --- blocks --------------------------------------------------------------------------------------------
    def items(self, depth: int, count: int, nested: int = 0) -> None:
        forms = [self.gated_two, self.gated_two, self.gated_one, self.modulate, self.modulate, self.modulate,
                 self.modulate_only, self.gelu_cat, self.silu, self.filler, self.filler, self.read, self.helper,
                 self.helper, self.fp32_forms, self.modulate_rows, self.gated_expr, self.norm_returned,
                 self.norm_returned]
        for _ in range(count):
            roll = self.rng.random()
            if nested < 2 and roll < 0.15:
                self.emit(depth, self.pick(["if flag:", "if not flag:"]))
                self.items(depth + 1, self.rng.randint(1, 3), nested + 1)
                if self.rng.random() < 0.3:
                    self.emit(depth, "else:")
                    self.items(depth + 1, self.rng.randint(1, 2), nested + 1)
            elif nested < 2 and roll < 0.25:
                self.emit(depth, "for _i in range(2):")
                self.items(depth + 1, self.rng.randint(1, 3), nested + 1)
            else:
                self.pick(forms)(depth)

    def source(self, name: str) -> str:
        self.emit(1, "def forward(self, x, c, gate_a, gate_b, scale, shift, flag):")
        for local in LOCALS:  # every name bound up front: a read of a dropped one gets a value, not a NameError
            self.emit(2, f"{local} = " + self.pick(["x * 0.5", "c.clone()", "x.view(x.shape)", "c - x"]))
        self.emit(2, "o = torch.cat([x, c], dim=2)")
        self.items(2, self.rng.randint(3, 8))
        self.emit(2, "return x, c, " + ", ".join(LOCALS) + ", o")
        return f"class {name}(Base):\n" + "\n".join(self.lines) + "\n"


def _import(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _inputs(gen: torch.Generator, flag: bool) -> dict:
    r = lambda *shape: torch.randn(*shape, generator=gen).to(torch.bfloat16)  # noqa: E731
    return dict(x=r(B, S, D), c=r(B, S, D), gate_a=r(B, D), gate_b=r(B, D), scale=r(B, D) * 0.5,
                shift=r(B, D), flag=flag)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):  # bit for bit, NaN where NaN
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))
    return a == b


def _run(block, inputs):
    args = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    try:
        with torch.no_grad():
            out = block(**args)
    except Exception as exc:  # noqa: BLE001 - the rewritten forward must fail the same way
        return type(exc), args
    return out, args


# calls whose presence in a rewritten forward the test counts: each form must be taken somewhere
CALLS = ("modulate_rows(", "norm_modulate_later(", "mul_silu(", "tanh(), ", "norm_modulate_indexed(", "norm_scale(",
         "return _diffusers_fastpath_chains.norm_modulate_rows(", "return _diffusers_fastpath_chains.norm_scale(")


def _fused(cls, name, module):
    return _chains.fused_subclass(cls, name, module, activations=("act", "F.silu"))


def test_rewritten_random_forwards_compute_the_same_bits(tmp_path, emulated_kernels):
    rng = random.Random(SEED)
    AUX.seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    found_kinds: dict[str, int] = {}
    fast = rewritten = 0
    wrong: list[str] = []  # each forward whose rewrite differs, with its source
    for m in range(MODULES):
        names = [f"Block{i}" for i in range(PER_MODULE)]
        path = tmp_path / f"generated_forwards_{m}.py"
        path.write_text(HEADER + "\n\n" + "\n\n".join(Forward(rng).source(n) for n in names))
        module_name = f"_fastpath_generated_forwards_{m}"
        module = _import(path, module_name)
        try:
            for name in names:
                cls = getattr(module, name)
                sub, found = _fused(cls, f"Fused{name}", module_name)
                if found is None:
                    continue
                rewritten += 1
                text = "".join(linecache.getlines(sub.forward.__code__.co_filename))
                for call in CALLS:
                    found_kinds[call] = found_kinds.get(call, 0) + (call in text)
                for kind, value in vars(found).items():
                    found_kinds[kind] = found_kinds.get(kind, 0) + bool(value)
                torch.manual_seed(rng.randrange(2**31))
                block = cls().to(torch.bfloat16)
                with torch.no_grad():
                    block.norm2.weight.normal_(1.0, 0.2)
                    block.norm2.bias.normal_(0.0, 0.2)
                fused = copy.deepcopy(block)
                fused.__class__ = sub
                _chains.add_chain_sites(PatchState("lossless"), fused, found)
                for flag in (True, False):
                    inputs = _inputs(gen, flag)
                    (want, want_in), (got, got_in) = _run(block, inputs), _run(fused, inputs)
                    if type(want) is not type(got):
                        wrong.append(f"{name} (flag={flag}) fails one way only")
                    elif not isinstance(want, type) and not (all(map(_same, want, got))
                                                              and all(_same(want_in[k], got_in[k]) for k in inputs)):
                        wrong.append(f"{name} (flag={flag}) computes other outputs or writes its inputs otherwise")
                    else:
                        continue
                    source = path.read_text().split(f"class {name}(Base):\n")[1].split("\n\n\nclass ")[0]
                    wrong[-1] += f":\n{source}"
                    break
                fast += sum(s.fast for mod in fused.modules() for attr, s in vars(mod).items()
                            if attr.startswith("_fastpath_site"))
        finally:
            del sys.modules[module_name]
    assert not wrong, f"{len(wrong)} rewritten forwards differ; the first:\n\n" + "\n\n".join(wrong[:4])
    # not vacuous: most forwards are rewritten, every form is taken somewhere, and the fused kernels run
    assert rewritten > MODULES * PER_MODULE // 2, rewritten
    for kind in ("gates", "norms", "modulates", "norm_modulates", "gelu_cat", "silu_mul", "gates_fp32", "norms_fp32", "inlined", *CALLS):
        assert found_kinds.get(kind, 0) >= 5, (kind, found_kinds)
    assert fast > 100, fast
