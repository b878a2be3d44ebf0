"""rmsnorm (diffusers' RMSNorm alone: SD3 and SD3.5's QK norms over short rows; the generic path's pre-norms over wide
rows): the reference is diffusers' forward, the bit-exact contract on the GPU at SD3.5's shapes (the [B, H, S, D] views
of its projections, the result in their strides) and at wide rows, guards, fallback and custom op everywhere."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.normalization import RMSNorm

from diffusers_fastpath.ops import Site, rmsnorm, rmsnorm_ref
from diffusers_fastpath.ops.rmsnorm import RMSNORM

DTYPES = [torch.bfloat16, torch.float16]
# [B, S, H, D] projections seen as [B, H, S, D]: SD3.5-large at 1024x1024 (38 heads of 64; 4096 image tokens, 333
# text), a CFG batch, Lumina2's head_dim 96, the vectorised 128, a small odd one
SHAPES = [(1, 4096, 38, 64), (2, 333, 38, 64), (1, 4096, 24, 96), (1, 1024, 24, 128), (1, 7, 3, 64), (2, 5, 4, 32)]


def make(shape, dtype, device, seed, transposed=True):
    gen = torch.Generator(device=device).manual_seed(seed)
    dim = shape[-1]
    norm = RMSNorm(dim, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=gen, device=device))  # not ones: the weight matters
    x = (torch.randn(shape, generator=gen, device=device) * 3).to(dtype)
    return norm, (x.transpose(1, 2) if transposed else x)


def test_reference_is_diffusers_forward():
    for dtype in DTYPES:
        norm, x = make((2, 9, 3, 64), dtype, "cpu", 0)
        with torch.no_grad():
            ref = rmsnorm_ref(norm, x)
            assert torch.equal(ref, norm(x)) and ref.stride() == x.stride()


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [True, False], ids=["BHSD_view", "contiguous"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_eager_bitwise_on_the_gpu(shape, dtype, transposed):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    with torch.no_grad():
        for seed in range(2):
            norm, x = make(shape, dtype, "cuda", seed, transposed)
            ref = norm(x)
            rows = x.permute(0, 2, 1, 3) if transposed else x  # the memory order
            poisoned = torch.full_like(rows.reshape(-1, 1, shape[-1]), float("nan"))
            poisoned.copy_(torch.ops.diffusers_fastpath._rmsnorm_plain_cuda(rows.reshape(-1, 1, shape[-1]),
                                                                             norm.weight, norm.eps))
            torch.cuda.synchronize()
            assert torch.equal(poisoned.view(rows.shape), ref.permute(0, 2, 1, 3) if transposed else ref)
            site = Site("rmsnorm")
            got = rmsnorm(norm, x, site)
            assert torch.equal(got, ref) and got.stride() == ref.stride() == x.stride()
            assert site.fast == 1 and not site.fallback, site
    assert RMSNORM.disabled is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 4429, 4096), (2, 1024, 3072), (1, 300, 640), (1, 17, 7936), (3, 77, 5120),
                                   (1, 4096, 18, 256), (2, 333, 4, 384), (1, 999, 512),
                                   # a multiple of 4, no multiple of 128: lanes with one quad fewer (Sana-Video's 2240)
                                   (1, 4725, 2240), (2, 77, 1028), (1, 300, 132), (2, 64, 4, 192), (1, 33, 8160)],
             ids=str)
def test_wide_rows_match_eager_bitwise_on_the_gpu(shape, dtype):
    """Rows longer than 128, a multiple of 4 below 8192: pre-norms across a whole row (Cosmos 3's hidden 4096),
    Ideogram 4's QK norms at head_dim 256, 384 and 512, Sana-Video's 2240 and widths no multiple of 128: the kernel's output poisoned, every element written and equal
    to diffusers' forward; through the op, fast and verified for (dtype, D)."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    with torch.no_grad():
        for seed in range(2):
            norm, x = make(shape, dtype, "cuda", seed, transposed=False)
            ref = norm(x)
            out = torch.full_like(x.reshape(-1, 1, shape[-1]), float("nan"))
            out.copy_(torch.ops.diffusers_fastpath._rmsnorm_plain_cuda(x.reshape(-1, 1, shape[-1]), norm.weight,
                                                                       norm.eps))
            assert torch.equal(out.view(shape), ref)
            site = Site("rmsnorm")
            assert torch.equal(rmsnorm(norm, x, site), ref)
            assert site.fast == 1 and not site.fallback, site
    assert RMSNORM.disabled is None and (str(dtype).removeprefix("torch."), shape[-1]) in RMSNORM.verified


@pytest.mark.parametrize("case, reason", [
    ("fp32", "dtype float32"), ("weight", "mixed dtypes"), ("dim", "D outside the reproduced reduction"),
    ("wide", "device cpu"), ("wide-256", "device cpu"), ("wide-8192", "device cpu"),
    ("wide-odd", "D outside the reproduced reduction"), ("wide-8164", "device cpu"), ("wide-53248", "device cpu"),
    ("wide-130560", "device cpu"), ("wide-130564", "D outside the reproduced reduction"),
    ("wide-53250", "D outside the reproduced reduction"),
    ("odd", "D outside the reproduced reduction"), ("few", "fewer than 16 rows"), ("strided", "x not dense"),
    ("bias", "norm without weight or with bias"), ("weightless", "device cpu"), ("cpu", "device cpu")])
def test_guard_falls_back_with_reason(case, reason):
    norm, x = make((1, 9, 4, 64), torch.bfloat16, "cpu", 1)
    if case == "fp32":
        norm, x = norm.float(), x.float()
    elif case == "weight":
        norm = norm.float()
    elif case == "dim":
        norm, x = make((1, 9, 4, 194), torch.bfloat16, "cpu", 1)
    elif case == "odd":
        norm, x = make((1, 9, 4, 66), torch.bfloat16, "cpu", 1)
    elif case.startswith("wide"):  # a pre-norm's [B, S, D]: wide rows, a multiple of 4 up to 130560
        dim = {"wide": 1024, "wide-256": 256, "wide-odd": 1002}.get(case) or int(case.removeprefix("wide-"))
        norm, x = make((1, 20, dim), torch.bfloat16, "cpu", 1, transposed=False)
    elif case == "few":
        norm, x = make((1, 3, 2, 64), torch.bfloat16, "cpu", 1)
    elif case == "strided":
        x = x[:, :, ::2]  # every other token: not dense
    elif case == "bias":
        norm = RMSNorm(64, eps=1e-6, bias=True).to(torch.bfloat16)
    elif case == "weightless":  # elementwise_affine=False: taken (a unit weight stands in), only the CPU refuses
        norm = RMSNorm(64, eps=1e-6, elementwise_affine=False)
    site = Site("rmsnorm")
    with torch.no_grad():  # the norm's weight is a parameter: with grad enabled the guard says "requires grad"
        assert RMSNORM.guard(norm, x) == reason
        assert torch.equal(rmsnorm(norm, x, site), norm(x))
    assert site.fast == 0 and site.fallback == {reason: 1}


def test_requires_grad_falls_back_and_keeps_the_graph():
    norm, x = make((1, 9, 4, 64), torch.bfloat16, "cpu", 2)
    x = x.detach().requires_grad_()
    site = Site("rmsnorm")
    out = rmsnorm(norm, x, site)
    out.float().sum().backward()
    assert site.fallback == {"requires grad": 1} and x.grad is not None and norm.weight.grad is not None


def test_custom_op_opcheck_cpu():
    norm, x = make((1, 9, 4, 64), torch.bfloat16, "cpu", 3)
    torch.library.opcheck(torch.ops.diffusers_fastpath.rmsnorm.default, (x, norm.weight.detach(), 1e-6))
    with torch.no_grad():
        got = torch.ops.diffusers_fastpath.rmsnorm(x, norm.weight, 1e-6)
        assert torch.equal(got, norm(x)) and got.stride() == x.stride()


def test_kernel_wrapper_runs_the_rows_in_memory_order_and_returns_x_strides(emulated_kernels):
    """The wrapper around the launch (emulated here: the eager norm of the rows it is given): any dense layout goes
    in as its rows in memory order and comes back in its own strides, equal to eager."""
    for shape, perm in (((2, 9, 4, 64), (0, 2, 1, 3)), ((3, 4, 5, 32), (2, 0, 1, 3)), ((1, 16, 64), (1, 0, 2))):
        norm, x = make(shape, torch.bfloat16, "cpu", 4, transposed=False)
        x = x.permute(perm)
        site = Site("rmsnorm")
        with torch.no_grad():
            got = rmsnorm(norm, x, site)
            assert torch.equal(got, norm(x)) and got.stride() == x.stride()
        assert site.fast == 1, site


def test_weightless_norm_runs_the_kernel_with_a_unit_weight_of_x_dtype(emulated_kernels, monkeypatch):
    """A weightless norm (LTX-2's ``norm2``, ``elementwise_affine=False``: ``(x * rstd).to(T)``) goes to the plain
    kernel with a weight of ones in x's dtype (``round_T(round_T(x * rstd) * 1)`` rounds nothing more), made once per
    (device, dtype, D) and kept; equal to diffusers' weightless forward."""
    import sys

    module = sys.modules["diffusers_fastpath.ops.rmsnorm"]
    module._UNIT_WEIGHTS.clear()
    launched = []

    def launch(x, weight, eps):
        launched.append(weight)
        return module._rms_norm(x, weight, eps).contiguous()

    monkeypatch.setattr(module, "_launch", launch)
    for dtype in DTYPES:
        norm = RMSNorm(1024, eps=1e-6, elementwise_affine=False)
        x = (torch.randn(1, 40, 1024, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
        site = Site("rmsnorm")
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(rmsnorm(norm, x, site), norm(x))
        assert site.fast == 2 and not site.fallback, site
        first, second = launched[-2:]
        assert first is second and first.dtype == dtype and first.shape == (1024,) and bool((first == 1).all())


def test_unit_weight_made_inside_a_capture_is_not_kept(monkeypatch):
    """Inside a CUDA graph capture a new tensor's fill is captured and runs only at replay: a unit weight made there
    serves that call and is not kept for calls outside the graph."""
    import sys

    module = sys.modules["diffusers_fastpath.ops.rmsnorm"]
    module._UNIT_WEIGHTS.clear()
    norm, x = RMSNorm(256, eps=1e-6, elementwise_affine=False), torch.randn(2, 20, 256).to(torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    w = module._weight(norm, x)
    assert bool((w == 1).all()) and w.dtype == torch.bfloat16 and not module._UNIT_WEIGHTS
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert module._weight(norm, x) is module._weight(norm, x) and len(module._UNIT_WEIGHTS) == 1
    weighted = make((1, 20, 256), torch.bfloat16, "cpu", 6, transposed=False)[0]
    assert module._weight(weighted, x) is weighted.weight


def test_custom_op_takes_a_weightless_norm():
    norm = RMSNorm(64, eps=1e-6, elementwise_affine=False)
    x = torch.randn(1, 9, 4, 64).to(torch.bfloat16).transpose(1, 2)
    torch.library.opcheck(torch.ops.diffusers_fastpath.rmsnorm.default, (x, None, 1e-6))
    got = torch.ops.diffusers_fastpath.rmsnorm(x, None, 1e-6)
    assert torch.equal(got, norm(x)) and got.stride() == x.stride()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 6144, 4096), (1, 126, 2048), (2, 333, 3072), (1, 4096, 24, 128)], ids=str)
def test_weightless_norm_matches_eager_bitwise_on_the_gpu(shape, dtype):
    """LTX-2's weightless pre-norms (video 4096 wide over 768x512x121's 6144 tokens, audio 2048; a CFG batch; a
    head-wide one): the kernel with a unit weight, its output poisoned, equal to diffusers' weightless forward; fast
    through the op; and inside a CUDA graph whose capture made the unit weight, equal on replay."""
    import sys

    from diffusers_fastpath.ops._build import load_extension

    module = sys.modules["diffusers_fastpath.ops.rmsnorm"]
    load_extension()
    with torch.no_grad():
        for seed in range(2):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            norm = RMSNorm(shape[-1], eps=1e-6, elementwise_affine=False)
            x = (torch.randn(shape, generator=gen, device="cuda") * 3).to(dtype)
            ref = norm(x)
            rows = x.reshape(-1, 1, shape[-1])
            out = torch.full_like(rows, float("nan"))
            unit = torch.ones(shape[-1], dtype=dtype, device="cuda")
            out.copy_(torch.ops.diffusers_fastpath._rmsnorm_plain_cuda(rows, unit, 1e-6))
            assert torch.equal(out.view(shape), ref)
            site = Site("rmsnorm")
            assert torch.equal(rmsnorm(norm, x, site), ref)
            assert site.fast == 1 and not site.fallback, site
        static = x.clone()  # (the self-verification of this (dtype, D) ran above, outside the capture)
        module._UNIT_WEIGHTS.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = rmsnorm(norm, static)
        assert not module._UNIT_WEIGHTS
        static.copy_((torch.randn(shape, device="cuda") * 2).to(dtype))
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, norm(static))
    assert RMSNORM.disabled is None


# --- rows wider than 8160: aten splits each row across its block's 16 warps (rmsnorm_wide_kernel) ------------------

def _rmsnorm_module():
    import sys

    return sys.modules["diffusers_fastpath.ops.rmsnorm"]  # (the package's `rmsnorm` is the op function)


@pytest.mark.parametrize("limits", [(132, 2048), (46, 2048), (8, 1024)], ids=str)
def test_guard_admits_exactly_the_orders_the_kernels_reproduce(limits):
    """setReduceConfig (`_aten_reduce.set_reduce_config`) for ``mean(-1)`` of the fp32 squares, at every width the
    guard's bounds turn on and a sample between: each admitted D (with at least 16 rows) is a (32, 16) block with
    no split across blocks, the input vectorised by 4 from 128 on, the row split across the 16 warps (the wide
    kernel's kWideWarps) exactly past kWarpRowWidest; the first refused width splits across blocks at 16 rows on an
    H100."""
    from diffusers_fastpath.ops._aten_reduce import set_reduce_config
    from diffusers_fastpath.ops.rmsnorm_scale_shift import _WARP_ROW_WIDEST, _WIDE_THREADS

    module = _rmsnorm_module()
    dims = sorted({*range(32, 260, 4), *range(8100, 8300, 4), *range(129000, 131200, 4), *range(32, 131200, 1028)})
    for dim in dims:
        admitted = 32 <= dim <= module._WIDEST
        for rows in (16, 300, 2048, 18432):
            cfg = set_reduce_config(rows, dim, True, *limits)
            if admitted:
                assert (cfg.block_width, cfg.block_height, cfg.ctas_per_output) == (32, 16, 1), (dim, rows)
                assert cfg.input_vec_size == (4 if dim >= 128 else 1), dim
                assert cfg.split_across_warps == (dim > _WARP_ROW_WIDEST), dim
                assert cfg.step_input == (_WIDE_THREADS if dim > _WARP_ROW_WIDEST else 32), dim
    assert set_reduce_config(16, module._WIDEST + 4, True, 132, 2048).ctas_per_output > 1  # an H100, 16 rows
    assert set_reduce_config(15, 4096, True, *limits).block_width > 32  # fewer than 16 rows: a wider block


def test_guard_has_no_size_bound_at_ideogram4_full_size():
    """Ideogram 4's full-size ``llm_cond_norm`` input, [1, 18432 tokens, 53248] (3.9 GB of fp32 squares, past aten's
    32-bit indexing: aten splits it into sub-iterators of whole rows, the order of each row unchanged): the guard
    refuses it for nothing but the device (a meta tensor here, no memory)."""
    norm = RMSNorm(53248, eps=1e-6).to(device="meta", dtype=torch.bfloat16)
    x = torch.empty(1, 18432, 53248, dtype=torch.bfloat16, device="meta")
    with torch.no_grad():
        assert RMSNORM.guard(norm, x) == "device meta"


def test_wide_rows_take_the_kernel_path_and_refused_ones_fall_back(emulated_kernels):
    """On a CPU with the kernels emulated: rows of 8164, 53248 and 130560 go to the fast path (`_launch`), each
    verified and counted fast; 130564 and a width no multiple of 4 run diffusers' forward, counted by reason."""
    for dim, fast in ((8164, True), (53248, True), (130560, True), (130564, False), (53250, False)):
        norm, x = make((1, 20, dim), torch.bfloat16, "cpu", dim, transposed=False)
        site = Site("rmsnorm")
        with torch.no_grad():
            assert torch.equal(rmsnorm(norm, x, site), norm(x))
        if fast:
            assert site.fast == 1 and not site.fallback, (dim, site)
            assert ("bfloat16", dim) in RMSNORM.verified
        else:
            assert site.fast == 0 and site.fallback == {"D outside the reproduced reduction": 1}, (dim, site)


def test_tiny_ideogram4_with_the_published_llm_width_patched_equals_unpatched(emulated_kernels):
    """The tiny zoo Ideogram 4 with its published ``llm_features_dim`` (53248): its ``llm_cond_norm`` is swapped to
    the fused norm and runs fast (emulated kernels), patched == unpatched, unpatch restores the classes."""
    import diffusers_fastpath as fp
    from diffusers_fastpath._state import sites_of
    from diffusers_fastpath.testing import zoo
    from diffusers_fastpath.testing.zoo._zoo import randomize_

    entry = zoo.ZOO["ideogram4"]
    torch.manual_seed(0)
    model = randomize_(entry.cls(**{**entry.tiny_config, "llm_features_dim": 53248}).to(torch.bfloat16), 0).eval()
    kwargs = zoo.inputs("ideogram4", model)
    assert kwargs["encoder_hidden_states"].shape[-1] == 53248
    classes = [type(m) for m in model.modules()]
    with torch.no_grad():
        ref = model(**kwargs)[0].clone()
    fp.patch(model)
    try:
        with torch.no_grad():
            first = model(**kwargs)[0].clone()  # verified: run both ways
            second = model(**kwargs)[0]
        assert torch.equal(first, ref) and torch.equal(second, ref)
        (site,) = [s for _, s in sites_of(model.llm_cond_norm)]
        assert site.op == "rmsnorm" and site.fast >= 1 and not site.fallback, site
    finally:
        fp.unpatch(model)
    assert [type(m) for m in model.modules()] == classes


@pytest.fixture(scope="module")
def nvrtc_kernels():
    """The NVRTC cubins (beside the nvcc extension where a toolkit is there): their launcher writes into a given
    output, which the GPU tests fill with NaN first."""
    from diffusers_fastpath.ops import _build, _nvrtc

    _build.load_extension()
    major, minor = torch.cuda.get_device_capability()
    _nvrtc.build(_build.csrc_dir(), _build.cache_root(), f"{major}{minor}", _build.NVRTC_FLAGS)


def _check_wide(shape, dtype, seed):
    """The wide kernel against diffusers' forward: written into a NaN-filled output (NVRTC's launcher), through the
    raw op (the way the package loaded), and through the op (fast, verified for (dtype, D))."""
    norm, x = make(shape, dtype, "cuda", seed, transposed=False)
    ref = norm(x)
    rows = x.reshape(-1, 1, shape[-1])
    poisoned = torch.full_like(rows, float("nan"))
    _rmsnorm_module()._nvrtc_kernel(rows, norm.weight, norm.eps, out=poisoned)
    assert torch.equal(poisoned.view(shape), ref)
    del poisoned
    raw = torch.ops.diffusers_fastpath._rmsnorm_plain_cuda(rows, norm.weight, norm.eps)
    assert torch.equal(raw.view(shape), ref)
    del raw
    site = Site("rmsnorm")
    assert torch.equal(rmsnorm(norm, x, site), ref)
    assert site.fast == 1 and not site.fallback, site


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2048, 53248), (2, 300, 53248), (1, 16, 8164), (2, 300, 8192),
                                   (1, 64, 12288), (1, 33, 16384), (1, 17, 32768), (1, 20, 65536), (1, 16, 130560),
                                   (3, 19, 9996), (1, 40, 53252), (1, 257, 8188)], ids=str)
def test_split_rows_match_eager_bitwise_on_the_gpu(shape, dtype, nvrtc_kernels):
    """Rows wider than 8160, where aten splits a row across its block's 16 warps: Ideogram 4's ``llm_cond_norm``
    (53248 over 2048 text tokens, a CFG-sized batch), powers of two up to 65536, the guard's widest (130560) and odd
    multiples of 4; fresh inputs, the kernel's output poisoned; verified for (dtype, D) and kept."""
    with torch.no_grad():
        for seed in range(2):
            _check_wide(shape, dtype, seed)
    assert RMSNORM.disabled is None and (str(dtype).removeprefix("torch."), shape[-1]) in RMSNORM.verified


@pytest.mark.gpu
def test_ideogram4_full_size_llm_norm_matches_eager_bitwise_on_the_gpu(nvrtc_kernels):
    """Ideogram 4's full-size ``llm_cond_norm`` input, [1, 18432, 53248] bf16 (2048 text + 16384 image tokens: 3.9 GB
    of fp32 squares, which aten reduces in two 32-bit sub-iterators of whole rows): equal to diffusers' forward."""
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs about 20 GB of GPU memory for eager's fp32 temporaries")
    with torch.no_grad():
        _check_wide((1, 18432, 53248), torch.bfloat16, 7)
    assert RMSNORM.disabled is None


def _wide_kernel_sum(row) -> float:
    """csrc/rmsnorm_scale_shift.cu's rmsnorm_wide_kernel, transcribed thread by thread in float32 scalars: thread
    t = lane + 32 y adds quads t, t + 512, ... into four accumulators, ((a_0 + a_1) + a_2) + a_3, the shuffle-down
    tree in each warp, then warp 0's tree over the 16 warp sums."""
    import numpy as np

    sq = [np.float32(v) * np.float32(v) for v in row.float().tolist()]
    sums = []
    for t in range(512):
        acc = [np.float32(0)] * 4
        for q in range(t, len(sq) // 4, 512):
            acc = [acc[j] + sq[4 * q + j] for j in range(4)]
        sums.append(((acc[0] + acc[1]) + acc[2]) + acc[3])

    def shuffle_down(v, offsets):
        for off in offsets:
            v = [v[i] + (v[i + off] if i + off < len(v) else v[i]) for i in range(len(v))]
        return v[0]

    warps = [shuffle_down(sums[32 * y:32 * (y + 1)], (16, 8, 4, 2, 1)) for y in range(16)]
    return float(shuffle_down(warps, (8, 4, 2, 1)))


def test_probe_emulates_the_wide_kernels_order_and_tells_the_orders_apart(tool):
    """tools/wide_rmsnorm_probe.py's emulation of the ``xy`` order (a warp's shuffle, then the warps' tree) is the
    wide kernel's arithmetic, transcribed thread by thread; the ``yx`` order (the warps' tree lane by lane first) and
    the ascending shuffle give other sums on such rows, so the probe's row counts can tell which order aten takes."""
    probe = tool("wide_rmsnorm_probe")
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(3, 8196, generator=gen) * torch.exp(torch.randn(3, 8196, generator=gen))).to(torch.bfloat16)
    sq = x.float().pow(2)
    xy = probe.emulated_sum(sq, 32, 16, 4, "xy", "down")
    assert [float(v) for v in xy] == [_wide_kernel_sum(row) for row in x]
    for combine, shuffle in (("yx", "down"), ("xy", "up"), ("yx", "up")):
        assert not torch.equal(probe.emulated_sum(sq, 32, 16, 4, combine, shuffle), xy), (combine, shuffle)
