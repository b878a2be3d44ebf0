"""The chain rewriter's patterns of attention processors (`_rewriter` holds the blocks' and the module doc of the
whole; `_Rewriter` runs these passes on a processor's forward):

- rotary embedding, into `diffusers_fastpath.ops.rotary_emb` (the fallback is diffusers' function itself), in
  attention processors:

  - ``Q = apply_rotary_emb(X, E, sequence_dim=1)`` (diffusers' ``embeddings.apply_rotary_emb``, real cos/sin
    tables)  ->  ``Q = rotary(X, E, site)``

  with one site, ``rotary_emb``, on the attention module the processor is called with (its first argument); also
  where the call is part of a larger expression (HunyuanVideo's ``torch.cat([apply_rotary_emb(...), ...])``), and
  where the processor imports ``apply_rotary_emb`` itself (``from ..embeddings import apply_rotary_emb``).
- QK RMSNorm + concatenation + rotary embedding, into `diffusers_fastpath.ops.qk_norm_rope` (self-verified; the
  fallback is the norms, ``torch.cat`` and the fused rotary), in attention processors whose rotary embedding the
  pattern above took (FLUX.2, the FLUX derivatives):

  - ``Q = A.N(Q)`` with ``N`` one of ``norm_q``, ``norm_k``, ``norm_added_q``, ``norm_added_k`` (``A`` the attention
    module)  ->  ``Q = norm_later(A.N, Q)``: the norm, not yet run; ``Q = A.N(Q).to(V.dtype)`` (Qwen-Image 2.1, ``V``
    another name)  ->  ``Q = norm_later_to(A.N, Q, V.dtype)``, which waits only where the cast is provably none (x and
    the norm's weight of that half dtype: ``.to`` returns the norm's very result) and runs the line as written else
  - ``Q = torch.cat([E, Q], dim=1)`` of two such  ->  ``Q = cat_later(E, Q)``
  - the rotary call of such a ``Q`` runs all three as one `qk_norm_rope` (site ``qk_norm_rope`` on the attention
    module), or, for a lone diffusers ``RMSNorm`` (HunyuanVideo-1.5, Bria-FIBO's single blocks), the norm and the
    rotary as one `rmsnorm_rope_real` (site ``rmsnorm_rope_real``); after the last statement holding a rotary call,
    each such name read later is made a tensor (``materialize``: the norm and the cat as written, where no rotary
    embedding ran); so is a read of one in a branch of an ``if`` whose other branch holds the fused rotary (LTX-2's
    ``elif attn.rope_type == "split"``: its split rotary, no fused form, gets the norm run as written)

  taken only where those names are read nowhere else before that point (else the norms run as written).
- QK RMSNorm + complex-form rotary embedding, into `diffusers_fastpath.ops.rmsnorm_rope_complex` (self-verified; the
  fallback is the norm and the rotary function as written), in processors whose adapter names the rotary function:
  ``complex_rotary="apply_rotary_emb_qwen"`` (a module function, called ``NAME(X, F, use_real=False)``; its source
  checked by digest at patch time, `register_complex_rotary`) or ``local_rotary=(name, digest)`` (a function the
  processor defines itself, called ``NAME(X, F)``, taken where ``ast.unparse`` of its definition has that digest):

  - ``Q = NAME(X, F, ...)``  ->  ``Q = rotary_complex(NAME, X, F, site, local)``; the QK norms before it wait as in
    the form above, and a pending diffusers ``RMSNorm`` without hooks runs with the rotary as one op (site
    ``rmsnorm_rope_complex`` on the attention module; Qwen-Image, Z-Image)
  - the joint form (module functions): ``J = torch.cat([A, B], dim=1)`` after the last rotary statement, of two such
    ``Q`` that nothing else reads afterwards  ->  ``J = cat_rotated(A, B, site)`` and their rotary calls
    ``rotary_complex_later``: the two streams' norms and rotary written into the joint tensor by
    `diffusers_fastpath.ops.rmsnorm_rope_complex_cat` (site ``rmsnorm_rope_complex_cat``; Qwen-Image's q and k)
- a value projection written after a prefix (Qwen-Image 2.1's cached value), into
  `diffusers_fastpath.ops.linear_prefix` (aten's GEMM into the rows after a copy of the prefix; self-verified), in any
  processor: ``V = A.M(X)`` at the top level, read before its one ``V = torch.cat([C, V], dim=1)`` only as ``V.dtype``
  or through ``V = V.unflatten(D, S)``  ->  ``V = linear_later(A.M, X)`` and ``V = cat_prefix_linear(C, V, site)``,
  ``V = materialize(V)`` before every other read (`AttentionPasses.prefix_linears`; site ``linear_prefix``)
- rows-form rotary embedding, into `diffusers_fastpath.ops.rotary_emb_rows` (exact by construction; the fallback is
  the function itself), in processors whose adapter names it: ``rows_rotary="apply_rotary_emb"`` (LTX-Video's module
  function, called ``NAME(X, F)`` with ``F = (cos, sin)`` over ``[B, S, C]`` rows; its source checked by digest at
  patch time, `register_rows_rotary`):

  - ``Q = NAME(X, F)``  ->  ``Q = rotary_rows(NAME, X, F, site)``, site ``rotary_emb`` on the attention module

  and Wan's, into `diffusers_fastpath.ops.rotary_emb_wan` (exact by construction): ``wan_rotary=(name, digest)``, a
  function the processor defines (in any block of its body), taken where ``ast.unparse`` of its definition has that
  digest:

  - ``Q = NAME(X, *F)``  ->  ``Q = rotary_wan(NAME, X, F, site)``, site ``rotary_emb`` on the attention module
- head concatenation (SD3's joint attention: the image and text q, k and v, each a ``[B, H, S, D]`` view), into
  `diffusers_fastpath.ops.cat_heads` (a vectorised copy, exact by construction, its addressing checked on first use
  per layout), in processors whose adapter asks for it (``head_cats=True``):

  - ``X = torch.cat([A, B], dim=2)``, ``A`` and ``B`` names  ->  ``X = cat_heads(A, B, site)``, the site
    ``cat_heads`` on the attention module; anything the op's guard refuses runs ``torch.cat`` as written
  - the attention of three such: ``H = F.scaled_dot_product_attention(Q, K, V, <constant keywords>)`` at the top
    level of the body, directly followed by ``H = H.transpose(1, 2).reshape(...)``, where ``Q``, ``K`` and ``V`` were
    last bound by those concatenations, are read by nothing between them and the attention, and after it only for
    their ``.dtype``  ->  the three ``cat_heads(A, B, site, True)`` (written token-major) and ``H =
    attention_heads(F.scaled_dot_product_attention, Q, K, V, site, ...)``: `diffusers_fastpath.ops.attention_seq_major`
    (self-verified per signature; site ``attention_seq_major`` on the attention module), whose token-major output
    makes the reshape a view

- grouped-query attention (Krea 2): ``if G > 1:`` whose body is exactly ``K = K.repeat_interleave(G, dim=2)`` and
  ``V = V.repeat_interleave(G, dim=2)`` (no ``else``), directly followed by ``H = dispatch_attention_fn(Q, K, V,
  <keywords>)``, ``Q``, ``K``, ``V`` and ``G`` names, each keyword a constant, a name or an attribute of one (Krea 2,
  NucleusMoE-Image), ``K`` and ``V`` read
  nowhere after the call  ->  ``H = attention_gqa(dispatch_attention_fn, Q, K, V, G, site, <keywords>)``: the test as
  written, then `diffusers_fastpath.ops.attention_gqa` (the call on the grouped heads, ``enable_gqa=True``,
  self-verified per signature; site ``attention_gqa`` on the attention module), or the copies and the call as written
- boolean attention masks (Ideogram 4's block-diagonal segment mask, one ``[B, 1, S, S]`` per forward): ``H =
  dispatch_attention_fn(Q, K, V, <keywords>)`` at the top level of a processor's body, one keyword ``attn_mask`` that
  is not ``None``, every keyword named  ->  ``H = attention_bool_mask(dispatch_attention_fn, Q, K, V, site,
  <keywords>)`` (the operands evaluated in the order written): a 4-D boolean mask handed to torch as the additive mask
  its SDPA would make of it in every call, made once per mask and forward
  (`diffusers_fastpath.ops.attention_bool_mask`, self-verified per signature; site ``attention_bool_mask`` on the
  attention module); any other mask (or none), and a key-padding one (``[B, H, 1, S]``: Bria FIBO 2's, made per call),
  runs the call as written
- sigmoid output gate (Krea 2), into `diffusers_fastpath.ops.sigmoid_mul` (the sigmoid proven on every bf16 / fp16
  value on first use), in any processor:

  - ``T = A * torch.sigmoid(G)`` or ``return A * torch.sigmoid(G)`` (``A`` and ``G`` any expressions)  ->  ``T =
    mul_sigmoid(A, torch.sigmoid, G, site)``: the operands evaluated in the order written and the sigmoid called
    after them, as the product does (nothing moves); the kernel where ``torch.sigmoid`` is torch's at run time and the
    op's guard takes the operands, else ``A * torch.sigmoid(G)`` as written; one site, ``sigmoid_mul``, on the
    attention module

Each rewrite is exact by construction, and one that moves or drops anything is taken only where `_chain_proofs`
proves it changes no value (`_rewriter`'s module doc).
"""

from __future__ import annotations

import ast
import copy

from ._chain_proofs import _bound_names, _reads, like
from ._chain_qk_fp32 import deferred_fp32, fp32_norm_input, mark_casts
from ._chain_rotate_half import QK_NORM_ROTARY_HALF
from ._chain_syntax import (_call, _cat_names, _complex_rotary_call, _ns_call, _PendingReads, _reads_after,
                            _reads_only_dtype, _rotary_call, _single_target, _site_of, _starred_call,
                            _transpose_reshape_of, _uses)

ROTARY = "rotary_emb"
CAT_HEADS = "cat_heads"
ATTENTION_SEQ_MAJOR = "attention_seq_major"  # a processor's attention of three token-major head concatenations (SD3)
ATTENTION_GQA = "attention_gqa"  # a processor's grouped-query attention without its repeated heads (Krea 2)
SIGMOID_MUL = "sigmoid_mul"  # a processor's sigmoid output gate, ``A * torch.sigmoid(G)`` (Krea 2)
ATTENTION_BOOL_MASK = "attention_bool_mask"  # a processor's attention with a boolean mask made additive once (Ideogram 4)
QK_NORM_ROPE = "qk_norm_rope"
QK_NORM_ROWS = "qk_norm_rows_rope"  # a processor's QK norms across all heads + its rows-form or Wan's rotary
QK_NORM_ROWS_PAIR = "qk_norm_rows_rope_pair"  # ... of q and k in one call (the rows form: LTX-Video)
_QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")  # an attention module's QK norms, by diffusers' names
# the namespace's fused rotary calls (rotary_half_partial: MiniMax-H3's partial rotate-half, `_chain_rotate_half`)
_ROTARY_CALLS = ("rotary", "rotary_complex", "rotary_rows", "rotary_wan", "rotary_half_partial")
RMSNORM_ROPE = "rmsnorm_rope_complex"  # a processor's QK norm + complex-form rotary (Qwen-Image)
RMSNORM_ROPE_CAT = "rmsnorm_rope_complex_cat"  # ... of two streams' q (or k) written into their joint concatenation
RMSNORM_ROPE_PREFIX = "rmsnorm_rope_complex_prefix"  # ... of a key written after a prefix (Qwen-Image 2.1's cache)
LINEAR_PREFIX = "linear_prefix"  # a processor's value projection written after a prefix (Qwen-Image 2.1's cache)
RMSNORM_ROPE_REAL = "rmsnorm_rope_real"  # ... diffusers' RMSNorm + the real-form rotary (HunyuanVideo-1.5)


def _own_nodes(body: list[ast.stmt]):
    """``(stmt, node)`` for every node of `body` (in any block), with the innermost statement holding it (whose line
    number the rewriter's new nodes lack)."""
    stack = list(body)
    while stack:
        stmt = stack.pop()
        todo = [stmt]
        while todo:
            node = todo.pop()
            yield stmt, node
            for child in ast.iter_child_nodes(node):
                (stack if isinstance(child, ast.stmt) else todo).append(child)



def _repeat_heads_if(stmt: ast.stmt) -> tuple[str, str, str] | None:
    """``(G, K, V)`` if `stmt` is ``if G > 1:`` holding exactly ``K = K.repeat_interleave(G, dim=2)`` and ``V =
    V.repeat_interleave(G, dim=2)`` (two different names, neither ``G``), with no ``else``; else None."""
    if not (isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 2
            and isinstance(stmt.test, ast.Compare) and isinstance(stmt.test.left, ast.Name)
            and len(stmt.test.ops) == 1 and isinstance(stmt.test.ops[0], ast.Gt)
            and isinstance(stmt.test.comparators[0], ast.Constant) and type(stmt.test.comparators[0].value) is int
            and stmt.test.comparators[0].value == 1):
        return None
    g = stmt.test.left.id
    names = []
    for line in stmt.body:
        target = _single_target(line)
        call = line.value if target is not None else None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "repeat_interleave" and isinstance(call.func.value, ast.Name)
                and call.func.value.id == target and len(call.args) == 1 and isinstance(call.args[0], ast.Name)
                and call.args[0].id == g and len(call.keywords) == 1 and call.keywords[0].arg == "dim"
                and isinstance(call.keywords[0].value, ast.Constant) and call.keywords[0].value.value == 2
                and type(call.keywords[0].value.value) is int):
            return None
        names.append(target)
    if names[0] == names[1] or g in names:
        return None
    return g, names[0], names[1]


def _sigmoid_gated(value: ast.expr | None) -> tuple[ast.expr, ast.expr, ast.expr] | None:
    """``(A, torch.sigmoid, G)`` if `value` is ``A * torch.sigmoid(G)`` (one positional argument, no keywords), else
    None. Whether ``torch`` is torch's is asked when the call runs (`_chain_calls`' ``mul_sigmoid``)."""
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult)):
        return None
    call = value.right
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "sigmoid"
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "torch" and len(call.args) == 1
            and not isinstance(call.args[0], ast.Starred) and not call.keywords):
        return None
    return value.left, call.func, call.args[0]


def _plain_reference(node: ast.expr) -> bool:
    """A constant, a name, or an attribute chain of one (``self._attention_backend``): read with nothing else
    evaluated."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, (ast.Name, ast.Constant))


class AttentionPasses:
    """The processor passes of `_rewriter._Rewriter` (a mixin: they read and count on its state, ``self.found``,
    ``self.owner``, ``self.proofs`` and the adapter's rotary names)."""

    def _head_cat(self, stmt: ast.stmt) -> ast.stmt | None:
        """The head-concatenation form: ``X = torch.cat([A, B], dim=2)`` of two names, as ``cat_heads``."""
        target = _single_target(stmt)
        pair = _cat_names(stmt.value, 2) if target is not None else None
        if pair is None:
            return None
        self.found.head_cats += 1
        site = _site_of(ast.Name(self.owner, ast.Load()), CAT_HEADS)
        call = _call("cat_heads", [ast.Name(pair[0], ast.Load()), ast.Name(pair[1], ast.Load()), site])
        return like(ast.Assign(targets=[ast.Name(target, ast.Store())], value=call), stmt)

    def sigmoid_gate(self, stmt: ast.stmt) -> ast.stmt | None:
        """The sigmoid output gate form (see the module doc): `stmt` rewritten, or None."""
        target = _single_target(stmt) if isinstance(stmt, ast.Assign) else None
        if target is None and not isinstance(stmt, ast.Return):
            return None
        gated = _sigmoid_gated(stmt.value)
        if gated is None:
            return None
        self.found.sigmoid_mul += 1
        call = _call("mul_sigmoid", [*gated, _site_of(ast.Name(self.owner, ast.Load()), SIGMOID_MUL)])
        if target is None:
            return like(ast.Return(value=call), stmt)
        return like(ast.Assign(targets=[ast.Name(target, ast.Store())], value=call), stmt)

    def seq_major_attention(self, body: list[ast.stmt]) -> list[ast.stmt]:
        """The head concatenations' attention form (see the module doc) over a processor's top-level `body` (its
        concatenations rewritten already), or `body` as it was."""
        for i, stmt in enumerate(body[:-1]):
            h = _single_target(stmt)
            call = stmt.value if h is not None else None
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "scaled_dot_product_attention" and isinstance(call.func.value, ast.Name)
                    and len(call.args) == 3 and all(isinstance(a, ast.Name) for a in call.args)
                    and all(k.arg is not None and isinstance(k.value, ast.Constant) for k in call.keywords)
                    and _transpose_reshape_of(body[i + 1], h)):
                continue
            names = [a.id for a in call.args]
            cats = [self._last_cat(body[:i], name) for name in names]
            if len(set(names)) != 3 or None in cats or not all(_reads_only_dtype(body[i + 1:], n) for n in names):
                continue
            for cat in cats:
                cat.args.append(ast.Constant(True))
            self.found.seq_major_attention = True
            site = _site_of(ast.Name(self.owner, ast.Load()), ATTENTION_SEQ_MAJOR)
            new = _call("attention_heads", [call.func, *call.args, site])
            new.keywords = call.keywords
            return [*body[:i], like(ast.Assign(targets=stmt.targets, value=new), stmt), *body[i + 1:]]
        return body

    def gqa_attention(self, body: list[ast.stmt]) -> list[ast.stmt]:
        """The grouped-query attention form (see the module doc) over a processor's top-level `body`, or `body`."""
        for i, stmt in enumerate(body[:-1]):
            repeats = _repeat_heads_if(stmt)
            after = body[i + 1]
            h = _single_target(after)
            call = after.value if repeats is not None and h is not None else None
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id == "dispatch_attention_fn" and len(call.args) == 3
                    and all(isinstance(a, ast.Name) for a in call.args)
                    and [a.id for a in call.args[1:]] == list(repeats[1:]) and call.args[0].id not in repeats
                    and all(k.arg is not None and _plain_reference(k.value) for k in call.keywords)):
                continue
            g, k, v = repeats
            if any(h != name and self.proofs.live_after(after, name) for name in (k, v)):
                continue  # eager's K and V hold the repeated heads after the call; here they would not
            self.found.gqa_attention = True
            site = _site_of(ast.Name(self.owner, ast.Load()), ATTENTION_GQA)
            new = _call("attention_gqa", [call.func, *call.args, ast.Name(g, ast.Load()), site])
            new.keywords = call.keywords
            return [*body[:i], like(ast.Assign(targets=after.targets, value=new), after), *body[i + 2:]]
        return body

    def bool_mask_attention(self, body: list[ast.stmt]) -> list[ast.stmt]:
        """The boolean-mask form (see the module doc) over a processor's top-level `body`, or `body`."""
        out = []
        for stmt in body:
            h = _single_target(stmt) if isinstance(stmt, ast.Assign) else None
            call = stmt.value if h is not None else None
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "dispatch_attention_fn"
                    and len(call.args) == 3 and not any(isinstance(a, ast.Starred) for a in call.args)
                    and all(k.arg is not None for k in call.keywords)
                    and any(k.arg == "attn_mask" and not (isinstance(k.value, ast.Constant) and k.value.value is None)
                            for k in call.keywords)):
                self.found.bool_masks += 1
                site = _site_of(ast.Name(self.owner, ast.Load()), ATTENTION_BOOL_MASK)
                new = _call("attention_bool_mask", [call.func, *call.args, site])
                new.keywords = call.keywords
                stmt = like(ast.Assign(targets=stmt.targets, value=new), stmt)
            out.append(stmt)
        return out

    @staticmethod
    def _last_cat(before: list[ast.stmt], name: str) -> ast.Call | None:
        """The ``cat_heads`` call of ``name = cat_heads(A, B, site)``, `name`'s last binding in `before` (in any
        block), if nothing in `before` reads `name` after it; else None."""
        stores, loads, cats = [], [], []
        for stmt, node in _own_nodes(before):
            if isinstance(node, ast.Name) and node.id == name:
                (loads if isinstance(node.ctx, ast.Load) else stores).append(stmt.lineno)
            if node is stmt and _single_target(stmt) == name and _ns_call(stmt.value, "cat_heads") and len(stmt.value.args) == 3:
                cats.append(stmt)
        if len(cats) != 1 or max(stores, default=None) != cats[0].lineno or any(line > cats[0].lineno for line in loads):
            return None
        return cats[0].value

    def _rotary_anywhere(self, stmt: ast.Assign) -> ast.stmt | None:
        """A processor's assignment with every ``apply_rotary_emb(X, E, sequence_dim=1)`` in it fused (and every
        call of the adapter's complex-form rotary, ``NAME(X, F, use_real=False)``), or None."""
        if not (self.rotary_ok or self.complex_rotary or self.rows_rotary or self.wan_rotary):
            return None
        rewriter = self

        class Calls(ast.NodeTransformer):
            def visit_Call(self, node: ast.Call) -> ast.expr:
                node = self.generic_visit(node)
                rotary = _rotary_call(node) if rewriter.rotary_ok else None
                if rotary is not None:
                    rewriter.found.rotary += 1
                    site = _site_of(ast.Name(rewriter.owner, ast.Load()), ROTARY)
                    return like(_call("rotary", [rotary[0], rotary[1], site]), node)
                rotary = _starred_call(node, rewriter.wan_rotary)
                if rotary is not None:  # Wan's ``NAME(X, *F)``
                    rewriter.found.rotary_named += 1
                    site = _site_of(ast.Name(rewriter.owner, ast.Load()), ROTARY)
                    return like(_call("rotary_wan", [node.func, rotary[0], rotary[1], site]), node)
                rotary = _complex_rotary_call(node, rewriter.rows_rotary, local=True)
                if rotary is not None:  # the rows form's ``NAME(X, F)``
                    rewriter.found.rotary_named += 1
                    site = _site_of(ast.Name(rewriter.owner, ast.Load()), ROTARY)
                    return like(_call("rotary_rows", [node.func, rotary[0], rotary[1], site]), node)
                rotary = _complex_rotary_call(node, rewriter.complex_rotary, rewriter.local_rotary)
                if rotary is None:
                    return node
                rewriter.found.rotary_complex += 1
                site = _site_of(ast.Name(rewriter.owner, ast.Load()), RMSNORM_ROPE)
                return like(_call("rotary_complex", [node.func, rotary[0], rotary[1], site,
                                                                  ast.Constant(rewriter.local_rotary)]), node)

        count = lambda: self.found.rotary + self.found.rotary_complex + self.found.rotary_named  # noqa: E731
        before = count()
        new = Calls().visit(copy.deepcopy(stmt))
        return new if count() > before else None

    def _rotary(self, target: str, value: ast.expr, stmt: ast.stmt) -> ast.stmt | None:
        rotary = _rotary_call(value) if self.rotary_ok else None
        if rotary is None:
            return None
        self.found.rotary += 1
        call = _call("rotary", [rotary[0], rotary[1], _site_of(ast.Name(self.owner, ast.Load()), ROTARY)])
        return like(ast.Assign(targets=[ast.Name(target, ast.Store())], value=call), stmt)

    def qk_norms(self, body: list[ast.stmt]) -> list[ast.stmt]:
        """The QK-norm form of the module doc over a processor's top-level `body` (its rotary calls rewritten
        already), or `body` as it was."""
        owner, deferred, order, deferrals, upcast = self.owner, set(), [], [], set()

        class Defer(ast.NodeTransformer):
            def visit_Assign(self, node: ast.Assign) -> ast.stmt:
                target, value = _single_target(node), node.value
                cast = None
                if (target is not None and isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                        and value.func.attr == "to" and len(value.args) == 1 and not value.keywords
                        and isinstance(value.args[0], ast.Attribute) and value.args[0].attr == "dtype"
                        and isinstance(value.args[0].value, ast.Name) and value.args[0].value.id != target):
                    # Qwen-Image 2.1's ``Q = A.norm_q(Q).to(V.dtype)``: waits where the cast is no cast (`norm_later_to`)
                    cast, value = value.args[0], value.func.value
                if (target is not None and isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                        and isinstance(value.func.value, ast.Name) and value.func.value.id == owner
                        and value.func.attr in _QK_NORMS and len(value.args) == 1 and not value.keywords
                        and ((isinstance(value.args[0], ast.Name) and value.args[0].id == target)
                             or fp32_norm_input(value, target))):
                    if cast is not None and not isinstance(value.args[0], ast.Name):
                        return node  # ``A.norm_q(Q.float()).to(V.dtype)``: no form waits on both; as written
                    deferred.add(target)
                    order.append(value.func.attr)
                    if cast is not None:
                        call = _call("norm_later_to", [value.func, value.args[0], cast])
                    elif isinstance(value.args[0], ast.Name):
                        call = _call("norm_later", [value.func, value.args[0]])
                    else:  # FLUX.3's ``Q = A.norm_q(Q.float())`` (`_chain_qk_fp32`)
                        upcast.add(target)
                        call = deferred_fp32(value)
                    new = like(ast.Assign(targets=node.targets, value=call), node)
                    deferrals.append((new, call.args[1]))
                    return new
                cat = _cat_names(value, 1) if target is not None else None
                if cat is not None and cat[1] == target and set(cat) <= deferred:
                    return like(ast.Assign(targets=node.targets, value=_call(
                        "cat_later", [ast.Name(cat[0], ast.Load()), ast.Name(cat[1], ast.Load())])), node)
                if (target in deferred and isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                        and value.func.attr == "unflatten" and isinstance(value.func.value, ast.Name)
                        and value.func.value.id == target and len(value.args) == 2 and not value.keywords):
                    # Wan: ``Q = Q.unflatten(2, (A.heads, -1))`` of a pending norm, before its rotary
                    return like(ast.Assign(targets=node.targets, value=_call(
                        "unflatten_later", [value.func.value, *value.args])), node)
                return node

        last = max((i for i, stmt in enumerate(body)
                    if any(_ns_call(n, name) for n in ast.walk(stmt) for name in _ROTARY_CALLS)), default=None)
        if last is None:
            return body
        # only norms before the rotary embedding wait for it (HunyuanVideo-1.5 normalises its text q and k after it)
        new, tops = [], {}  # tops: a deferred norm's statement -> the index of the top-level statement holding it
        for k, stmt in enumerate(body[:last + 1]):
            new.append(Defer().visit(copy.deepcopy(stmt)))
            tops.update((id(d), k) for d, _ in deferrals if id(d) not in tops)
        new += body[last + 1:]
        if not deferred:
            return body
        allowed = set()  # the Name nodes that may see a pending norm: cat_later's arguments, rotary's first
        for stmt in new[:last + 1]:
            for node in ast.walk(stmt):
                if _ns_call(node, "cat_later"):
                    allowed.update(id(a) for a in node.args)
                elif _ns_call(node, "rotary"):
                    allowed.add(id(node.args[0]))
                    node.args.append(_site_of(ast.Name(owner, ast.Load()), QK_NORM_ROPE))  # `new` is ours to change
                    node.args.append(_site_of(ast.Name(owner, ast.Load()), RMSNORM_ROPE_REAL))
                elif _ns_call(node, "rotary_complex"):
                    allowed.add(id(node.args[1]))
                elif _ns_call(node, "rotary_rows") or _ns_call(node, "rotary_wan"):
                    allowed.add(id(node.args[1]))
                    node.args.append(_site_of(ast.Name(owner, ast.Load()), QK_NORM_ROWS))
                elif _ns_call(node, "rotary_half_partial"):  # ``rotary_half_partial(R, X, F, site)``
                    allowed.add(id(node.args[1]))
                    node.args.append(_site_of(ast.Name(owner, ast.Load()), QK_NORM_ROTARY_HALF))
                elif _ns_call(node, "unflatten_later"):
                    allowed.add(id(node.args[0]))
        reads = _PendingReads(allowed)
        clean = reads.clean(new[:last + 1])
        if not clean:  # reads in a branch beside a fused rotary run the norm there; any other keeps the norms
            new[:last + 1] = self._materialize_other_branches(new[:last + 1], reads.reads, allowed)
            clean = _PendingReads(allowed).clean(new[:last + 1])
        if not clean or self.proofs.dynamic or deferred & self.proofs.captured:
            return body  # a pending name read elsewhere before the rotary (or unseen): the norms run as written
        own = [d for d, _ in deferrals]  # the norms' own statements write nothing (plain RMSNorms, or run in place)
        for d, x in deferrals:  # a pending norm reads its input when its rotary runs: nothing may write it before
            if not self.proofs.stays([x], d, new[tops[id(d)]:last + 1], by_name=False, skip=own):
                return body
        pending = [(tops[id(d)], d, x) for d, x in deferrals]
        joint = (self._rotary_cats(new, last, deferred, pending) if self.complex_rotary and not self.local_rotary
                 else set())
        joint |= (self._prefix_cats(new, last, deferred - joint, pending)
                  if self.complex_rotary and not self.local_rotary else set())  # (materialized where read)
        later = [ast.Assign(targets=[ast.Name(name, ast.Store())],
                            value=_call("materialize", [ast.Name(name, ast.Load())]))
                 for name in sorted(deferred - joint) if _reads_after(new[last + 1:], name)]  # (the top level: all)
        self.found.qk_norms = order
        head = self._rows_pairs(new[:last + 1])
        out = [*head, *(like(m, new[last]) for m in later), *new[last + 1:]]
        if upcast:
            self.found.qk_fp32 = mark_casts(out, upcast, owner)
        return out

    @staticmethod
    def _materialize_other_branches(stmts: list[ast.stmt], reads: list[ast.Name], allowed: set[int]) -> list[ast.stmt]:
        """Each read of a pending norm in `reads` that stands in a branch of an ``if`` whose other branch holds a
        fused rotary call (LTX-2's ``elif attn.rope_type == "split": query = apply_split_rotary_emb(query, ...)``
        beside its interleaved rotary) -> ``materialize(N)``: there the norm runs as written, on the input it was
        deferred with (which the proofs below keep unwritten up to the rotary), and the read is allowed (`allowed`
        gains it); `stmts` with those reads wrapped."""
        def fused(branch: list[ast.stmt]) -> bool:
            return any(_ns_call(n, name) for stmt in branch for n in ast.walk(stmt) for name in _ROTARY_CALLS)

        wrap: set[int] = set()
        for node in (n for stmt in stmts for n in ast.walk(stmt)):
            if isinstance(node, ast.If) and node.orelse:
                for this, other in ((node.body, node.orelse), (node.orelse, node.body)):
                    if fused(other) and not fused(this):
                        inside = {id(n) for stmt in this for n in ast.walk(stmt)}
                        wrap.update(id(r) for r in reads if id(r) in inside)

        class Materialize(ast.NodeTransformer):
            def visit_Name(self, node: ast.Name) -> ast.expr:
                if id(node) not in wrap:
                    return node
                allowed.add(id(node))
                return like(_call("materialize", [node]), node)

        return [Materialize().visit(stmt) for stmt in stmts] if wrap else stmts

    def _rotary_cats(self, new: list[ast.stmt], last: int, deferred: set[str],
                     pending: list[tuple[int, ast.stmt, ast.expr]]) -> set[str]:
        """The joint form over the QK-norm form's `new` body (its last rotary statement at `last`): each top-level
        ``J = torch.cat([A, B], dim=1)`` after it of two names with pending norms that their complex-form rotary
        (``A = rotary_complex(F, A, E, s, False)``, the last binding of A before) rotates and nothing but this
        concatenation reads afterwards -> ``J = cat_rotated(A, B, joint_site)`` and those rotary calls ->
        ``rotary_complex_later``: Qwen-Image's text and image q (and k), whose kernel then writes both into the
        joint tensor. Rewrites `new` in place; returns the names that now wait for their concatenation. `pending`:
        ``(top-level index, statement, input)`` of each deferred norm: what such a rotary reads at the
        concatenation (its norm's input, its factors) must not be written before it."""
        after = new[last + 1:]

        def loads(name: str) -> int:
            return sum(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
                       for stmt in after for n in ast.walk(stmt))

        rotation = self._rotations(new, last)

        def rotated(name: str) -> ast.Call | None:
            found = rotation(name)
            return found[0] if found is not None else None

        def waits(name: str, cat: ast.stmt, end: int) -> bool:
            """Whether the rotary of `name` may wait for the concatenation `cat` (at `end` in `new`): nothing else
            reads its result, and nothing in between writes its factors or its norm's input."""
            return (not self.proofs.live_after(rotation(name)[1], name, ignore=cat)
                    and self._inputs_stay(new, name, rotation(name), end, pending))

        joint: set[str] = set()
        for i, stmt in enumerate(after):
            target = _single_target(stmt) if isinstance(stmt, ast.Assign) else None
            pair = _cat_names(stmt.value, 1) if target is not None else None
            if (pair is None or pair[0] == pair[1] or target in pair or not set(pair) <= deferred - joint
                    or any(loads(n) != 1 or rotated(n) is None or not waits(n, stmt, last + 1 + i) for n in pair)):
                continue
            for name in pair:
                rotated(name).func.attr = "rotary_complex_later"
            call = _call("cat_rotated", [ast.Name(pair[0], ast.Load()), ast.Name(pair[1], ast.Load()),
                                         _site_of(ast.Name(self.owner, ast.Load()), RMSNORM_ROPE_CAT)])
            new[last + 1 + i] = like(ast.Assign(targets=stmt.targets, value=call), stmt)
            joint.update(pair)
            self.found.rotary_cats += 1
        return joint

    def _rotations(self, new: list[ast.stmt], last: int):
        """``rotation(name) -> (call, statement, top-level index) | None``: the complex-form rotary of `name` (``A =
        rotary_complex(F, A, E, s, False)``) in ``new[:last + 1]``, where it is the one such call and the last
        binding of the name there."""
        rotaries: dict[str, list[tuple[int, ast.Call, ast.stmt, int]]] = {}  # name -> its rotary assignments
        stores: dict[str, list[int]] = {}
        for k, stmt in enumerate(new[:last + 1]):
            for node in ast.walk(stmt):
                target = _single_target(node) if isinstance(node, ast.Assign) else None
                if (target is not None and _ns_call(node.value, "rotary_complex")
                        and isinstance(node.value.args[1], ast.Name) and node.value.args[1].id == target):
                    rotaries.setdefault(target, []).append((node.lineno, node.value, node, k))
                if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                    stores.setdefault(node.id, []).append(node.lineno)

        def rotation(name: str):
            calls = rotaries.get(name, [])
            if len(calls) == 1 and calls[0][0] == max(stores[name]):
                return calls[0][1:]
            return None

        return rotation

    def _inputs_stay(self, new: list[ast.stmt], name: str, rotation, end: int, pending) -> bool:
        """Whether what the rotary of `name` (`rotation`: its call, statement and top-level index) and its pending
        norm read (the factors, the norm's input) is written by nothing from their statements up to ``new[end]``:
        the rotary may run anywhere before it."""
        call, stmt, k = rotation
        own = [d for _, d, _ in pending]
        if not self.proofs.stays([call.args[2]], stmt, new[k:end], by_name=False, skip=own):
            return False
        return all(self.proofs.stays([x], d, new[top:end], by_name=False, skip=own)
                   for top, d, x in pending if _single_target(d) == name)

    def _prefix_cats(self, new: list[ast.stmt], last: int, deferred: set[str],
                     pending: list[tuple[int, ast.stmt, ast.expr]]) -> set[str]:
        """The prefix form over the QK-norm form's `new` body (its last rotary statement at `last`): the one
        ``K = torch.cat([C, K], dim=1)`` after it (at the top level or inside ``if`` statements only; ``C`` another
        name) of a name with a pending norm that its complex-form rotary rotates (``K = rotary_complex(F, K, E, s,
        False)``, the last binding of K before)  ->  ``K = cat_prefix_rotated(C, K, prefix_site)`` and that rotary
        call ``rotary_complex_later``: Qwen-Image 2.1's cached key, whose kernel then writes it after the cached
        prefix (`diffusers_fastpath.ops.rmsnorm_rope_prefix`). K may be read elsewhere after the rotary (the
        ``extract`` step's cache store, the processor's attention): ``K = materialize(K)`` goes before each other
        statement that reads or binds it (descending into ``if`` statements whose test does not read it), which
        runs the rotary there as `rotary_complex` would have. Taken only where nothing from the norm's and the
        rotary's statements up to the last such place writes what they read (`_inputs_stay`). Rewrites `new` in
        place; returns the names so handled (no materialize of their own after `last`)."""
        taken: set[str] = set()
        rotation = self._rotations(new, last)
        for name in sorted(deferred):
            if rotation(name) is None:
                continue
            cats = _prefix_cats_of(new[last + 1:], name)
            if len(cats) != 1:
                continue
            cat, touched = cats[0], []
            site = _site_of(ast.Name(self.owner, ast.Load()), RMSNORM_ROPE_PREFIX)
            materialize = _materialize(name)

            def stops(stmt: ast.stmt) -> str | None:
                return "stop" if _reads(stmt, name) or name in _bound_names(stmt) else None

            value = _call("cat_prefix_rotated", [ast.Name(_cat_names(cat.value, 1)[0], ast.Load()),
                                                 ast.Name(name, ast.Load()), site])
            placed = _place_prefix_cat(new[last + 1:], cat, value, materialize, touched, stops,
                                       lambda test: not _reads(test, name) and not _bound_names(test))
            tops = [i for i, stmt in enumerate(new[last + 1:])
                    if any(t is n for t in touched for n in ast.walk(stmt))]
            end = last + 2 + max(tops)  # through the last top-level statement holding a new call, or read after one
            if not self._inputs_stay(new, name, rotation(name), end, pending):
                continue
            rotation(name)[0].func.attr = "rotary_complex_later"
            new[last + 1:] = placed
            taken.add(name)
            self.found.prefix_cats += 1
        return taken

    def prefix_linears(self, body: list[ast.stmt]) -> list[ast.stmt]:
        """The prefix-projection form over a processor's top-level `body`: ``V = A.M(X)`` at the top level (``A`` the
        attention module, ``X`` another name), then the one ``V = torch.cat([C, V], dim=1)`` after it (at the top
        level or inside ``if`` statements only; ``C`` another name), V read on the way there only as ``V.dtype`` or
        rebound as ``V = V.unflatten(D, S)`` (S not reading V)  ->  ``V = linear_later(A.M, X)`` and ``V =
        cat_prefix_linear(C, V, site)``: Qwen-Image 2.1's cached value, whose GEMM then writes the rows after the
        cached prefix (`diffusers_fastpath.ops.linear_prefix`). `linear_later` leaves the projection waiting only where
        calling the module later is the call as written and its ``.dtype`` is known (`_chain_pending.linear_wait_unfit`);
        V may be read elsewhere (the ``extract`` step's cache store, the processor's tuple): ``V = materialize(V)``
        goes before each other statement that reads or binds it (descending into ``if`` statements whose test does
        not), which runs the module there. Taken only where nothing from the projection up to the last such place
        writes X or the module (and no name of the forward is read unseen). Returns the body rewritten, or `body`."""
        proofs = self.proofs
        if proofs.dynamic:
            return body
        for i, stmt in enumerate(body):
            name = _single_target(stmt)
            call = stmt.value if name is not None else None
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == self.owner
                    and len(call.args) == 1 and isinstance(call.args[0], ast.Name) and not call.keywords
                    and call.args[0].id not in (name, self.owner) and name != self.owner
                    and name not in proofs.captured):
                continue
            placed = self._prefix_linear(body, i, name)
            if placed is not None:
                return placed
        return body

    def _prefix_linear(self, body: list[ast.stmt], i: int, name: str) -> list[ast.stmt] | None:
        """The prefix-projection form of ``body[i]`` (``name = A.M(X)``), or None where it is not one."""
        cats = _prefix_cats_of(body[i + 1:], name)
        if len(cats) != 1:
            return None
        cat, touched = cats[0], []
        site = _site_of(ast.Name(self.owner, ast.Load()), LINEAR_PREFIX)
        materialize = _materialize(name)

        def dtype_only(node: ast.AST) -> bool:
            """Whether `node` reads `name` only as ``name.dtype`` (the waiting projection answers it) and binds it
            nowhere."""
            dtypes = {id(n.value) for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr == "dtype"
                      and isinstance(n.ctx, ast.Load) and isinstance(n.value, ast.Name)}
            return name not in _bound_names(node) and all(
                id(n) in dtypes for n in ast.walk(node) if isinstance(n, ast.Name) and n.id == name)

        def unflatten(stmt: ast.stmt) -> bool:
            value = stmt.value if _single_target(stmt) == name else None
            return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                    and value.func.attr == "unflatten" and isinstance(value.func.value, ast.Name)
                    and value.func.value.id == name and len(value.args) == 2 and not value.keywords
                    and not any(isinstance(a, ast.Starred) or _reads(a, name) or _bound_names(a) for a in value.args))

        def seen(stmt: ast.stmt) -> str | None:
            if unflatten(stmt):
                return "read"  # (the waiting projection's own ``unflatten``: nothing to change)
            if not dtype_only(stmt):
                return "stop"
            return "read" if _reads(stmt, name) else None

        value = _call("cat_prefix_linear", [ast.Name(_cat_names(cat.value, 1)[0], ast.Load()),
                                            ast.Name(name, ast.Load()), site])
        placed = _place_prefix_cat(body[i + 1:], cat, value, materialize, touched, seen,
                                   lambda test: dtype_only(test) and not _bound_names(test))
        if not any(t is cat for t in touched):
            return None  # (read otherwise before the concatenation: it would run as written)
        tops = [k for k, stmt in enumerate(body[i + 1:]) if any(t is n for t in touched for n in ast.walk(stmt))]
        end = i + 2 + max(tops)  # through the last top-level statement holding a new call, or read after one
        call = body[i].value
        if not self.proofs.stays([call.args[0], call.func], body[i], body[i + 1:end], by_name=False):
            return None  # X (or the module) written before the projection would run
        stmt = body[i]
        moved = like(ast.Assign(targets=stmt.targets, value=_call("linear_later", [call.func, call.args[0]])), stmt)
        self.found.prefix_linears += 1
        return [*body[:i], moved, *placed]

    def _rows_pairs(self, body: list[ast.stmt]) -> list[ast.stmt]:
        """``Q = rotary_rows(F, Q, E, s, qk)`` directly followed by ``K = rotary_rows(F, K, E, s, qk)`` (the same
        function, table and sites; in any block) -> ``Q, K = rotary_rows_pair(F, Q, K, E, s, pair_site)``: LTX-Video's
        q and k, whose pending norms and rotary then run as one kernel reading the tables once."""
        def same(a: ast.expr, b: ast.expr) -> bool:
            return ast.dump(a) == ast.dump(b)

        def rows_call(stmt: ast.stmt):
            target = _single_target(stmt)
            value = stmt.value if target is not None else None
            if (_ns_call(value, "rotary_rows") and len(value.args) == 5 and isinstance(value.args[1], ast.Name)
                    and value.args[1].id == target):
                return target, value
            return None

        out, i = [], 0
        while i < len(body):
            stmt = body[i]
            for name in ("body", "orelse"):
                inner = getattr(stmt, name, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    setattr(stmt, name, self._rows_pairs(inner))
            first = rows_call(stmt)
            second = rows_call(body[i + 1]) if first is not None and i + 1 < len(body) else None
            if (second is not None and first[0] != second[0]
                    and all(same(first[1].args[j], second[1].args[j]) for j in (0, 2, 3, 4))
                    and not _uses(second[1].args[2], first[0]) and self.proofs.quiet(second[1].args[2])):
                (q, call), (k, _) = first, second
                pair = _call("rotary_rows_pair", [call.args[0], ast.Name(q, ast.Load()), ast.Name(k, ast.Load()),
                                                  call.args[2], call.args[3],
                                                  _site_of(ast.Name(self.owner, ast.Load()), QK_NORM_ROWS_PAIR)])
                target = ast.Tuple(elts=[ast.Name(q, ast.Store()), ast.Name(k, ast.Store())], ctx=ast.Store())
                out.append(like(ast.Assign(targets=[target], value=pair), stmt))
                self.found.rows_pairs += 1
                i += 2
                continue
            out.append(stmt)
            i += 1
        return out


def _place_prefix_cat(stmts: list[ast.stmt], cat: ast.stmt, value: ast.expr, materialize: ast.stmt,
                      touched: list[ast.stmt], seen, enter) -> list[ast.stmt]:
    """`stmts` with the concatenation statement `cat` binding `value` instead, and `materialize` put before the first
    other statement that must see the pending name as it is (``seen(stmt)`` says "stop"; "read": it reads the name
    and may run while it waits; None: it does not read it), descending into ``if`` statements whose test `enter`
    takes. `touched` gets each statement changed or read on the way (`cat` among them where it was reached). Returns
    `stmts` itself where nothing changed: the two prefix forms' placement (`_prefix_cats`, `_prefix_linear`)."""
    out, changed = [], False
    for k, stmt in enumerate(stmts):
        if stmt is cat:
            touched.append(stmt)
            return [*out, like(ast.Assign(targets=stmt.targets, value=value), stmt), *stmts[k + 1:]]
        if isinstance(stmt, ast.If) and enter(stmt.test):
            new_if = copy.copy(stmt)
            new_if.body = _place_prefix_cat(stmt.body, cat, value, materialize, touched, seen, enter)
            new_if.orelse = _place_prefix_cat(stmt.orelse, cat, value, materialize, touched, seen, enter)
            if new_if.body is not stmt.body or new_if.orelse is not stmt.orelse:
                touched.append(stmt)
                changed = True
                stmt = new_if
            out.append(stmt)
            continue
        verdict = seen(stmt)
        if verdict == "stop":
            touched.append(stmt)
            return [*out, like(copy.deepcopy(materialize), stmt), *stmts[k:]]
        if verdict == "read":
            touched.append(stmt)
        out.append(stmt)
    return out if changed else stmts  # (the name not read here: the list itself, to say nothing changed)


def _prefix_cats_of(stmts: list[ast.stmt], name: str) -> list[ast.stmt]:
    """The statements ``name = torch.cat([C, name], dim=1)`` (``C`` another name) of `stmts`, at the top level or
    inside ``if`` statements (the prefix forms' concatenation)."""
    cats = []
    for stmt in stmts:
        pair = _cat_names(stmt.value, 1) if _single_target(stmt) == name else None
        if pair is not None and pair[1] == name and pair[0] != name:
            cats.append(stmt)
        elif isinstance(stmt, ast.If):
            cats += _prefix_cats_of(stmt.body, name) + _prefix_cats_of(stmt.orelse, name)
    return cats


def _materialize(name: str) -> ast.Assign:
    """``name = materialize(name)``: a waiting value written out before a statement that reads or binds it."""
    return ast.Assign(targets=[ast.Name(name, ast.Store())], value=_call("materialize", [ast.Name(name, ast.Load())]))
