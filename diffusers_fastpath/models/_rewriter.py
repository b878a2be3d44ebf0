"""The chain rewriter's patterns: which statements of an installed forward it takes and what replaces them
(`diffusers_fastpath.models._chains` compiles the result into subclasses and puts their sites).

Patterns (``G``, ``E``, ``R``, ``X``, ``S``, ``T`` any expressions; ``U``, ``H``, ``N`` names; ``A`` an attribute
of ``self``):

- gated residual, into `diffusers_fastpath.ops.gated_residual` (whose fallback is this very expression):

  - ``U = G * E`` directly followed by ``H = R + U``, ``U`` not read again (anywhere the value can reach: after the
    enclosing blocks, at the next iteration of a loop, in a handler; `_chain_proofs`)  ->
    ``H = gated_residual(R, G, E, site)``
    (also ``H = U + R`` with ``R`` a name: a sum of two numbers is the same either way round, bit for bit)
  - ``H = R + G * E``                                                       ->  the same

  - ``H = (R.float() + E * G).type_as(R)`` (also ``E.float() * G``), ``R`` a name: Wan's fp32 chain, into
    `diffusers_fastpath.ops.gated_residual_fp32` (an fp32 gate, the product and sum fp32, one rounding)

  - cast back to a name's dtype (``.type_as(R)``, ``.to(R.dtype)``, ``.to(dtype=R.dtype)``, once or more, every cast
    kept as written around the call, whose result where its op runs is of that dtype already):
    ``(R.float() + A.float() * B.float())``, every operand upcast (Kandinsky 5 / 6)  ->  ``gated_residual_float``:
    `gated_residual_fp32` with the gate ``G.float()`` where ``update * gate`` is ``update.float() * gate`` (checked
    per call, counted on the site otherwise), the gate being the operand whose name says so (else decided per call
    by the shapes); ``(R + E * G)`` (AceStep)  ->  the gated residual form inside the casts; the site ``name_2``,
    ``name_3`` ... where a gate of that name has one already

  where ``G`` is ``name.unsqueeze(1)`` or a name (a gate already unsqueezed), or a chain of methods, subscripts and
  attributes of a name (``g.tanh()``: Qwen-Image 2.1; ``g.index_select(0, rows)``: MiniMax-H3's per-token rows;
  ``self.g.tanh()``), computed as written before the fused call (whose arguments are evaluated in the order the
  expression evaluates them: nothing moves); the site is named after that name. ``R + E * g.unsqueeze(1)`` is
  taken as ``R + g.unsqueeze(1) * E`` (a product of two numbers is the same either way round, bit for bit), and so
  is ``R + E * G`` with two names of which only ``G``'s says ``gate``; where the syntax takes the roles the other way
  round (``R + E * torch.sigmoid(1 - g).unsqueeze(1)``: Stable Audio 3), the call swaps them by their shapes. A
  2-D ``[L, D]`` or 1-D ``[D]`` gate runs as the ``[1, L, D]`` / ``[1, 1, D]`` it broadcasts as.
- the LayerNorm + modulate forms (one and two statements, rows, fp32, into a modulate method), the modulate
  of a tensor normalised earlier and the modulate-rows form: documented in `_rewriter_norms`, which holds their
  passes (`NormForms`, a base of `_Rewriter`).
- SiLU-gated product (SwiGLU's elementwise half), into `diffusers_fastpath.ops.silu_mul` (the SiLU proven on every
  value of the dtype; the fallback is the expression as written), in blocks whose adapter names the activation
  (``activations=("gate_fn",)``: FLUX.2's ``Flux2SwiGLU``):

  - ``H = self.ACT(E) * F``  ->  ``H = silu_mul(self.ACT, E, F, site)`` when ``self.ACT`` is a plain ``nn.SiLU``
    without hooks (checked per call), with the site ``silu_mul`` on the block
  - ``return F.silu(E) * G`` or ``H = F.silu(E) * G`` with ``F`` the module's ``torch.nn.functional``
    (``activations=("F.silu",)``: Z-Image's ``FeedForward._forward_silu_gating``; also written out,
    ``torch.nn.functional.silu(E)``, MiniMax-Music 3)  ->  the same op
  - ``G * self.ACT(E)`` or ``G * F.silu(E)`` (diffusers' ``SwiGLU``: ``hidden_states * self.activation(gate)``)  ->
    ``mul_silu(G, ACT, E, site)``, the operands in the order written, the same op (the product commutes exactly)
  - either product inside a larger expression (``return self.linear_2(self.silu(E) * F)``: Lumina's
    ``LuminaFeedForward``, whose ``FP32SiLU`` the op's proof covers too)  ->  the same op, in place
- RMSNorm + scale and RMSNorm + gated residual (sandwich norms: Z-Image, Lumina2), into
  `diffusers_fastpath.ops.rmsnorm_scale` and `diffusers_fastpath.ops.rmsnorm_gated_residual` (self-verified; the
  fallback is the expression as written, the gated residual still the exact fused one), in blocks whose adapter names
  the norms (``rms_norms=("attention_norm1", ...)``):

  - ``H = R + G * self.A(E)``, ``G`` any expression (``gate.unsqueeze(1).tanh()``)  ->  ``H = rms_gated_residual(self.A, R, G, E, site)``
  - ``self.A(X) * S`` anywhere in a statement, ``S`` any expression (``scale_msa``, ``(1 + scale[:, None])``)  ->
    ``rms_scale(self.A, X, S, site)``

  each when ``self.A`` is diffusers' ``RMSNorm`` without hooks (checked per call), with the site on ``self.A``.
- pairwise attention mask (Hunyuan's token refiners, HunyuanVideo-1.5's every attention), in blocks and processors
  alike, exact by construction (bitwise AND of the same values, no kernel of ours):

  - ``M1 = A.view(B, 1, 1, S).repeat(1, 1, S, 1)``, ``M2 = M1.transpose(2, 3)``, ``X = (M1 & M2).bool()``, in that
    order, ``M1`` and ``M2`` read nowhere after  ->  ``X = pairwise_mask(A, B, S)``: ``A.view(B, 1, 1, S) &
    A.view(B, 1, S, 1)``, broadcast instead of materialised and read transposed (HunyuanVideo-1.5 spent 97.5 ms of a
    1,134 ms 480p step on that transposed read)

  and, where the forward takes the rotary table ``image_rotary_emb`` and never rebinds it, with the padding before it
  (HunyuanVideo-1.5's processor pads the forward's mask to the joint length and casts it in every layer):

  - ``A = P(A, E, value=True)``, ``A = A.bool()``, then the three statements above of ``A``  ->  ``X =
    pairwise_mask_padded(P, A, E, B, S, image_rotary_emb)``: with ``P`` torch's ``F.pad``, the padded mask and its
    pairwise product are kept on the table (as the outer-product form below) for that very ``A`` at its version and
    that padding, so the first layer builds it and the others reuse it (56 of ``[1, 1, S, S]`` a 480p step, ~0.5 ms
    each); otherwise computed as written, broadcast

- outer-product attention mask (Chroma's blocks, each of which expands the forward's one ``[B, S]`` mask again), in
  blocks whose forward takes the rotary table ``image_rotary_emb`` and never rebinds it, exact by construction (the
  same product of the same tensor, computed once and handed to the later blocks):

  - ``X = A[:, None, None, :] * A[:, None, :, None]``  ->  ``X = outer_mask(A, image_rotary_emb)``: the product is
    kept on the table (`diffusers_fastpath.models._rope_cache.derived`), which the transformer builds once per forward,
    for that very ``A`` object at its version; another mask, one written in place, an inference tensor (no version
    counter), no table or a ``torch.compile`` trace computes it as written (Chroma1-HD: 57 products of ``[1, 1, 4608, 4608]`` a step, 2.9 ms of GPU time)

- tanh-GELU + concatenation, into `diffusers_fastpath.ops.gelu_cat` (the GELU proven exact on every value of the
  dtype; the fallback is the two eager calls):

  - ``M = self.ACT(self.PROJ(X))`` and, later in the same block of statements, ``H = torch.cat([A, M], dim=2)``,
    ``M`` read nowhere else  ->  ``M = self.PROJ(X)`` ... ``H = gelu_cat(A, M, site)`` when ``self.ACT`` is a plain
    ``nn.GELU(approximate="tanh")`` without hooks (checked per call), else the original two statements

  with the site ``gelu_cat`` on the block.

- SwiGLU + concatenation (FLUX.2's parallel single-block processor), into `diffusers_fastpath.ops.swiglu_cat` (its
  SiLU proven exact on every value; the fallback is the two statements as written), in processors whose adapter
  names the attention module's SwiGLU attributes (``swiglus=("mlp_act_fn",)``):

  - ``M = attn.ACT(X)`` and, later in the same block of statements, ``H = torch.cat([A, M], dim=-1)``, ``M`` read
    nowhere else, nothing in between rebinding a name of ``X`` or ``M`` or writing what ``X`` may hold  ->
    ``M = X`` ... ``H = swiglu_cat(A, M, site)`` when ``attn.ACT`` is a registered SwiGLU module (`register_swiglu`:
    a class whose installed forward is, by digest, ``gate(x[..., :h]) * x[..., h:]``) with a plain SiLU gate and
    no hooks (checked per call), else the original two statements

  with the site ``swiglu_cat`` on ``attn.ACT`` (which then counts nothing as ``silu_mul``).

An attention processor's patterns (the rotary forms, the QK norms that wait for them, the head concatenations and
their attention) are in `_rewriter_attention`, whose passes `_Rewriter` runs on a processor's forward.

Before the patterns run, calls of helper functions of the forward's own module are inlined where that is exactly
the call (`_chain_inline`: Kandinsky 6's ``apply_scale_shift`` / ``apply_gate_sum``; `_chain_inline_stmts`: helpers
called as a whole statement, Qwen-Image 2.1's ``_qwenimage21_prepare_qkv``), and kept so only where the patterns
then fuse more than in the forward as written.

Each rewrite is exact by construction: the fused op computes the replaced expression with eager's roundings and, on
any input it does not take (another dtype, autograd, a layout, a norm that is not a plain LayerNorm), runs that
expression itself. The operand order is kept (``R + G * E``, not ``E * G + R``), so even the fallback's op order
is the original's.

A rewrite that changes *when* something runs (a LayerNorm, a SiLU or a GELU that now waits for expressions or
statements after it) or *whether* a name is bound (a product, a mask, a pending norm) is taken only where
`_chain_proofs` proves it changes no value: nothing in between rebinds or writes (in place, ``out=``,
``inplace=True``, ``+=``, a store into it, a view of it, a call that may write its arguments) what the moved
computation reads, and nothing afterwards reads the dropped name; else the statements stay as written. The property
test (``tests/test_rewriter_property.py``) rewrites random forwards built of these forms and such perturbations and
compares them with the originals on random inputs.

What each pattern's statements look like as AST is in `_chain_syntax`; what the rewritten statements call at run
time is in `_chain_calls`.
"""

from __future__ import annotations

import ast
import copy
import itertools
from dataclasses import dataclass, field

from ._chain_proofs import Proofs, _bound_names, like
from ._chain_rotary_matrix import matrix_calls
from ._chain_rotate_half import partial_call, rotate_half_call
from ._chain_syntax import (_act_of_proj, _call, _casts_back, _cat_of, _float_gated_of, _float_modulate_of,
                            _fp32_gated_of, _fp32_modulate_of, _fp32_norm_of, _gate_name, _modulate_of,
                            _operand_name, _outer_mask_of, _padded_pairwise_mask_of, _pairwise_mask_of, _recast,
                            _self_attr, _self_module_call, _single_target, _site_of, _unsqueezed, _uses)
from ._rewriter_attention import AttentionPasses
from ._rewriter_norms import MODULATE_ONLY, NORM_MODULATE_LATER, NormForms

MODULATE = "layernorm_scale_shift"  # the op of every adaLN site: LayerNorm and modulate in one kernel
RMS_MODULATE = "rmsnorm_modulate"  # a diffusers RMSNorm's modulate site (LTX-Video): the RMSNorm kernel's epilogue
MODULATE_FP32 = "layernorm_scale_shift_fp32"  # Wan's: an fp32 LayerNorm and modulate of the upcast stream
AFFINE_FP32 = "layernorm_affine_fp32"  # Wan's norm2: an FP32LayerNorm with weight and bias of the upcast stream
GATED_RESIDUAL = "gated_residual"
GATED_RESIDUAL_FP32 = "gated_residual_fp32"
GELU_CAT = "gelu_cat"
SILU_MUL = "silu_mul"
RMS_SCALE = "rmsnorm_scale"  # a sandwich norm's input side: norm(x) * scale
RMS_GATED = "rmsnorm_gated_residual"  # its output side: residual + gate * norm(x)
SWIGLU_CAT = "swiglu_cat"
_GELU_FLAG = "_fastpath_gelu_in_cat"  # the local the rewritten forward decides the GELU's place in
_SWIGLU_FLAG = "_fastpath_swiglu_in_cat"  # the same for the SwiGLU + concatenation form


@dataclass
class Rewrite:
    """What `rewrite_forward` found in one forward: the sites the rewritten statements count on."""

    gates: list[str] = field(default_factory=list)  # gated residual sites on the block, by gate name
    gates_fp32: list[str] = field(default_factory=list)  # the same, of Wan's fp32 chain
    norms: list[str] = field(default_factory=list)  # attributes of the block holding a LayerNorm + modulate site
    norms_fp32: list[str] = field(default_factory=list)  # the same, of Wan's fp32 chain
    affine_fp32: list[str] = field(default_factory=list)  # attributes of the block: FP32LayerNorms with affine (Wan)
    modulates: list[str] = field(default_factory=list)  # modulates of an already-normalised tensor, by target name
    # modulate-rows forms whose norm call waits for them (`norm_modulate_later`), as (norm attribute, site name)
    norm_modulates: list[tuple[str, str]] = field(default_factory=list)
    rotary: int = 0  # rotary embeddings fused (a processor's q and k: one site on its attention module)
    qk_norms: list[str] = field(default_factory=list)  # a processor's QK norms run inside qk_norm_rope, by name
    gelu_cat: bool = False  # a GELU + concatenation fused (the site ``gelu_cat`` on the block)
    silu_mul: bool = False  # a SiLU-gated product fused (the site ``silu_mul`` on the block)
    rms_scales: list[str] = field(default_factory=list)  # attributes of the block: RMSNorm + scale sites
    rms_gated: list[str] = field(default_factory=list)  # attributes of the block: RMSNorm + gated residual sites
    pairwise_masks: int = 0  # pairwise attention masks built by broadcasting (no site: exact by construction)
    outer_masks: int = 0  # outer-product attention masks built once per rotary table (no site: exact by construction)
    swiglu_cats: list[str] = field(default_factory=list)  # a processor's SwiGLU + concatenation, by attribute
    rotary_complex: int = 0  # complex-form rotary calls of a processor (with its QK norms where they wait)
    head_cats: int = 0  # a processor's concatenations of [B, H, S, D] operands along the sequence (`cat_heads`)
    seq_major_attention: bool = False  # ... and the attention of three of them, token-major (`attention_seq_major`)
    gqa_attention: bool = False  # a processor's grouped-query attention on its kv heads as they are (`attention_gqa`)
    bool_masks: int = 0  # a processor's attention calls with a boolean mask made additive once (`attention_bool_mask`)
    sigmoid_mul: int = 0  # a processor's sigmoid output gates, ``A * torch.sigmoid(G)`` (`sigmoid_mul`; Krea 2)
    rotary_named: int = 0  # calls of an adapter-named rotary form (LTX-Video's rows, Wan's): one site, ``rotary_emb``
    rows_pairs: int = 0  # LTX-Video's q and k rows-form rotary calls with pending norms, run as one pair
    qk_fp32: int = 0  # rotary calls of pending float32 QK norms proven cast back right after (FLUX.3)
    rotary_half: int = 0  # a processor's rotate-half rotary expressions (Ideogram 4, Cosmos 3): site ``rotary_half``
    rotary_half_partial: int = 0  # ``Q = R(X, *F)`` calls that may be MiniMax-H3's partial rotate-half (by digest)
    rotary_matrix: int = 0  # ``R(X, T)`` calls of Kandinsky 5's and 6's matrix-form rotary (by digest)
    rotary_cats: int = 0  # concatenations of two complex-form rotary results written by their kernel (Qwen-Image)
    prefix_cats: int = 0  # concatenations of a prefix and a complex-form rotary result written by its kernel
    prefix_linears: int = 0  # concatenations of a prefix and a projection whose GEMM writes after it (`linear_prefix`)
    inlined: list[str] = field(default_factory=list)  # helper functions inlined before the patterns ran (no site)
    lazy_gates: int = 0  # scale-rows gates read through an index by their gated residual (`_norm_methods.lazy_gates`)
    # norms of scale-rows method calls joined with the gated residual right before them (`_norm_methods
    # .gated_norm_methods`): a ``gated`` site on each
    gated_norms: list[str] = field(default_factory=list)
    index_rows: int = 0  # fused calls reading ``index_select`` rows through the index (`_chain_index_rows`)
    token_rows: int = 0  # ``select_per_token`` rows read through an index by a fused RMSNorm (`_chain_token_rows`)

    def __bool__(self) -> bool:
        return bool(self.gates or self.gates_fp32 or self.norms or self.norms_fp32 or self.affine_fp32
                    or self.modulates or self.norm_modulates or self.rotary
                    or self.gelu_cat or self.silu_mul or self.rms_scales or self.rms_gated or self.pairwise_masks
                    or self.outer_masks or self.swiglu_cats or self.rotary_complex
                    or self.head_cats or self.gqa_attention or self.bool_masks or self.sigmoid_mul or self.rotary_named or self.rotary_half
                    or self.rotary_half_partial or self.rotary_matrix or self.prefix_linears)


# the FLUX-derived blocks' rotary table parameter: built once per forward by the transformer (`FluxPosEmbed`) and
# handed to every block, it anchors what the blocks would otherwise derive again each from the same inputs
_ROTARY_TABLE = "image_rotary_emb"


def _unassigned_parameter(function: ast.FunctionDef, name: str) -> bool:
    """Whether `name` is a parameter of `function` that its body never rebinds."""
    params = [a.arg for a in (*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs)]
    return name in params and not any(
        isinstance(n, ast.Name) and n.id == name and not isinstance(n.ctx, ast.Load) for n in ast.walk(function))


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


class _Rewriter(NormForms, AttentionPasses):
    # the names of the forward's module functions the rotate-half forms take (`_chain_rotate_half.known_names`)
    rotate_halves: frozenset[str] = frozenset()
    partial_rotaries: frozenset[str] = frozenset()
    # ... and the matrix-form rotary (`_chain_rotary_matrix.known_names`): module functions, the forward's own
    matrix_rotaries: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())

    def __init__(self, owner: str, rotary_ok: bool, norm_methods: dict[str, str] | None = None,
                 activations: tuple[str, ...] = (), rms_norms: tuple[str, ...] = (),
                 swiglus: tuple[str, ...] = (), complex_rotary: str | None = None, local_rotary: bool = False,
                 head_cats: bool = False, rows_rotary: str | None = None, wan_rotary: str | None = None,
                 proofs: Proofs | None = None) -> None:
        self.found = Rewrite()
        self.proofs = proofs  # what a rewrite that moves or drops anything must prove (`_chain_proofs`)
        self.rows_rotary = rows_rotary  # the rows-form rotary function's name (the adapter's; `register_rows_rotary`)
        self.wan_rotary = wan_rotary  # ... Wan's, a function the forward defines (its source checked by digest)
        self.head_cats = head_cats  # a processor's ``torch.cat([A, B], dim=2)`` of [B, H, S, D] names as `cat_heads`
        self.complex_rotary = complex_rotary  # the complex-form rotary function's name (the adapter's)
        self.local_rotary = local_rotary  # ... a function the forward defines itself (its source checked by digest)
        self.swiglus = swiglus  # the owner's attributes that may be a registered SwiGLU (the SwiGLU + cat form)
        self.activations = activations  # the block's attributes that may be a SiLU (the SwiGLU form)
        self.rms_norms = rms_norms  # the block's attributes that may be diffusers' RMSNorm (the sandwich-norm forms)
        self.norm_methods = norm_methods or {}
        self.owner = owner  # the name of the module the rotary site lives on
        self.rotary_ok = rotary_ok  # the forward's apply_rotary_emb is diffusers' own
        self.block = owner == "self"  # a module's forward: the block patterns (a processor's self holds no sites)

    def _gated(self, target: str, residual: ast.expr, gate: ast.expr, update: ast.expr, stmt: ast.stmt,
               fp32: bool = False, cast: bool = False) -> ast.stmt | None:
        # cast: Wan's ``E.float() * G`` (the namespace computes that form where it differs from ``E * G``)
        if not _unsqueezed(gate) and _unsqueezed(update):  # ``R + E * g.unsqueeze(1)``: the product commutes exactly
            gate, update = update, gate
            if cast:
                return None  # the .float() would go with the gate: left as written
            if _names(gate) & _bound_names(update):  # g.unsqueeze(1), a view of g, is now evaluated before E: only a
                return None  # walrus in E rebinding g could tell
        elif (not _unsqueezed(gate) and isinstance(gate, ast.Name) and isinstance(update, ast.Name)
              and "gate" in update.id and "gate" not in gate.id):  # ``R + E * gate``, the gate unsqueezed before
            gate, update = update, gate
            if cast:
                return None
        name = _gate_name(gate)
        if name is None or name in self.found.gates or name in self.found.gates_fp32:
            return None
        (self.found.gates_fp32 if fp32 else self.found.gates).append(name)
        call = _call("gated_residual_fp32" if fp32 else "gated_residual",
                     [residual, gate, update, _site_of(_self_attr(), name), *([ast.Constant(True)] if cast else [])])
        return like(ast.Assign(targets=[ast.Name(target, ast.Store())], value=call), stmt)

    def _activation(self, node: ast.expr) -> tuple[ast.expr, ast.expr] | None:
        """``(module, E)`` if `node` is ``self.ACT(E)`` (ACT one of the adapter's activations) or ``F.silu(E)``
        (module ``None``), else None."""
        act = _self_module_call(node)
        if act is not None and act[0] in self.activations:
            return _self_attr(act[0]), act[1]
        if not (isinstance(node, ast.Call) and len(node.args) == 1 and not isinstance(node.args[0], ast.Starred)
                and not node.keywords and isinstance(node.func, ast.Attribute) and node.func.attr == "silu"):
            return None
        written = ast.unparse(node.func)
        if written in ("F.silu", "torch.nn.functional.silu") and written in self.activations:
            return ast.Constant(None), node.args[0]  # (`_chains` checked that the module's F / torch is torch's)
        return None

    def _silu_mul(self, value: ast.expr, stmt: ast.stmt) -> ast.Call | None:
        """The SwiGLU form's call for ``self.ACT(E) * G`` or ``F.silu(E) * G`` (see the module doc) in statement
        `stmt`, or None (also where evaluating ``G``, which the SiLU now waits for, may change what it reads); and
        for ``G * self.ACT(E)`` (diffusers' ``SwiGLU``, Stable Audio 3's feed-forward), whose call
        ``mul_silu(G, module, E, site)`` evaluates its operands in the order written and calls the activation after
        them, as the product does: nothing moves."""
        if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult)) or self.found.silu_mul:
            return None
        act = self._activation(value.left)
        if act is None:
            act = self._activation(value.right)
            if act is None:
                return None
            self.found.silu_mul = True
            return _call("mul_silu", [value.left, act[0], act[1], _site_of(_self_attr(), SILU_MUL)])
        module = act[0]
        if not self.proofs.stays([module, act[1]], stmt, exprs=[value.right]):
            return None
        self.found.silu_mul = True
        return _call("silu_mul", [module, act[1], value.right, _site_of(_self_attr(), SILU_MUL)])

    def one(self, stmt: ast.stmt) -> ast.stmt | None:
        """A one-statement pattern, rewritten, or None."""
        if not self.block:
            if self.head_cats and (cat := self._head_cat(stmt)) is not None:
                return cat
            if (gate := self.sigmoid_gate(stmt)) is not None:  # Krea 2's output gate (`_rewriter_attention`)
                return gate
            if (half := rotate_half_call(stmt, self.owner, self.rotate_halves)) is not None:  # Ideogram 4, Cosmos 3 (`_chain_rotate_half`)
                self.found.rotary_half += 1
                return like(half, stmt)
            if not isinstance(stmt, ast.Assign):
                return None
            if ((rotary := self._rotary_anywhere(stmt)) is None
                    and (partial := partial_call(stmt, self.owner, self.partial_rotaries))):
                self.found.rotary_half_partial += 1  # MiniMax-H3's ``Q = R(X, *F)``, after the named forms
                return like(partial, stmt)
            if rotary is None:  # Kandinsky 5's and 6's ``apply_rotary(X, T)`` calls (`_chain_rotary_matrix`)
                new, count = matrix_calls(stmt, self.owner, *self.matrix_rotaries)
                self.found.rotary_matrix += count
                return like(new, stmt) if count else None
            return rotary
        if isinstance(stmt, ast.Return) and stmt.value is not None:
            if (call := self._silu_mul(stmt.value, stmt)) is not None:
                return like(ast.Return(value=call), stmt)
            if (cast := _casts_back(stmt.value)) is not None and (new := self._cast_back_form(*cast, stmt)) is not None:
                return like(ast.Return(value=new), stmt)  # Kandinsky 6's ``return apply_gate_sum(...)``, inlined
            if (call := self._norm_form(stmt.value, stmt)) is not None:  # FLUX.3's, Qwen-Image 2.1's output norms
                return like(ast.Return(value=call), stmt)
        if self.norm_methods and (merged := self._nested_norm_method(stmt)) is not None:
            return merged
        target = _single_target(stmt)
        if target is None:
            return None
        value = stmt.value
        if (call := self._silu_mul(value, stmt)) is not None:
            return like(ast.Assign(targets=[ast.Name(target, ast.Store())], value=call), stmt)
        if (cast := _casts_back(value)) is not None and (new := self._cast_back_form(*cast, stmt)) is not None:
            return like(ast.Assign(targets=[ast.Name(target, ast.Store())], value=new), stmt)
        if (wan := _fp32_gated_of(value)) is not None:
            residual, update, gate, cast = wan  # R.float() (and E.float()) now wait for G, and G is evaluated before E
            stays = self.proofs.stays
            if not (stays([residual], stmt, exprs=[update, gate]) and stays([update], stmt, exprs=[gate])
                    and stays([gate], stmt, exprs=[update])):
                return None
            return self._gated(target, residual, gate, update, stmt, fp32=True, cast=cast)
        if (wan := _fp32_modulate_of(value)) is not None:
            attr, x, scale, shift = wan
            if not self.proofs.stays([_self_attr(attr), x], stmt, exprs=[scale, shift]):  # the norm waits for S and T
                return None
            if attr not in self.found.norms_fp32:
                self.found.norms_fp32.append(attr)
            call = _call("norm_modulate_fp32", [_self_attr(attr), x, scale, shift, _site_of(_self_attr(attr))])
            return like(ast.Assign(targets=[ast.Name(target, ast.Store())], value=call), stmt)
        if (wan := _fp32_norm_of(value)) is not None:
            attr, x = wan
            if attr not in self.found.affine_fp32:
                self.found.affine_fp32.append(attr)
            call = _call("norm_affine_fp32", [_self_attr(attr), x, _site_of(_self_attr(attr))])
            return like(ast.Assign(targets=[ast.Name(target, ast.Store())], value=call), stmt)
        if (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add) and isinstance(value.right, ast.BinOp)
                and isinstance(value.right.op, ast.Mult)):
            normed = _self_module_call(value.right.right)
            if normed is not None and normed[0] in self.rms_norms:
                if not self.proofs.stays([_self_attr(normed[0])], stmt, exprs=[value.left, value.right.left]):
                    return None  # self.A is now read before R and G are evaluated
                if normed[0] not in self.found.rms_gated:
                    self.found.rms_gated.append(normed[0])
                call = _call("rms_gated_residual", [_self_attr(normed[0]), value.left, value.right.left, normed[1],
                                                    _site_of(_self_attr(normed[0]), RMS_GATED)])
                return like(ast.Assign(targets=[ast.Name(target, ast.Store())], value=call), stmt)
            return self._gated(target, value.left, value.right.left, value.right.right, stmt)
        if (call := self._norm_form(value, stmt)) is not None:
            return like(ast.Assign(targets=[ast.Name(target, ast.Store())], value=call), stmt)
        modulate = _modulate_of(value)
        if (modulate is not None and not modulate[3] and isinstance(modulate[0], ast.Name)
                and target not in self.found.modulates  # a tensor normalised earlier, modulated here; N * (1 + S)
                and self.proofs.stays([modulate[0], modulate[1]], stmt, exprs=[modulate[2]])):  # now waits for T
            self.found.modulates.append(target)
            site = _site_of(_self_attr(), f"{MODULATE_ONLY}_{target}")
            call = _call("modulate", [modulate[0], modulate[1], modulate[2], site])
            return like(ast.Assign(targets=[ast.Name(target, ast.Store())], value=call), stmt)
        return self._rotary(target, value, stmt)

    def _site_name(self, name: str) -> str:
        """`name`, or ``name_2``, ``name_3`` ... where a gate site of that name exists already (Kandinsky's blocks
        name every gate ``gate``): one site per statement."""
        taken = {*self.found.gates, *self.found.gates_fp32}
        if name not in taken:
            return name
        return next(f"{name}_{k}" for k in itertools.count(2) if f"{name}_{k}" not in taken)

    def _cast_back_form(self, inner: ast.expr, x: str, casts: list[ast.Call], stmt: ast.stmt) -> ast.expr | None:
        """The forms written inside a cast back to a name's dtype (`_casts_back`), the casts kept as written around
        the fused call (whose result, where its op runs, is of that dtype already: the casts return it as it is):

        - ``(R.float() + A.float() * B.float())`` cast back to R (Kandinsky 5 / 6)  ->  ``gated_residual_float``
        - ``(self.A(X.float()) * (S.float() + 1.0) + T.float())`` cast back to X  ->  ``norm_modulate_float``
        - ``(R + E * G)`` cast back, ``R`` a name (AceStep)  ->  the gated residual form, inside the casts (Wan's
          ``R.float() + ...`` is its own form)

        None where no form matches (or its proof fails): Wan's forms, matched before, are not these."""
        stays = self.proofs.stays
        if (gated := _float_gated_of(inner, x)) is not None:
            residual, left, right = gated
            names = [_operand_name(left), _operand_name(right)]
            # the gate: the operand whose name says so, else the only one with a name, else decided per call by the
            # shapes (None); either way round the product is the same (it commutes exactly), and the op refuses roles
            # that are not its own (its fallback: this very sum)
            if names[0] is not None and "gate" in names[0]:
                gate_left = True
            elif names[1] is not None and "gate" in names[1]:
                gate_left = False
            elif (names[0] is None) != (names[1] is None):
                gate_left = names[0] is not None
            elif names[0] is not None:
                gate_left = None
            else:
                return None
            # R.float() now waits for A and B, and A.float() for B
            if not (stays([residual], stmt, exprs=[left, right]) and stays([left], stmt, exprs=[right])):
                return None
            name = self._site_name(names[0] if gate_left in (True, None) else names[1])
            self.found.gates_fp32.append(name)
            call = _call("gated_residual_float", [residual, left, right, _site_of(_self_attr(), name),
                                                  ast.Constant(gate_left)])
            return _recast(call, casts)
        if (wan := _float_modulate_of(inner, x)) is not None and _fp32_modulate_of(_recast(inner, casts[-1:])) is None:
            attr, normed, scale, shift, normed_left, one_left, one = wan
            module = _self_attr(*attr.split("."))
            if not stays([module, normed], stmt, exprs=[scale, shift]):  # the norm now waits for S and T
                return None
            if attr not in self.found.norms_fp32:
                self.found.norms_fp32.append(attr)
            call = _call("norm_modulate_float", [module, normed, scale, shift, _site_of(_self_attr(*attr.split("."))),
                                                 ast.Constant(normed_left), ast.Constant(one_left), ast.Constant(one)])
            return _recast(call, casts)
        if (isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Add) and isinstance(inner.left, ast.Name)
                and isinstance(inner.right, ast.BinOp)
                and isinstance(inner.right.op, ast.Mult) and _self_module_call(inner.right.right) is None):
            gated = self._gated("_", inner.left, inner.right.left, inner.right.right, stmt)
            return _recast(gated.value, casts) if gated is not None else None
        return None

    def nested(self, stmt: ast.stmt) -> ast.stmt:
        """`stmt` with every ``self.A(X) * S`` in it (``A`` one of the adapter's RMSNorms) as ``rms_scale``, and a
        SwiGLU product inside a larger expression (``self.linear_2(self.silu(E) * F)``, Lumina's) as ``silu_mul``;
        then every modulate-rows form left (`_rows_modulates`)."""
        if not isinstance(stmt, (ast.Assign, ast.Return, ast.Expr)):
            return stmt
        stmt = self._nested_modulates(stmt)
        return self._rows_modulates(self._scales(stmt))

    def _scales(self, stmt: ast.stmt) -> ast.stmt:
        if not (self.rms_norms or self.activations):
            return stmt
        rewriter = self

        class Scales(ast.NodeTransformer):
            def visit_BinOp(self, node: ast.BinOp) -> ast.expr:
                node = self.generic_visit(node)
                normed = _self_module_call(node.left) if isinstance(node.op, ast.Mult) else None
                if normed is None or normed[0] not in rewriter.rms_norms:
                    swiglu = rewriter._silu_mul(node, stmt) if rewriter.activations else None
                    return node if swiglu is None else like(swiglu, node)
                if not rewriter.proofs.stays([_self_attr(normed[0]), normed[1]], stmt, exprs=[node.right]):
                    return node  # the norm now waits for S
                if normed[0] not in rewriter.found.rms_scales:
                    rewriter.found.rms_scales.append(normed[0])
                return like(_call("rms_scale", [_self_attr(normed[0]), normed[1], node.right,
                                                             _site_of(_self_attr(normed[0]), RMS_SCALE)]), node)

        return Scales().visit(stmt)

    def two(self, first: ast.stmt, second: ast.stmt) -> ast.stmt | None:
        """A two-statement pattern (`first` directly followed by `second`), rewritten as one statement, or None."""
        u, h = _single_target(first), _single_target(second)
        if u is not None and self.block and (merged := self._norm_method(u, first, second)) is not None:
            return merged
        if u is not None and self.block and isinstance(second, ast.Return):  # MiniMax-H3's output norm
            return self.norm_then_rows_modulate(first, second)
        if u is None or h is None or not self.block:
            return None
        a, b = first.value, second.value
        if (isinstance(a, ast.BinOp) and isinstance(a.op, ast.Mult)
                and isinstance(b, ast.BinOp) and isinstance(b.op, ast.Add)):
            # ``U = G * E`` then ``H = R + U`` (or ``U + R``: the sum commutes exactly), R a plain name: read before G
            # and E are evaluated, which only a walrus there could tell; U is no longer bound, which only a read of it
            # afterwards could tell (anywhere: after the enclosing blocks, in the next iteration of a loop, ...)
            residual = (b.left if isinstance(b.right, ast.Name) and b.right.id == u
                        else b.right if isinstance(b.left, ast.Name) and b.left.id == u else None)
            if (isinstance(residual, ast.Name) and residual.id != u and residual.id not in _bound_names(a)
                    and (h == u or not self.proofs.live_after(second, u))):
                return self._gated(h, residual, a.left, a.right, second)
        called = _self_module_call(a)
        modulate = _modulate_of(b)
        if (called is not None and modulate is not None and isinstance(modulate[0], ast.Name)
                and modulate[0].id == u and not _uses(modulate[1], u) and not _uses(modulate[2], u)
                and (h == u or not self.proofs.live_after(second, u))):  # N, no longer bound, read nowhere after
            return self._modulated(h, called[0], called[1], modulate[1], modulate[2], modulate[3], second, first)
        if called is not None and modulate is None:  # ``N * (1.0 + S) + T`` and the like (MiniMax-H3's blocks)
            return self.norm_then_rows_modulate(first, second)
        return None

    def gelu_cat(self, body: list[ast.stmt], function: ast.FunctionDef) -> list[ast.stmt]:
        """The GELU + concatenation pattern over one block of statements (see the module doc)."""
        for i, stmt in enumerate(body):
            m = _single_target(stmt)
            act = _act_of_proj(stmt.value) if m is not None else None
            if act is None or self.found.gelu_cat:
                continue
            for j in range(i + 1, len(body)):
                h = _single_target(body[j])
                cat = _cat_of(body[j].value, 2) if h is not None else None
                if cat is None or cat[1] != m:
                    continue
                reads = sum(isinstance(n, ast.Name) and n.id == m and isinstance(n.ctx, ast.Load) for n in ast.walk(function))
                if (reads != 1 or _uses(cat[0], m) or self.proofs.dynamic
                        or m in _bound_names(cat[0]).union(*(_bound_names(b) for b in body[i + 1:j]))):
                    break  # M read elsewhere, or rebound before the concatenation (the GELU would take that value)
                flag = ast.Name(_GELU_FLAG, ast.Load())
                decide = ast.Assign(targets=[ast.Name(_GELU_FLAG, ast.Store())], value=_call(
                    "gelu_in_cat", [_self_attr(act[0]), _site_of(_self_attr(), GELU_CAT)]))
                up = ast.Assign(targets=[ast.Name(m, ast.Store())], value=ast.IfExp(test=flag, body=act[1], orelse=stmt.value))
                joined = ast.Assign(targets=[ast.Name(h, ast.Store())], value=ast.IfExp(test=flag, body=_call(
                    "gelu_cat", [cat[0], ast.Name(m, ast.Load()), _site_of(_self_attr(), GELU_CAT)]), orelse=body[j].value))
                self.found.gelu_cat = True
                return [*body[:i], like(decide, stmt), like(up, stmt), *body[i + 1:j],
                        like(joined, body[j]), *body[j + 1:]]
        return body

    def swiglu_cat(self, body: list[ast.stmt], function: ast.FunctionDef) -> list[ast.stmt]:
        """The SwiGLU + concatenation form over one block of statements (see the module doc)."""
        for i, stmt in enumerate(body):
            m = _single_target(stmt)
            value = stmt.value if m is not None else None
            if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                    and isinstance(value.func.value, ast.Name) and value.func.value.id == self.owner
                    and value.func.attr in self.swiglus and value.func.attr not in self.found.swiglu_cats
                    and len(value.args) == 1 and not value.keywords and not isinstance(value.args[0], ast.Starred)):
                continue
            x = value.args[0]
            for j in range(i + 1, len(body)):
                h = _single_target(body[j])
                cat = _cat_of(body[j].value, -1) if h is not None else None
                if cat is None or cat[1] != m:
                    continue
                reads = sum(isinstance(n, ast.Name) and n.id == m and isinstance(n.ctx, ast.Load)
                            for n in ast.walk(function))
                reads -= sum(isinstance(n, ast.Name) and n.id == m for n in ast.walk(x))  # ``M = attn.ACT(M)``
                between = body[i + 1:j]
                if (reads != 1 or _uses(cat[0], m) or self.proofs.dynamic
                        or m in _bound_names(cat[0]).union(*(_bound_names(b) for b in between))
                        or not self.proofs.stays([value.func, x], stmt, between, [cat[0]], body[j])):
                    break  # M read elsewhere or rebound, or X (M itself now) written before the concatenation
                act = value.func
                site = _site_of(copy.deepcopy(act), SWIGLU_CAT)
                flag = ast.Name(_SWIGLU_FLAG, ast.Load())
                decide = ast.Assign(targets=[ast.Name(_SWIGLU_FLAG, ast.Store())],
                                    value=_call("swiglu_in_cat", [copy.deepcopy(act), site]))
                deferred = ast.Assign(targets=[ast.Name(m, ast.Store())],
                                      value=ast.IfExp(test=flag, body=copy.deepcopy(x), orelse=value))
                joined = ast.Assign(targets=[ast.Name(h, ast.Store())], value=ast.IfExp(test=flag, body=_call(
                    "swiglu_cat", [copy.deepcopy(act), cat[0], ast.Name(m, ast.Load()), copy.deepcopy(site)]),
                    orelse=body[j].value))
                self.found.swiglu_cats.append(act.attr)
                return [*body[:i], like(decide, stmt), like(deferred, stmt), *body[i + 1:j],
                        like(joined, body[j]), *body[j + 1:]]
        return body

    def pairwise_masks(self, body: list[ast.stmt], function: ast.FunctionDef) -> list[ast.stmt]:
        """The pairwise-mask and outer-mask forms of the module doc over one block of statements."""
        anchor = _ROTARY_TABLE if _unassigned_parameter(function, _ROTARY_TABLE) else None
        out, i, quiet = [], 0, self.proofs.quiet

        def dead_after(k: int):  # the value a name holds after body[k] is read nowhere (the form no longer binds it)
            return lambda name: not self.proofs.live_after(body[k], name)

        while i < len(body):
            padded = (_padded_pairwise_mask_of(body[i:i + 5], anchor, dead_after(i + 4), quiet)
                      if anchor is not None and i + 5 <= len(body) else None)
            if padded is not None:
                self.found.pairwise_masks += 1
                out.append(padded)
                i += 5
                continue
            merged = _pairwise_mask_of(body[i:i + 3], dead_after(i + 2), quiet) if i + 3 <= len(body) else None
            if merged is not None:
                self.found.pairwise_masks += 1
                out.append(merged)
                i += 3
                continue
            outer = _outer_mask_of(body[i], anchor) if anchor is not None else None
            if outer is not None:
                self.found.outer_masks += 1
            out.append(outer or body[i])
            i += 1
        return out

    def body(self, body: list[ast.stmt], function: ast.FunctionDef) -> list[ast.stmt]:
        body = self.pairwise_masks(body, function)
        if self.block:
            body = self.deferred_norms(self.gelu_cat(body, function))
        elif self.swiglus:
            body = self.swiglu_cat(body, function)
        out: list[ast.stmt] = []
        i = 0
        while i < len(body):
            stmt = body[i]
            for name in ("body", "orelse", "finalbody"):  # if / for / while / with / try blocks
                inner = getattr(stmt, name, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    setattr(stmt, name, self.body(inner, function))
            if self.block and isinstance(stmt, (ast.Assign, ast.Return, ast.Expr)):
                stmt = self._nested_modulates(stmt)  # first: a gated residual around one then proves its order
            if i + 1 < len(body) and (merged := self.two(stmt, body[i + 1])) is not None:
                out.append(self.nested(merged) if self.block else merged)
                i += 2
                continue
            new = self.one(stmt) or stmt
            out.append(self.nested(new) if self.block else new)
            i += 1
        return out
