"""What the rewritten forwards call (`diffusers_fastpath.models._chains`): `_ChainsNamespace`, whose methods each
run one fused op where its operands allow and otherwise the replaced expression as written; those that leave a QK
norm, a rotated key or a projection waiting, and those that take one, are `_chain_pending`'s (`_PendingCalls`, which
it inherits). Also used directly by the hand-written FLUX.1 mirrors (`norm_modulate`, `gelu_cat_unfit`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.normalization import FP32LayerNorm
from torch import nn

from .. import graphs
from ..ops import (cat_heads, gated_residual, gated_residual_fp32, gelu_cat, layernorm_affine_fp32,
                   layernorm_modulate, layernorm_scale, layernorm_scale_shift, layernorm_scale_shift_fp32,
                   modulate_scale_shift, rmsnorm_gated_residual, rmsnorm_modulate, rmsnorm_scale, rotary_half,
                   rotary_matrix, sigmoid_mul, silu_mul, swiglu_cat)
from ..ops.attention_bool_mask import attention_bool_mask
from ..ops.attention_gqa import attention_gqa
from ..ops.gated_residual import gated_residual_rows
from ..ops.layernorm_modulate import name_site
from ..ops.selected_rows import IndexedRows, SelectedRows, TokenRows, index_rows, materialized, tanh_rows
from ..ops.rmsnorm_scale_shift import rmsnorm_gated_residual_rows, rmsnorm_scale_rows
from ..ops.layernorm_scale_shift import LAYERNORM_SCALE_SHIFT, _affine_free
from ..ops.modulate_scale_shift import MODULATE_SCALE_SHIFT, MODULATE_SCALE_SHIFT_ROWS
from ..ops.rms_norm_modulate_rows import RMS_NORM_MODULATE_ROWS
from ..ops.zero_centred_modulate import ZERO_CENTRED_MODULATE
from ._chain_qk_fp32 import is_zero_centred
from ._qk_norms import is_diffusers_rmsnorm
from ._chain_pending import _PendingCalls, _materialize
from ._chain_rotary_matrix import is_matrix_rotary
from ._chain_rotate_half import is_rotate_half
from ._chain_token_rows import token_rows
from ..ops.attention_seq_major import attention_seq_major, cat_reason, cat_seq_major, seq_major
from ..ops.silu_mul import SILUS  # the activation modules `silu_mul` stands for (its proof checks both)
from ..quality import hooked
from ._rope_cache import derived

_FLOAT_EXACT = (torch.float16, torch.bfloat16, torch.float32)  # the dtypes whose ``.float()`` is exact
_TORCH_SIGMOID = torch.sigmoid  # torch's sigmoid, as `mul_sigmoid` takes it (read at import: a replacement is not it)
SWIGLU_MODULES: dict[type, str] = {}  # SwiGLU module class -> the attribute holding its SiLU (`register_swiglu`)


def register_swiglu(cls: type, gate: str) -> None:
    """Let the SwiGLU + concatenation form take modules of exactly `cls`: its adapter has checked (by the digest of
    the installed source) that ``cls.forward(x)`` is ``self.<gate>(x[..., :h]) * x[..., h:]`` with ``h = x.shape[-1]
    // 2``, which `swiglu_cat` computes when ``self.<gate>`` is a plain SiLU."""
    SWIGLU_MODULES[cls] = gate


# per rewrite: [original forward, ((module globals, name, function, code), ...), the subclass that holds it or None]
ORIGINALS: list = []


def register_original(original, helpers: dict) -> int:
    """The key `_ChainsNamespace.stale` checks for a forward rewritten from `original` with `helpers` (name ->
    function) inlined (none, for most)."""
    ORIGINALS.append([original, tuple((original.__globals__, name, fn, fn.__code__) for name, fn in helpers.items()),
                      None])
    return len(ORIGINALS) - 1


def set_owner(key: int, owner: type) -> None:
    """The subclass whose method the rewrite `key` is (`_chains.rewrite_of`): called on an object of another class
    (the module unpatched, the forward still bound by a hook added after `patch`), the rewrite runs its original."""
    ORIGINALS[key][2] = owner


def _float_is_exact(update: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether ``update.float() * gate`` is ``update * gate`` bit for bit: `update` of float16, bfloat16 or float32
    (``.float()`` exact) and a dimensioned float32 `gate` (both products then float32 of the same operands). A
    float64 update is rounded by ``.float()``; a half `gate` or a 0-dim one makes ``update * gate`` a half product."""
    return update.dtype in _FLOAT_EXACT and gate.dtype is torch.float32 and gate.dim() > 0


def _tensors(a, b, c) -> bool:
    """``all(isinstance(t, torch.Tensor) for t in (a, b, c))``, without the generator: asked on every call of a
    rewritten chain (0.15 us against 0.35 on a CPU; tools/host_overhead.py)."""
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(c, torch.Tensor)


def swiglu_cat_unfit(act: nn.Module) -> str | None:
    """Why the SwiGLU module `act` cannot run inside `swiglu_cat`, or ``None``."""
    gate = SWIGLU_MODULES.get(type(act))
    if gate is None:
        return f"{type(act).__name__} is not a SwiGLU this package knows"
    if type(getattr(act, gate, None)) not in SILUS:
        return f"{type(act).__name__}.{gate} is not a SiLU"
    if hooked(act) or hooked(getattr(act, gate)):
        return f"{type(act).__name__} has hooks"
    return None


def norm_modulate(norm: nn.LayerNorm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, site) -> torch.Tensor:
    """``norm(x) * (1 + scale[:, None]) + shift[:, None]``: the LayerNorm + modulate of an adaLN site, as the fused
    `layernorm_scale_shift` (falling back to the LayerNorm module and the fused modulate; ``site`` counts), in
    every tier: no approximation of it is faster. A LayerNorm with its own affine, or diffusers' ``FP32LayerNorm``
    (AuraFlow, CogVideoX, EasyAnimate), goes to `layernorm_modulate` with the rows as ``[B, 1, D]`` (the same
    elements)."""
    if _other_layernorm(norm) and isinstance(scale, torch.Tensor) and isinstance(shift, torch.Tensor):
        return layernorm_modulate(norm, x, scale[:, None], shift[:, None], site)
    name_site(site, LAYERNORM_SCALE_SHIFT.name)  # (where a call of the same site ran another op before)
    return layernorm_scale_shift(norm, x, scale, shift, site)


def _other_layernorm(norm: nn.Module) -> bool:
    """`norm` is one of the LayerNorms `layernorm_modulate` takes and `layernorm_scale_shift` does not."""
    return type(norm) is FP32LayerNorm or type(norm) is nn.LayerNorm and not _affine_free(norm)  # (its weight or bias)


def gelu_cat_unfit(act: nn.Module) -> str | None:
    """Why a block's MLP activation cannot run inside `gelu_cat`, or ``None``."""
    if type(act) is not nn.GELU or act.approximate != "tanh":
        return "act_mlp is not torch.nn.GELU(approximate='tanh')"
    if hooked(act):
        return "act_mlp has hooks"
    return None


def _fits_in_cat(unfit, act: nn.Module, site) -> bool:
    """Whether the activation + concatenation form runs fused here (a rewritten forward's flag): the site exists and
    `unfit(act)` finds nothing; a reason it finds is counted on the site."""
    if site is None:
        return False
    reason = unfit(act)
    if reason is not None:
        site.fallback[reason] += 1
    return reason is None


def _kept_on_table(mask, table, key: tuple, compute):
    """``compute()``, a pure function of `mask`, kept on the forward's rotary `table` (built once per forward and handed
    to every block with the same mask: `derived`) for this mask object at this version, so that each block gets the
    same bits the expression gives (a hook's new mask, or a write in place, computes it again). An inference tensor
    has no version counter to tell a write in place (a hook of a later block may hold the mask), and a
    ``torch.compile`` trace stores nothing: computed as written, in every block."""
    anchor = table[0] if isinstance(table, (tuple, list)) and table else table
    if (torch.compiler.is_compiling() or not (isinstance(mask, torch.Tensor) and isinstance(anchor, torch.Tensor))
            or mask.is_inference()):
        return compute()
    version = mask._version
    return derived(anchor, (*key, id(mask)), lambda: (mask, version, compute()),
                   valid=lambda entry: entry[0] is mask and entry[1] == version)[2]


def _kept_on_mask(mask: torch.Tensor, key: tuple, compute):
    """``compute()``, a pure function of the boolean attention `mask`, kept on the mask itself for the forward that
    built it (`derived`: sealed for that forward, dropped with the mask, computed again after a write in place); an
    inference tensor (no version counter) or a ``torch.compile`` trace: computed as written, in every call."""
    if torch.compiler.is_compiling() or mask.is_inference():
        return compute()
    return derived(mask, key, compute)


def _modulate_rows(x, scale, shift, one) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(x3, s, t)`` with ``x3 * (1 + s[:, None]) + t[:, None]`` (`modulate_scale_shift`, ``x3`` a ``[R, L, D]`` view
    of `x`, ``s`` and ``t`` ``[R or 1, D]``) the same elements as ``x * (one + scale) + shift`` in x's shape, or
    None. `x` is ``[..., L, D]`` (at least 2-D, contiguous) and each of `scale`, `shift` either rows that broadcast
    over its tokens (``[..., 1, D]`` with x's leading dimensions, or all of size 1: per sample, per frame), one row
    per token (x's shape, or x's trailing dimensions where the leading ones are 1: MiniMax-H3's ``[L, D]`` at batch
    1; x then viewed as ``[tokens, 1, D]``), with the same mapping for both. The result has x's shape only where the
    rows broadcast to it, which each case requires; ``one`` the literal 1 (``1 + s`` and ``1.0 + s`` are the same
    number in any floating dtype)."""
    if not (_tensors(x, scale, shift) and one == 1 and type(one) in (int, float)
            and x.is_floating_point() and x.dim() >= 2 and x.is_contiguous() and x.numel() > 0):
        return None
    *lead, tokens, dim = x.shape
    groups = x.numel() // (tokens * dim)

    def grouped(t: torch.Tensor) -> bool:  # [..., 1, D]: one row per leading index (or one row for all)
        return (t.dim() >= 2 and t.shape[-2:] == (1, dim) and t.dim() <= x.dim()
                and (list(t.shape[:-2]) == lead[len(lead) - (t.dim() - 2):] if t.numel() != dim else True)
                and (t.dim() == x.dim() or t.numel() == dim))

    def per_token(t: torch.Tensor) -> bool:  # x's shape, or its trailing dimensions where the others are 1
        return t.dim() <= x.dim() and t.shape == x.shape[x.dim() - t.dim():] and t.numel() == x.numel()

    if all(grouped(t) for t in (scale, shift)):
        rows = [t.reshape(-1, dim) for t in (scale, shift)]
        return x.view(groups, tokens, dim), rows[0], rows[1]
    if all(per_token(t) for t in (scale, shift)):
        # (a view where the rows' strides allow, else a copy of the same values: the guard reads their strides)
        return x.view(-1, 1, dim), scale.reshape(-1, dim), shift.reshape(-1, dim)
    return None


class _ChainsNamespace(_PendingCalls):
    """What the rewritten forwards call. A pattern is matched by its syntax alone, so an operand may turn out not to
    be a tensor at run time: then the replaced expression runs as written."""

    @staticmethod
    def contiguous(x):
        # a residual stream handed over as a transposed view of the patch embedding's output (Wan VACE, SkyReels-V2,
        # Sana, PixArt: ``x.flatten(2).transpose(1, 2)`` with no copy) in memory order, once: every op of the block
        # computes the same values either way, and the fused kernels take rows in memory order only
        return x.contiguous() if isinstance(x, torch.Tensor) and x.dim() >= 2 else x

    @staticmethod
    def gated_residual_rows(residual, gate, update, site):
        # `_norm_methods.lazy_gates`' form: the gate a scale-rows method returned as SelectedRows, through
        # `tanh_rows` (the kernel reads it through an index), or a tensor as before; `_chain_index_rows`' form: the
        # gate's ``index_select`` rows as IndexedRows (`index_rows`)
        if type(gate) in (SelectedRows, IndexedRows):
            if not (isinstance(residual, torch.Tensor) and isinstance(update, torch.Tensor)):
                return residual + gate.materialize() * update
            return gated_residual_rows(residual, gate, update, site)
        return _ChainsNamespace.gated_residual(residual, gate, update, site)

    tanh_rows = staticmethod(tanh_rows)
    # `_chain_token_rows`' ``select_per_token(A, B, M, N)``: TokenRows (read through their index by `rms_scale` and
    # `rms_gated_residual`), or the call as written
    token_rows = staticmethod(token_rows)

    @staticmethod
    def index_rows(params, indices):
        # `_chain_index_rows`' operand ``params.index_select(0, indices)``: IndexedRows that the fused call reads
        # through the index (written out by the model's call in its every fallback); while compiling, the call
        if torch.compiler.is_compiling():
            return params.index_select(0, indices)
        return index_rows(params, indices)

    @staticmethod
    def gated_residual(residual, gate, update, site):
        if not _tensors(residual, gate, update):
            return residual + gate * update
        if update.shape != residual.shape and gate.shape == residual.shape:
            # the syntax could not tell the roles (``R + E * torch.sigmoid(1 - g).unsqueeze(1)``: Stable Audio 3):
            # the operand of the residual's shape is the update; a product of two numbers is the same either way
            # round, bit for bit (and so are its dtype and broadcast shape)
            gate, update = update, gate
        return gated_residual(residual, gate, update, site)

    @staticmethod
    def gated_residual_fp32(residual, gate, update, site, update_float=False):
        # ``(residual.float() + update * gate).type_as(residual)``, or with `update_float` (the rewriter saw
        # ``update.float() * gate``, Wan's FFN line) that form: the two are the same product only where
        # ``update.float()`` changes neither the value nor the product's dtype (`_float_is_exact`); elsewhere (a
        # float64 update, a half gate) the statement runs as written
        if not _tensors(residual, gate, update):
            return (residual.float() + (update.float() if update_float else update) * gate).type_as(residual)
        if update_float and not _float_is_exact(update, gate):
            if site is not None:
                site.fallback[f"update.float() * gate is another product ({str(update.dtype).removeprefix('torch.')}"
                              f" update, {str(gate.dtype).removeprefix('torch.')} gate)"] += 1
            return (residual.float() + update.float() * gate).type_as(residual)
        return gated_residual_fp32(residual, gate, update, site)

    @staticmethod
    def gated_residual_float(residual, left, right, site, gate_left=True):
        # ``residual.float() + left.float() * right.float()`` (Kandinsky 5 / 6), which the rewritten forward casts
        # back to the residual's dtype as written: where the op runs, its result is of that dtype already (each cast
        # returns it as it is). Every operand upcast, the product and the sum are fp32 whatever their dtypes; the op
        # computes ``residual.float() + update * gate`` with ``gate = G.float()``: the same product wherever
        # ``update * gate`` is ``update.float() * gate`` (`_float_is_exact`: an fp16 / bf16 / fp32 update, a
        # dimensioned gate), in the other order (a product of two numbers commutes exactly); elsewhere as written
        if _tensors(residual, left, right):
            if gate_left is None:  # the rewriter could not tell: the update is the operand of the residual's shape
                gate_left = right.shape == residual.shape
            gate, update = (left, right) if gate_left else (right, left)
            gate = gate.float()
            if _float_is_exact(update, gate):
                return gated_residual_fp32(residual, gate, update, site)
            if site is not None:
                site.fallback[f"update.float() * gate is another product ({str(update.dtype).removeprefix('torch.')}"
                              f" update, {gate.dim()}-dim gate)"] += 1
        return residual.float() + left.float() * right.float()

    @staticmethod
    def norm_modulate_float(norm, x, scale, shift, site, normed_left=True, one_left=False, one=1.0):
        # ``norm(x.float()) * (scale.float() + 1.0) + shift.float()`` (Kandinsky 5 / 6; the product and the sum either
        # way round, as written: `normed_left`, `one_left`), cast back to x's dtype by the rewritten forward as
        # written: where the op runs its result is of that dtype already. The rows upcast, every operation after the
        # norm is fp32 whatever their dtypes: the op's ``(norm(x.float()) * (1 + s[:, None]) + t[:, None])
        # .type_as(x)`` of ``s = scale.float()[:, 0]`` (``[B, 1, D]`` rows) is the same sums and products, element
        # by element (1 and 1.0 are the same fp32 number; sums and products commute exactly)
        if (isinstance(norm, nn.LayerNorm) and _tensors(x, scale, shift)
                and scale.dim() == shift.dim() == 3 and scale.shape[1] == shift.shape[1] == 1):
            return layernorm_scale_shift_fp32(norm, x, scale.float()[:, 0], shift.float()[:, 0], site)
        normed = norm(x.float())
        factor = one + scale.float() if one_left else scale.float() + one
        return (normed * factor if normed_left else factor * normed) + shift.float()

    @staticmethod
    def stale(key, obj):
        # a rewritten forward's original, where it must run as written: called on `obj` (its ``self``) that is no
        # longer of the patched subclass (a hook added after `patch` holds the bound rewrite, and the object's class is
        # diffusers' again: unpatched, or the verification's run as written, `verify.as_written`), or where its module
        # no longer holds one of the helper functions inlined into it (`_chain_inline`) with that code (replaced after
        # `patch`); the function diffusers' class holds now where that is not the original (replaced after `patch`: a
        # library's ``WanAttnProcessor.__call__``); else None
        original, helpers, owner = ORIGINALS[key]
        if owner is not None:
            if not isinstance(obj, owner):
                return original
            current = getattr(owner.__mro__[1], original.__name__, None)
            if current is not original:  # replaced on diffusers' class since (rewritten again at the next `patch`)
                return current
        for globals_, name, fn, code in helpers:
            if globals_.get(name) is not fn or fn.__code__ is not code:
                return original
        return None

    @staticmethod
    def norm_modulate_fp32(norm, x, scale, shift, site):
        if (isinstance(norm, nn.LayerNorm) and _tensors(x, scale, shift)
                and scale.dim() == shift.dim() == 3 and scale.shape[1] == shift.shape[1] == 1):
            return layernorm_scale_shift_fp32(norm, x, scale[:, 0], shift[:, 0], site)  # per element the same
        return (norm(x.float()) * (1 + scale) + shift).type_as(x)

    @staticmethod
    def norm_affine_fp32(norm, x, site):
        # norm: Wan's norm2, an FP32LayerNorm with weight and bias (or nn.Identity where the model has none); the op
        # refuses a hooked one (counted) and runs this very expression
        if type(norm) is FP32LayerNorm and isinstance(x, torch.Tensor):
            return layernorm_affine_fp32(norm, x, site)
        return norm(x.float()).type_as(x)

    @staticmethod
    def norm_modulate(norm, x, scale, shift, site):
        if not (isinstance(norm, nn.LayerNorm) and _tensors(x, scale, shift)):
            return norm(x) * (1 + scale[:, None]) + shift[:, None]
        return norm_modulate(norm, x, scale, shift, site)

    @staticmethod
    def norm_modulate_indexed(norm, x, scale, shift, site):
        # ``norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]`` (CogVideoX's, ConsisID's block norms): with
        # ``[B, D]`` rows the same elements as ``1 + scale[:, None]``, `norm_modulate`'s form
        if (isinstance(norm, nn.LayerNorm) and _tensors(x, scale, shift)
                and scale.dim() == shift.dim() == 2):
            return norm_modulate(norm, x, scale, shift, site)
        return norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]

    @staticmethod
    def norm_scale(norm, x, scale, site):
        # ``norm(x) * (1 + scale)`` (Qwen-Image 2.1's output norm): `layernorm_scale` where the rows are ``[B or 1,
        # S or 1, D]`` (its guard says the rest; its fallback is this very expression)
        if (isinstance(norm, nn.LayerNorm) and isinstance(x, torch.Tensor) and isinstance(scale, torch.Tensor)
                and scale.dim() == 3):
            return layernorm_scale(norm, x, scale, site)
        return norm(x) * (1 + scale)

    @staticmethod
    def modulate(x, scale, shift, site):
        if not _tensors(x, scale, shift):
            return x * (1 + scale[:, None]) + shift[:, None]
        return modulate_scale_shift(x, scale, shift, site)

    @staticmethod
    def modulate_rows(first, second, shift, site, one=1, normed_left=True):
        # ``first * (one + second) + shift`` (`normed_left`) or ``(one + first) * second + shift``, as written (``one``
        # the literal 1 or 1.0, the operands evaluated in the order written): the modulate of an already-normalised
        # tensor by rows that broadcast over it per sample or per token (MiniMax-H3's ``s.index_select(0, rows)``,
        # LTX-2's ``s.squeeze(2)``, Krea 2's ``[B, 1, D]``), as `modulate_scale_shift` where `_modulate_rows` maps
        # them onto its ``[B, D]`` rows exactly; elsewhere as written
        if type(second) is IndexedRows:  # `_chain_index_rows`' form (normed_left; the shift IndexedRows too)
            if isinstance(first, torch.Tensor) and type(one) in (int, float) and one == 1:
                out = MODULATE_SCALE_SHIFT_ROWS.try_fast(site, first, second, shift)
                if out is not None:
                    return out
            second, shift = second.materialize(), shift.materialize()  # the model's calls, in its order
            return first * (one + second) + shift
        x, scale = (first, second) if normed_left else (second, first)
        mapped = _modulate_rows(x, scale, shift, one)
        if mapped is not None:
            if torch.compiler.is_compiling():  # the op as torch.compile sees it (its fallback: the same elements)
                return MODULATE_SCALE_SHIFT(site, *mapped).view(x.shape)
            out = MODULATE_SCALE_SHIFT.try_fast(site, *mapped)
            if out is not None:
                return out.view(x.shape)
        elif site is not None:
            site.fallback["rows not [B or 1, 1, D] or per token"] += 1
        return (first * (one + second) if normed_left else (one + first) * second) + shift

    @staticmethod
    def norm_modulate_later(norm, x, scale, shift, site, modulate_site, one=1, normed_left=True):
        # ``norm(x) * (one + scale) + shift`` (`normed_left`) or ``(one + scale) * norm(x) + shift``, the norm's call
        # after its operands are evaluated (the rewriter proved it reads the same there: `_norm_waits`,
        # `norm_then_rows_modulate`): Krea 2's zero-centred norm and modulate as one kernel (`zero_centred_modulate`,
        # counted on `site`; its guard says the rest, and it refuses a hooked norm, whose call then runs them), and a
        # torch.nn.RMSNorm with rows picked through an index (MiniMax-H3's `IndexedRows`: `rms_norm_modulate_rows`,
        # likewise); elsewhere the norm's call, then `modulate_rows` as the form was before (counted on
        # `modulate_site`; `IndexedRows` written out after the norm's call, where eager's index_select runs)
        if _tensors(x, scale, shift) and one == 1 and type(one) in (int, float) and is_zero_centred(norm):
            if torch.compiler.is_compiling():  # (its fallback: the norm's call, then the same modulate's elements)
                return ZERO_CENTRED_MODULATE(site, norm, x, scale, shift)
            out = ZERO_CENTRED_MODULATE.try_fast(site, norm, x, scale, shift)
            if out is not None:
                return out
        elif type(norm) is nn.RMSNorm and one == 1 and type(one) in (int, float) and not torch.compiler.is_compiling():
            # (while compiling, the rows are tensors already: `index_rows`)
            out = RMS_NORM_MODULATE_ROWS.try_fast(site, norm, x, scale, shift)
            if out is not None:
                return out
        normed = norm(x)
        if normed_left:
            return _ChainsNamespace.modulate_rows(normed, scale, shift, modulate_site, one, True)
        scale, shift = materialized(scale), materialized(shift)  # (the rewriter keeps rows lazy only on the right)
        return _ChainsNamespace.modulate_rows(scale, normed, shift, modulate_site, one, False)

    @staticmethod
    def norm_modulate_picked(norm, x, scale, scale_index, shift, shift_index, site, modulate_site, one=1):
        # ``norm(x) * (one + scale.index_select(0, scale_index)) + shift.index_select(0, shift_index)``: the rewriter's
        # join of ``N = self.A(X)`` and the modulate of the rows the next statement picks (`norm_then_rows_modulate`,
        # MiniMax-H3's): as `norm_modulate_later` with the rows as IndexedRows (`rms_norm_modulate_rows` reads them
        # through the index; its fallbacks write them out after the norm's call), and while compiling the norm's call,
        # then the two index_select and the modulate, in eager's order
        if torch.compiler.is_compiling():
            normed = norm(x)
            return _ChainsNamespace.modulate_rows(normed, scale.index_select(0, scale_index),
                                                  shift.index_select(0, shift_index), modulate_site, one, True)
        return _ChainsNamespace.norm_modulate_later(norm, x, index_rows(scale, scale_index),
                                                    index_rows(shift, shift_index), site, modulate_site, one, True)

    @staticmethod
    def norm_modulate_rows(norm, x, scale, shift, site):
        tensors = _tensors(x, scale, shift)
        if (isinstance(norm, nn.LayerNorm) and tensors and scale.dim() == shift.dim() == 3
                and scale.shape[1] == shift.shape[1] == 1):
            # the same products and sums, per element; ``squeeze(1)`` is ``[:, 0]``'s view (sizes, strides, offset),
            # made in 1.0 us instead of 1.5 on a CPU
            return norm_modulate(norm, x, scale.squeeze(1), shift.squeeze(1), site)
        if isinstance(norm, nn.LayerNorm) and tensors and scale.dim() == shift.dim() == 3:
            return layernorm_modulate(norm, x, scale, shift, site)  # per-token rows (FLUX.3; its guard says the rest)
        if is_diffusers_rmsnorm(norm) and tensors:  # LTX-Video: per-token rows, all in x's dtype (hooks: the op refuses)
            return rmsnorm_modulate(norm, x, scale, shift, site)
        if site is not None:  # (the numbers are eager's; the site says why nothing ran fused)
            site.fallback["norm not a LayerNorm or diffusers RMSNorm, or rows not tensors"] += 1
        return norm(x) * (1 + scale) + shift

    @staticmethod
    def gelu_in_cat(act, site) -> bool:
        return _fits_in_cat(gelu_cat_unfit, act, site)

    @staticmethod
    def gelu_cat(attn, mlp, site):
        return gelu_cat(attn, mlp, site)

    @staticmethod
    def swiglu_in_cat(act, site) -> bool:
        return _fits_in_cat(swiglu_cat_unfit, act, site)

    @staticmethod
    def swiglu_cat(act, attn, x, site):
        # act: a registered SwiGLU (`swiglu_in_cat` said so for this call): its gate module goes to the op, whose
        # fallback calls it as the SwiGLU's forward does
        gate = SWIGLU_MODULES.get(type(act))
        if gate is None or not (isinstance(attn, torch.Tensor) and isinstance(x, torch.Tensor)):
            return torch.cat([attn, act(x)], dim=-1)
        return swiglu_cat(attn, x, site, getattr(act, gate))

    @staticmethod
    def silu_mul(act, x, y, site):
        # act: the block's activation module (nn.SiLU, or diffusers' FP32SiLU: the op's proof covers both), or None for
        # the functional F.silu (resolved at rewrite time); the op refuses any other module, one in place or with
        # hooks (counted), and its fallback is ``act(x) * y`` as written (FP32SiLU's float32 round trip included)
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            return (F.silu if act is None else act)(x) * y
        return silu_mul(x, y, site, act)

    @staticmethod
    def mul_silu(y, act, x, site):
        # ``y * act(x)`` (diffusers' SwiGLU: ``hidden_states * self.activation(gate)``): the op's kernel computes the
        # same values as ``act(x) * y`` (a product of two numbers commutes exactly) and runs only where the two
        # operands are laid out alike (eager lays a product out after its first operand); elsewhere, as written
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            return y * (F.silu if act is None else act)(x)
        return silu_mul(x, y, site, act, True)

    @staticmethod
    def mul_sigmoid(x, sigmoid, gate, site):
        # ``x * torch.sigmoid(gate)`` (Krea 2's output gate), its operands evaluated as written: `sigmoid` is what
        # ``torch.sigmoid`` named in the processor's module when the statement ran; the fused op only where that is
        # torch's own and both operands are tensors (its guard asks the rest), else the product as written
        if sigmoid is not _TORCH_SIGMOID or not (isinstance(x, torch.Tensor) and isinstance(gate, torch.Tensor)):
            return x * sigmoid(gate)
        return sigmoid_mul(x, gate, site)

    @staticmethod
    def cat_heads(a, b, site, token_major=False):
        # token_major: the rewriter saw that only the attention after it reads this concatenation (`attention_heads`):
        # written token-major where that attention's op allows, otherwise as eager's layout
        a, b = _materialize(a), _materialize(b)  # a norm a processor deferred (none is, where the form is used today)
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return torch.cat([a, b], dim=2)
        if token_major and cat_reason(a, b) is None:
            if site is not None:
                site.fast += 1
            return cat_seq_major(a, b)
        return cat_heads(a, b, site)

    @staticmethod
    def attention_heads(fn, q, k, v, site, **arguments):
        # fn(q, k, v, ...) of the three token-major concatenations above it (SD3's joint attention), or as written
        if seq_major(q) and seq_major(k) and seq_major(v):
            return attention_seq_major(fn, q, k, v, site, **arguments)
        return fn(q, k, v, **arguments)

    @staticmethod
    def attention_gqa(dispatch, q, k, v, groups, site, **arguments):
        # a processor's ``if G > 1: K = K.repeat_interleave(G, dim=2); V = (the same)`` then ``H = dispatch(Q, K, V,
        # ...)`` (Krea 2), K and V read nowhere after: the test as written, then the call on the grouped heads where
        # verified (`ops.attention_gqa`), else the copies and the call as written
        if groups > 1:
            return attention_gqa(dispatch, q, k, v, groups, site, **arguments)
        return dispatch(q, k, v, **arguments)

    @staticmethod
    def attention_bool_mask(dispatch, q, k, v, site, **arguments):
        # a processor's ``H = dispatch_attention_fn(Q, K, V, attn_mask=M, ...)``: a 4-D boolean mask handed to torch as
        # the additive mask torch makes of it, made once per mask and forward (`ops.attention_bool_mask`); no mask, or
        # another kind (an additive one, a key-padding one torch converts in a kernel of its size), as written. A
        # key-padding mask is one over the keys only, ``[B, H, 1, S]``: nothing to gain, and a processor makes it per
        # call (``mask[:, None, None, :]``: Bria FIBO 2's), a new tensor each time that nothing is kept on, whose first
        # use in a forward pays `derived`'s seal (the model's modules walked) in every call. While a CUDA graph
        # records (host time spent once) a key-padding mask is taken too: torch's own conversion for cuDNN's kernel
        # copies a host zero to the GPU in every call (``where`` of a 0-dim host tensor), which a capture refuses;
        # the op's zero is made on the device (Bria FIBO 2's cross-attention)
        mask = arguments.get("attn_mask")
        if not (isinstance(mask, torch.Tensor) and mask.dtype is torch.bool and mask.dim() == 4
                and (mask.shape[2] != 1 or graphs.recording())):
            return dispatch(q, k, v, **arguments)
        return attention_bool_mask(dispatch, q, k, v, _kept_on_mask, site, **arguments)

    @staticmethod
    def pairwise_mask(mask, batch, seq):
        # mask.view(B, 1, 1, S).repeat(1, 1, S, 1) & (the same).transpose(2, 3), then .bool(): element [b, 0, i, j] is
        # mask[b, j] & mask[b, i] either way; here the two operands are broadcast views, nothing is materialised or
        # read transposed. The AND of the same values in the same dtype, the same contiguous [B, 1, S, S] result.
        return (mask.view(batch, 1, 1, seq) & mask.view(batch, 1, seq, 1)).bool().contiguous()

    @staticmethod
    def pairwise_mask_padded(pad, mask, padding, batch, seq, table):
        # pad(mask, padding, value=True).bool(), then the pairwise mask above (HunyuanVideo-1.5's processor, every
        # layer, from the forward's one [B, S_txt] mask): with torch's F.pad, computed once per rotary table (built
        # once per forward) for this mask object at this version and this padding, as `outer_mask` does
        def compute():
            return _ChainsNamespace.pairwise_mask(pad(mask, padding, value=True).bool(), batch, seq)

        if pad is not F.pad:
            return compute()
        return _kept_on_table(mask, table, ("pairwise_mask", tuple(padding), batch, seq), compute)

    @staticmethod
    def outer_mask(mask, table):
        # mask[:, None, None, :] * mask[:, None, :, None] (Chroma's blocks), computed once per rotary table
        # (`_kept_on_table`: the same product of the same tensor for every block)
        return _kept_on_table(mask, table, ("outer_mask",), lambda: mask[:, None, None, :] * mask[:, None, :, None])

    @staticmethod
    def rms_scale(norm, x, scale, site):
        # the op refuses a hooked norm (counted) and runs this very expression; a `token_rows` scale is read through
        # its index (`rmsnorm_scale_rows`), or written out by the model's function where not
        if type(scale) is TokenRows:
            if is_diffusers_rmsnorm(norm) and isinstance(x, torch.Tensor):
                return rmsnorm_scale_rows(norm, x, scale, site)
            return norm(x) * scale.materialize()
        if not (is_diffusers_rmsnorm(norm) and isinstance(x, torch.Tensor) and isinstance(scale, torch.Tensor)):
            return norm(x) * scale
        return rmsnorm_scale(norm, x, scale, site)

    @staticmethod
    def rms_gated_residual(norm, residual, gate, x, site):
        if type(gate) is TokenRows:  # (as `rms_scale`'s)
            if is_diffusers_rmsnorm(norm) and isinstance(residual, torch.Tensor) and isinstance(x, torch.Tensor):
                return rmsnorm_gated_residual_rows(norm, residual, gate, x, site)
            return residual + gate.materialize() * norm(x)
        if not (is_diffusers_rmsnorm(norm) and _tensors(residual, gate, x)):
            return residual + gate * norm(x)
        return rmsnorm_gated_residual(norm, residual, gate, x, site)

    @staticmethod
    def rotary_half(fn, x, cos, sin, site):
        # ``x * cos + fn(x) * sin`` (Ideogram 4, Cosmos 3): fused where fn is a known rotate-half (by its source)
        if is_rotate_half(fn) and _tensors(x, cos, sin):
            return rotary_half(x, cos, sin, site, fn)
        return x * cos + fn(x) * sin

    @staticmethod
    def rotary_matrix(fn, x, rope, site, local):
        # ``fn(x, rope)``: Kandinsky 6's matrix-form rotary where fn is that function (by its source), Kandinsky 5's
        # where the forward defines it (`local`, proven by the rewriter; its result bfloat16); anything else as written
        known = (isinstance(x, torch.Tensor) and x.dtype is torch.bfloat16) if local else is_matrix_rotary(fn)
        if known and isinstance(x, torch.Tensor) and isinstance(rope, torch.Tensor):
            return rotary_matrix(x, rope, site, fn)
        return fn(x, rope)

