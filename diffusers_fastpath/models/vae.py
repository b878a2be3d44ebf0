"""The VAEs built from GroupNorm + SiLU pieces: every ``nn.GroupNorm`` runs as the fused, self-verified
`diffusers_fastpath.ops.group_norm`, and a GroupNorm whose output goes straight into an ``nn.SiLU`` module runs with
it as `diffusers_fastpath.ops.group_norm_silu` (one pass instead of two). The family files (`vae_kl`, ...) register
their VAE classes with `patch_group_norm_vae` and name their blocks.

Two pieces, the simplest that reach each call:

- `FastpathGroupNorm`, a subclass of ``nn.GroupNorm`` swapped in for every plain one whose output is not handed to a
  SiLU: its forward is the fused op (``nn.GroupNorm.forward`` where the guard refuses the input). Being the module's
  own forward, it runs inside the module call, so the module's hooks and the global ones run as before (the
  mid-block attention's ``group_norm``, which diffusers' processor calls on the ``[B, C, H*W]`` view).
- The pairs ``V = self.<norm>(V)`` then ``V = self.<act>(V)`` of a block's forward (``ResnetBlock2D``: ``norm1 ->
  nonlinearity`` and ``norm2 -> nonlinearity``; the encoder's and decoder's ``conv_norm_out -> conv_act``) are two
  module calls in diffusers' source; no module of the pair sees the other, so fusing them means rewriting the
  statement pair. `pair_subclass` does that on the block's installed ``forward`` (read with ``inspect``, as
  `_chains` does for the transformers' chains; `_chains`' patterns take single expressions, this one two
  statements), and nothing else: the pair becomes ``V = <namespace>.norm_act(self, "<norm>", "<act>", V)``. Where the
  activation follows an ``if``/``else`` whose branches end in the norm call (``ResnetBlock2D.forward``'s
  ``time_embedding_norm`` branches, the decoder's ``latent_embeds`` branch), the activation statement is moved into
  the end of each branch first (the same statements in the same order on every path) and paired where a branch ends
  in the norm; where an ``if`` (no ``elif``) whose test reads only the block's attributes (``self.x is not None``)
  stands between the norm and the activation (LTX-2's resnets: an optional modulate), both statements move into each
  branch (an ``else:`` made for them), which pairs them on the branch that runs nothing between. A `PairCalls` made
  with ``moved=True`` pairs the norm statement ``V = self.<norm>(V.movedim(1, -1)).movedim(-1, 1)`` instead (LTX-Video's
  VAE: a channel-last norm of channel-first activations), its fused op taking that view. At run time `_PairCalls.norm_act` takes the fused op only where the norm is a plain ``nn.GroupNorm``
  with this package's pair site and the activation exactly ``nn.SiLU``, neither with hooks (nor any global module
  hook); anything else runs ``act(norm(V))``, the two calls as written. The paired norms keep their class (every call
  of theirs in diffusers' blocks is the pair's).

The rewrite is made when the adapter module is imported (so pickles find the subclasses by name) and made again at
patch time if the class's ``forward`` is no longer the function it was made from (another library replaced it since).
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import linecache
import re
import sys
import textwrap

import torch
from torch import nn

from .._logging import warn_once
from .._state import SITE_ATTR, PatchState, bound_safe, site_attr
from ..ops.group_norm_silu import GROUP_NORM, GROUP_NORM_SILU, add_plain, group_norm, group_norm_silu
from ..ops._policy import forward_replaced, hooks_on
from ..quality import hooked
from .._source import body_digest, source_of
from .vae_conv import swap_convs

_NS = "_diffusers_fastpath_vae"  # the name `_PairCalls` goes by in the rewritten forwards' globals
PAIR_SITE = GROUP_NORM_SILU.name  # the pair's site, on the norm module: ``_fastpath_site_group_norm_silu``


class FastpathGroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` whose forward is the fused, self-verified `group_norm` (torch's forward wherever the guard
    refuses the input). Adds no state; unpatching gives ``nn.GroupNorm`` back."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return group_norm(self, input, self.__dict__.get(SITE_ATTR))


add_plain(FastpathGroupNorm)


def checked_forwards(classes, digests: frozenset, parent: type | None = None, register=None) -> set[type]:
    """The diffusers classes of `classes` whose installed ``forward`` is the one read here (its body's digest one of
    `digests`, and, with `parent`, the forward its ``super()`` reaches still `parent`'s), each given to `register`
    (the op's registration of the class); one warning for each that is not (its modules then run unpatched)."""
    ok = set()
    for base in classes:
        if body_digest(base.forward) in digests and (parent is None or base.__mro__[1].forward is parent.forward):
            if register is not None:
                register(base)
            ok.add(base)
        else:
            warn_once(f"diffusers_fastpath: {base.__qualname__}.forward is not the form this package reads "
                      f"(diffusers 0.42.1's); those modules run unpatched")
    return ok


def swap_checked(model: nn.Module, state: PatchState, subs: dict[type, type], digests: frozenset, register, site: str,
                 takes=None) -> None:
    """Make every module of `model` whose class is a key of `subs` (and that ``takes(module)``, where given) that
    key's subclass, with a `site`, where the class's forward is the one read here (`checked_forwards` with
    `register`, for the classes `model` holds; one warning for each that is not)."""
    held = {type(m) for m in model.modules() if type(m) in subs and (takes is None or takes(m))}
    fits = checked_forwards([base for base in subs if base in held], digests, register=register)
    for module in model.modules():
        if type(module) in fits and (takes is None or takes(module)):
            state.swap_class(module, subs[type(module)])
            state.add_site(module, site)


def silu_pair_unfit(is_norm, what: str):
    """The ``unfit(norm, act)`` of a `PairCalls` whose fused op takes a norm that ``is_norm(norm)`` accepts (`what`
    it is, for the reason) and exactly ``nn.SiLU``: why ``act(norm(x))`` cannot run fused (without calling either
    module), or ``None``."""

    def unfit(norm: nn.Module, act: nn.Module) -> str | None:
        if not is_norm(norm):
            return f"{type(norm).__name__} is not {what}"
        if type(act) is not nn.SiLU:
            return f"{type(act).__name__} is not nn.SiLU"
        if hooked(norm) or hooked(act):  # (global module hooks included)
            return "hooks"
        return None

    return unfit


pair_unfit = silu_pair_unfit(lambda norm: type(norm) is nn.GroupNorm, "a plain nn.GroupNorm")  # (group_norm_silu's)


class PairCalls:
    """What the rewritten forwards call: ``<ns>.norm_act(self, "<norm>", "<act>", V)``, `ns` the name this object
    goes by in their globals. `site` names the pair's site on the norm, `unfit(norm, act)` says why the pair cannot
    run fused (or ``None``), `fused(norm, x, site)` is the fused op (its guard decides per call, and counts). With
    `moved` the norm statement paired is ``V = self.<norm>(V.movedim(1, -1)).movedim(-1, 1)`` (a channel-last norm of
    channel-first activations: LTX-Video's VAE), and `fused` takes, and returns, the channel-last view."""

    def __init__(self, ns: str, site: str, unfit, fused, moved: bool = False) -> None:
        self.ns, self.site, self.unfit, self.fused, self.moved = ns, site, unfit, fused, moved

    def norm_act(self, owner: nn.Module, norm_name: str, act_name: str, x):
        """``act(norm(x))`` for ``norm = owner.<norm_name>``, ``act = owner.<act_name>`` (the norm's call as the
        statement wrote it: `moved`): the fused op where the norm carries this object's pair site and the pair fits
        (`unfit`), else the two module calls."""
        norm, act = getattr(owner, norm_name), getattr(owner, act_name)
        site = norm.__dict__.get(site_attr(self.site))
        if site is None:
            return act(self._norm(norm, x))
        reason = self.unfit(norm, act)
        if reason is None:
            if self.moved:
                return self.fused(norm, x.movedim(1, -1), site).movedim(-1, 1)
            return self.fused(norm, x, site)
        if not torch.compiler.is_compiling():
            site.fallback[reason] += 1
        return act(self._norm(norm, x))

    def _norm(self, norm: nn.Module, x):
        """The norm's call as the paired statement wrote it."""
        return norm(x.movedim(1, -1)).movedim(-1, 1) if self.moved else norm(x)

    def rewrite_body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        """A further rewrite of a forward's statements after its pairs were made (`rewrite_pairs`): none here; a
        subclass fuses what follows a pair (LTX-2's: the convolution, `vae_ltx2_chain`)."""
        return body


_PairCalls = PairCalls(_NS, PAIR_SITE, pair_unfit, group_norm_silu)


def between_reason(owner: nn.Module, names: tuple[str, ...]) -> str | None:
    """Why a module of `owner` called between a pair and the convolution that reads its result (`names`) is not the
    identity (or ``None``): exactly ``nn.Dropout`` (torch's forward) in eval mode, without hooks. LTX's joined chains
    (`vae_ltx2_chain`) and Wan's padded results (`vae_wan`) ask it."""
    for name in names:
        module = getattr(owner, name, None)
        if type(module) is not nn.Dropout or forward_replaced(module):
            return f"{type(module).__name__} between the SiLU and the convolution"
        if module.training:
            return "dropout in training mode"
        if hooks_on(module):
            return "hooks"
    return None


# --- the rewrite ----------------------------------------------------------------------------------------------------


def _self_call(stmt: ast.stmt) -> tuple[str, str] | None:
    """``(V, X)`` if `stmt` is ``V = self.X(V)`` (one name target, one positional argument, no keywords)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    call = stmt.value
    if not (isinstance(call, ast.Call) and len(call.args) == 1 and not call.keywords
            and isinstance(call.args[0], ast.Name) and call.args[0].id == stmt.targets[0].id
            and isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "self"):
        return None
    return stmt.targets[0].id, call.func.attr


_MOVED_CALL = re.compile(r"self\.(\w+)\((\w+)\.movedim\(1, -1\)\)\.movedim\(-1, 1\)")


def _norm_call(stmt: ast.stmt, moved: bool) -> tuple[str, str] | None:
    """``(V, N)`` if `stmt` is the norm statement of a pair: ``V = self.N(V)`` (`_self_call`), or, `moved`,
    ``V = self.N(V.movedim(1, -1)).movedim(-1, 1)`` (its value read in ``ast.unparse``'s normal form)."""
    if not moved:
        return _self_call(stmt)
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    match = _MOVED_CALL.fullmatch(ast.unparse(stmt.value))
    var = stmt.targets[0].id
    return (var, match[1]) if match is not None and match[2] == var else None


def _pair_stmt(var: str, norm: str, act: str, ns: str = _NS) -> ast.stmt:
    call = ast.Call(func=ast.Attribute(value=ast.Name(ns, ast.Load()), attr="norm_act", ctx=ast.Load()),
                    args=[ast.Name("self", ast.Load()), ast.Constant(norm), ast.Constant(act),
                          ast.Name(var, ast.Load())],
                    keywords=[])
    return ast.Assign(targets=[ast.Name(var, ast.Store())], value=call)


def pair_call(stmt: ast.stmt, ns: str):
    """``(V, norm, act)`` for the pair statement ``V = <ns>.norm_act(self, "<norm>", "<act>", V)`` (`_pair_stmt`'s),
    else ``None``: what the rewrites after the pairs' (LTX's joined chains, Wan's padded results) start from."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    call = stmt.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "norm_act"
            and isinstance(call.func.value, ast.Name) and call.func.value.id == ns and len(call.args) == 4
            and not call.keywords):
        return None
    owner, norm, act, var = call.args
    if (isinstance(owner, ast.Name) and owner.id == "self" and isinstance(norm, ast.Constant)
            and isinstance(act, ast.Constant) and isinstance(var, ast.Name) and var.id == stmt.targets[0].id):
        return var.id, norm.value, act.value
    return None


def _ends_in_norm(body: list[ast.stmt], var: str, activations: tuple[str, ...], moved: bool = False) -> bool:
    """Whether some path through `body` (an ``if`` chain's branches) ends in ``var = self.N(var)`` (`_norm_call`), N
    not an activation: where moving the activation into the branches lets a pair form."""
    if not body:
        return False
    last = body[-1]
    if isinstance(last, ast.If):
        return (_ends_in_norm(last.body, var, activations, moved)
                or _ends_in_norm(last.orelse, var, activations, moved))
    call = _norm_call(last, moved)
    return call is not None and call[0] == var and call[1] not in activations


def _append_to_branches(node: ast.If, stmt: ast.stmt) -> None:
    """Append a copy of `stmt` to the end of every branch of `node` (an ``else:`` with it alone where there is none);
    ``elif`` chains are nested ``if``s in ``orelse``."""
    node.body.append(copy.deepcopy(stmt))
    if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
        _append_to_branches(node.orelse[0], stmt)
    else:
        node.orelse.append(copy.deepcopy(stmt))


def names_in(node: ast.AST) -> set[str]:
    """The names (``ast.Name`` ids, read or bound) anywhere in `node`."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _attribute_of_self(node: ast.expr) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


def _hoistable_test(test: ast.expr) -> bool:
    """Whether `test` is ``self.<a>[.<b>...] is None`` / ``is not None`` (or ``and`` / ``or`` / ``not`` of such):
    a look-up of the block's own attributes, which nothing a norm module computes changes, so that evaluating it
    before the norm call instead of after gives the branch eager takes."""
    if isinstance(test, ast.BoolOp):
        return all(_hoistable_test(v) for v in test.values)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _hoistable_test(test.operand)
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot))
            and _attribute_of_self(test.left) and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None)


def _if_chain(node: ast.If) -> list[ast.If]:
    """`node` and the ``elif``s nested in its ``orelse``."""
    chain = [node]
    while len(chain[-1].orelse) == 1 and isinstance(chain[-1].orelse[0], ast.If):
        chain.append(chain[-1].orelse[0])
    return chain


def wrap_branches(node: ast.If, first: ast.stmt, last: ast.stmt, var: str) -> bool:
    """For `first`, then `node` (an ``if`` / ``elif`` chain whose every test `_hoistable_test` takes and does not
    name V, `var`), then `last`: `first` moved to the start and `last` to the end of each branch (an ``else:`` with
    the two alone where there is none), the statements each path runs and their order unchanged but the tests',
    now read first. False (nothing changed) where the form differs."""
    chain = _if_chain(node)
    if not all(_hoistable_test(n.test) and var not in names_in(n.test) for n in chain):
        return False
    for n in chain:
        n.body = [copy.deepcopy(first), *n.body, copy.deepcopy(last)]
    chain[-1].orelse = [copy.deepcopy(first), *chain[-1].orelse, copy.deepcopy(last)]
    return True


def _hoist_into(node: ast.If, norm: ast.stmt, act: ast.stmt, var: str) -> bool:
    """For ``V = self.N(V)``, then `node` (an ``if`` without ``elif``), then ``V = self.A(V)``: `wrap_branches`. LTX-2's
    resnets (``norm1``, an ``if self.scale_shift_table is not None:`` modulate that is off by default, then the SiLU)
    pair on the branch without the modulate."""
    return len(_if_chain(node)) == 1 and wrap_branches(node, norm, act, var)


@functools.lru_cache(maxsize=64)
def forward_calls(fn) -> tuple[tuple[str, tuple], ...]:
    """The calls ``<x>.<attr>(...)`` of the rewritten forward `fn` as ``(attr, args)``, read from its text (the
    rewrite's output, which `rewrite_pairs` keeps in ``linecache``)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return ()
    return tuple((node.func.attr, tuple(node.args)) for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute))


def rewrite_nested(stmt: ast.stmt, body) -> ast.stmt:
    """`stmt` with each statement list nested in it (an ``if``'s, a loop's, a ``with``'s, a ``try``'s and its
    handlers') replaced by ``body(list)``: a statement rewrite's recursion."""
    for field in ("body", "orelse", "finalbody"):
        inner = getattr(stmt, field, None)
        if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
            setattr(stmt, field, body(inner))
    for handler in getattr(stmt, "handlers", ()) or ():
        handler.body = body(handler.body)
    return stmt


class _Pairs:
    def __init__(self, activations: tuple[str, ...], ns: str = _NS, moved: bool = False) -> None:
        self.activations, self.ns, self.moved = activations, ns, moved
        self.found: list[tuple[str, str]] = []

    def body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for stmt in body:
            call = _self_call(stmt)
            if call is not None and call[1] in self.activations and out:
                var, act = call
                prev = _norm_call(out[-1], self.moved)
                if prev is not None and prev[0] == var and prev[1] not in self.activations:
                    out[-1] = _pair_stmt(var, prev[1], act, self.ns)
                    self._add(prev[1], act)
                    continue
                last = out[-1]
                if isinstance(last, ast.If) and _ends_in_norm([last], var, self.activations, self.moved):
                    _append_to_branches(last, stmt)
                    out[-1] = self.stmt(last)
                    continue
                before = _norm_call(out[-2], self.moved) if len(out) > 1 else None
                if (isinstance(last, ast.If) and before is not None and before[0] == var
                        and before[1] not in self.activations and _hoist_into(last, out[-2], stmt, var)):
                    out[-2:] = [self.stmt(last)]
                    continue
            out.append(self.stmt(stmt))
        return out

    def stmt(self, stmt: ast.stmt) -> ast.stmt:
        return rewrite_nested(stmt, self.body)

    def _add(self, norm: str, act: str) -> None:
        if (norm, act) not in self.found:
            self.found.append((norm, act))


def rewrite_pairs(fn, qualname: str, activations: tuple[str, ...], calls: PairCalls = _PairCalls):
    """`fn` (a block's ``forward``) with its norm -> activation statement pairs routed through `calls.norm_act`,
    and the ``(norm, activation)`` attribute pairs found; ``None`` where the source is not provably `fn`'s
    (`_source.source_of`: a ``functools.wraps`` wrapper, a file edited since the import), the function needs a
    closure, or no pair was found."""
    source, _ = source_of(fn)
    if source is None or fn.__code__.co_freevars:
        return None
    source = textwrap.dedent(source)
    tree = ast.parse(source)
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    func = tree.body[0]
    func.decorator_list = []
    pairs = _Pairs(activations, calls.ns, calls.moved)
    func.body = pairs.body(copy.deepcopy(func.body))
    if not pairs.found:
        return None
    func.body = calls.rewrite_body(func.body)
    ast.fix_missing_locations(tree)
    text = ast.unparse(tree) + "\n"
    filename = f"<diffusers_fastpath: {qualname}, rewritten from {inspect.getsourcefile(fn)}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    fn.__globals__.setdefault(calls.ns, calls)
    namespace: dict = {}
    exec(compile(text, filename, "exec"), fn.__globals__, namespace)  # noqa: S102 (diffusers' own source, rewritten)
    new = namespace[func.name]
    new.__qualname__ = qualname
    new.__doc__ = fn.__doc__
    return new, tuple(pairs.found)


class PairBlock:
    """A diffusers block class whose forward has GroupNorm -> SiLU statement pairs: `base` (the diffusers class), the
    subclass `name` defined in (and set as an attribute of) the adapter module `module`, `activations` (the
    attributes of `base` that hold its SiLU), `calls` what its pairs run (the GroupNorm's by default).

    The subclass is one object, made at construction (adapter import), so that pickles of patched models find it by
    name in this process and in a fresh one. Where ``base.forward`` has been replaced since it was last rewritten
    (`current`, at each patch), its forward is rewritten again from the function `base` holds then, on that same
    class: models patched before run it too, as their unpatched twins run the new function (a pair whose norm has no
    site runs the two modules as written); a function with no pair leaves the class without a forward of its own."""

    def __init__(self, base: type, name: str, module: str, activations: tuple[str, ...],
                 calls: PairCalls = _PairCalls) -> None:
        self.base, self.name, self.module, self.activations, self.calls = base, name, module, activations, calls
        self.sub: type | None = None  # the subclass, made at the first rewrite that finds a pair
        self.made_from = self.pairs = None
        self.current()

    def _install(self, fn, pairs: tuple, made_from) -> None:
        doc = (f"diffusers' ``{self.base.__qualname__}`` with the norm -> SiLU pairs {list(pairs)} of its "
               "installed forward fused (`diffusers_fastpath.models.vae`). Adds no state beyond the fusion sites.")
        fn.__module__ = self.module
        if self.sub is None:
            self.sub = type(self.name, (self.base,), {"forward": fn, "__module__": self.module,
                                                      "__qualname__": self.name, "__doc__": doc,
                                                      "_fastpath_pairs": pairs, "_fastpath_made_from": made_from})
            if self.module in sys.modules:  # an attribute of its module from the start, so that pickles find it
                setattr(sys.modules[self.module], self.name, self.sub)
            return
        self.sub.forward, self.sub._fastpath_pairs, self.sub.__doc__ = fn, pairs, doc
        self.sub._fastpath_made_from = made_from
        if self.sub.__dict__.get("_fastpath_bound_safe"):  # wrapped before: wrap the new forward the same way
            self.sub._fastpath_bound_safe = False
            bound_safe(self.sub)

    def current(self) -> type | None:
        """The subclass, rewritten from the forward `base` holds now (None: that forward has no pair)."""
        fn = self.base.forward
        if fn is not self.made_from:
            self.made_from = fn
            rewritten = rewrite_pairs(fn, f"{self.name}.forward", self.activations, self.calls)
            self.pairs = None if rewritten is None else rewritten[1]
            if rewritten is not None:
                self._install(*rewritten, fn)
            elif self.sub is not None and "forward" in self.sub.__dict__:
                del self.sub.forward  # (models patched before run `base`'s forward as it is now)
                self.sub._fastpath_pairs = ()
        return self.sub if self.pairs is not None else None


def swap_pair_blocks(model: nn.Module, state: PatchState, blocks: tuple[PairBlock, ...], fits) -> set[int]:
    """Make each module whose exact class is one of `blocks`' bases its pair subclass, with its `PairCalls`' site on
    each pair's norm where ``fits(norm, act)`` (one site per norm); the ids of the norms given a site."""
    by_base = {block.base: block for block in blocks}
    paired: set[int] = set()
    for module in model.modules():
        block = by_base.get(type(module))
        if block is None:
            continue
        sub = block.current()
        if sub is None:
            warn_once(f"diffusers_fastpath: found no norm -> SiLU pair in the installed "
                      f"{block.base.__qualname__}.forward; its norms run fused alone, the SiLUs apart")
            continue
        state.swap_class(module, sub)
        for norm_name, act_name in sub._fastpath_pairs:
            norm, act = getattr(module, norm_name, None), getattr(module, act_name, None)
            if fits(norm, act) and id(norm) not in paired:
                state.add_site(norm, block.calls.site, block.calls.site)
                paired.add(id(norm))
    return paired


def patch_group_norm_vae(model: nn.Module, state: PatchState, blocks: tuple[PairBlock, ...]) -> None:
    """Patch a VAE (see module doc): each module whose exact class is one of `blocks`' bases becomes its pair
    subclass, with a `group_norm_silu` site on each pair's norm that is a plain ``nn.GroupNorm`` beside an
    ``nn.SiLU``; every other plain ``nn.GroupNorm`` becomes `FastpathGroupNorm` with a `group_norm` site; every plain
    convolution with a bias its `conv_bias` subclass (`vae_conv.swap_convs`)."""
    swap_norms(model, state, blocks, {nn.GroupNorm: FastpathGroupNorm}, GROUP_NORM.name)
    swap_convs(model, state)


def swap_norms(model: nn.Module, state: PatchState, blocks: tuple[PairBlock, ...], subs: dict[type, type],
               site: str) -> None:
    """Give each pair of `blocks` whose norm is of a class of `subs` (exactly) and whose activation is ``nn.SiLU`` its
    pair site (`swap_pair_blocks`), and make every other norm of those classes its subclass ``subs[class]``, with a
    `site` site (the norm op alone)."""
    paired = swap_pair_blocks(model, state, blocks, lambda norm, act: type(norm) in subs and type(act) is nn.SiLU)
    for module in model.modules():
        sub = subs.get(type(module))
        if sub is not None and id(module) not in paired:
            state.swap_class(module, sub)
            state.add_site(module, site)
