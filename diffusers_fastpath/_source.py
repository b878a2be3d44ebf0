"""What a function's source is, provably: the text that compiles to its very code object (`source_of`), and digests
of that text (`source_digest`, `normalized_digest`) by which the rewriter, the adapters and the ops recognise a
function they know. ``inspect.getsource`` alone reads the file on disk now and follows ``__wrapped__``: a
``functools.wraps`` wrapper, a function replaced, a file edited since the import would be taken for the function
whose text it reads, and the wrapper dropped (issue 43); here each of those has no source, and no digest."""

from __future__ import annotations

import __future__
import ast
import functools
import hashlib
import importlib
import inspect
import linecache
import textwrap
import types

_FUTURE_FLAGS = 0
for _feature in __future__.all_feature_names:
    _FUTURE_FLAGS |= getattr(__future__, _feature).compiler_flag
_CO_NESTED = inspect.CO_NESTED  # says where a code object was compiled (in a function), not what it does
_CODE_FIELDS = ("co_argcount", "co_posonlyargcount", "co_kwonlyargcount", "co_nlocals", "co_stacksize", "co_code",
                "co_names", "co_varnames", "co_freevars", "co_cellvars", "co_name", "co_exceptiontable")


def _same_const(a, b) -> bool:
    if isinstance(a, types.CodeType) or isinstance(b, types.CodeType):
        return isinstance(a, types.CodeType) and isinstance(b, types.CodeType) and same_code(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same_const(x, y) for x, y in zip(a, b))
    if isinstance(a, (float, complex)):
        return repr(a) == repr(b)  # -0.0 and nan
    return a == b


def same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """Whether two code objects run the same instructions on the same names and constants (nested code objects
    alike): everything but where they were compiled (file, line numbers, qualified name)."""
    return (all(getattr(a, f, None) == getattr(b, f, None) for f in _CODE_FIELDS)
            and a.co_flags & ~_CO_NESTED == b.co_flags & ~_CO_NESTED
            and len(a.co_consts) == len(b.co_consts) and all(map(_same_const, a.co_consts, b.co_consts)))


@functools.lru_cache(maxsize=64)
def _imports(filename: str, _length: int) -> str:
    """The module-level imports of `filename` (as read now; `_length` keys the cache on its text): CPython 3.11
    compiles ``name.method(...)`` of an imported name without the method-call opcodes, so a function compiles to its
    own code object only among the same imports."""
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return ""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None) != "__future__":
            found.append(ast.unparse(node))
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt))
    return "".join(f"{line}\n" for line in found)


def source_of(fn) -> tuple[str | None, str]:
    """``(source, "")``: the source text of `fn` (as ``inspect.getsource`` gives it, indented as in its file) where it
    provably is `fn`'s, else ``(None, why)``.

    ``inspect.getsource`` reads the file on disk now, at the line the function *was* compiled from, and follows
    ``__wrapped__``: a function replaced by a ``functools.wraps`` wrapper, or a source file edited since the import,
    give the text of another function. So: `fn` must be a plain function with no ``__wrapped__``, and the text must
    compile (as a method of a class of its qualified name's, for name mangling and ``super``) to a code object equal
    to ``fn.__code__`` in every instruction, name and constant (`same_code`): then rewriting that text rewrites `fn`.
    """
    if not isinstance(fn, types.FunctionType):
        return None, f"is a {type(fn).__name__}, not a plain function"
    if hasattr(fn, "__wrapped__"):
        wrapped = getattr(fn.__wrapped__, "__qualname__", "another function")
        return None, f"is a wrapper of {wrapped} (it has __wrapped__)"
    code = fn.__code__
    if set(code.co_freevars) - {"__class__"}:  # (``__class__``: a method calling super(), compiled in its class below)
        return None, f"is a closure (it reads {', '.join(code.co_freevars)} of the function that made it)"
    try:
        lines, _ = inspect.getsourcelines(code)  # of the code object: never another function's
    except (OSError, TypeError):
        return None, "has no source file to read"
    source = "".join(lines)
    path = fn.__qualname__.split(".")
    owner = path[-2] if len(path) > 1 and path[-2] != "<locals>" else None
    text = f"class {owner}:\n" + textwrap.indent(textwrap.dedent(source), "    ") if owner else textwrap.dedent(source)
    text = _imports(code.co_filename, len(linecache.getlines(code.co_filename))) + text
    try:
        compiled = compile(text, code.co_filename, "exec", flags=code.co_flags & _FUTURE_FLAGS, dont_inherit=True)
    except (SyntaxError, ValueError):
        return None, "has source text that does not compile alone"
    consts = compiled.co_consts
    if owner:
        consts = next((c.co_consts for c in consts if isinstance(c, types.CodeType) and c.co_name == owner), ())
    found = [c for c in consts if isinstance(c, types.CodeType) and c.co_name == code.co_name]
    if len(found) != 1 or not same_code(found[0], code):
        return None, (f"is not the function its source file {code.co_filename} defines now (replaced, or the file "
                      "edited since it was imported)")
    return source, ""


def source_digest(fn) -> str | None:
    """The digest of `fn`'s source, or None where that source is not provably `fn`'s (`source_of`: a
    ``functools.wraps`` wrapper, whose ``inspect.getsource`` is the wrapped function's; a function replaced, or its
    file edited since the import)."""
    source, _ = source_of(fn)
    return None if source is None else hashlib.sha256(source.encode()).hexdigest()[:16]


def definition(fn_or_def) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The definition of a function (`fn_or_def` itself where it is one already), parsed from its source where
    that is provably its own (`source_of`), else ``None``."""
    if isinstance(fn_or_def, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return fn_or_def
    source, _ = source_of(fn_or_def)  # a wrapper or a replaced function has none
    if source is None:
        return None
    try:
        (node,) = ast.parse(textwrap.dedent(source)).body
    except (ValueError, SyntaxError):
        return None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def normalized_digest(fn_or_def) -> str | None:
    """sha256[:16] of ``ast.unparse`` of a function's definition with its name set aside: the same for a copy of a
    function under another name, different for any change of its code (comments and layout aside); ``None`` where
    the function's source is not provably its own (`source_of`)."""
    node = definition(fn_or_def)
    if not isinstance(node, ast.FunctionDef):
        return None
    node = ast.FunctionDef(name="_", args=node.args, body=node.body, decorator_list=[], returns=node.returns,
                           type_comment=None, type_params=getattr(node, "type_params", []))
    return hashlib.sha256(ast.unparse(ast.fix_missing_locations(node)).encode()).hexdigest()[:16]


def body_digest(fn) -> str | None:
    """sha256[:16] of `fn`'s body, its statements parsed and unparsed without the docstring (formatting, comments,
    the signature's annotations and defaults do not count; the parameter names do, through the body): for a
    function of another library whose docstring may change between releases (torch's ``F.normalize``); ``None``
    where its source is not provably its own (`source_of`)."""
    func = definition(fn)
    if func is None:
        return None
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
            body[0].value.value, str):
        body = body[1:]
    names = [a.arg for a in func.args.posonlyargs + func.args.args + func.args.kwonlyargs]
    text = ",".join(names) + "\n" + "\n".join(ast.unparse(stmt) for stmt in body)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def named_object(module: str, qualname: str):
    """The object `qualname` (``"Outer.Inner"``) names in the module `module`, imported: how a pickled patched class
    finds the class it was made from in a fresh process."""
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
