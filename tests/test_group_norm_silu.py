"""group_norm / group_norm_silu: bit-exact against eager ``F.group_norm`` (then ``F.silu``) on the GPU at the shapes of
a FLUX.1 VAE decode at 1024x1024 (poisoned outputs, fresh inputs), self-verified per signature, the SiLU proven on
every value; on CPU: the guard's reasons, the fallback policy, the custom op, and the launch constants against the
.cu."""

from __future__ import annotations

import importlib
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diffusers_fastpath.ops import Site, _build, _policy

gn = importlib.import_module("diffusers_fastpath.ops.group_norm_silu")  # the module (ops binds the name to the op)

CSRC = _build.csrc_dir()
DTYPES = [torch.bfloat16, torch.float16]
# The GroupNorm inputs of a FLUX.1 VAE decode at 1024x1024 (latents 128^2, block_out_channels 128/256/512/512,
# 32 groups): the mid block and the first up block at 128^2, then 256^2, 512^2 (the first resnet's 512 channels, then
# 256), 1024^2 (256, then 128); the mid-block attention's [1, 512, 128 * 128] view; and short rows (aten's one-warp
# block: rows of fewer than 512 elements), a batch of 2 (CFG decodes, slicing off).
FLUX_DECODE_SHAPES = [
    (1, 512, 128, 128), (1, 512, 256, 256), (1, 512, 512, 512), (1, 256, 512, 512), (1, 256, 1024, 1024),
    (1, 128, 1024, 1024), (1, 512, 16384),
]
SMALL_SHAPES = [(1, 64, 4, 4), (2, 128, 8, 8), (2, 96, 24, 40), (1, 32, 3, 8)]


def make_inputs(shape, dtype, device, seed, groups=32):
    """An affine ``nn.GroupNorm`` as the VAE has it (eps 1e-6) with random weight and bias, and activations with a
    per-channel offset and spread and rare outliers (the mean matters, not only the variance)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    channels = shape[1]
    lead = (1, channels) + (1,) * (len(shape) - 2)
    x = torch.randn(shape, generator=gen, device=device) * (0.5 + 3 * torch.rand(lead, generator=gen, device=device))
    x = x + 2 * torch.randn(lead, generator=gen, device=device)
    x = torch.where(torch.rand(shape, generator=gen, device=device) < 1e-4, 30 * x, x).to(dtype)
    norm = nn.GroupNorm(groups, channels, eps=1e-6).to(device=device, dtype=dtype).requires_grad_(False)  # inference
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(channels, generator=gen, device=device))
        norm.bias.copy_(0.2 * torch.randn(channels, generator=gen, device=device))
    return norm, x


def _raw_out(norm, x, silu, variant=None):
    """The raw op into a poisoned (NaN) output: every element must be written."""
    if variant is None:
        variant = gn._platform_variant(x.device, x.dtype)
    out = torch.full_like(x, float("nan"), memory_format=torch.contiguous_format)
    torch.ops.diffusers_fastpath._group_norm_silu_cuda_out(out, x, norm.weight, norm.bias, norm.num_groups, norm.eps,
                                                            silu, variant)
    torch.cuda.synchronize()
    return out


# --- GPU: the contract ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("silu", [True, False], ids=["silu", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX_DECODE_SHAPES + SMALL_SHAPES, ids=str)
def test_group_norm_matches_eager_bitwise_and_verifies(shape, dtype, silu):
    _build.load_extension()
    op = gn.GROUP_NORM_SILU if silu else gn.GROUP_NORM
    fn = gn.group_norm_silu if silu else gn.group_norm
    groups = 32 if shape[1] % 32 == 0 else 8
    for seed in range(2):  # fresh inputs each round
        norm, x = make_inputs(shape, dtype, "cuda", seed, groups)
        ref = F.group_norm(x, groups, norm.weight, norm.bias, norm.eps)
        ref = F.silu(ref) if silu else ref
        assert torch.equal(_raw_out(norm, x, silu), ref)
        site = Site(op.name)
        assert torch.equal(fn(norm, x, site), ref)
        assert site.fast == 1 and not site.fallback, site  # the fast path ran and passed its own check
    assert op.disabled is None and len(op.verified) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_group_norm_special_rows_match_eager(dtype):
    """Rows that are constant (variance 0: rstd = rsqrt(eps)), all zero, near the dtype's limits, or hold an inf or a
    NaN: every element has eager's bits."""
    _build.load_extension()
    norm, x = make_inputs((2, 64, 32, 32), dtype, "cuda", 3)
    big = torch.finfo(dtype).max / 4
    x = x.clone().view(2, 32, -1)
    x[0, 0] = 1.5
    x[0, 1] = 0
    x[0, 2, ::2], x[0, 2, 1::2] = big, -big
    x[0, 3, 7] = float("inf")
    x[1, 0, 100] = float("nan")
    x[1, 1] = torch.linspace(-3, 3, x.shape[-1], device="cuda").to(dtype) * 1e-3
    x[1, 2] = x[1, 2] * (1e-30 if dtype is torch.bfloat16 else 1e-6)  # bf16: |delta| below 2^-64 (div.rn's batches)
    x = x.view(2, 64, 32, 32)
    for silu in (False, True):
        ref = F.group_norm(x, 32, norm.weight, norm.bias, norm.eps)
        ref = F.silu(ref) if silu else ref
        assert _policy.tensors_equal(_raw_out(norm, x, silu), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_proof_and_platform_variant(dtype):
    """The SiLU epilogue equals eager's on all 65536 values of the dtype; the platform probe picks a variant that
    makes the op exact (torch 2.11 rounds the statistics to T: variant 0)."""
    _build.load_extension()
    norm, x = make_inputs((1, 64, 32, 32), dtype, "cuda", 5)
    assert gn._prove_silu(norm, x)
    variant = gn._platform_variant(x.device, dtype)
    assert variant in (0, gn.STATS_IN_FLOAT)
    print(f"torch {torch.__version__}: platform variant {variant}")


_DIVISION_CHECK = r"""
#include "group_norm_silu.cu"
// every mantissa of a in [2^e, 2^(e+1)) against every nf in [n_lo, n_hi]: the statistics' quotient() (with the
// reciprocal fold_batch gives it) against div.rn; `bad` counts mismatches, `example` keeps one
extern "C" __global__ void check_division(int e, unsigned int n_lo, unsigned int n_hi, unsigned long long* bad,
                                          unsigned int* example) {
  const unsigned long long total = (unsigned long long)(n_hi - n_lo + 1) << 23;
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const unsigned int mant = (unsigned int)(i & ((1u << 23) - 1));
    const float nf = (float)(n_lo + (unsigned int)(i >> 23));
    const float a = ldexpf(__uint_as_float(0x3f800000u | mant), e);
    const float r = __frcp_rn(nf);
    const float fast = diffusers_fastpath::quotient(a, nf, r);
    const float exact = __fdiv_rn(a, nf);
    if (__float_as_uint(fast) != __float_as_uint(exact)) {
      atomicAdd(bad, 1ull);
      example[0] = __float_as_uint(a);
      example[1] = (unsigned int)nf;
    }
  }
}
"""


@pytest.mark.gpu
def test_statistics_quotient_is_div_rn_on_every_mantissa():
    """The statistics kernel's branch-free quotient (csrc/group_norm_silu.cu's quotient()) equals div.rn for every
    mantissa of the dividend and every count up to 2^14 (FLUX's longest chain at 1024x1024 is 16384), at the ends of
    the range it is used in (2^-64, 2^64) and at 1; and on every mantissa for counts sampled up to 2^24. Compiled from
    the .cu itself by NVRTC (through CuPy)."""
    cupy = pytest.importorskip("cupy")
    module = cupy.RawModule(code=_DIVISION_CHECK, options=(f"-I{CSRC}", *_build.NVRTC_FLAGS))
    kernel = module.get_function("check_division")
    bad, example = cupy.zeros(1, dtype=cupy.uint64), cupy.zeros(2, dtype=cupy.uint32)
    ranges = [(0, 1, 1 << 14), (-64, 1, 1 << 10), (63, 1, 1 << 10)]
    ranges += [(0, n, n) for n in (20000, 65535, 65536, 99991, (1 << 20) + 7, (1 << 24) - 3, 1 << 24)]
    for e, lo, hi in ranges:
        kernel((132 * 32,), (256,), (cupy.int32(e), cupy.uint32(lo), cupy.uint32(hi), bad, example))
    cupy.cuda.runtime.deviceSynchronize()
    assert int(bad[0]) == 0, f"{int(bad[0])} mismatches, e.g. a bits {int(example[0]):#x}, n {int(example[1])}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_statistics_fast_division_equals_div_rn_at_decode_shapes(dtype):
    """The production statistics (branch-free quotient) and the probe's div.rn give the same bits at FLUX's shapes,
    tiny and huge activations included (their batches take div.rn: out of the quotient's range)."""
    for shape, scale in (((1, 512, 256, 256), 1.0), ((1, 128, 512, 512), 1.0), ((1, 64, 64, 64), 1e-22),
                         ((1, 64, 64, 64), 1e24)):
        norm, x = make_inputs(shape, dtype, "cuda", 13)
        if dtype is torch.bfloat16:
            x = (x.float() * scale).to(dtype)
        fast = _raw_out(norm, x, True)
        exact = _raw_out(norm, x, True, gn._platform_variant(x.device, dtype) | gn.DIV_RN)
        assert _policy.tensors_equal(fast, exact)
        assert _policy.tensors_equal(fast, F.silu(F.group_norm(x, 32, norm.weight, norm.bias, norm.eps)))


@pytest.mark.gpu
def test_group_norm_opcheck_cuda():
    norm, x = make_inputs((1, 64, 16, 16), torch.bfloat16, "cuda", 6)
    torch.library.opcheck(torch.ops.diffusers_fastpath.group_norm_silu.default,
                          (x, norm.weight.detach(), norm.bias.detach(), 32, norm.eps, True))


@pytest.mark.gpu
def test_group_norm_takes_channels_last_as_aten_does():
    """aten's group_norm makes a CUDA input contiguous first; so does the op (the same bits, NCHW out)."""
    norm, x = make_inputs((1, 128, 64, 64), torch.bfloat16, "cuda", 7)
    x = x.to(memory_format=torch.channels_last)
    site = Site("group_norm")
    out = gn.group_norm(norm, x, site)
    assert torch.equal(out, F.group_norm(x, 32, norm.weight, norm.bias, norm.eps)) and site.fast == 1


# --- CPU: guard, policy, custom op ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case, reason", [
    ("cpu", "device cpu"), ("fp32", "dtype float32"), ("no_affine", "no affine"), ("hxw1", "HxW of 1"),
    ("hxw_odd", "HxW not a multiple of 8"), ("grad", "requires grad"), ("subclass", "is not a plain nn.GroupNorm"),
    ("weight_fp32", "weight or bias of another dtype"), ("two_dims", "x not [N, C, *]"),
])
def test_guard_falls_back_to_exact_eager_with_reason(case, reason):
    norm, x = make_inputs((1, 64, 8, 8), torch.bfloat16, "cpu", 0)
    if case == "fp32":
        norm, x = norm.float(), x.float()
    elif case == "no_affine":
        norm = nn.GroupNorm(32, 64, affine=False).to(torch.bfloat16)
    elif case == "hxw1":
        x = x[:, :, :1, :1]
    elif case == "hxw_odd":
        x = x[:, :, :3, :5].contiguous()  # HxW 15
    elif case == "grad":
        x.requires_grad_(True)
    elif case == "subclass":
        norm.__class__ = type("MyGroupNorm", (nn.GroupNorm,), {})
    elif case == "weight_fp32":
        norm.weight.data, norm.bias.data = norm.weight.data.float(), norm.bias.data.float()  # aten's mixed type
    elif case == "two_dims":
        x = x.flatten(1)
        norm = nn.GroupNorm(32, x.shape[1]).to(torch.bfloat16)
    guard = gn._guard if case == "cpu" else (lambda *a: gn._guard(*a, check_pointers=False))
    with torch.set_grad_enabled(case == "grad"):  # inference (a pipeline's no_grad), but for the autograd case
        assert reason in guard(norm, x)
        if case == "two_dims":
            return
        site = Site("group_norm_silu")
        out = gn.group_norm_silu(norm, x, site)
        assert torch.equal(out, F.silu(nn.GroupNorm.forward(norm, x)))
    assert site.fast == 0 and any(reason in r for r in site.fallback), site


@pytest.fixture
def guard_open(monkeypatch):
    """The guards as on a GPU (a CPU tensor passes), so the policy around the kernel runs on CPU."""
    for op in (gn.GROUP_NORM, gn.GROUP_NORM_SILU):
        guard = op.guard
        monkeypatch.setattr(op, "guard", lambda *a, check_pointers=True, g=guard: (
            None if g(*a, check_pointers=False) == "device cpu" else g(*a, check_pointers=False)))
        monkeypatch.setattr(op, "prove", None)


@torch.no_grad()
def test_a_kernel_that_is_not_bit_exact_is_disabled_and_eager_returned(guard_open, monkeypatch, fastpath_log):
    monkeypatch.setattr(gn.GROUP_NORM_SILU, "kernel", lambda norm, x: gn.group_norm_silu_ref(norm, x) + 1)
    norm, x = make_inputs((1, 64, 8, 8), torch.bfloat16, "cpu", 1)
    site = Site("group_norm_silu")
    assert torch.equal(gn.group_norm_silu(norm, x, site), gn.group_norm_silu_ref(norm, x))
    assert gn.GROUP_NORM_SILU.disabled is not None and "not bit-exact" in gn.GROUP_NORM_SILU.disabled
    assert "disabling the fused op 'group_norm_silu'" in fastpath_log.text
    assert torch.equal(gn.group_norm_silu(norm, x, site), gn.group_norm_silu_ref(norm, x))  # stays eager
    assert site.fast == 0 and sum(site.fallback.values()) == 2


@torch.no_grad()
def test_a_bit_exact_kernel_is_verified_once_per_signature(guard_open, monkeypatch):
    calls = []

    def kernel(norm, x):
        calls.append(x.shape)
        return gn.group_norm_ref(norm, x)

    monkeypatch.setattr(gn.GROUP_NORM, "kernel", kernel)
    site = Site("group_norm")
    for seed in range(3):
        norm, x = make_inputs((1, 64, 8, 8), torch.bfloat16, "cpu", seed)
        assert torch.equal(gn.group_norm(norm, x, site), gn.group_norm_ref(norm, x))
    norm, x = make_inputs((1, 64, 32, 32), torch.bfloat16, "cpu", 9)  # rows of 2048: aten's 512-thread block
    gn.group_norm(norm, x, site)
    assert site.fast == 4 and len(calls) == 4
    assert gn.GROUP_NORM.verified == {("bfloat16", 64, 32, 32), ("bfloat16", 64, 32, 512)}


@pytest.mark.parametrize("silu", [True, False])
def test_custom_op_opcheck_and_eager_fallback_cpu(silu):
    norm, x = make_inputs((2, 64, 8, 8), torch.bfloat16, "cpu", 2)
    args = (x, norm.weight.detach(), norm.bias.detach(), 32, norm.eps, silu)  # inference: no autograd formula
    torch.library.opcheck(torch.ops.diffusers_fastpath.group_norm_silu.default, args)
    out = torch.ops.diffusers_fastpath.group_norm_silu(*args)
    ref = F.group_norm(x, 32, norm.weight, norm.bias, norm.eps)
    assert torch.equal(out, F.silu(ref) if silu else ref)


def test_kernel_eps_is_atens_eps_rounded_to_the_dtype():
    """aten adds ``static_cast<T>(eps)``: 1e-6 is 9.98e-7 in bf16, a subnormal 1.013e-6 in fp16."""
    assert gn.kernel_eps(1e-6, torch.bfloat16) == torch.tensor(1e-6).to(torch.bfloat16).item() != 1e-6
    assert gn.kernel_eps(1e-6, torch.float16) == pytest.approx(17 * 2.0**-24)
    assert [gn.aten_threads(n) for n in (1, 511, 512, 10**6)] == [32, 32, 512, 512]


def _constant(name: str) -> int:
    return int(re.search(rf"constexpr int {name} = (\d+);", (CSRC / "group_norm_silu.cu").read_text()).group(1))


def test_python_constants_match_the_cu():
    assert (gn.STATS_IN_FLOAT, gn.PARAMS_FUSED, gn.IDENTITY_AFFINE, gn.DIV_RN, gn._STATS_BITS, gn._VARIANT_MASK) == (
        _constant("kStatsInFloat"), _constant("kParamsFused"), _constant("kIdentityAffine"), _constant("kDivRn"),
        _constant("kStatsVariantMask"), _constant("kVariantMask"))
    assert (gn._APPLY_THREADS, gn._APPLY_BLOCKS_PER_SM, gn._ATEN_BLOCK, gn._WARP) == (
        _constant("kApplyThreads"), _constant("kApplyBlocksPerSm"), _constant("kAtenBlockThreads"), _constant("kWarp"))
    assert (gn._CL_CHANNELS, gn._CL_POSITIONS, gn._CL_THREADS, gn._CL_BLOCKS_PER_SM) == (
        _constant("kClChannels"), _constant("kClPositions"), _constant("kClThreads"), _constant("kClBlocksPerSm"))


def test_apply_grid_matches_the_cu(tmp_path):
    """The Python _apply_blocks_per_row against the .cu's apply_blocks_per_row, compiled and run on the host."""
    nvcc = Path("/usr/local/cuda/bin/nvcc")
    if not nvcc.exists():
        pytest.skip("needs nvcc")
    cases = [(1, 2**19, 132), (32, 2**19, 132), (32, 2**11, 132), (64, 4, 132), (2048, 100, 78), (1, 1, 132)]
    body = "".join(f'std::printf("%lld\\n", (long long)apply_blocks_per_row({r}, {v}, {s}));' for r, v, s in cases)
    # the channels-last apply kernel's grid (batch, channels, hxw, sms): apply_cl_grid against _cl_grid
    cl_cases = [(1, 128, 1 << 20, 132), (1, 512, 128 * 128, 132), (2, 96, 24 * 40, 132), (1, 40, 24, 78),
                (65535, 64, 64, 132), (1, 64, 8, 1)]
    for b, c, hxw, sms in cl_cases:
        body += ("{ GroupNormSiluArgs a{}; a.batch = %d; a.channels = %d; a.hxw = %d; dim3 g = apply_cl_grid(a, %d); "
                 'std::printf("%%u %%u %%u\\n", g.x, g.y, g.z); }' % (b, c, hxw, sms))
    (tmp_path / "grid.cu").write_text('#include <cstdio>\n#include "group_norm_silu.cu"\n'
                                      f"int main() {{ using namespace diffusers_fastpath; {body} return 0; }}\n")
    proc = subprocess.run([str(nvcc), "-std=c++17", f"-I{CSRC}", *_build.KERNEL_DEFINES, str(tmp_path / "grid.cu"),
                           "-o", str(tmp_path / "grid")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = subprocess.run([str(tmp_path / "grid")], capture_output=True, text=True, check=True).stdout.splitlines()
    assert [int(v) for v in out[:len(cases)]] == [gn._apply_blocks_per_row(*c) for c in cases]
    assert [tuple(map(int, v.split())) for v in out[len(cases):]] == [gn._cl_grid(*c) for c in cl_cases]


def test_every_value_covers_the_dtype():
    values = gn.every_value(torch.bfloat16, "cpu")
    assert values.numel() == 65536 and len(set(_policy.bits(values).flatten().tolist())) == 65536
    assert math.prod(values.shape[2:]) % 8 == 0  # a shape the kernel takes (HxW a multiple of the vector)
