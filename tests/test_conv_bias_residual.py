"""`conv_bias_residual` (ops/conv_bias_residual.py; csrc/conv_bias.cu's bias_contiguous_kernel, kResidual): a causal
convolution's channels-last result without its bias, read by the residual add after it (LTX-2's resnets'
``hidden_states + inputs`` after ``conv2``).

On CPU: the guard refuses what the kernel does not take, with the reason, never raising; the raw op's guard refuses
what bindings_vae.cpp refuses; the NVRTC launcher passes what bindings_vae.cpp passes (the residual pointer, the
variant), the plain bias_contiguous launch a null one. The wiring through a whole VAE (the rewrite, the sites, the
refusals, the first-call check) is in test_vae_ltx2.py.
On the GPU (marked): the kernel, both ways it launches, against eager's two ops (aten's bias add, then aten's add of
the residual: two roundings, which the inputs are chosen to tell from one) at the LTX-2 decoder's conv2 outputs and
at odd shapes, bf16, fp16 and fp32, the output's blocks poisoned with NaN first; the op (its first-call check
included) at the same shapes; a refused residual's sum and layout. (The full-size decode, three times with every
decoder resnet's add fast: test_ltx_bias_norm_conv.py.)
"""

from __future__ import annotations

import importlib

import pytest
import torch

from diffusers_fastpath.ops._policy import Site, tensors_equal
from diffusers_fastpath.ops.causal_conv_cl import PendingBias

cbr = importlib.import_module("diffusers_fastpath.ops.conv_bias_residual")  # (ops binds the names to the ops)
conv_bias = importlib.import_module("diffusers_fastpath.ops.conv_bias")


def _x(shape, dtype, scale=3.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _cl(x):
    return x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


def _time_major(x):
    """x's values laid out as [B, T, C, H, W] (what Wan's upsamplers return)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@torch.no_grad()
def test_the_guard_refuses_what_the_kernel_does_not_take():
    """Refused with the reason, never raised: no `PendingBias`, fp32 (the convolutions' channels-first path), raw
    contiguous, a bias of another dtype or size, a residual that is no plain tensor (a number; a subclass, whose own
    ``__add__`` eager calls), of another dtype (eager promotes), shape (eager broadcasts) or layout (eager's sum then
    is not what the kernel writes: channels-last), one that needs grad; on a CPU the device last. A time-major
    residual (Wan's upsamplers' layout) is taken."""
    raw = _cl(_x((1, 16, 3, 4, 5), torch.bfloat16))
    bias = _x((16,), torch.bfloat16, seed=1)
    res = _x((1, 16, 3, 4, 5), torch.bfloat16, seed=2)
    guard = cbr.CONV_BIAS_RESIDUAL.guard

    class Sub(torch.Tensor):
        pass

    assert guard(raw, res) == "x not a convolution's pending result"
    assert guard(PendingBias(raw.float(), bias.float()), res.float()) == "dtype float32"
    assert guard(PendingBias(raw.contiguous(), bias), res) == "x not channels-last [B, C, *]"
    assert guard(PendingBias(raw, bias.half()), res) == "bias"
    assert guard(PendingBias(raw, bias[:8]), res) == "bias"
    assert guard(PendingBias(raw, bias), 1.0) == "residual not a tensor"
    assert guard(PendingBias(raw, bias), res.as_subclass(Sub)) == "residual not a tensor"
    assert guard(PendingBias(raw, bias), res.half()) == "mixed dtypes"
    assert guard(PendingBias(raw, bias), res[:, :, :1]) == "residual's shape (broadcast)"
    assert guard(PendingBias(raw, bias), _cl(res)) == "residual not contiguous"
    assert guard(PendingBias(raw, bias), _time_major(res)) == "device cpu"  # (taken but for the device)
    with torch.enable_grad():
        assert guard(PendingBias(raw, bias), res.clone().requires_grad_()) == "requires grad"
    assert guard(PendingBias(raw, bias), res) == "device cpu"
    assert guard(PendingBias(_cl(_x((2, 16, 5, 7), torch.float16)), bias.half()),
                 _x((2, 16, 5, 7), torch.float16)) == "device cpu"  # (a 4-D one: taken but for the device)
    site = Site(cbr.CONV_BIAS_RESIDUAL.name)
    out = cbr.conv_bias_residual(PendingBias(raw, bias), res, site)  # (refused: the eager chain)
    assert dict(site.fallback) == {"device cpu": 1}
    assert out.is_contiguous() and torch.equal(out, (raw + bias.view(1, -1, 1, 1, 1)).contiguous() + res)


def test_raw_op_guard_refuses_what_bindings_cpp_refuses():
    raw = _cl(_x((1, 16, 3, 4, 5), torch.bfloat16))
    bias = _x((16,), torch.bfloat16)
    res = _x((1, 16, 3, 4, 5), torch.bfloat16)
    guard = conv_bias._raw_residual_guard
    assert guard(raw, bias, res) == "shape, dtype or layout"  # (a CPU tensor: bindings_vae.cpp's is_cuda)
    assert guard(raw.contiguous(), bias, res) == "shape, dtype or layout"

    class OnCuda(torch.Tensor):  # (the device check passed on a CPU, as test_vae_wan's raw-guard test does)
        is_cuda = property(lambda self: True)

    def cuda(t):
        return torch.Tensor._make_subclass(OnCuda, t)

    assert guard(cuda(raw), cuda(bias), res) is None
    assert guard(cuda(raw), cuda(bias), _time_major(res)) is None
    assert guard(cuda(raw), cuda(bias), res[:, :8]) == "residual"
    assert guard(cuda(raw), cuda(bias), res.half()) == "residual"
    assert guard(cuda(raw), cuda(bias), _cl(res)) == "residual"


def test_nvrtc_launcher_passes_what_bindings_cpp_passes(monkeypatch):
    """The kResidual variant's NVRTC launch, field by field as bindings_vae.cpp's conv_bias_residual_contiguous fills
    them (the residual's pointer, the dims from x), the variant's key, the tile grid; bias_contiguous's own launch the
    other variant with a null residual."""
    from test_nvrtc import captured_launches  # noqa: F401 - the fixture's body, called directly below

    launches = captured_launches.__wrapped__(monkeypatch)
    raw = _cl(_x((2, 40, 3, 5, 7), torch.bfloat16))
    bias = _x((40,), torch.bfloat16, seed=1)
    res = _x((2, 40, 3, 5, 7), torch.bfloat16, seed=2)
    out = conv_bias._nvrtc_contiguous(raw, bias, res)
    kernel, key, grid, block, a = launches[-1]
    assert (kernel, key, grid, block) == (conv_bias._NVRTC_CONTIGUOUS, (torch.bfloat16, True), (4, 2, 2), (32, 8, 1))
    assert out.shape == raw.shape and out.is_contiguous()
    assert (a.a.out, a.a.x, a.a.bias, a.a.residual, a.a.batch, a.a.spatial, a.a.channels, a.a.residual_plane,
            a.a.dtype) == (out.data_ptr(), raw.data_ptr(), bias.data_ptr(), res.data_ptr(), 2, 105, 40, 0, 1)
    conv_bias._nvrtc_contiguous(raw, bias, _time_major(res))  # (a time-major residual: its frames' planes)
    assert launches[-1][4].a.residual_plane == 35
    wide = _cl(_x((1, 16, 2, 4, 8), torch.bfloat16))  # (whole vectors: the wide kernel, a plane of 32 positions)
    conv_bias._nvrtc_contiguous(wide, bias[:16], _time_major(_x((1, 16, 2, 4, 8), torch.bfloat16)))
    assert launches[-1][0] is conv_bias._NVRTC_CONTIGUOUS_WIDE and launches[-1][4].a.residual_plane == 32
    conv_bias._nvrtc_contiguous(raw.half(), bias.half())
    kernel, key, grid, block, a = launches[-1]
    assert (key, a.a.residual, a.a.dtype) == ((torch.float16, False), None, 0)


def test_the_kernel_variants_are_declared_for_every_dtype():
    """The NVRTC names: bias_contiguous_kernel<T, kResidual> for bf16, fp16 and fp32, both variants (what the .cu's
    host launcher instantiates; test_nvrtc.py compares them with nvcc's cubin)."""
    names = conv_bias._NVRTC_CONTIGUOUS.names
    assert names[(torch.bfloat16, True)] == "diffusers_fastpath::bias_contiguous_kernel<__nv_bfloat16, true>"
    assert names[(torch.float32, False)] == "diffusers_fastpath::bias_contiguous_kernel<float, false>"
    assert len(names) == 6


# --- GPU ----------------------------------------------------------------------------------------------------------

# conv2's result [B, C, T, H, W] as the LTX-2 decoder's resnets leave it at 768x512x121 (latents [1, 128, 16, 16,
# 24]: the mid block at 1024 channels, the up blocks at 512, 256 and 128; 20 resnets in all)
DECODER_SHAPES = [(1, 1024, 16, 16, 24), (1, 512, 31, 32, 48), (1, 256, 61, 64, 96), (1, 128, 121, 128, 192)]
# channels and positions of no whole 32 x 32 tile, two and three batches, one position, 4-D
ODD_SHAPES = [(2, 24, 3, 5, 7), (1, 40, 1, 3, 5), (3, 5, 2, 7, 9), (1, 33, 65, 31), (1, 1024, 1, 1, 3),
              (2, 8, 1, 1, 1),
              # the wide kernel (channels and positions multiples of 8) with a part of a channel tile (40 of 2 x 32)
              # and of a position tile (1080 of 17 x 64), 4-D (a part of one tile)
              (2, 40, 3, 5, 72), (1, 8, 13, 8)]


def _inputs(shape, dtype, gen, device="cuda"):
    """cuDNN's channels-last output, its bias and a residual of eager's magnitudes; special positions: sums of zero
    (raw + b = 0, then + residual; and h = -residual exactly), infinities and NaN in raw and in the residual."""
    batch, channels, *spatial = shape
    memory = (torch.randn(batch, *spatial, channels, generator=gen) * 4).to(device, dtype)  # channels-last memory
    raw = memory.movedim(-1, 1)
    bias = torch.randn(channels, generator=gen).to(device, dtype)
    res = (torch.randn(shape, generator=gen) * 4).to(device, dtype)
    flat = memory.view(-1)  # (element k: channel k % C of position k // C)
    flat[:3] = -bias[:3]
    h = (raw + bias.view(1, -1, *([1] * (raw.dim() - 2)))).contiguous()
    res.view(-1)[5:9] = -h.view(-1)[5:9]
    if raw.numel() > 64:
        flat[20], flat[21], flat[22] = float("inf"), float("-inf"), float("nan")
        res.view(-1)[40], res.view(-1)[41] = float("nan"), float("inf")
    return raw, bias, res


def test_the_gpu_tests_inputs_are_what_they_say():
    """`_inputs` (on a CPU): raw laid out channels-last, exact zero sums where it says, the special values; and at
    the half dtypes rounding once gives other words than eager's two roundings (what lets the GPU test fail a kernel
    that rounds once)."""
    for shape in DECODER_SHAPES[:1] + ODD_SHAPES:
        for dtype in (torch.bfloat16, torch.float16):
            raw, bias, res = _inputs(shape, dtype, torch.Generator().manual_seed(sum(shape)), "cpu")
            assert _cl(raw).data_ptr() == raw.data_ptr() and raw.stride() == _cl(raw).stride()
            h = (raw + bias.view(1, -1, *([1] * (raw.dim() - 2)))).contiguous()
            assert (h.view(-1)[5:9] + res.view(-1)[5:9] == 0).all()
            assert (raw[0, :3].reshape(3, -1)[:, 0] + bias[:3] == 0).all()
            if raw.numel() > 1000:
                once = (raw.float() + bias.float().view(1, -1, *([1] * (raw.dim() - 2))) + res.float()).to(dtype)
                assert not tensors_equal(once, h + res)
                assert raw.isnan().sum() == 1 and raw.isinf().sum() == 2


# Wan 2.1's resnets whose identity shortcut reads an upsampler's time-major result (832x480: the decoder's third and
# fourth up blocks' first resnets, 4 frames), and odd ones (planes of no multiple of 8: the tiled kernel)
TIME_MAJOR_SHAPES = [(1, 192, 4, 240, 416), (1, 96, 4, 480, 832), (2, 24, 3, 5, 7), (1, 40, 2, 3, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape,layout", [(s, "contiguous") for s in DECODER_SHAPES + ODD_SHAPES]
                         + [(s, "time-major") for s in TIME_MAJOR_SHAPES], ids=str)
@torch.no_grad()
def test_kernel_equals_the_bias_add_then_the_residual_add(shape, layout, dtype):
    """csrc/conv_bias.cu's bias_contiguous kResidual against eager's ops on the GPU (aten's ``raw + bias`` made
    contiguous, then ``+ residual``), bit for bit (`tensors_equal`: NaN included), both ways it launches (NVRTC, and
    the nvcc build's raw op where that loads), every element written (the output's blocks poisoned with NaN first);
    the inputs hold positions where rounding once (``raw + bias + residual`` in fp32) gives another word, so a kernel
    that skipped the first rounding would fail. Then the op (its guard and first-call check) at the half dtypes. A
    time-major residual (Wan's): eager's sum contiguous all the same (the convolution's tensor the first operand)."""
    from test_nvrtc import both_ways

    nvcc = both_ways.__wrapped__()
    gen = torch.Generator().manual_seed(sum(shape))
    raw, bias, res = _inputs(shape, dtype, gen)
    if layout == "time-major":
        res = _time_major(res)
    h = (raw + bias.view(1, -1, *([1] * (raw.dim() - 2)))).contiguous()  # eager's conv output: aten's bias add
    ref = h + res  # the resnet's add
    if dtype is not torch.float32 and raw.numel() > 1000:
        once = (raw.float() + bias.float().view(1, -1, *([1] * (raw.dim() - 2))) + res.float()).to(dtype)
        assert not tensors_equal(once, ref)  # (the inputs tell one rounding from two)
    ways = [conv_bias._nvrtc_contiguous] + ([torch.ops.diffusers_fastpath._conv_bias_residual_contiguous_cuda]
                                            if nvcc else [])
    for way in ways:
        torch.full_like(ref, float("nan"))  # (freed: the next block of this size the kernel's output)
        out = way(raw, bias, res)
        assert out.is_contiguous() and out.stride() == ref.stride() and tensors_equal(out, ref), (shape, way)
    if dtype is torch.float32:  # (the op takes the half dtypes: a PendingBias is made of nothing else)
        return
    site = Site(cbr.CONV_BIAS_RESIDUAL.name)
    torch.full_like(ref, float("nan"))
    out = cbr.CONV_BIAS_RESIDUAL(site, PendingBias(raw, bias), res)
    assert site.fast == 1, (dict(site.fallback), cbr.CONV_BIAS_RESIDUAL.disabled)
    assert out.stride() == ref.stride() and tensors_equal(out, ref)


@pytest.mark.gpu
@torch.no_grad()
def test_a_refused_residual_gives_eagers_sum_and_layout():
    """A channels-last residual (a shortcut convolution's result) and a broadcast one: refused with the reason; the
    op's fallback is eager's sum, in eager's layout (the left operand's)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(3)
    raw, bias, res = _inputs((1, 64, 3, 8, 8), torch.bfloat16, gen)
    for residual, why in ((_cl(res), "residual not contiguous"), (res[:, :, :1], "residual's shape (broadcast)")):
        site = Site(cbr.CONV_BIAS_RESIDUAL.name)
        out = cbr.conv_bias_residual(PendingBias(raw, bias), residual, site)
        ref = (raw + bias.view(1, -1, 1, 1, 1)).contiguous() + residual
        assert dict(site.fallback) == {why: 1} and out.stride() == ref.stride() and tensors_equal(out, ref)
