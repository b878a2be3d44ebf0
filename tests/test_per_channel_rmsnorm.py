"""LTX-2's VAE norm (ops/per_channel_rmsnorm.py, csrc/per_channel_rmsnorm.cu; the module in models/vae_ltx2_norm.py):
diffusers' ``PerChannelRMSNorm``, and the pair with the SiLU after it.

On CPU: the kernel's arithmetic against the module (bf16, fp16, fp32: random values, positions whose channels are all
zero, tiny values where eps decides, squares that overflow, infinities and NaNs), on every bf16 / fp16 mean, and the
pair against ``F.silu`` of the module; how aten adds the python eps on a CPU; aten's order of the channel mean:
setReduceConfig's choices at LTX-2's shapes and others (the SM count's say in them), the MeanOps factor, the fused
kernel's order (in torch, and its units and scratch as the .cu reads) against aten's reduce kernel simulated thread by
thread, where `mean_order` keeps aten's mean and why; the wrapper lays the kernel's output out as eager's, for each
layout it takes, and refuses the others, taking the fused kernel with `mean_order`'s order where it gives one (the
emulated kernels as on an H100); the guard's refusals (hooks, fp64, a CPU without the emulation, autograd, a replaced
forward, ...); a kernel that differs (either one) is caught on its first call, a proof that fails disables the op; the
NVRTC launchers pass what bindings_vae.cpp passes, and the fused launch shape is the .cu's. On the GPU (marked): the op
against eager at LTX-2's decoder and encoder shapes with poisoned outputs (bf16, fp16, fp32, single and pair), the
fused kernel's mean against ``torch.mean(x**2, dim=1)`` at every kind of aten launch, the proofs on every value, NVRTC
against nvcc."""

from __future__ import annotations

import importlib
import struct
import subprocess

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_ltx2 import PerChannelRMSNorm

from diffusers_fastpath.models import vae_ltx2_norm
from diffusers_fastpath.models.vae_ltx2_norm import FastpathPerChannelRMSNorm
from diffusers_fastpath.ops import _unary_proof
from diffusers_fastpath.ops._policy import REASON_DISABLED, Site, bits, tensors_equal
from diffusers_fastpath.ops.gelu_cat import every_value

pcr = importlib.import_module("diffusers_fastpath.ops.per_channel_rmsnorm")  # (ops binds the names to the ops)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = 1e-8  # the module's default, as LTX-2's VAE builds them


def _x(shape, dtype, scale=3.0, seed=0, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


def _edge_cases(dtype):
    """[B, C, T, H, W] inputs for the arithmetic: each with what it exercises."""
    tiny = torch.finfo(dtype).tiny
    big = 300.0 if dtype == torch.float16 else 1e25  # squares past the dtype's largest value
    shape = (2, 24, 3, 4, 8)
    cases = {
        "random": _x(shape, dtype),
        "zero positions": _x(shape, dtype, seed=1).index_fill_(2, torch.tensor(1), 0),
        "eps decides": _x(shape, dtype, scale=1e-4, seed=2),
        "eps decides more": _x(shape, dtype, scale=3e-5, seed=3),
        "subnormal": _x(shape, torch.float32, scale=4 * tiny, seed=4).to(dtype),
        "overflowing squares": _x(shape, dtype, scale=big, seed=5),
    }
    special = _x(shape, dtype, seed=6)
    special[0, 3, 1] = float("inf")
    special[1, 5, 2, 2] = -float("inf")
    special[1, 2, 2, 1] = float("nan")
    special[0, :, 0, 0, 0] = float("inf")  # every channel infinite: inf / inf
    cases["infinities and NaNs"] = special
    return cases


def _arithmetic(x, silu=False, eps=EPS):
    """The kernel's arithmetic on x as the op runs it: aten's mean, the eps as aten adds it on x's device."""
    mean = torch.mean(x**2, dim=1, keepdim=True)
    return pcr.per_channel_rmsnorm_arithmetic(x, mean, pcr.eps_as_added(eps, x.dtype, x.device), silu)


# --- the arithmetic ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_arithmetic_equals_the_module(dtype):
    """The kernel's arithmetic after aten's mean is the module's output, bits (NaNs with their payloads) and strides;
    with the SiLU, ``F.silu`` of it."""
    norm = PerChannelRMSNorm()
    for name, x in _edge_cases(dtype).items():
        ref = norm(x)
        got = _arithmetic(x)
        assert got.stride() == ref.stride() and tensors_equal(got, ref), name
        pair = _arithmetic(x, silu=True)
        assert tensors_equal(pair, F.silu(ref)), name
    # the cases reach what they name: means that the eps changes, infinite means, NaNs
    assert torch.isnan(_arithmetic(_edge_cases(dtype)["infinities and NaNs"])).any()
    assert torch.isinf(torch.mean(_edge_cases(dtype)["overflowing squares"] ** 2, dim=1)).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_arithmetic_equals_eager_on_every_mean(dtype):
    """Over every bf16 / fp16 value of the mean (NaNs, infinities, negatives and subnormals too), the arithmetic's
    ``round(1 / round(sqrt(round(m + eps))))`` equals eager's ``1 / torch.sqrt(m + eps)`` (CPU: the eps rounded to the
    dtype first, as `eps_as_added` says), NaN payloads included."""
    m = every_value(dtype, "cpu").view(1, 1, -1)
    ones = torch.ones_like(m)
    got = pcr.per_channel_rmsnorm_arithmetic(ones, m, pcr.eps_as_added(EPS, dtype, m.device), False)
    assert tensors_equal(got, ones / torch.sqrt(m + EPS))


def test_cpu_adds_the_eps_rounded_to_the_dtype():
    """On a CPU aten makes the python eps a bf16 tensor before the add (1e-8 is 1.0012e-8 in bf16), and means near it
    add differently than with the float eps the CUDA kernel is given; fp16's 1e-8 rounds to 0 and changes no fp16 mean
    either way; fp32 and CUDA take the float."""
    m = every_value(torch.bfloat16, "cpu").view(1, 1, -1)
    m = m[torch.isfinite(m) & (m >= 0)].view(1, 1, -1)
    eager = torch.sqrt(m + EPS)
    ones = torch.ones_like(m)
    cpu = pcr.per_channel_rmsnorm_arithmetic(ones, m, pcr.eps_as_added(EPS, torch.bfloat16, m.device), False)
    as_float = pcr.per_channel_rmsnorm_arithmetic(ones, m, EPS, False)
    assert torch.equal(cpu, ones / eager) and not torch.equal(as_float, ones / eager)
    assert pcr.eps_as_added(EPS, torch.bfloat16, torch.device("cpu")) == float(torch.tensor(EPS).to(torch.bfloat16))
    assert pcr.eps_as_added(EPS, torch.float16, torch.device("cpu")) == 0.0
    assert pcr.eps_as_added(EPS, torch.float32, torch.device("cpu")) == EPS
    assert pcr.eps_as_added(EPS, torch.bfloat16, torch.device("cuda")) == EPS
    assert pcr.eps_as_added(2, torch.bfloat16, torch.device("cuda")) == 2.0


# --- aten's order of the channel mean -------------------------------------------------------------------------------

H100 = (132, 2048)  # (SMs, threads per SM) of an H100 / H200


def _config(b, c, s, limits=H100):
    cfg = pcr.aten_reduce_config(b, c, s, *limits)
    return cfg.output_vec_size, cfg.block_width, cfg.block_height, cfg.split_across_warps, cfg.ctas_per_output


def test_reduce_config_at_ltx2_shapes():
    """setReduceConfig's choices (output vector, block width x height, the channels split across the rows, blocks per
    output) at LTX-2's decoder and encoder shapes on 132 SMs, as the module docstring derives them; the ctas of a
    large C depend on the SM count (16 blocks from 46 SMs up); small and odd spatial sizes."""
    assert _config(1, 128, 121 * 128 * 192) == (4, 32, 4, True, 1)  # decoder norm_out: 32 values per row
    assert _config(1, 256, 61 * 64 * 96) == (4, 32, 4, True, 1)
    assert _config(1, 512, 31 * 32 * 48) == (4, 32, 4, True, 1)  # 128 values per row: no split across blocks
    assert _config(1, 1024, 16 * 16 * 24) == (4, 32, 4, True, 16)  # grid 48: max(min(ceil(2112 / 48), 16), 1)
    assert _config(1, 1024, 16 * 16 * 24, (46, 2048)) == (4, 32, 4, True, 16)
    assert _config(1, 1024, 16 * 16 * 24, (45, 2048)) == (4, 32, 4, True, 15)  # ceil(45 * 16 / 48)
    assert _config(1, 1024, 31 * 32 * 48) == (4, 32, 4, True, 6)  # the encoder's: grid 372, ceil(2112 / 372)
    assert _config(1, 2048, 16 * 16 * 24) == (4, 32, 4, True, 32)  # min(44, ceil(512 / 16))
    assert _config(2, 1024, 16 * 16 * 24) == (4, 32, 4, True, 16)  # grid 96: min(22, 16)
    assert _config(1, 1024, 16 * 16 * 24, (132, 1024)) == (4, 32, 4, True, 16)  # target 1056: min(22, 16)
    assert _config(1, 63, 4096) == (4, 32, 4, False, 1)  # 63 < 4 x 16: one thread sums the 63
    assert _config(1, 64, 4096) == (4, 32, 4, True, 1)
    assert _config(1, 128, 4098) == (2, 32, 8, True, 1)  # S % 4 == 2: pairs, 256 threads, 128 >= 8 x 16
    assert _config(1, 127, 4098) == (2, 32, 8, False, 1)
    assert _config(1, 256, 4097) == (1, 32, 16, True, 1)  # odd S: 512 threads, 256 >= min(16 x 16, 256)
    assert _config(1, 16, 8) == (4, 2, 16, False, 1)  # 2 vectors: the rows take outputs
    assert _config(1, 1024, 6) == (2, 2, 128, True, 1)  # 8 values per row
    assert _config(1, 65536, 2) == (2, 1, 256, True, 16)  # grid 1: min(1056, ceil(256 / 16))


def test_mean_factor_is_atens_float_arithmetic():
    """float(B S) / float(B C S) in float, as mean_kernel_impl's host code computes it: 1/C for C a power of two, and
    not float(1/C) where the counts round (3 channels of 2^24 + 1 positions)."""
    for c, n in ((128, 2973696), (1024, 6144), (24, 192), (3, 2**24 + 1), (6, 2**23 + 5), (5, 12345679)):
        want = (torch.tensor(float(n)) / torch.tensor(float(n * c))).item()  # (float32 tensors: IEEE float division)
        assert pcr.mean_factor(1, c, n) == want, (c, n)
    assert pcr.mean_factor(1, 1024, 6144) == 2.0**-10
    assert pcr.mean_factor(1, 3, 2**24 + 1) != struct.unpack("f", struct.pack("f", 1 / 3))[0]


def _aten_sum_thread_by_thread(q, cfg):
    """Reduce.cuh's ReduceOp::run with MeanOps for q [B, C, S] (T) up to the projection, as its code reads, each
    thread's value a [B, S] float tensor (every add a separate fp32 op): thread_reduce_impl (idx from input_idx,
    step_input, vt0 = 4, the tail, the combine), block_y_reduce over the block's rows, global_reduce across the ctas."""
    b, c, s = q.shape
    qf, zero = q.float(), torch.zeros(b, s)
    rows = cfg.block_height if cfg.split_across_warps else 1
    step_input = rows * cfg.ctas_per_output

    def thread_reduce(idx):
        values = [zero] * 4
        while idx + 3 * step_input < c:
            loaded = [qf[:, idx + i * step_input] for i in range(4)]
            for i in range(4):
                values[i] = values[i] + loaded[i]
            idx += step_input * 4
        for i in range(4):
            if idx >= c:
                break
            values[i] = values[i] + qf[:, idx]
            idx += step_input
        for i in range(1, 4):
            values[0] = values[0] + values[i]
        return values[0]

    def block_y_reduce(values):
        offset = len(values) // 2
        while offset > 0:
            for y in range(offset):
                values[y] = values[y] + values[y + offset]
            offset //= 2
        return values[0]

    staged = [block_y_reduce([thread_reduce(y + cta * rows) for y in range(rows)])
              for cta in range(cfg.ctas_per_output)]
    if cfg.ctas_per_output == 1:
        value = staged[0]
    else:
        last = []
        for y in range(rows):
            value = zero
            for offset in range(y, cfg.ctas_per_output, rows):
                value = value + staged[offset]
            last.append(value)
        value = block_y_reduce(last)
    return value


def _kernel_scratch_mean(x, order):
    """csrc/per_channel_rmsnorm.cu's fused kernel, steps 1 and 2, as its code reads: the units (chain (j, i) from
    channel j + i P by 4 P, or partial u by P: four accumulators, four loads at a time, the tail into the first ones),
    each into its scratch entry, then per position the in-place combine (partials into entries j, each CTA's tree at
    entries g rows, the t_y at units + y), the projection."""
    q = (x.float() * x.float()).to(x.dtype).float()
    c = x.shape[1]
    partials = order.rows * order.ctas
    chains = partials <= pcr._CHAIN_PARTIALS
    units = 4 * partials if chains else partials
    slot = {}
    for u in range(units):
        if chains:
            first, step = (u >> 2) + (u & 3) * partials, 4 * partials
            acc = torch.zeros_like(q[:, 0])
            for ch in range(first, c, step):
                acc = acc + q[:, ch]
            slot[u] = acc
        else:
            acc, ch = [torch.zeros_like(q[:, 0])] * 4, u
            while ch + 3 * partials < c:
                for k in range(4):
                    acc[k] = acc[k] + q[:, ch + k * partials]
                ch += 4 * partials
            for k in range(3):
                if ch < c:
                    acc[k] = acc[k] + q[:, ch]
                    ch += partials
            slot[u] = ((acc[0] + acc[1]) + acc[2]) + acc[3]
    if chains:
        for j in range(partials):
            slot[j] = ((slot[4 * j] + slot[4 * j + 1]) + slot[4 * j + 2]) + slot[4 * j + 3]

    def tree(first):
        off = order.rows // 2
        while off:
            for y in range(off):
                slot[first + y] = slot[first + y] + slot[first + y + off]
            off //= 2

    for g in range(order.ctas):
        tree(g * order.rows)
    if order.ctas == 1:
        total = slot[0]
    else:
        for y in range(order.rows):
            t = torch.zeros_like(q[:, 0])
            for g in range(y, order.ctas, order.rows):
                t = t + slot[g * order.rows]
            slot[units + y] = t
        tree(units)
        total = slot[units]
    return (total * torch.tensor(order.factor, dtype=torch.float32)).to(x.dtype)


ORDER_CASES = [  # (B, C, S, limits): chains (P <= 8) and partials, one CTA and several (fewer than rows, uneven)
    (1, 128, 64, H100), (2, 24, 96, H100), (1, 1000, 200, H100), (1, 1024, 48, H100), (1, 1024, 6144, H100),
    (1, 2048, 96, H100), (1, 520, 40, (8, 2048)), (1, 333, 7, H100), (1, 96, 4098, H100), (1, 1024, 1536, (3, 2048)),
    (1, 1100, 3072, H100),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_channel_mean_arithmetic_is_reduce_cuh_thread_by_thread(dtype):
    """The fused kernel's order (`channel_mean_arithmetic`, and the kernel's own units and scratch as its code reads)
    equals aten's reduce kernel simulated thread by thread, bit for bit, over configurations of every kind; values
    over several decades, where another order (the plain sum) gives other sums (other fp32 means)."""
    gen = torch.Generator().manual_seed(1)
    naive_differs = 0
    for b, c, s, limits in ORDER_CASES:
        spread = 1.0 if dtype == torch.float16 else 3.0  # (fp16: squares stay finite)
        x = (torch.randn(b, c, s, generator=gen) * torch.exp(torch.randn(b, c, s, generator=gen) * spread)).to(dtype)
        cfg = pcr.aten_reduce_config(b, c, s, *limits)
        order = pcr.order_of(cfg, b, c, s)
        q = (x.float() * x.float()).to(dtype)
        total = _aten_sum_thread_by_thread(q, cfg)
        want = (total * torch.tensor(order.factor, dtype=torch.float32)).to(dtype)
        assert tensors_equal(pcr.channel_mean_arithmetic(x, order), want), (b, c, s, limits)
        assert tensors_equal(_kernel_scratch_mean(x, order), want), (b, c, s, limits)
        naive = q.float().sum(1)
        naive_differs += not torch.equal(naive, total)
        if dtype == torch.float32:
            assert not torch.equal((naive * order.factor).to(dtype), want), (b, c, s, limits)
    assert naive_differs == len(ORDER_CASES)
    assert any(pcr.aten_reduce_config(b, c, s, *lim).ctas_per_output > 1 for b, c, s, lim in ORDER_CASES)


def test_mean_order_takes_atens_own_mean_where_its_order_is_not_reproduced():
    """`mean_order`'s reasons (the op then runs aten's square and mean): one position or one channel, q beyond 32-bit
    indexing, fp32 over a multiple of 1024 channels, more partial sums than the scratch, too many batches; a CPU."""
    bf16 = torch.bfloat16
    assert pcr._order(2, 16, 1, bf16, H100).startswith("one position")
    assert pcr._order(2, 1, 16, bf16, H100).startswith("one position")
    # can_use_32bit_indexing: 1 + (numel - 1) x 2 bytes <= 2^31 - 1 (exactly 2^31 bytes of q still index in 32 bits)
    assert pcr._order(1, 128, 2**23 + 1, bf16, H100).startswith("beyond 32-bit")
    assert type(pcr._order(1, 128, 2**23, bf16, H100)) is pcr.MeanOrder
    assert pcr._order(1, 128, 2**22 + 1, torch.float32, H100).startswith("beyond 32-bit")
    assert pcr._order(1, 1024, 6144, torch.float32, H100).startswith("fp32 over a multiple of 1024")
    assert pcr._order(1, 1024, 6144, torch.float16, H100) == pcr.MeanOrder(4, 16, 2.0**-10)
    assert pcr._order(1, 512, 6144, torch.float32, H100) == pcr.MeanOrder(4, 1, 2.0**-9)
    assert pcr._order(1, 65536, 2, bf16, H100).startswith("beyond the fused kernel's launch")  # 256 x 16 partials
    assert pcr._order(65536, 16, 8, bf16, H100).startswith("beyond the fused kernel's launch")  # grid.y
    assert pcr.mean_order(_x((1, 16, 8), bf16)) == "not on a CUDA device"
    assert pcr._order(1, 128, 121 * 128 * 192, bf16, H100) == pcr.MeanOrder(4, 1, 2.0**-7)


def test_fused_shape_fits_the_scratch():
    """The fused kernel's launch: threads per vector the units' (at most 32), a tile whose scratch fits 4096 floats,
    halved until the grid has 2 blocks per SM; the decoder's shapes."""
    assert pcr.fused_shape(1, 121 * 128 * 192, pcr.MeanOrder(4, 1, 0.0), 8, 132) == ((23232, 1, 1), (16, 16, 1))
    assert pcr.fused_shape(1, 31 * 32 * 48, pcr.MeanOrder(4, 1, 0.0), 8, 132) == ((372, 1, 1), (16, 16, 1))
    assert pcr.fused_shape(1, 16 * 16 * 24, pcr.MeanOrder(4, 16, 0.0), 8, 132) == ((384, 1, 1), (2, 32, 1))
    assert pcr.fused_shape(2, 95, pcr.MeanOrder(1, 1, 0.0), 1, 132) == ((95, 2, 1), (1, 4, 1))
    assert pcr.fused_shape(1, 6, pcr.MeanOrder(128, 1, 0.0), 2, 132) == ((3, 1, 1), (1, 32, 1))
    for order in (pcr.MeanOrder(4, 6, 0.0), pcr.MeanOrder(256, 1, 0.0), pcr.MeanOrder(4, 120, 0.0)):
        (tiles, _, _), (tx, ty, _) = pcr.fused_shape(1, 10**6, order, 8, 132)
        partials = order.rows * order.ctas
        units = 4 * partials if partials <= 8 else partials
        assert tx * ty <= 256 and (units + (order.rows if order.ctas > 1 else 0) + 1) * tx * 8 <= 4096
        assert tiles * tx * 8 >= 10**6 and ty == pcr.last_pow2(min(32, units))
    assert pcr.fused_shape(1, 8, pcr.MeanOrder(256, 16, 0.0), 8, 132) is None


# --- the wrapper, the guard ----------------------------------------------------------------------------------------


def _layouts(dtype):
    """The layouts the kernel takes, [B, C, *] each: eager's result is contiguous for all of them."""
    full = _x((2, 16, 5, 4, 8), dtype)
    return {
        "contiguous": _x((2, 16, 3, 4, 8), dtype),
        "frames sliced off": full[:, :, 2:],  # an upsampler's [:, :, stride - 1:]: channels apart
        "batches apart": _x((3, 16, 3, 4, 8), dtype)[::2],
        "channels apart": _x((2, 32, 3, 4, 8), dtype)[:, ::2],
        "odd trailing size": _x((2, 16, 3, 5, 7), dtype),  # one element per thread
        "[B, C]": _x((4, 16), dtype),
        "[B, C, S]": _x((2, 16, 24), dtype),
        "size-1 dims": _x((1, 16, 1, 1, 8), dtype),
        "one channel": _x((2, 1, 3, 4, 8), dtype),
        "one frame of many": full[:, :, 1:2],
        "offset": _x((2 * 16 * 96 + 1,), dtype)[1:].view(2, 16, 3, 4, 8),  # not 16-byte aligned: elements
    }


REFUSED = {
    "channels-last": lambda x: x.contiguous(memory_format=torch.channels_last_3d),
    "time-major": lambda x: x.transpose(1, 2).contiguous().transpose(1, 2),
    "width sliced": lambda x: x[..., :7],
    "channels expanded": lambda x: x[:, :1].expand(x.shape),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("silu", [False, True], ids=["norm", "pair"])
def test_wrapper_lays_the_kernel_out_as_eager(dtype, silu, monkeypatch, emulated_kernels):
    """Each layout taken: the kernel gets x's memory as [B, C, S] (its strides), the mean as contiguous [B, S] and the
    eps as aten adds it; the result has eager's bits and strides (contiguous), every call fast."""
    seen, launch = [], pcr._launch

    def recording(x, mean, eps, s, probe):
        seen.append((tuple(x.shape), x.stride(), tuple(mean.shape), mean.is_contiguous(), eps, s, probe))
        return launch(x, mean, eps, s, probe)

    monkeypatch.setattr(pcr, "_launch", recording)
    norm = PerChannelRMSNorm()
    vae_ltx2_norm.norm_fits()  # (registers PerChannelRMSNorm)
    op = pcr.PER_CHANNEL_RMSNORM_SILU if silu else pcr.PER_CHANNEL_RMSNORM
    for name, x in _layouts(dtype).items():
        site = Site(op.name)
        ref = F.silu(norm(x)) if silu else norm(x)
        assert ref.is_contiguous() and ref.stride() == torch.empty(ref.shape).stride(), name  # eager's: contiguous
        out = op(site, norm, x)
        assert site.fast == 1, (name, dict(site.fallback))
        assert out.shape == ref.shape and out.stride() == ref.stride() and tensors_equal(out, ref), name
        b, c = x.shape[:2]
        s = x[0, 0].numel()
        assert seen[-1] == ((b, c, s), (x.stride(0), x.stride(1), 1), (b, s), True,
                            pcr.eps_as_added(EPS, dtype, x.device), silu, 0), name
    for name, layout in REFUSED.items():
        x = layout(_x((2, 16, 3, 4, 8), dtype))
        site = Site(op.name)
        out, ref = op(site, norm, x), F.silu(norm(x)) if silu else norm(x)
        assert site.fast == 0 and list(site.fallback) == ["x's layout: trailing dims not contiguous or channels not "
                                                           "nested"], name
        assert out.stride() == ref.stride() and tensors_equal(out, ref), name


def _exact(shape, dtype, seed=0):
    """Values k / 2 for |k| <= 6: their squares (multiples of 1/4, at most 9) and any sum of up to 2^20 of them are
    exact in fp32, so a CPU's mean (sum, then / C for C a power of two) has aten's CUDA bits in any order."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-6, 7, shape, generator=gen) * 0.5).to(dtype)


def _fused_arithmetic(x, eps, silu, rows, ctas, factor, probe):
    """The fused kernel's launch in torch: `channel_mean_arithmetic` in the given order, then the first kernel's
    arithmetic; probe mode 3 the mean alone."""
    mean = pcr.channel_mean_arithmetic(x, pcr.MeanOrder(rows, ctas, factor))
    if probe == pcr.PROBE_MEAN:
        return mean
    return pcr.per_channel_rmsnorm_arithmetic(x, mean.view(x.shape[0], 1, -1), eps, silu).contiguous()


@pytest.fixture
def emulated_fused(monkeypatch, emulated_kernels):
    """The emulated kernels with CPU tensors taken as on an H100 (132 SMs of 2048 threads) by `mean_order`, and the
    fused kernel's launch as `_fused_arithmetic`; the calls of both launches recorded."""
    calls = {"fused": [], "aten": []}
    monkeypatch.setattr(pcr, "_device_limits", lambda device: H100)
    aten_launch = pcr._launch

    def fused(x, eps, silu, rows, ctas, factor, probe):
        calls["fused"].append((tuple(x.shape), x.stride(), eps, silu, rows, ctas, factor, probe))
        return _fused_arithmetic(x, eps, silu, rows, ctas, factor, probe)

    def aten(x, mean, eps, silu, probe):
        calls["aten"].append(tuple(x.shape))
        return aten_launch(x, mean, eps, silu, probe)

    monkeypatch.setattr(pcr, "_launch_fused", fused)
    monkeypatch.setattr(pcr, "_launch", aten)
    return calls


@torch.no_grad()
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("silu", [False, True], ids=["norm", "pair"])
def test_the_fused_kernel_takes_what_mean_order_gives(dtype, silu, emulated_fused):
    """Each layout with two or more channels and positions runs the fused kernel (no aten square or mean) with x's
    memory as [B, C, S], the eps as aten adds it and `mean_order`'s rows, ctas and factor; the result has eager's bits
    and strides; its signature names the order. A position or channel alone runs aten's mean, counted by reason."""
    vae_ltx2_norm.norm_fits()
    norm = PerChannelRMSNorm()
    op = pcr.PER_CHANNEL_RMSNORM_SILU if silu else pcr.PER_CHANNEL_RMSNORM
    for name, x in _layouts(dtype).items():
        x = _exact(x.shape, dtype).as_strided(x.shape, x.stride()) if x.is_contiguous() else x.copy_(
            _exact(x.shape, dtype))
        site, before = Site(op.name), dict(pcr.MEAN_FALLBACKS)
        ref = F.silu(norm(x)) if silu else norm(x)
        out = op(site, norm, x)
        assert site.fast == 1 and out.stride() == ref.stride() and tensors_equal(out, ref), (name, dict(site.fallback))
        b, c = x.shape[:2]
        s = x[0, 0].numel()
        order = pcr.mean_order(x)
        if c >= 2 and s >= 2:
            assert order == pcr.MeanOrder(1, 1, 1 / c), name  # (16 channels: one thread, ovs 4 or 2 or 1)
            assert emulated_fused["fused"][-1] == ((b, c, s), (x.stride(0), x.stride(1), 1),
                                                   pcr.eps_as_added(EPS, dtype, x.device), silu, 1, 1, 1 / c, 0), name
            assert pcr._signature(norm, x)[3] == f"mean of {c} in 1 x 1"
            assert dict(pcr.MEAN_FALLBACKS) == before, name
        else:
            assert emulated_fused["aten"][-1] == (b, c, s) and pcr._signature(norm, x)[3] == "aten's mean"
            assert pcr.MEAN_FALLBACKS[order] == before.get(order, 0) + 1, name
    x = _exact((1, 1024, 2, 64), dtype)  # 32 x 4 threads: 1024 >= 64, rows 4; 256 values each, grid 1: 16 ctas
    order = pcr.mean_order(x)
    site = Site(op.name)
    assert tensors_equal(op(site, norm, x), F.silu(norm(x)) if silu else norm(x)) and site.fast == 1
    if dtype == torch.float32:
        assert order.startswith("fp32 over a multiple of 1024") and emulated_fused["aten"][-1] == (1, 1024, 128)
    else:
        assert order == pcr.MeanOrder(4, 16, 2.0**-10) and emulated_fused["fused"][-1][4:7] == (4, 16, 2.0**-10)


@torch.no_grad()
def test_a_fused_kernel_that_differs_is_caught_on_its_first_call(monkeypatch, emulated_fused, fastpath_log):
    """The fused kernel one ulp off (its mean, say): the first call of the signature compares with eager, returns
    eager's result and disables the op (one warning)."""
    exact = pcr._launch_fused

    def off(*args):
        out = exact(*args)
        bits(out).view(-1)[3] += 1
        return out

    monkeypatch.setattr(pcr, "_launch_fused", off)
    vae_ltx2_norm.norm_fits()
    norm, x = PerChannelRMSNorm(), _exact((2, 16, 3, 4, 8), torch.bfloat16)
    site = Site("per_channel_rmsnorm")
    for _ in range(2):
        assert tensors_equal(pcr.per_channel_rmsnorm(norm, x, site), norm(x))
    assert site.fast == 0 and dict(site.fallback) == {REASON_DISABLED: 2}
    disabled = pcr.PER_CHANNEL_RMSNORM.disabled
    assert "not bit-exact" in disabled and "mean of 16 in 1 x 1" in disabled
    assert sum("disabling the fused op 'per_channel_rmsnorm'" in r.getMessage() for r in fastpath_log.records) == 1


def test_guard_refuses_what_the_kernel_does_not_take(monkeypatch):
    norm = FastpathPerChannelRMSNorm()
    x = _x((1, 16, 2, 4, 8), torch.bfloat16)
    assert pcr._guard(norm, x) == "device cpu"  # (the emulated kernels take this one)
    assert pcr._guard(norm, x.double()) == "dtype float64"
    assert pcr._guard(norm, x.float()) == "device cpu"  # fp32: an fp32 VAE, taken
    with torch.enable_grad():
        assert pcr._guard(norm, x.float().requires_grad_()) == "requires grad"
        with torch.no_grad():
            assert pcr._guard(norm, x.float().requires_grad_()) == "device cpu"
    assert pcr._guard(norm, x[0, 0, 0, 0]) == "x not [B, C, *]"
    assert pcr._guard(norm, x[:, :, :0]) == "empty"
    assert pcr._guard(norm, "x") == "input not a tensor"
    assert pcr._guard(norm, x.contiguous(memory_format=torch.channels_last_3d)).startswith("x's layout")

    class Other(PerChannelRMSNorm):
        pass

    assert pcr._guard(Other(), x) == "Other is not a checked per-channel RMS norm"
    for attr, value, reason in (("channel_dim", 2, "channel_dim not 1"), ("channel_dim", True, "channel_dim not 1"),
                                ("eps", torch.tensor(EPS), "eps not a python number"),
                                ("eps", 2**60, "eps not a python number"), ("eps", False, "eps not a python number")):
        odd = FastpathPerChannelRMSNorm()
        setattr(odd, attr, value)
        assert pcr._guard(odd, x) == reason, (attr, value)
    odd = FastpathPerChannelRMSNorm(eps=1)
    assert pcr._guard(odd, x) == "device cpu"  # an int eps: aten's CUDA add casts it to float as the kernel does

    # diffusers' forward replaced on its class (another library's patch): refused, and the replacement runs
    monkeypatch.setattr(PerChannelRMSNorm, "forward", lambda self, x, channel_dim=None: x * 2)
    assert pcr._guard(norm, x) == "FastpathPerChannelRMSNorm.forward replaced on its class"
    assert torch.equal(pcr.per_channel_rmsnorm(norm, x), x * 2)


@torch.no_grad()
def test_hooks_on_the_norm_refuse_the_pair_and_run(emulated_kernels):
    """The pair stands for the norm's call: a hook on the norm (or a global one) refuses it, and the fallback calls
    the module, so the hook runs once; the norm's own op, its forward, runs inside the call: the hook runs, the op is
    fast."""
    vae_ltx2_norm.norm_fits()
    norm, x = PerChannelRMSNorm(), _x((2, 16, 3, 4, 8), torch.bfloat16)
    ref = F.silu(PerChannelRMSNorm.forward(norm, x))
    seen = []
    handle = norm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    site = Site("per_channel_rmsnorm_silu")
    try:
        assert tensors_equal(pcr.per_channel_rmsnorm_silu(norm, x, site), ref)
    finally:
        handle.remove()
    assert seen == [x.shape] and site.fast == 0 and dict(site.fallback) == {"PerChannelRMSNorm has hooks": 1}
    glob = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append("global"))
    try:
        assert tensors_equal(pcr.per_channel_rmsnorm_silu(norm, x, site), ref)
    finally:
        glob.remove()
    assert seen[-1] == "global" and site.fallback["PerChannelRMSNorm has hooks"] == 2
    assert tensors_equal(pcr.per_channel_rmsnorm_silu(norm, x, site), ref) and site.fast == 1

    fast = FastpathPerChannelRMSNorm()
    fast._fastpath_site = Site("per_channel_rmsnorm")
    handle = fast.register_forward_hook(lambda m, i, o: seen.append("own"))
    try:
        assert tensors_equal(fast(x), PerChannelRMSNorm.forward(fast, x))
    finally:
        handle.remove()
    assert seen[-1] == "own" and fast._fastpath_site.fast == 1


def test_on_a_cpu_without_emulation_eager_runs():
    norm, x = FastpathPerChannelRMSNorm(), _x((2, 16, 3, 4, 8), torch.bfloat16)
    site = Site("per_channel_rmsnorm")
    assert tensors_equal(pcr.per_channel_rmsnorm(norm, x, site), PerChannelRMSNorm.forward(norm, x))
    assert site.fast == 0 and dict(site.fallback) == {"device cpu": 1}


# --- the module --------------------------------------------------------------------------------------------------


def test_the_module_class_adds_no_state_and_runs_the_op(emulated_kernels):
    """`FastpathPerChannelRMSNorm` is diffusers' class with the op as its forward: the same attributes, no parameters
    or buffers; a ``channel_dim`` argument runs diffusers' forward (which evaluates it)."""
    plain, fast = PerChannelRMSNorm(), FastpathPerChannelRMSNorm()
    assert vars(plain).keys() == vars(fast).keys() and not list(fast.parameters()) and not list(fast.buffers())
    assert fast.state_dict() == {} and isinstance(fast, PerChannelRMSNorm)
    fast._fastpath_site = Site("per_channel_rmsnorm")
    x = _x((2, 16, 3, 4, 8), torch.float32)
    assert tensors_equal(fast(x), plain(x)) and fast._fastpath_site.fast == 1
    assert tensors_equal(fast(x, 1), plain(x, 1)) and fast._fastpath_site.fast == 1  # (eager's own forward)


def test_norm_fits_checks_the_digest_and_registers_the_class(monkeypatch, fastpath_log):
    assert vae_ltx2_norm.norm_fits() and PerChannelRMSNorm in pcr._BASES
    monkeypatch.setattr(vae_ltx2_norm, "NORM_DIGESTS", frozenset())
    assert not vae_ltx2_norm.norm_fits()
    assert "PerChannelRMSNorm.forward is not the form" in fastpath_log.text
    monkeypatch.setattr(PerChannelRMSNorm, "forward", lambda self, x, channel_dim=None: x)
    monkeypatch.setattr(vae_ltx2_norm, "NORM_DIGESTS", frozenset({"6f3cf5cceb38d1d5"}))
    assert not vae_ltx2_norm.norm_fits()  # a replaced forward has another digest (or none)


def test_custom_op_and_its_fake_lay_out_as_eager():
    """What torch.compile traces with (the op's fake) has eager's shape and strides, for x with its frames sliced off
    too; the op's CPU form is eager's norm (and pair)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    norm = PerChannelRMSNorm()
    for x in (_x((2, 16, 3, 4, 8), torch.bfloat16), _x((2, 16, 5, 4, 8), torch.bfloat16)[:, :, 2:]):
        for silu in (False, True):
            ref = F.silu(norm(x)) if silu else norm(x)
            got = torch.ops.diffusers_fastpath.per_channel_rmsnorm.default(x, EPS, silu)
            assert got.stride() == ref.stride() and tensors_equal(got, ref)
            with FakeTensorMode() as mode:
                fake = torch.ops.diffusers_fastpath.per_channel_rmsnorm.default(mode.from_tensor(x), EPS, silu)
            assert fake.shape == ref.shape and fake.stride() == ref.stride()


@torch.no_grad()
def test_torch_compile_emits_the_op_once_verified(emulated_kernels):
    vae_ltx2_norm.norm_fits()
    norm, x = PerChannelRMSNorm(), _x((2, 16, 3, 4, 8), torch.bfloat16)
    ref = F.silu(norm(x))
    site = Site("per_channel_rmsnorm_silu")
    assert tensors_equal(pcr.per_channel_rmsnorm_silu(norm, x, site), ref) and site.fast == 1  # verified
    compiled = torch.compile(lambda t: pcr.per_channel_rmsnorm_silu(norm, t), backend="eager", fullgraph=True)
    assert tensors_equal(compiled(x), ref)


# --- self-verification ---------------------------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("silu", [False, True], ids=["norm", "pair"])
def test_a_kernel_that_differs_is_caught_on_its_first_call(silu, monkeypatch, emulated_kernels, fastpath_log):
    """A kernel one ulp off somewhere: the first call of the signature compares with eager, returns eager's result,
    disables the op (one warning); every later call runs eager."""
    exact = pcr._launch

    def off(x, mean, eps, s, probe):
        out = exact(x, mean, eps, s, probe)
        bits(out).view(-1)[7] += 1
        return out

    monkeypatch.setattr(pcr, "_launch", off)
    vae_ltx2_norm.norm_fits()
    op = pcr.PER_CHANNEL_RMSNORM_SILU if silu else pcr.PER_CHANNEL_RMSNORM
    norm, x = PerChannelRMSNorm(), _x((2, 16, 3, 4, 8), torch.bfloat16)
    ref = F.silu(norm(x)) if silu else norm(x)
    site = Site(op.name)
    for _ in range(2):
        assert tensors_equal(op(site, norm, x), ref)
    assert site.fast == 0 and dict(site.fallback) == {REASON_DISABLED: 2} and "not bit-exact" in op.disabled
    assert sum(f"disabling the fused op '{op.name}'" in r.getMessage() for r in fastpath_log.records) == 1


def _probe_launch(planted=None):
    """The launch with the kernel's probe modes in torch (1: the SiLU, 2: round(sqrt(round(x + eps)))), the result for
    the bit pattern planted[1] one ulp off in mode planted[0] where the kernel runs planted[2] ("vectors": a row of a
    multiple of 16 bytes; "elements": the row of one more value)."""
    def launch(x, mean, eps, silu, probe):
        if not probe:
            return pcr.per_channel_rmsnorm_arithmetic(x, mean.view(x.shape[0], 1, -1), eps, silu).contiguous()
        if probe == pcr.PROBE_SILU:
            out = F.silu(x)
        else:
            out = torch.sqrt((x.float() + torch.tensor(eps, dtype=torch.float32)).to(x.dtype))
        way = "vectors" if x.shape[2] % (16 // x.element_size()) == 0 else "elements"
        if planted is not None and planted[0] == probe and planted[2] == way:
            bits(out)[bits(x) == planted[1]] += 1
        return out
    return launch


@torch.no_grad()
@pytest.mark.parametrize("planted", [None, (1, 0x3F80, "vectors"), (1, -0x0080, "elements"), (2, 0x0001, "vectors"),
                                     (2, 0x7FC1, "elements"), (2, 0x3300, "vectors")], ids=str)
def test_a_proof_that_fails_disables_the_op(planted, monkeypatch, emulated_kernels):
    """The proofs run on the first call of a signature: the kernel's r (mode 2) and, for the pair, its SiLU (mode 1)
    on all 65536 bf16 values, both ways; one value off anywhere (a NaN's payload, a subnormal, a mean near eps), and
    the op is disabled with that call's result eager's."""
    monkeypatch.setattr(pcr, "_launch", _probe_launch(planted))
    monkeypatch.setattr(pcr.PER_CHANNEL_RMSNORM_SILU, "prove", pcr._prove_rms_silu)
    vae_ltx2_norm.norm_fits()
    norm, x = PerChannelRMSNorm(), _x((2, 16, 3, 4, 8), torch.bfloat16)
    site = Site("per_channel_rmsnorm_silu")
    assert tensors_equal(pcr.per_channel_rmsnorm_silu(norm, x, site), F.silu(norm(x)))
    assert (site.fast == 1) is (planted is None), (site, pcr.PER_CHANNEL_RMSNORM_SILU.status)
    assert pcr._prove_rms(norm, x) is (planted is None or planted[0] == pcr.PROBE_SILU)


def test_the_fp32_proofs_run_once_per_device_and_eps(monkeypatch):
    """fp32's proofs (2^32 values each) run once per device and eps (r) or device (the SiLU); a failure is not
    remembered."""
    calls = []
    monkeypatch.setattr(pcr, "_FP32_PROVEN", set())
    monkeypatch.setattr(pcr, "prove_fp32", lambda device, probe, ref=None: calls.append(ref) or len(calls) > 1)
    monkeypatch.setattr(pcr, "_launch", _probe_launch())
    norm, x = FastpathPerChannelRMSNorm(), torch.zeros(1, 4, 8)
    assert not pcr._prove_rms(norm, x) and pcr._prove_rms(norm, x) and pcr._prove_rms(norm, x)
    assert len(calls) == 2
    norm.eps = 1e-6
    assert pcr._prove_rms(norm, x) and len(calls) == 3
    assert pcr._prove_rms_silu(norm, x) and len(calls) == 4 and pcr._prove_rms_silu(norm, x) and len(calls) == 4
    assert calls[-1] is None  # (the SiLU's: F.silu, prove_fp32's default)


def test_the_fp32_rms_proof_checks_every_value_of_its_span():
    """The fp32 proof of r over spans of bit patterns (on the GPU all 2^32): one pattern off, as a vector or an
    element, around 1.0 or among the subnormals, fails it; none off passes."""
    eps = pcr.eps_as_added(EPS, torch.float32, torch.device("cpu"))

    def ref(m):
        return torch.sqrt(m + EPS)

    for planted in (None, (2, 0x3F800005, "vectors"), (2, 0x00000100, "elements")):
        launch = _probe_launch(planted)

        def probe(row):
            return launch(row, None, eps, False, pcr.PROBE_RMS)

        for start in (0x3F800000 - 1000, 0x00000000):
            inside = planted is not None and start <= planted[1] < start + 2500
            assert _unary_proof.prove_fp32(torch.device("cpu"), probe, ref, start, start + 2500, 1024) is not inside


# --- the NVRTC launcher --------------------------------------------------------------------------------------------


def test_launch_constants_match_the_source():
    from test_nvrtc import _constant

    assert (pcr._THREADS, pcr._BLOCKS_PER_SM, pcr._CHANNELS) == tuple(
        _constant("per_channel_rmsnorm.cuh", n) for n in ("kThreads", "kBlocksPerSm", "kChannels"))


def test_nvrtc_launcher_passes_what_bindings_cpp_passes(monkeypatch):
    """The NVRTC launcher's arguments, field by field, as bindings.cpp's per_channel_rmsnorm fills them, and the .cu's
    choice of vectors or elements and its grid (one thread per 8 channels of a vector, at most kBlocksPerSm blocks per
    SM); the driver call captured on CPU."""
    from test_nvrtc import captured_launches  # noqa: F401 - the fixture's body, called directly below

    launches = captured_launches.__wrapped__(monkeypatch)
    x, mean = _x((2, 16, 96), torch.bfloat16), _x((2, 96), torch.bfloat16)
    out = pcr._nvrtc_kernel(x, mean, EPS, True, 0)
    kernel, key, grid, block, a = launches[-1]
    assert (kernel, key, block) == (pcr._NVRTC, (torch.bfloat16, True), (256, 1, 1))
    assert out.shape == x.shape and out.is_contiguous() and out.dtype == x.dtype
    assert grid == (1, 1, 1)  # 2 batches x 2 groups of 8 channels x 12 vectors = 48 items
    assert (a.a.out, a.a.x, a.a.mean) == (out.data_ptr(), x.data_ptr(), mean.data_ptr())
    assert (a.a.batch, a.a.channels, a.a.spatial, a.a.x_batch_stride, a.a.x_channel_stride, a.a.silu, a.a.probe,
            a.a.dtype) == (2, 16, 96, 16 * 96, 96, 1, 0, 1)
    assert a.a.eps == struct.unpack("f", struct.pack("f", EPS))[0]  # the float bindings.cpp's static_cast gives
    sliced = _x((2, 17, 5, 4, 8), torch.float16)[:, :, 2:].reshape(2, 17, -1)  # channels apart, a last group of 1
    pcr._nvrtc_kernel(sliced, mean.half(), 1e-6, False, 0)
    _, key, grid, _, a = launches[-1]
    assert key == (torch.float16, True) and (a.a.x_batch_stride, a.a.x_channel_stride, a.a.channels) == (
        17 * 160, 160, 17) and (a.a.silu, a.a.dtype) == (0, 0) and grid == (1, 1, 1)
    odd = _x((2, 16, 95), torch.float32)
    pcr._nvrtc_kernel(odd, _x((2, 95), torch.float32), EPS, False, 0)
    assert launches[-1][1] == (torch.float32, False) and launches[-1][2] == (2, 1, 1)  # 2 x 2 x 95 = 380 items
    offset = _x((2 * 16 * 96 + 4,), torch.float32)[4:].view(2, 16, 96)  # 16-byte aligned: vectors of 4
    pcr._nvrtc_kernel(offset, _x((2, 96), torch.float32), EPS, False, 0)
    assert launches[-1][1] == (torch.float32, True)
    offset = _x((2 * 16 * 96 + 1,), torch.bfloat16)[1:].view(2, 16, 96)  # 2 bytes off: elements
    pcr._nvrtc_kernel(offset, mean, EPS, False, 0)
    assert launches[-1][1] == (torch.bfloat16, False) and launches[-1][4].a.x == offset.data_ptr()
    row = every_value(torch.bfloat16, "cpu").view(1, 1, -1)
    probed = pcr._nvrtc_kernel(row, None, EPS, False, pcr.PROBE_RMS)
    a = launches[-1][4].a
    assert (a.mean, a.probe, a.batch, a.channels, a.spatial, a.out) == (None, 2, 1, 1, 65536, probed.data_ptr())
    big = torch.empty(1, 8, 132 * 8 * 256 * 8 * 2, dtype=torch.bfloat16)
    pcr._nvrtc_kernel(big, torch.empty(1, big.shape[2], dtype=torch.bfloat16), EPS, False, 0)
    assert launches[-1][2] == (132 * 8, 1, 1)


def test_raw_op_guard_refuses_what_bindings_cpp_refuses():
    x, mean = _x((2, 16, 96), torch.bfloat16), _x((2, 96), torch.bfloat16)
    assert pcr._raw_guard(x, mean, EPS, False, 0) == "device"
    assert pcr._raw_guard(x.view(2, 16, 12, 8), mean, EPS, False, 0) == "x"
    assert pcr._raw_guard(x.transpose(1, 2), mean, EPS, False, 0) == "x"
    assert pcr._raw_guard(x, mean.float(), EPS, False, 0) == "mean"
    assert pcr._raw_guard(x, None, EPS, False, 0) == "mean"
    assert pcr._raw_guard(x, None, EPS, True, pcr.PROBE_SILU) == "probe"
    assert pcr._raw_guard(x, None, EPS, False, 3) == "probe"
    assert pcr._raw_guard(x, None, EPS, False, pcr.PROBE_RMS) == "device"


def test_fused_launch_constants_match_the_source():
    from test_nvrtc import _constant

    assert (pcr._FUSED_THREADS, pcr._UNIT_THREADS, pcr._CHAIN_PARTIALS, pcr._SHARED_FLOATS, pcr._MIN_BLOCKS_PER_SM,
            pcr.PROBE_MEAN) == tuple(_constant("per_channel_rmsnorm.cuh", n) for n in (
                "kFusedThreads", "kUnitThreads", "kChainPartials", "kSharedFloats", "kMinBlocksPerSm", "kProbeMean"))


FUSED_SHAPE_CASES = [  # (batch, spatial, rows, ctas, vec): the decoder's, the encoder's, small S, no fit
    (1, 2973696, 4, 1, 8), (1, 374784, 4, 1, 8), (1, 47616, 4, 1, 8), (1, 6144, 4, 16, 8), (1, 47616, 4, 6, 8),
    (1, 6144, 4, 32, 8), (2, 96, 1, 1, 8), (1, 105, 1, 1, 1), (1, 6, 128, 1, 2), (1, 2, 256, 16, 4), (1, 8, 256, 16, 8),
    (3, 4097, 16, 1, 1), (1, 1 << 20, 64, 8, 4),
]


def host_output(tmp_path, print_fn: str, cases, source: str = "per_channel_rmsnorm.cuh") -> list[str]:
    """The lines a host program prints that includes csrc/`source` (the header of the fused launch shape; the pad
    kernels' file for theirs), defines `print_fn` (C++: a ``void print(...)``) and calls it with each tuple of
    `cases`, compiled by nvcc and run (no GPU: num_sms() is 132); skipped without nvcc."""
    from test_nvrtc import NVCC

    if NVCC is None:
        pytest.skip("no nvcc")
    from diffusers_fastpath.ops import _build

    calls = "".join(f"  print({', '.join(map(str, case))});\n" for case in cases)
    (tmp_path / "host.cu").write_text(f'#include <cstdio>\n#include "{source}"\n'
                                      f"using namespace diffusers_fastpath;\n{print_fn}int main() {{\n{calls}}}\n")
    proc = subprocess.run([NVCC, "-std=c++17", f"-I{_build.csrc_dir()}", *_build.KERNEL_DEFINES,
                           str(tmp_path / "host.cu"), "-o", str(tmp_path / "host")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return subprocess.run([str(tmp_path / "host")], capture_output=True, text=True, check=True).stdout.splitlines()


def test_fused_shape_matches_the_cu(tmp_path):
    """The Python `fused_shape` against the .cu's fused_shape, compiled and run on the host (no GPU: num_sms() is
    132)."""
    out = host_output(tmp_path, "void print(long b, long s, long r, long c, int v) {\n  FusedShape f;\n"
                      '  if (!fused_shape(b, s, r, c, v, num_sms(), f)) { std::printf("none\\n"); return; }\n'
                      '  std::printf("%u %u %u %u\\n", f.grid.x, f.grid.y, f.block.x, f.block.y);\n}\n',
                      FUSED_SHAPE_CASES)
    want = []
    for b, s, r, c, v in FUSED_SHAPE_CASES:
        shape = pcr.fused_shape(b, s, pcr.MeanOrder(r, c, 0.0), v, 132)
        want.append("none" if shape is None else f"{shape[0][0]} {shape[0][1]} {shape[1][0]} {shape[1][1]}")
    assert out == want and "none" in want


def test_nvrtc_fused_launcher_passes_what_bindings_cpp_passes(monkeypatch):
    """The fused kernel's NVRTC launch: its parameters field by field as bindings_vae.cpp's per_channel_rmsnorm_fused
    fills them (mean null, the order after the struct), the .cu's vectors-or-elements choice and `fused_shape`; probe
    mode 3 writes [B, S]."""
    from test_nvrtc import captured_launches  # noqa: F401 - the fixture's body, called directly below

    launches = captured_launches.__wrapped__(monkeypatch)
    x = _x((1, 1024, 6144), torch.bfloat16)
    out = pcr._nvrtc_fused(x, EPS, True, 4, 16, 2.0**-10, 0)
    kernel, key, grid, block, a = launches[-1]
    assert (kernel, key, grid, block) == (pcr._NVRTC_FUSED, (torch.bfloat16, True), (384, 1, 1), (2, 32, 1))
    assert out.shape == x.shape and out.is_contiguous() and out.dtype == x.dtype
    assert (a.a.out, a.a.x, a.a.mean, a.a.batch, a.a.channels, a.a.spatial, a.a.x_batch_stride, a.a.x_channel_stride,
            a.a.silu, a.a.probe, a.a.dtype) == (out.data_ptr(), x.data_ptr(), None, 1, 1024, 6144, 1024 * 6144, 6144,
                                                1, 0, 1)
    assert (a.rows, a.ctas, a.factor) == (4, 16, 2.0**-10) and a.a.eps == struct.unpack("f", struct.pack("f", EPS))[0]
    sliced = _x((2, 24, 5, 4, 8), torch.float16)[:, :, 2:].reshape(2, 24, -1)  # channels apart
    mean = pcr._nvrtc_fused(sliced, 1e-6, False, 1, 1, pcr.mean_factor(2, 24, 96), pcr.PROBE_MEAN)
    _, key, grid, block, a = launches[-1]
    assert mean.shape == (2, 96) and a.a.out == mean.data_ptr() and (a.a.probe, a.a.silu, a.a.dtype) == (3, 0, 0)
    assert key == (torch.float16, True) and (a.a.x_batch_stride, a.a.x_channel_stride) == (24 * 160, 160)
    assert (grid, block) == ((12, 2, 1), (1, 4, 1)) and a.factor == pcr.mean_factor(2, 24, 96)
    odd = _x((1, 16, 95), torch.float32)
    pcr._nvrtc_fused(odd, EPS, False, 1, 1, 1 / 16, 0)
    assert launches[-1][1] == (torch.float32, False) and launches[-1][2:4] == ((95, 1, 1), (1, 4, 1))
    with pytest.raises(ValueError, match="scratch"):
        pcr._nvrtc_fused(_x((1, 8, 8), torch.bfloat16), EPS, False, 256, 16, 1 / 8, 0)


def test_raw_fused_guard_refuses_what_bindings_cpp_refuses():
    x = _x((2, 16, 96), torch.bfloat16)
    assert pcr._raw_fused_guard(x, EPS, False, 4, 1, 1 / 16, 0) == "device"
    assert pcr._raw_fused_guard(x.view(2, 16, 12, 8), EPS, False, 4, 1, 1 / 16, 0) == "x"
    assert pcr._raw_fused_guard(x.transpose(1, 2), EPS, False, 4, 1, 1 / 16, 0) == "x"
    assert pcr._raw_fused_guard(x.double(), EPS, False, 4, 1, 1 / 16, 0) == "x"
    assert pcr._raw_fused_guard(x, EPS, True, 4, 1, 1 / 16, pcr.PROBE_MEAN) == "probe"
    assert pcr._raw_fused_guard(x, EPS, False, 4, 1, 1 / 16, pcr.PROBE_RMS) == "probe"
    for rows, ctas in ((3, 1), (0, 1), (1024, 1), (4, 0), (4, 65537)):
        assert pcr._raw_fused_guard(x, EPS, False, rows, ctas, 1 / 16, 0) == "order", (rows, ctas)
    assert pcr._raw_fused_guard(x, EPS, False, 512, 65536, 1 / 16, pcr.PROBE_MEAN) == "device"


# --- GPU ---------------------------------------------------------------------------------------------------------

# The LTX-2 decoder (decoder_block_out_channels (256, 512, 1024), three x2 spatiotemporal upsamplings, 121 frames) on
# a 768x512 video, latents [1, 128, 16, 16, 24]: the mid block's resnets at 1024 channels, the first up block's at 512
# (31 frames of 32x48), norm_out at 128 (121 frames of 128x192, the largest).
DECODER_SHAPES = [(1, 1024, 16, 16, 24), (1, 512, 31, 32, 48), (1, 128, 121, 128, 192), (1, 256, 61, 64, 96)]
# The encoder's on the same video, where aten splits the channels across 6 and 32 blocks per output (132 SMs)
ENCODER_SHAPES = [(1, 1024, 31, 32, 48), (1, 2048, 16, 16, 24), (1, 256, 121, 64, 96)]


def _gpu_input(shape, dtype, layout="contiguous", seed=0):
    b, c, t, h, w = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(b, c, t + (layout == "sliced"), h, w, generator=gen, device="cuda") * 3).to(dtype)
    x = x[:, :, 1:] if layout == "sliced" else x
    x[:, :, 0, 0, :5] = 0  # positions whose channels are all zero (sqrt of eps)
    x[:, :, 0, 1, :7] *= 1e-4  # means near eps
    x[:, :, 0, 2, :3] *= 3e-5
    x[0, 1, 0, 3, :2] = float("inf")
    x[0, 2, 0, 3, 2] = float("nan")
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("silu", [False, True], ids=["norm", "pair"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", DECODER_SHAPES, ids=str)
@torch.no_grad()
def test_kernel_equals_eager_at_ltx2_decoder_shapes(shape, dtype, silu):
    """The op (its proofs included) against the module, bits (NaN payloads too) and strides, the allocator's blocks of
    the output's size poisoned with NaN first; x contiguous (the decoder's), and at the first shape with its first
    frame sliced off (channels apart); the fused kernel's statistics ran (aten's mean for fp32 over 1024 channels)."""
    vae_ltx2_norm.norm_fits()
    norm = PerChannelRMSNorm()
    op = pcr.PER_CHANNEL_RMSNORM_SILU if silu else pcr.PER_CHANNEL_RMSNORM
    for layout in ("contiguous", "sliced") if shape == DECODER_SHAPES[0] else ("contiguous",):
        x = _gpu_input(shape, dtype, layout)
        ref = F.silu(norm(x)) if silu else norm(x)
        poison = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for _ in range(3)]  # the next blocks
        del poison
        site, before = Site(op.name), dict(pcr.MEAN_FALLBACKS)
        out = op(site, norm, x)
        assert site.fast == 1, (dict(site.fallback), op.status)
        assert out.stride() == ref.stride() and tensors_equal(out, ref), layout
        order = pcr.mean_order(x)  # the fused kernel's statistics but for fp32 over 1024 channels (aten's mean)
        assert (type(order) is pcr.MeanOrder) is not (dtype == torch.float32 and shape[1] % 1024 == 0), order
        assert (dict(pcr.MEAN_FALLBACKS) == before) is (type(order) is pcr.MeanOrder)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", ENCODER_SHAPES, ids=str)
@torch.no_grad()
def test_kernel_equals_eager_at_ltx2_encoder_shapes(shape, dtype):
    """The pair at the encoder's shapes (aten's mean split across 6 and 32 blocks per output on 132 SMs), poisoned
    outputs, against the module and F.silu."""
    vae_ltx2_norm.norm_fits()
    norm = PerChannelRMSNorm()
    x = _gpu_input(shape, dtype)
    ref = F.silu(norm(x))
    poison = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for _ in range(3)]
    del poison
    site = Site("per_channel_rmsnorm_silu")
    out = pcr.per_channel_rmsnorm_silu(norm, x, site)
    assert site.fast == 1 and tensors_equal(out, ref), (dict(site.fallback), pcr.PER_CHANNEL_RMSNORM_SILU.status)


# (B, C, T, H, W): every kind of aten launch (ovs 4 / 2 / 1, one thread per output, rows of 4 .. 128, ctas 1, uneven,
# more than rows), batches, non-power-of-two C (factor), the decoder's and encoder's shapes
MEAN_CASES = [
    *DECODER_SHAPES, *ENCODER_SHAPES, (2, 1024, 16, 16, 24), (1, 1024, 15, 16, 24), (3, 24, 1, 4, 24),
    (1, 63, 1, 64, 64), (1, 96, 1, 2, 2049), (1, 256, 1, 1, 4097), (1, 127, 2, 3, 683), (1, 1024, 1, 2, 3),
    (1, 16, 1, 2, 4), (3, 333, 1, 1, 7),
    (1, 1100, 3, 32, 32), (2, 520, 5, 8, 8), (1, 2048, 1, 8, 12), (1, 4096, 1, 16, 24), (2, 3, 4, 5, 6),
]


def _spread_input(shape, dtype, seed=0, layout="contiguous"):
    b, c, t, h, w = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    full = (b, c, t + (layout == "sliced"), h, w)
    spread = 1.0 if dtype == torch.float16 else 3.0
    x = (torch.randn(full, generator=gen, device="cuda") * torch.exp(torch.randn(full, generator=gen, device="cuda")
                                                                     * spread)).to(dtype)
    return x[:, :, 1:] if layout == "sliced" else x


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@torch.no_grad()
def test_the_fused_mean_is_atens_mean(dtype):
    """The fused kernel's statistics alone (probe mode 3) against ``torch.mean(x**2, dim=1)`` on this GPU, bit for
    bit, at every kind of aten launch `mean_order` derives (values over several decades, where another order gives
    other means; inf and NaN; x with its first frame sliced off); where it keeps aten's mean, the reason."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    checked = 0
    for i, shape in enumerate(MEAN_CASES):
        for layout in ("contiguous", "sliced") if shape[2] > 1 else ("contiguous",):
            x = _spread_input(shape, dtype, i, layout)
            if i == 0 and layout == "contiguous":
                x = _gpu_input(shape, dtype)  # zeros, means near eps, inf, NaN
            order = pcr.mean_order(x)
            if type(order) is not pcr.MeanOrder:
                assert dtype == torch.float32 and shape[1] % 1024 == 0, (shape, order)
                continue
            b, c = x.shape[:2]
            got = pcr._launch_fused(x.reshape(b, c, -1), EPS, False, order.rows, order.ctas, order.factor,
                                    pcr.PROBE_MEAN)
            want = torch.mean(x**2, dim=1, keepdim=True)
            assert tensors_equal(got.view(want.shape), want), (shape, layout, order)
            checked += 1
    assert checked > len(MEAN_CASES) // 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@torch.no_grad()
def test_element_kernel_equals_eager(dtype):
    """The one-element-per-thread kernel: a trailing size of no multiple of the vector, and x 2 bytes off 16."""
    vae_ltx2_norm.norm_fits()
    norm = PerChannelRMSNorm()
    odd = _gpu_input((2, 20, 3, 5, 7), dtype)
    offset = torch.empty(2 * 20 * 3 * 4 * 8 + 1, dtype=dtype, device="cuda")[1:].view(2, 20, 3, 4, 8)
    offset.copy_(_gpu_input((2, 20, 3, 4, 8), dtype))
    for x in (odd, offset):
        for op in (pcr.PER_CHANNEL_RMSNORM, pcr.PER_CHANNEL_RMSNORM_SILU):
            site = Site(op.name)
            ref = F.silu(norm(x)) if op is pcr.PER_CHANNEL_RMSNORM_SILU else norm(x)
            out = op(site, norm, x)
            assert site.fast == 1 and tensors_equal(out, ref), (op.name, dict(site.fallback), op.status)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@torch.no_grad()
def test_the_proofs_pass_on_every_value(dtype):
    """The kernel's r (probe mode 2) equals eager's ``torch.sqrt(m + eps)`` and its SiLU (mode 1) eager's ``F.silu``
    on every value of the dtype, both ways the kernel runs (fp32: all 2^32 bit patterns; timed for the docs)."""
    import time

    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    norm = PerChannelRMSNorm()
    x = torch.zeros(1, 8, 8, dtype=dtype, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    assert pcr._prove_rms(norm, x) and pcr._prove_rms_silu(norm, x)
    print(f"{dtype} proofs: {time.perf_counter() - start:.3f} s")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@torch.no_grad()
def test_through_nvrtc_equals_nvcc_and_eager(dtype):
    """The NVRTC cubins' launches (aten's mean then the first kernel; the fused kernel, its mean probe too) against the
    nvcc extension's ops (where a toolkit built them) and eager, at LTX-2's largest norm (norm_out: 128 channels, 121
    frames of 128x192) and at 1024 channels with channels apart (16 blocks per output in aten); the probe modes."""
    from test_nvrtc import both_ways

    nvcc = both_ways.__wrapped__()
    norm = PerChannelRMSNorm()
    for shape, layout in ((DECODER_SHAPES[2], "contiguous"), (DECODER_SHAPES[0], "sliced")):
        x = _gpu_input(shape, dtype, layout)
        x3 = x.reshape(x.shape[0], x.shape[1], -1)
        mean = torch.mean(x**2, dim=1, keepdim=True).reshape(x.shape[0], -1)
        for silu in (False, True):
            ref = (F.silu(norm(x)) if silu else norm(x)).reshape(x3.shape)
            got = pcr._nvrtc_kernel(x3, mean, EPS, silu, 0)
            assert tensors_equal(got, ref), (layout, silu)
            if nvcc:
                assert tensors_equal(torch.ops.diffusers_fastpath._per_channel_rmsnorm_cuda(x3, mean, EPS, silu, 0),
                                     ref)
        order = pcr.mean_order(x)
        if type(order) is pcr.MeanOrder:
            for silu in (False, True):
                ref = (F.silu(norm(x)) if silu else norm(x)).reshape(x3.shape)
                got = pcr._nvrtc_fused(x3, EPS, silu, order.rows, order.ctas, order.factor, 0)
                assert tensors_equal(got, ref), (layout, silu, order)
                if nvcc:
                    assert tensors_equal(torch.ops.diffusers_fastpath._per_channel_rmsnorm_fused_cuda(
                        x3, EPS, silu, order.rows, order.ctas, order.factor, 0), ref)
            assert tensors_equal(pcr._nvrtc_fused(x3, EPS, False, order.rows, order.ctas, order.factor,
                                                  pcr.PROBE_MEAN), mean)
    row = (every_value(dtype, "cuda") if dtype != torch.float32 else
           torch.arange(-(1 << 20), 1 << 20, dtype=torch.int32, device="cuda").view(torch.float32)).reshape(1, 1, -1)
    for probe, want in ((pcr.PROBE_SILU, F.silu(row)), (pcr.PROBE_RMS, torch.sqrt(row + EPS))):
        got = pcr._nvrtc_kernel(row, None, EPS, False, probe)
        assert tensors_equal(got, want), probe
        if nvcc:
            assert tensors_equal(torch.ops.diffusers_fastpath._per_channel_rmsnorm_cuda(row, None, EPS, False, probe),
                                 want)
