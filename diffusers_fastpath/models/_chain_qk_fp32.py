"""The float32 QK-norm form of a processor (FLUX.3's ``Flux3AttnProcessor``), for the rewriter's QK-norm form::

    Q = A.norm_q(Q.float())                              # -> Q = norm_later_fp32(A.norm_q, Q)
    ...
    Q = apply_rotary_emb(Q, E, sequence_dim=1)           # -> Q = rotary(Q, E, s, qk, rms, cast=V.dtype, fp32_site=f)
    ...
    Q, K = Q.to(V.dtype), K.to(V.dtype)                  # unchanged

The norm waits, as the other QK norms do, for its rotary; the rotary of a pending float32 norm runs all three steps
as `qk_norm_rope_fp32` (one rounding, to ``V.dtype``) only where the rewriter proved here that the cast back follows it
with nothing reading the float32 result in between: then the written cast finds its operand already of that dtype and
returns it. Without that proof the rotary gets no ``cast`` and the chain runs as written (the norm on ``Q.float()``,
the float32 rotary, the cast). The proof (`mark_casts`), over a processor's top-level statements after the QK-norm
form:

- the cast statement follows the top-level statement holding the last of these rotary calls, with only the form's
  own ``N = materialize(N)`` statements in between;
- it is ``Q = Q.to(D)`` or ``Q, K = Q.to(D), K.to(D)`` with one expression ``D`` (``V.dtype``, ``V`` a plain name),
  which writes nothing and whose names nothing from the first rotary's statement to the cast binds, so that it has the
  same value at each rotary as at the cast (it is bound there already: the cast reads it after them);
- each cast name has exactly one rotary call in those statements, ``N = rotary(N, ...)``, of a pending float32 norm,
  and is read there only by that call and the ``materialize`` statements; nothing else binds it;
- no loop or ``try`` in those statements (a rotary run twice, or a handler reading the name in between).
"""

from __future__ import annotations

import ast
import copy

import torch

from ._chain_proofs import _bound_names
from ._chain_syntax import _call, _ns_call, _single_target, _site_of
from .._source import normalized_digest

QK_NORM_ROPE_FP32 = "qk_norm_rope_fp32"  # the site: FLUX.3's float32 QK norm + rotary, cast back
QK_NORM_ROPE_ZERO_CENTRED = "qk_norm_rope_zero_centred"  # the op of Krea 2's QK norm + rotary (at the qk site)
# _source.normalized_digest of Krea2RMSNorm.forward (diffusers 0.42.1): ``F.rms_norm(x.float(), (self.dim,),
# weight=self.weight + 1.0, eps=self.eps).to(x.dtype)``, a zero-centred norm the QK-norm form defers like torch's
ZERO_CENTRED_DIGESTS = frozenset({"f81c1343db165a25"})
_ZERO_CENTRED: dict[type, tuple[object, bool]] = {}  # class -> (the forward it held when checked, the answer)
# set on this package's subclass of such a class (`_qk_norms.zero_centred_class`, whose forward is the fused norm):
# the class whose forward the answer is read from
EAGER_CLASS_ATTR = "_fastpath_eager_class"


def is_zero_centred(norm) -> bool:
    """Whether `norm`'s class holds a forward whose source is provably a known zero-centred float32 RMSNorm (Krea
    2's; a ``functools.wraps`` wrapper or a forward replaced on the class is not: `_source.normalized_digest`),
    checked once per forward the class holds, and an instance forward of its own nowhere (`quality.hooked` refuses
    that too, as a hook)."""
    cls = type(norm)
    cls = cls.__dict__.get(EAGER_CLASS_ATTR, cls)  # this package's subclass: its diffusers class's forward
    forward = cls.__dict__.get("forward")
    cached = _ZERO_CENTRED.get(cls)
    if cached is None or cached[0] is not forward:
        if torch.compiler.is_compiling():
            return False  # (reading a source is not traced: a forward first seen in a trace runs as written there)
        cached = _ZERO_CENTRED[cls] = (forward, forward is not None and normalized_digest(forward) in ZERO_CENTRED_DIGESTS)
    return cached[1] and "forward" not in getattr(norm, "__dict__", {})


def fp32_norm_input(value: ast.expr, target: str) -> bool:
    """Whether `value`'s only argument is ``target.float()`` (``Q = A.norm_q(Q.float())``)."""
    arg = value.args[0] if isinstance(value, ast.Call) and len(value.args) == 1 and not value.keywords else None
    return (isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr == "float"
            and not arg.args and not arg.keywords and isinstance(arg.func.value, ast.Name)
            and arg.func.value.id == target)


def deferred_fp32(value: ast.Call) -> ast.Call:
    """``norm_later_fp32(A.norm_q, Q)`` for ``A.norm_q(Q.float())``."""
    return _call("norm_later_fp32", [value.func, value.args[0].func.value])


def _materializing(stmt: ast.stmt) -> bool:
    target = _single_target(stmt)
    return (target is not None and _ns_call(stmt.value, "materialize") and len(stmt.value.args) == 1
            and isinstance(stmt.value.args[0], ast.Name) and stmt.value.args[0].id == target)


def _casts(stmt: ast.stmt) -> tuple[list[str], ast.expr] | None:
    """``([Q, K], D)`` for ``Q, K = Q.to(D), K.to(D)`` (or ``([Q], D)`` for ``Q = Q.to(D)``), else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
        return None
    target, value = stmt.targets[0], stmt.value
    pairs = (list(zip(target.elts, value.elts)) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
             and len(target.elts) == len(value.elts) else [(target, value)])
    names, dtype = [], None
    for t, v in pairs:
        if not (isinstance(t, ast.Name) and isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute)
                and v.func.attr == "to" and isinstance(v.func.value, ast.Name) and v.func.value.id == t.id
                and len(v.args) == 1 and not v.keywords):
            return None
        arg = v.args[0]
        if not (isinstance(arg, ast.Attribute) and arg.attr == "dtype" and isinstance(arg.value, ast.Name)):
            return None
        if dtype is not None and ast.dump(arg) != ast.dump(dtype):
            return None
        names.append(t.id)
        dtype = arg
    return (names, dtype) if len(set(names)) == len(names) else None


def mark_casts(body: list[ast.stmt], pending: set[str], owner: str) -> int:
    """The proof of the module doc over a processor's top-level `body` (the QK-norm form's result), `pending` the
    names of the float32 norms it deferred: each proven rotary call gets ``cast=D, fp32_site=...`` (in place).
    Returns how many did."""
    def rotary_of(node: ast.AST) -> bool:
        return (_ns_call(node, "rotary") and node.args and isinstance(node.args[0], ast.Name)
                and node.args[0].id in pending)

    tops = [i for i, stmt in enumerate(body) if any(rotary_of(n) for n in ast.walk(stmt))]
    if not tops:
        return 0
    c = tops[-1] + 1
    while c < len(body) and _materializing(body[c]):
        c += 1
    cast = _casts(body[c]) if c < len(body) else None
    if cast is None or not set(cast[0]) <= pending:
        return 0
    names, dtype = cast
    span = body[tops[0]:c]
    if any(isinstance(n, (ast.For, ast.AsyncFor, ast.While, ast.Try, ast.Lambda, ast.FunctionDef))
           for stmt in span for n in ast.walk(stmt)):
        return 0
    if dtype.value.id in set().union(*(_bound_names(stmt) for stmt in span)):
        return 0
    calls = []
    for name in names:
        assigns = [n for stmt in span for n in ast.walk(stmt)
                   if isinstance(n, ast.Assign) and _single_target(n) == name and rotary_of(n.value)
                   and n.value.args[0].id == name]
        allowed = {id(a.value.args[0]) for a in assigns}
        allowed |= {id(s.value.args[0]) for s in span if _materializing(s) and _single_target(s) == name}
        loads = [n for stmt in span for n in ast.walk(stmt)
                 if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]
        stores = sum(isinstance(n, ast.Name) and n.id == name and not isinstance(n.ctx, ast.Load)
                     for stmt in span for n in ast.walk(stmt))
        materialized = sum(_materializing(s) and _single_target(s) == name for s in span)
        if len(assigns) != 1 or any(id(n) not in allowed for n in loads) or stores != 1 + materialized:
            return 0
        calls.append(assigns[0].value)
    for call in calls:
        call.keywords = [ast.keyword("cast", copy.deepcopy(dtype)),
                         ast.keyword("fp32_site", _site_of(ast.Name(owner, ast.Load()), QK_NORM_ROPE_FP32))]
    return len(calls)
