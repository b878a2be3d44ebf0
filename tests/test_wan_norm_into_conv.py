"""The Wan / Qwen-Image VAE norm -> SiLU pair written into the causal convolution that reads it (models/vae_wan.py's
`IntoPairCalls`, ops/channel_rmsnorm_silu.py's padded result, ops/causal_conv_pad.py's `interior_view` and
`fill_front`, ops/causal_conv_cl.py's in-place path).

On CPU: the readers the rewrite finds in diffusers' forwards and where it stops (other reads, branches that differ,
tests that read the value); a tiny Wan 2.1 / 2.2 and Qwen-Image VAE decode and encode patched == unpatched under the
emulated kernels with the pairs' results written into the buffers (counted) and every site fast; the refusals (hooks
on the convolution, a dropout in training mode, fp32, the channels-last op off) write the plain result and stay
exact; the view's fallbacks (each op refused or off) are eager's computation on the contiguous tensor; `interior_of`
takes nothing but the exact view of a buffer made for that convolution; the NVRTC launch passes what bindings_vae.cpp
passes. On the GPU: the kernel (NVRTC and nvcc) against eager's padded buffer at Wan's and Qwen-Image's shapes, and the
op chain (pair then convolution, cached chunks) against the modules at Wan's decoder shapes."""

from __future__ import annotations

import ast
import importlib
import textwrap

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.autoencoders import autoencoder_kl_wan as wan
from torch import nn

import diffusers_fastpath as fp
from diffusers_fastpath.models import vae_wan
from diffusers_fastpath.ops._policy import Site, bits
from diffusers_fastpath.testing._common import randomize_

causal_conv_pad = importlib.import_module("diffusers_fastpath.ops.causal_conv_pad")
causal_conv_cl = importlib.import_module("diffusers_fastpath.ops.causal_conv_cl")
crms = importlib.import_module("diffusers_fastpath.ops.channel_rmsnorm_silu")

from test_vae_wan import _build, _decode, _encode, _latents, _video, _every_site_fast, KINDS  # noqa: E402



def _into_calls(block: type) -> list[tuple[str, tuple[str, ...]]]:
    """The (norm, readers) of each ``norm_act_into`` call of the rewritten forward of `block`'s pair subclass."""
    sub = next(b for b in vae_wan.BLOCKS if b.base is block).current()
    tree = ast.parse(textwrap.dedent(__import__("inspect").getsource(sub.forward)))
    return [(node.args[1].value, tuple(e.value for e in node.args[4].elts)) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "norm_act_into"]


def test_the_rewrite_finds_each_pairs_convolution_in_diffusers_forwards():
    """Every pair of Wan's and Qwen-Image's blocks goes to its convolution: the residual blocks' ``conv1`` and,
    through the dropout, ``conv2``; the encoder's and decoder's ``conv_out`` (the feature cache's clone of the value
    read through a slice, Qwen-Image's slice bound by ``x.shape[2]``)."""
    resnet = [("norm1", ("conv1",)), ("norm2", ("dropout", "conv2"))]
    for block in (wan.WanResidualBlock, vae_wan.qwen.QwenImageResidualBlock):
        assert _into_calls(block) == resnet, block
    for block in (wan.WanEncoder3d, wan.WanDecoder3d, vae_wan.qwen.QwenImageEncoder3d,
                  vae_wan.qwen.QwenImageDecoder3d):
        assert _into_calls(block) == [("norm_out", ("conv_out",))], block


def _cloned_calls(block: type) -> int:
    """How many ``<ns>.cloned(x[...])`` calls the rewritten forward of `block`'s pair subclass makes."""
    sub = next(b for b in vae_wan.BLOCKS if b.base is block).current()
    return sum(attr == "cloned" and isinstance(args[0], ast.Subscript)
               for attr, args in vae_wan.forward_calls(sub.forward))


def test_the_rewrite_makes_the_caches_clones_of_the_pairs_values_word_copies():
    """Each feature-cache clone of a pair's value (``x[:, :, -CACHE_T:].clone()``: the resnets' two, the heads' one)
    becomes ``cloned``; the clones of other values (the blocks' inputs, the convolutions' results) stay."""
    for block in (wan.WanResidualBlock, vae_wan.qwen.QwenImageResidualBlock):
        assert _cloned_calls(block) == 2, block
    for block in (wan.WanEncoder3d, wan.WanDecoder3d, vae_wan.qwen.QwenImageEncoder3d,
                  vae_wan.qwen.QwenImageDecoder3d):
        assert _cloned_calls(block) == 1, block
    rewritten = vae_wan._Into("ns").body(ast.parse(textwrap.dedent("""
        x = ns.norm_act(self, "norm", "act", x)
        c = x[:, :, -2:].clone()
        d = y[:, :, -2:].clone()
        x = self.conv(x, c)
        e = x[:, :, -2:].clone(memory_format=torch.contiguous_format)
    """)).body)
    text = ast.unparse(ast.Module(rewritten, []))
    assert "c = ns.cloned(x[:, :, -2:])" in text and "d = y[:, :, -2:].clone()" in text
    assert "e = x[:, :, -2:].clone(memory_format=torch.contiguous_format)" in text


def test_cloned_is_clone():
    """`causal_conv_pad.cloned` gives ``t.clone()``'s tensor (bits, dtype, shape, strides), by words where a cache is
    cut from a pair's buffer, by ``clone`` itself elsewhere."""
    buf = torch.randn(1, 8, 6, 7, 10).to(torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    view = causal_conv_pad.interior_view(buf, [1, 1, 1, 1, 2, 0])
    cases = [view[:, :, -2:], view[:, :, -1:], view, torch.randn(2, 3, 4, 5, 6).to(torch.bfloat16),
             buf[:, :3, -2:, 1:-1, 1:-1],  # (3 channels: rows of 24 bytes, words all the same)
             buf[:, :, -2:, 1:-1, 2:-1],  # (an offset of one 16-byte column: no whole words from the start)
             torch.randn(1, 8, 2, 5, 8, requires_grad=True)[:, :, :, 1:4, 1:-1]]
    for t in cases:
        want, got = t.clone(), causal_conv_pad.cloned(t)
        assert got.stride() == want.stride() and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.detach().view(torch.int16 if got.dtype == torch.bfloat16 else torch.int32),
                           want.detach().view(torch.int16 if want.dtype == torch.bfloat16 else torch.int32))
        assert got.requires_grad == want.requires_grad and got.data_ptr() != t.data_ptr()
    assert causal_conv_pad._words(view[:, :, -2:]) is not None  # (the word path, for the cache's cut)

    class Other:
        def clone(self):
            return "cloned"

    assert causal_conv_pad.cloned(Other()) == "cloned"


def _residual(source: str) -> str:
    return ast.unparse(ast.Module(vae_wan._residual(ast.parse(textwrap.dedent(source)).body, "ns"), []))


def test_the_residual_rewrite_takes_only_a_convolutions_last_binding_read_by_the_add():
    """``return V + E`` whose V (or E) is bound last, on every path, by a module call after which nothing names it
    becomes ``pending_add`` and those calls ``conv_pending``; anything else stays as written."""
    assert _residual("""
        if c:
            x = self.conv2(x, k)
            feat[i] = k
        else:
            x = self.conv2(x)
        return x + h
    """) == ("if c:\n    x = ns.conv_pending(self, 'conv2', x, k)\n    feat[i] = k\nelse:\n"
             "    x = ns.conv_pending(self, 'conv2', x)\nreturn ns.pending_add(self, x, h)")
    assert _residual("x = self.conv2(x)\nreturn h + x") == (
        "x = ns.conv_pending(self, 'conv2', x)\nreturn ns.pending_add(self, h, x)")
    for source in ("if c:\n    x = self.conv2(x)\n    y = x\nelse:\n    x = self.conv2(x)\nreturn x + h",  # a read
                   "if c:\n    x = self.conv2(x)\nreturn x + h",  # a path without the call
                   "x = self.conv2(x) * 2\nreturn x + h", "x = self.conv2(x, x)\nreturn x + h",  # not the call alone
                   "x = self.conv2(x)\nreturn x + f(h)", "x = self.conv2(x)\nreturn x + x",  # not two names
                   "x = self.conv2(x)\nreturn x - h", "x = self.conv2(x)\nreturn (x + h) / 2"):
        assert _residual(source) == ast.unparse(ast.parse(source)), source


def _readers(source: str) -> tuple[tuple[str, ...], bool]:
    return vae_wan._readers(ast.parse(textwrap.dedent(source)).body, "x")


def test_readers_stop_where_the_value_is_read_otherwise():
    assert _readers("""
        c = x[:, :, -2:].clone()
        x = self.conv(x, cache)
        y = x * 2
    """) == (("conv",), False)
    assert _readers("""
        x = self.drop(x)
        if cache is not None:
            c = x[:, :, -min(2, x.shape[2]):].clone()
            x = self.conv(x, cache)
        else:
            x = self.conv(x)
    """) == (("drop", "conv"), True)
    # a read before the convolution (a product, a view, an argument elsewhere, a slice not cloned) ends the run there
    for read in ("y = x * 2", "y = x.view(-1)", "f(x)", "c = x[:, :, -2:]", "c = x[x > 0].clone()"):
        assert _readers(f"x = self.drop(x)\n{read}\nx = self.conv(x)") == (("drop",), False), read
    # the value bound otherwise, or named in the call's other arguments
    assert _readers("x = x + 1\nx = self.conv(x)") == ((), False)
    assert _readers("x = self.conv(x, x)") == ((), False)
    # branches that differ, a test that reads the value, a branch that stops: the run ends at the if
    assert _readers("""
        if flag:
            x = self.conv(x)
        else:
            x = self.other(x)
    """) == ((), False)
    assert _readers("if x.sum() > 0:\n    x = self.conv(x)\nelse:\n    x = self.conv(x)") == ((), False)
    assert _readers("if flag:\n    x = self.conv(x)") == ((), False)


def _spy(monkeypatch, module, name):
    """Record the calls of ``module.name`` (the emulated launch or the helper) as (args, result), calling it through."""
    calls = []
    inner = getattr(module, name)

    def spy(*args, **kwargs):
        out = inner(*args, **kwargs)
        calls.append((args, out))
        return out

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_pairs_write_into_the_convolutions_buffers_and_decode_exactly(kind, emulated_kernels, unpatch_after,
                                                                      monkeypatch):
    """Decode and encode patched == unpatched, every site fast, with the pairs' results written into their
    convolutions' buffers (the padded launch) and the convolutions filling only their first frames there; the views
    the pairs return are what the convolutions take (none falls back to a copy)."""
    vae = _build(kind)
    z, x = _latents(vae), _video(vae)
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    unpatch_after(fp.patch(vae))
    padded = _spy(monkeypatch, crms, "_raw_pad")
    filled = _spy(monkeypatch, causal_conv_pad, "fill_front")
    copied = _spy(monkeypatch, causal_conv_pad, "padded_input")
    clones = _spy(monkeypatch, vae_wan, "cloned")
    targets = []
    conv_of = vae_wan._conv_of
    monkeypatch.setattr(vae_wan, "_conv_of", lambda owner, readers: targets.append(conv_of(owner, readers))
                        or targets[-1])
    assert torch.equal(_decode(vae, z), ref_dec)
    assert torch.equal(_encode(vae, x), ref_enc)
    assert _every_site_fast(vae), str(fp.report(vae, verbose=True))
    # every pair whose value goes to a causal convolution wrote into its buffer, which that convolution filled
    # (and the channels-last op's first-call probes filled buffers like them)
    assert targets and all(t is not None for t in targets)
    assert len(padded) == len(targets) and {id(out) for _, out in padded} <= {id(out) for _, out in filled}
    # and no convolution copied a pair's view into a buffer of its own (the others read x as before)
    assert copied and all(causal_conv_pad.interior_of(args[1], args[0]) is None for args, _ in copied)
    # the caches cut from the pairs' values (views of the buffers) were cloned as words
    assert clones and all(not causal_conv_pad._dense(args[0]) and causal_conv_pad._words(args[0]) is not None
                          for args, _ in clones)


@pytest.mark.parametrize("kind", ["wan", "qwen"])
@torch.no_grad()
def test_the_resnets_add_their_convolutions_pending_result(kind, emulated_kernels, unpatch_after, monkeypatch):
    """Every residual block's ``return x + h`` takes ``conv2``'s result with its bias pending (`conv_bias_residual`:
    the bias, the transpose back and the add in one pass) from the second call of the convolution's signature on, in
    a decode and an encode long enough to call each signature again; patched == unpatched; the convolution's sites
    count the calls that stood for the module's; the rewrite leaves no other reader of the pending value."""
    vae = _build(kind)
    z, x = _latents(vae, frames=3), _video(vae, frames=9)
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    unpatch_after(fp.patch(vae))
    added = _spy(monkeypatch, vae_wan, "add_pending")
    assert torch.equal(_decode(vae, z), ref_dec)
    assert torch.equal(_encode(vae, x), ref_enc)
    rows = {r.site: r for r in fp.report(vae).sites}
    residual = {name: r for name, r in rows.items() if r.op == "conv_bias_residual"}
    resnets = [m for m in vae.modules() if type(m).__name__.endswith("ResidualBlock")]
    # every resnet's add reached and fast (an identity shortcut of an upsampler's time-major result too: the kernel
    # reads either layout)
    assert len(residual) == len(resnets) and all(r.fast > 0 for r in residual.values()), residual
    assert all(r.fallback == 0 for r in rows.values())
    pending = [args for args, _ in added if type(args[1]) is causal_conv_cl.PendingBias]
    assert len(pending) == sum(r.fast + r.fallback for r in residual.values())


@torch.no_grad()
def test_a_hooked_or_replaced_conv2_is_called_as_a_module(emulated_kernels, unpatch_after, monkeypatch):
    """A hook on a resnet's ``conv2`` (or a forward replaced on it) runs: its call is the module's, its result a
    tensor, the add as written; the decode stays exact."""
    vae = _build("wan")
    z = _latents(vae, frames=3)
    ref = _decode(vae, z)
    unpatch_after(fp.patch(vae))
    block = next(m for m in vae.decoder.modules() if type(m).__name__.endswith("ResidualBlock"))
    seen = []
    handle = block.conv2.register_forward_hook(lambda m, args, out: seen.append(type(out)))
    try:
        assert torch.equal(_decode(vae, z), ref)
    finally:
        handle.remove()
    assert seen and all(t is torch.Tensor for t in seen)
    conv = block.conv2
    conv.forward = type(conv).forward.__get__(conv)  # (an instance forward: the module's call runs it)
    calls = _spy(monkeypatch, causal_conv_cl, "pending_result")
    try:
        assert torch.equal(_decode(vae, z), ref)
    finally:
        del conv.forward
    assert calls and all(out is None for args, out in calls if args[0] is conv)


def _hooked_conv(vae):
    block = next(m for m in vae.decoder.modules() if type(m).__name__.endswith("ResidualBlock"))
    return block, block.conv1


@torch.no_grad()
def test_a_hooked_convolution_sees_a_contiguous_input_and_the_rest_stays_exact(emulated_kernels, unpatch_after,
                                                                               monkeypatch):
    vae = _build("wan")
    z = _latents(vae)
    ref = _decode(vae, z)
    unpatch_after(fp.patch(vae))
    block, conv = _hooked_conv(vae)
    seen = []
    handle = conv.register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous()))
    padded = _spy(monkeypatch, crms, "_raw_pad")
    try:
        assert torch.equal(_decode(vae, z), ref)
    finally:
        handle.remove()
    assert seen and all(seen)  # (the hooked convolution's pair wrote its own tensor)
    assert padded  # (the others still wrote into their buffers)
    padded.clear()
    assert torch.equal(_decode(vae, z), ref)
    baseline = len(padded)
    padded.clear()
    block.dropout.train()  # (nn.Dropout(0.0) in training mode: the between check refuses it, conv2 reads a tensor)
    try:
        assert torch.equal(_decode(vae, z), ref)
    finally:
        block.dropout.eval()
    assert 0 < len(padded) < baseline


@torch.no_grad()
def test_an_fp32_vae_and_a_disabled_channels_last_op_write_no_buffer(emulated_kernels, unpatch_after, monkeypatch):
    vae = _build("wan", dtype=torch.float32)
    z = _latents(vae).float()
    ref = _decode(vae, z)
    unpatch_after(fp.patch(vae))
    padded = _spy(monkeypatch, crms, "_raw_pad")
    assert torch.equal(_decode(vae, z), ref)
    assert not padded
    vae16 = _build("qwen")
    z16 = _latents(vae16)
    ref16 = _decode(vae16, z16)
    unpatch_after(fp.patch(vae16))
    monkeypatch.setattr(causal_conv_cl.CAUSAL_CONV3D_CL, "disabled", "off for the test")
    assert torch.equal(_decode(vae16, z16), ref16)
    assert not padded


def _patched_conv():
    """A Wan causal 3x3x3 convolution as the adapter patches it (its class, its sites), random weights; its VAE."""
    vae = _build("wan")
    block = next(m for m in vae.decoder.modules() if type(m).__name__.endswith("ResidualBlock"))
    fp.patch(vae)
    return vae, block.conv1


def _view_of(x: torch.Tensor, conv) -> torch.Tensor:
    """x's values as a pair's padded result for `conv`: the view of a zero-bordered channels-last buffer."""
    buf = torch.zeros(causal_conv_pad.padded_shape(x, conv._padding), dtype=x.dtype)
    buf = buf.contiguous(memory_format=torch.channels_last_3d)
    return causal_conv_pad.interior_view(buf, conv._padding).copy_(x)


@torch.no_grad()
def test_the_view_and_a_channels_last_cache_give_eagers_result_every_way(emulated_kernels, monkeypatch):
    """The convolution given a pair's view (and a cache cloned from one, channels-last): its in-place path, its
    channels-first path (the channels-last op off) and its eager fallback (both off) all equal the module's forward on
    the contiguous tensors; a contiguous x with a channels-last cache runs the one-buffer path, exactly."""
    vae, conv = _patched_conv()
    try:
        gen = torch.Generator().manual_seed(2)
        c = conv.in_channels
        x = torch.randn(1, c, 3, 6, 5, generator=gen).to(torch.bfloat16)
        cache = torch.randn(1, c, 2, 6, 5, generator=gen).to(torch.bfloat16)
        for cached in (None, cache[:, :, 1:], cache, _view_of(cache, conv)[:, :, -2:].clone()):
            want = wan.WanCausalConv3d.forward(conv, x, None if cached is None else cached.contiguous())
            view = _view_of(x, conv)
            assert not view.is_contiguous() and causal_conv_pad.interior_of(view, conv) is not None
            site = Site("causal_conv3d")
            assert torch.equal(causal_conv_pad.causal_conv3d(conv, view, cached, site), want)
            assert site.fast == 1, dict(site.fallback)
            assert torch.equal(causal_conv_pad.causal_conv3d(conv, x, cached, site), want)  # (contiguous x)
            assert site.fast == 2, dict(site.fallback)
            with monkeypatch.context() as m:
                m.setattr(causal_conv_cl.CAUSAL_CONV3D_CL, "disabled", "off")
                assert torch.equal(causal_conv_pad.causal_conv3d(conv, _view_of(x, conv), cached), want)
                m.setattr(causal_conv_pad.CAUSAL_CONV3D, "disabled", "off")
                assert torch.equal(causal_conv_pad.causal_conv3d(conv, _view_of(x, conv), cached), want)
    finally:
        fp.unpatch(vae)


def test_interior_of_takes_only_the_exact_view_of_a_buffer_made_for_the_convolution():
    conv = wan.WanCausalConv3d(4, 4, 3, padding=1)
    x = torch.randn(1, 4, 3, 5, 6)
    view = _view_of(x, conv)
    assert causal_conv_pad.interior_of(view, conv) is view._base
    assert causal_conv_pad.interior_of(view[:, :, 1:], conv) is None  # (another part of it)
    assert causal_conv_pad.interior_of(view.contiguous(), conv) is None
    other = wan.WanCausalConv3d(4, 4, (3, 1, 1), padding=(1, 0, 0))  # (another padding)
    assert causal_conv_pad.interior_of(view, other) is None
    unmarked = torch.zeros(causal_conv_pad.padded_shape(x, conv._padding)).contiguous(
        memory_format=torch.channels_last_3d)[:, :, 2:, 1:-1, 1:-1]  # (the same strides, not made by a pair)
    assert causal_conv_pad.interior_of(unmarked, conv) is None
    assert causal_conv_pad.as_eager(unmarked) is unmarked
    eager = causal_conv_pad.as_eager(view[:, :, -2:])
    assert eager.is_contiguous() and torch.equal(eager, x[:, :, -2:])


@pytest.mark.parametrize("dtype, channels", [(torch.float32, 4), (torch.bfloat16, 8), (torch.bfloat16, 6)], ids=str)
@torch.no_grad()
def test_fill_front_writes_the_cache_last_and_zeros_before_it(dtype, channels):
    """The buffer's first frames after `fill_front` are eager's padded input's: the cache (channels-first, or
    channels-last as cloned from a view: moved as int64 words where the buffer's rows and addresses are whole words,
    with 6 bf16 channels not) last, zeros before it, each fill after another (stale frames go)."""
    conv = wan.WanCausalConv3d(channels, channels, 3, padding=1)
    x = torch.randn(2, channels, 3, 5, 6).to(dtype)
    first = _view_of(x, conv)
    cloned = first[:, :, -2:].clone()
    front = first._base[:, :, :2, 1:-1, 1:-1]  # (its rows start a column in: whole words where C values are)
    assert not cloned.is_contiguous() and causal_conv_pad._words(cloned) is not None
    assert (causal_conv_pad._words(front) is not None) == (channels * x.element_size() % 8 == 0)
    assert causal_conv_pad._words(x) is None  # (channels-first: no rows of W * C values)
    for cache in (torch.randn(2, channels, 2, 5, 6).to(dtype), cloned):
        view = None
        for cached in (None, cache[:, :, 1:], cache, cache[:, :, 1:], None):
            view = _view_of(x, conv) if cached is None else view
            buf = causal_conv_pad.fill_front(view._base, conv._padding, cached)
            want = F.pad(x if cached is None else torch.cat([cached, x], dim=2),
                         (1, 1, 1, 1, 2 - (0 if cached is None else cached.shape[2]), 0))
            assert torch.equal(buf, want)


def test_padded_nvrtc_launch_passes_what_bindings_vae_passes(monkeypatch):
    """The NVRTC launcher of the padded kernel: causal_pad's channels-last arguments without a cache (the zero border:
    `launch_fields`'), then the denominator, gamma, bias (null for none) and the two floats; the wide kernel where
    every vector is whole, the tiled one elsewhere (Qwen-Image's 166-wide rows, 12 channels); the raw guard refuses
    what bindings_vae.cpp does."""
    from test_nvrtc import captured_launches  # noqa: F401 - the fixture's body, called directly below

    launches = captured_launches.__wrapped__(monkeypatch)
    padding = [1, 1, 1, 1, 2, 0]
    for shape, kernel in (((1, 96, 4, 6, 64), crms._NVRTC_PAD_WIDE), ((1, 16, 1, 3, 166), crms._NVRTC_PAD),
                          ((2, 12, 2, 7, 8), crms._NVRTC_PAD)):
        x = torch.randn(shape).to(torch.bfloat16)
        denom = torch.rand(shape[0], shape[2] * shape[3] * shape[4])
        gamma, bias = torch.randn(shape[1]).to(torch.bfloat16), torch.randn(shape[1]).to(torch.bfloat16)
        for b in (None, bias):
            out = crms._nvrtc_pad(x, denom, gamma, b, 9.75, 0.5, padding)
            got, _, grid, block, a = launches[-1]
            assert got is kernel and out.shape == causal_conv_pad.padded_shape(x, padding)
            assert out.is_contiguous(memory_format=torch.channels_last_3d)
            _, fields, wide, want_grid, want_block = causal_conv_pad.launch_fields(x, None, padding, True, False,
                                                                                    False, denom)
            assert wide == (kernel is crms._NVRTC_PAD_WIDE) and (grid, block) == (want_grid, want_block)
            assert (a.a.out, a.a.x, a.a.cache, a.a.cache_frames, a.a.pad_t0, a.a.channels_last, a.a.replicate_t,
                    a.a.reflect_hw) == (out.data_ptr(), x.data_ptr(), None, 0, 2, True, False, False)
            assert (a.denom, a.gamma, a.bias) == (denom.data_ptr(), gamma.data_ptr(),
                                                  None if b is None else b.data_ptr())
            assert (a.scale, a.bias_value) == (9.75, 0.5)
    x = torch.zeros(1, 8, 2, 4, 8, dtype=torch.bfloat16)
    denom, gamma = torch.zeros(1, 64), torch.zeros(8, dtype=torch.bfloat16)
    assert crms._raw_pad_guard(x, denom, gamma, None, 1.0, 0.0, padding) == "shape, dtype, layout or padding"
    cuda = torch.device("cuda")  # (the guard's other checks, read with the device taken as a GPU's)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    assert crms._raw_pad_guard(x, denom, gamma, None, 1.0, 0.0, padding) is None
    assert crms._raw_pad_guard(x.float(), denom, gamma.float(), None, 1.0, 0.0, padding) == "dtype"
    assert crms._raw_pad_guard(x, denom[:, :63], gamma, None, 1.0, 0.0, padding) == "denom"
    assert crms._raw_pad_guard(x, denom, gamma[:4], None, 1.0, 0.0, padding) == "gamma or bias"
    assert crms._raw_pad_guard(x, denom, gamma, gamma.float(), 1.0, 0.0, padding) == "gamma or bias"
    del cuda


# --- on the GPU -------------------------------------------------------------------------------------------------------

# Wan 2.1's decoder norms at 832x480 (the first chunk's single frames, then 2 and 4), Qwen-Image's at 1328x1328 (rows
# of no multiple of 8: the tiled kernel), a batch of 2, and an odd one (parts of every tile)
PAD_SHAPES = [(1, 384, 1, 60, 104), (1, 384, 2, 120, 208), (1, 192, 4, 240, 416), (1, 96, 4, 480, 832),
              (1, 384, 1, 166, 166), (2, 96, 2, 24, 40), (1, 24, 3, 7, 13)]


def _gpu_norm(channels, dtype, seed, bias):
    norm = wan.WanRMS_norm(channels, images=False, bias=bias).cuda()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        norm.gamma.copy_(1 + 0.5 * torch.randn(norm.gamma.shape, generator=gen, device="cuda"))
        if bias:
            norm.bias.copy_(torch.randn(norm.bias.shape, generator=gen, device="cuda"))
    return norm.to(dtype)


def _gpu_x(shape, dtype, seed, layout="contiguous"):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, c, t, h, w = shape
    if layout == "time-major":
        x = (torch.randn(b, t, c, h, w, generator=gen, device="cuda") * 3).to(dtype).transpose(1, 2)
    else:
        x = (torch.randn(shape, generator=gen, device="cuda") * 3).to(dtype)
    x[:, 1::5, ..., ::11] = 0
    x[0, :, 0, 0] = 0  # (positions whose channels are all zero: the norm clamped at eps)
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", PAD_SHAPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "time-major"])
@torch.no_grad()
def test_padded_kernel_through_nvrtc_and_nvcc_equals_eagers_buffer(shape, dtype, layout):
    """The padded kernel against eager's ``F.pad`` of the module's result then ``F.silu`` (laid out channels-last),
    bit for bit, through NVRTC and the nvcc extension (where a toolkit built it), a tensor bias and a python-float
    one, the allocator's blocks of the buffer's size poisoned with NaN first: every element but the first frames
    inside the border, which the kernel leaves, and those too once `fill_front` wrote them (no cache:
    zeros), as the convolution does before it reads the buffer."""
    from test_nvrtc import both_ways

    nvcc = both_ways.__wrapped__()
    padding = [1, 1, 1, 1, 2, 0]
    x = _gpu_x(shape, dtype, sum(shape), layout)
    for bias in (False, True):
        norm = _gpu_norm(shape[1], dtype, shape[1], bias)
        want = F.pad(F.silu(wan.WanRMS_norm.forward(norm, x)), padding).contiguous(
            memory_format=torch.channels_last_3d)
        gamma, b, value = crms._tensors(norm)
        denom = crms.denominator(x).contiguous().view(shape[0], -1)
        ways = [crms._nvrtc_pad] + ([torch.ops.diffusers_fastpath._channel_rmsnorm_pad_cl_cuda] if nvcc else [])
        for way in ways:
            torch.full((2 * want.numel(),), float("nan"), dtype=dtype, device="cuda")
            out = way(x, denom, gamma, b, float(norm.scale), value, padding)
            assert out.is_contiguous(memory_format=torch.channels_last_3d), way
            assert out.shape == want.shape
            left = torch.zeros(out.shape, dtype=torch.bool, device="cuda")
            left[:, :, :2, 1:-1, 1:-1] = True  # (the first frames inside the border)
            assert torch.equal(bits(out)[~left], bits(want)[~left]), (way, bias)
            causal_conv_pad.fill_front(out, padding, None)
            assert torch.equal(bits(out), bits(want)), (way, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("cin, shape", [(384, (1, 384, 1, 60, 104)), (192, (1, 192, 4, 240, 416)),
                                        (96, (1, 96, 4, 480, 832)), (384, (1, 384, 1, 166, 166))], ids=str)
@torch.no_grad()
def test_pair_into_the_convolution_equals_the_modules_over_chunks(cin, shape):
    """The pair op given the convolution (its padded result, its first-call check) then the convolution's op on the
    view, chunk after chunk as the decoder runs them (no cache, a one-frame cache, a two-frame cache cloned from the
    previous chunk's view: channels-last), against the modules called as diffusers' block calls them, bit for bit;
    every call fast, each view's buffer filled in place."""
    from diffusers_fastpath.models.vae import checked_forwards

    checked_forwards(vae_wan.NORMS, vae_wan.NORM_DIGESTS, None, crms.add_norm_class)
    checked_forwards(vae_wan.CONVS, vae_wan.CONV_DIGESTS, nn.Conv3d, causal_conv_pad.add_conv_class)
    norm = _gpu_norm(cin, torch.bfloat16, 1, False)
    conv = randomize_(wan.WanCausalConv3d(cin, cin, 3, padding=1), 2).cuda().to(torch.bfloat16).eval()
    conv.__class__ = vae_wan.CONVS[wan.WanCausalConv3d]
    conv.__dict__[causal_conv_cl.NAMED_SITE] = Site("causal_conv3d_cl")
    norm.__class__ = vae_wan.NORMS[wan.WanRMS_norm]
    eager_cache = fast_cache = None
    pair_site, conv_site = Site("channel_rmsnorm_silu"), Site("causal_conv3d")
    for chunk in range(3):
        x = _gpu_x(shape, torch.bfloat16, 10 + chunk)
        y = F.silu(wan.WanRMS_norm.forward(norm, x))
        cache = y[:, :, -2:].clone()
        if cache.shape[2] < 2 and eager_cache is not None:
            cache = torch.cat([eager_cache[:, :, -1:], cache], dim=2)
        want = wan.WanCausalConv3d.forward(conv, y, eager_cache)
        eager_cache = cache
        view = crms.channel_rmsnorm_silu(norm, x, pair_site, conv)
        assert causal_conv_pad.interior_of(view, conv) is not None, crms.CHANNEL_RMSNORM_SILU.status
        fast = view[:, :, -2:].clone()
        if fast.shape[2] < 2 and fast_cache is not None:
            fast = torch.cat([fast_cache[:, :, -1:], fast], dim=2)
        got = causal_conv_pad.causal_conv3d(conv, view, fast_cache, conv_site)
        fast_cache = fast
        assert torch.equal(bits(got), bits(want)) and got.stride() == want.stride(), chunk
        assert torch.equal(fast_cache, eager_cache)
    assert (pair_site.fast, conv_site.fast) == (3, 3), (dict(pair_site.fallback), dict(conv_site.fallback))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["wan", "qwen"])
@torch.no_grad()
def test_full_channel_vae_decodes_and_encodes_exactly_with_every_join(kind):
    """Wan's and Qwen-Image's VAE at their published channels (base 96) on a small video, on the GPU: decode (four
    latent frames) and encode (nine frames) patched == unpatched, bit for bit, with the pairs written into their
    convolutions' buffers, the caches cloned as words and the resnets' adds taking ``conv2``'s pending result (every
    residual site reached and fast, a time-major residual's too)."""
    vae = _build(kind, base_dim=96).cuda()
    z = _latents(vae, frames=4, size=8).cuda()
    x = _video(vae, frames=9, size=8).cuda()
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    try:
        fp.patch(vae)
        for _ in range(2):
            assert torch.equal(_decode(vae, z), ref_dec)
            assert torch.equal(_encode(vae, x), ref_enc)
        rows = {r.site: r for r in fp.report(vae).sites}
        residual = [r for r in rows.values() if r.op == "conv_bias_residual"]
        assert residual and all(r.fast > 0 for r in residual), str(fp.report(vae, verbose=True))
        assert all(r.fallback == 0 for r in rows.values()), str(fp.report(vae, verbose=True))
        assert any(r.op == "channel_rmsnorm_silu" and r.fast for r in rows.values())
    finally:
        fp.unpatch(vae)
