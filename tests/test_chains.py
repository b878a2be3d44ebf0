"""The chain rewriter (`diffusers_fastpath.models._chains`): which statements it fuses, which it must leave alone,
and that FLUX.1's hand-mirrored forwards (the oracle) are what it finds in diffusers' FLUX sources."""

from __future__ import annotations

import inspect
import pickle

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
from diffusers.models.transformers.transformer_ltx import apply_rotary_emb as ltx_rotary

from diffusers_fastpath.models import _chain_calls, _chains, flux
from diffusers_fastpath.ops import Site


class Block(torch.nn.Module):
    """A block in the style of diffusers' forwards, with every pattern and the near misses the rewriter must skip."""

    def __init__(self, dim=8):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, emb, gate_a, gate_b, gate_c, scale, shift, k):
        h = self.norm(x)
        h = h * (1 + scale[:, None]) + shift[:, None]          # two-statement modulate
        y = self.norm(x) * (1 + scale[:, None]) + shift[:, None]  # inline modulate
        u = gate_a.unsqueeze(1) * self.proj(h)
        x = x + u                                             # two-statement gated residual
        x = x + gate_b.unsqueeze(1) * y                       # inline gated residual
        v = gate_c.unsqueeze(1) * y
        z = x + v                                             # near miss: v is read again below
        w = k * 2
        w2 = w + 1                                            # near miss: a constant, not a gated residual
        return x, y, z + v, w2


def _inputs(seed=0, dim=8):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)  # noqa: E731
    return dict(x=r(2, 5, dim), emb=r(2, dim), gate_a=r(2, dim), gate_b=r(2, dim), gate_c=r(2, dim), scale=r(2, dim),
                shift=r(2, dim), k=3)


def _fused_block():
    sub, found = _chains.fused_subclass(Block, "FusedBlock", __name__)
    return sub, found


def test_finds_the_patterns_and_skips_the_near_misses():
    sub, found = _fused_block()
    assert found.gates == ["gate_a", "gate_b"] and found.norms == ["norm"]
    source = inspect.getsource(sub.forward)  # the rewritten source, registered with linecache
    assert source.count("_diffusers_fastpath_chains.gated_residual(") == 2
    assert source.count("_diffusers_fastpath_chains.norm_modulate(") == 2
    assert "v = gate_c.unsqueeze(1) * y" in source and "z = x + v" in source and "w2 = w + 1" in source


def _with_sites(block, found):
    for gate in found.gates:
        setattr(block, f"_fastpath_site_{gate}", Site("gated_residual"))
    block.norm._fastpath_site = Site("layernorm_scale_shift")


@pytest.mark.parametrize("seed", [0, 1])
def test_rewritten_forward_is_bit_identical_and_counts_on_its_sites(seed, emulated_kernels):
    """The fused ops' fast paths run on CPU with emulated kernels (see conftest): the rewrite's wiring is tested."""
    torch.manual_seed(seed)
    ref_block = Block().to(torch.bfloat16)
    sub, found = _fused_block()
    block = sub().to(torch.bfloat16)
    block.load_state_dict(ref_block.state_dict())
    _with_sites(block, found)
    inputs = _inputs(seed)
    with torch.no_grad():  # inference, as a pipeline runs it (with grad the ops fall back: "requires grad")
        ref = ref_block(**inputs)
        got = block(**inputs)
    assert all(torch.equal(a, b) for a, b in zip(got[:3], ref[:3])) and got[3] == ref[3] == 7
    assert block._fastpath_site_gate_a.fast == block._fastpath_site_gate_b.fast == 1
    assert block.norm._fastpath_site.fast == 2


class MethodBlock(torch.nn.Module):
    """Qwen-Image's style: the modulate in a method of the block, fed by a LayerNorm in the statement before."""

    def __init__(self, dim=8):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm2 = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def _mod(self, x, params, index=None):
        shift, scale, gate = params.chunk(3, dim=-1)
        return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1), gate.unsqueeze(1)

    def forward(self, x, params, index=None):
        n = self.norm1(x)
        a, g = self._mod(n, params, index)                    # fused: n is read nowhere else
        m = self.norm2(x)
        b, h = self._mod(m, params)                           # near miss: m is read again below
        c = self.norm1(x)
        d = self._other(c, params)                            # near miss: not the named method
        return a * g + b * h + m + d

    def _other(self, x, params):
        return x + params[:, None, : x.shape[-1]]


def _fused_mod(self, norm, x, params, index=None):
    site = getattr(norm, "_fastpath_site", None)
    if site is not None:
        site.fast += 1
    return self._mod(norm(x), params, index)


def test_a_layernorm_feeding_a_modulate_method_is_handed_to_its_fused_counterpart():
    sub, found = _chains.fused_subclass(MethodBlock, "FusedMethodBlock", __name__,
                                        norm_methods={"_mod": ("_mod_norm", _fused_mod)})
    assert found.norms == ["norm1"] and found.gates == []
    source = inspect.getsource(sub.forward)
    assert "a, g = self._mod_norm(self.norm1, x, params, index)" in source
    assert "b, h = self._mod(m, params)" in source and "d = self._other(c, params)" in source
    assert _chains.rewrite_forward(MethodBlock.forward, "X.forward") is None  # without the method named: nothing
    torch.manual_seed(3)
    ref_block = MethodBlock().to(torch.bfloat16)
    block = sub().to(torch.bfloat16)
    block.norm1._fastpath_site = Site("layernorm_scale_shift")
    x, params = torch.randn(2, 5, 8).to(torch.bfloat16), torch.randn(2, 24).to(torch.bfloat16)
    assert torch.equal(block(x, params), ref_block(x, params)) and block.norm1._fastpath_site.fast == 1


class DeferredBlock(torch.nn.Module):
    """HunyuanVideo's style: both streams normalised, then both modulated; a residual written ``U + R``; a gate
    unsqueezed before it is used; and the near misses of each."""

    def __init__(self, dim=8):
        super().__init__()
        self.norm2 = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm2_context = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, c, scale, shift, gate_a, gate_b):
        n = self.norm2(x)
        m = self.norm2_context(c)
        n = n * (1 + scale[:, None]) + shift[:, None]         # fused: only an unrelated norm between
        m = m * (1 + scale[:, None]) + shift[:, None]         # fused: adjacent after the first is merged
        p = self.norm2(x)
        x = x * 2                                             # near miss: X rebound in between
        p = p * (1 + scale[:, None]) + shift[:, None]
        q = self.norm2(c)
        r = c.mul_(1)                                         # near miss: an in-place call in between
        q = q * (1 + scale[:, None]) + shift[:, None]
        y = gate_a.unsqueeze(1) * n
        y = y + x                                             # fused: U + R
        gate_c = gate_b.unsqueeze(1)
        z = c + m * gate_c                                    # fused: the gate is the name that says so
        return y, z, p, q, r


def test_deferred_norms_sums_either_way_round_and_gate_names():
    sub, found = _chains.fused_subclass(DeferredBlock, "FusedDeferredBlock", __name__)
    assert found.norms == ["norm2", "norm2_context"] and found.gates == ["gate_a", "gate_c"]
    assert found.modulates == ["p", "q"]  # the near misses' modulates alone: their LayerNorms stay where they are
    source = inspect.getsource(sub.forward)
    assert "n = self.norm2(x)" not in source and "m = self.norm2_context(c)" not in source
    assert source.count("norm_modulate(") == 2 and "p = self.norm2(x)" in source and "q = self.norm2(c)" in source
    assert "p = _diffusers_fastpath_chains.modulate(p, scale, shift," in source
    assert "gated_residual(x, gate_a.unsqueeze(1), n," in source and "gated_residual(c, gate_c, m," in source
    torch.manual_seed(4)
    block = sub().to(torch.bfloat16)
    r = lambda *shape: torch.randn(*shape).to(torch.bfloat16)  # noqa: E731
    args = (r(2, 5, 8), r(2, 3, 8), r(2, 8), r(2, 8), r(2, 8), r(2, 8))
    ref = DeferredBlock().to(torch.bfloat16)(*[a.clone() for a in args])
    assert all(torch.equal(a, b) for a, b in zip(block(*[a.clone() for a in args]), ref))


class UnpackBlock(torch.nn.Module):
    """LTX-Video's style: the adaLN rows unpacked from a table between the norm and its modulate (rows already
    broadcast), and the near miss where the unpack rebinds the norm's input."""

    def __init__(self, dim=8):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm2 = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, table):
        n = self.norm1(x)
        shift, scale = table.unbind(dim=2)                    # fused: a tuple of other names in between
        n = n * (1 + scale) + shift
        m = self.norm2(x)
        x, scale = table.unbind(dim=2)                        # near miss: the unpack rebinds X
        m = m * (1 + scale) + shift
        return n, m, x


def test_deferred_norms_let_a_tuple_unpack_of_other_names_pass():
    sub, found = _chains.fused_subclass(UnpackBlock, "FusedUnpackBlock", __name__)
    assert found.norms == ["norm1"]
    source = inspect.getsource(sub.forward)
    assert "n = self.norm1(x)" not in source and "norm_modulate_rows(self.norm1, x, scale, shift," in source
    assert "m = self.norm2(x)" in source and "m = m * (1 + scale) + shift" in source
    torch.manual_seed(5)
    block = sub().to(torch.bfloat16)
    args = (torch.randn(2, 1, 8).to(torch.bfloat16), torch.randn(2, 1, 2, 8).to(torch.bfloat16))
    ref = UnpackBlock().to(torch.bfloat16)(*args)
    assert all(torch.equal(a, b) for a, b in zip(block(*args), ref))


class Processor:
    """A processor in diffusers' style: its ``self`` holds no sites, so only the rotary pattern applies (on `attn`)."""

    def __call__(self, attn, hidden_states, gate, image_rotary_emb=None):
        query = attn(hidden_states).unflatten(-1, (2, -1))
        hidden_states = hidden_states + gate * hidden_states
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        return query, hidden_states


def test_processors_take_only_the_rotary_pattern_with_the_site_on_their_module(emulated_kernels):
    sub, found = _chains.fused_subclass(Processor, "FusedProcessor", __name__, "__call__")
    assert found.rotary == 1 and found.gates == [] and found.norms == [] and not found.gelu_cat
    attn = torch.nn.Linear(8, 8).to(torch.bfloat16)
    attn._fastpath_site_rotary_emb = Site("rotary_emb")
    gen = torch.Generator().manual_seed(0)
    x, gate = torch.randn(2, 5, 8, generator=gen).to(torch.bfloat16), torch.randn(2, 1, 8, generator=gen).to(torch.bfloat16)
    cos, sin = torch.randn(5, 4, generator=gen), torch.randn(5, 4, generator=gen)
    with torch.no_grad():
        got, ref = sub()(attn, x, gate, (cos, sin)), Processor()(attn, x, gate, (cos, sin))
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert attn._fastpath_site_rotary_emb.fast == 1


class JointProcessor:
    """HunyuanVideo's style: ``apply_rotary_emb`` imported inside the call, and applied to the image part of a joint
    sequence inside a ``torch.cat``."""

    def __call__(self, attn, hidden_states, text_tokens, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        query = attn(hidden_states).unflatten(-1, (2, -1))
        query = torch.cat([apply_rotary_emb(query[:, :-text_tokens], image_rotary_emb, sequence_dim=1),
                           query[:, -text_tokens:]], dim=1)
        return query


def test_a_rotary_inside_an_expression_with_a_local_import_is_fused(emulated_kernels):
    sub, found = _chains.fused_subclass(JointProcessor, "FusedJointProcessor", __name__, "__call__")
    assert found.rotary == 1 and "_diffusers_fastpath_chains.rotary(query[:, :-text_tokens]" in inspect.getsource(sub.__call__)
    attn = torch.nn.Linear(8, 8).to(torch.bfloat16)
    attn._fastpath_site_rotary_emb = Site("rotary_emb")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 7, 8, generator=gen).to(torch.bfloat16)
    cos, sin = torch.randn(5, 4, generator=gen), torch.randn(5, 4, generator=gen)
    with torch.no_grad():
        assert torch.equal(sub()(attn, x, 2, (cos, sin)), JointProcessor()(attn, x, 2, (cos, sin)))
    assert attn._fastpath_site_rotary_emb.fast == 1


class QKAttention(torch.nn.Module):
    """FLUX.2's attention module in miniature: q/k projections and the four QK RMSNorms."""

    def __init__(self, dim=16, head=8):
        super().__init__()
        self.to_q, self.to_k, self.add_q, self.add_k = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k, self.norm_added_q, self.norm_added_k = (torch.nn.RMSNorm(head, eps=1e-6)
                                                                          for _ in range(4))
        for norm in (self.norm_q, self.norm_k, self.norm_added_q, self.norm_added_k):
            torch.nn.init.normal_(norm.weight, 1.0, 0.3)
        self.head = head


class QKProcessor:
    """FLUX.2's ``Flux2AttnProcessor`` in miniature: the QK norms, the text/image concatenation of q, the rotary
    embedding of q and k when tables are given, then reads of q and k after it."""

    def __call__(self, attn, hidden_states, text, image_rotary_emb=None):
        query = attn.to_q(hidden_states).unflatten(-1, (-1, attn.head))
        key = attn.to_k(hidden_states).unflatten(-1, (-1, attn.head))
        encoder_query = attn.add_q(text).unflatten(-1, (-1, attn.head))
        encoder_key = attn.add_k(text).unflatten(-1, (-1, attn.head))
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        if text is not None:
            encoder_query = attn.norm_added_q(encoder_query)
            encoder_key = attn.norm_added_k(encoder_key)
            query = torch.cat([encoder_query, query], dim=1)
            key = torch.cat([encoder_key, key], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        return query.float().sum(-1), key


class QKReadProcessor:
    """The same, but q is read between its norm and its rotary embedding: the norms must run as written."""

    def __call__(self, attn, hidden_states, text, image_rotary_emb=None):
        query = attn.norm_q(attn.to_q(hidden_states).unflatten(-1, (-1, attn.head)))
        query = attn.norm_q(query)
        scale = query.shape[-1]
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        return query * scale


@pytest.mark.parametrize("tables", [True, False], ids=["rotary", "no-rotary"])
def test_qk_norms_run_inside_the_fused_rotary(tables, emulated_kernels):
    sub, found = _chains.fused_subclass(QKProcessor, "FusedQKProcessor", __name__, "__call__")
    assert found.rotary == 2 and found.qk_norms == ["norm_q", "norm_k", "norm_added_q", "norm_added_k"]
    attn = QKAttention().to(torch.bfloat16)
    attn._fastpath_site_rotary_emb, attn._fastpath_site_qk_norm_rope = Site("rotary_emb"), Site("qk_norm_rope")
    gen = torch.Generator().manual_seed(2)
    x, text = torch.randn(2, 5, 16, generator=gen).to(torch.bfloat16), torch.randn(2, 3, 16, generator=gen).to(torch.bfloat16)
    # without tables the pending norms and concatenations become tensors after the rotary's `if` (materialize)
    freqs = (torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)) if tables else None
    with torch.no_grad():
        got, ref = sub()(attn, x, text, freqs), QKProcessor()(attn, x, text, freqs)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    qk, rope = attn._fastpath_site_qk_norm_rope, attn._fastpath_site_rotary_emb
    assert (qk.fast, rope.fast, qk.fallback, rope.fallback) == ((2, 0, {}, {}) if tables else (0, 0, {}, {}))


def test_qk_norms_read_elsewhere_are_left_as_written():
    sub, found = _chains.fused_subclass(QKReadProcessor, "FusedQKReadProcessor", __name__, "__call__")
    assert found.rotary == 1 and found.qk_norms == []
    assert "norm_later" not in inspect.getsource(sub.__call__)


class LateTextProcessor:
    """HunyuanVideo-1.5's order in miniature: the image q/k normalised and rotated first, the text q/k projected and
    normalised only after the rotary embedding (inside a later block), then the joint concatenation."""

    def __call__(self, attn, hidden_states, text, image_rotary_emb=None):
        query = attn.norm_q(attn.to_q(hidden_states).unflatten(-1, (-1, attn.head)))
        key = attn.to_k(hidden_states).unflatten(-1, (-1, attn.head))
        key = attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        if text is not None:
            encoder_query = attn.add_q(text).unflatten(-1, (-1, attn.head))
            encoder_key = attn.add_k(text).unflatten(-1, (-1, attn.head))
            encoder_query = attn.norm_added_q(encoder_query)
            encoder_key = attn.norm_added_k(encoder_key)
            query = torch.cat([query, encoder_query], dim=1)
            key = torch.cat([key, encoder_key], dim=1)
        return query, key


@pytest.mark.parametrize("tables", [True, False], ids=["rotary", "no-rotary"])
def test_qk_norms_after_the_rotary_run_as_written(tables, emulated_kernels):
    """Only norms before the last rotary statement wait for it: one written after it (the text q and k here) is
    never deferred, nor made a tensor before it is even assigned."""
    sub, found = _chains.fused_subclass(LateTextProcessor, "FusedLateTextProcessor", __name__, "__call__")
    assert found.rotary == 2 and found.qk_norms == ["norm_k"]
    source = inspect.getsource(sub.__call__)
    assert "norm_later(attn.norm_added_q" not in source and "materialize(encoder_query)" not in source
    attn = QKAttention().to(torch.bfloat16)
    attn._fastpath_site_rotary_emb, attn._fastpath_site_qk_norm_rope = Site("rotary_emb"), Site("qk_norm_rope")
    gen = torch.Generator().manual_seed(4)
    x, text = torch.randn(2, 5, 16, generator=gen).to(torch.bfloat16), torch.randn(2, 3, 16, generator=gen).to(torch.bfloat16)
    freqs = (torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen)) if tables else None
    with torch.no_grad():
        got, ref = sub()(attn, x, text, freqs), LateTextProcessor()(attn, x, text, freqs)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


class HeadCatProcessor:
    """SD3's joint concatenation in miniature, and near misses: along the heads, of three operands, of an
    expression."""

    def __call__(self, attn, hidden_states, text):
        query = attn.to_q(hidden_states).unflatten(-1, (-1, attn.head)).transpose(1, 2)
        text_query = attn.add_q(text).unflatten(-1, (-1, attn.head)).transpose(1, 2)
        joint = torch.cat([query, text_query], dim=2)
        along_heads = torch.cat([query, query], dim=1)
        three = torch.cat([query, text_query, query], dim=2)
        of_expression = torch.cat([query * 2, text_query], dim=2)
        return joint, along_heads, three, of_expression


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_head_concatenation_form_takes_only_two_names_along_the_sequence(dtype, emulated_kernels):
    sub, found = _chains.fused_subclass(HeadCatProcessor, "FusedHeadCatProcessor", __name__, "__call__", head_cats=True)
    assert found.head_cats == 1 and inspect.getsource(sub.__call__).count("cat_heads(") == 1
    assert _chains.fused_subclass(HeadCatProcessor, "PlainHeadCatProcessor", __name__, "__call__") == (None, None)
    attn = QKAttention(dim=64, head=16).to(dtype)
    attn._fastpath_site_cat_heads = Site("cat_heads")
    gen = torch.Generator().manual_seed(9)
    x, text = torch.randn(2, 5, 64, generator=gen).to(dtype), torch.randn(2, 3, 64, generator=gen).to(dtype)
    with torch.no_grad():
        got, ref = sub()(attn, x, text), HeadCatProcessor()(attn, x, text)
    for g, r in zip(got, ref):
        assert torch.equal(g, r) and g.stride() == r.stride()
    fast = 1 if dtype is torch.bfloat16 else 0  # the kernel takes fp16/bf16; fp32 runs torch.cat, counted
    assert attn._fastpath_site_cat_heads.fast == fast and sum(attn._fastpath_site_cat_heads.fallback.values()) == 1 - fast


class MaskBlock(torch.nn.Module):
    """Hunyuan's pairwise attention mask, and two near misses: a mask whose repeat is read again, and one whose
    transpose is of other dimensions."""

    def forward(self, attention_mask, seq_len):
        batch_size = attention_mask.shape[0]
        mask_1 = attention_mask.view(batch_size, 1, 1, seq_len).repeat(1, 1, seq_len, 1)
        mask_2 = mask_1.transpose(2, 3)
        mask = (mask_1 & mask_2).bool()
        kept_1 = attention_mask.view(batch_size, 1, 1, seq_len).repeat(1, 1, seq_len, 1)
        kept_2 = kept_1.transpose(2, 3)
        kept = (kept_1 & kept_2).bool()
        other_1 = attention_mask.view(batch_size, 1, 1, seq_len).repeat(1, 1, seq_len, 1)
        other_2 = other_1.transpose(1, 3)
        other = (other_1 & other_2).bool()
        return mask, kept, kept_1.sum(), other


@pytest.mark.parametrize("dtype", [torch.bool, torch.long], ids=str)
def test_the_pairwise_mask_is_built_by_broadcasting_with_the_same_bits_and_layout(dtype):
    sub, found = _chains.fused_subclass(MaskBlock, "FusedMaskBlock", __name__)
    assert found.pairwise_masks == 1
    source = inspect.getsource(sub.forward)
    assert source.count("pairwise_mask(") == 1 and "mask_2" not in source and "kept_2 = kept_1.transpose(2, 3)" in source
    gen = torch.Generator().manual_seed(5)
    mask = torch.randint(0, 3, (3, 11), generator=gen).to(dtype)  # long: 2 & 1 is 0, so the AND must be bitwise
    got, ref = sub()(mask, 11), MaskBlock()(mask, 11)
    for g, r in zip(got, ref):
        assert torch.equal(g, r) and g.dtype == r.dtype and g.stride() == r.stride()


class PaddedMaskBlock(torch.nn.Module):
    """HunyuanVideo-1.5's processor's padded pairwise mask, and a near miss: padded with False (another form)."""

    def forward(self, attention_mask, other_mask, seq_len, image_rotary_emb=None):
        batch_size = attention_mask.shape[0]
        attention_mask = F.pad(attention_mask, (seq_len - attention_mask.shape[1], 0), value=True)
        attention_mask = attention_mask.bool()
        mask_1 = attention_mask.view(batch_size, 1, 1, seq_len).repeat(1, 1, seq_len, 1)
        mask_2 = mask_1.transpose(2, 3)
        attention_mask = (mask_1 & mask_2).bool()
        other_mask = F.pad(other_mask, (seq_len - other_mask.shape[1], 0), value=False)
        other_mask = other_mask.bool()
        other_1 = other_mask.view(batch_size, 1, 1, seq_len).repeat(1, 1, seq_len, 1)
        other_2 = other_1.transpose(2, 3)
        other_mask = (other_1 & other_2).bool()
        return attention_mask, other_mask


def test_the_padded_pairwise_mask_is_built_once_per_table_with_the_same_bits():
    sub, found = _chains.fused_subclass(PaddedMaskBlock, "FusedPaddedMaskBlock", __name__)
    assert found.pairwise_masks == 2  # the padded form, and the near miss's plain three statements
    source = inspect.getsource(sub.forward)
    assert source.count("pairwise_mask_padded(") == 1 and source.count("pairwise_mask(") == 1
    gen = torch.Generator().manual_seed(6)
    mask, other = (torch.randint(0, 2, (2, 5), generator=gen) for _ in range(2))
    table = torch.randn(9, 4)
    block = sub()
    first = block(mask, other, 9, table)
    for g, r in zip(first, PaddedMaskBlock()(mask, other, 9, table)):
        assert torch.equal(g, r) and g.dtype == r.dtype and g.stride() == r.stride()
    # outside a patched model's forward the table is never sealed (`_rope_cache`): built again (reused by the later
    # layers of a forward: test_unversioned_writes.py, HunyuanVideo-1.5)
    assert block(mask, other, 9, table)[0] is not first[0]


class OuterMaskBlock(torch.nn.Module):
    """Chroma's outer-product mask, and near misses: the factors swapped, two masks, and a forward that rebinds its
    rotary table (no anchor: nothing of it is rewritten)."""

    def forward(self, attention_mask, other_mask, image_rotary_emb=None):
        attention_mask = attention_mask[:, None, None, :] * attention_mask[:, None, :, None]
        swapped = other_mask[:, None, :, None] * other_mask[:, None, None, :]
        mixed = other_mask[:, None, None, :] * attention_mask[:, 0, :1, :, None]
        return attention_mask, swapped, mixed


class RebindingOuterMaskBlock(torch.nn.Module):
    def forward(self, attention_mask, image_rotary_emb=None):
        image_rotary_emb = None
        return attention_mask[:, None, None, :] * attention_mask[:, None, :, None]


@pytest.mark.parametrize("dtype", [torch.bool, torch.long], ids=str)
def test_the_outer_mask_is_kept_on_the_rotary_table_with_the_same_bits(dtype):
    sub, found = _chains.fused_subclass(OuterMaskBlock, "FusedOuterMaskBlock", __name__)
    assert found.outer_masks == 1 and inspect.getsource(sub.forward).count("outer_mask(") == 1
    assert _chains.fused_subclass(RebindingOuterMaskBlock, "FusedRebinding", __name__) == (None, None)
    gen = torch.Generator().manual_seed(6)
    mask, other = (torch.randint(0, 3, (2, 9), generator=gen).to(dtype) for _ in range(2))
    table = (torch.randn(9, 4, generator=gen), torch.randn(9, 4, generator=gen))
    for rotary in (table, table, None):  # the expression's bits, with a table or without one
        got, ref = sub()(mask, other, rotary), OuterMaskBlock()(mask, other, rotary)
        for g, r in zip(got, ref):
            assert torch.equal(g, r) and g.dtype == r.dtype and g.stride() == r.stride()
    # called outside a patched model's forward, the table is never sealed (`_rope_cache`): nothing kept (the
    # product kept for the later blocks of a forward: test_chroma.py)
    kept = sub()(mask, other, table)[0]
    assert sub()(mask, other, table)[0] is not kept
    mask[0, 0] = 1 - mask[0, 0] if dtype is torch.long else ~mask[0, 0]
    assert torch.equal(sub()(mask, other, table)[0], OuterMaskBlock()(mask, other, table)[0])  # written in place


class WanStyleProcessor:
    """Wan's style: a rotary function defined inside the call (in a block) and called as ``NAME(X, *F)``; a near
    miss calls it with its arguments spelt out."""

    def __call__(self, attn, hidden_states, rotary_emb=None):
        query = attn(hidden_states).unflatten(-1, (2, -1))
        key = query * 2
        if rotary_emb is not None:

            def apply_rotary_emb(hidden_states, freqs_cos, freqs_sin):
                x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
                cos = freqs_cos[..., 0::2]
                sin = freqs_sin[..., 1::2]
                out = torch.empty_like(hidden_states)
                out[..., 0::2] = x1 * cos - x2 * sin
                out[..., 1::2] = x1 * sin + x2 * cos
                return out.type_as(hidden_states)

            query = apply_rotary_emb(query, *rotary_emb)
            key = apply_rotary_emb(key, rotary_emb[0], rotary_emb[1])  # near miss: not the starred call
        return query, key


def _wan_digest():
    import ast
    import hashlib
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(WanStyleProcessor.__call__)))
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "apply_rotary_emb"]
    return hashlib.sha256(ast.unparse(fn).encode()).hexdigest()[:16]


def test_wans_rotary_form_takes_the_starred_call_of_the_checked_definition_only(emulated_kernels):
    sub, found = _chains.fused_subclass(WanStyleProcessor, "FusedWanStyleProcessor", __name__, "__call__",
                                        wan_rotary=("apply_rotary_emb", _wan_digest()))
    assert found.rotary_named == 1 and "rotary_wan(apply_rotary_emb, query, rotary_emb," in inspect.getsource(sub.__call__)
    other = ("apply_rotary_emb", "0" * 16)  # a definition of another source: nothing taken
    assert _chains.fused_subclass(WanStyleProcessor, "UnfusedWanStyleProcessor", __name__, "__call__",
                                  wan_rotary=other) == (None, None)
    attn = torch.nn.Linear(8, 8).to(torch.bfloat16)
    attn._fastpath_site_rotary_emb = Site("rotary_emb")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 8, generator=gen).to(torch.bfloat16)
    tables = tuple(torch.randn(1, 5, 1, 4, generator=gen) for _ in range(2))
    with torch.no_grad():
        got, ref = sub()(attn, x, tables), WanStyleProcessor()(attn, x, tables)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
        assert all(torch.equal(a, b) for a, b in zip(sub()(attn, x), WanStyleProcessor()(attn, x)))  # no table
    assert attn._fastpath_site_rotary_emb.fast == 1


class RowsAttention(torch.nn.Module):
    """LTX-Video's and Wan's attention module in miniature: q/k projections and QK RMSNorms across all heads."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.to_q, self.to_k = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.norm_q, self.norm_k = torch.nn.RMSNorm(dim, eps=1e-6), torch.nn.RMSNorm(dim, eps=1e-6)
        for norm in (self.norm_q, self.norm_k):
            torch.nn.init.normal_(norm.weight, 1.0, 0.3)
        self.heads = heads


class LTXStyleProcessor:
    """LTX-Video's style: the QK norms across all heads, then its rows-form rotary of q and of k with one table."""

    def __call__(self, attn, hidden_states, image_rotary_emb=None):
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        if image_rotary_emb is not None:
            query = ltx_rotary(query, image_rotary_emb)
            key = ltx_rotary(key, image_rotary_emb)
        return query.unflatten(2, (attn.heads, -1)), key


class LTXStyleReadProcessor:
    """A near miss: q's pending norm is read (its shape) before the rotary: the norms run as written."""

    def __call__(self, attn, hidden_states, image_rotary_emb=None):
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        width = query.shape[-1]
        if image_rotary_emb is not None:
            query = ltx_rotary(query, image_rotary_emb)
            key = ltx_rotary(key, image_rotary_emb)
        return query, key, width


def test_the_rows_form_pairs_q_and_k_with_their_pending_norms(emulated_kernels):
    from diffusers_fastpath.models._chain_calls import register_rows_rotary

    register_rows_rotary(ltx_rotary)  # as the LTX-Video adapter does, after checking its digest
    sub, found = _chains.fused_subclass(LTXStyleProcessor, "FusedLTXStyleProcessor", __name__, "__call__",
                                        rows_rotary="ltx_rotary")
    assert found.qk_norms == ["norm_q", "norm_k"] and found.rows_pairs == 1 and found.rotary_named == 2
    assert "query, key = _diffusers_fastpath_chains.rotary_rows_pair(ltx_rotary, query, key," in inspect.getsource(
        sub.__call__)
    read, read_found = _chains.fused_subclass(LTXStyleReadProcessor, "FusedLTXStyleReadProcessor", __name__,
                                              "__call__", rows_rotary="ltx_rotary")
    assert not read_found.qk_norms and not read_found.rows_pairs and read_found.rotary_named == 2
    attn = RowsAttention().to(torch.bfloat16)
    for name in ("rotary_emb", "qk_norm_rows_rope_pair"):
        setattr(attn, f"_fastpath_site_{name}", Site(name))
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 5, 16, generator=gen).to(torch.bfloat16)
    angle = torch.rand(1, 5, 8, generator=gen) * 20
    tables = tuple(f(angle).repeat_interleave(2, dim=-1) for f in (torch.cos, torch.sin))
    with torch.no_grad():
        for fused, plain in ((sub, LTXStyleProcessor), (read, LTXStyleReadProcessor)):
            for table in (tables, None):  # without a table the pending norms are made tensors after the block
                got, ref = fused()(attn, x, table), plain()(attn, x, table)
                assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(got, ref))
    assert attn._fastpath_site_qk_norm_rows_rope_pair.fast == 1  # the paired call; the near miss's rotary alone
    assert attn._fastpath_site_rotary_emb.fast == 2 and not attn._fastpath_site_rotary_emb.fallback


class NormBlock(torch.nn.Module):
    """Wan's ``norm2`` line and its near misses: the cast to another tensor, a norm of x not upcast."""

    def __init__(self, dim=8):
        super().__init__()
        from diffusers.models.normalization import FP32LayerNorm

        self.norm2 = FP32LayerNorm(dim, eps=1e-6, elementwise_affine=True)
        with torch.no_grad():
            self.norm2.weight.normal_(1.0, 0.2)
            self.norm2.bias.normal_(0.0, 0.1)

    def forward(self, x, y):
        n = self.norm2(x.float()).type_as(x)
        m = self.norm2(x.float()).type_as(y)  # near miss: cast like another tensor
        k = self.norm2(x).type_as(x)  # near miss: no upcast
        return n, m, k


def test_the_fp32_norm_form_takes_an_upcast_norm_cast_back_only(emulated_kernels):
    sub, found = _chains.fused_subclass(NormBlock, "FusedNormBlock", __name__)
    assert found.affine_fp32 == ["norm2"]
    source = inspect.getsource(sub.forward)
    assert source.count("norm_affine_fp32(") == 1 and "m = self.norm2(x.float()).type_as(y)" in source
    torch.manual_seed(6)
    block, ref_block = sub().to(torch.bfloat16), NormBlock().to(torch.bfloat16)
    ref_block.load_state_dict(block.state_dict())
    block.norm2._fastpath_site = Site("layernorm_affine_fp32")
    x, y = torch.randn(2, 5, 8).to(torch.bfloat16), torch.randn(2, 5, 8)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(block(x, y), ref_block(x, y)))
    assert block.norm2._fastpath_site.fast == 1


def test_operands_that_are_not_tensors_run_the_original_expression():
    ns = _chain_calls._ChainsNamespace
    assert ns.gated_residual(1, 2, 3, None) == 7
    norm = torch.nn.Identity()  # not a LayerNorm: the module runs as written
    x, s = torch.ones(2, 3, 4), torch.full((2, 4), 0.5)
    assert torch.equal(ns.norm_modulate(norm, x, s, s, None), x * (1 + s[:, None]) + s[:, None])


def test_nothing_to_fuse_stays_unpatched_and_says_so_once_when_patched(fastpath_log):
    """A forward with no chain left (a changed or unreadable diffusers source) gives no subclass and no warning at
    import; patching a model that has it leaves it as it is, with one warning."""
    from diffusers_fastpath._state import PatchState

    class Plain(torch.nn.Module):
        def forward(self, x):
            return x * 2

    assert _chains.fused_subclass(Plain, "FusedPlain", __name__) == (None, None)
    assert not any("found no chain to fuse" in r.getMessage() for r in fastpath_log.records)
    model = torch.nn.Sequential(Plain(), Plain())
    for _ in range(2):
        _chains.swap_rewritten(PatchState("lossless"), model, {Plain: (None, None)})
    assert all(type(m) is Plain for m in model)
    assert sum("found no chain to fuse in the installed" in r.getMessage() for r in fastpath_log.records) == 1


def test_forwards_with_a_closure_are_left_alone():
    class WithSuper(torch.nn.Linear):
        def forward(self, x):
            y = super().forward(x)
            return x + y.unsqueeze(1) * y

    assert _chains.rewrite_forward(WithSuper.forward, "WithSuper.forward") is None


def test_flux_hand_mirrors_are_what_the_rewriter_finds():
    """FLUX.1's hand-mirrored forwards are the oracle: in diffusers' own FLUX block and adaLN sources the rewriter
    finds exactly the gated residuals and LayerNorm + modulates that the hand path fuses."""
    _, found = _chains.rewrite_forward(FluxTransformerBlock.forward, "X.forward")
    assert found.gates == list(flux._BLOCK_GATES) and found.norms == ["norm2", "norm2_context"] and not found.gelu_cat
    _, found = _chains.rewrite_forward(FluxSingleTransformerBlock.forward, "X.forward")
    assert found.gates == ["gate"] and found.norms == [] and found.gelu_cat  # the hand path's gate and gelu_cat sites
    for cls in (AdaLayerNormZero, AdaLayerNormZeroSingle):
        _, found = _chains.rewrite_forward(cls.forward, "X.forward")
        assert found.gates == [] and found.norms == ["norm"]


def test_rewritten_classes_pickle_by_name():
    from diffusers_fastpath.models import chroma

    cls = chroma.FastpathChromaTransformerBlock
    assert pickle.loads(pickle.dumps(cls)) is cls
    assert cls.forward.__module__ == chroma.__name__ and cls.__qualname__ == "FastpathChromaTransformerBlock"
