"""silu_mul (SwiGLU's ``F.silu(gate) * up``) and swiglu_cat (the same written into a concatenation after it): the
bit-exact contract and the proof on every value on the GPU, their guards, fallback and custom ops everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffusers_fastpath.ops import Site, silu_mul, silu_mul_ref, swiglu_cat, swiglu_cat_ref
from diffusers_fastpath.ops._policy import REASON_LAYOUT
from diffusers_fastpath.ops.silu_mul import SILU_MUL, SWIGLU_CAT

# [B, L, 2D] projections whose chunk(2, dim=-1) halves feed the op: FLUX.2-dev's feed-forward at 1024x1024 (4096 image
# tokens, D = 18432) and its single blocks' MLP (4608 joint tokens), a CFG batch, FLUX.2-klein's width, a small case
SHAPES = [(1, 4096, 2 * 18432), (1, 4608, 2 * 18432), (2, 512, 2 * 18432), (1, 4608, 2 * 9216), (1, 17, 128)]
DTYPES = [torch.bfloat16, torch.float16]


def make_inputs(shape, dtype, device, seed, layout="chunk"):
    """The two halves of one projection (``x.chunk(2, dim=-1)``: row stride 2D, no copy), or two contiguous tensors
    (a feed-forward with separate gate and up projections)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(shape, generator=gen, device=device) * 3).to(dtype)
    if layout == "chunk":
        return x.chunk(2, dim=-1)
    half = shape[2] // 2
    return x[..., :half].contiguous(), x[..., half:].contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["chunk", "separate"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_silu_mul_matches_eager_bitwise_and_is_proven(shape, dtype, layout):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    for seed in range(2):
        gate, up = make_inputs(shape, dtype, "cuda", seed, layout)
        ref = silu_mul_ref(gate, up)
        out = torch.full_like(ref, float("nan"))  # poisoned: every element must be written
        torch.ops.diffusers_fastpath._silu_mul_cuda_out(out, gate, up)
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
        site = Site("silu_mul")
        assert torch.equal(silu_mul(gate, up, site), ref)
        assert site.fast == 1 and not site.fallback, site  # the proof on all 65536 values passed
    assert SILU_MUL.disabled is None and SILU_MUL.verified == {(str(dtype).removeprefix("torch."),)}


def test_rounding_the_silu_matters():
    """Keeping the SiLU in fp32 into the product (skipping its rounding) changes many outputs: only a kernel with
    eager's two rounding points passes the GPU test above."""
    gate, up = make_inputs((1, 64, 512), torch.bfloat16, "cpu", 0)
    unrounded = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)
    assert (unrounded != silu_mul_ref(gate, up)).float().mean().item() > 0.05


@pytest.mark.parametrize("case, reason", [
    ("fp32", "dtype float32"), ("mixed", "mixed dtypes"), ("4d", "shape"), ("1d", "shape"),
    ("2d", "device cpu"), ("2d-strided", "rows strided"), ("odd", "D not a multiple of 8"),
    ("strided", "rows strided"), ("cpu", "device cpu"), ("map", "device cpu"), ("map-last", "device cpu"),
    ("map-strided", "shape"), ("map-odd", "D not a multiple of 8"), ("map-size1", "shape"),
    ("map-mixed", "feature maps laid out differently")])
def test_guard_falls_back_with_reason(case, reason):
    """Every refusal with its reason and the eager result; packed ``[N, D]`` rows (Cosmos 3) pass the guard as the
    ``[1, N, D]`` the kernel runs on (here refused for the CPU only), and so do the channel halves of a feature map
    (Sana's GLUMBConv) as ``[B, C, H * W]``: not where a sample's strides are not contiguous ones (a transposed map; a
    size-1 dimension with another stride) or its ``H * W`` is no whole number of 16-byte vectors."""
    gate, up = make_inputs((2, 9, 128), torch.bfloat16, "cpu", 1)
    fmap = torch.randn(2, 16, 4, 6, dtype=torch.bfloat16)
    last = torch.randn(2, 4, 6, 16, dtype=torch.bfloat16).permute(0, 3, 1, 2)  # channels last, as Sana's convolutions
    odd = torch.randn(2, 16, 3, 5, dtype=torch.bfloat16)
    size1 = torch.randn(800, dtype=torch.bfloat16).as_strided((2, 8, 1, 24), (384, 24, 7, 1))
    args = {
        "fp32": (gate.float(), up.float()), "mixed": (gate, up.half()), "4d": (gate[None], up[None]),
        "1d": (gate[0, 0], up[0, 0]), "2d": (gate[0], up[0]), "2d-strided": (gate[0, :, ::2], up[0, :, ::2]),
        "odd": (gate[..., :60], up[..., :60]), "strided": (gate[..., ::2], up[..., ::2]), "cpu": (gate, up),
        "map": fmap.chunk(2, dim=1), "map-last": last.chunk(2, dim=1),
        "map-strided": fmap.transpose(2, 3).chunk(2, dim=1), "map-odd": odd.chunk(2, dim=1),
        "map-size1": (size1, size1.clone()), "map-mixed": (last.chunk(2, dim=1)[0], fmap.chunk(2, dim=1)[0]),
    }[case]
    assert SILU_MUL.guard(*args) == reason
    site = Site("silu_mul")
    assert torch.equal(silu_mul(*args, site), silu_mul_ref(*args))
    assert site.fast == 0 and site.fallback == {reason: 1}


def test_only_rows_whose_eager_product_is_contiguous_take_the_kernel(monkeypatch):
    """The kernel writes contiguous rows, eager lays its product out after the gate: the ``[B, L, D]`` halves of a
    sequence-first ``[L, B, 2D]`` projection run eager, counted, with eager's strides; a ``[B, L, 2D]`` projection's
    halves, packed rows and Sana's channels-last halves (eager's product in the kernel's row order) still take the
    kernel, and `swiglu_cat`, whose concatenation is contiguous either way, takes the sequence-first halves too."""
    import sys

    mod = sys.modules["diffusers_fastpath.ops.silu_mul"]  # the package exports a function of that name
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(mod, "_cuda_op", lambda g, u: (F.silu(g) * u).contiguous())  # the raw op: contiguous rows
    monkeypatch.setattr(SILU_MUL, "prove", None)  # (it runs the CUDA kernel on every value)
    seq_first = torch.randn(9, 2, 128, dtype=torch.bfloat16).transpose(0, 1)
    channels_last = torch.randn(2, 4, 6, 32, dtype=torch.bfloat16).permute(0, 3, 1, 2)
    cases = [(seq_first.chunk(2, dim=-1), False), (make_inputs((2, 9, 128), torch.bfloat16, "cpu", 2), True),
             (torch.randn(9, 128, dtype=torch.bfloat16).chunk(2, dim=-1), True), (channels_last.chunk(2, dim=1), True)]
    for (gate, up), fast in cases:
        site = Site("silu_mul")
        out, ref = silu_mul(gate, up, site), silu_mul_ref(gate, up)
        assert torch.equal(out, ref) and out.stride() == ref.stride()
        assert (site.fast, dict(site.fallback)) == ((1, {}) if fast else (0, {REASON_LAYOUT: 1}))
    assert SWIGLU_CAT.guard(torch.randn(2, 9, 64, dtype=torch.bfloat16), seq_first) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, width", [(9000, 12288), (4680, 14336), (17, 128)])
def test_silu_mul_packed_rows_match_eager_bitwise(rows, width, dtype):
    """Packed ``[N, D]`` rows (Cosmos 3's feed-forward over its packed sequence, intermediate 12288; MiniMax-H3's
    14336): the kernel's ``[1, N, D]``, fast, its output every element written and viewed back as ``[N, D]``."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    gate, up = make_inputs((1, rows, 2 * width), dtype, "cuda", 3)
    gate, up = gate[0], up[0]
    ref = silu_mul_ref(gate, up)
    out = torch.full((1, rows, width), float("nan"), dtype=dtype, device="cuda")  # poisoned
    torch.ops.diffusers_fastpath._silu_mul_cuda_out(out, gate[None], up[None])
    assert torch.equal(out[0], ref)
    site = Site("silu_mul")
    got = silu_mul(gate, up, site)
    assert got.shape == ref.shape and torch.equal(got, ref)
    assert site.fast == 1 and not site.fallback, site


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels_last", [True, False], ids=["channels_last", "channels_first"])
@pytest.mark.parametrize("shape", [(2, 5600, 32, 32), (1, 5600, 64, 64), (2, 16, 3, 8, 8)], ids=str)
def test_silu_mul_feature_map_halves_match_eager_bitwise(shape, channels_last, dtype):
    """Sana's GLUMBConv ``x * silu(gate)`` on the ``chunk(2, dim=1)`` halves of a convolution's ``[B, 2C, H, W]``
    output (Sana 1.6B: 2C = 11200 at 1024² and 2048² latents, channels last as its convolutions give it; channels
    first; a 5-D map): fast as rows in memory order, every element written (poisoned output), the result laid out as
    eager's."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    torch.manual_seed(4)
    x = torch.randn(shape[0], 2 * shape[1], *shape[2:], dtype=dtype, device="cuda")
    if channels_last:
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    up, gate = x.chunk(2, dim=1)
    ref = up * F.silu(gate)
    site = Site("silu_mul")
    got = silu_mul(gate, up, site)
    assert got.shape == ref.shape and got.stride() == ref.stride() and torch.equal(got, ref)
    assert site.fast == 1 and not site.fallback, site
    rows = (lambda t: t.movedim(1, -1).flatten(1, -2)) if channels_last else (lambda t: t.flatten(2))
    out = torch.full(rows(gate).shape, float("nan"), dtype=dtype, device="cuda")  # poisoned, contiguous rows
    torch.ops.diffusers_fastpath._silu_mul_cuda_out(out, rows(gate), rows(up))
    assert torch.equal(out, rows(ref))


@pytest.mark.parametrize("layout", ["chunk", "separate", "map", "map-last"])
def test_custom_op_opcheck_cpu(layout):
    if layout.startswith("map"):  # a feature map's channel halves: the fake lays the result out as the op does
        x = torch.randn(2, 4, 6, 32, dtype=torch.bfloat16)
        gate, up = (x.permute(0, 3, 1, 2) if layout == "map-last" else x.transpose(1, 3).contiguous()).chunk(2, dim=1)
    else:
        gate, up = make_inputs((2, 9, 128), torch.bfloat16, "cpu", 2, layout)
    torch.library.opcheck(torch.ops.diffusers_fastpath.silu_mul.default, (gate, up))
    assert torch.equal(torch.ops.diffusers_fastpath.silu_mul(gate, up), silu_mul_ref(gate, up))


def test_flux2_swiglu_is_rewritten_and_hooks_keep_it_as_written(emulated_kernels):
    """FLUX.2's Flux2SwiGLU goes through the op (kernel emulated here); an activation with a hook runs as written."""
    from diffusers.models.transformers.transformer_flux2 import Flux2SwiGLU

    from diffusers_fastpath.models.flux2 import FastpathFlux2SwiGLU

    ref, fused = Flux2SwiGLU(), Flux2SwiGLU()
    fused.__class__ = FastpathFlux2SwiGLU
    fused._fastpath_site_silu_mul = Site("silu_mul")
    x = torch.randn(2, 9, 256).bfloat16()
    with torch.no_grad():
        assert torch.equal(fused(x), ref(x))
        assert fused._fastpath_site_silu_mul.fast == 1
        fused.gate_fn.register_forward_hook(lambda m, i, o: o * 2)
        ref.gate_fn.register_forward_hook(lambda m, i, o: o * 2)
        assert torch.equal(fused(x), ref(x))
    assert fused._fastpath_site_silu_mul.fast == 1  # the hooked call did not take the fused path


# --- swiglu_cat ---------------------------------------------------------------------------------------------------

# (tokens, attention width, MLP hidden width) of FLUX.2's parallel single blocks: dev at 1024x1024 (4096 image + 512
# text tokens), klein-4B, a small case
CAT_SHAPES = [(4608, 6144, 18432), (4608, 3072, 9216), (17, 64, 128)]


def make_cat_inputs(batch, tokens, width, hidden, dtype, device, seed):
    """FLUX.2's layout: x the MLP part of the fused projection's output (a column slice, row stride 3 * width + 2 *
    hidden), the attention output a transposed [B, S, H, D] view flattened (not contiguous in general)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    proj = (torch.randn(batch, tokens, 3 * width + 2 * hidden, generator=gen, device=device) * 3).to(dtype)
    heads = width // 64 if width >= 64 else 1
    attn = torch.randn(batch, heads, tokens, width // heads, generator=gen, device=device).to(dtype)
    return attn.transpose(1, 2).flatten(2, 3), proj[..., 3 * width:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("shape", CAT_SHAPES, ids=str)
def test_swiglu_cat_matches_eager_bitwise_and_writes_only_its_columns(shape, batch, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    tokens, width, hidden = shape
    for seed in range(2):
        attn, x = make_cat_inputs(batch, tokens, width, hidden, dtype, "cuda", seed)
        ref = swiglu_cat_ref(attn, x)
        # the raw kernel into the SwiGLU columns of a poisoned buffer: those all written, the others untouched
        buf = torch.full_like(ref, float("nan"))
        torch.ops.diffusers_fastpath._silu_mul_cuda_out(buf[..., width:], x[..., :hidden], x[..., hidden:])
        torch.cuda.synchronize()
        assert torch.equal(buf[..., width:], ref[..., width:])
        assert buf[..., :width].isnan().all()
        site = Site("swiglu_cat")
        got = swiglu_cat(attn, x, site)
        assert got.is_contiguous() and torch.equal(got, ref)
        assert site.fast == 1 and not site.fallback, site  # first call verified, SiLU proven on every value
    assert SWIGLU_CAT.disabled is None and (str(dtype).removeprefix("torch."),) in SWIGLU_CAT.verified


@pytest.mark.parametrize("case, reason", [
    ("fp32", "dtype float32"), ("mixed", "mixed dtypes"), ("odd", "odd width"), ("narrow", "D not a multiple of 8"),
    ("attn_width", "attention width not a multiple of 8"), ("batch", "shape"), ("cpu", "device cpu")])
def test_swiglu_cat_guard_falls_back_with_reason(case, reason):
    attn, x = make_cat_inputs(2, 9, 64, 128, torch.bfloat16, "cpu", 3)
    args = {
        "fp32": (attn.float(), x.float()), "mixed": (attn.half(), x), "odd": (attn, x[..., :255]),
        "narrow": (attn, x[..., :120]), "attn_width": (attn[..., :60], x), "batch": (attn[:1], x), "cpu": (attn, x),
    }[case]
    assert SWIGLU_CAT.guard(*args) == reason
    site = Site("swiglu_cat")
    if case in ("odd", "batch"):  # halves of different widths, operands of different batches: eager raises, and
        # so does the fallback
        with pytest.raises(RuntimeError):
            swiglu_cat(*args, site)
    else:
        assert torch.equal(swiglu_cat(*args, site), swiglu_cat_ref(*args))
    assert site.fast == 0 and site.fallback == {reason: 1}


def test_swiglu_cat_custom_op_opcheck_cpu():
    attn, x = make_cat_inputs(2, 9, 64, 128, torch.bfloat16, "cpu", 4)
    torch.library.opcheck(torch.ops.diffusers_fastpath.swiglu_cat.default, (attn, x))
    assert torch.equal(torch.ops.diffusers_fastpath.swiglu_cat(attn, x), swiglu_cat_ref(attn, x))


@pytest.mark.parametrize("laid_out", ["alike", "up_transposed", "gate_transposed"])
def test_written_up_first_keeps_eagers_layout(laid_out, emulated_kernels):
    """``up * act(gate)`` (diffusers' SwiGLU, SanaWM's output gate): where the two operands are laid out differently
    the product is laid out after ``up``, as eager lays it out (not after the gate, as ``act(gate) * up`` would be:
    the same values, but a Linear after it, or a backward through it, may round differently on another layout);
    where they are laid out alike the fused op runs."""
    from diffusers_fastpath.models._chain_calls import _ChainsNamespace

    gen = torch.Generator().manual_seed(5)
    gate, up = (torch.randn(2, 24, 64, generator=gen).bfloat16() for _ in range(2))
    if laid_out == "up_transposed":
        up = up.transpose(1, 2).contiguous().transpose(1, 2)  # [B, S, D] values, [B, D, S] memory
    elif laid_out == "gate_transposed":
        gate = gate.transpose(1, 2).contiguous().transpose(1, 2)
    site = Site("silu_mul")
    out = _ChainsNamespace.mul_silu(up, None, gate, site)
    ref = up * F.silu(gate)
    assert torch.equal(out, ref) and out.stride() == ref.stride()
    if laid_out == "alike":
        assert site.fast == 1 and not site.fallback
    else:
        assert site.fast == 0 and dict(site.fallback) == {"operands laid out differently": 1}
        assert (F.silu(gate) * up).stride() != ref.stride()  # the other order: another layout (the bug this guards)


def test_swiglu_cat_guard_hands_check_pointers_on(monkeypatch):
    """``check_pointers=False`` (what torch.compile's trace asks: fake tensors have no address) reaches the halves'
    guard: a misaligned x is refused only where pointers are checked (it once went to ``up_first``)."""
    import sys

    module = sys.modules["diffusers_fastpath.ops.silu_mul"]
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    attn = torch.randn(1, 16, 64).to(torch.bfloat16)
    x = torch.randn(16 * 128 + 1).to(torch.bfloat16)[1:].view(1, 16, 128)  # one element in: not 16-byte aligned
    assert module._cat_guard(attn, x, None, check_pointers=False) is None
    assert module._cat_guard(attn, x, None, check_pointers=True) is not None


def _rows_as_views(t):
    """The kernel's rows made as views (the guard's `_rows_layout` reads their sizes and strides without making
    them): ``unsqueeze(0)`` of packed rows, a feature map's ``movedim(1, -1)`` then ``flatten`` (channels last) or
    ``flatten(2)`` (channels first)."""
    if t.dim() == 2:
        return t.unsqueeze(0), False
    if t.dim() <= 3 or 1 in t.shape[1:] or t.stride(0) < max(st * n for st, n in zip(t.stride()[1:], t.shape[1:])):
        return t, False
    last = t.stride(1) == 1
    spatial = t.movedim(1, -1) if last else t
    lo, hi = (1, t.dim() - 2) if last else (2, t.dim() - 1)
    if not last and spatial.stride(hi) != 1:
        return t, False
    if any(spatial.stride(i) != spatial.stride(i + 1) * spatial.shape[i + 1] for i in range(lo, hi)):
        return t, False
    return spatial.flatten(lo, hi), last


def _layouts():
    """Tensors of every layout the guard meets and then some: packed rows (sliced, empty, stride 0), feature maps
    channels first and last (halves of a convolution's output, 3-D and 5-D), permuted, sliced, with size-1 dims."""
    base = torch.arange(4 * 6 * 8 * 10, dtype=torch.bfloat16)
    out = [base.view(24, 80), base.view(24, 80)[:, :40], base.view(80, 24).t(), base[:1].expand(7, 16),
           base.view(24, 80)[:0], base.view(4, 8, 6, 10).movedim(1, -1)]
    for shape in ((2, 16, 6, 5), (1, 32, 3, 2), (2, 8, 3, 2, 5), (3, 16, 10), (2, 4, 1, 6), (2, 2, 4, 6)):
        x = torch.zeros(shape, dtype=torch.bfloat16)
        last = x.movedim(1, -1).contiguous().movedim(-1, 1)  # channels last
        out += [x, last, x.chunk(2, dim=1)[1], last.chunk(2, dim=1)[1], x.transpose(-1, -2), x[..., ::2],
                x.movedim(0, -1), last[:, :, 1:]]
    return out


@pytest.mark.parametrize("t", _layouts(), ids=lambda t: f"{tuple(t.shape)}:{t.stride()}")
def test_rows_layout_is_the_views_the_kernel_makes(t):
    from diffusers_fastpath.ops._policy import laid_out_contiguous, layout_laid_out_contiguous
    from diffusers_fastpath.ops.silu_mul import _rows_layout, _rows_of

    view, last = _rows_as_views(t)
    layout = _rows_layout(t.shape, t.stride())
    assert layout is None if view is t else layout == (tuple(view.shape), view.stride(), last)
    rows, rows_last = _rows_of(t)
    assert (rows.shape, rows.stride(), rows.storage_offset(), rows_last) == (
        view.shape, view.stride(), view.storage_offset(), last)
    assert layout_laid_out_contiguous(tuple(view.shape), view.stride()) is laid_out_contiguous(view)
