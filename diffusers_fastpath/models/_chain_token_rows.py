"""Per-token modulation rows picked by ``select_per_token`` kept as a table and an index (Bria FIBO 2's and Z-Image's
blocks).

``BriaFibo2TransformerBlock.forward`` (and ``ZImageTransformerBlock.forward`` with a noise mask: Z-Image's omni mode)
picks each token's scales and gates, four ``[B, S, D]`` tensors a block, with its module's function::

    def select_per_token(value_noisy, value_clean, noise_mask, seq_len):
        noise_mask_expanded = noise_mask.unsqueeze(-1)
        return torch.where(noise_mask_expanded == 1, value_noisy.unsqueeze(1).expand(-1, seq_len, -1),
                           value_clean.unsqueeze(1).expand(-1, seq_len, -1))

and reads each result once, in ``self.attention_norm1(x) * scale_msa`` or ``x + gate_msa * self.attention_norm2(
attn_out)``, which the rewriter makes ``NS.rms_scale(...)`` and ``NS.rms_gated_residual(...)``. `lazy_token_rows`
then makes the call ``R = F(A, B, M, N)`` into ``R = NS.token_rows(F, A, B, M, N)`` (`token_rows`: an
`ops.selected_rows.TokenRows`, which both fused calls read through its index) where:

- ``F`` is a name the forward does not bind, which the forward's module binds to a function whose normalized source
  digest is ``select_per_token``'s (`known_select`: checked at patch time; at run time `token_rows` takes only a
  function checked so, with the code it had then, and calls anything else as written);
- ``A``, ``B``, ``M`` and ``N`` are names;
- the value bound to ``R`` there is read by one simple statement only (`Proofs.live_after`: no other read of it may
  follow, in the rest of the forward, a next loop iteration or a handler), once there, as the scale of
  ``NS.rms_scale`` or the gate of ``NS.rms_gated_residual`` (their third argument).

Nothing moves in time: `token_rows` runs where eager's ``where`` runs and copies what it reads there (``A`` and
``B`` into the ``[2B, D]`` table, the mask with its index), so whatever runs before the fused call reads the rows (the
attention, a hook) cannot change them; the fused call reads the table through the index, and every fallback writes
the rows out with the model's function on those copies (`TokenRows.materialize`). The index and the mask's copy are
derived from the mask once per forward (`_rope_cache.derived`, owned by the mask tensor: the model's forward builds
it and hands it to every block; every block of the forward that sealed it reuses them while the mask is not written;
elsewhere each call makes its own).
"""

from __future__ import annotations

import ast
import inspect

import torch

from .._source import normalized_digest
from ..ops._policy import HALF_DTYPES, _functorch_active
from ..ops.selected_rows import TokenRows, token_index
from ._rope_cache import derived

# normalized digest (diffusers 0.42.1) of ``select_per_token``: transformer_z_image's, and transformer_bria_fibo2's
# copy of it
_SELECT_PER_TOKEN = "8010a9103ef309c6"
_CHECKED: dict = {}  # function -> its code object when its digest was checked
_KEY = "token_rows"  # (the derived value's key on the mask, with the function)
_CONSUMERS = ("rms_scale", "rms_gated_residual")  # NS calls taking TokenRows as their third argument


def known_select(fn) -> bool:
    """Whether `fn` is a function whose installed source is ``select_per_token``'s (recorded for `token_rows`)."""
    if not inspect.isfunction(fn):
        return False
    if _CHECKED.get(fn) is fn.__code__:
        return True
    if normalized_digest(fn) != _SELECT_PER_TOKEN:
        return False
    _CHECKED[fn] = fn.__code__
    return True


def token_rows(select, noisy, clean, mask, seq_len):
    """``select(noisy, clean, mask, seq_len)`` as `TokenRows` where `select` is a checked ``select_per_token``
    (`known_select`) and the operands are its form (``noisy`` and ``clean`` half ``[B, D]`` of one dtype, ``mask``
    ``[B, seq_len]``, one device, no gradient to record, no ``torch.func`` transform, not compiling); else the call
    as written."""
    if (torch.compiler.is_compiling() or _CHECKED.get(select) is not getattr(select, "__code__", None)
            or not (isinstance(noisy, torch.Tensor) and isinstance(clean, torch.Tensor)
                    and isinstance(mask, torch.Tensor)) or type(seq_len) is not int
            or noisy.dim() != 2 or clean.shape != noisy.shape or noisy.dtype not in HALF_DTYPES
            or clean.dtype is not noisy.dtype or mask.shape != (noisy.shape[0], seq_len) or noisy.shape[0] == 0
            or clean.device != noisy.device or mask.device != noisy.device
            or (torch.is_grad_enabled() and (noisy.requires_grad or clean.requires_grad))
            or _functorch_active()):
        return select(noisy, clean, mask, seq_len)
    mask_copy, index = derived(mask, (_KEY, select), lambda: (mask.clone(), token_index(select, mask, seq_len)))
    return TokenRows(select, torch.cat([noisy, clean]), mask_copy, seq_len, index)


def _binds(function: ast.FunctionDef, name: str) -> bool:
    """Whether `function` may bind `name` locally (a parameter, any store, an import, a nested definition)."""
    args = function.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs, *(a for a in (args.vararg, args.kwarg) if a)]
    if any(a.arg == name for a in params):
        return True
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name).split(".")[0] == name
                                                                  for a in node.names):
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not function and (
                node.name == name):
            return True
        if isinstance(node, (ast.Global, ast.Nonlocal)) and name in node.names:
            return True
    return False


def _select_of(stmt: ast.stmt, module_globals: dict, function: ast.FunctionDef) -> tuple[str, ast.Call] | None:
    """``(R, call)`` where `stmt` is ``R = F(A, B, M, N)`` (names only) with ``F`` a checked ``select_per_token`` of
    the forward's module (`known_select`) that the forward does not bind; else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    call = stmt.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and len(call.args) == 4
            and not call.keywords and all(isinstance(a, ast.Name) for a in call.args)):
        return None
    if not known_select(module_globals.get(call.func.id)) or _binds(function, call.func.id):
        return None
    return stmt.targets[0].id, call


def _own_nodes(stmt: ast.stmt):
    """The nodes of `stmt` itself, not those of the statements it holds."""
    todo = [stmt]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.stmt))


def _consumer(stmt: ast.stmt, name: str, namespace: str) -> bool:
    """Whether simple statement `stmt` reads `name` once, as the third argument of an ``NS.rms_scale`` or
    ``NS.rms_gated_residual`` call."""
    if not isinstance(stmt, (ast.Assign, ast.Expr, ast.Return)):
        return False
    loads = [n for n in _own_nodes(stmt) if isinstance(n, ast.Name) and n.id == name]
    if len(loads) != 1 or not isinstance(loads[0].ctx, ast.Load):
        return False
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _CONSUMERS
               and isinstance(n.func.value, ast.Name) and n.func.value.id == namespace and not n.keywords
               and len(n.args) == (4 if n.func.attr == "rms_scale" else 5) and n.args[2] is loads[0]
               for n in _own_nodes(stmt))


def lazy_token_rows(body: list[ast.stmt], namespace: str, proofs, module_globals: dict) -> int:
    """Rewrite, in place, the ``select_per_token`` calls of a rewritten forward's `body` whose result only a fused
    RMSNorm call reads into ``NS.token_rows(F, A, B, M, N)`` (see the module doc); returns how many."""
    function = proofs.function
    statements = [n for n in ast.walk(ast.Module(body=body, type_ignores=[])) if isinstance(n, ast.stmt)]
    taken = 0
    for stmt in statements:
        found = _select_of(stmt, module_globals, function)
        if found is None:
            continue
        name, call = found
        consumers = [s for s in statements if s is not stmt and _consumer(s, name, namespace)]
        if len(consumers) != 1 or proofs.live_after(stmt, name, ignore=consumers[0]):
            continue
        stmt.value = ast.copy_location(ast.Call(
            func=ast.Attribute(value=ast.Name(namespace, ast.Load()), attr="token_rows", ctx=ast.Load()),
            args=[ast.Name(call.func.id, ast.Load()), *(ast.Name(a.id, ast.Load()) for a in call.args)],
            keywords=[]), call)
        taken += 1
    return taken
