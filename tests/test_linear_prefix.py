"""linear_prefix (Qwen-Image 2.1's cached value: the to_v GEMM written after the KV cache's prefix): the reference is
the helper's lines, the op writes after a copy of the prefix through aten's addmm, the guards fall back with their
reason, the custom op; the rewriter's prefix-projection form on the tiny model's cached and extract steps and its
pipeline (patched == unpatched, sites counted), and where it must refuse; the bit-exact contract on the GPU at the
published shapes."""

from __future__ import annotations


import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath._state import sites_of
from diffusers_fastpath.models._chain_pending import VALUE_UNFUSED
from diffusers_fastpath.ops import Site
from diffusers_fastpath.ops.linear_prefix import (BATCH_REASON, LINEAR_PREFIX, _out, linear_prefix, linear_prefix_ref,
                                                  unflattened)
from diffusers_fastpath.testing import zoo


def make(batch, prefix, tokens, heads, dim, k, dtype, device, seed, bias=False):
    """(cached prefix, to_v, x): Qwen-Image 2.1's projections have no bias (`bias`: one with)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    linear = torch.nn.Linear(k, heads * dim, bias=bias).to(device=device, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(heads * dim, k, generator=gen, device=device) / k ** 0.5)
        if bias:
            linear.bias.copy_(torch.randn(heads * dim, generator=gen, device=device))
    x = torch.randn(batch, tokens, k, generator=gen, device=device).to(dtype)
    cached = torch.randn(batch, prefix, heads, dim, generator=gen, device=device).to(dtype)
    return cached, linear, x


def test_reference_is_the_helpers_lines():
    """The reference is ``_qwenimage21_prepare_qkv``'s lines: ``to_v(x).unflatten(-1, (-1, D))``, then
    ``torch.cat([cached_v, value], dim=1)``."""
    cached, linear, x = make(1, 5, 11, 3, 16, 24, torch.bfloat16, "cpu", 0)
    with torch.no_grad():
        value = linear(x).unflatten(-1, (-1, 16))
        assert torch.equal(linear_prefix_ref(cached, linear, x, (-1, 16)), torch.cat([cached, value], dim=1))


@pytest.mark.parametrize("sizes, expected", [(None, (48,)), ((-1, 16), (3, 16)), ((3, -1), (3, 16)), ((3, 16), (3, 16)),
                                             ((-1, -1), None), ((5, -1), None), ((0, -1), None), ((3, 15), None),
                                             ((3.0, 16), None)])
def test_unflattened_is_torchs_shape_or_none(sizes, expected):
    """The shape the op writes is the one ``unflatten`` makes, and ``None`` exactly where ``unflatten`` raises."""
    assert unflattened(48, sizes) == expected
    if sizes is not None:
        try:
            shape = tuple(torch.empty(2, 48).unflatten(-1, sizes).shape[1:])
        except (RuntimeError, TypeError):
            shape = None
        assert shape == expected


@pytest.mark.parametrize("bias", [False, True])
def test_op_writes_after_a_copy_of_the_prefix(bias, emulated_kernels, monkeypatch):
    """The fast path on a CPU (the guard's device taken as a GPU's): one GEMM call, eager's (``mm`` without a bias,
    ``addmm`` with one), its ``out=`` the rows after the prefix of the result (a strided prefix copied as its values),
    the whole equal to the reference; self-verified."""
    calls = []
    gemm = torch.addmm if bias else torch.mm

    def recording(*args, out=None, **kwargs):
        calls.append(None if out is None else (out.data_ptr(), tuple(out.shape)))
        return gemm(*args, out=out, **kwargs)

    cached, linear, x = make(1, 8, 11, 2, 16, 24, torch.bfloat16, "cpu", 1, bias)
    cached = cached.transpose(1, 2).contiguous().transpose(1, 2)
    site = Site("linear_prefix")
    monkeypatch.setattr(torch, "addmm" if bias else "mm", recording)
    with torch.no_grad():
        out = linear_prefix(cached, linear, x, (-1, 16), site)
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(out, linear_prefix_ref(cached, linear, x, (-1, 16)))
    assert calls[0] == (out.data_ptr() + 8 * 32 * out.element_size(), (11, 32))
    assert (site.fast, site.fallback) == (1, {})


def test_out_form_writes_every_element_of_a_poisoned_tensor(emulated_kernels):
    cached, linear, x = make(1, 8, 11, 2, 16, 24, torch.bfloat16, "cpu", 2, bias=True)
    out = torch.full((1, 19, 2, 16), float("nan"), dtype=torch.bfloat16)
    with torch.no_grad():
        _out(cached, x, linear.weight, linear.bias, out)
        assert torch.equal(out, linear_prefix_ref(cached, linear, x, (-1, 16)))


@pytest.mark.parametrize("case, reason", [
    ("batch", BATCH_REASON), ("dtype", "prefix of another dtype"), ("align", "rows after the prefix not 256-byte aligned"),
    ("hooks", "Linear has hooks"), ("heads", "prefix not [B, P, *the value's heads]"), ("strided", "input not contiguous"),
    ("grad", "requires grad")])
def test_guard_falls_back_with_reason(case, reason, emulated_kernels):
    """What the op does not take runs the module's call (hooks and all) and the concatenation as written; the site
    counts why."""
    cached, linear, x = make(2 if case == "batch" else 1, 3 if case == "align" else 8, 11, 2, 16, 24, torch.bfloat16,
                             "cpu", 3)
    sizes = (-1, 16)
    if case == "dtype":  # (torch.cat promotes it)
        cached = cached.half()
    if case == "heads":
        sizes = (4, -1)
    if case == "strided":
        x = torch.randn(1, 24, 11).to(torch.bfloat16).transpose(1, 2)
    calls = []
    if case == "hooks":
        linear.register_forward_hook(lambda module, args, out: calls.append(1) or out * 2)
    site = Site("linear_prefix")
    with torch.set_grad_enabled(case == "grad"):
        if case == "heads":
            with pytest.raises(RuntimeError):  # (eager raises too: a [1, P, 2, 16] prefix and [1, S, 4, 8] values)
                linear_prefix(cached, linear, x, sizes, site)
        else:
            got = linear_prefix(cached, linear, x, sizes, site)
            assert torch.equal(got, torch.cat([cached, linear(x).unflatten(-1, sizes)], dim=1))
    assert site.fast == 0 and site.fallback == {reason: 1}
    assert calls == ([1, 1] if case == "hooks" else [])  # the fallback's call of the module, and the expected value's


def test_custom_op_opcheck_cpu():
    cached, linear, x = make(1, 8, 9, 2, 16, 24, torch.bfloat16, "cpu", 4)
    op = torch.ops.diffusers_fastpath.linear_prefix.default
    torch.library.opcheck(op, (cached, x, linear.weight.detach(), None))
    with torch.no_grad():
        assert torch.equal(op(cached, x, linear.weight, None), linear_prefix_ref(cached, linear, x, (-1, 16)))


# --- the rewriter's prefix-projection form on Qwen-Image 2.1 -------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 2])
def test_qwen_image_21_cached_value_is_written_after_its_prefix(batch, qwen21_cached_steps, emulated_kernels):
    """The tiny Qwen-Image 2.1's extract and cached steps patched == unpatched. Each block's value: at the extract step
    the projection runs where the cache store reads it; at the cached step its GEMM writes after the cached prefix
    (`linear_prefix`), at batch 1; at batch 2 that site counts why not and the concatenation runs as written."""
    model = qwen21_cached_steps(batch)
    for block in model.transformer_blocks:
        site = dict(sites_of(block.attn))["linear_prefix"]
        assert (site.fast, dict(site.fallback)) == ((1, {}) if batch == 1 else (0, {BATCH_REASON: 1}))
    assert LINEAR_PREFIX.disabled is None


@pytest.mark.parametrize("kind", ["hook", "lora", "autocast"])
def test_a_value_projection_that_must_run_as_written_runs_as_unpatched(kind, emulated_kernels):
    """Block 0's ``to_v`` with a diffusers hook that changes its output, or replaced by a subclass of ``nn.Linear``
    (a LoRA layer's stand-in: its forward must run), or every projection under CPU autocast: the cached step patched
    equals the unpatched model's; the value is projected where written and the site counts why; block 1's (no hook,
    plain) stays fast."""
    from diffusers.hooks import HookRegistry, ModelHook

    class Scale(ModelHook):
        def post_forward(self, module, output):
            calls.append(1)
            return output * 1.5

    class Lora(torch.nn.Linear):
        def forward(self, x):
            calls.append(1)
            return super().forward(x) + 0.5

    model = zoo.build("qwen-image-21", dtype=torch.bfloat16)
    kwargs = zoo.inputs("qwen-image-21", model, cached=True)
    with torch.no_grad():
        plain = model(**kwargs)[0].clone()
    calls = []
    attn = model.transformer_blocks[0].attn
    if kind == "hook":
        HookRegistry.check_if_exists_or_initialize(attn.to_v).register_hook(Scale(), "scale")
    elif kind == "lora":
        lora = Lora(attn.to_v.in_features, attn.to_v.out_features, bias=False, dtype=torch.bfloat16)
        lora.load_state_dict(attn.to_v.state_dict())
        attn.to_v = lora
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "autocast")
    with torch.no_grad(), autocast:
        ref = model(**kwargs)[0].clone()
    assert kind == "autocast" or (calls and not torch.equal(ref, plain))  # the test can fail
    fp.patch(model)
    try:
        with torch.no_grad(), autocast:
            for _ in range(2):
                assert torch.equal(model(**kwargs)[0], ref)
        first, second = (dict(sites_of(b.attn))["linear_prefix"] for b in model.transformer_blocks)
        assert (first.fast, dict(first.fallback)) == (0, {VALUE_UNFUSED: 2}), first
        if kind == "autocast":
            assert (second.fast, dict(second.fallback)) == (0, {VALUE_UNFUSED: 2}), second
        else:
            assert second.fast == 2 and not second.fallback, second
    finally:
        fp.unpatch(model)


def test_qwen_image_21_pipeline_patched_equals_unpatched(emulated_kernels):
    """Qwen-Image 2.1's modular pipeline (CFG through its guider: each branch's prefill, then cached steps), two
    steps: the images patched == unpatched, every block's value written after its prefix at every cached forward."""
    from diffusers_fastpath.testing.zoo.pipelines import PIPELINES

    pipe, call = PIPELINES["qwen-image-21"]()
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        ref = pipe(**call, generator=torch.Generator().manual_seed(0)).clone()
    fp.patch(pipe)
    try:
        with torch.no_grad():
            got = pipe(**call, generator=torch.Generator().manual_seed(0))
        sites = [dict(sites_of(b.attn))["linear_prefix"] for b in pipe.transformer.transformer_blocks]
    finally:
        fp.unpatch(pipe)
    assert torch.equal(got, ref)
    assert all(s.fast >= 1 and not s.fallback for s in sites), sites
    assert len({s.fast for s in sites}) == 1  # (as many in every block: each cached forward's)


PROCESSORS = '''import torch


class Prefix:
    def __call__(self, attn, x, cached):
        value = attn.to_v(x)
        value = value.unflatten(-1, (-1, 16))
        scale = torch.ones((), dtype=value.dtype)
        if cached is not None:
            value = torch.cat([cached, value], dim=1)
        return value * scale


class ReadFirst:  # the value read (not for its dtype) before the concatenation: not the form
    def __call__(self, attn, x, cached):
        value = attn.to_v(x).unflatten(-1, (-1, 16))
        total = value.sum()
        value = torch.cat([cached, value], dim=1)
        return value, total


class Written:  # the projection's input written between the projection and the concatenation: it may not wait
    def __call__(self, attn, x, cached):
        value = attn.to_v(x)
        value = value.unflatten(-1, (-1, 16))
        x.mul_(2)
        value = torch.cat([cached, value], dim=1)
        return value


class Suffix:  # the prefix after the value: not the form
    def __call__(self, attn, x, cached):
        value = attn.to_v(x)
        value = value.unflatten(-1, (-1, 16))
        value = torch.cat([value, cached], dim=1)
        return value
'''


@pytest.fixture
def processors(source_module):
    return source_module("_fastpath_prefix_linear_processors", PROCESSORS)


@pytest.mark.parametrize("name, taken", [("Prefix", True), ("ReadFirst", False), ("Written", False),
                                         ("Suffix", False)])
def test_prefix_projection_form_is_taken_only_where_it_is_the_concatenation(name, taken, processors,
                                                                            emulated_kernels):
    """``V = A.M(X)``, read as ``V.dtype`` and unflattened, then ``V = torch.cat([C, V], dim=1)`` (inside an ``if``)
    becomes the op; a value read otherwise first, its input written in between, or the prefix after it keeps the lines
    as written (the written case would project the doubled input if the projection waited). Each equal to the class
    as written, with and without the prefix."""
    from diffusers_fastpath.models import _chains

    cls = getattr(processors, name)
    sub, found = _chains.fused_subclass(cls, f"Fused{name}", processors.__name__, method="__call__")
    assert (sub is not None and found.prefix_linears == 1) if taken else sub is None
    if sub is None:
        return
    torch.manual_seed(5)
    attn = torch.nn.Module()
    attn.to_v = torch.nn.Linear(24, 32, bias=False).to(torch.bfloat16)
    x = torch.randn(1, 11, 24).to(torch.bfloat16)
    kernel, calls = LINEAR_PREFIX.kernel, []
    LINEAR_PREFIX.kernel = lambda *args: calls.append(1) or kernel(*args)
    try:
        for cached in (torch.randn(1, 8, 2, 16).to(torch.bfloat16), None):
            with torch.no_grad():
                assert torch.equal(sub()(attn, x.clone(), cached), cls()(attn, x.clone(), cached))
    finally:
        LINEAR_PREFIX.kernel = kernel
    assert calls == [1]


# --- the GPU ------------------------------------------------------------------------------------------------------

# (prefix, tokens, heads, dim, K): Qwen-Image 2.1 at 1024x1024 (256 text tokens cached, 4096 image tokens, 32 heads
# of 128, hidden 4096), at 512x512, and an odd small one (8 x 2 x 128 x 2 bytes: aligned)
GPU_SHAPES = [(256, 4096, 32, 128, 4096), (256, 1024, 32, 128, 4096), (8, 9, 2, 128, 96)]


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("prefix, tokens, heads, dim, k", GPU_SHAPES, ids=str)
def test_matches_eager_bitwise_on_the_gpu(prefix, tokens, heads, dim, k, dtype, bias):
    """The raw out form into a NaN-poisoned tensor, and the public op (fast, verified): `torch.equal` to the helper's
    lines."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    with torch.no_grad():
        for seed in range(2):
            cached, linear, x = make(1, prefix, tokens, heads, dim, k, dtype, "cuda", seed, bias)
            ref = linear_prefix_ref(cached, linear, x, (-1, dim))
            out = torch.full((1, prefix + tokens, heads, dim), float("nan"), dtype=dtype, device="cuda")
            _out(cached, x, linear.weight, linear.bias, out)
            torch.cuda.synchronize()
            assert torch.equal(out, ref)
            site = Site("linear_prefix")
            assert torch.equal(linear_prefix(cached, linear, x, (-1, dim), site), ref)
            assert site.fast == 1 and not site.fallback, site
    assert LINEAR_PREFIX.disabled is None


@pytest.mark.gpu
def test_qwen_image_21_cached_step_is_bit_identical_on_the_gpu(qwen21_cached_steps):
    """The tiny Qwen-Image 2.1's extract and cached steps on the GPU, patched == unpatched, every block's cached value
    written by the GEMM after its prefix (the site fast, nothing falling back)."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    model = qwen21_cached_steps(device="cuda")
    sites = [dict(sites_of(b.attn))["linear_prefix"] for b in model.transformer_blocks]
    assert all(s.fast == 1 and not s.fallback for s in sites), sites
    assert LINEAR_PREFIX.disabled is None
