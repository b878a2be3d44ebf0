"""The elementwise chains that sit inline in diffusers' block forwards, fused by rewriting the installed source.

A FLUX-style block computes its gated residuals and its second adaLN modulate inline, in its own ``forward``
(``hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output``). The same lines recur, under other class
names and around other small differences, in Chroma, FLUX.2, Qwen-Image, SD3, Wan, HunyuanVideo and the FLUX
derivatives. Rather than keep a copy of each forward per family (which each diffusers release can silently outdate,
and which a source digest then switches off), `fused_subclass` reads the forward that is *installed*, parses it,
replaces the statements that match one of the chain patterns (`_rewriter`) with a call of the fused op, and compiles
the result as the forward of a subclass. Every other line is diffusers' own, as installed; a forward where no pattern
matches is left alone (and the adapter says so).

Each rewrite is exact by construction: the fused op computes the replaced expression with eager's roundings and, on
any input it does not take (another dtype, autograd, a layout, a norm that is not a plain LayerNorm), runs that
expression itself. The operand order is kept (``R + G * E``, not ``E * G + R``), so even the fallback's op order
is the original's.

The rewriter is in four parts: this one (reading, rewriting and compiling a forward; the subclasses and their
sites), `_rewriter` (the patterns: which statements a forward has and what replaces them, documented there),
`_chain_syntax` (what each pattern's statements look like, as AST) and `_chain_calls` (what the rewritten forwards
call at run time).

The generated source is registered with `linecache`, so tracebacks and ``inspect.getsource`` show the rewritten
lines; the subclasses are created when the adapter module is imported, so pickles of patched models find them by
name.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import inspect
import linecache
import sys
import textwrap

import torch.nn.functional as F
from diffusers.models.normalization import FP32LayerNorm, RMSNorm
from torch import nn

from .._logging import warn_once
from .._state import PatchState, site_attr
from ..ops import Site
from ._chain_calls import SWIGLU_MODULES, _ChainsNamespace
from ._chain_syntax import _NS, _diffusers_rotary, _local_def
from ._rewriter import (AFFINE_FP32, ATTENTION_SEQ_MAJOR, CAT_HEADS, GATED_RESIDUAL, GATED_RESIDUAL_FP32, GELU_CAT, MODULATE, MODULATE_FP32,
                        MODULATE_ONLY, QK_NORM_ROPE, QK_NORM_ROWS, QK_NORM_ROWS_PAIR, RMS_GATED, RMS_MODULATE,
                        RMS_SCALE, RMSNORM_ROPE, RMSNORM_ROPE_CAT, RMSNORM_ROPE_REAL, ROTARY, SILU_MUL, SWIGLU_CAT, Rewrite, _Rewriter)

def rewrite_forward(fn, qualname: str, norm_methods: dict[str, str] | None = None,
                    activations: tuple[str, ...] = (), rms_norms: tuple[str, ...] = (),
                    swiglus: tuple[str, ...] = (), complex_rotary: str | None = None,
                    local_rotary: tuple[str, str] | None = None, head_cats: bool = False,
                    rows_rotary: str | None = None,
                    wan_rotary: tuple[str, str] | None = None) -> tuple[object, Rewrite] | None:
    """`fn` (a block's ``forward`` or a processor's ``__call__``) with its chains routed through the fused ops, and
    what was found; or ``None`` where its source cannot be read, it needs a closure (``super()``), or no pattern
    matched. `norm_methods` maps a modulate method of the block to its fused counterpart (see `_rewriter`)."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    if fn.__code__.co_freevars:
        return None
    tree = ast.parse(source)
    (func,) = tree.body
    if not isinstance(func, ast.FunctionDef):
        return None
    func.decorator_list = []  # the function is wrapped below, never re-decorated
    params = [a.arg for a in func.args.args]
    owner = params[1] if len(params) > 1 and params[0] == "self" and func.name == "__call__" else "self"
    if "F.silu" in activations and fn.__globals__.get("F") is not F:  # the functional form needs torch's F
        activations = tuple(a for a in activations if a != "F.silu")
    if complex_rotary is not None and complex_rotary not in fn.__globals__:
        complex_rotary = None
    if rows_rotary is not None and rows_rotary not in fn.__globals__:
        rows_rotary = None
    wan = None
    if wan_rotary is not None:  # (name, digest): Wan's rotary, a function the forward defines (in any block of it)
        name, digest = wan_rotary
        defs = [n for n in ast.walk(func) if isinstance(n, ast.FunctionDef) and n.name == name]
        stores = [n for n in ast.walk(func) if isinstance(n, ast.Name) and n.id == name and not isinstance(n.ctx, ast.Load)]
        if len(defs) == 1 and not stores and hashlib.sha256(ast.unparse(defs[0]).encode()).hexdigest()[:16] == digest:
            wan = name
    local = None
    if local_rotary is not None:  # (name, digest): a complex-form rotary the forward defines, checked by its source
        name, digest = local_rotary
        local = _local_def(func.body, name)
        if local is not None and hashlib.sha256(ast.unparse(local).encode()).hexdigest()[:16] == digest:
            complex_rotary = name
        else:
            local = None
    rewriter = _Rewriter(owner, _diffusers_rotary(fn, func) and local is None, norm_methods, activations, rms_norms,
                         swiglus, complex_rotary, local is not None, head_cats and owner != "self",
                         rows_rotary if owner != "self" else None, wan if owner != "self" else None)
    func.body = rewriter.body(copy.deepcopy(func.body), func)
    if rewriter.found.head_cats:
        func.body = rewriter.seq_major_attention(func.body)
    if not rewriter.block and (rewriter.found.rotary or rewriter.found.rotary_complex or rewriter.found.rotary_named):
        func.body = rewriter.qk_norms(func.body)
    if not rewriter.found:
        return None
    ast.fix_missing_locations(tree)
    text = ast.unparse(tree) + "\n"
    filename = f"<diffusers_fastpath: {qualname}, rewritten from {inspect.getsourcefile(fn)}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace: dict = {}
    module_globals = fn.__globals__
    module_globals.setdefault(_NS, _ChainsNamespace)
    exec(compile(text, filename, "exec"), module_globals, namespace)  # noqa: S102 (diffusers' own source, rewritten)
    new = namespace[func.name]
    new.__qualname__ = qualname
    new.__doc__ = fn.__doc__
    return new, rewriter.found


def fused_subclass(cls: type, name: str, module: str, method: str = "forward",
                   norm_methods: dict[str, tuple[str, object]] | None = None,
                   activations: tuple[str, ...] = (), rms_norms: tuple[str, ...] = (),
                   swiglus: tuple[str, ...] = (), complex_rotary: str | None = None,
                   local_rotary: tuple[str, str] | None = None,
                   head_cats: bool = False, rows_rotary: str | None = None,
                   wan_rotary: tuple[str, str] | None = None) -> tuple[type, Rewrite] | tuple[None, None]:
    """A subclass of the diffusers block (or attention processor, ``method="__call__"``) `cls`, named `name` and
    defined in (and set as an attribute of) the adapter module `module`, whose `method` is the installed one with its
    chains fused, and what was rewritten; ``(None, None)`` where nothing could be (`swap_rewritten` says so once, when a model has it).
    `norm_methods` maps a modulate method of `cls` to ``(name, function)``, the fused counterpart the subclass gets
    (the LayerNorm-into-method pattern of `_rewriter`); `activations` names the attributes of `cls` that the
    SwiGLU form may take as its SiLU; `rms_norms` those the sandwich-norm forms may take as diffusers' RMSNorm;
    `swiglus` (a processor's) the attention module's attributes the SwiGLU + concatenation form may take;
    `complex_rotary` (a processor's) the name of its module's complex-form rotary function (`register_complex_rotary`);
    `local_rotary` ``(name, digest)``: one the forward defines itself, taken where its normalised source
    (``ast.unparse``) has that sha256 digest prefix; `head_cats` (a processor's) takes its ``torch.cat([A, B], dim=2)``
    of two names (SD3's joint q, k and v of ``[B, H, S, D]``) as the fused `cat_heads`; `rows_rotary` (a
    processor's) the name of its module's rows-form rotary function (`register_rows_rotary`: LTX-Video's);
    `wan_rotary` ``(name, digest)``: Wan's, a function the processor defines, taken where its normalised source has
    that digest."""
    norm_methods = norm_methods or {}
    rewritten = rewrite_forward(getattr(cls, method), f"{name}.{method}",
                                {m: fused_name for m, (fused_name, _) in norm_methods.items()}, activations, rms_norms,
                                swiglus, complex_rotary, local_rotary, head_cats, rows_rotary, wan_rotary)
    if rewritten is None:  # said when a model that has it is patched (`swap_rewritten`), not at import
        return None, None
    fn, found = rewritten
    doc = (f"diffusers' ``{cls.__qualname__}`` with the chains of its installed ``{method}`` fused "
           f"(`diffusers_fastpath.models._chains`): gated residuals {found.gates or '-'} (fp32: "
           f"{found.gates_fp32 or '-'}), LayerNorm + modulate of {found.norms or '-'} (fp32: {found.norms_fp32 or '-'}), "
           f"fp32 affine LayerNorm of {found.affine_fp32 or '-'}, "
           f"rotary embeddings {found.rotary}, GELU + concatenation {found.gelu_cat}, SiLU-gated product "
           f"{found.silu_mul}, RMSNorm + scale of {found.rms_scales or '-'}, RMSNorm + gated residual of "
           f"{found.rms_gated or '-'}, SwiGLU + concatenation of {found.swiglu_cats or '-'}, complex rotary "
           f"{found.rotary_complex}, named-form rotary {found.rotary_named}, head concatenations {found.head_cats}. Adds no "
           "state beyond the fusion sites.")
    extra = {fused_name: fused for fused_name, fused in norm_methods.values()}
    sub = type(name, (cls,), {method: fn, **extra, "__module__": module, "__qualname__": name, "__doc__": doc,
                              "_fastpath_rewrite": found})
    fn.__module__ = module
    if module in sys.modules:  # an attribute of its module from the start, so that pickles find it by name
        setattr(sys.modules[module], name, sub)
    return sub, found


def replace_processors(state: PatchState, model: nn.Module, attention_cls: type, default_cls: type,
                       fused_cls: type | None, attribute: str | None = None) -> None:
    """Give every `attention_cls` module of `model` running diffusers' `default_cls` the rewritten `fused_cls`
    (`fused_subclass` of it, ``method="__call__"``) and its ``rotary_emb`` site; others are left and noted. With
    `attribute`, only the modules that are that attribute of their parent (``"attn1"``: the self-attentions of
    LTX-Video's and Wan's blocks, the only ones called with a rotary table)."""
    if fused_cls is None:
        if any(type(getattr(m, "processor", None)) is default_cls for m in model.modules()):
            warn_nothing_to_fuse(default_cls, "__call__")
        return
    where = None
    if attribute is not None:
        chosen = {id(m._modules[attribute]) for m in model.modules() if attribute in m._modules}
        where = lambda module: id(module) in chosen  # noqa: E731
    state.replace_processors(model, attention_cls, default_cls, fused_cls, where)
    found = fused_cls._fastpath_rewrite  # `fused_subclass` records what it rewrote
    qk = bool(found.qk_norms)
    for module in model.modules():
        if isinstance(module, attention_cls) and type(module.processor) is fused_cls:
            norm = type(getattr(module, "norm_q", None)) if qk else None  # what `norm_later` defers, by its type
            if found.rotary or found.rotary_named:
                state.add_site(module, ROTARY, name=ROTARY)
            if found.rotary:
                if norm is nn.RMSNorm:
                    state.add_site(module, QK_NORM_ROPE, name=QK_NORM_ROPE)
                elif norm is RMSNorm:
                    state.add_site(module, RMSNORM_ROPE_REAL, name=RMSNORM_ROPE_REAL)
            if found.rotary_named and norm is nn.RMSNorm:  # LTX-Video's and Wan's norms across all heads
                if found.rows_pairs:  # LTX-Video's q and k as one call
                    state.add_site(module, QK_NORM_ROWS_PAIR, name=QK_NORM_ROWS_PAIR)
                if found.rotary_named > 2 * found.rows_pairs:
                    state.add_site(module, QK_NORM_ROWS, name=QK_NORM_ROWS)
            if found.rotary_complex and norm is RMSNorm:
                state.add_site(module, RMSNORM_ROPE, name=RMSNORM_ROPE)
                if found.rotary_cats:  # the streams' q and k written into their concatenations (Qwen-Image)
                    state.add_site(module, RMSNORM_ROPE_CAT, name=RMSNORM_ROPE_CAT)
            if found.head_cats:
                state.add_site(module, CAT_HEADS, name=CAT_HEADS)
            if found.seq_major_attention:
                state.add_site(module, ATTENTION_SEQ_MAJOR, name=ATTENTION_SEQ_MAJOR)
            for attr in found.swiglu_cats:
                act = getattr(module, attr, None)
                if type(act) in SWIGLU_MODULES:  # its SwiGLU is counted here now, not as its own silu_mul
                    state.add_site(act, SWIGLU_CAT, SWIGLU_CAT)
                    if isinstance(act.__dict__.get(site_attr(SILU_MUL)), Site):
                        state.set_attr(act, site_attr(SILU_MUL), None)


def swap_rewritten(state: PatchState, model: nn.Module, swaps: dict[type, tuple[type | None, Rewrite | None]]) -> None:
    """Swap every module of `model` whose exact class is a key of `swaps` for its `fused_subclass`, with its sites
    (a class that had nothing to rewrite maps to ``(None, None)`` and stays)."""
    for module in model.modules():
        if type(module) not in swaps:
            continue
        fused, found = swaps[type(module)]
        if fused is None:
            warn_nothing_to_fuse(type(module), "forward")
            continue
        state.swap_class(module, fused)
        add_chain_sites(state, module, found)


def warn_nothing_to_fuse(cls: type, method: str = "forward") -> None:
    warn_once(f"diffusers_fastpath: found no chain to fuse in the installed {cls.__qualname__}.{method} (its source "
              "is unreadable or has changed); it stays unpatched: exact, no speedup")


def add_chain_sites(state: PatchState, block: nn.Module, found: Rewrite) -> None:
    """The sites the rewritten forward of `block` counts on: one `gated_residual` per gate, one LayerNorm +
    modulate per norm (with the ``"high"`` tier's LayerNorm-affine site on the same norm)."""
    for gate in found.gates:
        state.add_site(block, GATED_RESIDUAL, gate)
    for gate in found.gates_fp32:
        state.add_site(block, GATED_RESIDUAL_FP32, gate)
    for target in found.modulates:
        state.add_site(block, MODULATE_ONLY, f"{MODULATE_ONLY}_{target}")
    if found.gelu_cat:
        state.add_site(block, GELU_CAT, GELU_CAT)
    if found.silu_mul:
        state.add_site(block, SILU_MUL, SILU_MUL)
    for op, attrs in ((RMS_SCALE, found.rms_scales), (RMS_GATED, found.rms_gated)):
        for attr in attrs:
            if type(getattr(block, attr, None)) is RMSNorm:
                state.add_site(getattr(block, attr), op, op)
    for attr in found.norms_fp32:
        if isinstance(getattr(block, attr), nn.LayerNorm):
            state.add_site(getattr(block, attr), MODULATE_FP32)
    for attr in found.affine_fp32:  # an nn.Identity where the model has no such norm (Wan's cross_attn_norm=False)
        norm = getattr(block, attr)
        if type(norm) is FP32LayerNorm and norm.weight is not None and norm.bias is not None:
            state.add_site(norm, AFFINE_FP32)
    for attr in found.norms:
        norm = getattr(block, attr)
        if type(norm) is RMSNorm:  # LTX-Video's weightless norms: `rmsnorm_modulate` where the rows form took them
            state.add_site(norm, RMS_MODULATE)
        elif isinstance(norm, nn.LayerNorm):  # (SD3's last block's norm2_context is None: never reached)
            state.add_site(norm, MODULATE)
