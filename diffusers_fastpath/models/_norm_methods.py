"""Modulate methods the generic path fuses with the LayerNorm whose output they receive (the rewriter's
LayerNorm-into-method forms: ``self.M(self.A(X), ...)``, or ``N = self.A(X)`` then ``self.M(N, ...)``), known by
the normalized digest of their installed source (`_source.normalized_digest`: the same for a copy of the method in
another class, different for any change of its code), each with the fused counterpart the rewritten block calls.

- ``"scale_rows"``: Qwen-Image 2.1's ``QwenImage21TransformerBlock._modulate(hidden_states, mod_params,
  target_token_mask)``: ``scale, gate = mod_params.chunk(2, dim=-1)``, each through the module's
  ``_select_modulation_rows`` (``params.unsqueeze(1)``, or ``torch.where(mask.view(1, -1, 1), params[:-1]
  .unsqueeze(1), params[-1:].unsqueeze(0))``: rows picked, no arithmetic; its digest is checked too), then
  ``hidden_states * (1 + scale), gate``. `modulate_scale_rows` makes the same rows the same way (the very function
  the method calls, and the method itself, checked at run time to be the ones checked at patch time) and runs the LayerNorm with the product
  as `layernorm_scale` (per-token rows where the mask picks them, one row per sample without a mask).

  Where the method's LayerNorm reads the stream the gated residual right before it wrote (Qwen-Image 2.1's
  ``H = H + G.tanh() * E`` then ``A, G2 = self._modulate(self.img_norm2(H), ...)``), the two statements become one
  call (`gated_norm_methods`, proven by the rewriter) of `gated_modulate_scale_rows`: the update and the LayerNorm +
  scale of its result as one kernel (`gated_layernorm_scale_rows`), which writes the new stream too.
"""

from __future__ import annotations

import ast

import torch
from torch import nn

from .._state import site_attr
from ..ops import layernorm_scale
from ..ops.gated_layernorm_scale_rows import GATED_LAYERNORM_SCALE_ROWS
from ..ops.layernorm_modulate import LAYERNORM_SCALE_ROWS, layernorm_scale_rows, name_site
from ..ops.selected_rows import SelectedRows, where_index
from .._source import normalized_digest
from ._chain_calls import _ChainsNamespace
from ._chain_proofs import like
from ._rope_cache import derived

# normalized digests (diffusers 0.42.1) of the methods and of the module function the method calls
_SCALE_ROWS = "b4adc8bf2b419472"
_SELECT_ROWS = "faae88c3fde625a3"
_SELECT = "_select_modulation_rows"
_CHECKED: dict[type, tuple] = {}  # block class -> (its method, the `_select_modulation_rows` it calls), checked
_INDEX_KEY = "scale_rows_index"  # the rows' index kept on the forward's mask (`_shared_index`)
GATED_SITE = "gated"  # a norm's site for the gated update + LayerNorm + scale (`gated_modulate_scale_rows`)
LATER = "later"  # `lazy_gates`' mark of a gate whose modulation rows nothing writes before its residual reads them


def norm_method_hints(cls: type) -> tuple[tuple[str, str], ...]:
    """``((method, form), ...)``: the methods of `cls` this module has a fused counterpart for, as installed."""
    method = cls.__dict__.get("_modulate")
    if method is None or normalized_digest(method) != _SCALE_ROWS:
        return ()
    select = method.__globals__.get(_SELECT)
    if select is None or normalized_digest(select) != _SELECT_ROWS:
        return ()
    _CHECKED[cls] = (method, select)
    return (("_modulate", "scale_rows"),)


def modulate_scale_rows(self, norm: nn.Module, x, mod_params, target_token_mask, _fastpath_lazy_gate: bool = False):
    """``self._modulate(norm(x), mod_params, target_token_mask)`` with the LayerNorm and the scale as one fused op
    (the site on `norm` counts); where the method's row selection is no longer the one checked, or the operands are
    not tensors of a LayerNorm, the method runs itself; so too where the class holds another method than the one
    checked (replaced after `patch`: seen at the next patch, and here from its first call).

    With a mask on CUDA the rows the method's ``torch.where`` picks are never written out: the fused norm reads the
    scale through an index (`SelectedRows`), and so, where the rewriter proved the gate is read only as ``G.tanh()``
    by one gated residual (`_fastpath_lazy_gate`, `lazy_gates`), does that residual's kernel: the gate is returned
    as `SelectedRows` of its own copy of the rows and the mask as they are now (what eager's ``where`` reads now)."""
    select = _checked_select(self)
    if (select is None or not isinstance(norm, nn.LayerNorm) or not isinstance(x, torch.Tensor)
            or not isinstance(mod_params, torch.Tensor)):
        return self._modulate(norm(x), mod_params, target_token_mask)
    scale, gate = mod_params.chunk(2, dim=-1)
    site = getattr(norm, site_attr(), None)
    if isinstance(target_token_mask, torch.Tensor) and not torch.compiler.is_compiling():
        rows = SelectedRows(select, scale, target_token_mask, index=_shared_index(target_token_mask, scale))
        if rows.reason(x) is None:
            return layernorm_scale_rows(norm, x, rows, site), _gate_rows(select, gate, target_token_mask, rows,
                                                                         _fastpath_lazy_gate)
    scale = select(scale, target_token_mask)
    gate = select(gate, target_token_mask)
    return layernorm_scale(norm, x, scale, site), gate


def _checked_select(block):
    """The row selection `block`'s ``_modulate`` calls, where its class holds the method checked at patch time (by
    digest) and that method's module the function checked with it; else None."""
    method = type(block)._modulate
    select = getattr(method, "__globals__", {}).get(_SELECT)
    checked = (method, select)
    return select if any(checked == _CHECKED.get(c) for c in type(block).__mro__) else None


def _gate_rows(select, gate, mask, rows: SelectedRows, lazy):
    """The method's gate: ``select(gate, mask)`` as it returns it, or (`lazy`) `SelectedRows` of the rows and the mask
    as they are now (what eager's ``where`` reads now): the rows' tanh taken now into a table of their own, the mask
    held by the index the scale's rows used (`SelectedRows.tanh_taken`: one kernel, where a copy of the rows, a copy
    of the mask and the table's tanh later took three); where the rewriter proved that nothing writes the rows before
    their residual reads them (`lazy` is `LATER`), the rows themselves (`SelectedRows.read_later`: no kernel here,
    the residual's kernel takes their tanh)."""
    if not lazy:
        return select(gate, mask)
    if lazy == LATER:
        return SelectedRows.read_later(select, gate, mask, rows.cached_index)
    return SelectedRows.tanh_taken(select, gate, mask, rows.cached_index)


def gated_modulate_scale_rows(self, norm: nn.Module, residual, gate, update, gate_site, mod_params, target_token_mask,
                              _fastpath_lazy_gate: bool = False):
    """``x = residual + gate * update`` (the rewritten forward's ``gated_residual_rows(residual, gate, update,
    gate_site)``) and then ``self._modulate(norm(x), mod_params, target_token_mask)`` (`modulate_scale_rows`), as
    ``(x, normed, gate)``: where `gate` is `SelectedRows` (a lazy gate, `lazy_gates`) and the method's rows are picked
    by a mask, one kernel (`gated_layernorm_scale_rows`) computes the update, writes it, and computes the LayerNorm +
    scale of it, counted on `norm`'s ``gated`` site (the update's and the norm's own sites then count a fast call each);
    anything else, and wherever that op refuses (its reason counted there), the two calls as the rewritten forward made
    them before (`gated_norm_methods`). The method's own arguments are evaluated before the update either way, which the
    rewriter proved changes nothing the update reads."""
    if (type(gate) is SelectedRows and isinstance(target_token_mask, torch.Tensor)
            and isinstance(residual, torch.Tensor) and isinstance(update, torch.Tensor)
            and isinstance(mod_params, torch.Tensor) and isinstance(norm, nn.LayerNorm)
            and not torch.compiler.is_compiling() and (select := _checked_select(self)) is not None):
        scale, gate2 = mod_params.chunk(2, dim=-1)
        rows = SelectedRows(select, scale, target_token_mask, index=_shared_index(target_token_mask, scale))
        if rows.reason(residual) is None:
            out = GATED_LAYERNORM_SCALE_ROWS.try_fast(getattr(norm, site_attr(GATED_SITE), None), norm, residual,
                                                      gate, update, rows)
            if out is not None:
                for site in (gate_site, getattr(norm, site_attr(), None)):
                    if site is not None:
                        site.fast += 1
                name_site(getattr(norm, site_attr(), None), LAYERNORM_SCALE_ROWS.name)
                x, normed = out
                return x, normed, _gate_rows(select, gate2, target_token_mask, rows, _fastpath_lazy_gate)
    x = _ChainsNamespace.gated_residual_rows(residual, gate, update, gate_site)
    return (x, *modulate_scale_rows(self, norm, x, mod_params, target_token_mask, _fastpath_lazy_gate))


def _shared_index(mask, params: torch.Tensor) -> torch.Tensor | None:
    """`where_index` of the forward's `mask` for `params`' rows, made once for every block of the forward (kept on
    the mask: `_rope_cache.derived`, sealed for the forward that built it, made again after a write in place); an
    inference tensor or another mask than a bool ``[S]`` on the rows' device: ``None`` (`SelectedRows` makes its own,
    or its reason refuses the rows)."""
    if (not isinstance(mask, torch.Tensor) or mask.is_inference() or mask.dtype is not torch.bool or mask.dim() != 1
            or params.dim() != 2 or params.shape[0] < 2 or mask.device != params.device):
        return None
    batch = params.shape[0] - 1
    return derived(mask, (_INDEX_KEY, batch, params.device), lambda: where_index(mask, batch, params.device))


def lazy_gates(body: list[ast.stmt], fused: str, gated: str, namespace: str, proofs=None) -> int:
    """Mark the scale-rows methods' gates that need not be written out, in a rewritten forward's `body` (in place):
    ``A, G = self.F(...)`` (`fused` ``F``, the only binding of ``G`` in the forward) whose ``G`` is read once in
    the whole forward, as ``G.tanh()``, the gate of a fused gated residual ``NS.gated(R, G.tanh(), E, site)``:
    the call gets ``_fastpath_lazy_gate=True`` and the residual becomes ``NS.gated_residual_rows(R,
    NS.tanh_rows(G), E, site)`` (`SelectedRows` through the kernel's index; a tensor ``G`` as before). Anything
    else reading or binding ``G`` (another read, a ``del``, a loop target, a ``global``, ``locals()``) keeps the
    forward as it is. Where `proofs` also shows that nothing writes what the method's modulation operand holds from
    the method's call until the residual's kernel reads the rows (`_rows_stay`), the mark is ``LATER``: the rows are
    read there, not copied at the call. Returns how many gates were marked."""
    tree = ast.Module(body=body, type_ignores=[])
    loads, stores = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loads if isinstance(node.ctx, ast.Load) else stores).setdefault(node.id, []).append(node)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            return 0
    if any(n in loads for n in ("locals", "vars", "eval", "exec")):
        return 0
    residuals = {}  # gate name -> the gated residual call that reads it as ``G.tanh()``
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == gated
                and isinstance(node.func.value, ast.Name) and node.func.value.id == namespace
                and len(node.args) == 4 and not node.keywords):
            tanh = node.args[1]
            if (isinstance(tanh, ast.Call) and isinstance(tanh.func, ast.Attribute) and tanh.func.attr == "tanh"
                    and not tanh.args and not tanh.keywords and isinstance(tanh.func.value, ast.Name)):
                residuals.setdefault(tanh.func.value.id, []).append(node)
    marked = 0
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple)
                and len(node.targets[0].elts) == 2 and all(isinstance(e, ast.Name) for e in node.targets[0].elts)):
            continue
        call = node.value
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == fused
                and isinstance(call.func.value, ast.Name) and call.func.value.id == "self" and not call.keywords):
            continue
        g = node.targets[0].elts[1].id
        if len(stores.get(g, ())) != 1 or len(loads.get(g, ())) != 1 or len(residuals.get(g, ())) != 1:
            continue
        residual = residuals[g][0]
        later = proofs is not None and _rows_stay(tree, node, residual, fused, proofs)
        call.keywords.append(ast.keyword(arg="_fastpath_lazy_gate", value=ast.Constant(LATER if later else True)))
        residual.func.attr = "gated_residual_rows"
        residual.args[1] = ast.Call(func=ast.Attribute(value=ast.Name(namespace, ast.Load()), attr="tanh_rows",
                                                       ctx=ast.Load()), args=[residual.args[1].func.value],
                                    keywords=[])
        marked += 1
    return marked


def _rows_stay(tree: ast.Module, method: ast.Assign, residual: ast.Call, fused: str, proofs) -> bool:
    """Whether nothing writes what the method call's modulation operand (``self.F(N, X, M, K)``'s ``M``: the rows
    the gate picks) may hold from that call until the gated residual `residual` reads the rows: the residual the value
    of a statement of the same block, after the method's; none of the statements between them, nor the residual's other
    operands, nor (where the next statement is a scale-rows method call that `gated_norm_methods` may join to the
    residual, evaluating its operands first) that call's operands writes them (`Proofs.stays`, by object: the rows
    are the tensors taken at the call). The method itself reads and writes nothing else (checked by digest); the
    mask's values are held by the index made at the call."""
    call = method.value
    if len(call.args) != 4 or any(isinstance(a, ast.Starred) for a in call.args):
        return False
    for stmts in _blocks(tree):
        if not any(s is method for s in stmts):
            continue
        i = next(k for k, s in enumerate(stmts) if s is method)
        for j in range(i + 1, len(stmts)):
            if isinstance(stmts[j], (ast.Assign, ast.Expr)) and stmts[j].value is residual:
                break
        else:
            return False
        rows, between, at = [call.args[2]], stmts[i + 1:j], stmts[j]
        others = [a for k, a in enumerate(residual.args) if k != 1]
        if not proofs.stays(rows, method, between, exprs=others, where=at, by_name=False):
            return False
        after = stmts[j + 1] if j + 1 < len(stmts) else None
        if (isinstance(after, ast.Assign) and isinstance(after.value, ast.Call)
                and isinstance(after.value.func, ast.Attribute) and after.value.func.attr == fused):
            joined = [*after.value.args, *(k.value for k in after.value.keywords)]
            return proofs.stays(rows, method, between, exprs=joined, where=after, by_name=False)
        return True
    return False


def _blocks(tree: ast.AST):
    """Every list of statements in `tree` (bodies, else branches, finally blocks, handlers' bodies)."""
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            inner = getattr(node, name, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                yield inner


def gated_norm_methods(body: list[ast.stmt], fused: str, namespace: str, proofs) -> list[str]:
    """Join each gated residual and the fused scale-rows method call right after it that normalises its result, in a
    rewritten forward's `body` (in place, in every block of statements): ``H = NS.gated_residual_rows(R, G, E, S)`` (or
    ``NS.gated_residual``) directly followed by ``A, B = self.F(self.N, H, M, K[, _fastpath_lazy_gate=True])`` (`fused`
    ``F``) becomes ``H, A, B = NS.gated_modulate_scale_rows(self, self.N, R, G, E, S, M, K[, ...])``. The update now
    runs after ``self.N``, ``M`` and ``K`` are evaluated, and ``H`` is bound after them, so: none of them reads ``H``
    (the stream between the two statements is read only as the norm's input; ``A`` and ``B`` are other names), their
    evaluation leaves what ``R``, ``G`` and ``E`` hold as it was (`Proofs.stays`, on the forward as written), and no
    exception handler reads ``H`` (were their evaluation to raise, ``H`` would not yet hold the new stream). Returns the
    norms' attributes, one per pair joined."""
    joined: list[str] = []

    def visit(stmts: list[ast.stmt]) -> None:
        for stmt in stmts:
            for name in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, name, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    visit(inner)
            for handler in getattr(stmt, "handlers", ()):
                visit(handler.body)
        i = 0
        while i + 1 < len(stmts):
            merged = _gated_pair(stmts[i], stmts[i + 1], fused, namespace, proofs)
            if merged is not None:
                joined.append(merged[1])
                stmts[i:i + 2] = [merged[0]]
            i += 1

    visit(body)
    return joined


def _gated_pair(first: ast.stmt, second: ast.stmt, fused: str, namespace: str, proofs):
    """``(merged statement, norm attribute)`` for `gated_norm_methods`' pair, or None."""
    if not (isinstance(first, ast.Assign) and len(first.targets) == 1 and isinstance(first.targets[0], ast.Name)):
        return None
    h, residual_call = first.targets[0].id, first.value
    if not (isinstance(residual_call, ast.Call) and isinstance(residual_call.func, ast.Attribute)
            and residual_call.func.attr in ("gated_residual_rows", "gated_residual")
            and isinstance(residual_call.func.value, ast.Name) and residual_call.func.value.id == namespace
            and len(residual_call.args) == 4 and not residual_call.keywords
            and not any(isinstance(a, ast.Starred) for a in residual_call.args)):
        return None
    if not (isinstance(second, ast.Assign) and len(second.targets) == 1 and isinstance(second.targets[0], ast.Tuple)
            and len(second.targets[0].elts) == 2
            and all(isinstance(e, ast.Name) and e.id != h for e in second.targets[0].elts)):
        return None
    call = second.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == fused
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "self" and len(call.args) == 4
            and not any(isinstance(a, ast.Starred) for a in call.args)
            and all(k.arg == "_fastpath_lazy_gate" for k in call.keywords)):
        return None
    norm, x, *rest = call.args
    if not (isinstance(x, ast.Name) and x.id == h and isinstance(norm, ast.Attribute)
            and isinstance(norm.value, ast.Name) and norm.value.id == "self"):
        return None
    others = [norm, *rest, *(k.value for k in call.keywords)]
    if any(isinstance(n, ast.Name) and n.id == h for e in others for n in ast.walk(e)):
        return None  # read before the update binds H now
    residual, gate, update, site = residual_call.args
    if (isinstance(gate, ast.Call) and isinstance(gate.func, ast.Attribute) and gate.func.attr == "tanh_rows"
            and isinstance(gate.func.value, ast.Name) and gate.func.value.id == namespace and len(gate.args) == 1):
        gate = gate.args[0]  # (`lazy_gates`' ``NS.tanh_rows(G)``: the update reads what G holds)
    if (proofs is None or not proofs.stays([residual, gate, update], first, exprs=others, where=second)
            or proofs.handlers_read(second, h)):
        return None
    targets = [ast.Name(h, ast.Store()), *(ast.Name(e.id, ast.Store()) for e in second.targets[0].elts)]
    merged = ast.Call(func=ast.Attribute(value=ast.Name(namespace, ast.Load()), attr="gated_modulate_scale_rows",
                                         ctx=ast.Load()),
                      args=[ast.Name("self", ast.Load()), norm, *residual_call.args, *rest], keywords=call.keywords)
    return like(ast.Assign(targets=[ast.Tuple(elts=targets, ctx=ast.Store())], value=merged), first), norm.attr


# the rewritten forwards' call of `gated_modulate_scale_rows` (`_chain_calls` cannot import this module: it imports it)
_ChainsNamespace.gated_modulate_scale_rows = staticmethod(gated_modulate_scale_rows)

FUSED = {"scale_rows": ("_modulate_scale_rows", modulate_scale_rows)}  # form -> (the subclass's name for it, function)
