"""`ltx_upsampler3d` (ops/ltx_upsampler.py, models/vae_ltx_upsampler.py; csrc/conv_bias.cu's bias_depth_to_space):
LTX-2's and LTX-Video 0.9.5's residual upsamplers written in one pass from their convolution's channels-last output.

On CPU: the kernel's formula (output channel c' at frame 2t + dt - 1 reads the convolution's channel 8c' + j and the
input's (c' mod C/8) * 8 + j) and the tests' emulation are diffusers' forward; the guard refuses what the kernel does
not take, never raising; the raw op's guard refuses what bindings_vae.cpp refuses; the NVRTC launcher passes what
bindings_vae.cpp passes. Under the emulated kernels: the tiny LTX-2 VAE's decode (plain and tiled) and LTX-Video
0.9.5's equal unpatched with each upsampler fast once per call; the upsamplers of other forms (a spatial or temporal
stride, no residual, another upscale factor) left as they are; a hook on an upsampler's convolution, or a form changed
after patching, runs the forward as written (counted); a kernel one value off or failing is caught (one warning) and
the decode stays exact; unpatch restores the classes.
On the GPU (marked): the kernel, both ways it launches, against diffusers' forward on the convolution's tensor (aten's
bias add, the moves, aten's add) at the LTX-2 decoder's three upsampler shapes (768x512x121) and odd ones, bf16 and
fp16, the output's blocks poisoned with NaN first; the op (its first-call check included) on real modules. (The
full-size decode, its three upsamplers fast: test_ltx_bias_norm_conv.py's thrice-decoded test.)
"""

from __future__ import annotations

import importlib

import pytest
import torch
from diffusers import AutoencoderKLLTX2Video, AutoencoderKLLTXVideo
from diffusers.models.autoencoders.autoencoder_kl_ltx import LTXVideoUpsampler3d
from diffusers.models.autoencoders.autoencoder_kl_ltx2 import LTX2VideoUpsampler3d
from torch import nn

import diffusers_fastpath as fp
from diffusers_fastpath._state import SITE_ATTR
from diffusers_fastpath.bench.levels.vae import VAE_MODELS
from diffusers_fastpath.models.vae_ltx_upsampler import FastpathLTX2VideoUpsampler3d
from diffusers_fastpath.ops._policy import Site, tensors_equal
from diffusers_fastpath.testing._common import randomize_

ups = importlib.import_module("diffusers_fastpath.ops.ltx_upsampler")  # (ops binds the names to the ops)
conv_bias = importlib.import_module("diffusers_fastpath.ops.conv_bias")
_TINY = VAE_MODELS["ltx2-tiny"][1]


class _Given(nn.Module):
    """A convolution stand-in that returns a given tensor: diffusers' forward around it is eager's tail."""

    def __init__(self, h):
        super().__init__()
        self.h = h

    def forward(self, x, causal=True):
        return self.h


def eager_tail(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``LTX2VideoUpsampler3d.forward`` (stride (2, 2, 2), residual, upscale 2) of x with its convolution's
    result `h`: the reshape, permute, flatten, repeat and slice of x, of h, and the add, as written there."""
    module = LTX2VideoUpsampler3d(8, stride=(2, 2, 2), residual=True, upscale_factor=2)
    module.conv = _Given(h)
    return LTX2VideoUpsampler3d.forward(module, x)


def _formula(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The kernel's index formula, element by element: out[n, c, 2t + dt - 1, 2h + dh, 2w + dw] = h[n, 8c + j, t, h,
    w] + x[n, (c % (C / 8)) * 8 + j, t, h, w] (j = 4 dt + 2 dh + dw), each a T tensor, aten's add."""
    b, c8, frames, height, width = h.shape
    groups = x.shape[1] // 8
    out = torch.empty(b, c8 // 8, 2 * frames, 2 * height, 2 * width, dtype=h.dtype)
    res = torch.empty_like(out)
    for c in range(c8 // 8):
        for dt in range(2):
            for dh in range(2):
                for dw in range(2):
                    j = 4 * dt + 2 * dh + dw
                    out[:, c, dt::2, dh::2, dw::2] = h[:, 8 * c + j]
                    res[:, c, dt::2, dh::2, dw::2] = x[:, (c % groups) * 8 + j]
    return out[:, :, 1:] + res[:, :, 1:]


def _x(shape, dtype=torch.bfloat16, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _cl(t):
    return t.contiguous(memory_format=torch.channels_last_3d)


def test_the_kernels_formula_and_the_emulation_are_diffusers_forward():
    """The index formula the kernel computes (one frame, several groups of residual channels, two batches) and the
    emulation's torch form are diffusers' forward on the same convolution result, bit for bit."""
    for shape in ((2, 16, 3, 2, 5), (1, 24, 1, 3, 2), (1, 8, 2, 1, 1)):
        x = _x(shape, seed=sum(shape))
        h = _x((shape[0], 4 * shape[1], *shape[2:]), seed=1)
        bias = _x((4 * shape[1],), seed=2)
        ref = eager_tail((h + bias.view(1, -1, 1, 1, 1)).contiguous(), x)
        assert ref.is_contiguous()
        assert ref.shape == (shape[0], shape[1] // 2, 2 * shape[2] - 1, *(2 * s for s in shape[3:]))
        assert torch.equal(_formula((h + bias.view(1, -1, 1, 1, 1)).contiguous(), x), ref)
        got = conv_bias.depth_to_space_residual_arithmetic(_cl(h), bias, x)
        assert got.is_contiguous() and torch.equal(got, ref)


def _tiny(dtype=torch.bfloat16, **config):
    return randomize_(AutoencoderKLLTX2Video(**{**_TINY, **config}), 0).to(dtype).eval()


@torch.no_grad()
def test_the_guard_refuses_what_the_kernel_does_not_take(unpatch_after):
    """Refused with the reason, never raised: a module of no checked class, another stride, no residual, another
    upscale factor, x of another dtype than the weights, x not contiguous (a frame sliced off), a hook on the
    convolution, no bool ``causal`` for an LTX-2 convolution, channels eager's add would broadcast, fp32 (the
    convolution's channels-first path); on a CPU the device last."""
    vae, fp32 = _tiny(), _tiny(torch.float32)
    unpatch_after(fp.patch(vae))
    unpatch_after(fp.patch(fp32))
    module = vae.decoder.up_blocks[0].upsamplers[0]
    assert type(module) is FastpathLTX2VideoUpsampler3d
    x = _x((1, module.conv.conv.in_channels, 3, 4, 5))
    guard = ups.LTX_UPSAMPLER3D.guard
    assert guard(module, x, True) == guard(module, x, False) == "device cpu"
    assert guard(nn.Identity(), x, True) == "Identity is not a checked LTX upsampler"
    for name, value, why in (("stride", (1, 2, 2), "stride not (2, 2, 2)"), ("residual", False, "not residual"),
                             ("upscale_factor", 1, "upscale factor not 2")):
        old = getattr(module, name)
        setattr(module, name, value)
        try:
            assert guard(module, x, True) == why
        finally:
            setattr(module, name, old)
    assert guard(module, x.half(), True) == "mixed dtypes"
    assert guard(module, x[:, :, 1:], True) == "x not contiguous"
    handle = module.conv.register_forward_hook(lambda *args: None)
    try:
        assert guard(module, x, True) == "the convolution has hooks"
    finally:
        handle.remove()
    assert guard(module, x, None) == "causal not a bool"  # (an LTX-2 convolution has no is_causal to read)
    # diffusers' class (checked by the patch above), its convolution giving the output half the residual's channels
    wide = randomize_(LTX2VideoUpsampler3d(16, out_channels=8, stride=(2, 2, 2), residual=True, upscale_factor=2), 0)
    assert guard(wide.to(torch.bfloat16), _x((1, 16, 2, 3, 3)), True) == "channels"
    module = fp32.decoder.up_blocks[0].upsamplers[0]
    assert guard(module, _x((1, module.conv.conv.in_channels, 2, 3, 3), torch.float32), True) == (
        "the convolution's channels-first path (fp32, no bias, a channels-last weight)")


def test_raw_op_guard_refuses_what_bindings_cpp_refuses():
    raw = _cl(_x((1, 64, 3, 4, 5)))
    bias = _x((64,))
    res = _x((1, 16, 3, 4, 5))
    guard = conv_bias._raw_depth_to_space_guard
    assert guard(raw, bias, res) == "shape, dtype or layout"  # (a CPU tensor: bindings_vae.cpp's is_cuda)

    class OnCuda(torch.Tensor):  # (the device check passed on a CPU, as test_conv_bias_residual's raw-guard test does)
        is_cuda = property(lambda self: True)

    def cuda(t):
        return torch.Tensor._make_subclass(OnCuda, t)

    assert guard(cuda(raw), cuda(bias), res) is None
    assert guard(cuda(raw.contiguous()), cuda(bias), res) == "shape, dtype or layout"
    assert guard(cuda(raw.float()), cuda(bias.float()), res.float()) == "shape, dtype or layout"
    assert guard(cuda(_cl(_x((1, 60, 3, 4, 5)))), cuda(_x((60,))), res) == "shape, dtype or layout"
    assert guard(cuda(raw), cuda(bias[:32]), res) == "shape, dtype or layout"
    assert guard(cuda(raw), cuda(bias), res[:, :12]) == "residual"  # (channels not 8 G)
    assert guard(cuda(raw), cuda(bias), _x((1, 24, 3, 4, 5))) == "residual"  # (3 groups do not divide 8 channels)
    assert guard(cuda(raw), cuda(bias), res[:, :, :2].contiguous()) == "residual"
    assert guard(cuda(raw), cuda(bias), res.half()) == "residual"
    assert guard(cuda(raw), cuda(bias), _cl(res)) == "residual"
    assert guard(cuda(raw), cuda(bias), _x((1, 64, 3, 4, 5))) is None  # (one group a channel: taken)


def test_nvrtc_launcher_passes_what_bindings_cpp_passes(monkeypatch):
    """The NVRTC launch, field by field as bindings_vae.cpp's conv_bias_depth_to_space fills them, its key and grid
    (the column tiles times the channel tiles; the rows)."""
    from test_nvrtc import captured_launches  # noqa: F401 - the fixture's body, called directly below

    launches = captured_launches.__wrapped__(monkeypatch)
    raw = _cl(_x((2, 96, 3, 5, 40)))
    bias = _x((96,), seed=1)
    res = _x((2, 24, 3, 5, 40), seed=2)
    out = conv_bias._nvrtc_depth_to_space(raw, bias, res)
    kernel, key, grid, block, a = launches[-1]
    assert (kernel, key, grid, block) == (conv_bias._NVRTC_D2S, torch.bfloat16, (2 * 2, 30, 1), (32, 8, 1))
    assert out.shape == (2, 12, 5, 10, 80) and out.is_contiguous() and out.dtype is raw.dtype
    assert (a.a.out, a.a.x, a.a.bias, a.a.residual) == (out.data_ptr(), raw.data_ptr(), bias.data_ptr(), res.data_ptr())
    assert (a.a.batch, a.a.channels, a.a.groups, a.a.frames, a.a.height, a.a.width, a.a.dtype) == (
        2, 12, 3, 3, 5, 40, 1)
    conv_bias._nvrtc_depth_to_space(raw.half(), bias.half(), res.half())
    assert launches[-1][1] == torch.float16 and launches[-1][4].a.dtype == 0


def test_the_kernel_is_declared_for_the_half_dtypes():
    """bias_depth_to_space_kernel<T> for bf16 and fp16 (what the .cu's host launcher instantiates; test_nvrtc.py
    compares them with nvcc's cubin)."""
    assert conv_bias._NVRTC_D2S.names == {
        torch.bfloat16: "diffusers_fastpath::bias_depth_to_space_kernel<__nv_bfloat16>",
        torch.float16: "diffusers_fastpath::bias_depth_to_space_kernel<__half>"}


# --- the VAEs, under the emulated kernels ---------------------------------------------------------------------------


def _latents(vae, size=2, batch=1, frames=2):
    gen = torch.Generator().manual_seed(3)
    return torch.randn(batch, vae.config.latent_channels, frames, size, size, generator=gen).to(torch.bfloat16)


def _sites(vae) -> dict:
    """Per upsampler (its path), its `ltx_upsampler3d` site."""
    return {r.site: r for r in fp.report(vae).sites if r.op == "ltx_upsampler3d"}


def _upsamplers(vae) -> list[str]:
    return [n for n, m in vae.named_modules() if isinstance(m, (LTXVideoUpsampler3d, LTX2VideoUpsampler3d))]


@torch.no_grad()
def test_ltx2_decode_equals_unpatched_each_upsampler_fast(emulated_kernels, unpatch_after):
    """The tiny LTX-2 VAE (the published structure): its three upsamplers swapped, each with a site; two decodes and
    an encode equal unpatched, each upsampler fast once per decode, never falling back; its convolution's own site
    counts only the first decode's check (the module's eager forward calls it)."""
    vae = _tiny()
    z = _latents(vae)
    video = (torch.rand(1, 3, 9, 64, 64, generator=torch.Generator().manual_seed(4)) * 2 - 1).to(torch.bfloat16)
    ref, ref_enc = vae.decode(z).sample, vae.encode(video).latent_dist.mean
    paths = _upsamplers(vae)
    assert len(paths) == 3 and all(p.startswith("decoder.") for p in paths)
    unpatch_after(fp.patch(vae))
    assert all(type(vae.get_submodule(p)) is FastpathLTX2VideoUpsampler3d for p in paths)
    for decodes in (1, 2):
        assert torch.equal(vae.decode(z).sample, ref)
        sites = _sites(vae)
        assert sorted(sites) == sorted(paths)
        assert all((r.fast, r.fallback) == (decodes, 0) for r in sites.values()), str(fp.report(vae))
    convs = {r.site: r for r in fp.report(vae).sites if r.op == "ltx_causal_conv3d"}
    assert all((convs[f"{p}.conv"].fast, convs[f"{p}.conv"].fallback) == (1, 0) for p in paths), str(fp.report(vae))
    assert torch.equal(vae.encode(video).latent_dist.mean, ref_enc)


@torch.no_grad()
def test_tiled_decode_equals_unpatched(emulated_kernels, unpatch_after):
    """Tiles of two latents (and two batches, sliced): each upsampler fast on every tile, never falling back."""
    vae = _tiny()
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=64,
                      tile_sample_stride_width=64)
    vae.enable_slicing()
    z = _latents(vae, size=4, batch=2)
    ref = vae.decode(z).sample
    unpatch_after(fp.patch(vae))
    assert torch.equal(vae.decode(z).sample, ref)
    sites = _sites(vae)
    assert len(sites) == 3 and all((r.fast, r.fallback) == (8, 0) for r in sites.values()), str(fp.report(vae))


@torch.no_grad()
def test_ltx_video_095_decode_equals_unpatched_each_upsampler_fast(emulated_kernels, unpatch_after):
    """LTX-Video 0.9.5's form (residual upsamplers, the timestep-conditioned decoder): the same op, ``self.is_causal``
    read for the convolution; 0.9.0's upsamplers (no residual) keep their class and get no site."""
    from test_vae_ltx import CONFIGS

    vae = randomize_(AutoencoderKLLTXVideo(**CONFIGS["0.9.5"]), 0).to(torch.bfloat16).eval()
    z, temb = _latents(vae), torch.tensor([0.05])
    ref = vae.decode(z, temb).sample
    unpatch_after(fp.patch(vae))
    assert torch.equal(vae.decode(z, temb).sample, ref)
    sites = _sites(vae)
    assert sorted(sites) == sorted(_upsamplers(vae)) and len(sites) == 3
    assert all((r.fast, r.fallback) == (1, 0) for r in sites.values()), str(fp.report(vae))
    old = randomize_(AutoencoderKLLTXVideo(**CONFIGS["0.9.0"]), 0).to(torch.bfloat16).eval()
    unpatch_after(fp.patch(old))
    assert _upsamplers(old) and not _sites(old)
    assert all(type(old.get_submodule(p)) is LTXVideoUpsampler3d for p in _upsamplers(old))


@torch.no_grad()
def test_upsamplers_of_other_forms_run_as_written(emulated_kernels, unpatch_after):
    """A spatial (1, 2, 2) and a temporal (2, 1, 1) upsampler, one without residual, one of upscale factor 1: left as
    they are (their class, no site), the decode equal; only the (2, 2, 2) residual upscale-2 one fast."""
    for config in (dict(upsample_type=("spatial", "temporal", "spatiotemporal")),
                   dict(upsample_residual=(True, False, True), upsample_factor=(1, 2, 2))):
        vae = _tiny(**config)
        z = _latents(vae)
        ref = vae.decode(z).sample
        unpatch_after(fp.patch(vae))
        assert torch.equal(vae.decode(z).sample, ref)
        taken = [p for p in _upsamplers(vae) if type(vae.get_submodule(p)) is FastpathLTX2VideoUpsampler3d]
        others = [p for p in _upsamplers(vae) if type(vae.get_submodule(p)) is LTX2VideoUpsampler3d]
        assert len(taken) == 1 and len(others) == 2, config
        assert sorted(_sites(vae)) == taken and _sites(vae)[taken[0]].fast == 1


@torch.no_grad()
def test_a_hooked_convolution_or_a_changed_form_runs_the_forward_as_written(emulated_kernels, unpatch_after):
    """A forward hook on an upsampler's convolution: the forward runs as written (the hook sees the convolution's
    output), counted "the convolution has hooks"; removed, the op runs again. A swapped upsampler made non-residual
    after patching (in the eager model too): refused per call, "not residual", its forward as written."""
    vae, eager = _tiny(), _tiny()
    z = _latents(vae)
    ref = eager.decode(z).sample
    unpatch_after(fp.patch(vae))
    module = vae.decoder.up_blocks[1].upsamplers[0]
    seen = []
    handle = module.conv.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        assert torch.equal(vae.decode(z).sample, ref)
    finally:
        handle.remove()
    site = module.__dict__[SITE_ATTR]
    assert len(seen) == 1 and (site.fast, dict(site.fallback)) == (0, {"the convolution has hooks": 1})
    assert torch.equal(vae.decode(z).sample, ref) and site.fast == 1
    for m in (module, eager.decoder.up_blocks[1].upsamplers[0]):
        m.residual = False
    ref = eager.decode(z).sample
    assert torch.equal(vae.decode(z).sample, ref)
    assert (site.fast, dict(site.fallback)) == (1, {"the convolution has hooks": 1, "not residual": 1})


@pytest.mark.parametrize("failure", ["one value off", "raises"])
@torch.no_grad()
def test_a_kernel_that_differs_or_fails_falls_back_exactly(failure, emulated_kernels, monkeypatch, fastpath_log,
                                                            unpatch_after):
    """A kernel one value off is caught by the first call's check (the op disabled, one warning); one that raises
    disables the op likewise; the decodes stay exact, the sites count the fallbacks."""
    launch = conv_bias._depth_to_space_op

    def off(raw, bias, residual):
        out = launch(raw, bias, residual)
        out.view(-1)[7] = out.view(-1)[7] * 2 + 1
        return out

    def raises(raw, bias, residual):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(conv_bias, "_depth_to_space_op", off if failure == "one value off" else raises)
    vae = _tiny()
    z = _latents(vae)
    ref = vae.decode(z).sample
    unpatch_after(fp.patch(vae))
    for _ in range(2):
        assert torch.equal(vae.decode(z).sample, ref)
    assert ("not bit-exact" if failure == "one value off" else "launch failed") in ups.LTX_UPSAMPLER3D.disabled
    sites = _sites(vae)
    assert all(r.fast == 0 and r.fallback == 2 for r in sites.values()), str(fp.report(vae))
    assert sum("disabling the fused op 'ltx_upsampler3d'" in r.getMessage() for r in fastpath_log.records) == 1


def test_unpatch_restores_the_upsamplers():
    vae = _tiny()
    fp.patch(vae)
    assert all(type(vae.get_submodule(p)) is FastpathLTX2VideoUpsampler3d for p in _upsamplers(vae))
    fp.unpatch(vae)
    assert all(type(vae.get_submodule(p)) is LTX2VideoUpsampler3d for p in _upsamplers(vae))
    assert not any(k.startswith("_fastpath") for m in vae.modules() for k in m.__dict__)


# --- GPU ----------------------------------------------------------------------------------------------------------

# the LTX-2 decoder's three upsamplers at 768x512x121 (latents [1, 128, 16, 16, 24]): their input x [B, C, T, H, W]
# (the convolution's output 4 C channels; the block's output [B, C / 2, 2 T - 1, 2 H, 2 W])
DECODER_SHAPES = [(1, 1024, 16, 16, 24), (1, 512, 31, 32, 48), (1, 256, 61, 64, 96)]
# one frame (only the odd frame written), columns of no whole tile (33: two, the second of one), one row, two and three
# batches, one residual group (8 channels), several (24: three)
ODD_SHAPES = [(2, 16, 1, 3, 5), (1, 24, 3, 5, 33), (3, 8, 2, 1, 2), (1, 64, 2, 2, 65), (2, 8, 1, 1, 1)]


def _gpu_inputs(shape, dtype, gen, device="cuda"):
    """cuDNN's channels-last output (4 C channels), its bias and the upsampler's input, of eager's magnitudes;
    special positions: an exact zero sum (raw + b = 0), h = -x exactly, infinities and NaN."""
    b, c, *spatial = shape
    memory = (torch.randn(b, *spatial, 4 * c, generator=gen) * 4).to(device, dtype)
    raw = memory.movedim(-1, 1)
    bias = torch.randn(4 * c, generator=gen).to(device, dtype)
    x = (torch.randn(shape, generator=gen) * 4).to(device, dtype)
    flat = memory.view(-1)
    flat[:3] = -bias[:3]  # (position 0's channels 0-2)
    h = (raw + bias.view(1, -1, 1, 1, 1)).contiguous()
    x[:, 4, 0, 0, 0] = -h[:, 4, 0, 0, 0]  # (output channel 0 at frame 0, row 0, column 0: h's and x's channel 4)
    if x.numel() > 64:
        flat[20], flat[21], flat[22] = float("inf"), float("-inf"), float("nan")
        x.view(-1)[40], x.view(-1)[41] = float("nan"), float("inf")
    return raw, bias, x


def test_the_gpu_tests_inputs_are_what_they_say():
    """`_gpu_inputs` (on a CPU): raw laid out channels-last, the exact zero sums where it says (one in the output),
    the special values; rounding once gives other words than eager's two roundings at the larger shapes (what lets
    the GPU test fail a kernel that rounds once); the emulation equals eager's tail on them (NaN included)."""
    for shape in ODD_SHAPES:
        for dtype in (torch.bfloat16, torch.float16):
            raw, bias, x = _gpu_inputs(shape, dtype, torch.Generator().manual_seed(sum(shape)), "cpu")
            assert raw.is_contiguous(memory_format=torch.channels_last_3d) and x.is_contiguous()
            h = (raw + bias.view(1, -1, 1, 1, 1)).contiguous()
            assert (h[0, :3, 0, 0, 0] == 0).all()
            ref = eager_tail(h, x)
            assert (ref[:, 0, 0, 0, 0] == 0).all()
            assert tensors_equal(conv_bias.depth_to_space_residual_arithmetic(raw, bias, x), ref)
            if x.numel() > 64:
                assert raw.isnan().sum() == 1 and raw.isinf().sum() == 2 and x.isnan().sum() == 1
            if raw.numel() > 4096:
                once = eager_tail(raw.float() + bias.float().view(1, -1, 1, 1, 1), x.float()).to(dtype)
                assert not tensors_equal(once, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", DECODER_SHAPES + ODD_SHAPES, ids=str)
@torch.no_grad()
def test_kernel_equals_diffusers_forward_on_the_convolutions_tensor(shape, dtype):
    """csrc/conv_bias.cu's bias_depth_to_space against diffusers' forward on the convolution's tensor (aten's
    ``raw + bias`` made contiguous, then the forward's moves and add), bit for bit (`tensors_equal`: NaN included),
    both ways it launches (NVRTC, and the nvcc build's raw op where that loads), every element written (the output's
    blocks poisoned with NaN first); the inputs hold positions where rounding once gives another word."""
    from test_nvrtc import both_ways

    nvcc = both_ways.__wrapped__()
    gen = torch.Generator().manual_seed(sum(shape))
    raw, bias, x = _gpu_inputs(shape, dtype, gen)
    h = (raw + bias.view(1, -1, 1, 1, 1)).contiguous()
    ref = eager_tail(h, x)
    if raw.numel() > 4096:
        once = eager_tail(raw.float() + bias.float().view(1, -1, 1, 1, 1), x.float()).to(dtype)
        assert not tensors_equal(once, ref)  # (the inputs tell one rounding from two)
    ways = [conv_bias._nvrtc_depth_to_space] + ([torch.ops.diffusers_fastpath._conv_bias_depth_to_space_cuda]
                                                if nvcc else [])
    for way in ways:
        torch.full_like(ref, float("nan"))  # (freed: the next block of this size the kernel's output)
        out = way(raw, bias, x)
        assert out.is_contiguous() and out.stride() == ref.stride() and tensors_equal(out, ref), (shape, way)


# (the decoder's three, reflected, causal and not; zero spatial padding (LTX-Video's form) at an odd shape)
OP_CASES = [(DECODER_SHAPES[0], "reflect", True), (DECODER_SHAPES[1], "reflect", False),
            (DECODER_SHAPES[2], "reflect", True), ((2, 24, 3, 5, 33), "zeros", True)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,mode,causal", OP_CASES, ids=str)
@torch.no_grad()
def test_op_equals_the_modules_eager_forward(shape, mode, causal, dtype):
    """The op (its guard and first-call check) on a real ``LTX2VideoUpsampler3d`` with random weights, against the
    module's eager forward (diffusers' code, the convolution unpatched), bit for bit, the output poisoned first."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from diffusers.models.autoencoders.autoencoder_kl_ltx2 import LTX2VideoCausalConv3d

    from diffusers_fastpath.models.vae import checked_forwards
    from diffusers_fastpath.models.vae_ltx_conv import CONV_DIGESTS
    from diffusers_fastpath.models.vae_ltx_upsampler import UPSAMPLER_DIGESTS
    from diffusers_fastpath.ops.ltx_causal_conv import add_conv_class

    checked_forwards([LTX2VideoCausalConv3d], CONV_DIGESTS, register=add_conv_class)
    checked_forwards([LTX2VideoUpsampler3d], UPSAMPLER_DIGESTS, register=ups.add_upsampler_class)
    module = LTX2VideoUpsampler3d(shape[1], stride=(2, 2, 2), residual=True, upscale_factor=2,
                                  spatial_padding_mode=mode)
    module = randomize_(module, sum(shape) % 1000).to("cuda", dtype).eval()
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 3).to("cuda", dtype)
    ref = module(x, causal=causal)
    torch.full_like(ref, float("nan"))
    site = Site(ups.LTX_UPSAMPLER3D.name)
    out = ups.LTX_UPSAMPLER3D(site, module, x, causal)
    assert site.fast == 1, (dict(site.fallback), ups.LTX_UPSAMPLER3D.disabled)
    assert out.stride() == ref.stride() and tensors_equal(out, ref)
    assert ref.isfinite().all()
