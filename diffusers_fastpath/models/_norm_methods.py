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

import torch
from torch import nn

from .._state import site_attr
from ..ops import layernorm_scale
from .._source import normalized_digest

# normalized digests (diffusers 0.42.1) of the methods and of the module function the method calls
_SCALE_ROWS = "b4adc8bf2b419472"
_SELECT_ROWS = "faae88c3fde625a3"
_SELECT = "_select_modulation_rows"
_CHECKED: dict[type, tuple] = {}  # block class -> (its method, the `_select_modulation_rows` it calls), checked


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


def modulate_scale_rows(self, norm: nn.Module, x, mod_params, target_token_mask):
    """``self._modulate(norm(x), mod_params, target_token_mask)`` with the LayerNorm and the scale as one fused op
    (the site on `norm` counts); where the method's row selection is no longer the one checked, or the operands are
    not tensors of a LayerNorm, the method runs itself; so too where the class holds another method than the one
    checked (replaced after `patch`: seen at the next patch, and here from its first call)."""
    method = type(self)._modulate
    select = getattr(method, "__globals__", {}).get(_SELECT)
    checked = (method, select)
    if (not any(checked == _CHECKED.get(c) for c in type(self).__mro__) or not isinstance(norm, nn.LayerNorm)
            or not isinstance(x, torch.Tensor) or not isinstance(mod_params, torch.Tensor)):
        return self._modulate(norm(x), mod_params, target_token_mask)
    scale, gate = mod_params.chunk(2, dim=-1)
    scale = select(scale, target_token_mask)
    gate = select(gate, target_token_mask)
    return layernorm_scale(norm, x, scale, getattr(norm, site_attr(), None)), gate


FUSED = {"scale_rows": ("_modulate_scale_rows", modulate_scale_rows)}  # form -> (the subclass's name for it, function)
