"""The rotate-half rotary form of a processor (Ideogram 4's, Cosmos 3's), for the rewriter::

    Q = (X * C) + (R(X) * S)        ->  Q = rotary_half(R, X, C, S, site)        (X, C, S, R plain names)

The rewriter takes the form only for an ``R`` that is, in the forward's module, a function whose source (name set
aside) is the rotate-half these models define (`ROTATE_HALF_DIGESTS`, `known_names`); ``rotary_half`` runs the fused
`diffusers_fastpath.ops.rotary_half` only where ``R`` is still that function at run time, so that the kernel's
``cat(-x[..., D/2:], x[..., :D/2])`` is what ``R`` computes; otherwise, and for operands that are not tensors, the
expression as written, in its order (the names are evaluated first either way, which nothing can tell).
"""

from __future__ import annotations

import ast
import inspect

import torch

from ._chain_syntax import _call, _site_of
from .._source import normalized_digest

ROTARY_HALF = "rotary_half"  # the site: a processor's rotate-half rotary calls
ROTARY_HALF_PARTIAL = "rotary_half_partial"  # ... of MiniMax-H3's partial form
QK_NORM_ROTARY_HALF = "qk_norm_rotary_half"  # ... with the QK norm before it waiting for it (the QK-norm form)
# _source.normalized_digest of transformer_minimax_h3._apply_rotary_emb (diffusers 0.42.1): the rotate-half of the
# first cos.shape[-1] channels of each head, tables cast to x's dtype, the rest passed through, made contiguous
PARTIAL_DIGESTS = frozenset({"4af4ae1a781b25da"})
# _source.normalized_digest of the rotate-half function of transformer_ideogram4 and transformer_cosmos3 (diffusers
# 0.42.1; the same source in both): ``half = x.shape[-1] // 2; return torch.cat((-x[..., half:], x[..., :half]), -1)``
ROTATE_HALF_DIGESTS = frozenset({"62e1cdd97aa0beb9"})
_CHECKED: dict = {}  # function -> whether it is a known rotate-half (functions are few and live as long as modules)


def known_function(fn, digests: frozenset) -> bool:
    """Whether `fn` is a plain function whose source (name set aside) has one of `digests` (checked once per
    function; never while tracing, where a function not checked yet counts as unknown)."""
    if not inspect.isfunction(fn):
        return False
    key = (fn, digests)
    known = _CHECKED.get(key)
    if known is None and torch.compiler.is_compiling():
        return False  # (reading a source is not traced: a function first seen in a trace runs as written there)
    if known is None:
        known = _CHECKED[key] = normalized_digest(fn) in digests
    return known


def is_rotate_half(fn) -> bool:
    """Whether `fn` is a plain function whose source is a known rotate-half (checked once per function)."""
    return known_function(fn, ROTATE_HALF_DIGESTS)


def is_partial_rotate_half(fn) -> bool:
    """Whether `fn` is a plain function whose source is MiniMax-H3's partial rotate-half rotary."""
    return known_function(fn, PARTIAL_DIGESTS)


def rotate_half_of(value: ast.expr) -> tuple[ast.Name, ast.Name, ast.Name, ast.Name] | None:
    """``(R, X, C, S)`` if `value` is ``X * C + R(X) * S`` with plain names, else None."""
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add)):
        return None
    left, right = value.left, value.right
    if not (isinstance(left, ast.BinOp) and isinstance(left.op, ast.Mult) and isinstance(right, ast.BinOp)
            and isinstance(right.op, ast.Mult)):
        return None
    x, c, call, s = left.left, left.right, right.left, right.right
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and len(call.args) == 1
            and not call.keywords and all(isinstance(n, ast.Name) for n in (x, c, s, call.args[0]))
            and call.args[0].id == x.id and len({x.id, c.id, s.id, call.func.id}) == 4):
        return None
    return call.func, x, c, s


def module_functions(fn, func: ast.FunctionDef) -> dict[str, object]:
    """The plain names the forward `func` (of `fn`) calls and never binds itself, with what its module holds under
    them now."""
    bound = {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    bound |= {n.name for n in ast.walk(func) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    called = {c.func.id for c in ast.walk(func) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)} - bound
    return {name: fn.__globals__.get(name) for name in called}


def known_names(fn, func: ast.FunctionDef) -> tuple[frozenset[str], frozenset[str]]:
    """The names the forward `func` (of `fn`) calls that are, in its module, a known rotate-half function and
    MiniMax-H3's partial rotary (by digest), and that it never binds itself: the only calls the forms below take."""
    targets = module_functions(fn, func)
    return (frozenset(n for n, t in targets.items() if is_rotate_half(t)),
            frozenset(n for n, t in targets.items() if is_partial_rotate_half(t)))


def rotate_half_call(stmt: ast.stmt, owner: str, names: frozenset[str]) -> ast.Assign | None:
    """`stmt` (``Q = X * C + R(X) * S``, R one of `names`) with its value replaced by the namespace's
    ``rotary_half``, or None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    form = rotate_half_of(stmt.value)
    if form is None or form[0].id not in names:
        return None
    fn, x, c, s = form
    call = _call("rotary_half", [fn, x, c, s, _site_of(ast.Name(owner, ast.Load()), ROTARY_HALF)])
    return ast.Assign(targets=stmt.targets, value=call)


def partial_call(stmt: ast.stmt, owner: str, names: frozenset[str]) -> ast.Assign | None:
    """``Q = R(X, *F)`` (R one of `names`, X and F plain names; MiniMax-H3's ``_apply_rotary_emb(query, *rotary_emb)``)
    with its value replaced by the namespace's ``rotary_half_partial``, which calls R as written unless it is still
    the known function."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    call = stmt.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.keywords
            and len(call.args) == 2 and isinstance(call.args[0], ast.Name) and isinstance(call.args[1], ast.Starred)
            and isinstance(call.args[1].value, ast.Name) and call.func.id in names):
        return None
    site = _site_of(ast.Name(owner, ast.Load()), ROTARY_HALF_PARTIAL)
    new = _call("rotary_half_partial", [call.func, call.args[0], call.args[1].value, site])
    return ast.Assign(targets=stmt.targets, value=new)
