"""The generic path: a diffusers transformer with no family adapter, patched from what the model itself states, and
verified as a whole before it is trusted.

A family adapter names, for the rewriter (`_chains`), which of a block's attributes are diffusers' ``RMSNorm`` or a
SiLU, which function is its rotary embedding, and which classes to rewrite. Those are facts of the model, and this
adapter reads them from it:

- what to rewrite: every class of the model's modules that defines its own ``forward`` (blocks, adaLN modules,
  feed-forwards; not torch's own layers, not the model's class), and every attention processor class in use (its
  ``__call__``); a class whose installed code no pattern matches stays as it is;
- which attributes may be diffusers' ``RMSNorm`` (the sandwich-norm forms) or a SiLU (the SwiGLU form): those that
  are, in every instance of the class in this model;
- which rotary functions a processor calls: a module function (or one the processor defines) whose source, with its
  name set aside, is that of a rotary form this package has a kernel for, as installed and checked by the family
  adapters (`KNOWN_ROTARIES`): LTX-Video's rows form, Qwen-Image's complex form, Wan's and Z-Image's local forms.
  So a model that copies one of them ("Copied from" in diffusers) gets its kernel, and one that changes a character
  of it does not.
- which of a block's methods is a modulate method this package has a fused counterpart for (`_norm_methods`: Qwen-Image
  2.1's scale-only ``_modulate``), known the same way, by the digest of its installed code;
- which modules are diffusers' ``RMSNorm`` anywhere in the model: each runs as the fused, self-verified norm
  (`_qk_norms.patch_rmsnorms`; a chain that fuses the norm with what follows still does so).
- which modules are a zero-centred float32 RMSNorm (Krea 2's, by the digest of their forward): each runs as the
  fused, self-verified `zero_centred_rmsnorm` (`_qk_norms.patch_zero_centred_norms`).

Nobody has vouched for such a model by hand, so its first forward of each input signature runs both ways and is
compared bit for bit (`diffusers_fastpath.verify`); a mismatch unpatches it with one warning naming the first module
whose output differs.

Which classes are taken (`eligible`): diffusers ``ModelMixin`` transformers (and a user's own ``ModelMixin``
transformer) that hold repeated blocks, by diffusers' ``_repeated_blocks`` / ``_no_split_modules`` or a
``ModuleList`` of one block class with attention in it. UNets and autoencoders are not transformers: refused with
the reason.
"""

from __future__ import annotations

import ast
import base64
import copy
import hashlib
import importlib
import inspect
import json
import textwrap
import zlib

from diffusers.models.normalization import FP32LayerNorm, RMSNorm
from torch import nn

from .._logging import logger
from .._state import BACKEND_ATTRS, PatchState
from ..verify import Verifier, enabled
from ..ops.silu_mul import SILUS
from ._chain_pending import register_complex_rotary, register_rows_rotary
from ._chains import fused_subclass, replace_processors, swap_rewritten
from ._qk_norms import patch_rmsnorms, patch_zero_centred_norms
from .._source import definition, named_object, normalized_digest
from ._norm_methods import FUSED, norm_method_hints

GENERIC = "generic"  # what `coverage` says of a class patched this way


# --- the facts ------------------------------------------------------------------------------------------------------


def _form_digest(fn_or_def) -> str | None:
    """`normalized_digest` of a function's definition without its annotations, which change nothing it computes
    (LTX-2's ``apply_interleaved_rotary_emb`` is LTX-Video's ``apply_rotary_emb`` with annotated parameters): the
    same for an annotated copy, different for any change of its code; None where its source is not provably its
    own."""
    node = definition(fn_or_def)
    if node is None:
        return None
    node = copy.deepcopy(node)
    args = node.args
    for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
        if arg is not None:
            arg.annotation = None
    node.returns = None
    return normalized_digest(node)


def _known_rotaries() -> dict[str, str]:
    """normalized digest -> form, for the rotary functions the family adapters check by digest (as installed: a form
    whose installed source is not the checked one is not known)."""
    from diffusers.models.transformers import transformer_ltx, transformer_qwenimage, transformer_wan, transformer_z_image

    from .._source import source_digest
    from .ltx import _ROTARY as LTX
    from .qwenimage import _ROTARY as QWEN
    from .wan import _ROTARY as WAN
    from .zimage import _LOCAL_ROTARY as ZIMAGE

    known = {}
    if source_digest(transformer_ltx.apply_rotary_emb) == LTX:
        known[_form_digest(transformer_ltx.apply_rotary_emb)] = "rows"
    if source_digest(transformer_qwenimage.apply_rotary_emb_qwen) == QWEN:
        known[_form_digest(transformer_qwenimage.apply_rotary_emb_qwen)] = "complex"
    from diffusers.models.transformers import transformer_bria_fibo2

    for cls, (name, digest), form in ((transformer_wan.WanAttnProcessor, WAN, "wan"),
                                      (transformer_z_image.ZSingleStreamAttnProcessor, ZIMAGE, "local"),
                                      (transformer_bria_fibo2.BriaFibo2AttnProcessor, FIBO2, "local")):
        local = _local_defs(cls.__call__).get(name)
        if local is not None and hashlib.sha256(ast.unparse(local).encode()).hexdigest()[:16] == digest:
            known[_form_digest(local)] = form
    return known


# sha256[:16] of ast.unparse of Bria FIBO 2's processor-local `apply_rotary_emb` (diffusers 0.42.1): Z-Image's
# complex multiply (`x_in.float()` as complex, `* freqs_cis.unsqueeze(2)`, `.type_as(x_in)`) without its autocast
# block, which changes nothing for the op (its dtypes are explicit): the same "local" form
FIBO2 = ("apply_rotary_emb", "15efcd15e19c6261")

_KNOWN: dict[str, str] | None = None


def known_rotaries() -> dict[str, str]:
    global _KNOWN
    if _KNOWN is None:
        _KNOWN = _known_rotaries()
    return _KNOWN


def _parsed(fn) -> ast.FunctionDef | None:
    try:
        (node,) = ast.parse(textwrap.dedent(inspect.getsource(fn))).body
    except (OSError, TypeError, ValueError, SyntaxError):
        return None
    return node if isinstance(node, ast.FunctionDef) else None


def _local_defs(fn) -> dict[str, ast.FunctionDef]:
    node = _parsed(fn)
    if node is None:
        return {}
    return {n.name: n for n in ast.walk(node) if isinstance(n, ast.FunctionDef) and n is not node}


def processor_hints(fn) -> dict:
    """The rotary hints of a processor's ``__call__`` `fn`, read from its code: the known rotary forms it calls."""
    node = _parsed(fn)
    if node is None:
        return {}
    known = known_rotaries()
    hints: dict = {}
    called = {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    for name in sorted(called):  # ... and those of its module's helpers it calls (inlined: `_chain_inline_stmts`)
        helper = fn.__globals__.get(name)
        inner = _parsed(helper) if inspect.isfunction(helper) and helper.__globals__ is fn.__globals__ else None
        if inner is not None:
            called |= {c.func.id for c in ast.walk(inner) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    for name in sorted(called):
        target = fn.__globals__.get(name)
        if not inspect.isfunction(target):
            continue
        form = known.get(_form_digest(target))
        if form == "rows" and "rows_rotary" not in hints:
            register_rows_rotary(target)
            hints["rows_rotary"] = name
        elif form == "complex" and "complex_rotary" not in hints:
            register_complex_rotary(target)
            hints["complex_rotary"] = name
    for name, local in _local_defs(fn).items():
        form = known.get(_form_digest(local))
        digest = hashlib.sha256(ast.unparse(local).encode()).hexdigest()[:16]
        if form == "wan" and "wan_rotary" not in hints:
            hints["wan_rotary"] = (name, digest)
        elif form == "local" and "local_rotary" not in hints:
            hints["local_rotary"] = (name, digest)
    return hints


def block_hints(instances: list[nn.Module]) -> dict:
    """The attribute hints of a block class, from its instances in the model: diffusers' ``RMSNorm`` attributes
    (the sandwich-norm forms) and SiLU attributes (the SwiGLU form), where every instance has that type there."""
    def attrs(test) -> tuple[str, ...]:
        names = set(instances[0]._modules)
        return tuple(sorted(n for n in names if all(test(m._modules.get(n)) for m in instances)))

    params = list(inspect.signature(type(instances[0]).forward).parameters)[1:]
    return {"rms_norms": attrs(lambda m: type(m) is RMSNorm),
            "activations": (*attrs(lambda m: type(m) in SILUS), "F.silu"),
            # the residual streams, which a model may hand over as a transposed view (`_chains.rewrite_forward`)
            "contiguous": tuple(p for p in params if p.endswith("hidden_states") and "encoder" not in p),
            # the norms that read their input in memory order whatever its layout (aten's layer_norm takes a
            # contiguous copy: torch's LayerNorm and diffusers' FP32LayerNorm, of exactly these classes); an RMSNorm
            # is elementwise arithmetic and a reduction over x as laid out: not one
            "norms": attrs(lambda m: type(m) in (nn.LayerNorm, FP32LayerNorm)),
            # modulate methods known by digest, which the LayerNorm before them joins (`_norm_methods`)
            **({"norm_methods": known} if (known := norm_method_hints(type(instances[0]))) else {})}


# --- the subclasses, by a name that says how to make them -------------------------------------------------------
#
# A generic subclass is made at patch time for a class this package has never seen, with hints read from one model.
# Its name encodes the base class, the method and the hints, so that a pickled patched model finds it in a fresh
# process: `__getattr__` below makes it again from the name (PEP 562), and `_chains.fused_subclass` keeps one object
# per name.

_PREFIX = "FastpathGeneric_"


def subclass_name(base: type, method: str, hints: dict) -> str:
    spec = json.dumps([base.__module__, base.__qualname__, method, sorted(hints.items())], separators=(",", ":"))
    return _PREFIX + base64.b32encode(zlib.compress(spec.encode(), 9)).decode().rstrip("=")


def generic_subclass(base: type, method: str, hints: dict):
    """``(subclass, found)`` of `base` rewritten with `hints` (`_chains.fused_subclass`), or ``(None, None)``."""
    if method == "__call__":  # the rotary functions its hints name are registered with their forms (by digest)
        hints = {**processor_hints(base.__call__), **hints}
    options = dict(hints)
    if method == "__call__":  # a boolean attention mask made additive once per forward (Ideogram 4's; every generic
        options["bool_masks"] = True  # processor alike, so the subclass's name needs no hint for it)
    if "norm_methods" in options:  # (method, form) pairs -> the fused counterparts, checked against `base` again
        checked = dict(norm_method_hints(base))
        options["norm_methods"] = {m: FUSED[form] for m, form in options["norm_methods"] if checked.get(m) == form}
    sub, found = fused_subclass(base, subclass_name(base, method, hints), __name__, method, **options)
    if sub is not None:
        sub.__name__ = f"Fastpath{base.__name__}"  # what messages and `report` show; pickles go by the qualified name
    return sub, found


def __getattr__(name: str):
    if not name.startswith(_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    encoded = name[len(_PREFIX):]
    module, qualname, method, hints = json.loads(zlib.decompress(base64.b32decode(encoded + "=" * (-len(encoded) % 8))))
    base = named_object(module, qualname)
    hints = {k: tuple(v) if isinstance(v, list) else v for k, v in hints}
    sub, _ = generic_subclass(base, method, hints)
    if sub is None:
        raise AttributeError(f"{name}: {module}.{qualname}.{method} has no chain to fuse in this process")
    return sub


# --- which models ---------------------------------------------------------------------------------------------------


def _is_library_layer(cls: type) -> bool:
    return cls.__module__.split(".")[0] in ("torch", "diffusers_fastpath", "transformers", "peft", "accelerate",
                                            "torchao", "optimum", "bitsandbytes", "gguf")


def repeated_blocks(model: nn.Module) -> list[type]:
    """The model's repeated block classes: those diffusers names (``_repeated_blocks``, ``_no_split_modules``) that
    the model holds, else the classes of ``ModuleList`` entries that repeat and hold an attention."""
    named = set(getattr(model, "_repeated_blocks", None) or ()) | set(getattr(model, "_no_split_modules", None) or ())
    found = {type(m) for m in model.modules() if type(m).__name__ in named and m is not model}
    if found:
        return sorted(found, key=lambda c: c.__qualname__)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            kinds = {type(m) for m in module}
            if len(kinds) == 1 and any(hasattr(m, "processor") for m in module[0].modules()):
                found |= kinds
    return sorted(found, key=lambda c: c.__qualname__)


_AUTOENCODERS = "diffusers.models.autoencoders."


def eligible(model: nn.Module) -> str | None:
    """Why the generic path does not take `model`, or None."""
    from diffusers import ModelMixin

    name = type(model).__name__
    if not isinstance(model, ModelMixin):
        return f"{name} is not a diffusers model (ModelMixin)"
    if (why := _refused_by_name(name)) is not None:
        return why
    if type(model).__module__.startswith(_AUTOENCODERS):
        # what `coverage` leaves out too: diffusers' autoencoders and vocoders, whatever their names (MMAudioVAE,
        # LongCatAudioDiTVae, MMAudioVocoder); their pipelines call `decode`, which no forward-level check sees
        return f"{name} is an autoencoder or vocoder ({type(model).__module__}), not a diffusion transformer"
    if not repeated_blocks(model):
        return f"{name} holds no repeated transformer blocks"
    return None


# --- the adapter ----------------------------------------------------------------------------------------------------


def patch_generic(model: nn.Module, state: PatchState, name: str, verify: bool | None = None) -> None:
    """Rewrite every class of `model` that the patterns match, with the hints its modules state (module doc), and,
    unless `verify` is False (or ``DIFFUSERS_FASTPATH_VERIFY=0``), install the model-level verification."""
    classes: dict[type, list[nn.Module]] = {}
    for module in model.modules():
        cls = type(module)
        if module is model or _is_library_layer(cls) or "forward" not in _own_methods(cls):
            continue
        classes.setdefault(cls, []).append(module)
    swaps = {}
    for cls, instances in classes.items():
        hints = block_hints(instances)
        swaps[cls] = generic_subclass(cls, "forward", hints)
        if swaps[cls][0] is None:  # the chain may be in a method forward calls (Bria FIBO 2's FeedForward)
            for helper in helper_methods(cls):
                swaps[cls] = generic_subclass(cls, helper, hints)
                if swaps[cls][0] is not None:
                    break
    swap_rewritten(state, model, {c: v for c, v in swaps.items() if v[0] is not None})
    processors: dict[type, list[nn.Module]] = {}  # processor class -> the attention modules that hold one
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(module, "set_processor") and not _is_library_layer(type(processor)):
            processors.setdefault(type(processor), []).append(module)
    for cls, attentions in processors.items():
        if any(set(vars(a.processor)) - set(BACKEND_ATTRS) for a in attentions):
            # a processor with settings of its own (IP-adapter scales, a cache): a new one would not have them
            state.notes.append(f"generic path: kept {cls.__name__} (it holds settings a new processor would lack)")
            continue
        try:
            fused, _ = generic_subclass(cls, "__call__", {})
            if fused is not None:
                fused()  # constructible without arguments, as `replace_processors` makes them
        except TypeError:
            continue
        if fused is not None:
            replace_processors(state, model, tuple({type(a) for a in attentions}), cls, fused)
    swapped = sum(1 for r in state.records if r[0] in ("class", "processor"))
    # diffusers' RMSNorm modules, wherever they are: the fused, self-verified norm (`_qk_norms.patch_rmsnorms`)
    if norms := patch_rmsnorms(model, state):
        state.notes.append(f"generic path: {norms} diffusers RMSNorm modules run as the fused rmsnorm")
    if norms := patch_zero_centred_norms(model, state):
        state.notes.append(f"generic path: {norms} zero-centred float32 RMSNorm modules run as the fused "
                           "zero_centred_rmsnorm")
    if swapped == 0:
        state.notes.append("generic path: no chain of this model matched a pattern; it runs as diffusers wrote it")
    state.notes.append(f"patched by the generic path ({swapped} modules and processors rewritten)")
    if enabled(verify):
        Verifier(name, state, model).install(model)
    else:
        state.notes.append(VERIFY_SKIPPED)
    logger.info(f"diffusers_fastpath: {name} ({type(model).__name__}) patched by the generic path: {swapped} modules "
                f"and processors rewritten; verification {'on' if enabled(verify) else 'off'}")


VERIFY_SKIPPED = "model-level verification skipped (verify=False or DIFFUSERS_FASTPATH_VERIFY=0)"


def verify_again(model: nn.Module, state: PatchState, name: str, verify: bool | None) -> None:
    """`patch` asked again of a model the generic path patched: verification goes on where it was skipped and is
    asked for now (``verify=True``, or the default with ``DIFFUSERS_FASTPATH_VERIFY`` not 0); once on it stays on
    (a later ``verify=False`` does not take a check away from a model already trusted only through it)."""
    if getattr(state, "verifier", None) is not None or not enabled(verify) or VERIFY_SKIPPED not in state.notes:
        return
    state.notes.remove(VERIFY_SKIPPED)
    Verifier(name, state, model).install(model)
    logger.info(f"diffusers_fastpath: {name} ({type(model).__name__}): model-level verification now on")


def helper_methods(cls: type) -> list[str]:
    """The methods of `cls` its ``forward`` calls as ``self.NAME(...)``, in the order written: where ``forward``
    itself matches no pattern, the chain may be in one of them (``return self.w2(self._forward_silu_gating(
    self.w1(x), self.w3(x)))``); the rewrite of a method is the same as of ``forward`` (its own source, proven the
    same way), and the module's hooks still run around its ``forward``."""
    node = _parsed(cls.forward) if "forward" in _own_methods(cls) else None
    names: list[str] = []
    for call in ast.walk(node) if node is not None else ():
        func = getattr(call, "func", None) if isinstance(call, ast.Call) else None
        if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"
                and func.attr not in names and func.attr != "forward"
                and inspect.isfunction(inspect.getattr_static(cls, func.attr, None))):
            names.append(func.attr)
    return names


def _own_methods(cls: type) -> set[str]:
    """The methods `cls` or a base of it below ``nn.Module`` defines."""
    names = set()
    for base in cls.__mro__:
        if base is nn.Module or _is_library_layer(base):
            break
        names |= set(vars(base))
    return names


# --- coverage --------------------------------------------------------------------------------------------------------


def coverage() -> list[tuple[str, str, str]]:
    """``(class name, how, detail)`` for every model class of diffusers' ``models.transformers`` and every
    autoencoder a family adapter takes: ``how`` is ``"family"`` (an adapter written and tested for it; detail: its
    module), ``"generic"`` (patched from its own code and verified on its first forward per input signature) or
    ``"none"`` (detail: why)."""
    import diffusers.models.autoencoders as autoencoders
    import diffusers.models.transformers as transformers
    from diffusers import ModelMixin

    from .._state import ADAPTERS

    classes = {}
    for package in (transformers, autoencoders):
        for info in __import__("pkgutil").iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for cls in vars(module).values():
                if isinstance(cls, type) and issubclass(cls, ModelMixin) and cls.__module__ == module.__name__:
                    classes[cls.__name__] = cls
    rows = []
    for name, cls in sorted(classes.items()):
        family = next((ADAPTERS[c] for c in cls.__mro__ if c in ADAPTERS), None)
        if family is not None:
            rows.append((name, "family", family.__module__.rsplit(".", 1)[-1]))
        elif cls.__module__.startswith(autoencoders.__name__):
            continue  # autoencoders: only those a family adapter takes are listed
        elif (why := _refused_by_name(name)) is not None:
            rows.append((name, "none", why))
        else:
            rows.append((name, GENERIC, "verified on its first forward per input signature"))
    return rows


def _refused_by_name(name: str) -> str | None:
    if "UNet" in name:
        return f"{name} is a UNet: this package patches diffusion transformers, not UNets"
    if "Autoencoder" in name or name.startswith("VQ"):
        return f"{name} is an autoencoder, not a diffusion transformer"
    return None


def coverage_markdown() -> str:
    """The table of `coverage` as markdown (docs/coverage.md holds it; a test keeps the two the same)."""
    rows = coverage()
    counts = {k: sum(1 for r in rows if r[1] == k) for k in ("family", GENERIC, "none")}
    lines = [f"{counts['family']} classes by a family adapter, {counts[GENERIC]} by the generic path, "
             f"{counts['none']} not taken.", "", "| class | how | detail |", "|---|---|---|"]
    lines += [f"| `{name}` | {how} | {detail} |" for name, how, detail in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m diffusers_fastpath.models.generic > table: docs/coverage.md's
    print(coverage_markdown(), end="")
