"""The chain rewriter's LayerNorm + modulate patterns (`_rewriter` holds the others and runs these, as methods of
`_Rewriter`; `_chains` compiles the result). Patterns (``E``, ``R``, ``X``, ``S``, ``T`` any expressions; ``H``,
``N`` names; ``A`` an attribute of ``self``):

- LayerNorm + modulate, into `norm_modulate` (the fused `layernorm_scale_shift` or `layernorm_modulate` in every
  tier; the fallback is the LayerNorm module and the exact modulate):

  - ``N = self.A(X)`` directly followed by ``N = N * (1 + S[:, None]) + T[:, None]``  ->  ``N = norm_modulate(self.A, X, S, T, site)``
  - ``N = self.A(X) * (1 + S[:, None]) + T[:, None]``                               ->  the same
  - the same with rows already broadcast, ``N * (1 + S) + T`` or ``(1 + S) * N + T`` (FLUX.2): ``S[:, 0]`` and
    ``T[:, 0]`` go to the op where they are ``[B, 1, D]`` (the same products and sums element by element:
    multiplication and addition commute exactly), per-token ``[B, S, D]`` rows (FLUX.3) to `layernorm_modulate`,
    else the expression runs as written
  - ``N = self.A(X) * (1 + S)[:, None, :] + T[:, None, :]`` (CogVideoX's and ConsisID's ``CogVideoXLayerNormZero``,
    ``AdaLayerNormContinuous``: the sum indexed, the same elements as ``1 + S[:, None, :]``)  ->
    ``norm_modulate_indexed``: ``norm_modulate`` where ``S`` and ``T`` are ``[B, D]``, else as written
  - ``N = self.A(X) * (1 + S)``, a scale without a shift (``A`` none of the adapter's RMSNorms)  ->  ``norm_scale``:
    `layernorm_scale` of ``[B or 1, S or 1, D]`` rows, else as written
  - each one-expression form above also returned, ``return self.A(X) * (1 + S) + T`` / ``return self.A(X) * (1 +
    S)`` (FLUX.3's ``Flux3AdaLayerNorm``, Qwen-Image 2.1's ``QwenImage21AdaLayerNormContinuous``)  ->  ``return``
    of the same call
  - the two-statement form into another name, ``H = N * (1 + S[:, None]) + T[:, None]`` (CogView3Plus's
    ``normed_x = self.norm_x(x)`` ... ``x = normed_x * ...``), where ``N``, no longer bound, is read nowhere after

  - the rows form with ``self.A`` diffusers' ``RMSNorm`` (LTX-Video's weightless norms, per-token ``[B, T, D]``
    rows, all in the stream's dtype)  ->  `diffusers_fastpath.ops.rmsnorm_modulate` (the RMSNorm kernel with a
    modulate epilogue rounded as eager's three kernels; self-verified), the site op ``rmsnorm_modulate``

  - ``N = (self.A(X.float()) * (1 + S) + T).type_as(X)``, ``X`` a name (Wan: an fp32 LayerNorm of the upcast
    stream, fp32 ``[B, 1, D]`` rows)  ->  `layernorm_scale_shift_fp32` (the LayerNorm kernel with an fp32 modulate
    and one rounding; the fallback is this very expression), the site op ``layernorm_scale_shift_fp32``

  - ``(self.A(X.float()) * (S.float() + 1.0) + T.float())`` cast back to X (Kandinsky 5, and Kandinsky 6's
    ``apply_scale_shift`` inlined; ``1`` or ``1.0`` on either side, the product either way round; ``self.A`` may be
    a submodule's, ``self.B.A``; anywhere in a statement)  ->  ``norm_modulate_float``: `layernorm_scale_shift_fp32`
    of the upcast ``[B, 1, D]`` rows (every operation after the norm is fp32 whatever the rows' dtype), else as
    written

  with the site on the module ``self.A`` (`report`: ``<block>.<A>``), named after the op its calls run
  (`layernorm_scale_shift`, `layernorm_modulate` for a norm with its own affine, an ``FP32LayerNorm`` or per-token
  rows, `layernorm_scale`). The two statements of the first form may have others between them (HunyuanVideo
  normalises both streams, then modulates both; LTX-Video unpacks its adaLN rows) where those are plain assignments
  to other names (one or a tuple of them) that neither read ``N`` nor rebind a name ``X`` reads, read nothing ``X``
  may hold (``self.A`` may write it in place: `Proofs.unread`), and write nothing ``X`` may hold (in place, through
  ``out=``, ``inplace=True``, a view, a call that may write its arguments: `_chain_proofs`), nor does the
  modulate's ``S`` or ``T``, and no exception handler reads ``N``: the LayerNorm then runs at the modulate, on the
  same ``X``.
- LayerNorm into a modulate method, for a block that modulates in a method of its own (Qwen-Image's
  ``_modulate``); the adapter names the method ``M`` and a fused counterpart ``F`` (``norm_methods={M: F}``),
  which it defines and checks against the installed ``M``:

  - ``N = self.A(X)`` directly followed by ``T = self.M(N, ...)``, ``N`` not read again  ->  ``T = self.F(self.A, X, ...)``
  - ``T = self.M(self.A(X), ...)`` (Qwen-Image 2.1, through the generic path's known methods)  ->  the same

  with the site on ``self.A``, as above.
- modulate of an already-normalised tensor, into `diffusers_fastpath.ops.modulate_scale_shift` (exact on any input;
  the fallback is this very expression), where none of the LayerNorm forms above took it (SD3.5's
  ``SD35AdaLayerNormZeroX`` modulates one LayerNorm output twice):

  - ``H = N * (1 + S[:, None]) + T[:, None]``, ``N`` a name  ->  ``H = modulate(N, S, T, site)``

  with the site ``modulate_scale_shift_<H>`` on the block.
- the modulate-rows form, where none of the forms above took it, anywhere in a statement:

  - ``A * (1 + B) + T`` or ``(1.0 + A) * B + T`` (``1`` or ``1.0``; any operands: MiniMax-H3's ``N * (1.0 +
    s.index_select(0, rows)) + t.index_select(0, rows)`` after a ``torch.nn.RMSNorm``, LTX-2's a2v / v2a ``N * (1
    + s.squeeze(2)) + t.squeeze(2)``, Krea 2's ``self.attn((1.0 + s) * self.norm1(x) + t, ...)``)  ->
    ``modulate_rows(A, B, T, site, one, normed_left)``: the operands evaluated in the order written, the arithmetic
    after them (taken where evaluating ``B`` and ``T`` leaves what ``A`` holds as it was, and ``T`` what ``B``
    holds), as `modulate_scale_shift` of a ``[R, L, D]`` view where the rows are per sample, per frame or per
    token (`_chain_calls._modulate_rows`), else as written

  with the site ``modulate_scale_shift_<name>`` on the block (the target, the norm's attribute, or the name).
  Where the normalised operand is a norm's call ``self.A(X)`` (Krea 2's) that may wait for the other operands
  (`_norm_waits`), ``norm_modulate_later(self.A, X, S, T, site, modulate_site, one, normed_left)`` instead: the norm
  and the modulate as one kernel (`diffusers_fastpath.ops.zero_centred_modulate`, self-verified) where ``self.A`` is
  a zero-centred float32 RMSNorm (`_chain_qk_fp32.is_zero_centred`) and the rows ``[B or 1, 1, D]`` of its dtype,
  or (`diffusers_fastpath.ops.rms_norm_modulate_rows`, self-verified) a ``torch.nn.RMSNorm`` and rows picked with
  ``index_select`` (`_chain_index_rows`), the site ``norm_modulate`` on the norm (its op the kernel's); else the
  norm's call, then ``modulate_rows`` as above (the block's site, added where the norm is neither).
  The same where the norm is the statement before, ``N = self.A(X)`` directly followed by ``H = N * (1.0 + S) + T``
  or ``return N * (1.0 + S) + T`` (MiniMax-H3's blocks and output norm; `norm_then_rows_modulate`), with ``N`` read
  in neither ``S`` nor ``T`` and no longer bound afterwards, where no LayerNorm form took the pair; with ``S`` and
  ``T`` ``A.index_select(0, I)`` of names, ``norm_modulate_picked(self.A, X, A, I, A2, I2, site, modulate_site,
  one)``: the rows read through the index, or written out after the norm's call as eager writes them.

"""

from __future__ import annotations

import ast
import itertools

from ._chain_index_rows import picked_rows
from ._chain_proofs import like
from ._chain_syntax import (_assigned_names, _call, _casts_back, _float_modulate_of, _indexed_modulate_of,
                            _modulate_of, _rows_modulate_of, _scale_only_of, _self_attr, _self_module_call,
                            _single_target, _site_of, _uses)

MODULATE_ONLY = "modulate_scale_shift"  # a modulate of a tensor normalised by an earlier statement
# the named site, on the norm module, of a modulate-rows form whose norm call waits for it (`norm_modulate_later`):
# Krea 2's zero-centred norm and modulate as one kernel (`zero_centred_modulate`), a torch.nn.RMSNorm and the modulate
# of its index_select-picked rows (`rms_norm_modulate_rows`: MiniMax-H3's); the site's op says which
NORM_MODULATE_LATER = "norm_modulate"


class NormForms:
    """The LayerNorm + modulate passes of `_Rewriter` (which holds ``found``, ``proofs``, ``rms_norms``,
    ``norm_methods`` and ``_cast_back_form``)."""

    def _modulated(self, target: str, attr: str, x: ast.expr, scale: ast.expr, shift: ast.expr, rows: bool,
                   stmt: ast.stmt, first: ast.stmt | None = None, between: list[ast.stmt] = ()) -> ast.stmt | None:
        """``target = norm_modulate(self.attr, x, scale, shift, site)`` in place of `stmt`, where the LayerNorm, which
        ran first (in `first` where given, with the statements `between` after it), reads what it read there once
        `scale` and `shift` are evaluated; else None."""
        call = self._norm_call("norm_modulate_rows" if rows else "norm_modulate", attr, x, [scale, shift], stmt,
                               first, between)
        return None if call is None else like(ast.Assign(targets=[ast.Name(target, ast.Store())], value=call), stmt)

    def _norm_call(self, func: str, attr: str, x: ast.expr, rows: list[ast.expr], stmt: ast.stmt,
                   first: ast.stmt | None = None, between: list[ast.stmt] = ()) -> ast.Call | None:
        """``func(self.attr, x, *rows, site)``, the site on ``self.attr``, where the LayerNorm (run in `first` where
        given, with the statements `between` after it) reads what it read there once `rows` are evaluated, and the
        rows hold no number computed before the call (`Proofs.aliases_only`: ``self.attr`` may be any module, one
        that writes its input in place too); else None."""
        if not self.proofs.stays([_self_attr(attr), x], first or stmt, list(between), rows, stmt):
            return None
        if between and not self.proofs.unread([x], first, list(between)):  # they ran after the call as written
            return None
        if not all(self.proofs.aliases_only(r) for r in rows):  # the call now runs after them: it may write them
            return None
        if attr not in self.found.norms:
            self.found.norms.append(attr)
        return _call(func, [_self_attr(attr), x, *rows, _site_of(_self_attr(attr))])

    def _norm_form(self, value: ast.expr, stmt: ast.stmt) -> ast.Call | None:
        """The one-expression LayerNorm + modulate forms of `value` (an assignment's or a ``return``'s), as the
        namespace's call: ``self.A(X) * (1 + S[:, None]) + T[:, None]`` and the rows forms (``norm_modulate`` /
        ``norm_modulate_rows``), ``self.A(X) * (1 + S)[:, None, :] + T[:, None, :]`` (``norm_modulate_indexed``:
        CogVideoX), ``self.A(X) * (1 + S)`` (``norm_scale``: Qwen-Image 2.1's output norm, ``A`` none of the
        adapter's RMSNorms, whose ``rms_scale`` form takes them); else None."""
        modulate = _modulate_of(value)
        if modulate is not None and (called := _self_module_call(modulate[0])) is not None:
            return self._norm_call("norm_modulate_rows" if modulate[3] else "norm_modulate", called[0], called[1],
                                   [modulate[1], modulate[2]], stmt)
        indexed = _indexed_modulate_of(value)
        if indexed is not None and (called := _self_module_call(indexed[0])) is not None:
            return self._norm_call("norm_modulate_indexed", called[0], called[1], [indexed[1], indexed[2]], stmt)
        scaled = _scale_only_of(value)
        if (scaled is not None and (called := _self_module_call(scaled[0])) is not None
                and called[0] not in self.rms_norms):
            return self._norm_call("norm_scale", called[0], called[1], [scaled[1]], stmt)
        return None

    def _nested_modulates(self, stmt: ast.stmt) -> ast.stmt:
        """`stmt` with each fp32 modulate cast back (`_cast_back_form`'s second form) inside a larger expression as
        ``norm_modulate_float``: Kandinsky 6's ``self.attn(apply_scale_shift(self.norm(x.float()), x, s, t))``,
        inlined, modulates in the attention's argument."""
        rewriter = self

        class Modulates(ast.NodeTransformer):
            def visit_Call(self, node: ast.Call) -> ast.expr:
                node = self.generic_visit(node)
                cast = _casts_back(node)
                if cast is None or _float_modulate_of(cast[0], cast[1]) is None:
                    return node
                new = rewriter._cast_back_form(*cast, stmt)
                return node if new is None else like(new, node)

        if not any(isinstance(n, ast.Call) and n.func.__class__ is ast.Attribute and n.func.attr in ("type_as", "to")
                   for n in ast.walk(stmt)):
            return stmt
        return Modulates().visit(stmt)

    def _rows_modulates(self, stmt: ast.stmt) -> ast.stmt:
        """`stmt` with every modulate-rows form in it (`_rows_modulate_of`: ``A * (1 + B) + T`` or ``(1.0 + A) * B +
        T``, anywhere: MiniMax-H3's ``N * (1.0 + s.index_select(0, rows)) + t.index_select(0, rows)``, LTX-2's
        ``N * (1 + s.squeeze(2)) + t.squeeze(2)``, Krea 2's ``self.attn((1.0 + s) * self.norm1(x) + t, ...)``) that no
        form before took as ``modulate_rows(A, B, T, site, one, normed_left)``: the operands evaluated in the order
        written, the arithmetic after them, taken where evaluating ``B`` and ``T`` leaves what ``A`` holds as it was,
        and ``T`` what ``B`` holds (`_chain_proofs`); the site ``modulate_scale_shift_<name>`` on the block, after
        the assignment's target, the norm ``self.N`` of the normalised operand, or its name."""
        rewriter, target = self, _single_target(stmt)

        class Modulates(ast.NodeTransformer):
            def visit_BinOp(self, node: ast.BinOp) -> ast.expr:
                node = self.generic_visit(node)
                form = _rows_modulate_of(node)
                if form is None:
                    return node
                first, second, shift, one, normed_left = form
                stays = rewriter.proofs.stays
                if not (stays([first], stmt, exprs=[second, shift]) and stays([second], stmt, exprs=[shift])):
                    return node
                normed = first if normed_left else second
                called = _self_module_call(normed)
                name = (target if node is value else called[0] if called is not None
                        else normed.id if isinstance(normed, ast.Name) else None)
                if name is None:
                    return node
                taken = rewriter.found.modulates + [n for _, n in rewriter.found.norm_modulates]
                name = next(n for k in itertools.count(1) if (n := name if k == 1 else f"{name}_{k}") not in taken)
                site = _site_of(_self_attr(), f"{MODULATE_ONLY}_{name}")
                scale = second if normed_left else first
                if called is not None and rewriter._norm_waits(called, scale, shift, normed_left, stmt):
                    rewriter.found.norm_modulates.append((called[0], name))
                    norm_site = _site_of(_self_attr(called[0]), NORM_MODULATE_LATER)
                    return like(_call("norm_modulate_later", [_self_attr(called[0]), called[1], scale, shift,
                                                              norm_site, site, ast.Constant(one),
                                                              ast.Constant(normed_left)]), node)
                rewriter.found.modulates.append(name)
                return like(_call("modulate_rows", [first, second, shift, site, ast.Constant(one),
                                                    ast.Constant(normed_left)]), node)

        value = getattr(stmt, "value", None)
        if not any(_rows_modulate_of(n) is not None for n in ast.walk(stmt)):
            return stmt
        return Modulates().visit(stmt)

    def norm_then_rows_modulate(self, first: ast.stmt, second: ast.stmt) -> ast.stmt | None:
        """``N = self.A(X)`` (`first`) directly followed by `second`, ``H = N * (1.0 + S) + T`` or ``return N * (1.0 +
        S) + T`` (any modulate-rows form of the name ``N``: MiniMax-H3's blocks and output norm), as one statement
        ``H = norm_modulate_later(self.A, X, S, T, ...)`` (or its ``return``); else None. The norm then runs after
        ``S`` and ``T`` are evaluated instead of before, so, besides ``N`` being read in neither and no longer bound
        after `second` (no handler reading it either: the merged statement never binds it): evaluating ``S`` and ``T``
        leaves what ``self.A`` and ``X`` hold as it was, and each holds no number computed when it is evaluated
        (`Proofs.aliases_only`: the call, which may write in place, now runs after it), or both are ``A.index_select(0,
        I)`` of names (`_chain_index_rows.picked_rows`, with ``N`` on the left): ``norm_modulate_picked(self.A, X, A,
        I, A2, I2, ...)`` then, whose ``index_select`` runs after the norm's call, where eager runs it (in every
        fallback, and while compiling), or never (`diffusers_fastpath.ops.rms_norm_modulate_rows` reads the tables
        through the index)."""
        u = _single_target(first)
        called = _self_module_call(first.value) if u is not None else None
        if called is None or not isinstance(second, (ast.Assign, ast.Return)) or second.value is None:
            return None
        h = _single_target(second) if isinstance(second, ast.Assign) else None
        if isinstance(second, ast.Assign) and h is None:
            return None
        form = _rows_modulate_of(second.value)
        if form is None:
            return None
        left, right, shift, one, normed_left = form
        normed, scale = (left, right) if normed_left else (right, left)
        if (not (isinstance(normed, ast.Name) and normed.id == u) or _uses(scale, u) or _uses(shift, u)
                or (h != u and self.proofs.live_after(second, u)) or self.proofs.handlers_read(second, u)):
            return None
        picked = (picked_rows(scale), picked_rows(shift)) if normed_left else (None, None)
        if None in picked and not (self.proofs.aliases_only(scale) and self.proofs.aliases_only(shift)):
            return None
        attr, x = called
        if not self.proofs.stays([_self_attr(attr), x], first, exprs=[scale, shift], where=second):
            return None
        taken = self.found.modulates + [n for _, n in self.found.norm_modulates]
        base = h if h is not None else u
        name = next(n for k in itertools.count(1) if (n := base if k == 1 else f"{base}_{k}") not in taken)
        self.found.norm_modulates.append((attr, name))
        sites = [_site_of(_self_attr(attr), NORM_MODULATE_LATER), _site_of(_self_attr(), f"{MODULATE_ONLY}_{name}")]
        if None not in picked:  # each ``index_select`` runs where the rows are read: after the norm's call
            self.found.index_rows += 1
            names = [ast.Name(n.id, ast.Load()) for pair in picked for n in pair]
            call = _call("norm_modulate_picked", [_self_attr(attr), x, *names, *sites, ast.Constant(one)])
        else:
            call = _call("norm_modulate_later", [_self_attr(attr), x, scale, shift, *sites, ast.Constant(one),
                                                 ast.Constant(normed_left)])
        if h is None:
            return like(ast.Return(value=call), second)
        return like(ast.Assign(targets=[ast.Name(h, ast.Store())], value=call), second)

    def _norm_waits(self, called: tuple[str, ast.expr], scale: ast.expr, shift: ast.expr, normed_left: bool,
                    stmt: ast.stmt) -> bool:
        """Whether the norm call ``self.A(X)`` of a modulate-rows form (`called`: ``(A, X)``) may run after the
        form's operands are evaluated, as ``norm_modulate_later(self.A, X, S, T, ...)`` does: evaluating ``X`` writes
        and binds nothing (it may now be evaluated before ``S``), ``S`` and ``T`` leave what ``self.A`` and ``X``
        hold as they were, and each operand that ran after the call as written (``T``; ``S`` too where the normalised
        tensor is on the left) holds no number computed when it is evaluated (`Proofs.aliases_only`: the call, which
        may write in place, now runs after it). (``1 + S`` computed after the call where ``S`` is on the left: the
        form's own proof, that the call leaves what ``S`` holds as it was.)"""
        attr, x = called
        return (self.proofs.quiet(x) and self.proofs.stays([_self_attr(attr), x], stmt, exprs=[scale, shift])
                and self.proofs.aliases_only(shift) and (not normed_left or self.proofs.aliases_only(scale)))

    def _norm_method(self, u: str, first: ast.stmt, second: ast.stmt) -> ast.stmt | None:
        """``N = self.A(X)`` then ``T = self.M(N, ...)`` with ``M`` a modulate method: ``T = self.F(self.A, X, ...)``."""
        called = _self_module_call(first.value)
        call = second.value if isinstance(second, ast.Assign) and len(second.targets) == 1 else None
        if (called is None or not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute)
                or not (isinstance(call.func.value, ast.Name) and call.func.value.id == "self")
                or call.func.attr not in self.norm_methods or call.keywords or not call.args
                or not (isinstance(call.args[0], ast.Name) and call.args[0].id == u)
                or any(_uses(a, u) or isinstance(a, ast.Starred) for a in call.args[1:])
                or _uses(second.targets[0], u) or self.proofs.live_after(second, u)
                or not self.proofs.stays([_self_attr(called[0]), called[1]], first, exprs=call.args[1:], where=second)):
            return None  # N is no longer bound, and the LayerNorm now waits for the method's other arguments
        if called[0] not in self.found.norms:
            self.found.norms.append(called[0])
        fused = ast.Call(func=_self_attr(self.norm_methods[call.func.attr]),
                         args=[_self_attr(called[0]), called[1], *call.args[1:]], keywords=[])
        return like(ast.Assign(targets=second.targets, value=fused), second)

    def _nested_norm_method(self, stmt: ast.stmt) -> ast.stmt | None:
        """``T = self.M(self.A(X), ...)`` with ``M`` a modulate method: ``T = self.F(self.A, X, ...)`` (Qwen-Image
        2.1: the LayerNorm now runs after the method's other arguments are evaluated, which `stays` proves changes
        nothing it reads)."""
        call = stmt.value if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
        if (not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute)
                or not (isinstance(call.func.value, ast.Name) and call.func.value.id == "self")
                or call.func.attr not in self.norm_methods or call.keywords or not call.args
                or any(isinstance(a, ast.Starred) for a in call.args[1:])):
            return None
        called = _self_module_call(call.args[0])
        if called is None or not self.proofs.stays([_self_attr(called[0]), called[1]], stmt, exprs=call.args[1:]):
            return None
        if called[0] not in self.found.norms:
            self.found.norms.append(called[0])
        fused = ast.Call(func=_self_attr(self.norm_methods[call.func.attr]),
                         args=[_self_attr(called[0]), called[1], *call.args[1:]], keywords=[])
        return like(ast.Assign(targets=stmt.targets, value=fused), stmt)

    def deferred_norms(self, body: list[ast.stmt]) -> list[ast.stmt]:
        """``N = self.A(X)``, other plain assignments, then ``N = N * (1 + S[:, None]) + T[:, None]`` (see the module
        doc): the norm statement dropped, the modulate rewritten."""
        out = list(body)
        i = 0
        while i < len(out):
            n = _single_target(out[i])
            called = _self_module_call(out[i].value) if n is not None else None
            if called is None:
                i += 1
                continue
            x_names = {m.id for m in ast.walk(called[1]) if isinstance(m, ast.Name)}
            for j in range(i + 1, len(out)):
                stmt, target = out[j], _single_target(out[j])
                modulate = _modulate_of(stmt.value) if target is not None else None
                if (modulate is not None and isinstance(modulate[0], ast.Name) and modulate[0].id == n
                        and not _uses(modulate[1], n) and not _uses(modulate[2], n)
                        and (target == n or not self.proofs.live_after(stmt, n))):  # CogView3Plus: ``x = normed_x *``
                    # adjacent pairs are `two`'s; in between, N keeps its old value: no handler may read it
                    merged = (self._modulated(target, called[0], called[1], *modulate[1:], stmt, out[i], out[i + 1:j])
                              if j > i + 1 and not self.proofs.handlers_read(out[i], n) else None)
                    if merged is not None:  # the LayerNorm reads what it read at out[i] (`_modulated` proves it)
                        out[j] = merged
                        del out[i]
                        i -= 1
                    break
                stores = _assigned_names(stmt)  # LTX-Video unpacks its adaLN rows in between: ``a, b = t.unbind(2)``
                if stores is None or n in stores or stores & x_names or _uses(stmt.value, n):
                    break
            i += 1
        return out
