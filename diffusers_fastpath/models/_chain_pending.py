"""The waiting half of the rewritten forwards' calls (`diffusers_fastpath.models._chain_calls`): a QK norm, a joint
concatenation of two, a rotated key or a value projection that a rewritten processor leaves pending (`_NormLater` and
its kin) until the call that reads it (the rotary embedding, the prefix concatenation) knows whether one fused op can
run both, and `_PendingCalls`, the namespace methods that make and resolve them. A pending value that reaches
anything else is computed as diffusers' lines compute it (`_materialize`)."""

from __future__ import annotations

import torch
from diffusers.models import embeddings
from torch import nn

from ..ops import (qk_norm_rope, qk_norm_rope_fp32, qk_norm_rope_zero_centred, qk_norm_rotary_half, qk_norm_rows_rope,
                   qk_norm_rows_rope_pair, rmsnorm_rope_complex, rmsnorm_rope_complex_cat, rmsnorm_rope_real,
                   rotary_emb, rotary_emb_rows, rotary_emb_wan, rotary_half_partial)
from ..ops._policy import autocast_on
from ..ops.linear_prefix import linear_prefix, unflattened
from ..ops.rmsnorm_rope_prefix import rmsnorm_rope_complex_prefix
from ..quality import hooked, plain_linear_unfit
from ._chain_qk_fp32 import is_zero_centred
from ._chain_rotate_half import is_partial_rotate_half
from ._qk_norms import is_diffusers_rmsnorm

# complex-form rotary functions checked by digest (`register_complex_rotary`) -> the dims of the factors they take as
# the op broadcasts them: 2 (``[S, D/2]``, Qwen-Image's, which unsqueezes dim 1) or 3 (``[B, S, D/2]``, diffusers'
# ``apply_rotary_emb(..., use_real=False)``, which unsqueezes dim 2)
COMPLEX_ROTARIES: dict = {}
ROWS_ROTARIES: set = set()  # rows-form rotary functions checked by digest (`register_rows_rotary`)


def register_rows_rotary(fn) -> None:
    """Let the rows-form rotary calls ``fn(x, (cos, sin))`` run as `diffusers_fastpath.ops.rotary_emb_rows`: its
    adapter has checked (by the digest of the installed source) that `fn` is LTX-Video's ``apply_rotary_emb``, the
    op's reference expression."""
    ROWS_ROTARIES.add(fn)


def register_complex_rotary(fn, per_sample: bool = False) -> None:
    """Let a QK norm waiting for `fn` run fused with it (`rmsnorm_rope_complex`): its adapter has checked (by the
    digest of the installed source) that ``fn(x, freqs, use_real=False)`` is `diffusers_fastpath.ops.rmsnorm_rope.
    rope_complex`'s complex multiply for factors of ``[S, D/2]`` (`per_sample`: of ``[B, S, D/2]``, unsqueezed at
    dim 2, as diffusers' ``apply_rotary_emb`` does)."""
    COMPLEX_ROTARIES[fn] = 3 if per_sample else 2


def _plain_rmsnorm(norm) -> bool:
    """torch's ``nn.RMSNorm`` or diffusers' (`is_diffusers_rmsnorm`): the norms a pending QK norm may be."""
    return type(norm) is nn.RMSNorm or is_diffusers_rmsnorm(norm)


def _rms_qk_norm_unfit(norm: nn.Module) -> str | None:
    """Why a pending QK norm cannot run inside `rmsnorm_rope_complex` or `rmsnorm_rope_real`, or ``None``."""
    if not is_diffusers_rmsnorm(norm):
        return f"{type(norm).__name__} is not diffusers' RMSNorm"
    if hooked(norm):
        return "norm has hooks"
    return None


def rotary_complex_unfit(fn, norm: nn.Module) -> str | None:
    """Why the QK norm `norm` and the complex-form rotary `fn` after it cannot run as `rmsnorm_rope_complex`, or
    ``None``."""
    if fn is not None and fn not in COMPLEX_ROTARIES:  # None: the rewriter checked a local function's source
        return f"{getattr(fn, '__name__', fn)} is not the rotary this package checked"
    return _rms_qk_norm_unfit(norm)


class _NormLater:
    """``norm(x)`` not yet run: what a rewritten processor hands from a QK norm to the concatenation and the rotary
    embedding after it (the QK-norm form of `_rewriter`); with `heads`, ``norm(x).unflatten(2, (heads, -1))`` (Wan's
    processor splits the heads before its rotary). Only the namespace's calls ever see one."""

    __slots__ = ("norm", "x", "heads")

    def __init__(self, norm, x: torch.Tensor, heads: int = 0) -> None:
        self.norm, self.x, self.heads = norm, x, heads


class _NormFp32Later:
    """``norm(x.float())`` not yet run: a float32 QK norm (FLUX.3's) waiting for its rotary (`_chain_qk_fp32`)."""

    __slots__ = ("norm", "x")

    def __init__(self, norm, x: torch.Tensor) -> None:
        self.norm, self.x = norm, x


class _CatLater:
    """``torch.cat([norm_txt(x_txt), norm_img(x_img)], dim=1)`` not yet run (two `_NormLater`)."""

    __slots__ = ("txt", "img")

    def __init__(self, txt: _NormLater, img: _NormLater) -> None:
        self.txt, self.img = txt, img


def _row_norm_waits(x) -> bool:
    """Whether `x` is a pending torch ``RMSNorm`` across all heads (LTX-Video's, Wan's) of a ``[B, S, C]`` tensor."""
    return (isinstance(x, _NormLater) and type(x.norm) is nn.RMSNorm and x.x.dim() == 3
            and tuple(x.norm.normalized_shape) == (x.x.shape[-1],))


def _two_tables(freqs, kinds=(tuple, list)) -> bool:
    """Whether `freqs` is a rotary embedding's ``(cos, sin)`` pair of tensors (in one of `kinds`)."""
    return isinstance(freqs, kinds) and len(freqs) == 2 and all(isinstance(t, torch.Tensor) for t in freqs)


def _complex_waits(x, freqs, fn, local: bool) -> bool:
    """Whether `x` is a pending QK norm (of ``[B, S, H, D]``) whose complex-form rotary `fn` by `freqs` has the factor
    layout `rmsnorm_rope_complex` computes (``[B, S, D/2]`` for a processor-local function, else as `fn` was
    registered)."""
    return (isinstance(x, _NormLater) and not x.heads and isinstance(freqs, torch.Tensor)
            and freqs.dim() == (3 if local else COMPLEX_ROTARIES.get(fn, 2)))  # unregistered: says why below


class _RotatedLater:
    """``fn(norm(x), freqs, use_real=False)`` not yet run: a pending norm's complex-form rotary that only a joint
    concatenation reads (the rewriter's joint form), run by `rmsnorm_rope_complex` once that concatenation is known."""

    __slots__ = ("x", "freqs", "site")

    def __init__(self, x: _NormLater, freqs: torch.Tensor, site) -> None:
        self.x, self.freqs, self.site = x, freqs, site

    def run(self) -> torch.Tensor:
        return rmsnorm_rope_complex(self.x.norm, self.x.x, self.freqs, self.site)


# what a QK norm + partial rotate-half site counts where its pending norm ran as written before the rotary
PARTIAL_UNFUSED = "norm not torch.nn.RMSNorm, or the rotary not the known function with (cos, sin)"

# what a prefix concatenation's site counts where its key was not left waiting by a fused norm + rotary
PREFIX_UNFUSED = "key not a waiting norm + rotary (a hooked or other norm, other factors, or no rotary)"


class _LinearLater:
    """``linear(x)`` (then ``.unflatten(-1, sizes)``) not yet run: a value projection that nothing but its prefix
    concatenation reads, and its ``.dtype`` before (the rewriter's prefix-projection form; `linear_later` made it only
    where calling the module later is calling it now). ``dtype`` is ``F.linear``'s result dtype there: x's, which the
    weight and bias share (no autocast)."""

    __slots__ = ("linear", "x", "sizes", "dtype")

    def __init__(self, linear: nn.Linear, x: torch.Tensor, sizes=None) -> None:
        self.linear, self.x, self.sizes, self.dtype = linear, x, sizes, x.dtype

    def unflatten(self, dim, sizes):
        # ``V.unflatten(-1, sizes)`` waits too where it is one (and would not raise); any other runs the module now
        if self.sizes is None and dim == -1 and unflattened(self.linear.out_features, sizes) is not None:
            return _LinearLater(self.linear, self.x, tuple(sizes))
        return self.run().unflatten(dim, sizes)

    def run(self) -> torch.Tensor:
        value = self.linear(self.x)  # (the module's call, as written: later, on the same objects)
        return value if self.sizes is None else value.unflatten(-1, self.sizes)


# what a prefix-projection site counts where the value was not left waiting (`linear_later` ran it as written)
VALUE_UNFUSED = ("value not a waiting projection (a hooked, LoRA or quantized Linear, mixed dtypes, autocast, "
                 "autograd or torch.compile)")


NO_BIAS = "Linear has no bias"  # (`plain_linear_unfit`'s reason: not one here)


def linear_wait_unfit(linear, x) -> str | None:
    """Why ``linear(x)`` must run where it is written rather than later (at a prefix concatenation), or ``None``: its
    call later must be this call (a plain ``nn.Linear``, whose forward is ``F.linear`` and writes nothing,
    no hooks; not a functorch transform or a ``torch.compile`` trace), its result's dtype must be known without
    running it (x, weight and bias of one floating dtype, no autocast: ``F.linear``'s result has x's), and its place in
    autograd must not move (the order of the gradients summed into x follows the order of the calls)."""
    if torch.compiler.is_compiling():
        return "torch.compile"
    if torch._C._are_functorch_transforms_active():
        return "torch.func transform"
    if type(x) is not torch.Tensor:
        return "x not a plain tensor"
    reason = plain_linear_unfit(linear)
    if reason is not None and reason != NO_BIAS:  # (one without a bias is ``F.linear(x, weight)``: fine)
        return reason
    params = (linear.weight,) if linear.bias is None else (linear.weight, linear.bias)
    if linear.bias is not None and type(linear.bias) not in (nn.Parameter, torch.Tensor):
        return "bias is not a plain tensor (quantized)"
    if hooked(linear):
        return "Linear has hooks"
    if not x.is_floating_point() or any(p.dtype != x.dtype for p in params):
        return "mixed dtypes"
    if autocast_on((x,)):
        return "autocast"
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return "requires grad"
    return None


def _materialize(x):
    """The tensor a pending norm (and concatenation) stands for, computed as diffusers' lines compute it."""
    if isinstance(x, _NormLater):
        return x.norm(x.x).unflatten(2, (x.heads, -1)) if x.heads else x.norm(x.x)
    if isinstance(x, _CatLater):
        return torch.cat([_materialize(x.txt), _materialize(x.img)], dim=1)
    if isinstance(x, _NormFp32Later):
        return x.norm(x.x.float())
    if isinstance(x, (_RotatedLater, _LinearLater)):  # waiting for a prefix concatenation, read elsewhere first
        return x.run()
    return x


class _PendingCalls:
    """The namespace's calls that leave a value pending or take one (`_chain_calls._ChainsNamespace` inherits them)."""

    @staticmethod
    def rotary(x, freqs, site, qk_site=None, rms_site=None, cast=None, fp32_site=None):
        tables = _two_tables(freqs)
        if isinstance(x, _NormFp32Later):
            # FLUX.3's float32 norm: `cast` is the dtype the rewriter proved the result is cast to right after (the
            # written cast then returns what this returns); without it, or to another dtype, as written
            if tables and type(x.norm) is nn.RMSNorm and cast is not None and cast is x.x.dtype:
                return qk_norm_rope_fp32(x.norm, x.x, freqs[0], freqs[1], fp32_site, site)
            x = _materialize(x)
        if isinstance(x, _NormLater) and x.heads:
            x = _materialize(x)
        if isinstance(x, (_NormLater, _CatLater)):
            if tables and all(type(n.norm) is nn.RMSNorm for n in ((x.txt, x.img) if isinstance(x, _CatLater) else (x,))):
                txt, img = (x.txt, x.img) if isinstance(x, _CatLater) else (None, x)
                return qk_norm_rope(txt and txt.norm, txt and txt.x, img.norm, img.x, freqs[0], freqs[1], qk_site,
                                    site)
            if tables and isinstance(x, _NormLater) and is_diffusers_rmsnorm(x.norm):
                # diffusers' RMSNorm (HunyuanVideo-1.5, Bria-FIBO's single blocks): its own fused op
                reason = _rms_qk_norm_unfit(x.norm)
                if reason is None:
                    return rmsnorm_rope_real(x.norm, x.x, freqs[0], freqs[1], rms_site, site)
                if rms_site is not None:
                    rms_site.fallback[reason] += 1
            elif tables and isinstance(x, _NormLater) and is_zero_centred(x.norm):  # Krea 2's
                return qk_norm_rope_zero_centred(x.norm, x.x, freqs[0], freqs[1], qk_site, site)
            x = _materialize(x)
        if not (isinstance(x, torch.Tensor) and tables):
            return embeddings.apply_rotary_emb(x, freqs, sequence_dim=1)
        return rotary_emb(x, freqs[0], freqs[1], site)

    @staticmethod
    def rotary_complex(fn, x, freqs, site, local=False):
        # fn: the processor's complex-form rotary: a module function checked by digest (Qwen-Image's
        # apply_rotary_emb_qwen, called with use_real=False), or with `local` one the forward defines, whose source the
        # rewriter checked (Z-Image's, called with two arguments); x a pending QK norm where the rewriter deferred it
        # (Z-Image's local function unsqueezes freqs at dim 2: the op's [B, S, D/2] form only; apply_rotary_emb_qwen
        # unsqueezes dim 1, which is the op's broadcast for [S, D/2] factors only: [B, S, D/2] ones broadcast
        # differently there, and run as written)
        if _complex_waits(x, freqs, fn, local):
            reason = rotary_complex_unfit(None if local else fn, x.norm)
            if reason is None:
                return rmsnorm_rope_complex(x.norm, x.x, freqs, site)
            if site is not None:
                site.fallback[reason] += 1
        return fn(_materialize(x), freqs) if local else fn(_materialize(x), freqs, use_real=False)

    @staticmethod
    def rotary_complex_later(fn, x, freqs, site, local=False):
        # the joint form's rotary (a stream's q or k that only their concatenation reads): where `rotary_complex` would
        # run `rmsnorm_rope_complex`, that waits for `cat_rotated`; otherwise `rotary_complex` runs now
        if not local and _complex_waits(x, freqs, fn, local) and rotary_complex_unfit(fn, x.norm) is None:
            return _RotatedLater(x, freqs, site)
        return _PendingCalls.rotary_complex(fn, x, freqs, site, local)

    @staticmethod
    def cat_rotated(a, b, site):
        # ``torch.cat([a, b], dim=1)`` of two streams' rotated q (or k): at batch 1 both written into the joint tensor
        # by one op; otherwise each as its rotary would have run (a pending norm where the rotary was skipped)
        if (isinstance(a, _RotatedLater) and isinstance(b, _RotatedLater) and a.x.x.dim() == b.x.x.dim() == 4
                and a.x.x.shape[0] == b.x.x.shape[0] == 1):
            return rmsnorm_rope_complex_cat(a.x.norm, a.x.x, a.freqs, b.x.norm, b.x.x, b.freqs, site, a.site)
        return torch.cat([t.run() if isinstance(t, _RotatedLater) else _materialize(t) for t in (a, b)], dim=1)

    @staticmethod
    def cat_prefix_rotated(c, k, site):
        # ``torch.cat([c, k], dim=1)`` of a prefix (Qwen-Image 2.1's cached key) and a rotated key that nothing but
        # this concatenation reads (the rewriter's prefix form): where its rotary waits (`rotary_complex_later`), the
        # kernel writes it after a copy of the prefix; otherwise the concatenation as written
        if isinstance(k, _RotatedLater) and isinstance(c, torch.Tensor):
            return rmsnorm_rope_complex_prefix(c, k.x.norm, k.x.x, k.freqs, site, k.site)
        if site is not None:
            site.fallback[PREFIX_UNFUSED] += 1
        return torch.cat([c, _materialize(k)], dim=1)

    @staticmethod
    def linear_later(linear, x):
        # ``linear(x)``, a value projection the rewriter proved is read before its prefix concatenation only for its
        # ``.dtype`` and ``.unflatten(-1, sizes)``: waits (`_LinearLater`) where calling it later is this call;
        # otherwise runs here, as written
        if linear_wait_unfit(linear, x) is None:
            return _LinearLater(linear, x)
        return linear(x)

    @staticmethod
    def cat_prefix_linear(c, v, site):
        # ``torch.cat([c, v], dim=1)`` of a prefix (Qwen-Image 2.1's cached value) and a projection that nothing but
        # this concatenation reads (the rewriter's prefix-projection form): where it waits (`linear_later`), its GEMM
        # writes the rows after a copy of the prefix (`linear_prefix`); otherwise the concatenation as written
        if isinstance(v, _LinearLater):
            return linear_prefix(c, v.linear, v.x, v.sizes, site)
        if site is not None:
            site.fallback[VALUE_UNFUSED] += 1
        return torch.cat([c, v], dim=1)

    @staticmethod
    def rotary_rows(fn, x, freqs, site, qk_site=None):
        # fn: the processor's module function NAME of the rows form (LTX-Video's apply_rotary_emb), checked by digest;
        # x a pending QK norm across all heads where the rewriter deferred it
        tables = _two_tables(freqs, tuple)
        if fn in ROWS_ROTARIES and tables and _row_norm_waits(x):
            return qk_norm_rows_rope(x.norm, x.x, freqs[0], freqs[1], 0, qk_site, site)
        x = _materialize(x)
        if fn in ROWS_ROTARIES and isinstance(x, torch.Tensor) and tables:
            return rotary_emb_rows(x, freqs[0], freqs[1], site)
        return fn(x, freqs)

    @staticmethod
    def rotary_rows_pair(fn, q, k, freqs, site, pair_site=None):
        # LTX-Video's q and k (the rewriter's pair of rows-form rotary calls): both pending norms across all heads,
        # of one shape, run as one kernel reading the tables once; otherwise each as `rotary_rows` would
        tables = _two_tables(freqs, tuple)
        if fn in ROWS_ROTARIES and tables and _row_norm_waits(q) and _row_norm_waits(k):
            return qk_norm_rows_rope_pair(q.norm, q.x, k.norm, k.x, freqs[0], freqs[1], pair_site, site)
        if pair_site is not None and (_row_norm_waits(q) or _row_norm_waits(k)):
            pair_site.fallback["q or k not a pending torch.nn.RMSNorm, or tables not LTX-Video's"] += 1
        rotary = _PendingCalls.rotary_rows
        return rotary(fn, q, freqs, site), rotary(fn, k, freqs, site)

    @staticmethod
    def rotary_wan(fn, x, freqs, site, qk_site=None):
        # fn: Wan's rotary, the function the processor defines (the rewriter checked its source), called NAME(X, *F);
        # x a pending QK norm across all heads, split into heads, where the rewriter deferred it
        tables = _two_tables(freqs)
        if tables and _row_norm_waits(x) and x.heads:
            return qk_norm_rows_rope(x.norm, x.x, freqs[0], freqs[1], x.heads, qk_site, site)
        x = _materialize(x)
        if isinstance(x, torch.Tensor) and tables:
            return rotary_emb_wan(x, freqs[0], freqs[1], site)
        return fn(x, *freqs)

    @staticmethod
    def rotary_half_partial(fn, x, freqs, site, qk_site=None):
        # ``fn(x, *freqs)``: MiniMax-H3's partial rotate-half where fn is that function (by its source) and freqs its
        # (cos, sin), with the pending QK norm of each head before it where the rewriter deferred one (torch's
        # RMSNorm: `qk_norm_rotary_half`, whose fallback runs the norm and then this rotary); any other function, or
        # another norm (run here, as written), as written
        known = is_partial_rotate_half(fn) and _two_tables(freqs, tuple)
        if isinstance(x, _NormLater) and not x.heads:
            if known and type(x.norm) is nn.RMSNorm:
                return qk_norm_rotary_half(x.norm, x.x, freqs[0], freqs[1], qk_site, site, fn)
            if qk_site is not None:
                qk_site.fallback[PARTIAL_UNFUSED] += 1
        x = _materialize(x)
        if known and isinstance(x, torch.Tensor):
            return rotary_half_partial(x, freqs[0], freqs[1], site, fn)
        return fn(x, *freqs)

    @staticmethod
    def norm_later_fp32(norm, x):
        # FLUX.3's ``norm(x.float())``: waits only where its fused op could run it (torch's RMSNorm of a tensor)
        return _NormFp32Later(norm, x) if isinstance(x, torch.Tensor) and type(norm) is nn.RMSNorm else norm(x.float())

    @staticmethod
    def norm_later(norm, x):
        # only a norm a fused op can run waits: torch's RMSNorm (`qk_norm_rope`) or diffusers' (`rmsnorm_rope_real`
        # before the real-form rotary, `rmsnorm_rope_complex` before the complex one); any other runs here, as written
        if isinstance(x, torch.Tensor) and (_plain_rmsnorm(norm) or is_zero_centred(norm)):
            return _NormLater(norm, x)  # (Krea 2's zero-centred norm: `qk_norm_rope_zero_centred`)
        return norm(x)

    @staticmethod
    def norm_later_to(norm, x, dtype):
        # Qwen-Image 2.1's ``norm(x).to(dtype)``: waits as `norm_later` where the cast is provably none (x of that half
        # dtype, an RMSNorm whose weight is of it or absent: its result has the dtype, and ``.to`` returns that very
        # tensor); any other runs here, as written
        if (isinstance(x, torch.Tensor) and _plain_rmsnorm(norm) and x.dtype == dtype
                and dtype in (torch.float16, torch.bfloat16)
                and (getattr(norm, "weight", None) is None or norm.weight.dtype == dtype)):
            return _NormLater(norm, x)
        return norm(x).to(dtype)

    @staticmethod
    def unflatten_later(x, dim, sizes):
        # Wan: ``x.unflatten(2, (attn.heads, -1))`` of a pending norm waits with it for the rotary
        if (isinstance(x, _NormLater) and not x.heads and dim == 2 and isinstance(sizes, tuple) and len(sizes) == 2
                and isinstance(sizes[0], int) and sizes[0] > 0 and sizes[1] == -1):
            return _NormLater(x.norm, x.x, sizes[0])
        return _materialize(x).unflatten(dim, sizes)

    @staticmethod
    def cat_later(a, b):
        if isinstance(a, _NormLater) and isinstance(b, _NormLater) and not (a.heads or b.heads):
            return _CatLater(a, b)
        return torch.cat([_materialize(a), _materialize(b)], dim=1)

    materialize = staticmethod(_materialize)
