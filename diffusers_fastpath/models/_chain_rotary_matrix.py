"""The matrix-form rotary calls of a processor (Kandinsky 5's and 6's), for the rewriter::

    R(X, T)        ->  rotary_matrix(R, X, T, site, local)        (R, X, T plain names; anywhere in an assignment)

``R`` is either a function of the forward's module whose source (name set aside) is Kandinsky 6's ``apply_rotary``
(`MODULE_DIGESTS`; the forward never binds the name), checked again at run time by ``rotary_matrix``, so that a
function replaced since runs as written; or a function the forward defines itself, once, whose definition is
Kandinsky 5's (`LOCAL_DIGESTS`; the name bound by nothing else), proven here from the forward's own source, which
the rewritten forward keeps (``local`` True: its result is bfloat16 whatever x's dtype, so the fused op runs only on
bfloat16 x). The call's operands are evaluated as written (names: nothing can tell the order), then the fused
`diffusers_fastpath.ops.rotary_matrix` or, where it refuses, ``R(X, T)`` itself.
"""

from __future__ import annotations

import ast

from ._chain_rotate_half import known_function, module_functions
from ._chain_syntax import _call, _site_of
from .._source import normalized_digest

ROTARY_MATRIX = "rotary_matrix"  # the site: a processor's matrix-form rotary calls
# _source.normalized_digest of apply_rotary in transformer_kandinsky6 and transformer_kandinsky6_sr (diffusers 0.42.1;
# the same source): ``x_ = x.reshape(*x.shape[:-1], -1, 1, 2).float()``, ``(rope.float() * x_).sum(dim=-1)``, reshaped
# to x's shape and cast to x's dtype
MODULE_DIGESTS = frozenset({"20b974c6caffd665"})
# ... of the apply_rotary that Kandinsky5AttnProcessor.__call__ defines (transformer_kandinsky): the same arithmetic
# with ``rope`` as given (float32 in the model) and the result cast to bfloat16
LOCAL_DIGESTS = frozenset({"df0d81b8c03a6494"})


def is_matrix_rotary(fn) -> bool:
    """Whether `fn` is a plain function whose source is Kandinsky 6's ``apply_rotary`` (checked once per function)."""
    return known_function(fn, MODULE_DIGESTS)


def known_names(fn, func: ast.FunctionDef) -> tuple[frozenset[str], frozenset[str]]:
    """``(module, local)``: the names the forward `func` (of `fn`) calls that are Kandinsky 6's function in its
    module (never bound by `func`), and those it binds only by one definition of Kandinsky 5's (no decorator)."""
    module = frozenset(n for n, t in module_functions(fn, func).items() if is_matrix_rotary(t))
    defs: dict[str, list[ast.AST]] = {}
    for node in ast.walk(func):
        if node is func:
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs.setdefault(node.name, []).append(node)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            defs.setdefault(node.id, []).append(node)
        elif isinstance(node, (ast.Global, ast.Nonlocal, ast.Import, ast.ImportFrom)):
            for name in getattr(node, "names", ()):
                defs.setdefault(name if isinstance(name, str) else (name.asname or name.name), []).append(node)
        elif isinstance(node, ast.arg):
            defs.setdefault(node.arg, []).append(node)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defs.setdefault(node.name, []).append(node)
    local = frozenset(name for name, binds in defs.items()
                      if len(binds) == 1 and isinstance(binds[0], ast.FunctionDef) and not binds[0].decorator_list
                      and normalized_digest(binds[0]) in LOCAL_DIGESTS)
    return module, local


def matrix_calls(stmt: ast.stmt, owner: str, module: frozenset[str], local: frozenset[str]) -> tuple[ast.stmt, int]:
    """`stmt` (an assignment) with every call ``R(X, T)`` of one of the names in it replaced by the namespace's
    ``rotary_matrix``, and how many were; `stmt` itself and 0 where none is."""
    if not (module or local) or not isinstance(stmt, ast.Assign):
        return stmt, 0
    count = 0

    class Calls(ast.NodeTransformer):
        def visit_Call(self, node: ast.Call) -> ast.expr:
            nonlocal count
            node = self.generic_visit(node)
            if not (isinstance(node.func, ast.Name) and node.func.id in module | local and not node.keywords
                    and len(node.args) == 2 and all(isinstance(a, ast.Name) for a in node.args)):
                return node
            count += 1
            site = _site_of(ast.Name(owner, ast.Load()), ROTARY_MATRIX)
            new = _call("rotary_matrix", [node.func, *node.args, site, ast.Constant(node.func.id in local)])
            return ast.copy_location(new, node)

    new = Calls().visit(ast.Assign(targets=stmt.targets, value=stmt.value))
    return (ast.copy_location(new, stmt), count) if count else (stmt, 0)
