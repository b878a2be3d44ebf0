"""The chain rewriter (`diffusers_fastpath.models._chains`): which statements it fuses, which it must leave alone,
and that FLUX.1's hand-mirrored forwards (the oracle) are what it finds in diffusers' FLUX sources."""

from __future__ import annotations

import functools
import inspect
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
from diffusers.models.transformers.transformer_ltx import apply_rotary_emb as ltx_rotary

import diffusers_fastpath as fp
from diffusers_fastpath.models import _chain_calls, _chains, flux
from diffusers_fastpath.ops import Site


fuse = _chains.fused_subclass


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
    sub, found = fuse(Block, "FusedBlock", __name__)
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
    sub, found = fuse(MethodBlock, "FusedMethodBlock", __name__,
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
    sub, found = fuse(DeferredBlock, "FusedDeferredBlock", __name__)
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
    sub, found = fuse(UnpackBlock, "FusedUnpackBlock", __name__)
    assert found.norms == ["norm1"]
    source = inspect.getsource(sub.forward)
    assert "n = self.norm1(x)" not in source and "norm_modulate_rows(self.norm1, x, scale, shift," in source
    # the near miss: the norm runs where written; its modulate of the normalised rows is the modulate-rows form
    assert "m = self.norm2(x)" in source and "m = _diffusers_fastpath_chains.modulate_rows(m, scale, shift," in source
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
    sub, found = fuse(Processor, "FusedProcessor", __name__, "__call__")
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
    sub, found = fuse(JointProcessor, "FusedJointProcessor", __name__, "__call__")
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
    sub, found = fuse(QKProcessor, "FusedQKProcessor", __name__, "__call__")
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
    sub, found = fuse(QKReadProcessor, "FusedQKReadProcessor", __name__, "__call__")
    assert found.rotary == 1 and found.qk_norms == []
    assert "norm_later" not in inspect.getsource(sub.__call__)


class UpcastCastProcessor:
    """``Q = A.norm_q(Q.float()).to(V.dtype)``: an fp32 norm cast back, a form no fused norm waits on."""

    def __call__(self, attn, hidden_states, text, image_rotary_emb=None):
        query = attn.to_q(hidden_states).unflatten(-1, (-1, attn.head))
        key = attn.to_k(hidden_states).unflatten(-1, (-1, attn.head))
        query = attn.norm_q(query.float()).to(hidden_states.dtype)
        key = attn.norm_k(key.float()).to(hidden_states.dtype)
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        return query, key


def test_an_upcast_qk_norm_cast_back_is_left_as_written_and_not_counted():
    """The norms of ``A.norm_q(Q.float()).to(V.dtype)`` run as written, and the rewrite does not list them among the
    QK norms it fused (it did once: they were booked before the form was refused)."""
    sub, found = fuse(UpcastCastProcessor, "FusedUpcastCastProcessor", __name__, "__call__")
    assert found.qk_norms == []
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
    sub, found = fuse(LateTextProcessor, "FusedLateTextProcessor", __name__, "__call__")
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
    sub, found = fuse(HeadCatProcessor, "FusedHeadCatProcessor", __name__, "__call__", head_cats=True)
    assert found.head_cats == 1 and inspect.getsource(sub.__call__).count("cat_heads(") == 1
    assert fuse(HeadCatProcessor, "PlainHeadCatProcessor", __name__, "__call__")[1] is None
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
    sub, found = fuse(MaskBlock, "FusedMaskBlock", __name__)
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
    sub, found = fuse(PaddedMaskBlock, "FusedPaddedMaskBlock", __name__)
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
    sub, found = fuse(OuterMaskBlock, "FusedOuterMaskBlock", __name__)
    assert found.outer_masks == 1 and inspect.getsource(sub.forward).count("outer_mask(") == 1
    assert fuse(RebindingOuterMaskBlock, "FusedRebinding", __name__)[1] is None
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
    sub, found = fuse(WanStyleProcessor, "FusedWanStyleProcessor", __name__, "__call__",
                                        wan_rotary=("apply_rotary_emb", _wan_digest()))
    assert found.rotary_named == 1 and "rotary_wan(apply_rotary_emb, query, rotary_emb," in inspect.getsource(sub.__call__)
    other = ("apply_rotary_emb", "0" * 16)  # a definition of another source: nothing taken
    assert fuse(WanStyleProcessor, "UnfusedWanStyleProcessor", __name__, "__call__",
                                  wan_rotary=other)[1] is None
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
    from diffusers_fastpath.models._chain_pending import register_rows_rotary

    register_rows_rotary(ltx_rotary)  # as the LTX-Video adapter does, after checking its digest
    sub, found = fuse(LTXStyleProcessor, "FusedLTXStyleProcessor", __name__, "__call__",
                                        rows_rotary="ltx_rotary")
    assert found.qk_norms == ["norm_q", "norm_k"] and found.rows_pairs == 1 and found.rotary_named == 2
    assert "query, key = _diffusers_fastpath_chains.rotary_rows_pair(ltx_rotary, query, key," in inspect.getsource(
        sub.__call__)
    read, read_found = fuse(LTXStyleReadProcessor, "FusedLTXStyleReadProcessor", __name__,
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
    sub, found = fuse(NormBlock, "FusedNormBlock", __name__)
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
    """A forward with no chain left (a changed diffusers source) gives no subclass and no warning at import;
    patching a model that has it leaves it as it is, with a note for `report` and one warning."""
    from diffusers_fastpath._state import PatchState

    class Plain(torch.nn.Module):
        def forward(self, x):
            return x * 2

    assert fuse(Plain, "FusedPlain", __name__) == (None, None)
    assert not any("no chain the rewriter fuses" in r.getMessage() for r in fastpath_log.records)
    model = torch.nn.Sequential(Plain(), Plain())
    for _ in range(2):
        state = PatchState("lossless")
        _chains.swap_rewritten(state, model, {Plain: (None, None)})
        assert state.notes == [f"{Plain.__qualname__}.forward has no chain the rewriter fuses: it runs as it is "
                               "(exact, no speedup)"]
    assert all(type(m) is Plain for m in model)
    assert sum("has no chain the rewriter fuses" in r.getMessage() for r in fastpath_log.records) == 1


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


# --- what a rewrite must prove (issue 43, item 7): the reads and writes of the names it moves or drops -----------


class WrittenBetweenBlock(torch.nn.Module):
    """The deferred form's near misses: the norm's input written in place between the norm and its modulate (by
    ``out=``, by ``inplace=True``, through a view of it), and the one it takes: an unrelated module call between."""

    def __init__(self, dim=8):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, c, scale, shift):
        n = self.norm(x)
        y = torch.add(x, c, out=x)                            # near miss: out= writes x
        n = n * (1 + scale[:, None]) + shift[:, None]
        m = self.norm(c)
        z = F.relu(c, inplace=True)                           # near miss: inplace=True writes c
        m = m * (1 + scale[:, None]) + shift[:, None]
        p = self.norm(y)
        w = y[:, 1:]
        w2 = w.mul_(2)                                        # near miss: a view of y written
        p = p * (1 + scale[:, None]) + shift[:, None]
        q = self.norm(z * 3)
        r = self.proj(y)                                      # fused: the call writes nothing the norm reads
        q = q * (1 + scale[:, None]) + shift[:, None]
        return n, m, p, q, y, z, w2, r


def test_a_layernorm_waits_for_its_modulate_only_where_nothing_writes_its_input(emulated_kernels):
    sub, found = fuse(WrittenBetweenBlock, "FusedWrittenBetweenBlock", __name__)
    source = inspect.getsource(sub.forward)
    assert found.norms == ["norm"] and source.count("norm_modulate(") == 1 and "q = self.norm(z * 3)" not in source
    assert all(f"{name} = self.norm(" in source for name in "nmp")  # they run where they are written
    torch.manual_seed(7)
    block = sub().to(torch.bfloat16)
    block.norm._fastpath_site = Site("layernorm_scale_shift")
    args = [torch.randn(2, 5, 8).to(torch.bfloat16) for _ in range(2)] + [torch.randn(2, 8).to(torch.bfloat16) for _ in range(2)]
    ref_block = WrittenBetweenBlock().to(torch.bfloat16)
    ref_block.load_state_dict(block.state_dict())
    with torch.no_grad():
        got, ref = block(*[a.clone() for a in args]), ref_block(*[a.clone() for a in args])
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert block.norm._fastpath_site.fast == 1


class ReadAfterBlock(torch.nn.Module):
    """The two-statement gated residual's near misses: the product read after the ``if`` it is in, at the next
    iteration of its loop, in a ``finally``; and the one it takes: the product rebound before anything reads it."""

    def forward(self, x, e, gate_a, gate_b, gate_c, gate_d, flag: bool):
        u = e
        if flag:
            u = gate_a.unsqueeze(1) * e
            x = x + u                                         # near miss: u read after the if
        v, y = e, e
        for _ in range(2):
            y = y + v                                         # (v read at the next iteration)
            v = gate_b.unsqueeze(1) * e
            x = x + v                                         # near miss
        t = e
        try:
            t = gate_c.unsqueeze(1) * e
            x = x + t                                         # near miss: t read in the finally
        finally:
            y = y + t
        w = gate_d.unsqueeze(1) * e
        x = x + w                                             # fused: w rebound before any read
        w = e
        return x, u, y, w


@pytest.mark.parametrize("flag", [True, False])
def test_a_dropped_product_is_read_nowhere_after_in_any_enclosing_block(flag, emulated_kernels):
    sub, found = fuse(ReadAfterBlock, "FusedReadAfterBlock", __name__)
    assert found.gates == ["gate_d"]
    block = sub()
    block._fastpath_site_gate_d = Site("gated_residual")
    gen = torch.Generator().manual_seed(8)
    r = lambda *shape: torch.randn(*shape, generator=gen).to(torch.bfloat16)  # noqa: E731
    args = (r(2, 5, 8), r(2, 5, 8), r(2, 8), r(2, 8), r(2, 8), r(2, 8), flag)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(block(*args), ReadAfterBlock()(*args)))
    assert block._fastpath_site_gate_d.fast == 1


class GeluRebindBlock(torch.nn.Module):
    """The GELU + concatenation form's near miss: the projection's name rebound before the concatenation."""

    def __init__(self, dim=8):
        super().__init__()
        self.proj_mlp = torch.nn.Linear(dim, dim)
        self.act_mlp = torch.nn.GELU(approximate="tanh")

    def forward(self, x, a):
        mlp = self.act_mlp(self.proj_mlp(x))
        mlp = x * 2
        out = torch.cat([a, mlp], dim=2)
        return out


def test_the_gelu_does_not_move_onto_another_value_of_its_name(emulated_kernels):
    sub, found = fuse(GeluRebindBlock, "FusedGeluRebindBlock", __name__)
    block = (sub or GeluRebindBlock)().to(torch.bfloat16)
    x, a = torch.randn(2, 5, 8).to(torch.bfloat16), torch.randn(2, 5, 8).to(torch.bfloat16)
    ref = GeluRebindBlock().to(torch.bfloat16)
    ref.load_state_dict(block.state_dict())
    with torch.no_grad():
        assert torch.equal(block(x, a), ref(x, a))
    assert found is None


class SwiGLUModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_fn = torch.nn.SiLU()

    def forward(self, x):
        half = x.shape[-1] // 2
        return self.gate_fn(x[..., :half]) * x[..., half:]


class SwiAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp_act_fn = SwiGLUModule()


class SwiWrittenProcessor:
    """FLUX.2's SwiGLU + concatenation, and a write into the SwiGLU's input (a subscript store) before it."""

    def __call__(self, attn, hidden_states, other):
        mlp = attn.mlp_act_fn(hidden_states)
        hidden_states[:, 0] = other[:, 0].repeat(1, 2)
        out = torch.cat([other, mlp], dim=-1)
        return out


class SwiProcessor:
    def __call__(self, attn, hidden_states, other):
        mlp = attn.mlp_act_fn(hidden_states)
        other = other * 2
        out = torch.cat([other, mlp], dim=-1)
        return out


def test_the_swiglu_waits_for_its_concatenation_only_where_nothing_writes_its_input(emulated_kernels):
    from diffusers_fastpath.models._chain_calls import register_swiglu

    register_swiglu(SwiGLUModule, "gate_fn")
    written, written_found = fuse(SwiWrittenProcessor, "FusedSwiWrittenProcessor", __name__, "__call__",
                                  swiglus=("mlp_act_fn",))
    plain, plain_found = fuse(SwiProcessor, "FusedSwiProcessor", __name__, "__call__", swiglus=("mlp_act_fn",))
    assert plain_found.swiglu_cats == ["mlp_act_fn"]
    attn = SwiAttention()
    attn.mlp_act_fn._fastpath_site_swiglu_cat = Site("swiglu_cat")
    gen = torch.Generator().manual_seed(9)
    x, other = torch.randn(2, 5, 16, generator=gen).to(torch.bfloat16), torch.randn(2, 5, 8, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        for fused, original in ((written or SwiWrittenProcessor, SwiWrittenProcessor), (plain, SwiProcessor)):
            assert torch.equal(fused()(attn, x.clone(), other), original()(attn, x.clone(), other))
    assert attn.mlp_act_fn._fastpath_site_swiglu_cat.fast == 1 and written_found is None


# --- the rewrite comes from the function the class holds when `patch` runs (issue 43, item 3) ---------------------


def _shifted(forward):
    """A library's replacement of `forward`: it runs `forward` and adds one to every tensor that returns."""
    def replaced(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return pytree.tree_map(lambda t: t + 1 if isinstance(t, torch.Tensor) else t, out)
    return replaced


@pytest.mark.parametrize("wrapped", [False, True], ids=["replaced", "functools.wraps"])
def test_a_block_forward_replaced_after_import_runs_as_it_is(wrapped, monkeypatch, fastpath_log, emulated_kernels,
                                                            unpatch_after):
    """FLUX.2's block forward replaced after this package's import (a plain replacement, or a ``functools.wraps``
    wrapper, whose ``inspect.getsource`` is diffusers' forward): the patched model runs the replacement, its blocks
    keep diffusers' class, `report` says why, one warning; the rest is patched as before."""
    from diffusers.models.transformers.transformer_flux2 import Flux2TransformerBlock

    from diffusers_fastpath.models import flux2
    from diffusers_fastpath.testing import build_flux2_transformer, flux2_transformer_inputs

    original = Flux2TransformerBlock.forward
    replaced = functools.wraps(original)(_shifted(original)) if wrapped else _shifted(original)
    monkeypatch.setattr(Flux2TransformerBlock, "forward", replaced)
    model, twin = build_flux2_transformer(seed=11), build_flux2_transformer(seed=11)
    inputs = flux2_transformer_inputs(model, seed=12)
    fp.patch(model)
    unpatch_after(model)
    try:
        with torch.no_grad():
            assert torch.equal(model(**inputs).sample, twin(**inputs).sample)
        blocks = [type(b) for b in model.transformer_blocks]
        assert blocks and all(cls is Flux2TransformerBlock for cls in blocks)
        assert type(model.single_transformer_blocks[0]) is flux2.FastpathFlux2SingleTransformerBlock
        why = "is a wrapper of" if wrapped else "is a closure (it reads forward of the function that made it)"
        assert any(why in note for note in fp.report(model).models[0].notes)
        assert sum(why in r.getMessage() for r in fastpath_log.records) == 1
    finally:
        fp.unpatch(model)
        monkeypatch.undo()
    # with diffusers' forward back, the next patch rewrites it again: the same class as at import
    assert _chains.rewrite_of(flux2.FastpathFlux2TransformerBlock) is not None
    assert flux2.FastpathFlux2TransformerBlock.forward.__name__ == "forward"


def test_a_flux_block_forward_wrapped_after_import_runs_as_it_is(monkeypatch, emulated_kernels, unpatch_after):
    """FLUX.1's hand-mirrored forwards: the digest of a ``functools.wraps`` wrapper's source is diffusers' forward's;
    the wrapper is not that function, and runs."""
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs

    original = FluxTransformerBlock.forward
    monkeypatch.setattr(FluxTransformerBlock, "forward", functools.wraps(original)(_shifted(original)))
    model, twin = build_flux_transformer(seed=13), build_flux_transformer(seed=13)
    inputs = flux_transformer_inputs(model, seed=14)
    fp.patch(model)
    unpatch_after(model)
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, twin(**inputs).sample)
    assert all(type(b) is FluxTransformerBlock for b in model.transformer_blocks)


class Swappable(torch.nn.Module):
    def forward(self, x, e, gate):
        x = x + gate.unsqueeze(1) * e
        return x


def _swappable_other(self, x, e, gate):
    """Another forward for `Swappable`, whose source is its own: a library's rewrite of diffusers' forward."""
    e = e + gate.unsqueeze(1) * x
    return e * 2


def test_the_subclass_is_rewritten_from_the_forward_its_base_holds_now(monkeypatch, emulated_kernels):
    """A replacement whose source is provably its own is rewritten (from it, not from the file the base class was
    defined in); the subclass stays the same object (pickles find it by name), and takes diffusers' forward back."""
    sub, found = fuse(Swappable, "FusedSwappable", __name__)
    first = sub.forward
    gen = torch.Generator().manual_seed(15)
    args = [torch.randn(2, 5, 8, generator=gen).to(torch.bfloat16) for _ in range(2)]
    args.append(torch.randn(2, 8, generator=gen).to(torch.bfloat16))
    block = sub()
    block._fastpath_site_gate = Site("gated_residual")
    monkeypatch.setattr(Swappable, "forward", _swappable_other)
    assert _chains.rewrite_of(sub).gates == ["gate"] and sub.forward is not first
    assert "e = _diffusers_fastpath_chains.gated_residual(e, gate.unsqueeze(1), x," in inspect.getsource(sub.forward)
    with torch.no_grad():
        assert torch.equal(block(*args), Swappable()(*args))  # both run _swappable_other
    assert block._fastpath_site_gate.fast == 1
    assert pickle.loads(pickle.dumps(sub)) is sub
    monkeypatch.undo()
    assert _chains.rewrite_of(sub) is found and sub.forward is first  # made once per function
    with torch.no_grad():
        assert torch.equal(block(*args), Swappable()(*args))


EDITED = '''import torch


class EditedBlock(torch.nn.Module):
    def forward(self, x, e, gate):
        x = x + gate.unsqueeze(1) * {}
        return x
'''


def test_a_source_file_edited_after_import_is_not_rewritten(tmp_path, monkeypatch, emulated_kernels):
    """The class runs the code it was imported with; the file on disk, edited since, says another thing: nothing is
    rewritten from it."""
    import importlib.util
    import os
    import sys

    path = tmp_path / "edited_block.py"
    path.write_text(EDITED.format("e"))
    spec = importlib.util.spec_from_file_location("_fastpath_edited_block", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    assert fuse(module.EditedBlock, "FusedEditedBlock", spec.name)[1] is not None  # as imported: rewritten
    path.write_text(EDITED.format("(e * 2)"))  # the same lines, another expression
    os.utime(path, (os.stat(path).st_atime, os.stat(path).st_mtime + 5))
    sub, found = fuse(module.EditedBlock, "FusedEditedBlock2", spec.name)
    gen = torch.Generator().manual_seed(16)
    args = [torch.randn(2, 5, 8, generator=gen).to(torch.bfloat16) for _ in range(2)]
    args.append(torch.randn(2, 8, generator=gen).to(torch.bfloat16))
    with torch.no_grad():
        assert torch.equal((sub or module.EditedBlock)()(*args), module.EditedBlock()(*args))
    assert found is None and "edited since it was imported" in _chains.why_unrewritten(sub, module.EditedBlock)


class QKWrittenProcessor:
    """The QK-norm form's near miss: the norm's input written (through a view of it) before the rotary embedding,
    which is where a pending norm runs."""

    def __call__(self, attn, hidden_states, text, image_rotary_emb=None):
        query = attn.to_q(hidden_states).unflatten(-1, (-1, attn.head))
        first = query[:, :1]
        query = attn.norm_q(query)
        first.mul_(2)
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        return query


def test_a_qk_norm_waits_for_its_rotary_only_where_nothing_writes_its_input(emulated_kernels):
    sub, found = fuse(QKWrittenProcessor, "FusedQKWrittenProcessor", __name__, "__call__")
    assert found.rotary == 1 and found.qk_norms == []
    attn = QKAttention().to(torch.bfloat16)
    attn._fastpath_site_rotary_emb, attn._fastpath_site_qk_norm_rope = Site("rotary_emb"), Site("qk_norm_rope")
    gen = torch.Generator().manual_seed(17)
    x, text = torch.randn(2, 5, 16, generator=gen).to(torch.bfloat16), torch.randn(2, 3, 16, generator=gen).to(torch.bfloat16)
    freqs = (torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen))
    with torch.no_grad():
        assert torch.equal(sub()(attn, x, text, freqs), QKWrittenProcessor()(attn, x, text, freqs))
    assert attn._fastpath_site_rotary_emb.fast == 1


# the two-statement gated residual ``u = gate.unsqueeze(1) * e; x = x + u`` around odd control flow: whether ``u``
# (no longer bound by the rewrite) may be read afterwards, and so whether the pattern is taken
DROPS = {
    "rebound before any read": ("u = e\nu = gate.unsqueeze(1) * e\nx = x + u\nu = e * 2\nreturn x, u", True),
    "read in a lambda made before": ("u = e\nf = lambda: u\nu = gate.unsqueeze(1) * e\nx = x + u\nreturn x, f()", False),
    "locals() read": ("u = e\nu = gate.unsqueeze(1) * e\nx = x + u\nreturn x, len(locals())", False),
    "a break skips the rebinding": ("u = e\nfor _ in range(2):\n    u = gate.unsqueeze(1) * e\n    x = x + u\n"
                                    "    if flag:\n        break\n    u = e\nreturn x, u", False),
    "read by a while test": ("u = e\ni = 0\nwhile i < 2 and u.sum() != 0:\n    u = gate.unsqueeze(1) * e\n"
                             "    x = x + u\n    i += 1\nreturn x,", False),
    "read by a handler": ("u = e\ntry:\n    u = gate.unsqueeze(1) * e\n    x = x + u\n    x = x / 0 if flag else x\n"
                          "except ZeroDivisionError:\n    x = u\nreturn x,", False),
    "read in a later match case": ("u = e\nu = gate.unsqueeze(1) * e\nx = x + u\nmatch flag:\n    case True:\n"
                                   "        x = x * 2\n    case _:\n        x = u\nreturn x,", False),
    "read only in a branch that rebinds first": ("u = gate.unsqueeze(1) * e\nx = x + u\nif flag:\n    u = e\n"
                                                 "    x = x + u\nreturn x,", True),
}


@pytest.mark.parametrize("case", sorted(DROPS))
def test_a_dropped_product_is_proven_unread_through_any_control_flow(case, tmp_path, monkeypatch, emulated_kernels):
    import importlib.util
    import sys
    import textwrap

    body, fused = DROPS[case]
    path = tmp_path / "drops.py"
    path.write_text("import torch\n\n\nclass Drop(torch.nn.Module):\n    def forward(self, x, e, gate, flag):\n"
                    + textwrap.indent(body, " " * 8) + "\n")
    spec = importlib.util.spec_from_file_location("_fastpath_drops", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    sub, found = fuse(module.Drop, "FusedDrop", spec.name)
    gen = torch.Generator().manual_seed(18)
    x, e = (torch.randn(2, 5, 8, generator=gen).to(torch.bfloat16) for _ in range(2))
    gate = torch.randn(2, 8, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        for flag in (True, False):
            got, want = (sub or module.Drop)()(x, e, gate, flag), module.Drop()(x, e, gate, flag)
            assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(got, want))
    assert (found is not None and found.gates == ["gate"]) == fused


@pytest.mark.parametrize("when", ["before_patch", "after_patch"])
@pytest.mark.parametrize("family", ["flux", "wan"])
def test_a_processor_call_replaced_on_diffusers_class_runs(family, when, emulated_kernels, monkeypatch):
    """``FluxAttnProcessor.__call__`` / ``WanAttnProcessor.__call__`` replaced on diffusers' class (cache-dit's
    context-parallel planners do it), before or after `patch`: the patched model runs the replacement, as unpatched
    diffusers does (FLUX.1's mirrored processor through `_state.call_safe`, Wan's rewritten one through
    `_chain_calls.stale`); after `patch` it was the fused mirror of the old one."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    from diffusers_fastpath.testing import (build_flux_transformer, build_wan_transformer, flux_transformer_inputs,
                                            wan_transformer_inputs)

    build, make_inputs, cls = {"flux": (build_flux_transformer, flux_transformer_inputs, FluxAttnProcessor),
                               "wan": (build_wan_transformer, wan_transformer_inputs, WanAttnProcessor)}[family]
    ref_model, model = build(seed=1), build(seed=1)
    inputs = make_inputs(model, seed=2)
    original = cls.__call__

    def replaced(self, *args, **kwargs):  # (a context-parallel gather around the original, say: here a scale)
        out = original(self, *args, **kwargs)
        return tuple(o * 1.5 for o in out) if isinstance(out, tuple) else out * 1.5

    with torch.no_grad():
        plain = ref_model(**inputs).sample
        if when == "after_patch":
            fp.patch(model)
            assert torch.equal(model(**inputs).sample, plain)
        monkeypatch.setattr(cls, "__call__", replaced)
        ref = ref_model(**inputs).sample
        assert not torch.equal(ref, plain)
        if when == "before_patch":
            fp.patch(model)
        try:
            assert torch.equal(model(**inputs).sample, ref)
            monkeypatch.setattr(cls, "__call__", original)
            assert torch.equal(model(**inputs).sample, plain)
        finally:
            fp.unpatch(model)
