"""rmsnorm_rope_complex_prefix (Qwen-Image 2.1's cached key: the QK norm + complex rotary written after the KV cache's
prefix): the reference is the helper's lines, the kernel writes after a copy of the prefix, the guards fall back to
the single op with their reason, the custom op; the rewriter's prefix form on the tiny model's cached and extract
steps (patched == unpatched, sites counted) and where it must refuse; the bit-exact contract on the GPU at the
published shapes."""

from __future__ import annotations


import pytest
import torch
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

import diffusers_fastpath as fp
from diffusers_fastpath._state import sites_of
from diffusers_fastpath.models._chain_pending import PREFIX_UNFUSED
from diffusers_fastpath.ops import Site
from diffusers_fastpath.ops.rmsnorm_rope_prefix import (BATCH_REASON, RMSNORM_ROPE_COMPLEX_PREFIX,
                                                        rmsnorm_rope_complex_prefix, rmsnorm_rope_complex_prefix_ref)
from diffusers_fastpath.testing import zoo


def make(batch, prefix, tokens, heads, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    norm = RMSNorm(128, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(128, generator=gen, device=device))
    x = (torch.randn(batch, tokens, heads, 128, generator=gen, device=device) * 3).to(dtype)
    cached = torch.randn(batch, prefix, heads, 128, generator=gen, device=device).to(dtype)
    freqs = torch.polar(torch.ones(tokens, 64, device=device), torch.rand(tokens, 64, generator=gen, device=device) * 100)
    return cached, norm, x, freqs


def test_reference_is_the_helpers_chain():
    """The reference is ``_qwenimage21_prepare_qkv``'s lines: the norm (cast to the value's dtype), the rotary, then
    ``torch.cat([cached_k, key], dim=1)``."""
    cached, norm, x, freqs = make(1, 5, 11, 3, torch.bfloat16, "cpu", 0)
    with torch.no_grad():
        key = apply_rotary_emb_qwen(norm(x).to(x.dtype), freqs, use_real=False)
        assert torch.equal(rmsnorm_rope_complex_prefix_ref(cached, norm, x, freqs), torch.cat([cached, key], dim=1))


def test_kernel_writes_after_a_copy_of_the_prefix(rope_launches):
    """The fast path's own wrapper on a CPU (the launch emulated by the eager chain of its rows): one launch, into
    the rows after the prefix (a strided prefix copied as its values), the whole equal to the reference."""
    launches = rope_launches
    cached, norm, x, freqs = make(1, 6, 11, 2, torch.bfloat16, "cpu", 1)
    cached = cached.transpose(1, 2).contiguous().transpose(1, 2)  # (a strided prefix: copied all the same)
    site, single = Site("rmsnorm_rope_complex_prefix"), Site("rmsnorm_rope_complex")
    with torch.no_grad():
        out = rmsnorm_rope_complex_prefix(cached, norm, x, freqs, site, single)
        assert torch.equal(out, rmsnorm_rope_complex_prefix_ref(cached, norm, x, freqs))
    assert launches == [(out.data_ptr() + 6 * 2 * 128 * out.element_size(), (22, 1, 128))]
    assert (site.fast, site.fallback, single.fast, single.fallback) == (1, {}, 0, {})


@pytest.mark.parametrize("case, reason", [
    ("batch", BATCH_REASON), ("dtype", "prefix of other heads, dtype or device"), ("few", "fewer than 16 rows"),
    ("hooks", "RMSNorm has hooks")])
def test_guard_falls_back_to_the_single_op_with_reason(case, reason, emulated_kernels):
    """What the kernel does not take runs the norm and rotary through `rmsnorm_rope_complex` (counted on its own
    site) and the concatenation as written; the prefix site counts why. A hooked norm is called, hook and all."""
    cached, norm, x, freqs = make(2 if case == "batch" else 1, 5, 3 if case == "few" else 11, 2, torch.bfloat16,
                                  "cpu", 2)
    if case == "dtype":  # (torch.cat promotes it)
        cached = cached.half()
    calls = []
    if case == "hooks":
        norm.register_forward_hook(lambda *args: calls.append(1))
    site, single = Site("rmsnorm_rope_complex_prefix"), Site("rmsnorm_rope_complex")
    with torch.no_grad():
        assert torch.equal(rmsnorm_rope_complex_prefix(cached, norm, x, freqs, site, single),
                           torch.cat([cached, apply_rotary_emb_qwen(norm(x), freqs, use_real=False)], dim=1))
    assert site.fast == 0 and site.fallback == {reason: 1}
    assert single.fast + sum(single.fallback.values()) == 1
    assert calls == ([1, 1] if case == "hooks" else [])  # the fallback's call of the norm, and the expected value's


def test_custom_op_opcheck_cpu():
    cached, norm, x, freqs = make(1, 5, 9, 2, torch.bfloat16, "cpu", 3)
    op = torch.ops.diffusers_fastpath.rmsnorm_rope_complex_prefix.default
    torch.library.opcheck(op, (cached, x, norm.weight.detach(), freqs, 1e-6))
    with torch.no_grad():
        assert torch.equal(op(cached, x, norm.weight, freqs, 1e-6),
                           rmsnorm_rope_complex_prefix_ref(cached, norm, x, freqs))


# --- the rewriter's prefix form on Qwen-Image 2.1 ------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 2])
def test_qwen_image_21_cached_key_is_written_after_its_prefix(batch, qwen21_cached_steps, emulated_kernels):
    """The tiny Qwen-Image 2.1's extract and cached steps patched == unpatched. Each block's key: at the extract step
    its rotary runs where the cache store reads it (`rmsnorm_rope_complex`, as before); at the cached step the kernel
    writes it after the cached prefix (`rmsnorm_rope_complex_prefix`), at batch 1; at batch 2 that site counts why
    not and the key runs through the single op before the concatenation as written."""
    model = qwen21_cached_steps(batch)
    for block in model.transformer_blocks:
        sites = dict(sites_of(block.attn))
        prefix, single = sites["rmsnorm_rope_complex_prefix"], sites["rmsnorm_rope_complex"]
        if batch == 1:
            assert (prefix.fast, prefix.fallback) == (1, {})
            assert (single.fast, single.fallback) == (3, {})  # q and k at the extract step, q at the cached
        else:
            assert (prefix.fast, dict(prefix.fallback)) == (0, {BATCH_REASON: 1})
            assert single.fast + sum(single.fallback.values()) == 4


PROCESSORS = '''import torch
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen


class Prefix:
    def __call__(self, attn, x, freqs, cached):
        key = attn.to_k(x).unflatten(-1, (attn.heads, -1))
        key = attn.norm_k(key)
        key = apply_rotary_emb_qwen(key, freqs, use_real=False)
        if cached is not None:
            key = torch.cat([cached, key], dim=1)
        return key * 1


class Suffix:  # the prefix after the key: not the form
    def __call__(self, attn, x, freqs, cached):
        key = attn.to_k(x).unflatten(-1, (attn.heads, -1))
        key = attn.norm_k(key)
        key = apply_rotary_emb_qwen(key, freqs, use_real=False)
        key = torch.cat([key, cached], dim=1)
        return key


class Written:  # the norm's input written between the rotary and the concatenation: the rotary may not wait
    def __call__(self, attn, x, freqs, cached):
        raw = attn.to_k(x).unflatten(-1, (attn.heads, -1))
        key = raw
        key = attn.norm_k(key)
        key = apply_rotary_emb_qwen(key, freqs, use_real=False)
        raw.mul_(2)
        key = torch.cat([cached, key], dim=1)
        return key
'''


@pytest.fixture
def processors(source_module):
    return source_module("_fastpath_prefix_processors", PROCESSORS)


@pytest.mark.parametrize("name, taken", [("Prefix", True), ("Suffix", False), ("Written", False)])
def test_prefix_form_is_taken_only_where_it_is_the_concatenation(name, taken, processors, emulated_kernels):
    """``K = torch.cat([C, K], dim=1)`` (inside an ``if`` too) after K's complex rotary becomes the prefix op; a
    concatenation with the key first, or a write of the norm's input before it, keeps the lines as written (the
    written case would compute the norm of the doubled input if the rotary waited). Each equal to the class as
    written, with and without the prefix."""
    from diffusers_fastpath.models import _chains
    from diffusers_fastpath.models._chain_pending import register_complex_rotary

    register_complex_rotary(processors.apply_rotary_emb_qwen)
    cls = getattr(processors, name)
    sub, found = _chains.fused_subclass(cls, f"Fused{name}", processors.__name__, method="__call__",
                                        complex_rotary="apply_rotary_emb_qwen")
    assert sub is not None and found.prefix_cats == (1 if taken else 0)
    torch.manual_seed(4)
    attn = torch.nn.Module()
    attn.heads, attn.to_k = 2, torch.nn.Linear(32, 256).to(torch.bfloat16)
    attn.norm_k = RMSNorm(128, eps=1e-6).to(torch.bfloat16)
    x = torch.randn(1, 11, 32).to(torch.bfloat16)
    freqs = torch.polar(torch.ones(11, 64), torch.rand(11, 64) * 100)
    kernel, calls = RMSNORM_ROPE_COMPLEX_PREFIX.kernel, []
    RMSNORM_ROPE_COMPLEX_PREFIX.kernel = lambda *args: calls.append(1) or kernel(*args)
    try:
        for cached in ((torch.randn(1, 5, 2, 128).to(torch.bfloat16), None) if name == "Prefix"
                       else (torch.randn(1, 5, 2, 128).to(torch.bfloat16),)):
            with torch.no_grad():
                assert torch.equal(sub()(attn, x.clone(), freqs, cached), cls()(attn, x.clone(), freqs, cached))
    finally:
        RMSNORM_ROPE_COMPLEX_PREFIX.kernel = kernel
    assert calls == ([1] if taken else [])


# --- the GPU ------------------------------------------------------------------------------------------------------

# (prefix, tokens, heads): Qwen-Image 2.1 at 1024x1024 (256 text tokens cached, 4096 image tokens, 32 heads of 128),
# at 512x512, and an odd small one
GPU_SHAPES = [(256, 4096, 32), (256, 1024, 32), (7, 9, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("prefix, tokens, heads", GPU_SHAPES, ids=str)
def test_matches_eager_bitwise_on_the_gpu(prefix, tokens, heads, dtype):
    """The raw ``_out`` launch into the rows after the prefix of a NaN-poisoned tensor, and the public op (fast,
    verified): `torch.equal` to the helper's chain."""
    from diffusers_fastpath.ops._build import load_extension
    from diffusers_fastpath.ops.rmsnorm_rope import _pairs

    load_extension()
    with torch.no_grad():
        for seed in range(2):
            cached, norm, x, freqs = make(1, prefix, tokens, heads, dtype, "cuda", seed)
            ref = rmsnorm_rope_complex_prefix_ref(cached, norm, x, freqs)
            out = torch.full((1, prefix + tokens, heads, 128), float("nan"), dtype=dtype, device="cuda")
            out[:, :prefix].copy_(cached)
            torch.ops.diffusers_fastpath._rmsnorm_rope_complex_cuda_out(
                out[:, prefix:].view(-1, 1, 128), x.view(-1, 1, 128), norm.weight, _pairs(freqs), heads, tokens,
                norm.eps)
            torch.cuda.synchronize()
            assert torch.equal(out, ref)
            site = Site("rmsnorm_rope_complex_prefix")
            assert torch.equal(rmsnorm_rope_complex_prefix(cached, norm, x, freqs, site), ref)
            assert site.fast == 1 and not site.fallback, site
    assert RMSNORM_ROPE_COMPLEX_PREFIX.disabled is None


@pytest.mark.gpu
def test_qwen_image_21_cached_step_is_bit_identical_on_the_gpu(qwen21_cached_steps):
    """The tiny Qwen-Image 2.1's extract and cached steps on the GPU, patched == unpatched, every block's cached key
    written by the kernel (the prefix site fast, nothing falling back)."""
    model = qwen21_cached_steps(device="cuda")
    prefix = [dict(sites_of(b.attn))["rmsnorm_rope_complex_prefix"] for b in model.transformer_blocks]
    assert all(s.fast == 1 and not s.fallback for s in prefix), prefix
    assert RMSNORM_ROPE_COMPLEX_PREFIX.disabled is None


def test_a_hook_on_the_key_norm_runs_as_unpatched(emulated_kernels):
    """A diffusers hook on block 0's ``norm_k`` (an instance-level wrapper, as offloading's) that changes its output:
    the cached step patched equals the unpatched model's with the same hook (its first call verified, the second
    trusted); block 0's key norm runs as written, hook and all, and its prefix site counts why the concatenation ran
    as written; the other block's stays fast."""
    from diffusers.hooks import HookRegistry, ModelHook

    class Scale(ModelHook):
        def post_forward(self, module, output):
            calls.append(1)
            return output * 1.5

    model = zoo.build("qwen-image-21", dtype=torch.bfloat16)
    kwargs = zoo.inputs("qwen-image-21", model, cached=True)
    with torch.no_grad():
        plain = model(**kwargs)[0].clone()
    calls = []
    HookRegistry.check_if_exists_or_initialize(model.transformer_blocks[0].attn.norm_k).register_hook(Scale(), "scale")
    with torch.no_grad():
        ref = model(**kwargs)[0].clone()
    assert calls and not torch.equal(ref, plain)  # the hook runs and changes the output: the test can fail
    fp.patch(model)
    try:
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(**kwargs)[0], ref)
        hooked, free = (dict(sites_of(b.attn))["rmsnorm_rope_complex_prefix"] for b in model.transformer_blocks)
        assert (hooked.fast, dict(hooked.fallback)) == (0, {PREFIX_UNFUSED: 2}), hooked
        assert free.fast == 2 and not free.fallback, free
    finally:
        fp.unpatch(model)
