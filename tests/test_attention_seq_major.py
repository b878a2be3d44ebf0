"""attention_seq_major: SD3's joint attention on token-major head concatenations. On the GPU at SD3.5's shapes, every
torch attention backend: the concatenations and the attention `torch.equal` to eager's, the output token-major so
that the processor's reshape copies nothing; everywhere: the guards, the verification that disables the op on a
layout-dependent attention, and the rewritten processor's wiring (the attention as written where nothing was
concatenated)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffusers_fastpath.ops import Site
from diffusers_fastpath.ops import attention_seq_major as attention_module
from diffusers_fastpath.ops.attention_seq_major import (ATTENTION_SEQ_MAJOR, attention_seq_major, cat_reason,
                                                        cat_seq_major, seq_major)

DTYPES = [torch.bfloat16, torch.float16]
# (batch, heads, image tokens, text tokens, head_dim): SD3.5-large at 1024x1024 (CLIP 77 + T5 256 text tokens), its
# CFG batch, SD3.5-medium at 512x512, a small odd case
SHAPES = [(1, 38, 4096, 333, 64), (2, 38, 4096, 333, 64), (1, 24, 1024, 333, 64), (2, 3, 17, 5, 64)]


def operands(shape, dtype, device, seed):
    """The image and text q, k and v of SD3's processor: ``[B, H, S, D]`` views of ``[B, S, H, D]`` projections."""
    b, h, sa, sb, d = shape
    gen = torch.Generator(device=device).manual_seed(seed)

    def one(s):
        return (torch.randn(b, s, h, d, generator=gen, device=device) * 2).to(dtype).transpose(1, 2)

    return [(one(sa), one(sb)) for _ in range(3)]


def eager(pairs, fn=F.scaled_dot_product_attention):
    """The processor's lines: three ``torch.cat(dim=2)``, the attention, the reshape."""
    q, k, v = (torch.cat(pair, dim=2) for pair in pairs)
    out = fn(q, k, v, dropout_p=0.0, is_causal=False)
    return out.transpose(1, 2).reshape(out.shape[0], -1, out.shape[1] * out.shape[3])


@pytest.fixture
def fresh_op():
    """The op as at import (not disabled, nothing verified), and so again afterwards."""
    ATTENTION_SEQ_MAJOR.reset()
    yield ATTENTION_SEQ_MAJOR
    ATTENTION_SEQ_MAJOR.reset()


# --- GPU: the contract ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["default", "CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@torch.no_grad()
def test_matches_eager_bitwise_and_the_reshape_copies_nothing(shape, dtype, backend, fresh_op):
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    context = nullcontext() if backend == "default" else sdpa_kernel([getattr(SDPBackend, backend)])
    with context:
        for seed in range(2):  # the first call verifies, the second runs on the verified signature
            pairs = operands(shape, dtype, "cuda", seed)
            ref = eager(pairs)
            cats = []
            for a, b in pairs:
                assert cat_reason(a, b) is None
                cat = cat_seq_major(a, b)
                assert torch.equal(cat, torch.cat([a, b], dim=2)) and seq_major(cat) and cat.transpose(1, 2).is_contiguous()
                cats.append(cat)
            site = Site("attention_seq_major")
            out = attention_seq_major(F.scaled_dot_product_attention, *cats, site, dropout_p=0.0, is_causal=False)
            assert site.fast == 1 and not site.fallback, site
            flat = out.transpose(1, 2).reshape(out.shape[0], -1, out.shape[1] * out.shape[3])
            assert flat.data_ptr() == out.data_ptr()  # a view: the copy eager makes here is gone
            assert torch.equal(flat, ref) and flat.stride() == ref.stride()
    assert fresh_op.disabled is None


# --- everywhere: guards, verification, fallback ------------------------------------------------------------------


def test_cat_is_torch_cat_written_token_major():
    for a, b in operands((2, 3, 7, 5, 16), torch.bfloat16, "cpu", 0):
        cat = cat_seq_major(a, b)
        assert torch.equal(cat, torch.cat([a, b], dim=2)) and seq_major(cat)
        assert cat.transpose(1, 2).is_contiguous() and not cat.is_contiguous()
        assert not seq_major(torch.cat([a, b], dim=2)) and not seq_major(cat.transpose(1, 2))  # only that tensor


@pytest.mark.parametrize("case, reason", [
    ("fp32", "dtype float32"), ("contiguous", "not a token-major view"), ("one_head", "one head"),
    ("grad", "requires grad"), ("cpu", "device cpu")])
def test_cat_reason(case, reason):
    shape = (1, 1, 7, 5, 16) if case == "one_head" else (1, 3, 7, 5, 16)
    a, b = operands(shape, torch.float32 if case == "fp32" else torch.bfloat16, "cpu", 1)[0]
    if case == "contiguous":
        a = a.contiguous()
    elif case == "grad":
        a.requires_grad_()
    assert cat_reason(a, b) == reason


def _layout_dependent(q, k, v, **arguments):
    """An attention whose values depend on q's layout (a stand-in for a kernel that computes differently by layout)."""
    out = F.scaled_dot_product_attention(q, k, v, **arguments)
    return out if q.is_contiguous() else out + 1


def _on_cpu(monkeypatch):
    """The operand checks with the CPU taken as a GPU (their other checks unchanged)."""
    from diffusers_fastpath.ops import attention_seq_major as module

    check = module.ATTENTION_SEQ_MAJOR_GUARD
    monkeypatch.setattr(module, "ATTENTION_SEQ_MAJOR_GUARD",
                        lambda t, check_pointers=True: None if check(t) == "device cpu" else check(t))


@torch.no_grad()
def test_a_layout_dependent_attention_disables_the_op_once_and_gets_eager_layout(monkeypatch, fresh_op, fastpath_log):
    _on_cpu(monkeypatch)
    monkeypatch.setattr(attention_module, "_SDPA", _layout_dependent)  # taken as torch's attention
    pairs = operands((2, 3, 7, 5, 16), torch.bfloat16, "cpu", 2)
    cats = [cat_seq_major(a, b) for a, b in pairs]
    site = Site("attention_seq_major")
    out = attention_seq_major(_layout_dependent, *cats, site, dropout_p=0.0)
    assert torch.equal(out, _layout_dependent(*(torch.cat(p, dim=2) for p in pairs), dropout_p=0.0))  # eager's values
    assert out.is_contiguous()  # and eager's layout
    assert fresh_op.disabled is not None and "not bit-exact" in fresh_op.disabled
    assert site.fast == 0 and site.fallback == {"op disabled after an error": 1}
    assert sum("disabling the fused op 'attention_seq_major'" in r.message for r in fastpath_log.records) == 1
    assert cat_reason(*pairs[0]) == "op disabled after an error"  # the concatenations are eager's layout again


@torch.no_grad()
def test_a_verified_signature_runs_on_the_operands_as_they_are(monkeypatch, fresh_op):
    _on_cpu(monkeypatch)
    calls = []

    def spy(q, k, v, **arguments):
        calls.append(q.is_contiguous())
        return F.scaled_dot_product_attention(q, k, v, **arguments)

    monkeypatch.setattr(attention_module, "_SDPA", spy)  # taken as torch's attention
    for seed in range(3):
        pairs = operands((1, 3, 6, 4, 16), torch.float16, "cpu", seed)
        cats = [cat_seq_major(a, b) for a, b in pairs]
        ref = eager(pairs, spy)
        calls.clear()
        site = Site("attention_seq_major")
        out = attention_seq_major(spy, *cats, site, dropout_p=0.0, is_causal=False)
        assert torch.equal(out.transpose(1, 2).reshape(ref.shape), ref)
        assert site.fast == 1
        assert calls == ([False, True] if seed == 0 else [False])  # verified once: the token-major call, then eager's
    assert len(fresh_op.verified) == 1


@pytest.mark.parametrize("arguments, reason", [(dict(dropout_p=0.1), "arguments"), (dict(attn_mask=None), "arguments"),
                                               (dict(enable_gqa=True), "arguments")])
@torch.no_grad()
def test_arguments_it_does_not_pass_on_run_the_eager_layout(monkeypatch, fresh_op, arguments, reason):
    _on_cpu(monkeypatch)
    pairs = operands((1, 3, 6, 4, 16), torch.bfloat16, "cpu", 5)
    cats = [cat_seq_major(a, b) for a, b in pairs]
    site = Site("attention_seq_major")
    torch.manual_seed(0)
    out = attention_seq_major(F.scaled_dot_product_attention, *cats, site, **arguments)
    torch.manual_seed(0)
    assert torch.equal(out, F.scaled_dot_product_attention(*(torch.cat(p, dim=2) for p in pairs), **arguments))
    assert site.fallback == {reason: 1} and out.is_contiguous()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("DIFFUSERS_FASTPATH_DISABLE", "1")
    a, b = operands((1, 3, 6, 4, 16), torch.bfloat16, "cpu", 6)[0]
    assert cat_reason(a, b) == "DIFFUSERS_FASTPATH_DISABLE is set"


def test_sd3_processor_without_text_runs_the_attention_as_written(emulated_kernels, unpatch_after):
    """An SD3 attention called without ``encoder_hidden_states`` concatenates nothing: its attention runs on the
    projections' views as eager's does, and the token-major site is not entered."""
    import diffusers_fastpath as fp
    from diffusers_fastpath.testing import build_sd3_transformer

    model = build_sd3_transformer(seed=11)
    attn = model.transformer_blocks[1].attn
    x = torch.randn(2, 9, attn.to_q.in_features).to(torch.bfloat16)
    with torch.no_grad():
        ref = attn(x)
        fp.patch(model)
        unpatch_after(model)
        assert torch.equal(attn(x), ref)
    site = attn._fastpath_site_attention_seq_major
    assert site.fast == 0 and not site.fallback


@torch.no_grad()
def test_an_attention_other_than_torchs_runs_once_in_eager_layout(monkeypatch, fresh_op):
    """A library's replacement of ``F.scaled_dot_product_attention`` is user code: the op refuses it (its self-check
    would call it twice on the first call), so it runs once, on eager's layout."""
    _on_cpu(monkeypatch)
    calls = []

    def replacement(q, k, v, **arguments):
        calls.append(q.is_contiguous())
        return F.scaled_dot_product_attention(q, k, v, **arguments)

    pairs = operands((1, 3, 6, 4, 16), torch.bfloat16, "cpu", 7)
    cats = [cat_seq_major(a, b) for a, b in pairs]
    site = Site("attention_seq_major")
    out = attention_seq_major(replacement, *cats, site, dropout_p=0.0)
    assert torch.equal(out, F.scaled_dot_product_attention(*(torch.cat(p, dim=2) for p in pairs), dropout_p=0.0))
    assert calls == [True] and site.fallback == {"attention is not torch's scaled_dot_product_attention": 1}
    assert not fresh_op.verified and fresh_op.disabled is None
