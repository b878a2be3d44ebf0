"""Wan's VAE and those built of its pieces (diffusers' ``AutoencoderKLWan``, Wan 2.1 and 2.2; ``AutoencoderKLQwenImage``,
Wan's VAE under other class names; ``AutoencoderKLQwenImage21``, its one-frame image form with 2-D convolutions;
``AutoencoderKLHunyuanVideo15`` and ``AutoencoderKLHunyuanImageRefiner``, whose norm is Wan's, digest for digest),
through exact pieces and the pair rewrite of `diffusers_fastpath.models.vae`.

- The norms (``WanRMS_norm``, ``QwenImageRMS_norm``: ``F.normalize(x.float(), dim=1).to(x.dtype) * scale * gamma +
  bias``): a norm whose output goes straight into the block's SiLU module (``norm1 -> nonlinearity`` and ``norm2 ->
  nonlinearity`` of every residual block, ``norm_out -> nonlinearity`` of the encoder and the decoder) runs with it as
  `diffusers_fastpath.ops.channel_rmsnorm_silu` (the block's forward rewritten as the GroupNorm VAEs' are: the
  statement pair becomes one call, which takes the fused op only where the norm carries this package's site, the
  activation is exactly ``nn.SiLU`` and neither has hooks); every other such norm (the mid-block attention's) becomes
  `FastpathWanRMS_norm` / `FastpathQwenImageRMS_norm`, whose forward is `channel_rmsnorm`. Both keep aten's norm
  reduction and fuse the tail (division, cast, scale, gamma, bias, SiLU), exact by construction.
- The pair's result written into the causal convolution that reads it (`IntoPairCalls`): where the block's forward
  hands the pair's value to a module call ``V = self.<conv>(V, ...)`` (after ``V = self.<m>(V)`` calls, the resnets'
  ``dropout``), reading it otherwise only through a slice's ``clone()`` (the feature cache), the pair statement
  becomes ``V = <ns>.norm_act_into(self, "<norm>", "<act>", V, ("<m>", ..., "<conv>"))``, and at run time the pair
  op writes its result into that convolution's padded channels-last input (`channel_rmsnorm_silu`'s `conv`) where the
  modules before it are exactly ``nn.Dropout`` in eval mode without hooks and it is a causal convolution patched here.
  The feature cache's clones of that value after it (``x[:, :, -CACHE_T:].clone()``) become ``<ns>.cloned(x[...])``
  (`causal_conv_pad.cloned`: ``clone``'s tensor, the buffer's rows moved as 8-byte words where aten's strided copy
  moved 2-byte values).
- The residual blocks' add (`_residual`): where a block's forward ends ``return V + E`` and V's last binding on every
  path is a module call ``V = self.<conv>(V, ...)`` (Wan's and Qwen-Image's resnets: ``conv2`` in both branches of
  the feature cache's ``if``, then ``return x + h``), the calls become ``<ns>.conv_pending(self, "<conv>", V, ...)``
  and the add ``<ns>.pending_add(self, V, E)``: where the convolution is a causal convolution patched here with
  nothing else in its module call (no hooks, its class's forward), its channels-last path leaves the bias pending
  (`causal_conv_cl.pending_result`, from the second call of its signature on) and the add runs
  `diffusers_fastpath.ops.conv_bias_residual` (the bias, the transpose back and the add in one pass; the residual
  contiguous, or time-major: an identity shortcut after an upsampler's result); anything else, the module's call and
  the add as written.
- The causal convolutions (``WanCausalConv3d``, ``QwenImageCausalConv3d``): `FastpathWanCausalConv3d` /
  `FastpathQwenImageCausalConv3d`, whose forward is `diffusers_fastpath.ops.causal_conv3d`: the cache frames and the
  zero padding written around x in one buffer instead of a concatenation, a fill and a copy (values moved, never
  changed; the convolution is the module's own ``nn.Conv3d.forward``).
- The convolutions' biases (`diffusers_fastpath.models.vae_conv`): the causal convolutions' padded input goes to
  `diffusers_fastpath.ops.conv_bias`, the plain ``nn.Conv2d`` / ``nn.Conv3d`` ones (HunyuanVideo-1.5's and the
  refiner's causal convolutions hold one after their replicate padding) become `FastpathConv2d` / `FastpathConv3d`.
  Qwen-Image 2.1's ``QwenImage21CausalConv3d`` is an ``nn.Conv2d`` whose forward pads and calls
  ``super().forward``: `FastpathQwenImage21CausalConv3d` puts `FastpathConv2d` between it and ``nn.Conv2d`` in the
  method order, so that diffusers' forward runs as written and its ``super().forward`` is `conv_bias`.
- The decoders' 2x upsampling (``WanUpsample``, ``QwenImageUpsample``: ``nn.Upsample`` of ``x.float()``, cast back):
  `FastpathWanUpsample` / `FastpathQwenImageUpsample`, whose forward is
  `diffusers_fastpath.ops.upsample_nearest2x`: one read of x and one write of the result instead of an fp32 round
  trip at four times the size (exact by construction).

Being the modules' own forwards, these run inside the module call, so hooks run as before.

The forwards this relies on (the norm's, the convolution's, the upsampling's) are checked by source digest at import and at patch
time; a class whose forward differs is left as it is, with one warning. The caches diffusers keeps between chunks
(``feat_cache``: the blocks' ``x[:, :, -CACHE_T:].clone()``) are made by diffusers' own statements, those of a
pair's value by `causal_conv_pad.cloned` (the tensor ``clone`` makes).
Tiling and slicing call the same modules on smaller tensors: the same sites, each checked per call by its guard.
"""

from __future__ import annotations

import ast
import copy

from diffusers.models.autoencoders import autoencoder_kl_hunyuanimage_refiner as refiner
from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as hunyuan15
from diffusers.models.autoencoders import autoencoder_kl_qwenimage as qwen
from diffusers.models.autoencoders import autoencoder_kl_qwenimage21 as qwen21
from diffusers.models.autoencoders import autoencoder_kl_wan as wan
from torch import nn

from .._state import SITE_ATTR, PatchState, register_adapter, site_attr
from ..ops import causal_conv_cl as _conv_cl
from ..ops.causal_conv_pad import CAUSAL_CONV3D, add_conv_class, causal_conv3d, cloned
from ..ops.conv_bias_residual import CONV_BIAS_RESIDUAL, add_pending
from ..ops.channel_rmsnorm_silu import (CHANNEL_RMSNORM, CHANNEL_RMSNORM_SILU, add_norm_class, channel_rmsnorm,
                                        channel_rmsnorm_silu)
from ..ops.upsample_nearest import UPSAMPLE_NEAREST2X, add_upsample_class, upsample_nearest2x
from ..ops.conv_bias import CONV_BIAS, add_bias_conv_class
from .vae import (PairBlock, PairCalls, between_reason, checked_forwards, forward_calls, names_in, pair_call,
                  rewrite_nested, silu_pair_unfit, swap_pair_blocks)
from .vae_conv import FastpathConv2d, add_conv_subclass, causal_conv_site, swap_convs

# diffusers 0.42.1's forwards (`_source.body_digest`: the body, without docstring and formatting), the same in both files
NORM_DIGESTS = frozenset({"960a6e5b25f82893"})  # F.normalize(x.float()).to(x.dtype) * self.scale * self.gamma + bias
CONV_DIGESTS = frozenset({"3c4433890f22647d"})  # torch.cat([cache_x, x], dim=2); F.pad; super().forward
UPSAMPLE_DIGESTS = frozenset({"0fefd24a11a840dc"})  # super().forward(x.float()).type_as(x)

PAIR_SITE = CHANNEL_RMSNORM_SILU.name  # the pair's site, on the norm module: ``_fastpath_site_channel_rmsnorm_silu``


def _norm_forward(self, x):
    return channel_rmsnorm(self, x, self.__dict__.get(SITE_ATTR))


def _conv_forward(self, x, cache_x=None):
    return causal_conv3d(self, x, cache_x, self.__dict__.get(SITE_ATTR))


def _upsample_forward(self, x):
    return upsample_nearest2x(self, x, self.__dict__.get(SITE_ATTR))


def _subclass(base: type, name: str, forward, what: str) -> type:
    """A module-level subclass of `base` named `name` whose forward is `forward` (adds no state)."""
    doc = (f"diffusers' ``{base.__qualname__}`` whose forward is {what} (`diffusers_fastpath.models.vae_wan`); "
           f"``{base.__qualname__}.forward`` wherever the guard refuses. Adds no state.")
    cls = type(name, (base,), {"forward": forward, "__module__": __name__, "__qualname__": name, "__doc__": doc})
    globals()[name] = cls
    return cls


NORMS = {base: _subclass(base, f"Fastpath{base.__name__}", _norm_forward, "`channel_rmsnorm`")
         for base in (wan.WanRMS_norm, qwen.QwenImageRMS_norm, qwen21.QwenImage21RMS_norm,
                      hunyuan15.HunyuanVideo15RMS_norm, refiner.HunyuanImageRefinerRMS_norm)}
CONVS = {base: _subclass(base, f"Fastpath{base.__name__}", _conv_forward, "`causal_conv3d`")
         for base in (wan.WanCausalConv3d, qwen.QwenImageCausalConv3d)}
UPSAMPLES = {base: _subclass(base, f"Fastpath{base.__name__}", _upsample_forward, "`upsample_nearest2x`")
             for base in (wan.WanUpsample, qwen.QwenImageUpsample, qwen21.QwenImage21Upsample)}
for _base, _sub in NORMS.items():
    add_norm_class(_sub, _base)
_CONV_SUBS = frozenset(CONVS.values())  # (the convolutions a pair's result may be written into: `_conv_of`)
for _base, _sub in CONVS.items():
    add_conv_class(_sub, _base)
    add_bias_conv_class(_sub)  # (its forward hands the padded input to `conv_bias`)
for _base, _sub in UPSAMPLES.items():
    add_upsample_class(_sub, _base)


class FastpathQwenImage21CausalConv3d(qwen21.QwenImage21CausalConv3d, FastpathConv2d):
    """diffusers' ``QwenImage21CausalConv3d`` (an ``nn.Conv2d`` that pads, then calls ``super().forward``) with
    `FastpathConv2d` next in the method order: diffusers' forward runs as written, its ``super().forward`` is
    `conv_bias` (``nn.Conv2d.forward`` wherever the guard refuses). Adds no state."""


add_conv_subclass(FastpathQwenImage21CausalConv3d, qwen21.QwenImage21CausalConv3d)


pair_unfit = silu_pair_unfit(lambda norm: type(norm) in NORMS, "a checked channel RMS norm")  # (channel_rmsnorm_silu's)


class IntoPairCalls(PairCalls):
    """The pair calls of Wan's and Qwen-Image's blocks, with the pair statements whose value goes to a module call
    found in the forward (`_readers`) made ``<ns>.norm_act_into(self, "<norm>", "<act>", V, readers)`` (the module
    doc): the pair op given the causal convolution its value reaches (`_conv_of`), which it may write the value
    into."""

    def norm_act_into(self, owner: nn.Module, norm_name: str, act_name: str, x, readers: tuple[str, ...]):
        """`norm_act` (the same site, fit and counts), the fused op given the convolution of `readers` that the
        value reaches (`_conv_of`) where there is one."""
        norm, act = getattr(owner, norm_name), getattr(owner, act_name)
        site = norm.__dict__.get(site_attr(self.site))
        conv = _conv_of(owner, readers) if site is not None else None
        if conv is None or self.unfit(norm, act) is not None:
            return self.norm_act(owner, norm_name, act_name, x)
        return self.fused(norm, x, site, conv)

    def cloned(self, t):
        """``t.clone()`` (`causal_conv_pad.cloned`: the same tensor, a cache cut from the pair's buffer moved as
        words), for the rewritten ``V[...].clone()`` reads of the pair's value."""
        return cloned(t)

    def conv_pending(self, owner: nn.Module, conv_name: str, x, *args, **kwargs):
        """``owner.<conv_name>(x, ...)``, a causal convolution's call whose value only the block's residual add reads
        (`_residual`'s proof): where the block has its `conv_bias_residual` site, the channels-last op's result with
        its bias pending (`causal_conv_cl.pending_result`, which stands for the module's call only where that call
        would run nothing else; counted on the convolution's sites as its call would be); elsewhere, and where that
        op does not take the call, the module's call."""
        conv = getattr(owner, conv_name)
        out = None
        if (site_attr(CONV_BIAS_RESIDUAL.name) in owner.__dict__ and type(conv) in _CONV_SUBS and not kwargs
                and len(args) <= 1):
            out = _conv_cl.pending_result(conv, x, *args)
        if out is None:
            return conv(x, *args, **kwargs)
        for attr in (SITE_ATTR, _conv_cl.NAMED_SITE):
            site = conv.__dict__.get(attr)
            if site is not None:
                site.fast += 1
        return out

    def pending_add(self, owner: nn.Module, left, right):
        """``left + right``, one of them a convolution's `PendingBias` or neither (`conv_bias_residual.add_pending`,
        with the block's site)."""
        return add_pending(owner.__dict__.get(site_attr(CONV_BIAS_RESIDUAL.name)), left, right)

    def rewrite_body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        return _residual(_Into(self.ns).body(body), self.ns)


def _conv_of(owner: nn.Module, readers: tuple[str, ...]) -> nn.Module | None:
    """The first module of `readers` (names of `owner`'s modules, in the order the value goes through them) that is a
    causal convolution this adapter patched, where every one before it is the identity (`vae.between_reason`); else
    ``None``."""
    for k, name in enumerate(readers):
        module = getattr(owner, name, None)
        if type(module) in _CONV_SUBS:
            return module if between_reason(owner, readers[:k]) is None else None
    return None


class _Into:
    """The rewrite of `IntoPairCalls`: each pair statement ``V = <ns>.norm_act(self, N, A, V)`` followed by statements
    that hand V to module calls (`_readers`) becomes ``V = <ns>.norm_act_into(self, N, A, V, readers)``, and in the
    statements after it (to the next pair statement) each ``V[...].clone()`` becomes ``<ns>.cloned(V[...])`` (the same
    tensor: `IntoPairCalls.cloned`)."""

    def __init__(self, ns: str) -> None:
        self.ns = ns

    def body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        cut = None  # the pair's value whose clones are rewritten (V of the last pair statement with readers)
        for k, stmt in enumerate(body):
            pair = pair_call(stmt, self.ns)
            readers = None if pair is None else _readers(body[k + 1:], pair[0])[0]
            if pair is not None:
                cut = pair[0] if readers else None
            if readers:
                stmt = copy.deepcopy(stmt)
                stmt.value.func.attr = "norm_act_into"
                stmt.value.args.append(ast.Tuple([ast.Constant(name) for name in readers], ast.Load()))
            elif cut is not None:
                stmt = _Cloned(self.ns, cut).visit(copy.deepcopy(stmt))
            out.append(rewrite_nested(stmt, self.body))
        return out


class _Cloned(ast.NodeTransformer):
    """``V[...].clone()`` (no arguments) made ``<ns>.cloned(V[...])``."""

    def __init__(self, ns: str, var: str) -> None:
        self.ns, self.var = ns, var

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        func = node.func
        if (not node.args and not node.keywords and isinstance(func, ast.Attribute) and func.attr == "clone"
                and isinstance(func.value, ast.Subscript) and isinstance(func.value.value, ast.Name)
                and func.value.value.id == self.var):
            return ast.copy_location(ast.Call(func=ast.Attribute(value=ast.Name(self.ns, ast.Load()), attr="cloned",
                                                                 ctx=ast.Load()),
                                              args=[func.value], keywords=[]), node)
        return node


def _residual(body: list[ast.stmt], ns: str) -> list[ast.stmt]:
    """A residual block's add of its convolution's result, made to take that result with its bias pending: where the
    forward's statements `body` end ``return V + E`` (or ``E + V``; E another name) and the statement before it binds
    V last, on every path, by a module call ``V = self.<conv>(V, ...)`` after which nothing on that path names V
    (`_last_calls`; Wan's and Qwen-Image's resnets: ``conv2``'s call in both branches of the feature cache's ``if``,
    then ``return x + h``), those calls become ``V = <ns>.conv_pending(self, "<conv>", V, ...)`` and the return
    ``return <ns>.pending_add(self, V, E)`` (the operands in their order): the add is the value's only reader."""
    last = body[-1] if body else None
    if len(body) < 2 or not (isinstance(last, ast.Return) and isinstance(last.value, ast.BinOp)
                             and isinstance(last.value.op, ast.Add)):
        return body
    add = last.value
    if not (isinstance(add.left, ast.Name) and isinstance(add.right, ast.Name) and add.left.id != add.right.id):
        return body
    before = copy.deepcopy(body[-2])
    calls = _last_calls(before, add.left.id) or _last_calls(before, add.right.id)
    if not calls:
        return body
    for stmt in calls:
        call = stmt.value
        stmt.value = ast.copy_location(ast.Call(
            func=ast.Attribute(value=ast.Name(ns, ast.Load()), attr="conv_pending", ctx=ast.Load()),
            args=[ast.Name("self", ast.Load()), ast.Constant(call.func.attr), *call.args], keywords=call.keywords), call)
    ret = ast.copy_location(ast.Return(value=ast.Call(
        func=ast.Attribute(value=ast.Name(ns, ast.Load()), attr="pending_add", ctx=ast.Load()),
        args=[ast.Name("self", ast.Load()), add.left, add.right], keywords=[])), last)
    return [*body[:-2], before, ast.fix_missing_locations(ret)]


def _last_calls(stmt: ast.stmt, var: str) -> list[ast.stmt]:
    """The statements of `stmt` that bind `var` last on each path through it, where each is a module call ``V =
    self.X(V, ...)`` (`_module_call`): `stmt` itself, or for an ``if`` with an ``else`` those of each branch (the last
    statement of the branch that names V, nothing after it naming V); an empty list where some path ends otherwise."""
    if _module_call(stmt, var) is not None:
        return [stmt]
    if not (isinstance(stmt, ast.If) and stmt.orelse):
        return []
    found: list[ast.stmt] = []
    for branch in (stmt.body, stmt.orelse):
        named = [s for s in branch if var in names_in(s)]
        calls = _last_calls(named[-1], var) if named else []
        if not calls:
            return []
        found += calls
    return found


def _module_call(stmt: ast.stmt, var: str) -> str | None:
    """X for ``V = self.X(V, ...)`` (V, `var`, the first positional argument and named nowhere else in the call)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == var):
        return None
    call = stmt.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "self" and call.args
            and isinstance(call.args[0], ast.Name) and call.args[0].id == var):
        return None
    rest = [*call.args[1:], *(k.value for k in call.keywords)]
    return None if any(var in names_in(node) for node in rest) else call.func.attr


_LAYOUT_FREE = frozenset({"shape", "dtype", "device"})  # (what a read of V may ask of it, whatever its strides)


def _reads_cloned(stmt: ast.AST, var: str) -> bool:
    """Whether every read of `var` in `stmt` is a slice of it cloned, ``V[...].clone()`` (the feature cache's
    ``x[:, :, -CACHE_T:, :, :].clone()``: a copy of values, whatever V's layout), or its ``shape``, ``dtype`` or
    ``device`` (Qwen-Image's ``-min(CACHE_T, x.shape[2])``), and nothing binds it."""
    allowed = set()
    for node in ast.walk(stmt):
        if (isinstance(node, ast.Call) and not node.args and not node.keywords
                and isinstance(node.func, ast.Attribute) and node.func.attr == "clone"
                and isinstance(node.func.value, ast.Subscript) and isinstance(node.func.value.value, ast.Name)
                and node.func.value.value.id == var):
            allowed.add(id(node.func.value.value))
        elif isinstance(node, ast.Attribute) and node.attr in _LAYOUT_FREE and isinstance(node.value, ast.Name):
            allowed.add(id(node.value))
    return all(isinstance(node.ctx, ast.Load) and id(node) in allowed
               for node in ast.walk(stmt) if isinstance(node, ast.Name) and node.id == var)


def _readers(body: list[ast.stmt], var: str) -> tuple[tuple[str, ...], bool]:
    """The modules the value of `var` goes through in `body` (the statements after its pair): the X of each ``V =
    self.X(V, ...)`` in order (`_module_call`), as long as every other statement reads V only through
    `_reads_cloned`'s form and binds it nowhere; an ``if`` whose test does not name V continues the run where both
    branches give the same modules and run on (neither stopped). With whether the run went through all of `body`
    (a branch's: the statements after the ``if`` continue it). What goes on past a module whose result V then holds
    is harmless (that value is the module's own): the run may only be longer than the fused path needs."""
    names: list[str] = []
    for stmt in body:
        name = _module_call(stmt, var)
        if name is not None:
            names.append(name)
            continue
        if isinstance(stmt, ast.If) and var not in names_in(stmt.test):
            taken, rest = _readers(stmt.body, var), _readers(stmt.orelse, var)
            if taken != rest:
                return tuple(names), False
            names.extend(taken[0])
            if not taken[1]:
                return tuple(names), False
            continue
        if not _reads_cloned(stmt, var):
            return tuple(names), False
    return tuple(names), True


PAIRS = IntoPairCalls("_diffusers_fastpath_vae_wan", PAIR_SITE, pair_unfit, channel_rmsnorm_silu)

# Made at import, so that a pickled patched model finds the subclasses here by name.
BLOCKS = tuple(
    PairBlock(base, f"Fastpath{base.__name__}", __name__, (act,), PAIRS)
    for base, act in ((wan.WanResidualBlock, "nonlinearity"), (wan.WanEncoder3d, "nonlinearity"),
                      (wan.WanDecoder3d, "nonlinearity"), (qwen.QwenImageResidualBlock, "nonlinearity"),
                      (qwen.QwenImageEncoder3d, "nonlinearity"), (qwen.QwenImageDecoder3d, "nonlinearity"),
                      (qwen21.QwenImage21ResidualBlock, "nonlinearity"), (qwen21.QwenImage21Encoder3d, "nonlinearity"),
                      (qwen21.QwenImage21Decoder3d, "nonlinearity"), (hunyuan15.HunyuanVideo15ResnetBlock, "nonlinearity"),
                      (hunyuan15.HunyuanVideo15Encoder3D, "conv_act"), (hunyuan15.HunyuanVideo15Decoder3D, "conv_act"),
                      (refiner.HunyuanImageRefinerResnetBlock, "nonlinearity"),
                      (refiner.HunyuanImageRefinerEncoder3D, "conv_act"),
                      (refiner.HunyuanImageRefinerDecoder3D, "conv_act"))
)


@register_adapter(wan.AutoencoderKLWan)
@register_adapter(qwen.AutoencoderKLQwenImage)
@register_adapter(qwen21.AutoencoderKLQwenImage21)
@register_adapter(hunyuan15.AutoencoderKLHunyuanVideo15)
@register_adapter(refiner.AutoencoderKLHunyuanImageRefiner)
def patch_wan_vae(model, state: PatchState) -> None:
    """Fuse the norms (and their SiLUs) and build the causal convolutions' inputs in one buffer (see module doc)."""
    norms = checked_forwards(NORMS, NORM_DIGESTS, None, add_norm_class)
    convs = checked_forwards(CONVS, CONV_DIGESTS, nn.Conv3d, add_conv_class)
    upsamples = checked_forwards(UPSAMPLES, UPSAMPLE_DIGESTS, nn.Upsample, add_upsample_class)
    paired = swap_pair_blocks(model, state, BLOCKS, lambda norm, act: type(norm) in norms and type(act) is nn.SiLU)
    for module in model.modules():
        cls = type(module)
        if cls in norms and id(module) not in paired:
            state.swap_class(module, NORMS[cls])
            state.add_site(module, CHANNEL_RMSNORM.name)
        elif cls in convs:
            state.swap_class(module, CONVS[cls])
            state.add_site(module, CAUSAL_CONV3D.name)
            causal_conv_site(module, state)
        elif cls in upsamples:
            state.swap_class(module, UPSAMPLES[cls])
            state.add_site(module, UPSAMPLE_NEAREST2X.name)
        elif cls is qwen21.QwenImage21CausalConv3d and module.bias is not None:
            state.swap_class(module, FastpathQwenImage21CausalConv3d)
            state.add_site(module, CONV_BIAS.name)
    swap_convs(model, state)  # the plain ones (the resampling's nn.Conv2d, the attention's 1x1)
    add_residual_sites(model, state)


def add_residual_sites(model, state: PatchState) -> None:
    """Give each block whose rewritten forward adds a convolution's pending result (`_residual`: ``conv_pending``
    then ``pending_add``) its `conv_bias_residual` site, where a convolution it names is a causal convolution patched
    here (the others' calls are the modules' own: nothing pending)."""
    subs = {block.sub for block in BLOCKS if block.sub is not None}
    for module in model.modules():
        if type(module) not in subs or site_attr(CONV_BIAS_RESIDUAL.name) in module.__dict__:
            continue
        convs = [args[1].value for attr, args in forward_calls(type(module).__dict__.get("forward"))
                 if attr == "conv_pending" and len(args) >= 3 and isinstance(args[1], ast.Constant)]
        if any(type(getattr(module, name, None)) in _CONV_SUBS for name in convs):  # (`_residual` makes the add too)
            state.add_site(module, CONV_BIAS_RESIDUAL.name, CONV_BIAS_RESIDUAL.name)
