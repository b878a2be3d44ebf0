"""LTX-Video's and LTX-2's causal 3D convolutions built in one buffer (ops/ltx_causal_conv.py,
models/vae_ltx_conv.py, csrc/causal_pad.cu's repeated frames and reflected border). On CPU: the kernel's buffer (its
arithmetic in torch) against eager's ``repeat`` + ``torch.concatenate`` + ``F.pad`` for causal and non-causal, zeros
and reflect, bf16 / fp16 / fp32; the op against the module (both paths); tiny ``AutoencoderKLLTXVideo`` (patched) and
``AutoencoderKLLTX2Video`` (`swap_ltx_causal_convs` on a `PatchState`) decode and encode equal to unpatched with every
causal convolution fast, tiled too, and undone; the guard's refusals; the NVRTC launcher's arguments; a kernel that
differs caught on its first call. On the GPU: the op and the buffer kernel against eager at LTX-2's decoder shapes,
outputs poisoned first, through NVRTC and nvcc, and LTX-2's VAE decode md5-identical."""

from __future__ import annotations

import hashlib
import importlib

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLLTX2Video, AutoencoderKLLTXVideo
from diffusers.models.autoencoders import autoencoder_kl_ltx as ltx
from diffusers.models.autoencoders import autoencoder_kl_ltx2 as ltx2
from torch import nn

import diffusers_fastpath as fp
from diffusers_fastpath._state import SITE_ATTR, PatchState, sites_of
from diffusers_fastpath.models import vae_conv, vae_ltx_conv
from diffusers_fastpath.ops._policy import Site, bits
from diffusers_fastpath.testing._common import randomize_
from test_vae_ltx import _build as _build_ltx
from test_vae_ltx import _decode, _encode, _latents, _video

op = importlib.import_module("diffusers_fastpath.ops.ltx_causal_conv")  # (ops binds the names to the op functions)
causal_conv_pad = importlib.import_module("diffusers_fastpath.ops.causal_conv_pad")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _eager_buffer(module, x, causal):
    """What eager's convolution reads: diffusers' forward's padding statements, then ``nn.Conv3d``'s reflect pad."""
    k = module.kernel_size[0]
    if causal:
        padded = torch.concatenate([x[:, :, :1, :, :].repeat((1, 1, k - 1, 1, 1)), x], dim=2)
    else:
        pad_left = x[:, :, :1, :, :].repeat((1, 1, (k - 1) // 2, 1, 1))
        pad_right = x[:, :, -1:, :, :].repeat((1, 1, (k - 1) // 2, 1, 1))
        padded = torch.concatenate([pad_left, x, pad_right], dim=2)
    if module.conv.padding_mode == "reflect":
        padded = F.pad(padded, module.conv._reversed_padding_repeated_twice, mode="reflect")
    return padded


def _module(kind="ltx2", cin=4, cout=6, kernel=3, mode="zeros", causal=True, dtype=torch.bfloat16, seed=1):
    """A patched-class module with its site (what `swap_ltx_causal_convs` makes of it)."""
    if kind == "ltx2":
        module = ltx2.LTX2VideoCausalConv3d(cin, cout, kernel, spatial_padding_mode=mode)
    else:
        module = ltx.LTXVideoCausalConv3d(cin, cout, kernel, padding_mode=mode, is_causal=causal)
    module = randomize_(module, seed).to(dtype)
    module.__class__ = vae_ltx_conv.CONVS[type(module)]
    module.__dict__[SITE_ATTR] = Site(op.LTX_CAUSAL_CONV3D.name)
    return module


def _x(shape=(2, 4, 3, 5, 6), dtype=torch.bfloat16, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 3).to(dtype)


def _call(module, x, causal):
    """The module's forward as its caller calls it (LTX-2's with ``causal``; LTX-Video's reads ``is_causal``)."""
    return module(x, causal=causal) if isinstance(module, ltx2.LTX2VideoCausalConv3d) else module(x)


def _diffusers(module, x, causal):
    base = type(module).__mro__[1]
    return base.forward(module, x, causal) if base is ltx2.LTX2VideoCausalConv3d else base.forward(module, x)


# --- the buffer -----------------------------------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["zeros", "reflect"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_buffer_equals_repeat_concatenate_pad(causal, mode, dtype):
    """The kernel's buffer (`pad_arithmetic`: each element gathered from the source position the kernel computes)
    equals eager's, bits, shape and layout (contiguous), also channels-last (the same values), for the kernel sizes
    LTX's VAEs use (3, the shortcut's 1) and a longer one, x contiguous, a time slice cropped in W (strided rows) and
    channels-last (eager's concatenation is contiguous all the same); NaN payloads, infinities and -0.0 included."""
    for kernel in (3, 1, (5, 3, 1)):
        module = _module(mode=mode, kernel=kernel, dtype=dtype)
        x = _x((2, 4, 5, 5, 7), dtype)
        x[0, 0, 0, 0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")]).to(dtype)
        bits(x)[1, 1, 0, 1, 1] = {torch.bfloat16: 0x7F81, torch.float16: 0x7C01, torch.float32: 0x7F800123}[dtype]
        for view in (x, x[:, :, 1:4, :, 1:6], x.contiguous(memory_format=torch.channels_last_3d),
                     x[:1, :, 2:3, 1:3, 2:4]):  # (the last: one frame of 2 x 2, the least a reflection of 1 takes)
            ref = _eager_buffer(module, view, causal)
            padding, conv_padding, reflect = op._plan(module, causal)
            assert reflect == (mode == "reflect") and conv_padding == ((0, 0, 0) if reflect else module.conv.padding)
            for cl in (False, True):
                out = causal_conv_pad.pad_arithmetic(view, None, padding, cl, True, reflect)
                assert out.shape == ref.shape and torch.equal(bits(out), bits(ref)), (kernel, cl)
                assert out.is_contiguous(memory_format=torch.channels_last_3d if cl else torch.contiguous_format)
                assert ref.is_contiguous()


def test_the_zero_border_arithmetic_is_wans():
    """`pad_arithmetic` without the flags is Wan's buffer (cache frames, x, zeros): ``F.pad(torch.cat(...))``."""
    x, cache = _x((1, 3, 2, 4, 5)), _x((1, 3, 1, 4, 5), seed=3)
    ref = F.pad(torch.cat([cache, x], dim=2), (1, 1, 1, 1, 1, 0))
    assert torch.equal(causal_conv_pad.pad_arithmetic(x, cache, [1, 1, 1, 1, 2, 0]), ref)


# --- the op ---------------------------------------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind, mode, causal", [("ltx2", "zeros", True), ("ltx2", "reflect", False),
                                                 ("ltx2", "reflect", True), ("ltx", "zeros", True),
                                                 ("ltx", "zeros", False)])
def test_op_equals_the_module(kind, mode, causal, dtype, emulated_kernels):
    """The patched module against diffusers' forward, bits and strides: channels-last in bf16 / fp16 (its buffer,
    the convolution on it, the bias pass), the channels-first one buffer in fp32; each signature checked once."""
    module = _module(kind, mode=mode, causal=causal, dtype=dtype)
    site = module.__dict__[SITE_ATTR]
    for x in (_x(dtype=dtype), _x(dtype=dtype)[:, :, 1:, :, :5]):
        out, ref = _call(module, x, causal), _diffusers(module, x, causal)
        assert out.stride() == ref.stride() and torch.equal(out, ref)
    assert site.fast == 2 and not site.fallback
    path = "channels-first" if dtype is torch.float32 else "channels-last"
    assert {key[0] for key in op.LTX_CAUSAL_CONV3D.verified} == {path}


@torch.no_grad()
def test_channels_first_path_calls_the_convolution_module(emulated_kernels):
    """fp32, no bias, a channels-last weight: the time-padded buffer (contiguous) handed to ``self.conv``'s own call,
    whose site (`conv_bias`, where the adapter swapped it) counts it; a reflect convolution pads it there."""
    for mode in ("zeros", "reflect"):
        module = _module(mode=mode, dtype=torch.float32)
        module.conv.__class__ = vae_conv.FastpathConv3d
        inner = module.conv.__dict__[SITE_ATTR] = Site("conv_bias")
        seen = []
        module.conv.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
        x = _x(dtype=torch.float32)
        assert op._guard(module, x, False) == "the convolution has hooks"
        module.conv._forward_pre_hooks.clear()
        launched = []
        real = causal_conv_pad._launch
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(causal_conv_pad, "_launch", lambda *args: launched.append(args[2:]) or real(*args))
            assert torch.equal(module(x, causal=False), _diffusers(module, x, False))
        assert launched == [([0, 0, 0, 0, 1, 1], False, True, False)]
        # the op's call, eager's, and the first-call check's (once per dtype on this path: the first mode's)
        assert inner.fast + sum(inner.fallback.values()) == (3 if mode == "zeros" else 2)
        assert set(inner.fallback) <= {"padding mode"} and (mode == "reflect") == bool(inner.fallback)
    module = _module(dtype=torch.bfloat16)
    module.conv.bias = None
    x = _x()
    assert torch.equal(module(x), _diffusers(module, x, True)) and module.__dict__[SITE_ATTR].fast == 1


@torch.no_grad()
def test_hooks_on_the_module_run_and_hooks_on_its_convolution_refuse(emulated_kernels):
    module = _module()
    x = _x()
    seen = []
    module.register_forward_hook(lambda m, i, o: seen.append("module"))
    ref = _diffusers(module, x, True)
    assert torch.equal(module(x), ref) and seen == ["module"] and module.__dict__[SITE_ATTR].fast == 1
    handle = module.conv.register_forward_hook(lambda m, i, o: seen.append("conv"))
    assert torch.equal(module(x), ref) and seen[-2:] == ["conv", "module"]
    assert dict(module.__dict__[SITE_ATTR].fallback) == {"the convolution has hooks": 1}
    handle.remove()


def _refusals(module, x):
    return op._guard(module, x, True)


@torch.no_grad()
def test_guard_refuses_what_the_op_does_not_take(monkeypatch):
    """Each refusal, with its reason (the module's forward then runs as diffusers wrote it); never an exception."""
    module, x = _module(), _x()
    assert _refusals(module, x) == "device cpu"
    plain = ltx2.LTX2VideoCausalConv3d(4, 6, 3)
    monkeypatch.delitem(op._BASES._bases, ltx2.LTX2VideoCausalConv3d, raising=False)
    assert _refusals(plain, x) == "LTX2VideoCausalConv3d is not a checked LTX causal convolution"
    assert op._guard(module, x, "yes") == "causal not a bool"
    assert _refusals(module, "x") == "x not [B, C, T, H, W]" and _refusals(module, x[0]) == "x not [B, C, T, H, W]"
    assert _refusals(module, x.double()) == "dtype float64"
    assert _refusals(module, x.half()) == "mixed dtypes"
    assert _refusals(module, x.contiguous(memory_format=torch.channels_last_3d)) == "x of a channels-last layout"
    assert _refusals(module, _x((2, 5, 3, 5, 6))) == "shape"  # another channel count: eager's error
    assert _refusals(module, x[:, :, :0]) == "shape"
    reflect = _module(mode="reflect")
    assert op._guard(reflect, _x((2, 4, 3, 1, 6)), True) == "shape"  # a reflected row of one: F.pad refuses
    assert op._guard(reflect, _x((2, 4, 3, 2, 6)), True) == "device cpu"
    monkeypatch.setattr(reflect.conv, "padding", (1, 1, 1))
    assert op._guard(reflect, x, True) == "padding reflected in time"
    monkeypatch.setattr(reflect.conv, "padding", "same")
    assert op._guard(reflect, x, True) == "padding"
    monkeypatch.setattr(reflect.conv, "padding_mode", "circular")
    assert op._guard(reflect, x, True) == "padding"
    monkeypatch.setattr(module.conv, "stride", (1, 0, 1))
    assert _refusals(module, x) == "stride, dilation or groups not positive ints"
    monkeypatch.undo()
    monkeypatch.setattr(module, "kernel_size", (0, 3, 3))
    assert _refusals(module, x) == "time kernel size"
    monkeypatch.undo()
    conv = module.conv
    module.conv = nn.Conv2d(4, 6, 3)
    assert _refusals(module, x) == "the convolution is a Conv2d, not torch's nn.Conv3d"
    module.conv = None
    assert _refusals(module, x) == "the convolution is a NoneType, not torch's nn.Conv3d"
    module.conv = conv
    handle = conv.register_forward_pre_hook(lambda m, args: None)
    assert _refusals(module, x) == "the convolution has hooks"
    handle.remove()
    monkeypatch.setattr(nn.Conv3d, "forward", lambda self, t: self._conv_forward(t, self.weight, self.bias))
    assert _refusals(module, x) == "Conv3d.forward replaced on its class"
    monkeypatch.undo()
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert _refusals(module, x) == "cudnn.benchmark on"
    monkeypatch.undo()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _refusals(module, x) == "compiling"
    monkeypatch.undo()
    with torch.enable_grad():
        assert _refusals(module, x.requires_grad_()) == "requires grad"
    ltx_module = _module("ltx")
    ltx_module.is_causal = "yes"
    assert op._guard(ltx_module, x, None) == "causal not a bool"


@torch.no_grad()
def test_a_refused_call_runs_diffusers_forward_counted(emulated_kernels, monkeypatch):
    module, x = _module(), _x()
    ref = _diffusers(module, x, True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert torch.equal(module(x), ref) and torch.equal(module(x), ref)
    site = module.__dict__[SITE_ATTR]
    assert site.fast == 0 and dict(site.fallback) == {"cudnn.benchmark on": 2}


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_ltx2_causal_none_is_non_causal_as_eager(dtype, emulated_kernels):
    """LTX-2's forward tests ``if causal:``: a ``causal=None`` argument is non-causal there (the first and last frames
    repeated (k - 1) // 2 times each), not the default ``True`` that an argument-less call of the forward would take
    (the op's own ``None`` means LTX-Video's ``self.is_causal``); the call runs fast as a non-causal one."""
    module, x = _module(dtype=dtype), _x(dtype=dtype)
    ref = _diffusers(module, x, None)
    assert torch.equal(ref, _diffusers(module, x, False)) and not torch.equal(ref, _diffusers(module, x, True))
    assert torch.equal(module(x, causal=None), ref) and torch.equal(module(x, None), ref)
    site = module.__dict__[SITE_ATTR]
    assert site.fast == 2 and not site.fallback


@torch.no_grad()
def test_a_wrong_input_raises_eagers_error_and_disables_nothing(emulated_kernels):
    module = _module()
    with pytest.raises(RuntimeError):
        module(_x((2, 5, 3, 5, 6)))
    with pytest.raises(RuntimeError):
        _module(mode="reflect")(_x((2, 4, 3, 1, 6)))
    assert op.LTX_CAUSAL_CONV3D.disabled is None


def test_signature_names_what_cudnn_picks_its_engine_by(monkeypatch):
    module, x = _module(), _x()
    key = op._signature(module, x, True)
    assert key[:2] == ("channels-last", "bfloat16") and key[2] == (2, 4, 5, 5, 6) and key[5] == (0, 1, 1)
    assert op._signature(module, x, False) == key  # (the same buffer's shape: 1 + 1 frames, not 2 + 0)
    assert op._signature(module, x[:, :, :2], True) != key
    assert op._signature(_module(mode="reflect"), x, True)[2:6] == ((2, 4, 5, 7, 8), (6, 4, 3, 3, 3), (1, 1, 1),
                                                                    (0, 0, 0))
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    assert op._signature(module, x, True) != key
    monkeypatch.undo()
    assert op._signature(module, x.float(), True) == ("channels-first", "float32")


# --- the VAEs -------------------------------------------------------------------------------------------------------


def _ltx_convs(vae) -> int:
    return sum(isinstance(m, (ltx.LTXVideoCausalConv3d, ltx2.LTX2VideoCausalConv3d)) for m in vae.modules())


def _conv_sites(vae) -> list[Site]:
    return [s for m in vae.modules() for _, s in sites_of(m) if s.op == op.LTX_CAUSAL_CONV3D.name]


def _conv_calls(vae) -> list[tuple[int, int]]:
    """Per causal convolution, (fast, fallback) of its own site and of the norm -> SiLU -> convolution chain that calls
    the convolution's kernel instead where the SiLU's result goes to it (LTX-Video's `ltx_vae_rmsnorm_conv`, a site on
    the same module), together."""
    ops = (op.LTX_CAUSAL_CONV3D.name, "ltx_vae_rmsnorm_conv")
    calls = []
    for m in vae.modules():
        sites = [s for _, s in sites_of(m) if s.op in ops]
        if any(s.op == ops[0] for s in sites):
            calls.append((sum(s.fast for s in sites), sum(s.fallback.total() for s in sites)))
    return calls


@torch.no_grad()
@pytest.mark.parametrize("kind", ["0.9.0", "0.9.5"])
def test_ltx_video_vae_every_causal_convolution_fast(kind, emulated_kernels, unpatch_after):
    """``AutoencoderKLLTXVideo`` patched: every ``LTXVideoCausalConv3d`` (the resnets' 3x3x3 and 1x1x1 shortcuts, the
    down- and upsamplers', conv_in / conv_out; causal encoder, non-causal decoder) a site, fast in the decode and the
    encode (by its own site, or by the norm -> SiLU chain joined with it), bit-identical."""
    vae = _build_ltx(kind)
    z, x = _latents(vae), _video()
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    convs = _ltx_convs(vae)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref_dec) and torch.equal(_encode(vae, x), ref_enc)
    assert len(_conv_sites(vae)) == convs
    assert all(fast > 0 and not fallback for fast, fallback in _conv_calls(vae)), fp.report(vae)
    assert {key[0] for key in op.LTX_CAUSAL_CONV3D.verified} == {"channels-last"}


@torch.no_grad()
def test_ltx_video_vae_tiled_and_sliced(emulated_kernels, unpatch_after):
    vae = _build_ltx("0.9.0")
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=32,
                      tile_sample_stride_width=32)
    vae.enable_slicing()
    z, x = _latents(vae, size=3, batch=2), _video(size=96, batch=2)
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref_dec) and torch.equal(_encode(vae, x), ref_enc)
    assert all(fast > 0 for fast, _ in _conv_calls(vae)) and not any(s.fallback for s in _conv_sites(vae)), (
        fp.report(vae))
    # (a chain refused for its tile's size, which the norm's kernels do not take, runs its convolution's call: fast)
    assert all(reason.startswith("trailing sizes") for m in vae.modules() for _, s in sites_of(m)
               if s.op == "ltx_vae_rmsnorm_conv" for reason in s.fallback), fp.report(vae)


LTX2_CONFIG = dict(latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 16, 32),
                   layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1))


def _build_ltx2(dtype=torch.bfloat16, **overrides):
    return randomize_(AutoencoderKLLTX2Video(**{**LTX2_CONFIG, **overrides}), 0).to(dtype).eval()


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("decoder_causal", [False, True], ids=["non-causal", "causal"])
@pytest.mark.parametrize("inner", ["torch", "conv_bias"])
def test_ltx2_vae_swapped_equals_unswapped_and_undoes(inner, decoder_causal, dtype, emulated_kernels):
    """``AutoencoderKLLTX2Video`` (its decoder's "reflect" convolutions, its encoder's "zeros"; the decoder causal or
    not) with `swap_ltx_causal_convs` on a `PatchState` (and the plain convolutions' `swap_convs`, or not: ``.conv``
    torch's or `FastpathConv3d`): decode and encode equal, every causal convolution a site run fast (channels-last in
    bf16, the channels-first buffer in fp32); undone, the classes and the state dict are diffusers' again."""
    vae = _build_ltx2(dtype, decoder_causal=decoder_causal)
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(1, 8, 2, 3, 3, generator=gen).to(dtype)
    x = (torch.rand(1, 3, 9, 64, 64, generator=gen) * 2 - 1).to(dtype)
    ref_dec, ref_enc = vae.decode(z).sample, vae.encode(x).latent_dist.mean
    classes = {name: type(m) for name, m in vae.named_modules()}
    weights = {k: v.clone() for k, v in vae.state_dict().items()}
    state = PatchState("lossless")
    if inner == "conv_bias":
        vae_conv.swap_convs(vae, state)
    vae_ltx_conv.swap_ltx_causal_convs(vae, state)
    assert all(type(m) is vae_ltx_conv.FastpathLTX2VideoCausalConv3d for m in vae.modules()
               if isinstance(m, ltx2.LTX2VideoCausalConv3d))
    assert torch.equal(vae.decode(z).sample, ref_dec) and torch.equal(vae.encode(x).latent_dist.mean, ref_enc)
    sites = _conv_sites(vae)
    assert len(sites) == _ltx_convs(vae) and all(s.fast > 0 and not s.fallback for s in sites)
    path = "channels-first" if dtype is torch.float32 else "channels-last"
    assert {key[0] for key in op.LTX_CAUSAL_CONV3D.verified} == {path}
    assert vae.state_dict().keys() == weights.keys()
    state.undo()
    assert {name: type(m) for name, m in vae.named_modules()} == classes
    assert not [name for name, m in vae.named_modules() if any(k.startswith("_fastpath") for k in vars(m))]
    assert torch.equal(vae.decode(z).sample, ref_dec)


@torch.no_grad()
def test_ltx2_vae_tiled(emulated_kernels):
    """LTX-2's spatial and temporal tiling call the same modules on tiles (sliced latents: strided x)."""
    vae = _build_ltx2(decoder_causal=False)
    # (the config's compression, which tiling reads: /64 in space, /16 in time; latent tiles of 2 at a stride of 2: a
    # tile of one latent column would be narrower than the reflection, which eager refuses)
    vae.enable_tiling(tile_sample_min_height=128, tile_sample_min_width=128, tile_sample_stride_height=128,
                      tile_sample_stride_width=128, tile_sample_min_num_frames=32, tile_sample_stride_num_frames=32)
    vae.use_framewise_decoding = True  # (the temporal tiles too)
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(1, 8, 4, 4, 4, generator=gen).to(torch.bfloat16)
    ref = vae.decode(z).sample
    state = PatchState("lossless")
    vae_ltx_conv.swap_ltx_causal_convs(vae, state)
    try:
        assert torch.equal(vae.decode(z).sample, ref)
        sites = _conv_sites(vae.decoder)
        assert all(s.fast > 0 and not s.fallback for s in sites), sites
        assert vae.decoder.conv_in.__dict__[SITE_ATTR].fast == 8  # (a call per tile: 2 in time x 2 x 2 in space)
    finally:
        state.undo()


def test_a_replaced_forward_is_left_unswapped(monkeypatch, fastpath_log):
    """A forward that is not diffusers 0.42.1's (here LTX-2's, replaced): its modules keep their class, one warning;
    LTX-Video's class, which the model does not hold, is not asked about."""
    original = ltx2.LTX2VideoCausalConv3d.forward
    monkeypatch.setattr(ltx2.LTX2VideoCausalConv3d, "forward", lambda self, x, causal=True: original(self, x, causal))
    vae = _build_ltx2()
    state = PatchState("lossless")
    vae_ltx_conv.swap_ltx_causal_convs(vae, state)
    assert not _conv_sites(vae) and not state.records
    assert "LTX2VideoCausalConv3d.forward is not the form" in fastpath_log.text
    assert "LTXVideoCausalConv3d.forward" not in fastpath_log.text


@torch.no_grad()
def test_a_kernel_that_differs_is_caught_on_its_first_call(monkeypatch, emulated_kernels):
    """A buffer one ulp off at one element (a repeated frame's): the first call of the signature is compared with
    diffusers' forward, the op disabled (one warning), and every output is eager's."""
    arithmetic = causal_conv_pad.pad_arithmetic

    def planted(x, cache, padding, channels_last=False, replicate_t=False, reflect_hw=False):
        out = arithmetic(x, cache, padding, channels_last, replicate_t, reflect_hw).clone()
        out.view(torch.int16)[0, 0, 0, 1, 1] += 1
        return out

    monkeypatch.setattr(causal_conv_pad, "_launch", planted)
    vae = _build_ltx2()
    z = torch.randn(1, 8, 2, 3, 3, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ref = vae.decode(z).sample
    state = PatchState("lossless")
    vae_ltx_conv.swap_ltx_causal_convs(vae, state)
    try:
        assert torch.equal(vae.decode(z).sample, ref) and torch.equal(vae.decode(z).sample, ref)
    finally:
        state.undo()
    assert "not bit-exact" in (op.LTX_CAUSAL_CONV3D.disabled or "")


# --- the NVRTC launcher ---------------------------------------------------------------------------------------------


def test_nvrtc_launcher_passes_what_bindings_cpp_passes(monkeypatch):
    """The NVRTC way's launch of csrc/causal_pad.cu with the mode flags: the kModes instantiations, the padding in
    bindings.cpp's slots (t0 without cache frames), the two flags after channels_last, the output's shape and layout;
    the raw op refuses what bindings.cpp refuses (a reflected padding not below its size, no frame to repeat)."""
    from test_nvrtc import captured_launches  # noqa: F401 - the fixture's body, called directly below

    launches = captured_launches.__wrapped__(monkeypatch)
    x = _x((2, 6, 5, 9, 40))[:, :, 1:4]  # a time slice: strided frames
    out = causal_conv_pad._nvrtc_kernel(x, None, [1, 1, 2, 2, 1, 1], True, True, True)
    kernel, key, grid, block, a = launches[-1]
    assert (kernel, key) == (causal_conv_pad._NVRTC_CL_MODES, torch.bfloat16)
    assert out.shape == (2, 6, 5, 13, 42) and out.is_contiguous(memory_format=torch.channels_last_3d)
    assert grid == (2, 1, 2 * 5 * 13) and block == (32, 8, 1)
    assert (a.a.out, a.a.x, a.a.cache, a.a.batch, a.a.channels, a.a.frames, a.a.height, a.a.width) == (
        out.data_ptr(), x.data_ptr(), None, 2, 6, 3, 9, 40)
    assert (a.a.cache_frames, a.a.pad_t0, a.a.pad_t1, a.a.pad_h0, a.a.pad_h1, a.a.pad_w0, a.a.pad_w1) == (
        0, 1, 1, 2, 2, 1, 1)
    assert (a.a.x_stride_b, a.a.x_stride_c, a.a.x_stride_t, a.a.x_stride_h) == x.stride()[:4]
    assert (a.a.dtype, a.a.channels_last, a.a.replicate_t, a.a.reflect_hw) == (1, True, True, True)
    out = causal_conv_pad._nvrtc_kernel(x.float(), None, [0, 0, 0, 0, 2, 0], False, True, False)
    kernel, key, grid, block, a = launches[-1]
    assert (kernel, key, block) == (causal_conv_pad._NVRTC_MODES, torch.float32, (256, 1, 1)) and out.is_contiguous()
    assert grid == (1, 2 * 6 * 5 * 9, 1)
    assert (a.a.channels_last, a.a.replicate_t, a.a.reflect_hw) == (False, True, False)
    causal_conv_pad._nvrtc_kernel(x, None, [1, 1, 1, 1, 2, 0])  # Wan's: the zero-border instantiation, flags off
    kernel, _, _, _, a = launches[-1]
    assert kernel is causal_conv_pad._NVRTC and (a.a.replicate_t, a.a.reflect_hw) == (False, False)

    class OnCuda(torch.Tensor):  # (the raw guard's device check, passed on a CPU)
        is_cuda = property(lambda self: True)

    on_cuda = torch.Tensor._make_subclass(OnCuda, x)
    assert causal_conv_pad._raw_guard(on_cuda, None, [8, 8, 8, 8, 1, 1], True, True, True) is None
    assert causal_conv_pad._raw_guard(on_cuda, None, [40, 0, 0, 0, 1, 1], True, True, True) is not None
    assert causal_conv_pad._raw_guard(on_cuda, None, [0, 0, 9, 0, 1, 1], True, True, True) is not None
    assert causal_conv_pad._raw_guard(on_cuda, None, [40, 0, 9, 0, 1, 1], True, False, False) is None  # zeros: any
    empty = torch.Tensor._make_subclass(OnCuda, x[:, :, :0])
    assert causal_conv_pad._raw_guard(empty, None, [0, 0, 0, 0, 2, 0], False, True, False) is not None
    assert causal_conv_pad._raw_guard(empty, None, [0, 0, 0, 0, 2, 0]) is None


# --- GPU ------------------------------------------------------------------------------------------------------------

# LTX-2's decoder (decoder_block_out_channels (256, 512, 1024), "reflect") at 768x512x121 (latents 16 frames of
# 16x24): conv_in 128 -> 1024 on the latents, a 512-channel resnet convolution after the first 2x upsampling, and
# conv_out 128 -> 48 at the last (121 frames of 128x192 patches)
LTX2_SHAPES = [(128, 1024, (1, 128, 16, 16, 24)), (512, 512, (1, 512, 31, 32, 48)), (128, 48, (1, 128, 121, 128, 192))]


@pytest.mark.gpu
@pytest.mark.parametrize("cin, cout, shape", LTX2_SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
@torch.no_grad()
def test_ltx_causal_conv_equals_the_module_at_ltx2_shapes(cin, cout, shape, causal):
    """The op (channels-last) against diffusers' forward at LTX-2's decoder shapes, bf16 and fp16 ("reflect") and the
    encoder's "zeros": the op's own first-call check passed (the site's fast count), and again here, strides
    included, the allocator's blocks of the output's size poisoned with NaN first."""
    for dtype, mode in ((torch.bfloat16, "reflect"), (torch.float16, "reflect"), (torch.bfloat16, "zeros")):
        module = _module(cin=cin, cout=cout, mode=mode, dtype=dtype, seed=2).cuda()
        site = module.__dict__[SITE_ATTR]
        gen = torch.Generator(device="cuda").manual_seed(5)
        x = torch.randn(shape, generator=gen, device="cuda").to(dtype)
        for _ in range(2):
            out_shape = (shape[0], cout, *shape[2:])
            poison = [torch.full(out_shape, float("nan"), dtype=dtype, device="cuda") for _ in range(3)]
            del poison
            out = module(x, causal=causal)
            ref = _diffusers(module, x, causal)
            assert out.stride() == ref.stride() and torch.equal(out, ref), (dtype, mode)
        assert site.fast == 2, (dict(site.fallback), op.LTX_CAUSAL_CONV3D.status)


@pytest.mark.gpu
@pytest.mark.parametrize("cin, cout, shape", LTX2_SHAPES, ids=str)
@torch.no_grad()
def test_ltx_causal_conv_fp32_channels_first_equals_the_module(cin, cout, shape):
    """fp32 (TF32 as eager's): the channels-first one buffer and the convolution module's call, at LTX-2's shapes."""
    module = _module(cin=cin, cout=cout, mode="reflect", dtype=torch.float32, seed=2).cuda()
    x = torch.randn(shape, generator=torch.Generator(device="cuda").manual_seed(5), device="cuda")
    out, ref = module(x, causal=False), _diffusers(module, x, False)
    assert out.stride() == ref.stride() and torch.equal(out, ref)
    assert module.__dict__[SITE_ATTR].fast == 1, op.LTX_CAUSAL_CONV3D.status


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [s for _, _, s in LTX2_SHAPES] + [(2, 33, 3, 7, 37), (2, 8, 1, 2, 2), (2, 40, 3, 5, 72)],
                         ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.no_grad()
def test_causal_pad_modes_through_nvrtc_equal_nvcc_and_eager(shape, dtype):
    """csrc/causal_pad.cu with the flags, through NVRTC and through the nvcc extension (where a toolkit built it),
    against eager's ``repeat`` + ``torch.concatenate`` (+ ``F.pad(mode="reflect")``), contiguous and channels-last,
    causal and not, every element written (poisoned first); x also a strided time slice; an odd shape (channels and
    columns no multiple of the 32 x 32 tile); the smallest a reflection of 1 takes (rows and columns of 2, one frame
    repeated on both sides); the wide kernel's with parts of its 32 x 64 tiles (40 channels, 72 columns), its border
    columns reflected or zero."""
    from test_nvrtc import both_ways

    nvcc = both_ways.__wrapped__()
    gen = torch.Generator(device="cuda").manual_seed(7)
    b, c, t, h, w = shape
    x = (torch.randn(b, c, t + 2, h, w, generator=gen, device="cuda") * 3).to(dtype)
    for view in (x[:, :, 1:1 + t], x[:, :, :t].contiguous()):
        for mode in ("reflect", "zeros"):
            module = _module(cin=c, cout=4, mode=mode, dtype=dtype).cuda()
            for causal in (False, True):
                ref = _eager_buffer(module, view, causal)
                padding, _, reflect = op._plan(module, causal)
                for cl in (False, True):
                    ways = [causal_conv_pad._nvrtc_kernel] + (
                        [torch.ops.diffusers_fastpath._causal_pad_cuda] if nvcc else [])
                    for way in ways:
                        torch.full_like(ref, float("nan"))
                        out = way(view, None, padding, cl, True, reflect)
                        assert out.shape == ref.shape and torch.equal(bits(out), bits(ref)), (way, mode, causal, cl)
                        layout = torch.channels_last_3d if cl else torch.contiguous_format
                        assert out.is_contiguous(memory_format=layout)


@pytest.mark.gpu
@torch.no_grad()
def test_ltx2_vae_decode_md5_identical_every_causal_convolution_fast():
    """LTX-2's VAE decoder (the published one: channels (256, 512, 1024), 5 resnets a block, "reflect"; random
    weights; the encoder made tiny, it is not run) decoding a crop (latents 3 frames of 4x4, bf16): the swapped causal
    convolutions bit-identical to diffusers', every one fast."""
    vae = AutoencoderKLLTX2Video(decoder_causal=False, block_out_channels=(8, 8, 8, 8),
                                 layers_per_block=(1, 1, 1, 1, 1))
    vae = randomize_(vae.to("cuda"), 0).to(torch.bfloat16).eval()
    z = torch.randn(1, 128, 3, 4, 4, generator=torch.Generator(device="cuda").manual_seed(0), device="cuda")
    z = z.to(torch.bfloat16)
    ref = vae.decode(z).sample
    state = PatchState("lossless")
    vae_ltx_conv.swap_ltx_causal_convs(vae, state)
    try:
        out = vae.decode(z).sample
        sites = _conv_sites(vae.decoder)
        assert len(sites) == _ltx_convs(vae.decoder) and all(s.fast > 0 and not s.fallback for s in sites), [
            dict(s.fallback) for s in sites if s.fallback]
    finally:
        state.undo()
    assert torch.equal(out, ref) and _md5(out) == _md5(ref)


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.float().cpu().numpy().tobytes()).hexdigest()
