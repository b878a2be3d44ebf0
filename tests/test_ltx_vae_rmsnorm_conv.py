"""LTX-Video's VAE norm -> SiLU -> causal convolution as one op (ops/ltx_vae_rmsnorm_conv.py: the norm's multiply, cast
and SiLU written straight into the convolution's padded channels-last input by csrc/causal_pad.cu's
ltx_rmsnorm_pad_cl_kernel; the joined call of models/vae_ltx2_chain.py in LTX-Video's form). On CPU: the kernel's
arithmetic against the eager modules' padded input, the op against the modules (causal and not, x with its channels
apart), the wrapper's launch, the rewrite's bare-call rule, the refusals (hooks on each module, a dropout in training
mode, fp32, no bias, another activation) run as written, the tail's proof and a planted mismatch in it, the NVRTC
launcher and raw guard. The VAE-level tests (every site, tiling, counts) are in test_vae_ltx.py. On the GPU: the op at
the decoder's real shapes (bf16 / fp16, contiguous and sliced x, outputs poisoned first), the kernel through NVRTC and
nvcc against eager, and the tail's proof on every value. The fused kernel (csrc/per_channel_rmsnorm_pad.cu's pad kernel
with kLtx: aten's mean of the fp32 squares in aten's order, the rsqrt, the tail, from x): on CPU its order against
aten's reduce kernel simulated thread by thread, the premise that eager's fp32 squares keep x's channel-first order,
its arithmetic against eager's padded input, the wrapper's launch, the orders at the decoder's shapes, the rsqrt's
proof and a planted mismatch in it, its NVRTC launchers and raw guards; on the GPU its mean (probe 3) and its buffer
against eager both ways at every decoder norm shape, and the rsqrt's proof on every fp32 value."""

from __future__ import annotations

import ast
import importlib
import struct
import textwrap

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.autoencoders import autoencoder_kl_ltx as ltx
from diffusers.models.normalization import RMSNorm
from torch import nn

import diffusers_fastpath as fp
from diffusers_fastpath._state import SITE_ATTR
from diffusers_fastpath.models import vae_ltx, vae_ltx2_chain, vae_ltx_conv
from diffusers_fastpath.ops._policy import REASON_DISABLED, Site, bits, tensors_equal
from diffusers_fastpath.testing._common import randomize_
from test_vae_ltx import _build, _decode, _latents

chain = importlib.import_module("diffusers_fastpath.ops.ltx_vae_rmsnorm_conv")  # (ops binds the names to the ops)
ltx_norm = importlib.import_module("diffusers_fastpath.ops.ltx_vae_rmsnorm")
causal_conv_pad = importlib.import_module("diffusers_fastpath.ops.causal_conv_pad")
OP = chain.LTX_VAE_RMSNORM_CONV


def _modules(cin=16, cout=8, causal=True, dtype=torch.bfloat16, seed=1, bias=True):
    """A patched norm, an ``nn.SiLU`` and a patched ``LTXVideoCausalConv3d`` (what the adapter makes of them)."""
    norm = RMSNorm(cin, eps=1e-8, elementwise_affine=False)
    norm.__class__ = vae_ltx.FastpathLTXRMSNorm
    conv = randomize_(ltx.LTXVideoCausalConv3d(cin, cout, 3, is_causal=causal), seed).to(dtype)
    if not bias:
        conv.conv.bias = None
    conv.__class__ = vae_ltx_conv.FastpathLTXVideoCausalConv3d
    conv.__dict__[SITE_ATTR] = Site("ltx_causal_conv3d")
    return norm, nn.SiLU(), conv


def _x(shape=(2, 16, 3, 4, 8), dtype=torch.bfloat16, sliced=False, seed=2):
    """x ``[B, C, T, H, W]``: contiguous, or with its first frame sliced off (channels apart, as the upsamplers leave
    it); zeros scattered and one position whose channels are all zero (rsqrt of eps)."""
    b, c, t, h, w = shape
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, c, t + sliced, h, w, generator=gen) * 3).to(dtype)
    x = x[:, :, 1:] if sliced else x
    x[:, 1::5, ..., ::3] = 0
    x[0, :, 0, 0, 0] = 0
    return x


def _eager(norm, act, conv, x):
    """The block's statements: the norm on the channel-last view, moved back, the SiLU, the convolution's call."""
    return conv(act(ltx_norm.ltx_rmsnorm_ref(norm, x.movedim(1, -1)).movedim(-1, 1)))


# --- the arithmetic and the op on CPU ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("sliced", [False, True], ids=["contiguous", "sliced"])
def test_arithmetic_is_the_padded_input_eager_convolves(sliced, causal, dtype):
    """`norm_pad_arithmetic` (the kernel's documentation in code) on x and aten's reciprocal is, bit for bit and in
    layout (channels-last), what eager's convolution reads: the module's own padding statements (the first frame
    repeated, or the first and the last) of the SiLU of the norm."""
    norm, act, conv = _modules(causal=causal, dtype=dtype)
    x = _x(dtype=dtype, sliced=sliced)
    view = x.movedim(1, -1)
    y = act(RMSNorm.forward(norm, view).movedim(-1, 1))
    k = conv.kernel_size[0]
    if causal:
        want = torch.concatenate([y[:, :, :1].repeat((1, 1, k - 1, 1, 1)), y], dim=2)
    else:
        want = torch.concatenate([y[:, :, :1].repeat((1, 1, (k - 1) // 2, 1, 1)), y,
                                  y[:, :, -1:].repeat((1, 1, (k - 1) // 2, 1, 1))], dim=2)
    padding, _, reflect = chain._conv._plan(conv, None)
    r = ltx_norm.reciprocal(view, norm.eps).contiguous().view(x.shape[0], -1)
    got = chain.norm_pad_arithmetic(x, r, padding, reflect)
    assert got.is_contiguous(memory_format=torch.channels_last_3d) and torch.equal(bits(got), bits(want))


@torch.no_grad()
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("sliced", [False, True], ids=["contiguous", "sliced"])
def test_op_equals_the_modules(sliced, causal, emulated_kernels):
    """The op (its own code: aten's reciprocal with the squares kernel where x is dense, the launch, the convolution
    channels-last) equals the block's statements, its first call checked against eager (the site fast, the
    signature verified)."""
    norm, act, conv = _modules(causal=causal)
    x = _x(sliced=sliced)
    ref = _eager(norm, act, conv, x)
    site = Site(OP.name)
    out = chain.ltx_vae_rmsnorm_conv(norm, act, conv, x, None, site)
    assert out.stride() == ref.stride() and torch.equal(out, ref)
    assert site.fast == 1 and not site.fallback and OP.disabled is None
    assert {key[0] for key in OP.verified} == {("bfloat16", "strided" if sliced else "dense")}


def test_kernel_wrapper_hands_the_launch_what_it_takes(monkeypatch, emulated_kernels):
    """Where the fused kernel does not reproduce aten's order (`mean_order`'s reason), `_kernel` gives the pair's pad
    kernel x as it is (channels apart too), aten's reciprocal as contiguous ``[B, T*H*W]`` fp32 rows, the
    convolution's time padding (causal: k - 1 frames before; non-causal: one each side) and no reflection."""
    seen = []
    monkeypatch.setattr(chain, "_mean_order", lambda x: "a reason")

    def launch(x, r, padding, reflect_hw):
        seen.append((x.data_ptr(), x.stride(), tuple(r.shape), r.dtype, r.is_contiguous(), list(padding), reflect_hw))
        return chain.norm_pad_arithmetic(x, r, padding, reflect_hw)

    monkeypatch.setattr(chain, "_launch", launch)
    for causal, padding in ((True, [0, 0, 0, 0, 2, 0]), (False, [0, 0, 0, 0, 1, 1])):
        norm, act, conv = _modules(causal=causal)
        x = _x(sliced=True)
        seen.clear()
        assert torch.equal(chain._kernel(norm, act, conv, x), _eager(norm, act, conv, x))
        assert seen == [(x.data_ptr(), x.stride(), (2, 3 * 4 * 8), torch.float32, True, padding, False)]


@torch.no_grad()
def test_guard_refuses_what_the_kernel_does_not_take():
    """Refused with the reason (never raised): another activation, fp32 (the norm's kernels refuse it, as the
    convolution's channels-last path does), a convolution without bias (its channels-first path), x not 5-D, a
    weighted norm, x's layout the norm's kernel does not read; a CPU x passes every other check (the device last)."""
    norm, act, conv = _modules()
    x = _x()
    assert OP.guard(norm, act, conv, x) == "device cpu"
    assert OP.guard(norm, nn.GELU(), conv, x) == "GELU is not nn.SiLU"
    assert OP.guard(norm, act, conv, x.float()) == "dtype float32"
    assert OP.guard(norm, act, _modules(bias=False)[2], x) == "the convolution's channels-first path"
    assert OP.guard(norm, act, conv, x[0]) == "x not [B, C, T, H, W]"
    assert OP.guard(norm, act, conv, "x") == "x not [B, C, T, H, W]"
    weighted = vae_ltx.FastpathLTXRMSNorm(16, eps=1e-8)
    assert OP.guard(weighted, act, conv, x) == "norm with weight or bias"
    assert OP.guard(norm, act, conv, x.contiguous(memory_format=torch.channels_last_3d)) == (
        "x not the channel-last view of channel-first memory")
    assert OP.guard(norm, act, conv, x, 1) == "causal not a bool"


@torch.no_grad()
@pytest.mark.parametrize("hooked", ["norm", "act", "conv", "inner"])
def test_hooks_on_any_module_refuse_and_the_modules_run(hooked, emulated_kernels):
    """The op stands for the three module calls: a hook on the norm, the SiLU, the convolution (or its inner
    ``nn.Conv3d``) refuses it, counted, and the fallback calls the modules, so the hook runs and sees what it sees
    unpatched."""
    norm, act, conv = _modules()
    x = _x()
    ref = _eager(norm, act, conv, x)
    target = {"norm": norm, "act": act, "conv": conv, "inner": conv.conv}[hooked]
    seen = []
    handle = target.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    site = Site(OP.name)
    try:
        assert torch.equal(chain.ltx_vae_rmsnorm_conv(norm, act, conv, x, None, site), ref)
    finally:
        handle.remove()
    assert len(seen) == 1 and site.fast == 0
    reason = "the convolution has hooks" if hooked == "inner" else f"{type(target).__name__} has hooks"
    assert dict(site.fallback) == {reason: 1}


@torch.no_grad()
@pytest.mark.parametrize("planted", [None, 0x3F80, -0x0080, 0x7FC1, 0x0001], ids=str)
def test_a_tail_proof_that_fails_disables_the_op(planted, monkeypatch, emulated_kernels):
    """The proof runs the kernel on every bf16 value with the reciprocal 1 (`tail_probe`, against eager's chain,
    `tail_ref`) on the first call of a signature: one value off anywhere (1.0, -0.0, a NaN's payload, a subnormal)
    disables the op, that call's result eager's; the pair and the norm stay on."""
    def launch(x, r, padding, reflect_hw):
        out = chain.norm_pad_arithmetic(x, r, padding, reflect_hw)
        if planted is not None and not any(padding):  # (the proof's row: nothing padded, x's shape)
            bits(out)[bits(x) == planted] += 1
        return out

    monkeypatch.setattr(chain, "_launch", launch)
    monkeypatch.setattr(OP, "prove", chain._prove)
    _rsqrt_proof_on_a_part(monkeypatch)
    norm, act, conv = _modules()
    x = _x(shape=(1, 16, 2, 2, 8))
    site = Site(OP.name)
    assert torch.equal(chain.ltx_vae_rmsnorm_conv(norm, act, conv, x, None, site), _eager(norm, act, conv, x))
    assert (site.fast == 1) is (planted is None), (site, OP.status)
    if planted is not None:
        assert "not bit-exact" in OP.disabled and dict(site.fallback) == {REASON_DISABLED: 1}
        assert ltx_norm.LTX_VAE_RMSNORM_SILU.disabled is None and ltx_norm.LTX_RMSNORM.disabled is None


def _rsqrt_proof_on_a_part(monkeypatch, planted=None):
    """The reciprocal's proof on CPU: its probe the torch arithmetic (`planted`: one fp32 bit pattern off by one ulp),
    `prove_fp32` on the bit patterns of [0.5, 2) and of the NaNs above +inf's (2^32 values take a GPU), nothing
    proven yet."""
    import functools

    from diffusers_fastpath.ops import _unary_proof

    def probe(m, eps):
        out = chain.rsqrt_ref(eps)(m)
        if planted is not None:
            bits(out)[bits(m) == planted] += 1
        return out

    def part(device, probe_row, ref):
        low, high = 0x3F000000, 0x40000000  # [0.5, 2): 1.0 and its neighbours
        return all(_unary_proof.prove_fp32(device, probe_row, ref, start=a, stop=b, chunk=1 << 16)
                   for a, b in ((low, high), (0x7F800000, 0x7F810000)))

    monkeypatch.setattr(chain, "_launch_rsqrt", probe)
    monkeypatch.setattr(chain, "prove_fp32", part)
    monkeypatch.setattr(chain, "_RSQRT_PROVEN", set())


@torch.no_grad()
@pytest.mark.parametrize("planted", [None, 0x3F800000, 0x3F7FFFFF, 0x7F800001], ids=str)
def test_a_reciprocal_proof_that_fails_disables_the_op(planted, monkeypatch, emulated_kernels):
    """Where the fused kernel runs (x dense), the first call of a signature also proves its ``rsqrtf(m + eps)`` on
    every fp32 value against eager's ``torch.rsqrt(m + eps)`` (`_prove_rsqrt`, once per device and eps): one value off
    (1.0, the float below it, a NaN's payload) disables the op, that call's result eager's; a pass is remembered."""
    monkeypatch.setattr(OP, "prove", chain._prove)
    monkeypatch.setattr(chain, "tail_probe", chain.tail_ref)  # (the tail's proof passes: this test is the rsqrt's)
    _rsqrt_proof_on_a_part(monkeypatch, planted)
    norm, act, conv = _modules()
    x = _x(shape=(1, 16, 2, 2, 8))
    site = Site(OP.name)
    assert torch.equal(chain.ltx_vae_rmsnorm_conv(norm, act, conv, x, None, site), _eager(norm, act, conv, x))
    assert (site.fast == 1) is (planted is None), (site, OP.status)
    assert chain._RSQRT_PROVEN == ({(x.device, 1e-8)} if planted is None else set())
    if planted is not None:
        assert "not bit-exact" in OP.disabled and dict(site.fallback) == {REASON_DISABLED: 1}


def test_the_tail_probe_runs_the_kernel_on_a_row(monkeypatch):
    """`tail_probe` hands the kernel a ``[1, 1, 1, 1, n]`` x (any n: the kernel reads elements), a ``[1, n]`` fp32
    reciprocal of ones and no padding, and returns the row; `tail_ref` is eager's chain with that reciprocal."""
    seen = []

    def launch(x, r, padding, reflect_hw):
        seen.append((tuple(x.shape), tuple(r.shape), r.dtype, bool((r == 1).all()), list(padding), reflect_hw))
        return chain.norm_pad_arithmetic(x, r, padding, reflect_hw)

    monkeypatch.setattr(chain, "_launch", launch)
    row = torch.randn(1, 1, 65537).to(torch.float16)
    assert torch.equal(chain.tail_probe(row), F.silu(row))
    assert torch.equal(chain.tail_ref(row), F.silu(row))
    assert seen == [((1, 1, 1, 1, 65537), (1, 65537), torch.float32, True, [0] * 6, False)]


# --- the fused kernel: aten's mean of the fp32 squares in the kernel -----------------------------------------------

H100 = (132, 2048)  # (SMs, threads per SM) of an H100 / H200


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_eagers_fp32_squares_keep_xs_layout_where_x_is_dense(dtype):
    """The premise of `mean_order`: eager's ``x.movedim(1, -1).to(float32).pow(2)`` keeps x's memory order, dense:
    x's strides where x is dense, and where x's channels lie apart (a sliced upsampler output) dense strides in the
    same order; either way channel-first fp32 squares (the mean reduces a dim of stride T H W over contiguous
    positions: the iterator LTX-2's [C, S, B]). (The same `_to_copy` and iterator code runs on CUDA.)"""
    for sliced in (False, True):
        view = _x(dtype=dtype, sliced=sliced).movedim(1, -1)
        squares = view.to(torch.float32).pow(2)
        assert squares.movedim(-1, 1).is_contiguous(), sliced
        assert squares.stride() == view.stride() or sliced


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_mean_arithmetic_is_reduce_cuh_thread_by_thread(dtype):
    """The fused kernel's statistics with kLtx (`ltx_mean_arithmetic`, and the kernel's own units and scratch as its
    code reads, LTX-2's emulation of it run on the fp32 squares) equal aten's reduce kernel simulated thread by thread
    on eager's fp32 squares (nothing rounded to the dtype: squares and mean fp32), bit for bit, over configurations of
    every kind; the plain sum gives other means."""
    from test_per_channel_rmsnorm import ORDER_CASES, _aten_sum_thread_by_thread, _kernel_scratch_mean

    pcr = chain._pcr
    gen = torch.Generator().manual_seed(3)
    naive_differs = 0
    for b, c, s, limits in ORDER_CASES:
        spread = 1.0 if dtype == torch.float16 else 3.0
        x = (torch.randn(b, c, s, generator=gen) * torch.exp(torch.randn(b, c, s, generator=gen) * spread)).to(dtype)
        cfg = pcr.aten_reduce_config(b, c, s, *limits)
        order = pcr.order_of(cfg, b, c, s)
        q = x.float() * x.float()  # eager's pow(2) of the fp32 upcast: exact
        total = _aten_sum_thread_by_thread(q, cfg)
        want = total * torch.tensor(order.factor, dtype=torch.float32)
        got = chain.ltx_mean_arithmetic(x, order)
        assert got.dtype == torch.float32 and tensors_equal(got, want), (b, c, s, limits)
        assert tensors_equal(_kernel_scratch_mean(x.float(), order), want), (b, c, s, limits)
        naive_differs += not torch.equal(q.sum(1) * order.factor, want)
    assert naive_differs >= len(ORDER_CASES) - 1


def test_mean_order_at_ltx_video_shapes():
    """aten's order of the fp32 mean at the decoder's shapes (132 SMs: 4 rows, one block per output; the factor
    1 / C), as LTX-2's port derives it for an fp32 input, x's channels apart alike; refused with the reason: C a
    multiple of 1024 (fp32), one channel, a CPU x without stand-in limits."""
    pcr = chain._pcr
    for shape in ((1, 512, 16, 16, 24), (1, 512, 31, 32, 48), (1, 256, 61, 64, 96), (1, 128, 121, 128, 192)):
        x = torch.empty(shape, dtype=torch.bfloat16)
        assert chain.mean_order(x, H100) == pcr.MeanOrder(4, 1, 1.0 / shape[1]), shape
    x = torch.empty(1, 512, 17, 16, 24, dtype=torch.float16)
    assert chain.mean_order(x[:, :, 1:], H100) == pcr.MeanOrder(4, 1, 1 / 512)  # (channels apart: the same order)
    assert chain.mean_order(torch.empty(1, 1024, 2, 16, 24, dtype=torch.bfloat16), H100).startswith("fp32 over")
    assert chain.mean_order(torch.empty(1, 1, 2, 16, 24, dtype=torch.bfloat16), H100).startswith("one position")
    assert chain.mean_order(torch.empty(1, 512, 2, 16, 24, dtype=torch.bfloat16)) == "not on a CUDA device"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_fused_arithmetic_is_the_padded_input_eager_convolves(causal, dtype):
    """`fused_pad_arithmetic` (the fused kernel's documentation in code) on x ``[B, C, S]`` and eager's fp32 mean of
    squares is, bit for bit and in layout, what eager's convolution reads (the module's padding statements of the
    SiLU of the norm)."""
    from test_ltx_causal_conv import _eager_buffer

    norm, act, conv = _modules(causal=causal, dtype=dtype)
    x = _x(dtype=dtype)
    view = x.movedim(1, -1)
    want = _eager_buffer(conv, act(RMSNorm.forward(norm, view).movedim(-1, 1)), causal)
    mean = view.to(torch.float32).pow(2).mean(-1).reshape(x.shape[0], -1)
    padding, _, reflect = chain._conv._plan(conv, None)
    got = chain.fused_pad_arithmetic(x.reshape(*x.shape[:2], -1), mean, norm.eps, True, x.shape[2:], padding, reflect)
    assert got.is_contiguous(memory_format=torch.channels_last_3d) and torch.equal(bits(got), bits(want))


def test_kernel_wrapper_hands_the_fused_launch_what_it_takes(monkeypatch, emulated_kernels):
    """`_kernel` runs the fused kernel alone: x as ``[B, C, S]`` (a view, channels apart too), the python eps, the
    SiLU, aten's order (`mean_order`), x's trailing dims, the convolution's time padding, no reflection, probe 0; no
    aten reduction, no pair kernel (their launches fail here); where no order is reproduced, the path before,
    counted by reason."""
    seen = []
    emulated = chain._launch_fused

    def launch(x, eps, silu, rows, ctas, factor, dims, padding, reflect_hw, probe):
        seen.append((x.data_ptr(), tuple(x.shape), x.stride(), eps, silu, rows, ctas, factor, list(dims),
                     list(padding), reflect_hw, probe))
        return emulated(x, eps, silu, rows, ctas, factor, dims, padding, reflect_hw, probe)

    def refused(*args):
        raise AssertionError("the path before ran")

    monkeypatch.setattr(chain, "_launch_fused", launch)
    monkeypatch.setattr(chain, "_launch", refused)
    for causal, padding in ((True, [0, 0, 0, 0, 2, 0]), (False, [0, 0, 0, 0, 1, 1])):
        norm, act, conv = _modules(causal=causal)
        for sliced in (False, True):
            x = _x(sliced=sliced)
            seen.clear()
            assert torch.equal(chain._kernel(norm, act, conv, x), _eager(norm, act, conv, x))
            assert seen == [(x.data_ptr(), (2, 16, 3 * 4 * 8), (x.stride(0), x.stride(1), 1), 1e-8, True, 1, 1,
                             1 / 16, [3, 4, 8], padding, False, 0)]
    monkeypatch.setattr(chain, "_launch", chain.norm_pad_arithmetic)
    monkeypatch.setattr(chain, "_mean_order", lambda x: "a reason")
    before = chain.MEAN_FALLBACKS["a reason"]
    seen.clear()
    assert torch.equal(chain._kernel(norm, act, conv, x), _eager(norm, act, conv, x)) and not seen
    assert chain.MEAN_FALLBACKS["a reason"] == before + 1


@torch.no_grad()
def test_the_signature_names_the_means_order(emulated_kernels):
    """A first-call check vouches for one order of the mean: the norm's signature, the order (channels, rows, ctas)
    or aten's own mean, the convolution's signature."""
    norm, act, conv = _modules()
    dense, sliced = chain._signature(norm, act, conv, _x()), chain._signature(norm, act, conv, _x(sliced=True))
    assert dense[:2] == (("bfloat16", "dense"), "mean of 16 in 1 x 1")
    assert sliced[:2] == (("bfloat16", "strided"), "mean of 16 in 1 x 1")
    assert chain._signature(norm, act, conv, _x(shape=(1, 1, 2, 4, 8)))[1] == "aten's mean"  # (one channel)


# --- the rewrite and the refusals in a VAE ------------------------------------------------------------------------


def _chains(code: str, keyword=None) -> str:
    body = ast.parse(textwrap.dedent(code)).body
    return ast.unparse(ast.fix_missing_locations(ast.Module(vae_ltx2_chain._Chains("ns", keyword).body(body), [])))


_PAIR = "x = ns.norm_act(self, 'n', 'a', x)"


def test_the_bare_call_that_ends_the_run_after_a_pair_is_joined():
    """LTX-Video's form (no argument names the convolution): the last ``V = self.X(V)`` of the run after the pair is
    taken for the convolution, the ones before it for the modules between; a call with an argument, another value's
    call or a statement that is no call ends the run; with a keyword (LTX-2's form) a bare call is not joined."""
    joined = "x = ns.norm_act_conv(self, 'n', 'a', ({}), '{}', x)"
    assert _chains(f"{_PAIR}\nx = self.c(x)\ny = 1") == joined.format("", "c") + "\ny = 1"
    assert _chains(f"{_PAIR}\nx = self.d(x)\nx = self.c(x)") == joined.format("'d',", "c")
    assert _chains(f"{_PAIR}\nx = self.c(x)\nx = self.c2(x, k=1)") == joined.format("", "c") + "\nx = self.c2(x, k=1)"
    assert _chains(f"{_PAIR}\nx = self.c(x)\ny = self.e(y)") == joined.format("", "c") + "\ny = self.e(y)"
    assert _chains(f"{_PAIR}\ny = self.c(x)") == f"{_PAIR}\ny = self.c(x)"
    assert _chains(f"{_PAIR}\nx = self.c(x)", "causal") == f"{_PAIR}\nx = self.c(x)"
    # across a branch that ends in the pair: the statements after the if move into both branches, joined in one
    code = f"if self.m is not None:\n    x = g(x)\nelse:\n    {_PAIR}\nx = self.d(x)\nx = self.c(x)"
    assert _chains(code).splitlines() == ["if self.m is not None:", "    x = g(x)", "    x = self.d(x)",
                                          "    x = self.c(x)", "else:", "    " + joined.format("'d',", "c")]


def test_the_blocks_forwards_join_each_pair_with_its_convolution():
    """The rewritten LTX-Video forwards: the resnet's two pairs joined with ``conv1`` and (past ``dropout``) ``conv2``,
    each norm_out with ``conv_out``, on the branch without the timestep modulate; nothing left pending; the modulated
    branches keep their statements."""
    import inspect

    resnet, encoder, decoder = (block.current() for block in vae_ltx.BLOCKS)
    assert vae_ltx2_chain._joined_convs(resnet.forward) == ("conv1", "conv2")
    assert vae_ltx2_chain._joined_convs(encoder.forward) == vae_ltx2_chain._joined_convs(decoder.forward) == (
        "conv_out",)
    source = inspect.getsource(resnet.forward)
    ns = "_diffusers_fastpath_vae_ltx"
    assert f"{ns}.norm_act_conv(self, 'norm2', 'nonlinearity', ('dropout',), 'conv2', hidden_states)" in source
    assert source.count("hidden_states = self.conv1(hidden_states)") == 1  # (the modulated branch's, as written)
    assert all("pending" not in inspect.getsource(b.forward) and "settled" not in inspect.getsource(b.forward)
               for b in (resnet, encoder, decoder))


def _chain_site(conv):
    return conv.__dict__[f"_fastpath_site_{OP.name}"]


@torch.no_grad()
def test_chain_refusals_in_the_vae_run_the_statements_as_written(emulated_kernels, unpatch_after):
    """In a patched VAE: a hook on a joined convolution (it sees the SiLU's result, as unpatched), a dropout in
    training mode (p 0: the identity, but not provably) refuse that chain, counted on its site; the pair then runs
    fused on its own site and the convolution's call; patched == unpatched; the other chains stay fast."""
    vae = _build()
    z = _latents(vae)
    seen = []
    resnet = vae.decoder.mid_block.resnets[0]

    def decode():
        handle = resnet.conv1.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
        resnet.dropout.train()
        try:
            return _decode(vae, z)
        finally:
            handle.remove()
            resnet.dropout.eval()

    ref, ref_seen = decode(), list(seen)
    seen.clear()
    unpatch_after(fp.patch(vae))
    assert torch.equal(decode(), ref) and len(seen) == len(ref_seen) == 1 and torch.equal(seen[0], ref_seen[0])
    assert dict(_chain_site(resnet.conv1).fallback) == {"FastpathLTXVideoCausalConv3d has hooks": 1}
    assert dict(_chain_site(resnet.conv2).fallback) == {"dropout in training mode": 1}
    assert resnet.norm1._fastpath_site_ltx_vae_rmsnorm_silu.fast == 1  # (the pair's own site, as written)
    assert resnet.norm2._fastpath_site_ltx_vae_rmsnorm_silu.fast == 1
    others = [r for r in fp.report(vae).sites if r.op == OP.name and r.site.startswith("decoder.")
              and ".mid_block.resnets.0." not in r.site]
    assert others and all(r.fast == 1 and not r.fallback for r in others), str(fp.report(vae))


@torch.no_grad()
def test_fp32_vae_chains_refuse_by_dtype(emulated_kernels, unpatch_after):
    """An fp32 VAE: every chain refused for its dtype (the norm's kernels, as the convolution's channels-last path),
    the statements as written; patched == unpatched."""
    vae = _build(dtype=torch.float32)
    z = _latents(vae).float()
    ref = _decode(vae, z)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref)
    chains = [r for r in fp.report(vae).sites if r.op == OP.name and r.site.startswith("decoder.")]
    assert chains and all(r.fast == 0 and set(r.reasons) == {"dtype float32"} for r in chains), str(fp.report(vae))


# --- the NVRTC launcher ---------------------------------------------------------------------------------------------


def test_nvrtc_launcher_passes_what_bindings_cpp_passes(monkeypatch):
    """The NVRTC way's launch of csrc/causal_pad.cu's norm kernels: causal_pad's arguments (channels-last, the frames
    repeated, no cache, x's strides) and the channels-last grid of the wide kernel (40 channels and columns: whole
    vectors) or of the tiled one (36 channels), then the reciprocal's pointer; the output padded in time,
    channels-last."""
    from test_nvrtc import captured_launches  # noqa: F401 - the fixture's body, called directly below

    launches = captured_launches.__wrapped__(monkeypatch)
    x = _x((2, 40, 5, 9, 40))[:, :, 1:4]  # a time slice: strided frames
    r = torch.rand(2, 3 * 9 * 40)
    out = chain._nvrtc_kernel(x, r, [0, 0, 0, 0, 1, 1], False)
    kernel, key, grid, block, a = launches[-1]
    assert (kernel, key, block) == (chain._NVRTC_WIDE, torch.bfloat16, (128, 1, 1))
    assert out.shape == (2, 40, 5, 9, 40) and out.is_contiguous(memory_format=torch.channels_last_3d)
    assert grid == (1, 2, 2 * 5 * 9)
    assert (a.a.out, a.a.x, a.a.cache, a.a.batch, a.a.channels, a.a.frames, a.a.height, a.a.width) == (
        out.data_ptr(), x.data_ptr(), None, 2, 40, 3, 9, 40)
    assert (a.a.cache_frames, a.a.pad_t0, a.a.pad_t1, a.a.pad_h0, a.a.pad_h1, a.a.pad_w0, a.a.pad_w1) == (
        0, 1, 1, 0, 0, 0, 0)
    assert (a.a.x_stride_b, a.a.x_stride_c, a.a.x_stride_t, a.a.x_stride_h) == x.stride()[:4]
    assert (a.a.dtype, a.a.channels_last, a.a.replicate_t, a.a.reflect_hw, a.rsqrt) == (
        1, True, True, False, r.data_ptr())
    out = chain._nvrtc_kernel(x.half(), r, [1, 1, 1, 1, 2, 0], True)
    kernel, key, grid, block, a = launches[-1]
    assert key == torch.float16 and out.shape == (2, 40, 5, 11, 42) and grid == (1, 2, 2 * 5 * 11)
    assert (a.a.dtype, a.a.pad_t0, a.a.pad_t1, a.a.pad_w0, a.a.reflect_hw) == (0, 2, 0, 1, True)
    out = chain._nvrtc_kernel(x[:, :36], r, [1, 1, 1, 1, 2, 0], True)
    kernel, key, grid, block, a = launches[-1]
    assert (kernel, block, grid, a.a.channels) == (chain._NVRTC, (32, 8, 1), (2, 2, 2 * 5 * 11), 36)


def test_raw_op_guard_refuses_what_bindings_cpp_refuses():
    class OnCuda(torch.Tensor):  # (the raw guard's device check, passed on a CPU)
        is_cuda = property(lambda self: True)

    x = torch.Tensor._make_subclass(OnCuda, _x((2, 8, 3, 4, 8)))
    r = torch.rand(2, 3 * 4 * 8)
    assert chain._raw_guard(x, r, [0, 0, 0, 0, 2, 0], False) is None
    assert chain._raw_guard(torch.Tensor._make_subclass(OnCuda, x.float()), r, [0, 0, 0, 0, 2, 0], False) == "dtype"
    assert chain._raw_guard(x, r[:, 1:], [0, 0, 0, 0, 2, 0], False) == "rsqrt"
    assert chain._raw_guard(x, r.double(), [0, 0, 0, 0, 2, 0], False) == "rsqrt"
    assert chain._raw_guard(x, r, [0, 0, 0, 0, 2], False) is not None
    assert chain._raw_guard(x, r, [8, 8, 0, 0, 2, 0], True) is not None  # (a reflection not below its size)
    assert chain._raw_guard(_x((2, 8, 3, 4, 8)), r, [0, 0, 0, 0, 2, 0], False) is not None  # (CPU)


def test_nvrtc_fused_launcher_passes_what_bindings_cpp_passes(monkeypatch):
    """The fused kernel's NVRTC launch: the kLtx instantiation of per_channel_rmsnorm_pad.cu's pad kernel, its params
    field by field as bindings_vae.cpp's ltx_rmsnorm_fused_pad_cl fills them (LTX-2's pad kernel's, the probe mode
    too), vectors or elements as the .cu chooses, `fused_shape`; probe 3 writes the fp32 mean [B, S]."""
    from test_nvrtc import captured_launches  # noqa: F401 - the fixture's body, called directly below

    pcr = chain._pcr
    launches = captured_launches.__wrapped__(monkeypatch)
    x = _x((1, 512, 16, 16, 24)).reshape(1, 512, -1)
    out = chain._nvrtc_fused(x, 1e-8, True, 4, 1, 1 / 512, [16, 16, 24], [0, 0, 0, 0, 1, 1], False, 0)
    kernel, key, grid, block, a = launches[-1]
    assert (kernel, key) == (chain._NVRTC_FUSED, (torch.bfloat16, True))
    assert kernel.names[key] == "diffusers_fastpath::per_channel_rmsnorm_pad_cl_kernel<__nv_bfloat16, true, true>"
    assert (grid, block) == pcr.fused_shape(1, 6144, pcr.MeanOrder(4, 1, 1 / 512), 8, 132)
    assert out.shape == (1, 512, 18, 16, 24) and out.is_contiguous(memory_format=torch.channels_last_3d)
    assert (a.a.out, a.a.x, a.a.mean, a.a.batch, a.a.channels, a.a.spatial, a.a.x_batch_stride, a.a.x_channel_stride,
            a.a.silu, a.a.probe, a.a.dtype) == (out.data_ptr(), x.data_ptr(), None, 1, 512, 6144, 512 * 6144, 6144,
                                                1, 0, 1)
    assert (a.g.frames, a.g.height, a.g.width, a.g.pad_t0, a.g.pad_t1, a.g.pad_h0, a.g.pad_w1, a.g.reflect_hw) == (
        16, 16, 24, 1, 1, 0, 0, 0)
    assert (a.rows, a.ctas, a.factor) == (4, 1, 1 / 512) and a.a.eps == struct.unpack("f", struct.pack("f", 1e-8))[0]
    odd = _x((2, 24, 3, 5, 7), torch.float16).reshape(2, 24, -1)  # 105 positions: elements
    mean = chain._nvrtc_fused(odd, 1e-6, False, 1, 1, 1 / 24, [3, 5, 7], [0, 0, 0, 0, 2, 0], False, 3)
    _, key, grid, block, a = launches[-1]
    assert key == (torch.float16, False) and mean.shape == (2, 105) and mean.dtype == torch.float32
    assert (a.a.out, a.a.probe, a.a.silu, a.a.dtype) == (mean.data_ptr(), 3, 0, 0)
    with pytest.raises(ValueError, match="scratch"):
        chain._nvrtc_fused(x, 1e-8, True, 256, 16, 1 / 512, [16, 16, 24], [0] * 6, False, 0)


def test_nvrtc_rsqrt_probe_launcher(monkeypatch):
    """The reciprocal's probe kernel: m's and the output's pointers, the count, the eps as a float, a grid stride of
    256-thread blocks (at most 8 a multiprocessor), the result of m's shape."""
    from test_nvrtc import captured_launches  # noqa: F401

    launches = captured_launches.__wrapped__(monkeypatch)
    m = torch.rand(1, 1, 1 << 20)
    out = chain._nvrtc_rsqrt(m, 1e-8)
    kernel, key, grid, block, a = launches[-1]
    assert (kernel, key, grid, block) == (chain._NVRTC_RSQRT, torch.float32, (132 * 8, 1, 1), (256, 1, 1))
    assert kernel.names[key] == "diffusers_fastpath::ltx_rsqrt_probe_kernel<float>"
    assert (a.m, a.out, a.n, a.eps) == (m.data_ptr(), out.data_ptr(), 1 << 20, struct.unpack("f", struct.pack(
        "f", 1e-8))[0]) and out.shape == m.shape
    chain._nvrtc_rsqrt(torch.rand(1000), 1e-6)
    assert launches[-1][2] == (4, 1, 1)


def test_raw_fused_guards_refuse_what_bindings_cpp_refuses():
    class OnCuda(torch.Tensor):
        is_cuda = property(lambda self: True)

    x = torch.Tensor._make_subclass(OnCuda, _x((2, 8, 3, 4, 8)).reshape(2, 8, -1))
    args = (1e-8, True, 1, 1, 1 / 8, [3, 4, 8], [0, 0, 0, 0, 2, 0], False)
    assert chain._raw_fused_guard(x, *args, 0) is None
    assert chain._raw_fused_guard(torch.Tensor._make_subclass(OnCuda, x.float()), *args, 0) == "dtype"
    assert chain._raw_fused_guard(x, *args, 3) == "probe"  # (with the SiLU)
    assert chain._raw_fused_guard(x, 1e-8, False, *args[2:], 3) is None
    assert chain._raw_fused_guard(x, *args, 2) == "probe"
    assert chain._raw_fused_guard(x, 1e-8, True, 3, 1, *args[4:], 0) == "order"
    assert chain._raw_fused_guard(x, *args[:5], [3, 4, 9], args[6], False, 0) == "dims"
    assert chain._raw_fused_guard(x.reshape(2, 8, 12, 8), *args, 0) == "x"
    assert chain._raw_fused_guard(_x((2, 8, 3, 4, 8)).reshape(2, 8, -1), *args, 0) == "device"
    assert chain._raw_rsqrt_guard(torch.Tensor._make_subclass(OnCuda, torch.rand(8)), 1e-8) is None
    assert chain._raw_rsqrt_guard(torch.Tensor._make_subclass(OnCuda, torch.rand(8).half()), 1e-8) == "m"
    assert chain._raw_rsqrt_guard(torch.Tensor._make_subclass(OnCuda, torch.rand(8, 2).t()), 1e-8) == "m"
    assert chain._raw_rsqrt_guard(torch.rand(8), 1e-8) == "device"


# --- GPU ------------------------------------------------------------------------------------------------------------

# The chains of LTX-Video's decode at 768x512x121 (latents 16 frames of 16x24; the published 0.9.0 decoder,
# non-causal: the mid block at 512 channels, the up blocks at 512, 256 and 128 after each 2x upsampling, the last at
# the 4x4-patchified 128x192, 121 frames; norm_out -> conv_out 128 -> 48), as (x shape, convolution's out channels,
# causal); the encoder's (causal) at two of its shapes.
CHAIN_SHAPES = [((1, 512, 16, 16, 24), 512, False), ((1, 512, 31, 32, 48), 512, False),
                ((1, 256, 61, 64, 96), 256, False), ((1, 128, 121, 128, 192), 128, False),
                ((1, 128, 121, 128, 192), 48, False), ((1, 128, 121, 128, 192), 128, True),
                ((1, 512, 16, 16, 24), 512, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "sliced"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,out_channels,causal", CHAIN_SHAPES, ids=str)
@torch.no_grad()
def test_chain_equals_eager_at_ltx_video_decoder_shapes(shape, out_channels, causal, dtype, layout):
    """The op (its kernel, the tail's proof and its first-call check included) against diffusers' modules called as
    the blocks call them, bit for bit (`tensors_equal`), strides included, the allocator's blocks of the padded buffer's
    size poisoned with NaN first; x contiguous or with its first frame sliced off (the upsamplers' ``[:, :, 1:]``:
    channels apart), zeros scattered and an all-zero position (rsqrt of eps)."""
    from diffusers_fastpath.models.vae import checked_forwards
    from diffusers_fastpath.ops.ltx_causal_conv import add_conv_class

    ltx_norm.add_norm_class(RMSNorm)
    checked_forwards([ltx.LTXVideoCausalConv3d], vae_ltx_conv.CONV_DIGESTS, register=add_conv_class)
    conv = ltx.LTXVideoCausalConv3d(shape[1], out_channels, 3, is_causal=causal)
    conv = randomize_(conv, sum(shape) % 1000).to("cuda", dtype).eval()
    norm, act = RMSNorm(shape[1], eps=1e-8, elementwise_affine=False).cuda(), nn.SiLU()
    b, c, t, h, w = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape) + out_channels)
    x = (torch.randn(b, c, t + (layout == "sliced"), h, w, generator=gen, device="cuda") * 3).to(dtype)
    x = x[:, :, 1:] if layout == "sliced" else x
    x[:, 1::5, ..., ::11] = 0
    x[0, :, 0, 0] = 0
    ref = conv(act(norm(x.movedim(1, -1)).movedim(-1, 1)))
    padded = b * c * (t + 2) * h * w
    torch.full((2 * padded,), float("nan"), dtype=dtype, device="cuda")  # (freed: the next blocks hold NaN)
    torch.cuda.synchronize()
    site = Site(OP.name)
    out = OP(site, norm, act, conv, x, None)
    assert site.fast == 1, (dict(site.fallback), OP.disabled)
    assert out.stride() == ref.stride() and tensors_equal(out, ref) and ref.isfinite().float().mean() > 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@torch.no_grad()
def test_the_tail_proof_passes_on_every_value(dtype):
    """The kernel with the reciprocal 1 equals eager's chain (`tail_ref`) on all 65536 values of the dtype (NaN
    payloads, infinities, subnormals), as the op's proof runs it."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    norm = RMSNorm(8, eps=1e-8, elementwise_affine=False)  # (the decoder's; x's order the fused kernel's: its rsqrt too)
    assert chain._prove(norm, None, None, torch.zeros(1, 8, 1, 1, 8, dtype=dtype, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 128, 121, 128, 192), (2, 33, 3, 7, 37), (1, 8, 1, 2, 2), (2, 40, 3, 5, 72)],
                         ids=str)
@torch.no_grad()
def test_kernel_through_nvrtc_equals_nvcc_and_eager(shape, dtype):
    """csrc/causal_pad.cu's norm kernel through NVRTC and through the nvcc extension (where a toolkit built it)
    against eager's chain (the norm, the SiLU, the module's padding statements; for "reflect" F.pad's), causal and
    not, "zeros" and "reflect", x contiguous and a strided time slice, every element written (poisoned first); at
    LTX-Video's largest norm (the wide kernel), and at odd shapes (channels and columns no multiple of the 32 x 32
    tile; one frame; the wide kernel's with parts of its 32 x 64 tiles)."""
    from test_ltx_causal_conv import _eager_buffer
    from test_nvrtc import both_ways

    nvcc = both_ways.__wrapped__()
    b, c, t, h, w = shape
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = (torch.randn(b, c, t + 2, h, w, generator=gen, device="cuda") * 3).to(dtype)
    norm = RMSNorm(c, eps=1e-8, elementwise_affine=False)
    for view in (x[:, :, 1:1 + t], x[:, :, :t].contiguous()):
        r = ltx_norm.reciprocal(view.movedim(1, -1), norm.eps).contiguous().view(b, -1)
        y = F.silu(RMSNorm.forward(norm, view.movedim(1, -1)).movedim(-1, 1))
        for mode in ("zeros", "reflect"):
            conv = ltx.LTXVideoCausalConv3d(c, 4, 3, padding_mode=mode)
            for causal in (True, False):
                conv.is_causal = causal
                padding, _, reflect = chain._conv._plan(conv, None)
                want = _eager_buffer(conv, y, causal)
                ways = [chain._nvrtc_kernel] + ([torch.ops.diffusers_fastpath._ltx_rmsnorm_pad_cl_cuda] if nvcc else [])
                for way in ways:
                    torch.full((2 * want.numel(),), float("nan"), dtype=dtype, device="cuda")
                    out = way(view, r, padding, reflect)
                    assert out.is_contiguous(memory_format=torch.channels_last_3d), (way, mode, causal)
                    assert out.shape == want.shape and torch.equal(bits(out), bits(want)), (way, mode, causal)



def _gpu_x(shape, dtype, seed=0):
    """x at a decoder shape: values over several decades (other orders give other means), zeros scattered, an all-zero
    position (rsqrt of eps), means near eps, an inf and a NaN in one position each."""
    b, c, t, h, w = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    spread = 1.0 if dtype == torch.float16 else 3.0
    x = (torch.randn(shape, generator=gen, device="cuda")
         * torch.exp(torch.randn(shape, generator=gen, device="cuda") * spread)).to(dtype)
    x[:, 1::5, ..., ::11] = 0
    flat = x.view(b, c, t * h * w)  # (positions counted along the frames' rows: the last ones where x has fewer)
    at = [min(i, t * h * w - 1) for i in (w, 2 * w, 2 * w + 1)]
    flat[0, :, 0] = 0
    flat[0, :, at[0]:at[0] + 5] *= 1e-4
    flat[0, 1, at[1]] = float("inf")
    flat[0, 2, at[2]] = float("nan")
    return x


# the decoder's norm shapes (the up blocks' conv_in resnets add 256 x 31 frames and 128 x 61) and two odd ones
FUSED_SHAPES = sorted({shape for shape, _, _ in CHAIN_SHAPES} | {(1, 256, 31, 32, 48), (1, 128, 61, 64, 96),
                                                                  (2, 64, 3, 7, 13), (1, 24, 1, 1, 2)})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=str)
@torch.no_grad()
def test_fused_mean_is_eagers_mean_both_ways(shape, dtype):
    """The fused kernel's statistics alone (probe 3) against eager's ``x.movedim(1, -1).to(float32).pow(2).mean(-1)``
    on this GPU, bit for bit, through NVRTC and the nvcc extension (where a toolkit built it), at the decoder's shapes
    and two odd ones (batch 2, positions no multiple of the vector: elements; one frame of 1 x 2)."""
    from test_nvrtc import both_ways

    nvcc = both_ways.__wrapped__()
    x = _gpu_x(shape, dtype)
    order = chain.mean_order(x)
    assert type(order) is chain._pcr.MeanOrder, order
    b, c = shape[:2]
    want = x.movedim(1, -1).to(torch.float32).pow(2).mean(-1).reshape(b, -1)
    x3, dims = x.reshape(b, c, -1), list(shape[2:])
    ways = [chain._nvrtc_fused] + ([torch.ops.diffusers_fastpath._ltx_rmsnorm_fused_pad_cl_cuda] if nvcc else [])
    for way in ways:
        torch.full((2 * want.numel(),), float("nan"), device="cuda")
        got = way(x3, 1e-8, False, order.rows, order.ctas, order.factor, dims, [0, 0, 0, 0, 2, 0], False, 3)
        assert got.dtype == torch.float32 and tensors_equal(got, want), (way, order)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=str)
@torch.no_grad()
def test_fused_kernel_through_nvrtc_equals_nvcc_and_eager(shape, dtype):
    """The fused kernel's padded buffer (the norm, its SiLU, causal and not; the norm alone too) through NVRTC and the
    nvcc extension against eager's (the module's padding statements of ``F.silu(norm(x))``), every element written
    (the allocator's blocks poisoned with NaN first), strides channels-last."""
    from test_ltx_causal_conv import _eager_buffer
    from test_nvrtc import both_ways

    nvcc = both_ways.__wrapped__()
    x = _gpu_x(shape, dtype, seed=1)
    b, c = shape[:2]
    order = chain.mean_order(x)
    norm = RMSNorm(c, eps=1e-8, elementwise_affine=False)
    normed = RMSNorm.forward(norm, x.movedim(1, -1)).movedim(-1, 1)
    x3, dims = x.reshape(b, c, -1), list(shape[2:])
    ways = [chain._nvrtc_fused] + ([torch.ops.diffusers_fastpath._ltx_rmsnorm_fused_pad_cl_cuda] if nvcc else [])
    conv = ltx.LTXVideoCausalConv3d(c, 4, 3)
    for causal in (True, False):
        conv.is_causal = causal
        padding, _, reflect = chain._conv._plan(conv, None)
        for silu in (True, False):
            want = _eager_buffer(conv, F.silu(normed) if silu else normed, causal)
            for way in ways:
                torch.full((2 * want.numel(),), float("nan"), dtype=dtype, device="cuda")
                got = way(x3, 1e-8, silu, order.rows, order.ctas, order.factor, dims, padding, reflect, 0)
                assert got.is_contiguous(memory_format=torch.channels_last_3d), (way, causal, silu)
                assert got.shape == want.shape and torch.equal(bits(got), bits(want)), (way, causal, silu)


@pytest.mark.gpu
@torch.no_grad()
def test_the_rsqrt_proof_passes_on_every_fp32_value():
    """The fused kernel's ``rsqrtf(m + eps)`` (its probe kernel, both ways) equals eager's ``torch.rsqrt(m + eps)`` on
    all 2^32 fp32 bit patterns, as the op's proof runs it, for the decoder's eps and another."""
    from diffusers_fastpath.ops._unary_proof import prove_fp32
    from test_nvrtc import both_ways

    nvcc = both_ways.__wrapped__()
    device = torch.device("cuda", torch.cuda.current_device())
    for eps in (1e-8, 1e-6):
        assert prove_fp32(device, lambda row: chain._nvrtc_rsqrt(row.contiguous(), eps), chain.rsqrt_ref(eps))
        if nvcc:
            assert prove_fp32(device, lambda row: torch.ops.diffusers_fastpath._ltx_rsqrt_probe_cuda(
                row.contiguous(), eps), chain.rsqrt_ref(eps), start=-(1 << 28), stop=1 << 28)
    assert chain._prove_rsqrt(1e-8, device)
