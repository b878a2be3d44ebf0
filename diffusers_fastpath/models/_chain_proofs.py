"""What the chain rewriter (`_rewriter`) proves before it moves or drops anything: that no read sees another value.

A rewrite keeps every statement's *values*, but some forms change *when* a computation runs or *whether* a name is
bound: the deferred-norm form runs a LayerNorm at its modulate, statements later; the two-statement gated residual
no longer binds the product's name; the GELU + concatenation form runs the GELU at the concatenation. Each is exact
only if nothing in between writes what the moved computation reads, and nothing afterwards reads the dropped name.
`Proofs` answers those two questions for one forward, from its AST, conservatively: where it cannot tell, it says
"unsafe" and the statement stays as written.

The model (what "write" and "read" mean here):

- A name is rebound by any binding of it anywhere inside a statement (assignment, augmented assignment, ``del``,
  walrus, ``for`` / ``with`` / ``except`` targets, imports, ``def``).
- A tensor is written in place by a method whose name ends in ``_`` (PyTorch's convention), by a call with ``out=``,
  by a call with ``inplace=`` anything but ``False``, by an augmented assignment (``x += y`` writes ``x``), by a store
  into an attribute or a subscript of it (``x[0] = ...``, ``x.data = ...``), and by *any call not known to write
  nothing* that takes it as an argument (an unknown function may write its arguments in place). A call of a method of
  the forward's own module (``self.norm2(c)``, a processor's ``attn.to_q(x)``) writes its arguments, not the module.
- Which names may share a tensor's storage is followed through the forward, statement by statement, as *tokens*: a
  parameter is its own token, every value a call or an operator makes is a new one (per call site), a view
  (``x[...]``, ``x.view(...)``, ``x.chunk(...)``, ``x.to(...)``: anything that may return ``x`` or its storage) has
  the tokens of what it views, a call that writes in place those of what it wrote (``x.add_(y)``, ``out=``,
  ``inplace=True`` return it), a tuple those of its items, an object the tokens of what is stored into it; branches
  merge, loops run to a fixed point. A write through one name reaches every name holding one of its tokens.
- A read of a name that a rewrite drops may come from anywhere after it: later in its block, after the enclosing
  ``if`` / ``for`` / ``with`` / ``try`` (up to the function's end), in the next iteration of an enclosing loop, in an
  exception handler, or in a nested function or lambda (which may run at any time: such a name is never dropped).
  ``locals()``, ``vars()``, ``eval``, ``exec``, ``global`` and ``nonlocal`` make every name readable: nothing is
  dropped in such a forward.

What the model takes on trust (stated so that a reader can judge it): a call's result is a new tensor unless the call
is a view (a module returning its very input, ``nn.Identity``, is not followed); two parameters of the forward are
not the same tensor; what a call stores and another call writes later (outside this forward's code) is not followed;
the module a pattern replaces (the LayerNorm, the GELU) writes none of its inputs (the fused ops run only plain
torch / diffusers modules without hooks; any other runs as written).
"""

from __future__ import annotations

import ast

_NS = "_diffusers_fastpath_chains"  # the rewritten forwards' namespace (`_chain_syntax._NS`): its calls write nothing
_ORIGIN = "_fastpath_origin"  # set on the statements of the copy being rewritten: the index of the original

# methods whose result may be the receiver or share its storage (views, and conversions that return ``self`` where
# nothing changes)
VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "unsqueeze", "squeeze", "expand", "expand_as",
    "chunk", "split", "tensor_split", "unbind", "narrow", "select", "flatten", "unflatten", "movedim", "moveaxis",
    "swapaxes", "swapdims", "t", "diagonal", "as_strided", "detach", "contiguous", "to", "type", "type_as", "float",
    "half", "bfloat16", "double", "long", "int", "bool", "cpu", "cuda", "real", "imag", "view_as_real", "unfold",
    "get", "values", "items", "keys"})
# methods whose result is always a view of the receiver (never a copy: not ``reshape``, ``flatten``, ``contiguous`` or
# the conversions, which copy where they change something)
ALIAS_METHODS = frozenset({"view", "transpose", "permute", "unsqueeze", "squeeze", "expand", "chunk", "split",
                           "unbind", "narrow", "select", "unflatten", "movedim", "moveaxis", "swapaxes", "swapdims", "t",
                           "diagonal", "detach"})
# methods that write none of their operands (absent ``out=`` / ``inplace=``)
PURE_METHODS = VIEW_METHODS | frozenset({
    "add", "sub", "mul", "div", "pow", "neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "abs", "sum", "mean",
    "var", "std", "max", "min", "amax", "amin", "norm", "softmax", "matmul", "bmm", "mm", "clone", "size", "dim",
    "numel", "item", "tolist", "repeat", "repeat_interleave", "masked_fill", "where", "clamp", "square", "reciprocal",
    "cumsum", "any", "all", "sort", "argsort", "topk", "gather", "flip", "roll", "new_zeros", "new_ones", "new_empty",
    "new_full", "new_tensor", "stride", "is_contiguous", "data_ptr", "startswith", "endswith", "format", "join",
    "count", "index", "copy"})
# functions of these modules, and builtins, that write none of their operands (absent ``out=`` / ``inplace=``)
_MODULES = frozenset({"torch", "F", "math", "nn", "functional"})
PURE_FUNCTIONS = frozenset({
    "cat", "concat", "stack", "zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like", "full_like",
    "arange", "linspace", "tensor", "as_tensor", "where", "matmul", "einsum", "bmm", "baddbmm", "addmm", "exp", "sin",
    "cos", "tanh", "sigmoid", "sqrt", "rsqrt", "silu", "gelu", "relu", "softmax", "log_softmax", "pad", "linear",
    "layer_norm", "rms_norm", "group_norm", "scaled_dot_product_attention", "dropout", "interpolate", "view_as_complex",
    "view_as_real", "polar", "outer", "broadcast_to", "split", "chunk", "unbind", "flatten", "unflatten", "transpose",
    "permute", "reshape", "squeeze", "unsqueeze", "narrow", "is_tensor", "is_grad_enabled", "no_grad",
    "inference_mode", "autocast", "get_autocast_dtype", "is_autocast_enabled", "finfo", "iinfo", "promote_types",
    "result_type", "mean", "sum", "max", "min", "clamp", "abs", "ceil", "floor", "pi", "sqrt", "isfinite", "isnan",
    "len", "isinstance", "issubclass", "range", "int", "float", "bool", "str", "tuple", "list", "dict", "set",
    "frozenset", "min", "max", "abs", "sum", "zip", "enumerate", "getattr", "hasattr", "iter", "next", "reversed",
    "sorted", "any", "all", "repr", "type", "id", "divmod", "round", "slice", "print", "callable", "super"})
# ... of which these take ``inplace`` as a positional argument too (``F.relu(x, True)``): pure with one argument only
_INPLACE_ABLE = frozenset({"relu", "silu", "dropout", "elu", "selu", "celu", "leaky_relu", "hardtanh", "relu6",
                           "hardswish", "hardsigmoid", "mish", "threshold", "rrelu", "alpha_dropout"})
_VIEW_FUNCTIONS = frozenset({"split", "chunk", "unbind", "flatten", "unflatten", "transpose", "permute", "reshape",
                             "squeeze", "unsqueeze", "narrow", "broadcast_to", "view_as_real", "view_as_complex"})
_CONTAINER_FUNCTIONS = frozenset({"tuple", "list", "iter", "next", "reversed", "zip", "enumerate", "getattr",
                                  "sorted", "dict", "set", "frozenset"})
_DYNAMIC = frozenset({"locals", "vars", "eval", "exec", "globals", "dir", "__import__"})

_NONE: frozenset = frozenset()
_TRY = (ast.Try, ast.TryStar) if hasattr(ast, "TryStar") else (ast.Try,)
# the ``match`` statement's nodes (Python 3.10+; none before)
_MATCH, _CASE = getattr(ast, "Match", ()), getattr(ast, "match_case", ())
_CASE_TYPES = (_CASE,) if _CASE else ()
_MATCH_TYPES = (_MATCH,) if _MATCH else ()
_CAPTURES = tuple(getattr(ast, n) for n in ("MatchAs", "MatchStar", "MatchMapping") if hasattr(ast, n))


def _merge(*states: dict) -> dict:
    out: dict = {}
    for state in states:
        for name, tokens in state.items():
            out[name] = out.get(name, _NONE) | tokens
    return out


def _root(node: ast.expr) -> str | None:
    """The name an attribute / subscript / call chain starts from (``self`` of ``self.a[0].b``), or None."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call, ast.Starred)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_false(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def _bound_names(node: ast.AST) -> set[str]:
    """Every name a statement (or expression) binds or deletes, in any block of it."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            names.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names.add(n.name)
        elif isinstance(n, ast.alias):
            names.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, _CAPTURES) and (getattr(n, "name", None) or getattr(n, "rest", None)):
            names.add(getattr(n, "name", None) or n.rest)
    return names


def _reads(node: ast.AST, name: str) -> bool:
    """Whether `node` reads `name` (a load, a ``del``, or ``name += ...``), in any block or nested scope of it."""
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id == name and not isinstance(n.ctx, ast.Store):
            return True
        if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name) and n.target.id == name:
            return True
    return False


def _binds_first(stmt: ast.stmt, name: str) -> bool:
    """Whether `stmt` surely rebinds `name` (a plain assignment to it) without reading it first."""
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        targets = [stmt.target]
    else:
        return False
    plain = set()
    for target in targets:
        todo = [target]
        while todo:
            t = todo.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                todo.extend(t.elts)
            elif isinstance(t, ast.Starred):
                todo.append(t.value)
            elif isinstance(t, ast.Name):
                plain.add(t.id)
    return name in plain and not _reads(stmt, name)


def _jumps(stmt: ast.stmt) -> bool:
    """Whether control may leave `stmt` other than by its end (``break``, ``continue``, ``return``, ``raise``)."""
    return any(isinstance(n, (ast.Break, ast.Continue, ast.Return, ast.Raise)) for n in ast.walk(stmt))


class Proofs:
    """The facts about one forward (`function`, its original AST) that the rewriter's proofs read. `roots` are the
    names of the modules whose methods the forward calls (``self``, and a processor's attention module)."""

    def __init__(self, function: ast.FunctionDef, roots: set[str], pure: frozenset[str] = frozenset()) -> None:
        self.function, self.roots = function, roots
        self.pure = PURE_FUNCTIONS | pure  # and the functions the rewriter checked (diffusers' rotary embeddings)
        self.statements: list[ast.stmt] = []  # the originals, by the index a copy's statements carry
        self.parent: dict[int, tuple[ast.AST, str, int]] = {}  # id(node) -> (parent, field, index)
        self.before: dict[int, dict] = {}  # id(stmt) -> the tokens each name may hold when the statement starts
        self.own_writes: dict[int, frozenset] = {}  # id(stmt) -> tokens its own expressions may write in place
        self.captured: set[str] = set()  # names a nested function or lambda reads
        self.dynamic = False  # locals() / eval / global ...: any name may be read unseen
        self._loops: list[tuple[list, list]] = []
        self._index(function)
        args = function.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs, *(a for a in (args.vararg, args.kwarg) if a)]
        self._block(function.body, {a.arg: frozenset({("param", a.arg)}) for a in params})

    # --- the copy being rewritten -------------------------------------------------------------------------------
    def tag(self, body: list[ast.stmt]) -> None:
        """Mark each statement of `body` (a deep copy of the function's body) with the original it copies; the mark
        survives further copies, and `like` hands it to a statement that replaces one."""
        originals = ast.walk(ast.Module(body=self.function.body, type_ignores=[]))
        copies = ast.walk(ast.Module(body=body, type_ignores=[]))
        for original, copied in zip(originals, copies):
            if isinstance(original, ast.stmt):
                setattr(copied, _ORIGIN, len(self.statements))
                self.statements.append(original)

    def origin(self, stmt: ast.AST) -> ast.stmt | None:
        index = getattr(stmt, _ORIGIN, None)
        return self.statements[index] if index is not None else None

    # --- questions ----------------------------------------------------------------------------------------------
    def stays(self, inputs: list[ast.expr], at: ast.stmt, stmts: list[ast.stmt] = (), exprs: list[ast.expr] = (),
              where: ast.stmt | None = None, *, by_name: bool = True, skip: list[ast.stmt] = ()) -> bool:
        """Whether a computation reading `inputs` where statement `at` starts reads the same values after the
        statements `stmts` ran and the expressions `exprs` (parts of statement `where`, default `at`) were
        evaluated: none of the tensors they may hold is written there, and (`by_name`: the computation reads the
        names again, not the objects it took at `at`) none of the names is rebound. The statements of `skip` (the
        pattern's own, whose effects the rewriter knows) write nothing."""
        start = self.origin(at)
        state = self.before.get(id(start)) if start is not None else None
        if state is None:
            return False
        names = {n.id for e in inputs for n in ast.walk(e) if isinstance(n, ast.Name)}
        tokens = _NONE.union(*(self._tokens(e, state) for e in inputs))
        written: set = set()
        skipped = {id(self.origin(s)) for s in skip}
        for stmt in stmts:
            original = self.origin(stmt)
            if original is None or id(original) not in self.before:
                return False
            if by_name and _bound_names(original) & names:
                return False
            for node in ast.walk(original):
                if isinstance(node, ast.stmt) and id(node) not in skipped:
                    written |= self.own_writes.get(id(node), _NONE)
        if exprs:
            context = self.origin(where or at)
            state = self.before.get(id(context)) if context is not None else None
            if state is None:
                return False
            for expr in exprs:
                if by_name and _bound_names(expr) & names:
                    return False
                written |= self._writes(expr, dict(state))
        return not (tokens & written)

    def unread(self, inputs: list[ast.expr], at: ast.stmt, stmts: list[ast.stmt]) -> bool:
        """Whether the statements `stmts` read none of the tensors `inputs` may hold where statement `at` starts: a
        call on `inputs` moved from `at` to after them (any module: one that writes its input in place too) then
        leaves what they read as it was."""
        start = self.origin(at)
        state = self.before.get(id(start)) if start is not None else None
        if state is None or self.dynamic:
            return False
        tokens = _NONE.union(*(self._tokens(e, state) for e in inputs))
        for stmt in stmts:
            original = self.origin(stmt)
            if original is None:
                return False
            for node in ast.walk(original):
                if not isinstance(node, ast.stmt):
                    continue
                before = self.before.get(id(node))
                if before is None:
                    return False
                if any(isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and self._tokens(n, before) & tokens
                       for n in ast.walk(node)):
                    return False
        return True

    def quiet(self, expr: ast.expr) -> bool:
        """Whether evaluating `expr` writes nothing and binds nothing: only names, constants, operators and calls
        known to write nothing (so evaluating it earlier, later, once or twice is all the same)."""
        for node in ast.walk(expr):
            if isinstance(node, (ast.NamedExpr, ast.Yield, ast.YieldFrom, ast.Await, ast.Lambda)):
                return False
            if isinstance(node, ast.Call) and not self._pure_call(node):
                return False
        return True

    @staticmethod
    def aliases_only(expr: ast.expr) -> bool:
        """Whether `expr`'s value holds no number computed when it is evaluated: a name, a constant, an attribute or
        a basic-indexing subscript (constants, slices, ``None``, ``...``) of one, or a view method of one
        (`ALIAS_METHODS`). Evaluated before a call instead of after it, such a value still sees whatever that call
        writes in place (the same storage), so the call may move after it (a module that writes its input: the
        LayerNorm + modulate forms take any ``self.A``)."""
        node = expr
        while True:
            if isinstance(node, (ast.Name, ast.Constant)):
                return True
            if isinstance(node, ast.Attribute):
                node = node.value
            elif isinstance(node, ast.Subscript):
                index = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                if not all(isinstance(i, ast.Constant) or (isinstance(i, ast.Slice) and all(
                        b is None or isinstance(b, ast.Constant) or (isinstance(b, ast.UnaryOp)
                                                                      and isinstance(b.operand, ast.Constant))
                        for b in (i.lower, i.upper, i.step)))
                        or (isinstance(i, ast.UnaryOp) and isinstance(i.operand, ast.Constant)) for i in index):
                    return False
                node = node.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ALIAS_METHODS and not node.keywords
                  and all(isinstance(a, ast.Constant) or (isinstance(a, ast.UnaryOp) and isinstance(a.operand, ast.Constant))
                          or (isinstance(a, ast.Tuple) and all(isinstance(e, ast.Constant) for e in a.elts))
                          for a in node.args)):
                node = node.func.value
            else:
                return False

    def live_after(self, stmt: ast.stmt, name: str, ignore: ast.stmt | None = None) -> bool:
        """Whether the value `name` holds when statement `stmt` (of the copy) ends may be read later: in the rest of
        its block, after each enclosing block, in the next iteration of an enclosing loop or in an exception handler
        (a read in `ignore`, a statement of the copy, does not count). True wherever that cannot be told."""
        node = self.origin(stmt)
        skip = self.origin(ignore) if ignore is not None else None
        if node is None or (ignore is not None and skip is None) or self.dynamic or name in self.captured:
            return True
        while id(node) in self.parent:
            parent, field, index = self.parent[id(node)]
            verdict = self._scan(getattr(parent, field)[index + 1:], name, skip)
            if verdict != "open":
                return verdict == "read"
            if isinstance(parent, (ast.For, ast.AsyncFor, ast.While)) and field == "body":  # the next iteration
                if isinstance(parent, ast.While) and _reads(parent.test, name):
                    return True
                rebound = isinstance(parent, (ast.For, ast.AsyncFor)) and name in _bound_names(parent.target)
                if not rebound and self._scan(parent.body, name, skip) == "read":
                    return True
                if self._scan(parent.orelse, name, skip) == "read":
                    return True
            if isinstance(parent, ast.ExceptHandler):
                parent, field, _ = self.parent[id(parent)]
            if isinstance(parent, _CASE):
                parent, _, _ = self.parent[id(parent)]
            if isinstance(parent, _TRY) and self._handlers_read(parent, field, name):
                return True
            node = parent
        return False

    def handlers_read(self, stmt: ast.stmt, name: str) -> bool:
        """Whether an exception raised in statement `stmt` (of the copy) may reach a handler (or ``finally``) of
        this function that reads `name`. True where that cannot be told."""
        node = self.origin(stmt)
        if node is None or self.dynamic or name in self.captured:
            return True
        while id(node) in self.parent:
            parent, field, _ = self.parent[id(node)]
            if isinstance(parent, ast.ExceptHandler):
                parent, field, _ = self.parent[id(parent)]
            if isinstance(parent, _TRY) and self._handlers_read(parent, field, name):
                return True
            node = parent
        return False

    # --- reads -----------------------------------------------------------------------------------------------
    @staticmethod
    def _handlers_read(try_: ast.Try, field: str, name: str) -> bool:
        clauses = [*try_.handlers, *try_.finalbody, *(try_.orelse if field == "body" else ())]
        return any(_reads(c, name) for c in clauses)

    @classmethod
    def _scan(cls, stmts: list[ast.stmt], name: str, skip: ast.stmt | None) -> str:
        """``"read"`` if straight through `stmts` `name` may be read before it is surely rebound, ``"bound"`` if it
        is surely rebound first, ``"open"`` if neither (control may go on past their end)."""
        jumped = False
        for stmt in stmts:
            verdict = "open" if stmt is skip else cls._scan_one(stmt, name, skip)
            if verdict == "read" or (verdict == "bound" and not jumped):
                return verdict
            jumped = jumped or _jumps(stmt)  # a break / continue / return before the rebinding may skip it
        return "open"

    @classmethod
    def _scan_one(cls, stmt: ast.stmt, name: str, skip: ast.stmt | None) -> str:
        """`_scan` of one statement, through the blocks of an ``if`` (both bind: bound), a ``with`` and a loop (which
        may not run: never bound); any other compound statement that mentions `name` reads it."""
        if isinstance(stmt, ast.If):
            if _reads(stmt.test, name):
                return "read"
            branches = {cls._scan(stmt.body, name, skip), cls._scan(stmt.orelse, name, skip)}
            return "read" if "read" in branches else "bound" if branches == {"bound"} else "open"
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            if any(_reads(item, name) for item in stmt.items):
                return "read"
            return cls._scan(stmt.body, name, skip)
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            head = stmt.iter if isinstance(stmt, (ast.For, ast.AsyncFor)) else stmt.test
            if _reads(head, name) or any(_reads(s, name) for s in stmt.orelse):
                return "read"
            if isinstance(stmt, (ast.For, ast.AsyncFor)) and name in _bound_names(stmt.target):
                return "open"  # the body reads the loop's own value
            return "read" if cls._scan(stmt.body, name, skip) == "read" else "open"
        if isinstance(stmt, (*_TRY, *_MATCH_TYPES, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return "read" if _reads(stmt, name) else "open"
        if _reads(stmt, name):
            return "read"
        return "bound" if _binds_first(stmt, name) else "open"

    def _index(self, function: ast.FunctionDef) -> None:
        for node in ast.walk(function):
            nested = isinstance(node, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if nested and node is not function:
                body = node.body if isinstance(node.body, list) else [node.body]
                self.captured |= {n.id for b in body for n in ast.walk(b) if isinstance(n, ast.Name)}
            if isinstance(node, (ast.Global, ast.Nonlocal)):
                self.dynamic = True
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _DYNAMIC:
                self.dynamic = True
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    for i, child in enumerate(children):
                        if isinstance(child, (ast.stmt, ast.ExceptHandler, *_CASE_TYPES)):
                            self.parent[id(child)] = (node, field, i)

    # --- writes: the tokens each name may hold, statement by statement ---------------------------------------
    def _pure_call(self, call: ast.Call) -> bool:
        func = call.func
        if any(k.arg == "out" or (k.arg == "inplace" and not _is_false(k.value)) for k in call.keywords):
            return False
        if isinstance(func, ast.Attribute):
            if isinstance(func.value, ast.Name) and func.value.id == _NS:
                return True
            if isinstance(func.value, ast.Name) and func.value.id in _MODULES:
                return func.attr in PURE_FUNCTIONS and (func.attr not in _INPLACE_ABLE or len(call.args) <= 1)
            return func.attr in PURE_METHODS
        return isinstance(func, ast.Name) and func.id in self.pure

    def _tokens(self, node: ast.expr, state: dict) -> frozenset:
        """The tokens of the tensors (or containers) the value of `node` may be or share storage with."""
        if isinstance(node, ast.Name):
            return state.get(node.id, frozenset({("global", node.id)}))
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
            return self._tokens(node.value, state)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return _NONE.union(*(self._tokens(e, state) for e in node.elts))
        if isinstance(node, ast.Dict):
            return _NONE.union(*(self._tokens(e, state) for e in node.values))
        if isinstance(node, ast.IfExp):
            return self._tokens(node.body, state) | self._tokens(node.orelse, state)
        if isinstance(node, ast.BoolOp):
            return _NONE.union(*(self._tokens(e, state) for e in node.values))
        if isinstance(node, ast.NamedExpr):
            return self._tokens(node.value, state)
        if isinstance(node, ast.Call):
            func = node.func
            fresh = frozenset({("new", id(node))})
            out = [k.value for k in node.keywords if k.arg == "out"]
            if out:  # a call writing into `out=` returns it
                return self._tokens(out[0], state) | fresh
            positional = (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                          and func.value.id in _MODULES and func.attr in _INPLACE_ABLE and len(node.args) > 1)
            if positional or any(k.arg == "inplace" and not _is_false(k.value) for k in node.keywords):
                return _NONE.union(*(self._tokens(a, state) for a in node.args)) | fresh  # ... or its written input
            if isinstance(func, ast.Attribute) and func.attr.endswith("_") and not func.attr.startswith("_"):
                return self._tokens(func.value, state) | fresh  # x.add_(y) returns x
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in _MODULES:
                if func.attr in _VIEW_FUNCTIONS and node.args:
                    return self._tokens(node.args[0], state)
            elif isinstance(func, ast.Attribute) and func.attr in VIEW_METHODS:
                return self._tokens(func.value, state) | frozenset({("new", id(node))})
            elif isinstance(func, ast.Name) and func.id in _CONTAINER_FUNCTIONS:
                return _NONE.union(*(self._tokens(a, state) for a in node.args))
        return frozenset({("new", id(node))})

    def _writes(self, expr: ast.AST, state: dict) -> set:
        """The tokens evaluating `expr` may write in place; applies its walruses (and what unknown methods may store
        in their receiver) to `state`."""
        written: set = set()
        for node in ast.walk(expr):
            if isinstance(node, ast.NamedExpr):
                state[node.target.id] = self._tokens(node.value, state)
            if not isinstance(node, ast.Call) or self._pure_call(node):
                continue
            func = node.func
            operands = [*node.args, *(k.value for k in node.keywords)]
            method = isinstance(func, ast.Attribute) and not (
                isinstance(func.value, ast.Name) and func.value.id in _MODULES | {_NS})
            if method and func.attr.endswith("_") and not func.attr.startswith("_"):
                written |= self._tokens(func.value, state)  # x.add_(y) writes x
                continue
            for operand in operands:
                written |= self._tokens(operand, state)
            if method and _root(func.value) not in self.roots:  # an unknown method of a value may write it...
                receiver = self._tokens(func.value, state)
                written |= receiver
                root = _root(func.value)
                if root is not None and root in state:  # ... and keep its arguments (``items.append(x)``)
                    state[root] = state[root] | _NONE.union(*(self._tokens(a, state) for a in operands))
        return written

    def _bind(self, target: ast.expr, tokens: frozenset, state: dict, written: set, value: ast.expr | None) -> None:
        if isinstance(target, ast.Name):
            state[target.id] = tokens
        elif isinstance(target, (ast.Tuple, ast.List)):
            fresh = isinstance(value, ast.Call) and tokens == frozenset({("new", id(value))})
            for i, elt in enumerate(target.elts):  # the items a call returns are new tensors each
                self._bind(elt, frozenset({("new", id(value), i)}) if fresh else tokens, state, written, None)
        elif isinstance(target, ast.Starred):
            self._bind(target.value, tokens, state, written, None)
        elif isinstance(target, (ast.Attribute, ast.Subscript)):  # a store into an object writes it, and keeps it
            written |= self._tokens(target.value, state)
            root = _root(target.value)
            if root is not None and root in state:
                state[root] = state[root] | tokens

    def _record(self, stmt: ast.stmt, state: dict, written: set) -> None:
        key = id(stmt)
        self.before[key] = _merge(self.before[key], state) if key in self.before else dict(state)
        self.own_writes[key] = self.own_writes.get(key, _NONE) | frozenset(written)

    def _block(self, stmts: list[ast.stmt], state: dict) -> dict:
        for stmt in stmts:
            state = self._stmt(stmt, state)
        return state

    def _stmt(self, stmt: ast.stmt, state: dict) -> dict:
        entry, state, written = dict(state), dict(state), set()
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            if stmt.value is not None:
                written |= self._writes(stmt.value, state)
                tokens = self._tokens(stmt.value, state)
                for target in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]):
                    written |= self._writes(target, state) if not isinstance(target, ast.Name) else set()
                    self._bind(target, tokens, state, written, stmt.value)
        elif isinstance(stmt, ast.AugAssign):
            written |= self._writes(stmt.value, state)
            target = stmt.target
            if isinstance(target, ast.Name):
                written |= state.get(target.id, _NONE)  # ``x += y`` writes a tensor x in place
                state[target.id] = state.get(target.id, _NONE) | frozenset({("new", id(stmt))})
            else:
                written |= self._writes(target, state) | self._tokens(target.value, state)
        elif isinstance(stmt, ast.Delete):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    state.pop(target.id, None)
                else:
                    written |= self._writes(target, state) | self._tokens(target.value, state)
        elif isinstance(stmt, (ast.Expr, ast.Return, ast.Raise, ast.Assert)):
            for child in ast.iter_child_nodes(stmt):
                written |= self._writes(child, state)
        elif isinstance(stmt, ast.If):
            written |= self._writes(stmt.test, state)
            self._record(stmt, entry, written)
            return _merge(self._block(stmt.body, dict(state)), self._block(stmt.orelse, dict(state)))
        elif isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            head = stmt.iter if isinstance(stmt, (ast.For, ast.AsyncFor)) else stmt.test
            written |= self._writes(head, state)
            self._record(stmt, entry, written)
            return self._loop(stmt, state)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                written |= self._writes(item.context_expr, state)
                if item.optional_vars is not None:
                    self._bind(item.optional_vars, self._tokens(item.context_expr, state), state, written, None)
            self._record(stmt, entry, written)
            return self._block(stmt.body, state)
        elif isinstance(stmt, _TRY):
            self._record(stmt, entry, written)
            body = self._block(stmt.body, dict(state))
            after = _merge(state, body)  # a handler may start anywhere in the body
            handled = []
            for handler in stmt.handlers:
                inner = dict(after)
                if handler.name:
                    inner[handler.name] = frozenset({("new", id(handler))})
                handled.append(self._block(handler.body, inner))
            out = _merge(self._block(stmt.orelse, body), *handled, after)
            return self._block(stmt.finalbody, out)
        elif isinstance(stmt, _MATCH):
            written |= self._writes(stmt.subject, state)
            self._record(stmt, entry, written)
            cases = []
            for case in stmt.cases:
                inner = dict(state)
                for name in _bound_names(case.pattern):
                    inner[name] = self._tokens(stmt.subject, state)
                cases.append(self._block(case.body, inner))
            return _merge(state, *cases)
        elif isinstance(stmt, (ast.Break, ast.Continue)):
            if self._loops:
                self._loops[-1][isinstance(stmt, ast.Continue)].append(dict(state))
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            state[stmt.name] = frozenset({("new", id(stmt))})
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for name in _bound_names(stmt):
                state[name] = frozenset({("global", name)})
        self._record(stmt, entry, written)
        return state

    def _loop(self, stmt: ast.stmt, state: dict) -> dict:
        """A loop's states: its body run from the merge of the entry and every way back, to a fixed point (tokens are
        finite: at most one per call site)."""
        entry, breaks = dict(state), []
        for _ in range(16):
            inner = dict(entry)
            if isinstance(stmt, (ast.For, ast.AsyncFor)):
                self._bind(stmt.target, self._tokens(stmt.iter, inner), inner, set(), None)
            self._loops.append(([], []))
            out = self._block(stmt.body, inner)
            breaks, continues = self._loops.pop()
            again = _merge(entry, out, *continues)
            if again == entry:
                break
            entry = again
        else:
            self.dynamic = True  # no fixed point in time: say nothing is safe
        return _merge(self._block(stmt.orelse, dict(entry)), *breaks)


def like(new: ast.AST, old: ast.AST) -> ast.AST:
    """`new`, with the source location of `old` and its mark (`Proofs.tag`): a statement that replaces `old` stands
    where it stood."""
    ast.copy_location(new, old)
    if hasattr(old, _ORIGIN):
        setattr(new, _ORIGIN, getattr(old, _ORIGIN))
    return new
