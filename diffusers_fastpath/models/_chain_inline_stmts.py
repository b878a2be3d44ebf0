"""Statement inlining for the chain rewriter: a forward (or a processor's ``__call__``) that runs part of its chains in
a helper function of its own module, called as a statement (Qwen-Image 2.1's processors: ``query, key, value,
seq_len_q = _qwenimage21_prepare_qkv(attn, hidden_states, rotary_emb, ...)``, whose body projects, normalises and
rotates q and k), gets the call replaced by the helper's statements, so that the patterns see the chains as if the
forward had written them (`_chain_inline` inlines helpers that are one expression; this takes those with statements,
module calls and side effects, called as a whole statement).

The replacement runs exactly what the call runs, in the same order:

- the callee: a name the forward never binds, whose value in the forward's module globals is a plain function of that
  very module (``__globals__`` the forward's), no closure, no decorator, no ``*args`` / ``**kwargs`` / keyword-only
  parameters, not a generator or coroutine, whose source is provably its own (`_source.source_of`), not a function a
  pattern matches by name; its free names are not names the forward binds (they would read the forward's locals);
- its body (after an optional docstring): statements with no ``return`` but a last ``return E`` (or none), no nested
  scope (function, class, lambda, comprehension), no ``global`` / ``nonlocal`` / ``try`` / ``import`` / ``yield`` /
  ``await``, and no call of ``locals``, ``vars``, ``eval``, ``exec``, ``super``;
- the call: ``T = h(...)`` or ``h(...)`` as a statement, positional and keyword arguments (no ``*`` / ``**``), each
  parameter given once or left to a default that is a constant (``None``, a number, a string, a bool);
- each argument is evaluated first, in the call's order, into a fresh local (``_fp<k>_<param>``); a plain name of
  the forward stands for its parameter directly where the helper reads that parameter and never rebinds it (nothing
  between the call and the body's reads can rebind the forward's name: every name the body binds is renamed fresh);
  the helper's locals are renamed ``_fp<k>_<name>``; ``T = E`` ends it, then the fresh locals are set to ``None`` (the
  references a returning call drops).

The rewritten forward checks on each call that the module still holds the function with that code
(`_chain_calls.stale`, as for `_chain_inline`), and runs as written where it does not.
"""

from __future__ import annotations

import ast
import copy
import types

from .._source import definition
from ._chain_proofs import _bound_names

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
           ast.GeneratorExp, ast.Global, ast.Nonlocal, ast.Try, ast.Import, ast.ImportFrom, ast.Yield, ast.YieldFrom,
           ast.Await, ast.AsyncFor, ast.AsyncWith, ast.Match) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())
_DYNAMIC = frozenset({"locals", "vars", "eval", "exec", "super", "globals", "__import__"})
_UNSUITABLE_FLAGS = 0x04 | 0x08 | 0x20 | 0x80 | 0x100 | 0x200  # *args, **kwargs, generator, coroutine, async
_CONSTANTS = (type(None), bool, int, float, str)


class _Helper:
    """A helper's parameters, the constants of its defaults, its body (without the docstring and the last ``return``),
    that return's value (None: returns None), the names its body binds and reads, and its free names."""

    __slots__ = ("params", "defaults", "body", "value", "rebound", "read", "free")

    def __init__(self, params, defaults, body, value, rebound, read, free) -> None:
        self.params, self.defaults, self.body, self.value, self.rebound, self.read, self.free = (
            params, defaults, body, value, rebound, read, free)


def parsed_def(helper: types.FunctionType) -> ast.FunctionDef | None:
    """The definition of `helper` (`_source.definition`: parsed from its source where that is provably its own),
    where it is a plain ``def`` without a decorator; else None."""
    defn = definition(helper)
    return defn if isinstance(defn, ast.FunctionDef) and not defn.decorator_list else None


def helper_of(helper: types.FunctionType) -> _Helper | None:
    """The statement form of `helper` (the module doc's body rules), or None."""
    code = helper.__code__
    if code.co_flags & _UNSUITABLE_FLAGS or code.co_freevars or code.co_kwonlyargcount or helper.__kwdefaults__:
        return None
    defaults = helper.__defaults__ or ()
    if not all(type(d) in _CONSTANTS for d in defaults):
        return None
    defn = parsed_def(helper)
    if defn is None:
        return None
    args = defn.args
    if args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs:
        return None
    params = [a.arg for a in args.args]
    body = list(defn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    value = None
    if body and isinstance(body[-1], ast.Return):
        value, body = body[-1].value, body[:-1]
    if not body and value is None:
        return None
    module = ast.Module(body=[*body, *([ast.Expr(value)] if value is not None else [])], type_ignores=[])
    for node in ast.walk(module):
        if isinstance(node, (*_SCOPES, ast.Return)):
            return None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _DYNAMIC:
            return None
    rebound = _bound_names(module)
    read = {n.id for n in ast.walk(module) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    free = {n.id for n in ast.walk(module) if isinstance(n, ast.Name)} - set(params) - rebound
    return _Helper(params, dict(zip(params[len(params) - len(defaults):], defaults)), body, value, rebound, read, free)


def module_helper(fn, name: str, locals_: set[str], exclude: frozenset[str], form_of):
    """``form_of(helper)`` for the helper that `fn`'s module holds under `name`, where it may be inlined into `fn`
    at all: a name `fn` never binds nor a pattern takes by name, a plain function (no wrapper) of `fn`'s own module,
    whose form reads no name `fn` binds (it would read `fn`'s local of that name); else None."""
    globals_ = fn.__globals__
    helper = globals_.get(name)
    if (name in locals_ or name in exclude or not isinstance(helper, types.FunctionType)
            or helper.__globals__ is not globals_ or hasattr(helper, "__wrapped__")):
        return None
    form = form_of(helper)
    return None if form is None or form.free & locals_ else form


class _Rename(ast.NodeTransformer):
    def __init__(self, names: dict[str, ast.expr]) -> None:
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.expr:
        new = self.names.get(node.id)
        if new is None:
            return node
        return ast.copy_location(ast.Name(new.id, node.ctx), node)


class StatementInliner:
    """Inlines the statement calls of helpers in one forward (a tree, changed in place by `run`). `locals`: the names
    the forward binds (parameters included); `exclude`: names a pattern matches by name (never inlined)."""

    def __init__(self, fn, locals_: set[str], exclude: frozenset[str]) -> None:
        self.fn, self.locals, self.exclude = fn, locals_, exclude
        self.helpers: dict[str, types.FunctionType] = {}  # name -> the function inlined
        self._forms: dict[str, _Helper | None] = {}
        self._count = 0

    def form(self, name: str) -> _Helper | None:
        if name not in self._forms:
            self._forms[name] = module_helper(self.fn, name, self.locals, self.exclude, helper_of)
        return self._forms[name]

    def run(self, function: ast.FunctionDef) -> bool:
        """Inline every statement call of a helper in `function` (in every block of it); whether any was."""
        names = {n.id for n in ast.walk(function) if isinstance(n, ast.Name)}
        self._taken = names | self.locals
        self._blocks(function)
        return bool(self.helpers)

    def _blocks(self, node: ast.AST) -> None:
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list) or not stmts or not isinstance(stmts[0], ast.stmt):
                continue
            out = []
            for stmt in stmts:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    out.append(stmt)  # another scope: its names are not the forward's
                    continue
                self._blocks(stmt)
                for handler in getattr(stmt, "handlers", ()):
                    self._blocks(handler)
                out.extend(self._inline(stmt) or [stmt])
            setattr(node, field, out)

    def _fresh(self, k: int, name: str) -> str:
        new = f"_fp{k}_{name}"
        while new in self._taken:
            new += "_"
        self._taken.add(new)
        return new

    def _inline(self, stmt: ast.stmt) -> list[ast.stmt] | None:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            call = stmt.value
        elif isinstance(stmt, ast.Expr):
            call = stmt.value
        else:
            return None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
            return None
        form = self.form(call.func.id)
        if form is None or any(isinstance(a, ast.Starred) for a in call.args) \
                or any(k.arg is None for k in call.keywords) or len(call.args) > len(form.params):
            return None
        given = list(zip(form.params, call.args))
        for keyword in call.keywords:
            if keyword.arg not in form.params or keyword.arg in dict(given):
                return None
            given.append((keyword.arg, keyword.value))
        if any(_bound_names(value) for _, value in given):
            return None  # an argument binding a name (a walrus)
        missing = [p for p in form.params if p not in dict(given)]
        if any(p not in form.defaults for p in missing):
            return None
        k, self._count = self._count, self._count + 1
        names: dict[str, ast.Name] = {}
        out: list[ast.stmt] = []
        fresh: list[str] = []
        for param, value in given:  # Python evaluates the arguments first, in the order written
            if isinstance(value, ast.Name) and param in form.read and param not in form.rebound:
                names[param] = ast.Name(value.id, ast.Load())  # the forward's name, which nothing rebinds here
                continue
            names[param] = ast.Name(self._fresh(k, param), ast.Load())
            fresh.append(names[param].id)
            out.append(ast.copy_location(ast.Assign(targets=[ast.Name(names[param].id, ast.Store())],
                                                    value=copy.deepcopy(value)), stmt))
        for param in missing:
            names[param] = ast.Name(self._fresh(k, param), ast.Load())
            fresh.append(names[param].id)
            out.append(ast.copy_location(ast.Assign(targets=[ast.Name(names[param].id, ast.Store())],
                                                    value=ast.Constant(form.defaults[param])), stmt))
        for name in sorted(form.rebound - set(form.params)):
            names[name] = ast.Name(self._fresh(k, name), ast.Load())
            fresh.append(names[name].id)
        rename = _Rename(names)
        for inner in form.body:
            out.append(located(rename.visit(copy.deepcopy(inner)), stmt))
        value = rename.visit(copy.deepcopy(form.value)) if form.value is not None else ast.Constant(None)
        if isinstance(stmt, ast.Assign):
            last = ast.Assign(targets=[copy.deepcopy(stmt.targets[0])], value=value)
        else:
            last = ast.Expr(value)
        out.append(located(last, stmt))
        if fresh:  # the references the returning call would drop
            out.append(located(ast.Assign(targets=[ast.Name(n, ast.Store()) for n in fresh],
                                           value=ast.Constant(None)), stmt))
        self.helpers[call.func.id] = self.fn.__globals__[call.func.id]
        return out


def located(node: ast.AST, at: ast.AST) -> ast.AST:
    """`node` with every node in it at `at`'s place in the source (the inliners' replacements)."""
    for child in ast.walk(node):
        ast.copy_location(child, at)
    return node
