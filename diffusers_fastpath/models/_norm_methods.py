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
"""

from __future__ import annotations

import ast

import torch
from torch import nn

from .._state import site_attr
from ..ops import layernorm_scale
from ..ops.layernorm_modulate import layernorm_scale_rows
from ..ops.selected_rows import SelectedRows, where_index
from .._source import normalized_digest
from ._rope_cache import derived

# normalized digests (diffusers 0.42.1) of the methods and of the module function the method calls
_SCALE_ROWS = "b4adc8bf2b419472"
_SELECT_ROWS = "faae88c3fde625a3"
_SELECT = "_select_modulation_rows"
_CHECKED: dict[type, tuple] = {}  # block class -> (its method, the `_select_modulation_rows` it calls), checked
_INDEX_KEY = "scale_rows_index"  # the rows' index kept on the forward's mask (`_shared_index`)


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
    method = type(self)._modulate
    select = getattr(method, "__globals__", {}).get(_SELECT)
    checked = (method, select)
    if (not any(checked == _CHECKED.get(c) for c in type(self).__mro__) or not isinstance(norm, nn.LayerNorm)
            or not isinstance(x, torch.Tensor) or not isinstance(mod_params, torch.Tensor)):
        return self._modulate(norm(x), mod_params, target_token_mask)
    scale, gate = mod_params.chunk(2, dim=-1)
    site = getattr(norm, site_attr(), None)
    if isinstance(target_token_mask, torch.Tensor) and not torch.compiler.is_compiling():
        rows = SelectedRows(select, scale, target_token_mask, index=_shared_index(target_token_mask, scale))
        if rows.reason(x) is None:
            out = layernorm_scale_rows(norm, x, rows, site)
            if not _fastpath_lazy_gate:
                return out, select(gate, target_token_mask)
            # (the index the norm's kernel used, if it ran: the same mask's)
            return out, SelectedRows(select, gate.clone(), target_token_mask.clone(), index=rows.cached_index)
    scale = select(scale, target_token_mask)
    gate = select(gate, target_token_mask)
    return layernorm_scale(norm, x, scale, site), gate


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


def lazy_gates(body: list[ast.stmt], fused: str, gated: str, namespace: str) -> int:
    """Mark the scale-rows methods' gates that need not be written out, in a rewritten forward's `body` (in place):
    ``A, G = self.F(...)`` (`fused` ``F``, the only binding of ``G`` in the forward) whose ``G`` is read once in
    the whole forward, as ``G.tanh()``, the gate of a fused gated residual ``NS.gated(R, G.tanh(), E, site)``:
    the call gets ``_fastpath_lazy_gate=True`` and the residual becomes ``NS.gated_residual_rows(R,
    NS.tanh_rows(G), E, site)`` (`SelectedRows` through the kernel's index; a tensor ``G`` as before). Anything
    else reading or binding ``G`` (another read, a ``del``, a loop target, a ``global``, ``locals()``) keeps the
    forward as it is. Returns how many gates were marked."""
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
        call.keywords.append(ast.keyword(arg="_fastpath_lazy_gate", value=ast.Constant(True)))
        residual.func.attr = "gated_residual_rows"
        residual.args[1] = ast.Call(func=ast.Attribute(value=ast.Name(namespace, ast.Load()), attr="tanh_rows",
                                                       ctx=ast.Load()), args=[residual.args[1].func.value],
                                    keywords=[])
        marked += 1
    return marked


FUSED = {"scale_rows": ("_modulate_scale_rows", modulate_scale_rows)}  # form -> (the subclass's name for it, function)
