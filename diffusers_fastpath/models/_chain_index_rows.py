"""Per-token modulation rows picked with ``index_select`` kept as a table and an index (MiniMax-H3's blocks).

MiniMax-H3's ``MiniMaxH3TransformerBlock.forward`` modulates and gates with rows it picks per token of its packed
sequence: ``N * (1.0 + s.index_select(0, rows)) + t.index_select(0, rows)`` and ``R + g.index_select(0, rows) * E``.
The rewriter makes these ``NS.modulate_rows(N, s.index_select(0, rows), t.index_select(0, rows), site, 1.0, True)``
and ``NS.gated_residual(R, g.index_select(0, rows), E, site)``; `lazy_index_rows` then hands the fused ops the table
and the index instead of the written-out ``[N, D]`` rows: each ``A.index_select(0, I)`` operand (``A`` and ``I``
names, the ``0`` a literal) becomes ``NS.index_rows(A, I)`` (`diffusers_fastpath.ops.selected_rows.IndexedRows`),
whose every fallback is the model's call ``A.index_select(0, I)``, made later:

- the ``index_select`` result is an operand of the fused call and nothing else: the call is its only reader;
- what runs between the place eager calls ``index_select`` and the place the rows are read is the evaluation of the
  call's later operands, each a name, a literal, an ``index_rows`` of names or the site's ``getattr(self, ...)``:
  none writes anything, so the table and the index hold then what they held at eager's call;
- the modulate: both rows must be of this form (the scale's written out first in every fallback, as eager orders
  them); the gated residual: its update a name.

The call is then ``NS.modulate_rows`` as before (which takes `IndexedRows` operands) and ``NS.gated_residual_rows``
(which takes them as it takes `SelectedRows`). The rewriter's norm + modulate pair (``N = self.A(X)`` then ``N * (1.0
+ s.index_select(0, rows)) + t.index_select(0, rows)``, `_rewriter_norms.norm_then_rows_modulate`) hands its
``(A, I)`` pairs (`picked_rows`) to ``NS.norm_modulate_picked`` itself: its fallbacks run the norm's call and then
write the rows out, in eager's order, and `diffusers_fastpath.ops.rms_norm_modulate_rows` reads them through the index
instead.
"""

from __future__ import annotations

import ast


def picked_rows(node: ast.expr) -> tuple[ast.Name, ast.Name] | None:
    """``(A, I)`` where `node` is ``A.index_select(0, I)`` with ``A`` and ``I`` names and ``0`` the literal; else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "index_select"
            and isinstance(node.func.value, ast.Name) and len(node.args) == 2 and not node.keywords):
        return None
    dim, index = node.args
    if not (isinstance(dim, ast.Constant) and type(dim.value) is int and dim.value == 0 and isinstance(index, ast.Name)):
        return None
    return node.func.value, index


def _quiet(node: ast.expr) -> bool:
    """A later operand whose evaluation writes nothing: a name, a literal, or the rewriter's ``getattr(self, 'S',
    None)`` of a site."""
    if isinstance(node, (ast.Name, ast.Constant)):
        return True
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) == 3 and not node.keywords and isinstance(node.args[0], ast.Name)
            and node.args[0].id == "self" and all(isinstance(a, ast.Constant) for a in node.args[1:]))


def _lazy(picked: tuple[ast.Name, ast.Name], namespace: str, like: ast.expr) -> ast.expr:
    call = ast.Call(func=ast.Attribute(value=ast.Name(namespace, ast.Load()), attr="index_rows", ctx=ast.Load()),
                    args=[ast.Name(picked[0].id, ast.Load()), ast.Name(picked[1].id, ast.Load())], keywords=[])
    return ast.copy_location(call, like)


def _namespace_call(node: ast.AST, namespace: str, attr: str, arity: int) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr
            and isinstance(node.func.value, ast.Name) and node.func.value.id == namespace
            and len(node.args) == arity and not node.keywords)


def lazy_index_rows(body: list[ast.stmt], namespace: str) -> int:
    """Rewrite, in place, the ``index_select`` rows of the rewritten forward's fused modulates and gated residuals
    into ``NS.index_rows(A, I)`` (see the module doc); returns how many calls now read rows through an index."""
    taken = 0
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if _namespace_call(node, namespace, "modulate_rows", 6):
            first, second, shift, *rest = node.args
            rows = (picked_rows(second), picked_rows(shift))
            normed_left = rest[2]
            if (None in rows or not all(_quiet(a) for a in rest)
                    or not (isinstance(normed_left, ast.Constant) and normed_left.value is True)):
                continue
            node.args[1], node.args[2] = _lazy(rows[0], namespace, second), _lazy(rows[1], namespace, shift)
            taken += 1
        elif _namespace_call(node, namespace, "gated_residual", 4):
            residual, gate, update, site = node.args
            rows = picked_rows(gate)
            if rows is None or not isinstance(update, ast.Name) or not _quiet(site):
                continue
            node.func.attr = "gated_residual_rows"
            node.args[1] = _lazy(rows, namespace, gate)
            taken += 1
    return taken
