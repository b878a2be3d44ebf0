"""Helper-function inlining for the chain rewriter: a block forward that writes its chains through small functions of
its own module (Kandinsky 6's ``apply_scale_shift(self.norm(x.float()), x, scale, shift)`` and ``apply_gate_sum(x,
out, gate)``, Stable Audio 3's ``_modulate(self.norm(x), shift, scale)``) gets each such call replaced by the
function's return expression, its parameters bound to the call's arguments, before the patterns run
(`_chains.rewrite_forward`); the patterns then see the chain as if the forward had written it inline.

A call is inlined only where the inlined expression computes what the call computes, by these rules (anything else
and the call stays as written):

- the callee: a name the forward never binds, whose value in the forward's module globals is a plain function of
  that very module (``__globals__`` the forward's: its free names resolve there as in the forward), with no closure,
  no decorator, no defaults, no ``*args`` / ``**kwargs`` / keyword-only parameters, not a generator or coroutine,
  whose source is provably its own (`_source.source_of`), and not a function a pattern matches by name (the
  rotary functions the adapter names);
- its body: an optional docstring, straight-line assignments to names (``t = E``, ``a, b = E1, E2``) and ``if C:``
  blocks of such (no ``else``), then ``return E``. The body becomes one expression by substitution (a name bound in
  an ``if`` becomes ``(NEW if C else OLD)``). Every expression of the body must be *deterministic and quiet*:
  names, constants, operators, attribute and subscript reads, and calls of torch functions / tensor methods known
  to write nothing and to draw no random numbers (`_DETERMINISTIC_METHODS`, `_DETERMINISTIC_FUNCTIONS`); no walrus,
  lambda, comprehension, f-string. So evaluating a part of it earlier, later or twice gives the same value, and it
  writes and binds nothing;
- its free names (``torch``, ``F``) must not be names the forward binds (they would resolve to the forward's
  locals);
- the call: positional and keyword arguments naming each parameter once (no ``*`` / ``**``). An argument that is
  a plain name may be read any number of times (nothing rebinds it: no argument binds a name); any other argument
  must be read exactly once, not under a condition (an ``if`` expression's branch, a short-circuit operand), in the
  order of the arguments; and where it is now evaluated after parts of the body, it must write nothing those parts
  read (the tensors the name arguments and the earlier arguments may hold, `_chain_proofs.Proofs`), and bind
  nothing. Python evaluates every argument before the body; the inlined expression evaluates an argument where the
  body reads it: these conditions make the two orders read the same values.

What is inlined is the function the module holds when the forward is rewritten; a rewritten forward checks on each
call that the module still holds that function with that code (`_chain_calls.stale`), and runs the forward as it was
written where it does not (a helper replaced after `patch`).
"""

from __future__ import annotations

import ast
import copy
import math
import types

import torch
import torch.nn.functional as F

from ._chain_proofs import _INPLACE_ABLE, _NS, PURE_FUNCTIONS, PURE_METHODS, Proofs, _bound_names
from ._chain_inline_stmts import StatementInliner, located, module_helper, parsed_def
from ._chain_syntax import _self_path_call

# tensor methods and torch functions that write nothing and draw no random numbers (of the rewriter's pure lists):
# a helper's own computations may run at another time, or twice, with the same result
_DETERMINISTIC_METHODS = PURE_METHODS - {"new_empty", "data_ptr", "get", "values", "items", "keys", "copy"}
_DETERMINISTIC_FUNCTIONS = PURE_FUNCTIONS - {
    "empty", "empty_like", "dropout", "print", "next", "iter", "id", "is_grad_enabled", "no_grad", "inference_mode",
    "autocast", "get_autocast_dtype", "is_autocast_enabled", "super", "callable", "getattr", "hasattr", "type", "repr"}
_MODULES = {"torch": torch, "F": F, "math": math}  # the module prefixes a helper may call through, by their value
_BUILTINS = frozenset({"len", "isinstance", "int", "float", "bool", "tuple", "list", "min", "max", "abs", "range",
                       "slice", "sum", "round", "divmod", "all", "any", "zip", "enumerate", "reversed", "sorted"})
_SCOPES = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.NamedExpr, ast.Yield,
           ast.YieldFrom, ast.Await, ast.JoinedStr, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_UNSUITABLE_FLAGS = (0x04 | 0x08 | 0x20 | 0x80 | 0x100 | 0x200)  # *args, **kwargs, generator, coroutine, async


class _Template:
    """A helper as one expression of its parameters (`params`, in order; `expr` reads each as a ``Name``)."""

    __slots__ = ("params", "expr", "free")

    def __init__(self, params: list[str], expr: ast.expr, free: set[str]) -> None:
        self.params, self.expr, self.free = params, expr, free


def _deterministic(expr: ast.expr, globals_: dict) -> bool:
    """Whether evaluating `expr` (a helper's expression over its parameters) writes nothing, binds nothing and draws
    no random numbers (see the module doc)."""
    for node in ast.walk(expr):
        if isinstance(node, _SCOPES):
            return False
        if not isinstance(node, ast.Call):
            continue
        if any(k.arg is None or k.arg == "out" or (k.arg == "inplace" and not (
                isinstance(k.value, ast.Constant) and k.value.value is False)) for k in node.keywords):
            return False
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in _MODULES:
            if globals_.get(func.value.id) is not _MODULES[func.value.id]:
                return False  # a module prefix that is not torch's (or not bound in the module at all)
            if func.attr not in _DETERMINISTIC_FUNCTIONS or (func.attr in _INPLACE_ABLE and len(node.args) > 1):
                return False
        elif isinstance(func, ast.Attribute):
            if func.attr not in _DETERMINISTIC_METHODS:
                return False
        elif isinstance(func, ast.Name):
            if func.id not in _BUILTINS or func.id in globals_:  # the builtin, not a module's name of that spelling
                return False
        else:
            return False
    return True


def _substitute(expr: ast.expr, env: dict[str, ast.expr], bound: set[str], free: set[str]) -> ast.expr | None:
    """A copy of `expr` with each name of `env` replaced by a copy of its expression; None where `expr` reads a name
    of the helper's (`bound`) that `env` lacks (maybe unbound). Other names are the helper's free names (`free`)."""
    missing = False

    class Names(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.expr:
            nonlocal missing
            if node.id in env:
                return copy.deepcopy(env[node.id])
            if node.id in bound:
                missing = True
            free.add(node.id)
            return node

    new = Names().visit(copy.deepcopy(expr))
    return None if missing else new


def _assignments(stmt: ast.stmt) -> list[tuple[str, ast.expr]] | None:
    """``[(name, value)]`` of ``name = E`` or ``a, b = E1, E2`` (each target a name, as many values), else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
        return None
    target, value = stmt.targets[0], stmt.value
    if isinstance(target, ast.Name):
        return [(target.id, value)]
    if (isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts)
            and all(isinstance(t, ast.Name) for t in target.elts)
            and len({t.id for t in target.elts}) == len(target.elts)
            and not any(isinstance(v, ast.Starred) for v in value.elts)):
        return [(t.id, v) for t, v in zip(target.elts, value.elts)]
    return None


def template_of(helper: types.FunctionType) -> _Template | None:
    """The helper as one expression of its parameters (the module doc's body rules), or None."""
    code = helper.__code__
    if (code.co_flags & _UNSUITABLE_FLAGS or code.co_freevars or code.co_kwonlyargcount
            or helper.__defaults__ or helper.__kwdefaults__):
        return None
    defn = parsed_def(helper)
    if defn is None:
        return None
    args = defn.args
    if args.vararg or args.kwarg or args.kwonlyargs or args.defaults or args.kw_defaults:
        return None
    params = [a.arg for a in (*args.posonlyargs, *args.args)]
    body = list(defn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return None
    bound = set(params) | _bound_names(ast.Module(body=body, type_ignores=[]))
    env: dict[str, ast.expr] = {p: ast.Name(p, ast.Load()) for p in params}
    free: set[str] = set()

    def assign(stmt: ast.stmt, env: dict) -> bool:
        pairs = _assignments(stmt)
        if pairs is None:
            return False
        values = [_substitute(v, env, bound, free) for _, v in pairs]  # all read before any is bound
        if any(v is None or not _deterministic(v, helper.__globals__) for v in values):
            return False
        env.update((name, v) for (name, _), v in zip(pairs, values))
        return True

    for stmt in body[:-1]:
        if isinstance(stmt, ast.If) and not stmt.orelse:
            test = _substitute(stmt.test, env, bound, free)
            if test is None or not _deterministic(test, helper.__globals__):
                return None
            inner = dict(env)
            if not all(assign(s, inner) for s in stmt.body):
                return None
            for name, value in inner.items():
                if name in env and value is env[name]:
                    continue
                if name in env:  # bound before and maybe again here: one or the other, as the test says
                    env[name] = ast.IfExp(test=copy.deepcopy(test), body=value, orelse=env[name])
                else:
                    env.pop(name, None)  # bound only here: unbound where the test is false (a read then: refused)
        elif not assign(stmt, env):
            return None
    expr = _substitute(body[-1].value, env, bound, free)
    if expr is None or not _deterministic(expr, helper.__globals__):
        return None
    return _Template(params, expr, free - set(params))


def _order(node: ast.AST, conditional: bool = False):
    """``(node, conditional)`` for the nodes of an expression in the order Python evaluates them (a node after its
    operands), `conditional` for those that may not be evaluated (an ``if`` expression's branches, the operands of
    ``and`` / ``or`` after the first)."""
    if isinstance(node, ast.IfExp):
        yield from _order(node.test, conditional)
        yield from _order(node.body, True)
        yield from _order(node.orelse, True)
    elif isinstance(node, ast.BoolOp):
        for i, value in enumerate(node.values):
            yield from _order(value, conditional or i > 0)
    elif isinstance(node, ast.Call):
        yield from _order(node.func, conditional)
        for arg in node.args:
            yield from _order(arg, conditional)
        for keyword in node.keywords:
            yield from _order(keyword.value, conditional)
    elif isinstance(node, ast.Dict):
        for key, value in zip(node.keys, node.values):
            if key is not None:
                yield from _order(key, conditional)
            yield from _order(value, conditional)
    else:
        for child in ast.iter_child_nodes(node):
            yield from _order(child, conditional)
    yield node, conditional


def _trusting(argument: ast.expr, writes) -> tuple[list[str], ast.expr]:
    """``(dumps, copy)``: the calls ``self.A(X)`` / ``self.A.B(X)`` of `argument` (the form of a norm a pattern
    fuses) that `writes(X)` (what the call, taken as writing its argument, may write) finds writing, and a copy of
    `argument` with each such call as one that writes nothing (``_NS.trusted(X)``): the inlining may take them so,
    provided a pattern then fuses each (`Inliner.proven`)."""
    dumps = []

    class Trust(ast.NodeTransformer):
        def visit_Call(self, node: ast.Call) -> ast.expr:
            dump = ast.dump(node)
            node = self.generic_visit(node)
            if _self_path_call(node) is not None and writes(node.args[0]):
                dumps.append(dump)
                return ast.Call(func=ast.Attribute(ast.Name(_NS, ast.Load()), "trusted", ast.Load()), args=node.args,
                                keywords=[])
            return node

    return dumps, Trust().visit(copy.deepcopy(argument))


class Inliner:
    """Inlines the helper calls of one forward (`function`, parsed from the source of `fn`). `exclude`: names a
    pattern matches by name (never inlined). `proofs`: the facts of the forward as written."""

    def __init__(self, fn, function: ast.FunctionDef, proofs: Proofs, exclude: frozenset[str],
                 statements: bool = True) -> None:
        self.fn, self.function, self.proofs, self.exclude = fn, function, proofs, exclude
        self.statements = statements  # the helpers called as whole statements too (`_chain_inline_stmts`)
        args = function.args
        self.locals = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                                       *(a for a in (args.vararg, args.kwarg) if a))} | _bound_names(function)
        self.helpers: dict[str, types.FunctionType] = {}  # name -> the function inlined
        self.trusted: list[str] = []  # ast.dump of the module calls an inlining took as writing nothing (`proven`)
        self._templates: dict[str, _Template | None] = {}

    def template(self, name: str) -> _Template | None:
        if name not in self._templates:
            self._templates[name] = module_helper(self.fn, name, self.locals, self.exclude, template_of)
        return self._templates[name]

    def run(self) -> ast.FunctionDef:
        """The forward with every inlinable call inlined (a new tree; `function` as it was where none is)."""
        if self.proofs.dynamic:
            return self.function
        new = copy.deepcopy(self.function)
        originals = [n for n in ast.walk(self.function) if isinstance(n, ast.stmt)]
        copies = [n for n in ast.walk(new) if isinstance(n, ast.stmt)]
        for original, stmt in zip(originals, copies):
            if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Return, ast.Expr)) \
                    and stmt.value is not None and id(original) in self.proofs.before:
                stmt.value = self._expr(stmt.value, self.proofs.before[id(original)])
        # then the helpers called as whole statements, with statements of their own (`_chain_inline_stmts`)
        if self.statements:
            statements = StatementInliner(self.fn, self.locals, self.exclude | set(self.helpers))
            if statements.run(new):
                self.helpers.update(statements.helpers)
        return new if self.helpers else self.function

    def proven(self, body: list[ast.stmt]) -> bool:
        """Whether the module calls this inlining took as writing nothing (`trusted`) are gone from `body` (the
        forward rewritten by the patterns): each is the norm of a fused op now, a module the rewriter's proofs trust
        as writing none of its inputs (the ops run only plain torch / diffusers norms without hooks, and otherwise
        the norm as written at the place the proofs checked)."""
        if not self.trusted:
            return True
        left = {ast.dump(n) for n in ast.walk(ast.Module(body=body, type_ignores=[])) if isinstance(n, ast.Call)}
        return not left.intersection(self.trusted)

    def _expr(self, expr: ast.expr, state: dict) -> ast.expr:
        inliner = self

        class Calls(ast.NodeTransformer):
            def visit_Lambda(self, node):  # another scope: its names are not the forward's
                return node

            visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_Lambda

            def visit_Call(self, node: ast.Call) -> ast.expr:
                node = self.generic_visit(node)
                if isinstance(node.func, ast.Name):
                    inlined = inliner._inline(node, state)
                    if inlined is not None:
                        return inlined
                return node

        return Calls().visit(expr)

    def _inline(self, call: ast.Call, state: dict) -> ast.expr | None:
        """The inlined expression of `call` (whose arguments are inlined already), or None (see the module doc)."""
        name = call.func.id
        template = self.template(name)
        if template is None or any(isinstance(a, ast.Starred) for a in call.args) \
                or any(k.arg is None for k in call.keywords) or len(call.args) > len(template.params):
            return None
        bound = dict(zip(template.params, call.args))
        for keyword in call.keywords:
            if keyword.arg in bound or keyword.arg not in template.params:
                return None
            bound[keyword.arg] = keyword.value
        if len(bound) != len(template.params):
            return None
        order = [*call.args, *(k.value for k in call.keywords)]  # Python evaluates them so
        if any(_bound_names(a) for a in order):
            return None  # an argument binding a name (a walrus) would change what a name argument reads later
        reads = {p: [(i, c) for i, (n, c) in enumerate(_order(template.expr))
                     if isinstance(n, ast.Name) and n.id == p and isinstance(n.ctx, ast.Load)] for p in template.params}
        moved = [p for p in template.params if not isinstance(bound[p], ast.Name)]
        if any(not reads[p] for p in template.params):
            return None  # an argument the body never reads would not be evaluated at all
        for p in moved:
            if len(reads[p]) != 1 or reads[p][0][1]:
                return None  # read twice, or maybe not at all
        positions = {p: reads[p][0][0] for p in moved}
        by_argument = sorted(moved, key=lambda p: order.index(bound[p]))
        if [positions[p] for p in by_argument] != sorted(positions[p] for p in by_argument):
            return None  # the arguments would be evaluated in another order
        for p in by_argument:  # each now runs after the body's reads before it: it must write none of what they read
            earlier = {q for q in template.params if reads[q] and reads[q][0][0] < positions[p]}
            held = set().union(*(self.proofs._tokens(bound[q], state) for q in earlier)) if earlier else set()
            if self.proofs._writes(bound[p], dict(state)) & held:
                trusted, argument = _trusting(bound[p], lambda x: self.proofs._tokens(x, state) & held)
                if not trusted or self.proofs._writes(argument, dict(state)) & held:
                    return None
                self.trusted += trusted
        env = {p: bound[p] for p in template.params}
        new = _substitute(template.expr, env, set(), set())
        self.helpers[name] = self.fn.__globals__[name]
        return located(new, call)
