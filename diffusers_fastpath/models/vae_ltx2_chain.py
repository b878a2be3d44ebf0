"""LTX-2's and LTX-Video's VAEs: the norm -> SiLU pair and the causal convolution that reads it, as one call
(`diffusers_fastpath.ops.ltx_norm_conv` for LTX-2, `diffusers_fastpath.ops.ltx_vae_rmsnorm_conv` for LTX-Video: the
norm written straight into the convolution's padded channels-last input; `ChainPairCalls.chain`).

The pair rewrite of `diffusers_fastpath.models.vae` turns each ``V = self.<norm>(V)`` ... ``V = self.<act>(V)`` of a
block's forward into ``V = <ns>.norm_act(self, "<norm>", "<act>", V)`` (LTX-Video's norm statement is the moved form
``V = self.<norm>(V.movedim(1, -1)).movedim(-1, 1)``, the same pair statement). `ChainPairCalls.rewrite_body` then joins
that statement with the convolution after it: a convolution's statement (LTX-2's: ``V = self.<conv>(V, causal=<expr>)``,
the form of every ``LTX2VideoCausalConv3d`` call in its forwards, a module call without the keyword not taken for one;
LTX-Video's, whose ``LTXVideoCausalConv3d`` takes no argument: ``V = self.<conv>(V)`` that is the last of the run of
such statements after the pair, `ChainPairCalls.keyword` None) whose predecessors are, going back, any ``V =
self.<m>(V)`` statements (the resnets' ``dropout``) and then the pair statement, becomes ``V =
<ns>.norm_act_conv(self, "<norm>", "<act>", ("<m>", ...), "<conv>", V, causal=<expr>)`` (LTX-Video's without the
keyword). Where the pair ends a branch of an ``if`` (the resnets' ``if self.scale_shift_table is not None:``
modulate, which the pair rewrite split into a branch with the modulate and one with the pair; the decoder's timestep
modulate), the statements after the ``if`` up to the convolution move to the end of each of its branches first (the
same statements in the same order on every path: only where no branch leaves early, no ``return``, ``raise``,
``break`` or ``continue`` in it) and join on the branch that ends in the pair.

Why nothing else reads what the joined call skips: each statement is ``V = f(V)``, so the value it leaves is read by
the next statement only, and V is bound again by the convolution's; what could see the skipped values at run time are
the modules' hooks (and the global ones), which refuse the fused op, and a between module that is not exactly
``nn.Dropout`` in eval mode (``F.dropout(x, p, False)`` returns x itself) refuses it too. A statement taken for the
convolution's that is not one (LTX-Video's form names no argument to tell) runs as written: its module carries no
chain site. Refused, the call runs the statements as written: the pair's own call (its site decides), each between
module, then the convolution's module call.

At run time `ChainPairCalls.norm_act_conv` takes its chain op where the convolution carries that op's site (given by
`add_chain_sites` at patch time to each convolution that a joined call of its block names) and the norm its pair site;
the op's guard and per-signature check decide the rest, counted on the convolution's site.

Then, for LTX-2 (`ChainPairCalls.bias`), a joined call whose result the next joined call reads (a resnet's ``conv1``,
read by ``norm2``'s chain) may leave it without its bias: `_Pending` rewrites the first as ``norm_act_conv_pending``
and the second as ``pending_norm_act_conv`` where every other path between them settles the value first (``V =
<ns>.settled(V)``, inserted; see `_Pending` for what it proves). At run time the first returns `ltx_norm_conv`'s
`causal_conv_cl.PendingBias` where its kernel ran and its signature was checked; the second takes it with
`ltx_bias_norm_conv` where its convolution carries that op's site (on each convolution a receiving call names) and the
chain fits, else settles it and runs as `norm_act_conv`.

And, for LTX-2 (`ChainPairCalls.residual`), a joined call whose result goes to a residual add ``V = V + W`` (a resnet's
``conv2``, read by ``hidden_states + inputs``; also where it received its own input pending:
``pending_norm_act_conv_pending``) may leave it without its bias too: the add becomes ``V = <ns>.pending_add(self, V,
W)`` (the operands in their order), which takes a `PendingBias` with `conv_bias_residual` where the block carries that
op's site (on each block whose forward has such a call; counted there) and the add fits, else settles it and adds as
written.

LTX-Video's calls (``bias`` and ``residual`` None) leave nothing pending: `_Pending` does not run, every joined call
returns the tensor its convolution's module would, and its resnets' residual adds stay as written.
"""

from __future__ import annotations

import ast
import copy

import torch
from torch import nn

from .._state import PatchState, site_attr
from ..ops.causal_conv_cl import PendingBias, settled
from ..ops.conv_bias_residual import CONV_BIAS_RESIDUAL, add_pending
from ..ops.ltx_bias_norm_conv import LTX_BIAS_NORM_CONV
from ..ops.ltx_norm_conv import LTX_NORM_CONV
from .vae import PairCalls, between_reason, forward_calls, names_in, pair_call, rewrite_nested, wrap_branches

# the joined call's forms (`_Pending`): the one whose convolution may leave its result pending, the one that takes it,
# the one that does both; the residual add that takes it; the settle
JOINED, PENDING, RECEIVER, SETTLED = "norm_act_conv", "norm_act_conv_pending", "pending_norm_act_conv", "settled"
RECEIVER_PENDING, ADD = "pending_norm_act_conv_pending", "pending_add"


class ChainPairCalls(PairCalls):
    """A `PairCalls` whose rewrite joins each pair with the convolution after it (the module doc): `chain` the fused op
    the joined call takes (``chain(site, norm, act, conv, x, causal)``, `causal` the convolution's argument, ``None``
    where the statement names none), its name the site on the convolution; `keyword` the argument that marks a
    convolution's statement (LTX-2's ``causal``; ``None``: the bare call that ends the run after the pair,
    LTX-Video's); `bias` the op that takes a convolution's result left pending by the chain before it (LTX-2's
    `ltx_bias_norm_conv`; ``None``: no joined call receives one); `residual` the op that takes it in a residual add
    (``pending_add``, its name the site on the block: LTX-2's `conv_bias_residual`; ``None``: the adds stay as
    written). Either needs a chain op that can leave its result pending (``chain(..., causal, True)``: `ltx_norm_conv`).
    With neither, every joined call returns the tensor and no statement is rewritten for a pending value
    (LTX-Video's)."""

    def __init__(self, ns: str, site: str, unfit, fused, moved: bool = False, chain=LTX_NORM_CONV,
                 keyword: str | None = "causal", bias=LTX_BIAS_NORM_CONV, residual=CONV_BIAS_RESIDUAL) -> None:
        super().__init__(ns, site, unfit, fused, moved)
        self.chain, self.keyword, self.bias, self.residual = chain, keyword, bias, residual

    def norm_act_conv(self, owner: nn.Module, norm_name: str, act_name: str, between: tuple[str, ...], conv_name: str,
                      x, **kwargs):
        """``conv(<between>(act(norm(x))), **kwargs)`` for the modules of `owner` so named: `ltx_norm_conv` where the
        convolution has its site and the pair fits, else the statements as written."""
        return self._chain(owner, norm_name, act_name, between, conv_name, x, kwargs, False)

    def norm_act_conv_pending(self, owner: nn.Module, norm_name: str, act_name: str, between: tuple[str, ...],
                              conv_name: str, x, **kwargs):
        """`norm_act_conv`, the convolution's result a `PendingBias` where `ltx_norm_conv` runs and leaves it so
        (its signature checked already); the rewrite made this call only where every path from it reaches
        `pending_norm_act_conv` or `settled` before anything else reads the value."""
        return self._chain(owner, norm_name, act_name, between, conv_name, x, kwargs, True)

    def pending_norm_act_conv(self, owner: nn.Module, norm_name: str, act_name: str, between: tuple[str, ...],
                              conv_name: str, x, **kwargs):
        """`norm_act_conv` of x, a tensor or a `PendingBias`: for the latter `ltx_bias_norm_conv` where the
        convolution has its site and the chain fits (counted there), else x settled and `norm_act_conv`."""
        return self._receive(owner, norm_name, act_name, between, conv_name, x, kwargs, False)

    def pending_norm_act_conv_pending(self, owner: nn.Module, norm_name: str, act_name: str,
                                      between: tuple[str, ...], conv_name: str, x, **kwargs):
        """`pending_norm_act_conv`, its convolution's result a `PendingBias` where its op (`ltx_bias_norm_conv`, or
        `ltx_norm_conv` on a tensor) runs and leaves it so, as `norm_act_conv_pending`'s."""
        return self._receive(owner, norm_name, act_name, between, conv_name, x, kwargs, True)

    def pending_add(self, owner: nn.Module, left, right):
        """``left + right``, one of them a `PendingBias` or neither: `conv_bias_residual.add_pending` with the block's
        `residual` site (none without the op)."""
        site = None if self.residual is None else owner.__dict__.get(site_attr(self.residual.name))
        return add_pending(site, left, right)

    @staticmethod
    def settled(x):
        """x, or the tensor of a `PendingBias` (its bias added, contiguous: eager's): `causal_conv_cl.settled`."""
        return settled(x)

    def _receive(self, owner: nn.Module, norm_name: str, act_name: str, between: tuple[str, ...], conv_name: str, x,
                 kwargs, pending: bool):
        if type(x) is PendingBias:
            conv = getattr(owner, conv_name)
            site = None if self.bias is None else conv.__dict__.get(site_attr(self.bias.name))
            if site is not None:
                norm, act = getattr(owner, norm_name), getattr(owner, act_name)
                reason = self._reason(owner, norm, between, kwargs)
                if reason is None:
                    out = self.bias.try_fast(site, norm, act, conv, x, self._causal(kwargs), pending)
                    if out is not None:
                        return out
                else:
                    site.fallback[reason] += 1
            x = x.settle()
        return self._chain(owner, norm_name, act_name, between, conv_name, x, kwargs, pending)

    def _reason(self, owner: nn.Module, norm: nn.Module, between: tuple[str, ...], kwargs) -> str | None:
        """Why the joined statements cannot run as one op (the norm, the arguments, the modules between), or None."""
        if norm.__dict__.get(site_attr(self.site)) is None:
            return "the norm is not a pair site"
        if kwargs.keys() - {self.keyword}:
            return "arguments"
        return between_reason(owner, between)

    def _causal(self, kwargs):
        """The chain op's `causal` for the convolution's keywords: ``None`` where its statement names no argument
        (LTX-Video's module reads ``self.is_causal``); LTX-2's ``causal`` (its forward's default True; diffusers'
        forward tests ``if causal:``, so a None is non-causal, as FastpathLTX2VideoCausalConv3d maps it)."""
        if self.keyword is None:
            return None
        causal = kwargs.get(self.keyword, True)
        return False if causal is None else causal

    def _chain(self, owner: nn.Module, norm_name: str, act_name: str, between: tuple[str, ...], conv_name: str, x,
               kwargs, pending: bool):
        conv = getattr(owner, conv_name)
        site = conv.__dict__.get(site_attr(self.chain.name))
        if site is not None and not torch.compiler.is_compiling():
            norm, act = getattr(owner, norm_name), getattr(owner, act_name)
            reason = self._reason(owner, norm, between, kwargs)
            if reason is None:
                # (a `PendingBias` asked for only where the rewrite made a pending call: `bias` or `residual` given)
                out = self.chain.try_fast(site, norm, act, conv, x, self._causal(kwargs), *((True,) if pending else ()))
                if out is not None:
                    return out
            else:
                site.fallback[reason] += 1
        value = self.norm_act(owner, norm_name, act_name, x)
        for name in between:
            value = getattr(owner, name)(value)
        return conv(value, **kwargs)

    def rewrite_body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        body = _Chains(self.ns, self.keyword).body(body)
        if self.bias is None and self.residual is None:
            return body
        return _Pending(self.ns, body, self.bias is not None, self.residual is not None).body(body)


def _self_call(stmt: ast.stmt, keywords: tuple[str, ...] = ()):
    """``(V, X, keywords)`` for ``V = self.X(V, k=...)`` with one positional argument and keywords among `keywords`,
    each a constant or a name other than V (the joined call evaluates it before the statements it stands for run:
    only a value those statements cannot change may move there)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    call, var = stmt.value, stmt.targets[0].id
    if not (isinstance(call, ast.Call) and len(call.args) == 1 and isinstance(call.args[0], ast.Name)
            and call.args[0].id == var and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "self"
            and all(k.arg in keywords and (isinstance(k.value, ast.Constant)
                                           or (isinstance(k.value, ast.Name) and k.value.id != var))
                    for k in call.keywords)):
        return None
    return var, call.func.attr, call.keywords


def _falls_through(node: ast.If) -> bool:
    """Whether every path through `node` that does not raise ends at a branch's end (no ``return``, ``break`` or
    ``continue`` in it), so that a statement after it runs exactly where the branches' ends are reached: appended to
    the end of each branch, it runs on the same paths. A ``raise`` (FLUX.1's resnets raise in their ``scale_shift``
    branch when ``temb`` is missing) leaves the branch, or is caught inside it and the branch goes on to its end, on
    the same path either way."""
    return not any(isinstance(n, (ast.Return, ast.Break, ast.Continue)) for n in ast.walk(node))


def _pair_into_branches(node: ast.If, pair: ast.stmt, conv: ast.stmt, var: str) -> bool:
    """For the pair statement, then `node` (no branch leaving early), then the convolution's statement:
    `vae.wrap_branches` (the tests, the block's own attributes, read before the norm and its activation, which cannot
    change them). FLUX.1's resnets (``norm1 -> nonlinearity``, ``if self.upsample is not None: ... elif
    self.downsample is not None: ...``, ``conv1``) then join on the ``else:`` branch. False (nothing changed) where
    the form differs."""
    return _falls_through(node) and wrap_branches(node, pair, conv, var)


def _ends_in_pair(body: list[ast.stmt], var: str, ns: str) -> bool:
    if not body:
        return False
    last = body[-1]
    if isinstance(last, ast.If):
        return _ends_in_pair(last.body, var, ns) or _ends_in_pair(last.orelse, var, ns)
    pair = pair_call(last, ns)
    return pair is not None and pair[0] == var


class _Chains:
    def __init__(self, ns: str, keyword: str | None = "causal") -> None:
        self.ns, self.keyword = ns, keyword

    def body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for k, stmt in enumerate(body):
            conv = self._conv_call(stmt, body[k + 1] if k + 1 < len(body) else None)
            if conv is not None and self._join(out, stmt, conv):
                continue
            out.append(rewrite_nested(stmt, self.body))
        return out

    def _conv_call(self, stmt: ast.stmt, after: ast.stmt | None):
        """`_self_call`'s ``(V, X, keywords)`` where `stmt` is taken for a convolution's call: with `keyword`, ``V =
        self.X(V, <keyword>=...)`` (LTX-2's ``causal=``); without, ``V = self.X(V)`` not followed by another ``V =
        self.Y(V)`` (`after`: the last of the run after the pair, the ones before it the modules between)."""
        if self.keyword is not None:
            call = _self_call(stmt, (self.keyword,))
            return call if call is not None and call[2] else None
        call = _self_call(stmt)
        if call is None:
            return None
        following = None if after is None else _self_call(after)
        return None if following is not None and following[0] == call[0] else call

    def _join(self, out: list[ast.stmt], stmt: ast.stmt, conv) -> bool:
        """Join `stmt` (the convolution's call) with the pair before it in `out` (in place); False where none."""
        var, conv_name, keywords = conv
        k = len(out)
        between: list[str] = []
        while k > 0:
            call = _self_call(out[k - 1])
            if call is None or call[0] != var or call[2]:
                break
            between.insert(0, call[1])
            k -= 1
        if k == 0:
            return False
        prev = out[k - 1]
        pair = pair_call(prev, self.ns)
        if pair is not None and pair[0] == var:
            out[k - 1:] = [self._joined(var, pair[1], pair[2], tuple(between), conv_name, keywords)]
            return True
        pair = pair_call(out[k - 2], self.ns) if k > 1 else None
        if (isinstance(prev, ast.If) and not between and pair is not None and pair[0] == var
                and _pair_into_branches(prev, out[k - 2], stmt, var)):
            del out[k - 2:]
            out.append(rewrite_nested(prev, self.body))
            return True
        if isinstance(prev, ast.If) and _falls_through(prev) and _ends_in_pair([prev], var, self.ns):
            moved = [*out[k:], stmt]
            for branch in ("body", "orelse"):
                setattr(prev, branch, self.body([*getattr(prev, branch), *copy.deepcopy(moved)]))
            del out[k:]
            return True
        return False

    def _joined(self, var: str, norm: str, act: str, between: tuple[str, ...], conv: str, keywords) -> ast.stmt:
        call = ast.Call(func=ast.Attribute(value=ast.Name(self.ns, ast.Load()), attr="norm_act_conv", ctx=ast.Load()),
                        args=[ast.Name("self", ast.Load()), ast.Constant(norm), ast.Constant(act),
                              ast.Tuple([ast.Constant(b) for b in between], ast.Load()), ast.Constant(conv),
                              ast.Name(var, ast.Load())],
                        keywords=copy.deepcopy(keywords))
        return ast.Assign(targets=[ast.Name(var, ast.Store())], value=call)


# builtins and functions that read a frame's locals (a value bound to a name is then not only the code's to read)
_FRAME_READERS = frozenset({"locals", "vars", "eval", "exec", "_getframe", "currentframe", "stack", "getouterframes"})
_SCOPES = (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ListComp, ast.SetComp, ast.DictComp,
           ast.GeneratorExp)


def _joined_var(stmt: ast.stmt, ns: str, attr: str = JOINED) -> str | None:
    """V for a joined call ``V = <ns>.<attr>(self, "<norm>", "<act>", (...), "<conv>", V, ...)`` (`_Chains`' form),
    else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    call = stmt.value
    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == attr
            and isinstance(call.func.value, ast.Name) and call.func.value.id == ns and len(call.args) == 6
            and isinstance(call.args[5], ast.Name) and call.args[5].id == stmt.targets[0].id):
        return stmt.targets[0].id
    return None


def _binds(body: list[ast.stmt], var: str) -> bool:
    """Whether every path through `body` ends by binding `var` (``var = ...``, or an ``if`` with an ``else`` whose
    branches all do): `var` is bound after it whichever path ran."""
    last = body[-1] if body else None
    if isinstance(last, ast.If):
        return bool(last.orelse) and _binds(last.body, var) and _binds(last.orelse, var)
    return (isinstance(last, ast.Assign) and len(last.targets) == 1 and isinstance(last.targets[0], ast.Name)
            and last.targets[0].id == var)


def _ending_calls(body: list[ast.stmt], var: str, ns: str) -> list[ast.stmt]:
    """The joined calls binding `var` that end a path through `body` (its last statement, or its ``if``'s branches'):
    plain ones and receiving ones (which may leave their own result pending in turn)."""
    last = body[-1] if body else None
    if isinstance(last, ast.If):
        return _ending_calls(last.body, var, ns) + _ending_calls(last.orelse, var, ns)
    return [last] if last is not None and var in (_joined_var(last, ns), _joined_var(last, ns, RECEIVER)) else []


def _add_node(stmt: ast.stmt, var: str, after: ast.stmt | None):
    """The residual add of `var` that `stmt` makes, as ``(holder, field)`` (the add is ``getattr(holder, field)``):
    ``V = V + E`` or ``V = E + V`` (E an expression that does not name V: evaluated where it was, it cannot read the
    pending value; V bound to the tensor again), or ``T = (V + E) / D`` / ``T = (E + V) / D`` with D not naming V
    either, followed by ``return T`` (FLUX.1's resnets: ``output_tensor = (input_tensor + hidden_states) /
    self.output_scale_factor``; V holds the pending value after it, which the return leaves unread), else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.BinOp)):
        return None
    target = stmt.targets[0].id
    if target == var and isinstance(stmt.value.op, ast.Add):
        holder, field = stmt, "value"
    elif (isinstance(stmt.value.op, ast.Div) and isinstance(stmt.value.left, ast.BinOp)
          and isinstance(stmt.value.left.op, ast.Add) and var not in names_in(stmt.value.right)
          and isinstance(after, ast.Return) and isinstance(after.value, ast.Name) and after.value.id == target):
        holder, field = stmt.value, "left"
    else:
        return None
    add = getattr(holder, field)
    for this, other in ((add.left, add.right), (add.right, add.left)):
        if isinstance(this, ast.Name) and this.id == var and var not in names_in(other):
            return holder, field
    return None


def _blocked(body: list[ast.stmt]) -> set[str] | None:
    """The names whose value code other than these statements could read: those a nested scope (a lambda, a
    function, a class, a comprehension) names, or ``global`` / ``nonlocal`` declare; ``None`` (every name) where a
    frame's locals are read (`_FRAME_READERS`)."""
    blocked: set[str] = set()
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, _SCOPES):
                blocked |= names_in(node)
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                blocked.update(node.names)
            elif (isinstance(node, ast.Name) and node.id in _FRAME_READERS
                  or isinstance(node, ast.Attribute) and node.attr in _FRAME_READERS):
                return None
    return blocked


class _Pending:
    """Hands a joined convolution's result on without its bias (`PendingBias`) where the next joined call or a residual
    add reads it.

    In a statement list that is the function's body or a branch of its ``if`` statements (not in a loop, ``try`` or
    ``with``: there a value could outlive the statements that settle it), a statement S binding V through joined calls
    (a joined call ``V = <ns>.norm_act_conv(..., V, ...)``, or one that is a receiver already, ``V =
    <ns>.pending_norm_act_conv(...)``, or an ``if`` whose every branch ends by binding V, some with such a call) is
    followed, going forward while V may hold the pending value, by: a receiver, a joined call reading V (where `joined`:
    it becomes ``pending_norm_act_conv``, which takes a `PendingBias`) or a residual add ``V = V + E`` / ``V = E + V``
    with E not naming V, or ``T = (V + E) / D`` right before ``return T`` (`_add_node`; where `adds`: the add becomes
    ``<ns>.pending_add(self, V, E)``, the operands in their order, which takes one); an ``if`` whose test does not
    name V (each branch that starts with a receiver keeps it, each other branch that names V starts with ``V = <ns>.settled(V)``, and a branch that does not name V, or a missing ``else``,
    leaves V pending past the ``if``); a statement that does not name V (left as it is); any other statement, or the
    list's end, gets ``V = <ns>.settled(V)`` before it, and V is a tensor again. Where that walk finds a receiver, S's
    joined calls that end its paths become ``norm_act_conv_pending`` (a receiver: ``pending_norm_act_conv_pending``),
    and the walk's settles are inserted. So every read of V after S on every path is a receiver's or a settle's: the
    pending value is read by nothing else (no name of a nested scope, no ``global`` or ``nonlocal`` name, no function
    that reads frames: `_blocked`), and the statements run as before in the same order, the settles aside (a settle is
    the tensor eager's convolution returns, `PendingBias.settle`). LTX-2's resnets: ``conv1``'s joined call (on the
    branch without the timestep modulate), the ``if`` of the noise injection (off in the published configs: its branch
    settles), then the ``if`` of the modulate, whose branch without it starts with ``conv2``'s joined call (the
    receiver); that ``if`` in turn (its branches end in ``conv2``'s module call and its joined call), the second noise
    injection's ``if`` (its branch settles), the ``if`` statements of ``norm3`` and ``conv_shortcut`` (which do not name
    ``hidden_states``), then ``hidden_states = hidden_states + inputs`` (the receiving add)."""

    def __init__(self, ns: str, body: list[ast.stmt], joined: bool = True, adds: bool = True) -> None:
        self.ns, self.joined, self.adds = ns, joined, adds  # (the receivers it makes: joined calls, residual adds)
        self.blocked = _blocked(body)

    def body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        if self.blocked is None:
            return body
        for stmt in body:  # (the branches' own lists first)
            if isinstance(stmt, ast.If):
                stmt.body = self.body(stmt.body)
                stmt.orelse = self.body(stmt.orelse)
        for k, stmt in enumerate(body):
            var = _bound_var(stmt)
            if var is None or var in self.blocked or not _binds([stmt], var):
                continue
            calls = _ending_calls([stmt], var, self.ns)
            if calls and self._walk(body, k + 1, var, False):
                self._walk(body, k + 1, var, True)
                for call in calls:
                    call.value.func.attr = PENDING if call.value.func.attr == JOINED else RECEIVER_PENDING
        return body

    def _receiver(self, stmt: ast.stmt, var: str, after: ast.stmt | None) -> bool:
        """Whether `stmt` (`after`: the statement after it in its list) may take V pending: a joined call reading it,
        or its residual add (each where asked)."""
        return (self.joined and _joined_var(stmt, self.ns) == var
                or self.adds and _add_node(stmt, var, after) is not None)

    def _receive(self, stmt: ast.stmt, var: str, after: ast.stmt | None) -> None:
        """Make the receiver `stmt` take V pending: the joined call's receiving form, the add's call."""
        node = _add_node(stmt, var, after)
        if node is None:
            stmt.value.func.attr = RECEIVER
            return
        add = getattr(*node)
        setattr(*node, ast.Call(func=ast.Attribute(value=ast.Name(self.ns, ast.Load()), attr=ADD, ctx=ast.Load()),
                                args=[ast.Name("self", ast.Load()), add.left, add.right], keywords=[]))

    def _settle(self, var: str) -> ast.stmt:
        call = ast.Call(func=ast.Attribute(value=ast.Name(self.ns, ast.Load()), attr=SETTLED, ctx=ast.Load()),
                        args=[ast.Name(var, ast.Load())], keywords=[])
        return ast.Assign(targets=[ast.Name(var, ast.Store())], value=call)

    def _walk(self, body: list[ast.stmt], start: int, var: str, apply: bool) -> bool:
        """The walk of the class doc from ``body[start]`` on; whether it finds a receiver. `apply`: make the
        receivers and insert the settles (else only look)."""
        found = False
        k = start
        while k < len(body):
            stmt = body[k]
            after = body[k + 1] if k + 1 < len(body) else None
            if self._receiver(stmt, var, after):
                if apply:
                    self._receive(stmt, var, after)
                return True
            if isinstance(stmt, ast.If) and var not in names_in(stmt.test):
                through = False
                for branch in (stmt.body, stmt.orelse):
                    second = branch[1] if len(branch) > 1 else None
                    if branch and self._receiver(branch[0], var, second):
                        found = True
                        if apply:
                            self._receive(branch[0], var, second)
                    elif any(var in names_in(s) for s in branch):
                        if apply:
                            branch.insert(0, self._settle(var))
                    else:
                        through = True
                if not through:
                    return found
            elif var in names_in(stmt):
                if apply:
                    body.insert(k, self._settle(var))
                return found
            k += 1
        if apply:
            body.append(self._settle(var))
        return found


def _bound_var(stmt: ast.stmt) -> str | None:
    """The name a statement ends by binding: ``V = ...``'s V, or for an ``if`` its first branch's last statement's."""
    while isinstance(stmt, ast.If) and stmt.body:
        stmt = stmt.body[-1]
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id
    return None


def _joined_convs(fn, forms: tuple[str, ...] = (JOINED, PENDING, RECEIVER, RECEIVER_PENDING)) -> tuple[str, ...]:
    """The convolutions the joined calls of the rewritten forward `fn` name (those of the call `forms` given)."""
    return tuple(args[4].value for attr, args in forward_calls(fn)
                 if attr in forms and len(args) == 6 and isinstance(args[4], ast.Constant))


def _adds(fn) -> int:
    """How many pending residual adds (``pending_add(self, ...)``) the rewritten forward `fn` makes."""
    return sum(attr == ADD and len(args) == 3 for attr, args in forward_calls(fn))


def add_chain_sites(model: nn.Module, state: PatchState, blocks: dict[type, ChainPairCalls], takes) -> None:
    """Give each convolution that a joined call of a block names (the blocks whose class is a key of `blocks`: the
    pair subclasses, each with its calls' namespace) its calls' `ChainPairCalls.chain` site, and each that a receiving
    call names (``pending_norm_act_conv``, ``pending_norm_act_conv_pending``) its `ChainPairCalls.bias` site too,
    where ``takes(conv)`` (a class the chain op takes); and each block whose forward adds a pending result
    (``pending_add``) its `ChainPairCalls.residual` site."""
    for module in model.modules():
        calls = blocks.get(type(module))
        forward = type(module).__dict__.get("forward") if calls is not None else None
        if forward is None:
            continue
        sites = [(_joined_convs(forward), calls.chain.name)]
        if calls.bias is not None:
            sites.append((_joined_convs(forward, (RECEIVER, RECEIVER_PENDING)), calls.bias.name))
        joined = False  # (whether a convolution of this block takes a joined call: only then can a result be pending)
        for names, site in sites:
            for name in dict.fromkeys(names):
                conv = getattr(module, name, None)
                if isinstance(conv, nn.Module) and takes(conv):
                    joined = True
                    if site_attr(site) not in conv.__dict__:
                        state.add_site(conv, site, site)
        residual = None if calls.residual is None else calls.residual.name
        if residual is not None and joined and _adds(forward) and site_attr(residual) not in module.__dict__:
            state.add_site(module, residual, residual)
