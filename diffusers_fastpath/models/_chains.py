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
is the original's. Where a rewrite moves a computation (a LayerNorm that waits for its modulate) or no longer binds
a name (the product of a two-statement gated residual), `_chain_proofs` proves from the forward's AST that nothing
in between writes what it reads and nothing afterwards reads the name, or the statements stay as written.

What is rewritten is the function the class holds when a model is patched: a library may replace a block's
``forward`` after this package is imported (``Flux2TransformerBlock.forward = ...``), or wrap it with
``functools.wraps`` (whose ``inspect.getsource`` is the wrapped function's), or the source file may be edited on disk
after diffusers was imported (``inspect.getsource`` reads the file now). So the source read is *proven* to be the
function's (`_source.source_of`: the text compiles to the function's own code object), and `rewrite_of` makes
the rewrite again, at patch time, for whatever function the class holds then; what cannot be proven runs as it is,
unswapped, with a note in `report` and one warning (issue 43 found each before: a replaced FLUX.2 block forward
discarded, max diff 0.89; a wrapped FLUX.1 one, 0.20; an edited file rewritten from its new text, 1.98;
`tests/test_chains.py` has each).

The rewriter's parts: this one (reading, rewriting and compiling a forward; the subclasses and their
sites), `_chain_inline` (helper functions of the forward's module inlined first, where that is exactly the call:
one-expression helpers there, helpers called as a whole statement in `_chain_inline_stmts`),
`_rewriter` (the patterns: which statements a forward has and what replaces them, documented there; the
LayerNorm + modulate ones in `_rewriter_norms`, an attention processor's in `_rewriter_attention`),
`_chain_proofs` (what a rewrite that moves or drops anything must prove, and that a source is its function's),
`_chain_syntax` (what each pattern's statements look like, as AST) and `_chain_calls` (what the rewritten forwards
call at run time).

The generated source is registered with `linecache`, so tracebacks and ``inspect.getsource`` show the rewritten
lines. The adapters make their subclasses when they are imported, one object per name (rewritten again in place
when the class's function changes), so pickles of patched models find them by name in any process.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import hashlib
import inspect
import itertools
import linecache
import sys
import textwrap
from collections.abc import Callable

import torch
import torch.nn.functional as F
from diffusers.models.normalization import FP32LayerNorm, RMSNorm
from torch import nn

from .._logging import warn_once
from .._state import PatchState, site_attr
from ..ops import Site
from ..ops.layernorm_modulate import LAYERNORM_MODULATE
from ..ops.rms_norm_modulate_rows import RMS_NORM_MODULATE_ROWS
from ..ops.zero_centred_modulate import ZERO_CENTRED_MODULATE
from ._norm_methods import FUSED as _NORM_FUSED, GATED_SITE, gated_norm_methods, lazy_gates
from ..ops.gated_layernorm_scale_rows import GATED_LAYERNORM_SCALE_ROWS
from ._chain_index_rows import lazy_index_rows
from ._chain_token_rows import lazy_token_rows
from ._chain_calls import SWIGLU_MODULES, _ChainsNamespace, _other_layernorm, register_original, set_owner
from ._chain_inline import Inliner
from .._source import source_of
from ._chain_proofs import Proofs
from ._chain_qk_fp32 import QK_NORM_ROPE_FP32, QK_NORM_ROPE_ZERO_CENTRED, is_zero_centred
from ._chain_rotary_matrix import ROTARY_MATRIX
from ._chain_rotary_matrix import known_names as matrix_known_names
from ._chain_rotate_half import QK_NORM_ROTARY_HALF, ROTARY_HALF, ROTARY_HALF_PARTIAL, known_names
from ._chain_syntax import _NS, _diffusers_rotary, _local_def
from ._rewriter import (AFFINE_FP32, GATED_RESIDUAL, GATED_RESIDUAL_FP32, GELU_CAT, MODULATE, MODULATE_FP32,
                        MODULATE_ONLY, NORM_MODULATE_LATER, RMS_GATED, RMS_MODULATE, RMS_SCALE, SILU_MUL, SWIGLU_CAT,
                        Rewrite, _Rewriter)
from ._rewriter_attention import (ATTENTION_BOOL_MASK, ATTENTION_GQA, ATTENTION_SEQ_MAJOR, CAT_HEADS, QK_NORM_ROPE, QK_NORM_ROWS, QK_NORM_ROWS_PAIR,
                                  RMSNORM_ROPE, RMSNORM_ROPE_CAT, RMSNORM_ROPE_PREFIX, RMSNORM_ROPE_REAL, ROTARY,
                                  LINEAR_PREFIX,
                                  SIGMOID_MUL)

_SCALE_ROWS = _NORM_FUSED["scale_rows"][0]  # the fused name whose gates `lazy_gates` may keep as rows


def rewrite_forward(fn, qualname: str, norm_methods: dict[str, str] | None = None,
                    activations: tuple[str, ...] = (), rms_norms: tuple[str, ...] = (),
                    swiglus: tuple[str, ...] = (), complex_rotary: str | None = None,
                    local_rotary: tuple[str, str] | None = None, head_cats: bool = False,
                    rows_rotary: str | None = None,
                    wan_rotary: tuple[str, str] | None = None,
                    contiguous: tuple[str, ...] = (), norms: tuple[str, ...] = (),
                    bool_masks: bool = False) -> tuple[object, Rewrite] | None:
    """`fn` (a block's ``forward`` or a processor's ``__call__``) with its chains routed through the fused ops, and
    what was found; or ``None`` where its source is not provably `fn`'s (`_source.source_of`: a wrapper, a
    replaced function, a file edited since the import), it needs a closure (``super()``), or no pattern matched.
    `norm_methods` maps a modulate method of the block to its fused counterpart (see `_rewriter`). `contiguous`
    names parameters (the residual stream) that the rewritten forward takes in memory order first
    (`_ChainsNamespace.contiguous`: a transposed token view, which the fused kernels refuse, is copied once), where
    that can change no value (`_layout_free`: the forward writes nothing in place and reads the stream only through
    the norms `norms` (attributes of the block), elementwise arithmetic it assigns back to the stream, and its
    shape or dtype; a Linear or an attention reading the stream itself can round differently by layout)."""
    source, _ = source_of(fn)
    if source is None or fn.__code__.co_freevars:
        return None
    source = textwrap.dedent(source)
    tree = ast.parse(source)
    (func,) = tree.body
    if not isinstance(func, ast.FunctionDef):
        return None
    if any(isinstance(n, ast.Name) and n.id == _STALE_LOCAL for n in ast.walk(func)):
        return None  # the prologue's local (`_stale_check`) would be this forward's own name
    func.decorator_list = []  # the function is wrapped below, never re-decorated
    for arg in (*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs, func.args.vararg, func.args.kwarg):
        if arg is not None:
            arg.annotation = None  # `fn`'s own annotations are copied below, not evaluated again
    func.returns = None
    params = [a.arg for a in func.args.args]
    owner = params[1] if len(params) > 1 and params[0] == "self" and func.name == "__call__" else "self"
    if "F.silu" in activations and fn.__globals__.get("torch") is torch:  # ... or written out (MiniMax-Music 3)
        activations = (*activations, "torch.nn.functional.silu")
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
    rotary_ok = _diffusers_rotary(fn, func) and local is None
    # what the proofs read: the forward as written (`func` is rewritten); the rotary functions checked above write
    # nothing (diffusers' apply_rotary_emb; those the adapter names, checked by digest before their calls are fused)
    checked = {n for n in (complex_rotary, rows_rotary, wan, "apply_rotary_emb" if rotary_ok else None) if n}
    # helper functions of the forward's module inlined first (`_chain_inline`), never one a pattern takes by name;
    # the proofs then read the forward as it will run
    written_body = func.body
    # a processor's matrix-form rotary functions (`_chain_rotary_matrix`): called by name, never inlined
    matrix_names = matrix_known_names(fn, func) if owner != "self" else (frozenset(), frozenset())
    exclude = frozenset({*checked, "apply_rotary_emb", *(n for n in (complex_rotary, rows_rotary) if n),
                         *matrix_names[0]})
    made = []  # (rewriter, body, proofs, inliner): with helpers inlined (where any is), then as written
    for inline in (True, False):
        written = ast.parse(source).body[0]
        inliner = Inliner(fn, written, Proofs(written, {"self", owner}, frozenset(checked)), exclude)
        if inline:
            if (written := inliner.run()) is inliner.function:
                continue
        func.body = copy.deepcopy(written.body) if inline else written_body
        proofs = Proofs(written, {"self", owner}, frozenset(checked))
        proofs.tag(func.body)
        rewriter = _Rewriter(owner, rotary_ok, norm_methods, activations, rms_norms,
                             swiglus, complex_rotary, local is not None, head_cats and owner != "self",
                             rows_rotary if owner != "self" else None, wan if owner != "self" else None, proofs=proofs)
        if owner != "self":  # a processor's rotary forms: the functions they may call (by digest)
            rewriter.rotate_halves, rewriter.partial_rotaries = known_names(fn, func)
            rewriter.matrix_rotaries = matrix_names
        body = rewriter.body(copy.deepcopy(func.body), func)
        if rewriter.block and _SCALE_ROWS in (norm_methods or {}).values():
            rewriter.found.lazy_gates = lazy_gates(body, _SCALE_ROWS, "gated_residual", _NS, proofs)
        if rewriter.block:
            rewriter.found.index_rows += lazy_index_rows(body, _NS)  # (with the norm + modulate pairs' own)
            rewriter.found.token_rows = lazy_token_rows(body, _NS, proofs, fn.__globals__)
        if rewriter.block and _SCALE_ROWS in (norm_methods or {}).values():  # after `lazy_gates`: its gates' form
            rewriter.found.gated_norms = gated_norm_methods(body, _SCALE_ROWS, _NS, proofs)
        if rewriter.found.head_cats:
            body = rewriter.seq_major_attention(body)
        if not rewriter.block:
            body = rewriter.gqa_attention(body)
            if bool_masks:  # (the generic path's processors: `generic.generic_subclass`)
                body = rewriter.bool_mask_attention(body)
        if not rewriter.block and (rewriter.found.rotary or rewriter.found.rotary_complex or rewriter.found.rotary_named
                                   or rewriter.found.rotary_half_partial):
            body = rewriter.qk_norms(body)
        if not rewriter.block:  # (after the QK-norm form, whose pending norms read the value's ``.dtype``)
            body = rewriter.prefix_linears(body)
        # inlined only where that lets a pattern take more, and every norm the inlining took on trust is fused
        if not inline or inliner.proven(body):
            made.append((rewriter, body, proofs, inliner))
    if len(made) == 2 and _reach(made[0][0].found) <= _reach(made[1][0].found):
        del made[0]
    rewriter, func.body, proofs, inliner = made[0]  # (the forward as written: an inliner that inlined nothing)
    if not rewriter.found:
        return None
    taken = [p for p in contiguous if p in params and _layout_free(proofs.function, p, norms)]
    func.body[:0] = [ast.parse(f"{p} = {_NS}.contiguous({p})").body[0] for p in taken]
    if inliner.helpers:
        rewriter.found.inlined = sorted(inliner.helpers)
    # the forward as written while the model runs so (the verification's reference run), and wherever its module holds
    # another function under an inlined helper's name
    key = register_original(fn, inliner.helpers)
    func.body[:0] = [_stale_check(func, key)]
    ast.fix_missing_locations(tree)
    text = ast.unparse(tree) + "\n"
    filename = f"<diffusers_fastpath: {qualname}, rewritten from {inspect.getsourcefile(fn)}:{next(_REWRITES)}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace: dict = {}
    module_globals = fn.__globals__
    module_globals.setdefault(_NS, _ChainsNamespace)
    exec(compile(text, filename, "exec"), module_globals, namespace)  # noqa: S102 (diffusers' own source, rewritten)
    new = namespace[func.name]
    new.__qualname__ = qualname
    new.__doc__ = fn.__doc__
    new.__defaults__, new.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__  # the objects, not evaluated again
    new.__annotations__ = dict(fn.__annotations__)
    new._fastpath_original_key = key  # its owner is set when a subclass takes it (`rewrite_of`: `set_owner`)
    return new, rewriter.found


def _reach(found: Rewrite) -> int:
    """How much a rewrite fuses: its sites and forms, counted."""
    return sum(len(v) if isinstance(v, list) else int(v) for k, v in dataclasses.asdict(found).items() if k != "inlined")


_STALE_LOCAL = "_fastpath_written_forward"  # the local the check below binds (a forward using that name: no rewrite)


def _stale_check(func: ast.FunctionDef, key: int) -> ast.stmt:
    """``if (F := stale(key, self)) is not None: return F(<the parameters, as bound>)``: the original forward, called
    with the very objects its parameters hold (defaults included), while the model runs as written (the
    verification's reference run), on a module no longer patched (a hook holds the bound rewrite), or where an
    inlined helper was replaced."""
    args = func.args
    positional = [ast.Name(a.arg, ast.Load()) for a in (*args.posonlyargs, *args.args)]
    if args.vararg is not None:
        positional.append(ast.Starred(ast.Name(args.vararg.arg, ast.Load()), ast.Load()))
    keywords = [ast.keyword(arg=a.arg, value=ast.Name(a.arg, ast.Load())) for a in args.kwonlyargs]
    if args.kwarg is not None:
        keywords.append(ast.keyword(arg=None, value=ast.Name(args.kwarg.arg, ast.Load())))
    first = (positional[0] if positional and isinstance(positional[0], ast.Name)  # self: the block, or the processor
             else ast.Constant(None))
    test = ast.Compare(left=ast.NamedExpr(target=ast.Name(_STALE_LOCAL, ast.Store()), value=ast.Call(
        func=ast.Attribute(ast.Name(_NS, ast.Load()), "stale", ast.Load()), args=[ast.Constant(key), first],
        keywords=[])),
        ops=[ast.IsNot()], comparators=[ast.Constant(None)])
    call = ast.Call(func=ast.Name(_STALE_LOCAL, ast.Load()), args=positional, keywords=keywords)
    return ast.If(test=test, body=[ast.Return(value=call)], orelse=[])


_ELEMENTWISE = (ast.Add, ast.Sub, ast.Mult, ast.Div)
_CASTS = ("float", "to", "type_as", "contiguous")  # keep the values (and the layout) of what they are called on
_META = ("shape", "dtype", "device", "ndim", "size", "dim")


def _layout_free(func: ast.FunctionDef, name: str, norms: tuple[str, ...]) -> bool:
    """Whether the values `func` computes cannot depend on the memory layout of the tensor its parameter `name`
    holds, nor of what it rebinds `name` to: the body writes nothing in place, and every read of `name` is its shape,
    dtype or device, the argument of a norm ``self.N(...)`` (N in `norms`: a LayerNorm, which normalises a contiguous
    copy; never an RMSNorm, whose reduction and products run over x as laid out and keep its layout), the operand of elementwise arithmetic (through casts) whose result is assigned
    back to `name`, or ``return name``. Conservative: any other read (a Linear, an attention, a concatenation, a
    reshape) and it is not."""
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(func):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
        if isinstance(node, (ast.AugAssign, ast.Delete)) or (
                isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, ast.Store)):
            return False
        if isinstance(node, ast.Call) and ((isinstance(node.func, ast.Attribute) and node.func.attr.endswith("_")
                                            and not node.func.attr.startswith("_"))
                                           or any(k.arg in ("out", "inplace") for k in node.keywords)):
            return False
    for node in ast.walk(func):
        if not (isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load)):
            continue
        value = node
        parent = parents.get(id(value))
        while (isinstance(parent, ast.Attribute) and parent.attr in _CASTS and isinstance(parents.get(id(parent)), ast.Call)
               and parents[id(parent)].func is parent):  # ``x.float()``, ``x.to(dtype)``: the same layout, on
            value = parents[id(parent)]
            parent = parents.get(id(value))
        if isinstance(parent, ast.Attribute) and parent.attr in _META:
            continue
        if isinstance(parent, ast.Call) and value in parent.args and any(
                isinstance(f, ast.Attribute) and f.attr in ("type_as", "to") for f in [parent.func]):
            continue  # ``y.type_as(x)``, ``y.to(x.dtype)``: x's dtype only
        if (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute) and parent.func.attr in norms
                and isinstance(parent.func.value, ast.Name) and parent.func.value.id == "self" and parent.args
                and parent.args[0] is value):
            continue
        if isinstance(parent, ast.Return) or (isinstance(parent, ast.BinOp) and isinstance(parent.op, _ELEMENTWISE)
                                             and _assigned_back(parent, parents, name)):
            continue
        return False
    return True


def _assigned_back(expr: ast.AST, parents: dict, name: str) -> bool:
    """Whether elementwise `expr` (through more elementwise arithmetic and casts) is what a statement assigns to
    `name` itself."""
    node = expr
    while True:
        parent = parents.get(id(node))
        if isinstance(parent, ast.BinOp) and isinstance(parent.op, _ELEMENTWISE):
            node = parent
        elif isinstance(parent, ast.Attribute) and parent.attr in _CASTS and isinstance(parents.get(id(parent)), ast.Call):
            node = parents[id(parent)]
        else:
            return (isinstance(parent, ast.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0], ast.Name)
                    and parent.targets[0].id == name and parent.value is node)


_REWRITES = itertools.count()  # each rewrite's source has a file name of its own (linecache, tracebacks)


@dataclasses.dataclass(eq=False)
class _Spec:
    """How a `fused_subclass` is rewritten: from `base`'s `method` as the class holds it (at import, and again
    wherever it holds another function when a model is patched: `rewrite_of`)."""

    base: type
    method: str
    module: str
    options: dict  # rewrite_forward's keyword arguments
    norm_methods: dict  # modulate method -> (fused name, fused function)
    modulates: dict  # modulate method -> the function `base` held for it when the adapter vouched for it
    held: tuple = (None,)  # (function, modulates) the subclass's method was last made from
    why: str = ""  # why the held function is not rewritten (report, warning)
    made: dict = dataclasses.field(default_factory=dict)  # (function, kept modulates) -> (rewritten, found, why)

    def make(self, name: str, fn, kept: dict) -> tuple:
        """``(rewritten function, found, "")``, or ``(None, None, why)``, for the function `fn`, cached per function."""
        key = (fn, tuple(kept))
        if key not in self.made:
            source, why = source_of(fn)
            try:
                rewritten = rewrite_forward(fn, f"{name}.{self.method}", kept, **self.options) if source else None
            except Exception as exc:  # noqa: BLE001 - a rewriter that fails leaves the forward as it is, and says so
                rewritten, source, why = None, None, f"could not be rewritten ({type(exc).__name__}: {exc})"
            if rewritten is not None:
                rewritten[0].__module__ = self.module
            elif source is not None:
                why = "has no chain the rewriter fuses" + (" (it calls super())" if fn.__code__.co_freevars else "")
            self.made[key] = (*(rewritten or (None, None)), why)
        return self.made[key]


_SPECS: dict[type, _Spec] = {}
_NAMED: dict[tuple[str, str], type] = {}  # (module, name) -> the subclass made under that name


def fused_subclass(cls: type, name: str, module: str, method: str = "forward",
                   norm_methods: dict[str, tuple[str, object]] | None = None,
                   activations: tuple[str, ...] = (), rms_norms: tuple[str, ...] = (),
                   swiglus: tuple[str, ...] = (), complex_rotary: str | None = None,
                   local_rotary: tuple[str, str] | None = None,
                   head_cats: bool = False, rows_rotary: str | None = None,
                   wan_rotary: tuple[str, str] | None = None,
                   contiguous: tuple[str, ...] = (), norms: tuple[str, ...] = (),
                   bool_masks: bool = False) -> tuple[type, Rewrite] | tuple[None, None]:
    """A subclass of the diffusers block (or attention processor, ``method="__call__"``) `cls`, named `name` and
    defined in (and set as an attribute of) the adapter module `module`, whose `method` is the one `cls` holds now
    with its chains fused, and what was rewritten; ``(None, None)`` where nothing can be (`swap_rewritten` and
    `replace_processors` say why, once, when a model has it).

    The rewrite comes from the function `cls` holds when a model is patched, not only from the one it held here:
    `swap_rewritten`, `replace_processors` (and an adapter that needs what was found, through `rewrite_of`) make it
    again where `cls` holds another function since (a library that replaced the forward after this import), cached
    per function. A function whose source is not provably its own (`_source.source_of`: a ``functools.wraps``
    wrapper, a closure, a file edited since the import) or in which no pattern matches is never rewritten: the
    subclass then has no `method` of its own and runs `cls`'s as it is, and no module is swapped to it. The subclass
    stays one object per `name` (a second call with the same arguments returns it), so that pickles of patched
    models find it by name, in this process and in a fresh one, and ``copy.deepcopy`` keeps it.

    `norm_methods` maps a modulate method of `cls` to ``(name, function)``, the fused counterpart the subclass gets
    (the LayerNorm-into-method pattern of `_rewriter`), taken only while `cls` holds the method it holds here (the one
    the adapter checked); `activations` names the attributes of `cls` that the SwiGLU form may take as its SiLU;
    `rms_norms` those the sandwich-norm forms may take as diffusers' RMSNorm; `swiglus` (a processor's) the
    attention module's attributes the SwiGLU + concatenation form may take; `complex_rotary` (a processor's) the name
    of its module's complex-form rotary function (`register_complex_rotary`); `local_rotary` ``(name, digest)``: one
    the forward defines itself, taken where its normalised source (``ast.unparse``) has that sha256 digest prefix;
    `head_cats` (a processor's) takes its ``torch.cat([A, B], dim=2)`` of two names (SD3's joint q, k and v of
    ``[B, H, S, D]``) as the fused `cat_heads`; `rows_rotary` (a processor's) the name of its module's rows-form
    rotary function (`register_rows_rotary`: LTX-Video's); `wan_rotary` ``(name, digest)``: Wan's, a function the
    processor defines, taken where its normalised source has that digest; `bool_masks` (a processor's) hands its
    ``dispatch_attention_fn`` calls' boolean masks to torch in their additive form, made once per forward
    (`attention_bool_mask`)."""
    norm_methods = dict(norm_methods or {})
    options = dict(activations=activations, rms_norms=rms_norms, swiglus=swiglus, complex_rotary=complex_rotary,
                   local_rotary=local_rotary, head_cats=head_cats, rows_rotary=rows_rotary, wan_rotary=wan_rotary,
                   contiguous=contiguous, norms=norms, bool_masks=bool_masks)
    sub = _NAMED.get((module, name))
    spec = _SPECS.get(sub)
    if spec is None or (spec.base, spec.method, spec.options, spec.norm_methods) != (cls, method, options,
                                                                                       norm_methods):
        spec = _Spec(cls, method, module, options, norm_methods, {m: getattr(cls, m, None) for m in norm_methods})
        if spec.make(name, getattr(cls, method, None), {m: f for m, (f, _) in norm_methods.items()})[1] is None:
            return None, None  # (no class: nothing refers to it)
        extra = {fused_name: fused for fused_name, fused in norm_methods.values()}
        sub = type(name, (cls,), {**extra, "__module__": module, "__qualname__": name, "_fastpath_rewrite": None})
        _SPECS[sub], _NAMED[(module, name)] = spec, sub
        if module in sys.modules:  # an attribute of its module from the start, so that pickles find it by name
            setattr(sys.modules[module], name, sub)
    found = rewrite_of(sub)
    return (sub, found) if found is not None else (None, None)


def rewrite_of(sub: type) -> Rewrite | None:
    """What the `fused_subclass` `sub` rewrote in the function its base class holds *now* (made again where that is
    not the one it was last made from), or None where that function runs as it is (`why_unrewritten` says why).

    The subclass is one object, so models patched before run the new function too, from here on: what their
    unpatched twins run (a site the new rewrite counts on and they lack counts nothing: ``getattr(..., None)``). A
    function replaced after the last `patch` (or this call) is seen at the next one."""
    spec = _SPECS[sub]
    fn = getattr(spec.base, spec.method, None)
    modulates = tuple(getattr(spec.base, m, None) for m in spec.norm_methods)
    if (fn, modulates) != spec.held:
        kept = {m: fused for (m, (fused, _)), held in zip(spec.norm_methods.items(), modulates)
                if held is spec.modulates[m]}  # a modulate method replaced since the adapter checked it: as written
        new, found, spec.why = spec.make(sub.__name__, fn, kept)
        spec.held = (fn, modulates)
        if new is not None:
            setattr(sub, spec.method, new)
            set_owner(new._fastpath_original_key, sub)
        elif spec.method in sub.__dict__:
            delattr(sub, spec.method)  # the subclass (of models patched before) runs the base's function as it is
        sub._fastpath_rewrite = found
        sub.__doc__ = _doc(spec, found)
    return sub.__dict__["_fastpath_rewrite"]


def why_unrewritten(sub: type | None, cls: type | None = None, method: str = "forward") -> str:
    """Why `rewrite_of(sub)` is None (`sub` None: why `fused_subclass` of `cls` gave none): what is wrong with the
    function the base class holds."""
    if sub is not None:
        spec = _SPECS[sub]
        return f"{spec.base.__qualname__}.{spec.method} {spec.why}"
    source, why = source_of(getattr(cls, method, None))
    return f"{cls.__qualname__}.{method} {why if source is None else 'has no chain the rewriter fuses'}"


def _doc(spec: _Spec, found: Rewrite | None) -> str:
    head = f"diffusers' ``{spec.base.__qualname__}``"
    if found is None:
        return f"{head} as it is: its ``{spec.method}`` {spec.why} (`diffusers_fastpath.models._chains`)."
    return (f"{head} with the chains of its installed ``{spec.method}`` fused "
            f"(`diffusers_fastpath.models._chains`): gated residuals {found.gates or '-'} (fp32: "
            f"{found.gates_fp32 or '-'}), LayerNorm + modulate of {found.norms or '-'} (fp32: {found.norms_fp32 or '-'}), "
            f"norm call + modulate of {[a for a, _ in found.norm_modulates] or '-'}, "
            f"fp32 affine LayerNorm of {found.affine_fp32 or '-'}, "
            f"rotary embeddings {found.rotary}, GELU + concatenation {found.gelu_cat}, SiLU-gated product "
            f"{found.silu_mul}, RMSNorm + scale of {found.rms_scales or '-'}, RMSNorm + gated residual of "
            f"{found.rms_gated or '-'}, SwiGLU + concatenation of {found.swiglu_cats or '-'}, complex rotary "
            f"{found.rotary_complex}, named-form rotary {found.rotary_named}, head concatenations {found.head_cats}, "
            f"sigmoid output gates {found.sigmoid_mul}. Adds no "
            "state beyond the fusion sites.")


def rewritten_for(state: PatchState, sub: type | None, cls: type, method: str = "forward") -> Rewrite | None:
    """`rewrite_of(sub)` when a model holding `cls` modules is patched (`sub` its `fused_subclass`, None where that
    gave none); where that is None, a note for `report` and one warning say why."""
    found = rewrite_of(sub) if sub is not None else None
    if found is None:
        note = f"{why_unrewritten(sub, cls, method)}: it runs as it is (exact, no speedup)"
        if note not in state.notes:
            state.notes.append(note)
        warn_once(f"diffusers_fastpath: {note}")
    return found


def replace_processors(state: PatchState, model: nn.Module, attention_cls: type, default_cls: type,
                       fused_cls: type | None, attribute: str | None = None) -> None:
    """Give every `attention_cls` module of `model` running diffusers' `default_cls` the rewritten `fused_cls`
    (`fused_subclass` of it, ``method="__call__"``, rewritten from the ``__call__`` `default_cls` holds now) and its
    ``rotary_emb`` site; others are left and noted. With `attribute`, only the modules that are that attribute of
    their parent (``"attn1"``: the self-attentions of LTX-Video's and Wan's blocks, the only ones called with a
    rotary table)."""
    if not any(type(getattr(m, "processor", None)) is default_cls for m in model.modules()):
        return
    found = rewritten_for(state, fused_cls, default_cls, "__call__")
    if found is None:
        return
    where = None
    if attribute is not None:
        chosen = {id(m._modules[attribute]) for m in model.modules() if attribute in m._modules}
        where = lambda module: id(module) in chosen  # noqa: E731
    state.replace_processors(model, attention_cls, default_cls, fused_cls, where)
    qk = bool(found.qk_norms)
    for module in model.modules():
        if isinstance(module, attention_cls) and type(module.processor) is fused_cls:
            norm = type(getattr(module, "norm_q", None)) if qk else None  # what `norm_later` defers, by its type
            if found.rotary or found.rotary_named:
                state.add_site(module, ROTARY, name=ROTARY)
            if found.rotary_half:  # Ideogram 4's, Cosmos 3's rotate-half form (`_chain_rotate_half`)
                state.add_site(module, ROTARY_HALF, name=ROTARY_HALF)
            if found.rotary_half_partial:  # MiniMax-H3's
                state.add_site(module, ROTARY_HALF_PARTIAL, name=ROTARY_HALF_PARTIAL)
                if norm is nn.RMSNorm:  # ... with its QK norms, each head's, in one op
                    state.add_site(module, QK_NORM_ROTARY_HALF, name=QK_NORM_ROTARY_HALF)
            if found.rotary_matrix:  # Kandinsky 5's and 6's matrix form (`_chain_rotary_matrix`)
                state.add_site(module, ROTARY_MATRIX, name=ROTARY_MATRIX)
            if found.rotary and found.qk_fp32:  # FLUX.3's float32 QK norms (`_chain_qk_fp32`)
                state.add_site(module, QK_NORM_ROPE_FP32, name=QK_NORM_ROPE_FP32)
            elif found.rotary:
                if norm is nn.RMSNorm:
                    state.add_site(module, QK_NORM_ROPE, name=QK_NORM_ROPE)
                elif norm is RMSNorm:
                    state.add_site(module, RMSNORM_ROPE_REAL, name=RMSNORM_ROPE_REAL)
                elif qk and is_zero_centred(module.norm_q):  # Krea 2's: counted by its own op at the qk site
                    state.add_site(module, QK_NORM_ROPE_ZERO_CENTRED, name=QK_NORM_ROPE)
            if found.rotary_named and norm is nn.RMSNorm:  # LTX-Video's and Wan's norms across all heads
                if found.rows_pairs:  # LTX-Video's q and k as one call
                    state.add_site(module, QK_NORM_ROWS_PAIR, name=QK_NORM_ROWS_PAIR)
                if found.rotary_named > 2 * found.rows_pairs:
                    state.add_site(module, QK_NORM_ROWS, name=QK_NORM_ROWS)
            if found.rotary_complex and norm is RMSNorm:
                state.add_site(module, RMSNORM_ROPE, name=RMSNORM_ROPE)
                if found.rotary_cats:  # the streams' q and k written into their concatenations (Qwen-Image)
                    state.add_site(module, RMSNORM_ROPE_CAT, name=RMSNORM_ROPE_CAT)
                if found.prefix_cats:  # a key written after its cached prefix (Qwen-Image 2.1's cached steps)
                    state.add_site(module, RMSNORM_ROPE_PREFIX, name=RMSNORM_ROPE_PREFIX)
            if found.prefix_linears:  # a value projection written after its cached prefix (Qwen-Image 2.1)
                state.add_site(module, LINEAR_PREFIX, name=LINEAR_PREFIX)
            if found.head_cats:
                state.add_site(module, CAT_HEADS, name=CAT_HEADS)
            if found.seq_major_attention:
                state.add_site(module, ATTENTION_SEQ_MAJOR, name=ATTENTION_SEQ_MAJOR)
            if found.gqa_attention:
                state.add_site(module, ATTENTION_GQA, name=ATTENTION_GQA)
            if found.bool_masks:  # Ideogram 4's block-diagonal mask, made additive once per forward
                state.add_site(module, ATTENTION_BOOL_MASK, name=ATTENTION_BOOL_MASK)
            if found.sigmoid_mul:  # Krea 2's output gate (one site for every such product of the processor)
                state.add_site(module, SIGMOID_MUL, name=SIGMOID_MUL)
            for attr in found.swiglu_cats:
                act = getattr(module, attr, None)
                if type(act) in SWIGLU_MODULES:  # its SwiGLU is counted here now, not as its own silu_mul
                    state.add_site(act, SWIGLU_CAT, SWIGLU_CAT)
                    if isinstance(act.__dict__.get(site_attr(SILU_MUL)), Site):
                        state.set_attr(act, site_attr(SILU_MUL), None)


def swap_rewritten(state: PatchState, model: nn.Module, swaps: dict[type, tuple[type | None, Rewrite | None]],
                   where: Callable[[nn.Module], bool] | None = None) -> None:
    """Swap every module of `model` whose exact class is a key of `swaps` (and that `where` accepts, if given) for
    its `fused_subclass` (the first of the value; the second, what was found at import, is not read: the rewrite is
    made from the ``forward`` the class holds now), with its sites; a class whose forward cannot be rewritten
    (``(None, None)``, or `rewrite_of`) stays, with a note and one warning."""
    found: dict[type, Rewrite | None] = {}
    for module in model.modules():
        cls = type(module)
        if cls not in swaps or (where is not None and not where(module)):
            continue
        if cls not in found:
            found[cls] = rewritten_for(state, swaps[cls][0], cls)
        if found[cls] is not None:
            state.swap_class(module, swaps[cls][0])
            add_chain_sites(state, module, found[cls])


def add_chain_sites(state: PatchState, block: nn.Module, found: Rewrite) -> None:
    """The sites the rewritten forward of `block` counts on: one `gated_residual` per gate, one LayerNorm +
    modulate per norm (with the ``"high"`` tier's LayerNorm-affine site on the same norm)."""
    for gate in found.gates:
        state.add_site(block, GATED_RESIDUAL, gate)
    for gate in found.gates_fp32:
        state.add_site(block, GATED_RESIDUAL_FP32, gate)
    for target in found.modulates:
        state.add_site(block, MODULATE_ONLY, f"{MODULATE_ONLY}_{target}")
    for attr, target in found.norm_modulates:  # the norm and its modulate in one kernel where the norm is Krea 2's
        norm = getattr(block, attr, None)  # or torch's RMSNorm (with rows read through an index: MiniMax-H3's)
        if is_zero_centred(norm):
            state.add_site(norm, ZERO_CENTRED_MODULATE.name, NORM_MODULATE_LATER)
        elif type(norm) is nn.RMSNorm:
            state.add_site(norm, RMS_NORM_MODULATE_ROWS.name, NORM_MODULATE_LATER)
        else:  # its call, then the modulate (`modulate_rows`)
            state.add_site(block, MODULATE_ONLY, f"{MODULATE_ONLY}_{target}")
    if found.gelu_cat:
        state.add_site(block, GELU_CAT, GELU_CAT)
    if found.silu_mul:
        state.add_site(block, SILU_MUL, SILU_MUL)
    for op, attrs in ((RMS_SCALE, found.rms_scales), (RMS_GATED, found.rms_gated)):
        for attr in attrs:
            if type(getattr(block, attr, None)) is RMSNorm:
                state.add_site(getattr(block, attr), op, op)
    for attr in found.norms_fp32:  # (a dotted path: Kandinsky 6's fused block calls its submodules' norms)
        norm = _submodule(block, attr)
        if isinstance(norm, nn.LayerNorm):
            state.add_site(norm, MODULATE_FP32)
    for attr in found.affine_fp32:  # an nn.Identity where the model has no such norm (Wan's cross_attn_norm=False)
        norm = getattr(block, attr)
        if type(norm) is FP32LayerNorm and norm.weight is not None and norm.bias is not None:
            state.add_site(norm, AFFINE_FP32)
    for attr in found.gated_norms:  # a gated update joined with the scale-rows method's norm of its result
        norm = getattr(block, attr, None)
        if isinstance(norm, nn.LayerNorm):
            state.add_site(norm, GATED_LAYERNORM_SCALE_ROWS.name, GATED_SITE)
    for attr in found.norms:
        norm = getattr(block, attr)
        if type(norm) is RMSNorm:  # LTX-Video's weightless norms: `rmsnorm_modulate` where the rows form took them
            state.add_site(norm, RMS_MODULATE)
        elif isinstance(norm, nn.LayerNorm):  # (SD3's last block's norm2_context is None: never reached)
            # named after the op its norm's kind runs (its calls rename it where they run another: `name_site`)
            state.add_site(norm, LAYERNORM_MODULATE.name if _other_layernorm(norm) else MODULATE)


def _submodule(block: nn.Module, path: str):
    """``block.a.b`` for the path ``"a.b"`` (None where an attribute is missing)."""
    for name in path.split("."):
        block = getattr(block, name, None)
    return block
