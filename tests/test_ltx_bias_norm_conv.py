"""`ltx_bias_norm_conv` (ops/ltx_bias_norm_conv.py; csrc/per_channel_rmsnorm_pad.cu's channels-last kernel): a causal
convolution's channels-last result without its bias, read by LTX-2's VAE norm -> SiLU -> causal convolution.

On CPU: the kernel's statistics as its code reads them (each position's chains from 16-byte vectors of channels, its
threads' chain sums into the fused kernel's scratch entries, the fused kernel's combine) equal aten's reduce kernel
simulated thread by thread; its arithmetic in torch equals the eager chain's padded input; `cl_shape` equals the
.cu's; the NVRTC launcher passes what bindings_vae.cpp passes; the guards refuse what the kernel does not take, with
the reason. The wiring through a whole VAE (the rewrite, the sites, the refusals) is in test_vae_ltx2.py.
On the GPU (marked): the op against diffusers' modules at the LTX-2 decoder's and encoder's shapes and at odd ones,
bf16 and fp16, its padded buffer against the pad kernel's on bias_contiguous's tensor, the allocator poisoned with NaN
first; fp32 refused, exactly; the full-size decode decoded three times (the second with conv1's pending results,
the third with conv2's too, read by the residual adds) md5-identical.
"""

from __future__ import annotations

import importlib
import struct

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_ltx2 import LTX2VideoCausalConv3d, PerChannelRMSNorm

from diffusers_fastpath.ops._policy import Site, tensors_equal
from diffusers_fastpath.ops.causal_conv_cl import PendingBias
from diffusers_fastpath.testing._common import randomize_

bnc = importlib.import_module("diffusers_fastpath.ops.ltx_bias_norm_conv")  # (ops binds the names to the ops)
pcr = importlib.import_module("diffusers_fastpath.ops.per_channel_rmsnorm")
norm_conv = importlib.import_module("diffusers_fastpath.ops.ltx_norm_conv")

EPS = 1e-8
H100 = (132, 2048)


def _x(shape, dtype, scale=3.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _registered():
    """The classes the guards take, registered as the VAE adapter registers them."""
    from diffusers_fastpath.models.vae import checked_forwards
    from diffusers_fastpath.models.vae_ltx2_norm import norm_fits
    from diffusers_fastpath.models.vae_ltx_conv import CONV_DIGESTS
    from diffusers_fastpath.ops.ltx_causal_conv import add_conv_class

    norm_fits()
    checked_forwards([LTX2VideoCausalConv3d], CONV_DIGESTS, register=add_conv_class)


# --- the statistics, as the kernel's code reads them ----------------------------------------------------------------


def _kernel_chain_mean(h, order, vec=8):
    """csrc/per_channel_rmsnorm_pad.cu's channels-last kernel, stages 1 and 2, for eager's tensor h [B, C, S]: per
    position, thread k of `per_position` reads the 16-byte vectors at channels k vec, k vec + step, ... (step =
    max(G, vec), G = 4 P) and adds element i of each (in channel order) to its accumulator i % lanes (lanes =
    min(G, vec)), chain rho = k lanes + i, stored at scratch entry 4 (rho % P) + rho // P; then the fused kernel's
    combine (`position_mean`: chains into partials, each CTA's tree, the global step, the projection)."""
    q = (h.float() * h.float()).to(h.dtype).float()
    channels = h.shape[1]
    partials = order.rows * order.ctas
    chains = 4 * partials
    lanes = min(chains, vec)
    per_position = max(chains // vec, 1)
    step = per_position * vec
    zero = torch.zeros_like(q[:, 0])
    entry = {}
    for k in range(per_position):
        acc = [zero] * lanes
        for c in range(k * vec, channels, step):
            for i in range(vec):
                acc[i % lanes] = acc[i % lanes] + q[:, c + i]
        for i in range(lanes):
            rho = k * lanes + i
            entry[4 * (rho % partials) + rho // partials] = acc[i]
    assert sorted(entry) == list(range(chains))
    combined = [((entry[4 * j] + entry[4 * j + 1]) + entry[4 * j + 2]) + entry[4 * j + 3] for j in range(partials)]
    return pcr.combine_partials(combined, order, h.dtype)


# (B, C, S, limits): one thread a position (G = 4) and several (G = 16 .. 512), C no multiple of G, several CTAs
CHAIN_CASES = [(2, 24, 96, H100), (1, 128, 64, H100), (1, 1000, 200, H100), (1, 1024, 48, H100), (1, 520, 40, H100),
               (1, 1024, 6144, H100), (1, 2048, 96, H100), (1, 96, 4098, H100), (1, 1024, 1536, (3, 2048)),
               (1, 1096, 768, H100)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kernel_statistics_are_reduce_cuh_thread_by_thread(dtype):
    """The channels-last kernel's order (its chains read along the channels, into the fused kernel's scratch)
    equals aten's reduce kernel simulated thread by thread, bit for bit, at every kind of order the kernel takes;
    values over several decades, where another order gives other sums."""
    from test_per_channel_rmsnorm import _aten_sum_thread_by_thread

    gen = torch.Generator().manual_seed(2)
    kinds = set()
    for b, c, s, limits in CHAIN_CASES:
        spread = 1.0 if dtype == torch.float16 else 3.0
        h = (torch.randn(b, c, s, generator=gen) * torch.exp(torch.randn(b, c, s, generator=gen) * spread)).to(dtype)
        cfg = pcr.aten_reduce_config(b, c, s, *limits)
        order = pcr.order_of(cfg, b, c, s)
        assert bnc.cl_shape(b, s, c, order, 8, limits[0]) is not None, (b, c, s)
        q = (h.float() * h.float()).to(dtype)
        want = (_aten_sum_thread_by_thread(q, cfg) * torch.tensor(order.factor, dtype=torch.float32)).to(dtype)
        assert tensors_equal(_kernel_chain_mean(h, order), want), (b, c, s, limits)
        kinds.add((4 * order.rows * order.ctas > 8, order.ctas > 1, c % (4 * order.rows * order.ctas) != 0))
    assert kinds >= {(False, False, False), (True, False, False), (True, True, False), (True, False, True)}


def test_arithmetic_is_the_eager_chains_padded_input():
    """`bias_norm_pad_arithmetic` (the kernel in torch) equals, on a CPU, what eager's convolution input is for the
    norm -> SiLU of ``raw + bias``: the norm module, ``F.silu``, the causal padding and F.pad's reflection, laid out
    channels-last; the bias added by aten (one rounding)."""
    _registered()
    raw = _x((2, 16, 3, 4, 5), torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    bias = _x((16,), torch.bfloat16, seed=1)
    raw[:, :, 0, 0, :2] = -bias.view(1, -1, 1)  # (positions whose channels all sum to zero: sqrt of eps)
    h = raw + bias.view(1, -1, 1, 1, 1)
    y = F.silu(PerChannelRMSNorm()(h))
    want = F.pad(torch.cat([y[:, :, :1], y[:, :, :1], y], dim=2), (1, 1, 1, 1, 0, 0), mode="reflect")
    eps = pcr.eps_as_added(EPS, torch.bfloat16, torch.device("cpu"))
    got = bnc.bias_norm_pad_arithmetic(raw, bias, eps, True, [1, 1, 1, 1, 2, 0], True)
    assert got.is_contiguous(memory_format=torch.channels_last_3d) and tensors_equal(got, want)


# --- the launch -------------------------------------------------------------------------------------------------


def test_cl_shape_fits_the_threads_and_the_scratch():
    """The launch at the decoder's shapes: 2 threads a position for its 16 chains (tiles of 128), 32 for the mid
    block's 256 (tiles of 8); one thread a position for 4 chains; halved for a small grid; none where the chains do
    not map onto the vectors or the channels are no whole vectors."""
    order = pcr.MeanOrder
    assert bnc.cl_shape(1, 121 * 128 * 192, 128, order(4, 1, 0.0), 8, 132) == ((23232, 1, 1), (256, 1, 1), 128)
    assert bnc.cl_shape(1, 16 * 16 * 24, 1024, order(4, 16, 0.0), 8, 132) == ((768, 1, 1), (256, 1, 1), 8)
    assert bnc.cl_shape(1, 31 * 32 * 48, 1024, order(4, 6, 0.0), 8, 132) == ((2976, 1, 1), (256, 1, 1), 16)
    assert bnc.cl_shape(1, 16 * 16 * 24, 2048, order(4, 32, 0.0), 8, 132) == ((1536, 1, 1), (256, 1, 1), 4)
    assert bnc.cl_shape(2, 10**5, 16, order(1, 1, 0.0), 8, 132) == ((391, 2, 1), (256, 1, 1), 256)
    assert bnc.cl_shape(1, 100, 16, order(1, 1, 0.0), 8, 132) == ((100, 1, 1), (256, 1, 1), 1)
    assert bnc.cl_shape(1, 100, 12, order(1, 1, 0.0), 8, 132) is None  # (channels: no whole vectors)
    assert bnc.cl_shape(1, 100, 96, order(1, 3, 0.0), 8, 132) is None  # (12 chains)
    assert bnc.cl_shape(1, 100, 96, order(1, 3, 0.0), 4, 132) is not None  # (fp32's vectors of 4)
    assert bnc.cl_shape(1, 100, 8192, order(512, 8, 0.0), 8, 132) is None  # (16384 chains: scratch)


CL_SHAPE_CASES = [  # (batch, spatial, channels, rows, ctas, vec)
    (1, 2973696, 128, 4, 1, 8), (1, 374784, 256, 4, 1, 8), (1, 47616, 512, 4, 1, 8), (1, 6144, 1024, 4, 16, 8),
    (1, 47616, 1024, 4, 6, 8), (1, 6144, 2048, 4, 32, 8), (2, 96, 24, 1, 1, 8), (1, 7, 64, 1, 1, 8),
    (1, 100, 12, 1, 1, 8), (1, 100, 96, 1, 3, 8), (1, 100, 96, 1, 3, 4), (1, 40, 520, 16, 1, 8),
    (1, 100, 8192, 512, 8, 8), (3, 4097, 1000, 4, 1, 8),
]


def test_cl_shape_matches_the_cu(tmp_path):
    """The Python `cl_shape` against the .cu's cl_shape, compiled and run on the host (no GPU: num_sms() is 132)."""
    from test_per_channel_rmsnorm import host_output

    out = host_output(tmp_path, "void print(long b, long s, long c, long r, long k, int v) {\n  FusedShape f;\n"
                      '  int tile = 0;\n  if (!cl_shape(b, s, c, r, k, v, num_sms(), f, tile)) { std::printf("none\\n"); '
                      'return; }\n  std::printf("%u %u %u %d\\n", f.grid.x, f.grid.y, f.block.x, tile);\n}\n',
                      CL_SHAPE_CASES, "per_channel_rmsnorm_pad.cu")
    want = []
    for b, s, c, r, k, v in CL_SHAPE_CASES:
        shape = bnc.cl_shape(b, s, c, pcr.MeanOrder(r, k, 0.0), v, 132)
        want.append("none" if shape is None else f"{shape[0][0]} {shape[0][1]} {shape[1][0]} {shape[2]}")
    assert out == want and "none" in want


def test_nvrtc_launcher_passes_what_bindings_cpp_passes(monkeypatch):
    """The channels-last kernel's NVRTC launch, field by field as bindings_vae.cpp's per_channel_rmsnorm_cl_pad_cl
    fills them (x's batch stride, channel stride 1, no mean, the dims from x, the bias pointer, the order, the tile),
    and the channels-last padded output."""
    from test_nvrtc import captured_launches  # noqa: F401 - the fixture's body, called directly below

    launches = captured_launches.__wrapped__(monkeypatch)
    x = _x((2, 16, 3, 4, 5), torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    bias = _x((16,), torch.bfloat16, seed=1)
    out = bnc._nvrtc_cl_pad(x, bias, EPS, True, 1, 1, 1 / 16, [1, 1, 1, 1, 2, 0], True)
    kernel, key, grid, block, a = launches[-1]
    assert (kernel, key, grid, block) == (bnc._NVRTC_CL, torch.bfloat16, (60, 2, 1), (256, 1, 1))
    assert out.shape == (2, 16, 5, 6, 7) and out.is_contiguous(memory_format=torch.channels_last_3d)
    assert (a.a.out, a.a.x, a.a.mean, a.a.batch, a.a.channels, a.a.spatial, a.a.x_batch_stride, a.a.x_channel_stride,
            a.a.silu, a.a.probe, a.a.dtype) == (out.data_ptr(), x.data_ptr(), None, 2, 16, 60, 16 * 60, 1, 1, 0, 1)
    assert a.a.eps == struct.unpack("f", struct.pack("f", EPS))[0]
    assert (a.g.frames, a.g.height, a.g.width, a.g.pad_t0, a.g.pad_t1, a.g.pad_h0, a.g.pad_h1, a.g.pad_w0,
            a.g.pad_w1, a.g.reflect_hw) == (3, 4, 5, 2, 0, 1, 1, 1, 1, 1)
    assert (a.bias, a.rows, a.ctas, a.factor, a.tile) == (bias.data_ptr(), 1, 1, 1 / 16, 1)
    half = _x((1, 1024, 16, 16, 24), torch.float16).contiguous(memory_format=torch.channels_last_3d)
    bnc._nvrtc_cl_pad(half, _x((1024,), torch.float16), 1e-6, False, 4, 16, 2.0**-10, [0, 0, 0, 0, 2, 0], False)
    kernel, key, grid, block, a = launches[-1]
    assert (key, grid, a.tile, a.a.silu, a.a.dtype, a.g.reflect_hw) == (torch.float16, (768, 1, 1), 8, 0, 0, 0)
    with pytest.raises(ValueError, match="do not fit"):
        bnc._nvrtc_cl_pad(_x((1, 96, 2, 2, 2), torch.bfloat16).contiguous(memory_format=torch.channels_last_3d),
                          _x((96,), torch.bfloat16), EPS, True, 1, 3, 1 / 96, [0, 0, 0, 0, 2, 0], False)


def test_raw_op_guard_refuses_what_bindings_cpp_refuses():
    x = _x((1, 16, 3, 4, 5), torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    bias = _x((16,), torch.bfloat16)
    pad = [1, 1, 1, 1, 2, 0]
    assert bnc._raw_guard(x, bias, EPS, True, 1, 1, 1 / 16, pad, True) == "device"
    assert bnc._raw_guard(x.contiguous(), bias, EPS, True, 1, 1, 1 / 16, pad, True) == "x"
    assert bnc._raw_guard(x, bias.float(), EPS, True, 1, 1, 1 / 16, pad, True) == "bias"
    assert bnc._raw_guard(x, bias[:8], EPS, True, 1, 1, 1 / 16, pad, True) == "bias"
    narrow = _x((1, 4, 3, 4, 5), torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    assert bnc._raw_guard(narrow, bias[:4], EPS, True, 1, 1, 1 / 4, pad, True) == "alignment"
    assert bnc._raw_guard(x, bias, EPS, True, 3, 1, 1 / 16, pad, True) == "order"
    assert bnc._raw_guard(x, bias, EPS, True, 1, 1, 1 / 16, [5, 5, 1, 1, 2, 0], True) == "padding"
    assert bnc._raw_guard(x, bias, EPS, True, 1, 1, 1 / 16, pad, False) == "padding"


@torch.no_grad()
def test_the_guard_refuses_what_the_kernel_does_not_take():
    """Refused with the reason, never raised: no `PendingBias`, another activation, a causal that is no bool, fp32,
    x contiguous, a bias of another dtype, channels of no whole 16-byte vector, autocast on; on a CPU (no aten order
    to reproduce) the mean's reason last."""
    _registered()
    conv = randomize_(LTX2VideoCausalConv3d(16, 16, 3, spatial_padding_mode="reflect"), 0).to(torch.bfloat16)
    norm, act = PerChannelRMSNorm(), torch.nn.SiLU()
    raw = _x((1, 16, 3, 4, 5), torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    bias = _x((16,), torch.bfloat16)
    guard = bnc.LTX_BIAS_NORM_CONV.guard

    def reason(x=PendingBias(raw, bias), a=act, causal=False):
        return guard(norm, a, conv, x, causal)

    assert reason(raw) == "x not a convolution's pending result"
    assert reason(a=torch.nn.GELU()) == "GELU is not nn.SiLU"
    assert reason(causal=1) == "causal not a bool"
    assert reason(PendingBias(raw.float(), bias.float())) == "dtype float32"
    assert reason(PendingBias(raw.contiguous(), bias)) == "x not channels-last [B, C, T, H, W]"
    assert reason(PendingBias(raw, bias.half())) == "bias"
    narrow = _x((1, 4, 3, 4, 5), torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    assert reason(PendingBias(narrow, bias[:4])) == "channels not a multiple of 16 bytes"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert reason().startswith("autocast is on")
    assert reason() == "aten's mean: not on a CUDA device"
    assert guard(norm, act, conv, PendingBias(raw, bias), True) == "aten's mean: not on a CUDA device"
    out = bnc.ltx_bias_norm_conv(norm, act, conv, PendingBias(raw, bias), False)  # (refused: the eager chain)
    assert torch.equal(out, conv(act(norm(raw + bias.view(1, -1, 1, 1, 1))), causal=False))


def test_settle_is_bias_contiguous_or_atens_add_where_its_kernel_fails(monkeypatch, fastpath_log):
    """`PendingBias.settle`: bias_contiguous's tensor; where its kernel raises, one warning and aten's add and copy
    (the same values); where no kernels load at all (a CPU), aten's without a warning."""
    conv_bias = importlib.import_module("diffusers_fastpath.ops.conv_bias")
    raw = _x((1, 16, 3, 4, 5), torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    bias = _x((16,), torch.bfloat16, seed=1)
    want = (raw + bias.view(1, -1, 1, 1, 1)).contiguous()
    got = PendingBias(raw, bias).settle()
    assert got.is_contiguous() and torch.equal(got, want)
    assert not any("bias_contiguous failed" in r.getMessage() for r in fastpath_log.records)

    def failing(x, b):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(conv_bias, "_contiguous_op", failing)
    for _ in range(2):
        got = PendingBias(raw, bias).settle()
        assert got.is_contiguous() and torch.equal(got, want)
    assert sum("bias_contiguous failed" in r.getMessage() for r in fastpath_log.records) == 1
    monkeypatch.setattr(conv_bias, "_contiguous_op", lambda x, b: (x.float() + b.float().view(1, -1, 1, 1, 1)).to(
        x.dtype).contiguous())
    assert torch.equal(PendingBias(raw, bias).settle(), want)  # (the kernel's arithmetic: aten's add)


# --- GPU ----------------------------------------------------------------------------------------------------------

# conv1's result [B, C, T, H, W] as the LTX-2 decoder's resnets leave it at 768x512x121 (latents [1, 128, 16, 16,
# 24]: the mid block at 1024 channels, 64 partial sums; the up blocks at 512, 256 and 128, 4), norm2 -> conv2 with
# the reflected spatial padding, non-causal; and the encoder's (zero padding, causal) where aten splits the channels
# across 6 and 32 blocks per output (96 and 512 chains).
CHAIN_SHAPES = [((1, 1024, 16, 16, 24), "reflect", False), ((1, 512, 31, 32, 48), "reflect", False),
                ((1, 256, 61, 64, 96), "reflect", False), ((1, 128, 121, 128, 192), "reflect", False),
                ((1, 256, 121, 64, 96), "zeros", True), ((1, 1024, 31, 32, 48), "zeros", True),
                ((1, 2048, 16, 16, 24), "zeros", True)]

# Odd geometry: one frame (the first frame is the last), rows and columns of 2 (each reflected copy at both ends),
# channels no multiple of the chains (1000 of 16), one thread a position (4 chains) and two batches, rows split 16 ways
ODD_SHAPES = [((1, 16, 1, 3, 5), "reflect", False), ((2, 24, 3, 2, 7), "reflect", False),
              ((1, 64, 2, 2, 2), "zeros", True), ((2, 40, 3, 5, 16), "zeros", True), ((1, 1000, 2, 10, 10),
                                                                                       "reflect", False),
              ((1, 520, 1, 5, 8), "reflect", False)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,mode,causal", CHAIN_SHAPES + ODD_SHAPES, ids=str)
@torch.no_grad()
def test_op_equals_eager_at_ltx2_shapes(shape, mode, causal, dtype):
    """`ltx_bias_norm_conv` (its kernel, proofs and first-call check included) against diffusers' modules called as
    the resnet calls them on eager's conv1 output (``raw + bias``, aten's add), bit for bit (`tensors_equal`: NaN
    included), the allocator's blocks poisoned with NaN first; and its padded buffer against the pad kernel's on
    bias_contiguous's tensor (the path before). Positions whose channels sum to zero (sqrt of eps), means near eps;
    fp16's all-zero positions give NaN in eager too (eps rounds to 0 there), which the kernel must give as well."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from diffusers_fastpath.ops.conv_bias import bias_contiguous

    _registered()
    gen = torch.Generator().manual_seed(sum(shape))
    channels = shape[1]
    conv = LTX2VideoCausalConv3d(channels, channels, 3, spatial_padding_mode=mode)
    conv = randomize_(conv, sum(shape) % 1000).to("cuda", dtype).eval()
    norm, act = PerChannelRMSNorm(), torch.nn.SiLU()
    raw = (torch.randn(shape, generator=gen) * 3).to("cuda", dtype).contiguous(memory_format=torch.channels_last_3d)
    bias = (torch.randn(channels, generator=gen)).to("cuda", dtype)
    if dtype is torch.bfloat16 or min(shape[3:]) > 2:  # (fp16: the NaN would cover a 2x2 frame whole)
        raw[:, :, 0, 0, :2] = -bias.view(1, -1, 1)  # (raw + bias = 0 in every channel)
    raw[:, :, 0, -1, :3] = (raw[:, :, 0, -1, :3] * 1e-4 - bias.view(1, -1, 1))  # (sums near zero: means near eps)
    h = raw.add(bias.view(1, -1, 1, 1, 1)).contiguous()  # eager's conv1 output: aten's bias add, contiguous
    ref = conv(act(norm(h)), causal=causal)
    padded = shape[0] * channels * (shape[2] + 2) * (shape[3] + 2) * (shape[4] + 2)
    torch.full((3 * padded,), float("nan"), dtype=dtype, device="cuda")  # (freed: the next blocks hold NaN)
    torch.cuda.synchronize()
    site = Site(bnc.LTX_BIAS_NORM_CONV.name)
    out = bnc.LTX_BIAS_NORM_CONV(site, norm, act, conv, PendingBias(raw, bias), causal)
    assert site.fast == 1, (dict(site.fallback), bnc.LTX_BIAS_NORM_CONV.disabled)
    assert out.stride() == ref.stride() and tensors_equal(out, ref)
    assert ref.isfinite().any()
    # the buffer itself, against the path before: bias_contiguous, then the pad kernel
    padding, _, reflect = norm_conv._conv._plan(conv, causal)
    order = pcr.mean_order(h)
    eps = pcr.eps_as_added(EPS, dtype, h.device)
    before = norm_conv._launch(bias_contiguous(raw, bias).view(shape[0], channels, -1), eps, True, order.rows,
                               order.ctas, order.factor, list(shape[2:]), padding, reflect)
    torch.full((3 * padded,), float("nan"), dtype=dtype, device="cuda")
    now = bnc._launch(raw, bias, eps, True, order.rows, order.ctas, order.factor, padding, reflect)
    assert now.stride() == before.stride() and tensors_equal(now, before)


@pytest.mark.gpu
@torch.no_grad()
def test_fp32_and_narrow_channels_are_refused_and_exact():
    """fp32 (the convolutions' channels-first path: no pending result is made there, but a direct call) and channels
    of no whole 16-byte vector: refused with the reason, the eager chain's result."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _registered()
    for dtype, channels, why in ((torch.float32, 16, "dtype float32"),
                                 (torch.bfloat16, 12, "channels not a multiple of 16 bytes")):
        conv = randomize_(LTX2VideoCausalConv3d(channels, 8, 3, spatial_padding_mode="reflect"), 0).to("cuda", dtype)
        norm, act = PerChannelRMSNorm(), torch.nn.SiLU()
        raw = _x((1, channels, 3, 4, 5), dtype).cuda().contiguous(memory_format=torch.channels_last_3d)
        bias = _x((channels,), dtype, seed=1).cuda()
        site = Site(bnc.LTX_BIAS_NORM_CONV.name)
        out = bnc.ltx_bias_norm_conv(norm, act, conv, PendingBias(raw, bias), False, site)
        ref = conv(act(norm(raw.add(bias.view(1, -1, 1, 1, 1)).contiguous())), causal=False)
        assert dict(site.fallback) == {why: 1} and tensors_equal(out, ref)


@pytest.mark.gpu
@pytest.mark.full_size
@torch.no_grad()
def test_ltx2_vae_decoded_thrice_md5_identical_with_the_pending_results(unpatch_after):
    """The published VAE (random bf16 weights) decoding 768x512x121 three times: the second decode leaves each resnet's
    conv1 result pending (every signature checked by the first) and conv2's chain takes it; the third leaves conv2's
    result pending too (its chain's signatures checked by the second) and each resnet's residual add takes it
    (`conv_bias_residual`); md5-identical to eager every time, every decoder bias site and every decoder resnet's add
    fast, the three upsamplers fast on every decode (`ltx_upsampler3d`: from the first), no fallback anywhere."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import hashlib

    from diffusers import AutoencoderKLLTX2Video

    import diffusers_fastpath as fp
    from diffusers_fastpath.bench.levels.vae import VAE_MODELS

    _, config = VAE_MODELS["ltx2"]
    vae = randomize_(AutoencoderKLLTX2Video(**config), 0).to("cuda", torch.bfloat16).eval()
    z = torch.randn(1, 128, 16, 16, 24, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)

    def md5(t):
        return hashlib.md5(t.float().cpu().numpy().tobytes()).hexdigest()

    ref = md5(vae.decode(z).sample)
    unpatch_after(fp.patch(vae))
    for _ in range(3):
        assert md5(vae.decode(z).sample) == ref
    report = fp.report(vae)
    for op, count in ((bnc.LTX_BIAS_NORM_CONV.name, 20), ("conv_bias_residual", 20), ("ltx_upsampler3d", 3)):
        sites = [r for r in report.sites if r.op == op and r.site.startswith("decoder.")]
        assert len(sites) == count and all(r.fast >= 1 for r in sites), (op, str(report))
    assert all(r.fast == 3 for r in report.sites if r.op == "ltx_upsampler3d"), str(report)
    assert all(r.fallback == 0 for r in report.sites), str(report)
