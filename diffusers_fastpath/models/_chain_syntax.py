"""The syntax of the chain patterns (`diffusers_fastpath.models._chains`): what a statement or an expression of a
diffusers forward must look like for a pattern to take it, and the AST nodes a rewrite puts in its place. Nothing
here runs a model: these functions read and build `ast` nodes only."""

from __future__ import annotations

import ast
import importlib
import importlib.util

from diffusers.models import embeddings

from .._state import site_attr
from ._chain_proofs import like

_NS = "_diffusers_fastpath_chains"  # the name `_chain_calls._ChainsNamespace` goes by in the rewritten forwards' globals


def _call(func: str, args: list[ast.expr]) -> ast.Call:
    return ast.Call(func=ast.Attribute(value=ast.Name(_NS, ast.Load()), attr=func, ctx=ast.Load()), args=args,
                    keywords=[])


def _self_attr(*names: str) -> ast.expr:
    node: ast.expr = ast.Name("self", ast.Load())
    for name in names:
        node = ast.Attribute(value=node, attr=name, ctx=ast.Load())
    return node


def _site_of(owner: ast.expr, name: str | None = None) -> ast.expr:
    """``getattr(owner, "_fastpath_site[_name]", None)``: the site, or no counting on a module that has none."""
    return ast.Call(func=ast.Name("getattr", ast.Load()), args=[owner, ast.Constant(site_attr(name)),
                                                               ast.Constant(None)], keywords=[])


def _unsqueezed(node: ast.expr) -> bool:
    """Whether `node` is ``g.unsqueeze(1)`` with ``g`` a name (a gate row broadcast over the sequence)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "unsqueeze"
            and isinstance(node.func.value, ast.Name) and len(node.args) == 1 and not node.keywords
            and isinstance(node.args[0], ast.Constant) and node.args[0].value == 1)


_NAMESPACES = frozenset({"torch", "F", "nn", "math", "np"})  # module names: ``torch.sigmoid(g)`` is no method of a gate


def _gate_name(gate: ast.expr) -> str | None:
    """The site name of a gate expression: ``g.unsqueeze(1)`` or ``g`` gives ``g``; so does a chain of methods,
    subscripts and attributes of ``g`` (``g.tanh()``, ``g.index_select(0, rows)``, ``g.unsqueeze(1).tanh()``,
    ``g[:, None]``), and ``self.g.tanh()`` gives ``g``. The gate is then computed as written, before the fused
    call (its arguments are evaluated in the order the expression evaluates them)."""
    if isinstance(gate, ast.Name):
        return gate.id
    if _unsqueezed(gate):
        return gate.func.value.id
    node, last = gate, None
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Attribute):
            last, node = node.attr, node.value
        else:
            break
    if not isinstance(node, ast.Name) or node is gate or node.id in _NAMESPACES:
        return None
    return last if node.id == "self" and last is not None else (None if node.id == "self" else node.id)


def _is_one_literal(node: ast.expr) -> bool:
    """Whether `node` is the literal ``1`` or ``1.0`` (not ``True``)."""
    return isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value == 1


def _rows_modulate_of(node: ast.expr) -> tuple[ast.expr, ast.expr, ast.expr, object, bool] | None:
    """``(A, B, T, one, normed_left)`` if `node` is ``A * (one + B) + T`` (`normed_left`: A the normalised tensor, B
    the scale) or ``(one + A) * B + T`` (A the scale, B the normalised tensor), ``one`` the literal 1 or 1.0 and
    the operands any expressions (the modulate-rows form: rows per sample or per token, `_chain_calls.
    _modulate_rows` decides per call)."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.left, ast.BinOp)
            and isinstance(node.left.op, ast.Mult)):
        return None
    left, right = node.left.left, node.left.right
    for plus, normed_left in ((right, True), (left, False)):
        if isinstance(plus, ast.BinOp) and isinstance(plus.op, ast.Add) and _is_one_literal(plus.left):
            other = left if normed_left else right
            if isinstance(other, ast.BinOp) and isinstance(other.op, ast.Add) and _is_one_literal(other.left):
                return None  # (1 + a) * (1 + b): which is the scale is not said
            first, second = (left, plus.right) if normed_left else (plus.right, right)
            return first, second, node.right, plus.left.value, normed_left
    return None


def _is_none_row(node: ast.expr) -> ast.expr | None:
    """``S`` if `node` is ``S[:, None]``."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 2:
        first, second = node.slice.elts
        if (isinstance(first, ast.Slice) and first.lower is None and first.upper is None and first.step is None
                and isinstance(second, ast.Constant) and second.value is None):
            return node.value
    return None


def _one_plus(node: ast.expr) -> ast.expr | None:
    """``S`` if `node` is ``1 + S``."""
    if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.left, ast.Constant)
            and type(node.left.value) is int and node.left.value == 1):
        return node.right
    return None


def _modulate_of(node: ast.expr) -> tuple[ast.expr, ast.expr, ast.expr, bool] | None:
    """``(N, S, T, rows)`` if `node` is ``N * (1 + S[:, None]) + T[:, None]`` (``rows`` False: ``S``, ``T`` are
    ``[B, D]``), or ``N * (1 + S) + T`` / ``(1 + S) * N + T`` (``rows`` True: ``S``, ``T`` already broadcast as
    ``[B, 1, D]``, checked per call)."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.left, ast.BinOp)
            and isinstance(node.left.op, ast.Mult)):
        return None
    product, shift = node.left, node.right
    if (scale := _one_plus(product.right)) is not None:
        normed = product.left
    elif (scale := _one_plus(product.left)) is not None:
        normed = product.right
    else:
        return None
    scale_row, shift_row = _is_none_row(scale), _is_none_row(shift)
    if scale_row is not None and shift_row is not None and normed is product.left:
        return normed, scale_row, shift_row, False
    if scale_row is None and shift_row is None:
        return normed, scale, shift, True
    return None


def _none_middle(node: ast.expr) -> ast.expr | None:
    """``S`` if `node` is ``S[:, None, :]``."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 3:
        first, second, third = node.slice.elts
        full = lambda e: (isinstance(e, ast.Slice) and e.lower is None and e.upper is None  # noqa: E731
                          and e.step is None)
        if full(first) and isinstance(second, ast.Constant) and second.value is None and full(third):
            return node.value
    return None


def _indexed_modulate_of(node: ast.expr) -> tuple[ast.expr, ast.expr, ast.expr] | None:
    """``(N, S, T)`` if `node` is ``N * (1 + S)[:, None, :] + T[:, None, :]`` (CogVideoX's ``CogVideoXLayerNormZero``,
    ConsisID's: the sum indexed, not its operand; element by element the same values as ``1 + S[:, None, :]``)."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.left, ast.BinOp)
            and isinstance(node.left.op, ast.Mult)):
        return None
    plus, shift = _none_middle(node.left.right), _none_middle(node.right)
    scale = _one_plus(plus) if plus is not None else None
    return None if scale is None or shift is None else (node.left.left, scale, shift)


def _scale_only_of(node: ast.expr) -> tuple[ast.expr, ast.expr] | None:
    """``(N, S)`` if `node` is ``N * (1 + S)`` (Qwen-Image 2.1's ``QwenImage21AdaLayerNormContinuous``: a scale
    without a shift)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and (scale := _one_plus(node.right)) is not None:
        return node.left, scale
    return None


def _float_of(node: ast.expr) -> ast.expr | None:
    """``X`` if `node` is ``X.float()``."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "float"
            and not node.args and not node.keywords):
        return node.func.value
    return None


def _type_as_of(node: ast.expr) -> tuple[ast.expr, str] | None:
    """``(E, X)`` if `node` is ``E.type_as(X)`` with ``X`` a name (Wan's fp32 chains end so)."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "type_as"
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.Name)):
        return node.func.value, node.args[0].id
    return None


def _fp32_gated_of(node: ast.expr) -> tuple[ast.expr, ast.expr, ast.expr, bool] | None:
    """``(R, E, G, cast)`` if `node` is ``(R.float() + E * G).type_as(R)`` or, `cast`, ``(R.float() + E.float() *
    G).type_as(R)`` with ``R`` a name (Wan's gated residuals: the two differ for a float64 ``E``)."""
    cast = _type_as_of(node)
    if cast is None:
        return None
    total, like = cast
    if not (isinstance(total, ast.BinOp) and isinstance(total.op, ast.Add) and isinstance(total.right, ast.BinOp)
            and isinstance(total.right.op, ast.Mult)):
        return None
    residual = _float_of(total.left)
    if not (isinstance(residual, ast.Name) and residual.id == like):
        return None
    update = total.right.left
    cast = _float_of(update)
    return residual, cast or update, total.right.right, cast is not None


def _fp32_modulate_of(node: ast.expr) -> tuple[str, ast.expr, ast.expr, ast.expr] | None:
    """``(A, X, S, T)`` if `node` is ``(self.A(X.float()) * (1 + S) + T).type_as(X)`` with ``X`` a name (Wan)."""
    cast = _type_as_of(node)
    modulate = _modulate_of(cast[0]) if cast is not None else None
    if modulate is None or not modulate[3]:
        return None
    called = _self_module_call(modulate[0])
    if called is None:
        return None
    x = _float_of(called[1])
    if not (isinstance(x, ast.Name) and x.id == cast[1]):
        return None
    return called[0], x, modulate[1], modulate[2]


def _fp32_norm_of(node: ast.expr) -> tuple[str, ast.expr] | None:
    """``(A, X)`` if `node` is ``self.A(X.float()).type_as(X)`` with ``X`` a name (Wan's ``norm2``)."""
    cast = _type_as_of(node)
    called = _self_module_call(cast[0]) if cast is not None else None
    if called is None:
        return None
    x = _float_of(called[1])
    if not (isinstance(x, ast.Name) and x.id == cast[1]):
        return None
    return called[0], x


def _cast_back(node: ast.expr) -> tuple[ast.expr, str] | None:
    """``(E, X)`` if `node` is ``E.type_as(X)``, ``E.to(X.dtype)`` or ``E.to(dtype=X.dtype)`` with ``X`` a name: a
    cast to X's dtype (``type_as`` also to X's device, where E is not on it already)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    if (node.func.attr == "type_as" and len(node.args) == 1 and not node.keywords
            and isinstance(node.args[0], ast.Name)):
        return node.func.value, node.args[0].id
    if node.func.attr == "to" and len(node.args) + len(node.keywords) == 1:
        arg = node.args[0] if node.args else node.keywords[0].value
        if node.keywords and node.keywords[0].arg != "dtype":
            return None
        if isinstance(arg, ast.Attribute) and arg.attr == "dtype" and isinstance(arg.value, ast.Name):
            return node.func.value, arg.value.id
    return None


def _casts_back(node: ast.expr) -> tuple[ast.expr, str, list[ast.Call]] | None:
    """``(E, X, casts)`` if `node` is ``E`` cast back to X's dtype once or more (`_cast_back`: Kandinsky 6 writes
    ``apply_gate_sum(...).type_as(x)`` of a helper ending in ``.to(dtype=x.dtype)``), every cast to the same name;
    `casts` outermost first (`_recast` puts them around another expression)."""
    casts, x = [], None
    while (cast := _cast_back(node)) is not None and (x is None or cast[1] == x):
        casts.append(node)
        node, x = cast
    return (node, x, casts) if casts else None


def _recast(inner: ast.expr, casts: list[ast.Call]) -> ast.expr:
    """`inner` with the casts of `_casts_back` around it, as written."""
    for cast in reversed(casts):
        inner = ast.Call(func=ast.Attribute(value=inner, attr=cast.func.attr, ctx=ast.Load()), args=cast.args,
                         keywords=cast.keywords)
    return inner


def _self_path_call(node: ast.expr) -> tuple[str, ast.expr] | None:
    """``("A.B", X)`` if `node` is ``self.A.B(X)`` (``("A", X)`` for ``self.A(X)``): a module of the block, maybe of
    a submodule (Kandinsky 6's fused block calls ``self.video_dec_block.self_attention_norm``)."""
    if not (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords
            and not isinstance(node.args[0], ast.Starred)):
        return None
    path, func = [], node.func
    while isinstance(func, ast.Attribute):
        path.append(func.attr)
        func = func.value
    if not (isinstance(func, ast.Name) and func.id == "self" and path):
        return None
    return ".".join(reversed(path)), node.args[0]


def _is_one(node: ast.expr) -> bool:
    """Whether `node` is the literal ``1`` or ``1.0``."""
    return isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value == 1


def _float_modulate_of(node: ast.expr, x: str) -> tuple[str, ast.expr, ast.expr, ast.expr, bool, bool, object] | None:
    """``(A, X, S, T, normed_left, one_left, one)`` if `node` is ``self.A(X.float()) * (S.float() + 1.0) +
    T.float()`` with ``X`` the name `x` (Kandinsky 5, and Kandinsky 6's ``apply_scale_shift`` inlined), the product
    either way round (`normed_left`), ``1`` or ``1.0`` on either side of its sum (`one_left`, `one`)."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.left, ast.BinOp)
            and isinstance(node.left.op, ast.Mult)):
        return None
    shift = _float_of(node.right)
    for normed_left in (True, False):
        normed, plus = ((node.left.left, node.left.right) if normed_left else (node.left.right, node.left.left))
        called = _self_path_call(normed)
        inner = _float_of(called[1]) if called is not None else None
        if not (isinstance(inner, ast.Name) and inner.id == x and isinstance(plus, ast.BinOp)
                and isinstance(plus.op, ast.Add) and shift is not None):
            continue
        for one_left in (True, False):
            one, scale = (plus.left, plus.right) if one_left else (plus.right, plus.left)
            scale = _float_of(scale)
            if _is_one(one) and scale is not None:
                return called[0], inner, scale, shift, normed_left, one_left, one.value
    return None


def _float_gated_of(node: ast.expr, r: str) -> tuple[ast.expr, ast.expr, ast.expr] | None:
    """``(R, A, B)`` if `node` is ``R.float() + A.float() * B.float()`` with ``R`` the name `r` (Kandinsky 5, and
    Kandinsky 6's ``apply_gate_sum`` inlined): every operand upcast, so every operation is fp32 whatever their
    dtypes."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.right, ast.BinOp)
            and isinstance(node.right.op, ast.Mult)):
        return None
    residual, left, right = _float_of(node.left), _float_of(node.right.left), _float_of(node.right.right)
    if isinstance(residual, ast.Name) and residual.id == r and left is not None and right is not None:
        return residual, left, right
    return None


def _operand_name(node: ast.expr) -> str | None:
    """The name a gate operand stands for: ``g``, ``g.unsqueeze(1)``, or an inlined helper's ``(g.reshape(...) if C
    else g)``; else None."""
    if isinstance(node, ast.Name):
        return node.id
    if _unsqueezed(node):
        return node.func.value.id
    if isinstance(node, ast.IfExp) and isinstance(node.orelse, ast.Name):
        inner = node.body
        while isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute):
            inner = inner.func.value
        if isinstance(inner, ast.Name) and inner.id == node.orelse.id:
            return inner.id
    return None


def _self_module_call(node: ast.expr) -> tuple[str, ast.expr] | None:
    """``(A, X)`` if `node` is ``self.A(X)``."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self" and len(node.args) == 1 and not node.keywords
            and not isinstance(node.args[0], ast.Starred)):
        return node.func.attr, node.args[0]
    return None


def _single_target(stmt: ast.stmt) -> str | None:
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id
    return None


def _assigned_names(stmt: ast.stmt) -> set[str] | None:
    """The names a plain assignment binds (``a = ...``, ``a, b = ...``), or None for any other statement."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
        return None
    target = stmt.targets[0]
    elts = target.elts if isinstance(target, ast.Tuple) else [target]
    return {e.id for e in elts} if all(isinstance(e, ast.Name) for e in elts) else None


def _reads_after(body_after: list[ast.stmt], name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
               for stmt in body_after for n in ast.walk(stmt))


def _act_of_proj(node: ast.expr) -> tuple[str, ast.expr] | None:
    """``(ACT, self.PROJ(X))`` if `node` is ``self.ACT(self.PROJ(X))``."""
    outer = _self_module_call(node)
    if outer is not None and _self_module_call(outer[1]) is not None:
        return outer
    return None


def _int_literal(node: ast.expr) -> int | None:
    """The value of an integer literal (``2``, ``-1``), or None."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if type(value) is int else None


def _cat_of(node: ast.expr, dim: int) -> tuple[ast.expr, str] | None:
    """``(A, M)`` if `node` is ``torch.cat([A, M], dim=<dim>)`` (an integer literal) with ``M`` a name."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "cat"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch" and len(node.args) == 1
            and isinstance(node.args[0], ast.List) and len(node.args[0].elts) == 2
            and isinstance(node.args[0].elts[1], ast.Name) and len(node.keywords) == 1
            and node.keywords[0].arg == "dim" and _int_literal(node.keywords[0].value) == dim):
        return None
    return node.args[0].elts[0], node.args[0].elts[1].id


def _cat_names(node: ast.expr, dim: int) -> tuple[str, str] | None:
    """``(A, B)`` if `node` is ``torch.cat([A, B], dim=<dim>)`` (an integer literal) with two names."""
    cat = _cat_of(node, dim)
    return (cat[0].id, cat[1]) if cat is not None and isinstance(cat[0], ast.Name) else None


def _transpose_reshape_of(stmt: ast.stmt, name: str) -> bool:
    """Whether `stmt` is ``NAME = NAME.transpose(1, 2).reshape(...)``."""
    value = stmt.value if _single_target(stmt) == name else None
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "reshape"):
        return False
    inner = value.func.value
    return (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and inner.func.attr == "transpose"
            and isinstance(inner.func.value, ast.Name) and inner.func.value.id == name and not inner.keywords
            and [getattr(a, "value", None) for a in inner.args] == [1, 2]
            and all(isinstance(a, ast.Constant) for a in inner.args))


def _reads_only_dtype(body: list[ast.stmt], name: str) -> bool:
    """Whether every read of `name` in `body` is ``NAME.dtype`` (and nothing binds it: the same tensor throughout)."""
    dtype_reads = set()
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Attribute) and node.attr == "dtype" and isinstance(node.value, ast.Name):
            dtype_reads.add(id(node.value))
    return all(id(n) in dtype_reads for n in ast.walk(ast.Module(body=body, type_ignores=[]))
               if isinstance(n, ast.Name) and n.id == name)


def _ns_call(node: ast.AST, name: str | None = None) -> bool:
    """Whether `node` is a call of this module's namespace (``_diffusers_fastpath_chains.<name>(...)``)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == _NS
            and (name is None or node.func.attr == name))


def _rotary_call(node: ast.expr) -> tuple[ast.expr, ast.expr] | None:
    """``(X, E)`` if `node` is ``apply_rotary_emb(X, E, sequence_dim=1)``."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "apply_rotary_emb"
            and len(node.args) == 2 and not any(isinstance(a, ast.Starred) for a in node.args)
            and len(node.keywords) == 1 and node.keywords[0].arg == "sequence_dim"
            and isinstance(node.keywords[0].value, ast.Constant) and node.keywords[0].value.value == 1):
        return node.args[0], node.args[1]
    return None


def _complex_rotary_call(node: ast.expr, name: str | None, local: bool = False) -> tuple[ast.expr, ast.expr] | None:
    """``(X, F)`` if `node` is ``NAME(X, F, use_real=False)`` with NAME the adapter's complex-form rotary function
    (`local`: ``NAME(X, F)``, NAME a function defined in the forward itself)."""
    if not (name is not None and isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
            and len(node.args) == 2 and not any(isinstance(a, ast.Starred) for a in node.args)):
        return None
    if local and not node.keywords:
        return node.args[0], node.args[1]
    if (not local and len(node.keywords) == 1 and node.keywords[0].arg == "use_real"
            and isinstance(node.keywords[0].value, ast.Constant) and node.keywords[0].value.value is False):
        return node.args[0], node.args[1]
    return None


def _starred_call(node: ast.expr, name: str | None) -> tuple[ast.expr, ast.expr] | None:
    """``(X, F)`` if `node` is ``NAME(X, *F)`` (Wan's rotary call), else None."""
    if not (name is not None and isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
            and not node.keywords and len(node.args) == 2 and not isinstance(node.args[0], ast.Starred)
            and isinstance(node.args[1], ast.Starred)):
        return None
    return node.args[0], node.args[1].value


def _local_def(body: list[ast.stmt], name: str) -> ast.FunctionDef | None:
    """The function `name` defined by a top-level statement of `body` (the only binding of that name there), or None."""
    defs = [s for s in body if isinstance(s, ast.FunctionDef) and s.name == name]
    stores = [n for n in ast.walk(ast.Module(body=body, type_ignores=[]))
              if isinstance(n, ast.Name) and n.id == name and not isinstance(n.ctx, ast.Load)]
    return defs[0] if len(defs) == 1 and not stores else None


def _method_call(node: ast.expr, name: str) -> tuple[ast.expr, list[ast.expr]] | None:
    """``(X, args)`` if `node` is ``X.name(*args)`` with plain positional arguments."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
            and not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args)):
        return node.func.value, node.args
    return None


def _constants(args: list[ast.expr], *values) -> bool:
    return len(args) == len(values) and all(
        v is None or (isinstance(a, ast.Constant) and type(a.value) is int and a.value == v) for a, v in zip(args, values))


def _pairwise_mask_of(three: list[ast.stmt], dead, quiet) -> ast.stmt | None:
    """``X = pairwise_mask(A, B, S)`` for the three statements of the pairwise-mask form (module doc), or None.
    `dead(name)`: whether the value `name` holds after the third statement is read nowhere (the rewrite binds
    neither ``M1`` nor ``M2``); `quiet(expr)`: whether evaluating `expr` writes and binds nothing (``B`` and ``S``
    are evaluated once, at the third statement, instead of at the first)."""
    m1, m2, x = (_single_target(s) for s in three)
    if m1 is None or m2 is None or x is None or len({m1, m2}) < 2:
        return None
    repeat = _method_call(three[0].value, "repeat")
    view = _method_call(repeat[0], "view") if repeat is not None else None
    if view is None or len(view[1]) != 4 or not _constants(view[1], None, 1, 1, None):
        return None
    (a, (batch, _, _, seq)), (_, reps) = view, repeat
    if not (_constants(reps, 1, 1, None, 1) and ast.dump(reps[2]) == ast.dump(seq)):
        return None
    transpose = _method_call(three[1].value, "transpose")
    if not (transpose and isinstance(transpose[0], ast.Name) and transpose[0].id == m1 and _constants(transpose[1], 2, 3)):
        return None
    cast = _method_call(three[2].value, "bool")
    both = cast[0] if cast is not None and not cast[1] else None
    if not (isinstance(both, ast.BinOp) and isinstance(both.op, ast.BitAnd) and isinstance(both.left, ast.Name)
            and both.left.id == m1 and isinstance(both.right, ast.Name) and both.right.id == m2):
        return None
    if any(_uses(e, n) for e in (a, batch, seq) for n in (m1, m2)) or not (quiet(a) and quiet(batch) and quiet(seq)):
        return None
    if any(n != x and not dead(n) for n in (m1, m2)):
        return None
    return like(ast.Assign(targets=[ast.Name(x, ast.Store())], value=_call("pairwise_mask", [a, batch, seq])), three[2])


def _padded_pairwise_mask_of(five: list[ast.stmt], anchor: str, dead, quiet) -> ast.stmt | None:
    """``X = pairwise_mask_padded(P, A, E, B, S, anchor)`` for ``A = P(A, E, value=True)``, ``A = A.bool()`` and the
    pairwise-mask form of ``A`` into ``X`` (HunyuanVideo-1.5's processor; the padded form of the module doc), or
    None. `dead` and `quiet` as for `_pairwise_mask_of`, of the fifth statement."""
    a = _single_target(five[0])
    pad = five[0].value if a is not None else None
    if not (isinstance(pad, ast.Call) and isinstance(pad.func, ast.Attribute) and pad.func.attr == "pad"
            and len(pad.args) == 2 and isinstance(pad.args[0], ast.Name) and pad.args[0].id == a
            and len(pad.keywords) == 1 and pad.keywords[0].arg == "value"
            and isinstance(pad.keywords[0].value, ast.Constant) and pad.keywords[0].value.value is True):
        return None
    cast = _method_call(five[1].value, "bool") if _single_target(five[1]) == a else None
    if not (cast and isinstance(cast[0], ast.Name) and cast[0].id == a and not cast[1]):
        return None
    merged = _pairwise_mask_of(five[2:], dead, quiet)
    if merged is None:
        return None
    mask, batch, seq = merged.value.args
    x = _single_target(merged)
    if not (isinstance(mask, ast.Name) and mask.id == a) or (x != a and not dead(a)):
        return None
    if any(_uses(e, a) for e in (batch, seq)) or not (quiet(pad.func) and quiet(pad.args[1])):
        return None
    call = _call("pairwise_mask_padded", [pad.func, ast.Name(a, ast.Load()), pad.args[1], batch, seq,
                                          ast.Name(anchor, ast.Load())])
    return like(ast.Assign(targets=[ast.Name(x, ast.Store())], value=call), five[4])


def _outer_index(node: ast.expr, name: str, last: bool) -> bool:
    """Whether `node` is ``name[:, None, None, :]`` (`last`) or ``name[:, None, :, None]``."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == name
            and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 4):
        return False
    full = lambda e: isinstance(e, ast.Slice) and e.lower is None and e.upper is None and e.step is None  # noqa: E731
    none = lambda e: isinstance(e, ast.Constant) and e.value is None  # noqa: E731
    a, b, c, d = node.slice.elts
    return full(a) and none(b) and (none(c) and full(d) if last else full(c) and none(d))


def _outer_mask_of(stmt: ast.stmt, anchor: str) -> ast.stmt | None:
    """``X = outer_mask(A, anchor)`` for ``X = A[:, None, None, :] * A[:, None, :, None]`` (the outer-mask form of
    the module doc), or None."""
    target = _single_target(stmt)
    value = stmt.value if target is not None else None
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult) and isinstance(value.left, ast.Subscript)
            and isinstance(value.left.value, ast.Name)):
        return None
    mask = value.left.value.id
    if not (_outer_index(value.left, mask, True) and _outer_index(value.right, mask, False)):
        return None
    call = _call("outer_mask", [ast.Name(mask, ast.Load()), ast.Name(anchor, ast.Load())])
    return like(ast.Assign(targets=[ast.Name(target, ast.Store())], value=call), stmt)


class _PendingReads(ast.NodeVisitor):
    """Walks statements in evaluation order, tracking the names bound to a pending norm (``norm_later`` or
    ``cat_later``), and finds any read of one that is not in `allowed` (a binding inside a nested block keeps the
    name pending: the block may not run; a loop's body is walked twice: its next iteration reads what it left)."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed, self.pending, self.depth, self.ok = allowed, set(), 0, True
        self.reads: list[ast.Name] = []  # the reads found (`ok` False)

    def clean(self, stmts: list[ast.stmt]) -> bool:
        for stmt in stmts:
            self.visit(stmt)
        return self.ok

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        target = _single_target(node)
        if target is not None and any(_ns_call(node.value, f) for f in ("norm_later", "cat_later", "unflatten_later")):
            self.pending.add(target)
        elif self.depth == 0:
            for t in node.targets:
                self.pending -= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}

    def _nested(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    def _loop(self, node: ast.AST) -> None:
        self._nested(node)
        self._nested(node)  # the next iteration reads what this one left pending

    visit_If = visit_With = visit_Try = _nested
    visit_For = visit_While = _loop

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load) and node.id in self.pending and id(node) not in self.allowed:
            self.ok = False
            self.reads.append(node)


def _uses(node: ast.expr, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _diffusers_rotary(fn, func: ast.FunctionDef) -> bool:
    """Whether the name ``apply_rotary_emb`` in `fn` is diffusers' ``embeddings.apply_rotary_emb``: a module global,
    or a ``from ..embeddings import apply_rotary_emb`` (or absolute) of its own that resolves to it."""
    if fn.__globals__.get("apply_rotary_emb") is embeddings.apply_rotary_emb:
        return True
    for node in ast.walk(func):
        if (isinstance(node, ast.ImportFrom) and node.module
                and any(a.name == "apply_rotary_emb" and a.asname is None for a in node.names)):
            package = fn.__module__.rsplit(".", 1)[0]
            try:
                name = importlib.util.resolve_name("." * node.level + node.module, package) if node.level else node.module
                module = importlib.import_module(name)
            except (ImportError, ValueError):
                return False
            return getattr(module, "apply_rotary_emb", None) is embeddings.apply_rotary_emb
    return False
