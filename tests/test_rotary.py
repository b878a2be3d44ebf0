"""rotary_emb (exact by construction), its rows form rotary_emb_rows (LTX-Video's), Wan's rotary_emb_wan and qk_norm_rope (QK RMSNorm +
text/image cat + RoPE, self-verified): bit-exact on GPU at FLUX.1-dev's and LTX-Video's shapes with the fast path
verified (and Wan's), and their guards, verification and fallbacks everywhere."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from diffusers.models.transformers.transformer_flux import FluxPosEmbed

from diffusers.models.transformers.transformer_ltx import apply_rotary_emb as ltx_apply_rotary_emb

from diffusers_fastpath.ops import (Site, qk_norm_rope, qk_norm_rope_ref, rotary_emb, rotary_emb_ref, rotary_emb_rows,
                                    rotary_emb_rows_ref, rotary_emb_wan, rotary_emb_wan_ref)
from diffusers_fastpath.ops import _policy
from diffusers_fastpath.ops.qk_norm_rope import QK_NORM_ROPE
from diffusers_fastpath.ops.rotary import ROTARY_EMB, ROTARY_EMB_ROWS, ROTARY_EMB_WAN

DTYPES = [torch.bfloat16, torch.float16]


def rope_tables(seq, dim, device, seed=0, txt=0, grid=None):
    """fp32 [seq, dim] cos/sin: FLUX.1's own (axes 16/56/56; `txt` text ids 0, then image ids (0, row, col) of
    `grid`) when a grid is given, random in [-1, 1] otherwise."""
    if grid is None:
        gen = torch.Generator(device=device).manual_seed(seed)
        return tuple(torch.rand(seq, dim, generator=gen, device=device) * 2 - 1 for _ in range(2))
    h, w = grid
    assert dim == 128 and seq == txt + h * w
    img = torch.zeros(h, w, 3)
    img[..., 1] = torch.arange(h)[:, None]
    img[..., 2] = torch.arange(w)[None, :]
    ids = torch.cat([torch.zeros(txt, 3), img.reshape(-1, 3)]).to(device)
    cos, sin = FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])(ids)
    return cos.contiguous(), sin.contiguous()


def activations(shape, dtype, device, gen, strided=False):
    """[B, S, H, D] with per-head scales spread over decades (as q/k projections have); `strided` lays it out as
    the q part of a fused qkv projection (``to_qkv(x).chunk(3, -1)[0].unflatten(-1, (H, D))``)."""
    b, s, h, d = shape
    heads = 3 * h if strided else h
    buf = torch.randn(b, s, heads, d, generator=gen, device=device)
    buf = buf * torch.exp(torch.randn(b, s, heads, 1, generator=gen, device=device))
    return buf.to(dtype)[:, :, :h]


def norm_of(dim, dtype, device, gen, eps=1e-6):
    norm = torch.nn.RMSNorm(dim, eps=eps).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(dim, generator=gen, device=device))
    return norm.requires_grad_(False)


def qk_inputs(txt, img, heads, dim, dtype, device, seed, batch=1, grid=None, strided=False):
    gen = torch.Generator(device=device).manual_seed(seed)
    norm_txt, norm_img = norm_of(dim, dtype, device, gen), norm_of(dim, dtype, device, gen)
    x_txt = activations((batch, txt, heads, dim), dtype, device, gen, strided) if txt else None
    x_img = activations((batch, img, heads, dim), dtype, device, gen, strided)
    cos, sin = rope_tables(txt + img, dim, device, seed, txt, grid)
    return (norm_txt if txt else None), x_txt, norm_img, x_img, cos, sin


# --- GPU: the contract ---------------------------------------------------------------------------------------

# (batch, seq, heads, dim): FLUX.1-dev 1024x1024 single-stream and text parts, CFG batch, odd lengths, D > 128 (the
# kernel's second lane pass), D = 12 (three of 32 lanes busy).
ROPE_SHAPES = [(1, 4608, 24, 128), (2, 4608, 24, 128), (1, 512, 24, 128), (2, 1037, 24, 128), (1, 17, 3, 64),
               (2, 33, 5, 256), (1, 9, 2, 12)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
def test_rotary_emb_matches_eager_bitwise(shape, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    ops = torch.ops.diffusers_fastpath
    b, s, h, d = shape
    for seed, strided in [(0, False), (1, True)]:  # fresh inputs each round; the second as a fused-qkv view
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = activations(shape, dtype, "cuda", gen, strided)
        cos, sin = rope_tables(s, d, "cuda", seed, grid=(1, s) if d == 128 else None)
        ref = rotary_emb_ref(x, cos, sin)
        out = torch.full(shape, float("nan"), dtype=dtype, device="cuda")  # poisoned
        ops._rotary_emb_cuda_out(out, x, cos, sin)
        assert torch.equal(out, ref)
        site = Site("rotary_emb")
        assert torch.equal(rotary_emb(x, cos, sin, site), ref)
        assert site.fast == 1 and not site.fallback


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_emb_special_values_bitwise(dtype):
    """NaN, inf, signed zeros, subnormals and the largest finite values in x and in the tables: the same bits as
    eager (compared as integers, since NaN != NaN)."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()  # the raw op below is the extension's (a worker may run this test first)
    gen = torch.Generator(device="cuda").manual_seed(3)
    info = torch.finfo(dtype)
    specials = torch.tensor(
        [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, info.tiny, -info.tiny, info.tiny / 4, info.max,
         -info.max, 1.0, -1.0],
        dtype=dtype,
    )
    x = torch.randn(2, 64, 4, 128, generator=gen, device="cuda").to(dtype)
    pick = torch.randint(0, len(specials), x.shape, generator=gen, device="cuda")
    x = torch.where(torch.rand(x.shape, generator=gen, device="cuda") < 0.3, specials.cuda()[pick], x)
    cos, sin = rope_tables(64, 128, "cuda", 4)
    table_specials = torch.tensor([float("nan"), float("inf"), -0.0, 0.0, 1e-42, -1.0], device="cuda")
    cos[::7, ::5] = table_specials[torch.arange(cos[::7, ::5].numel(), device="cuda") % 6].view_as(cos[::7, ::5])
    sin[3::11, 1::3] = -table_specials[torch.arange(sin[3::11, 1::3].numel(), device="cuda") % 6].view_as(
        sin[3::11, 1::3]
    )
    ref = rotary_emb_ref(x, cos, sin)
    assert ref.isnan().any() and ref.isinf().any() and (_bits(ref) == _bits(torch.tensor(-0.0, dtype=dtype))).any()
    out = torch.full_like(x, float("nan"))
    torch.ops.diffusers_fastpath._rotary_emb_cuda_out(out, x, cos, sin)
    assert torch.equal(_bits(out), _bits(ref))


def ltx_tables(batch, seq, channels, device, seed):
    """fp32 [batch, seq, C] cos/sin as LTXVideoRotaryPosEmbed lays them out (each angle twice, interleaved; a
    different table per sample), angles random."""
    gen = torch.Generator(device=device).manual_seed(seed)
    angle = torch.rand(batch, seq, channels // 2, generator=gen, device=device) * 50
    return tuple(f(angle).repeat_interleave(2, dim=-1).contiguous() for f in (torch.cos, torch.sin))


# (batch, seq, C, table batch): LTX-Video 768x512x121 (6,144 tokens, 2048 channels: 32 heads of 64), its CFG batch
# with a table per sample and with one for both, a qkv-strided view, odd small ones (C = 200: heads of 8; C = 12)
ROWS_CASES = [(1, 6144, 2048, 1), (2, 6144, 2048, 2), (2, 6144, 2048, 1), (2, 37, 200, 2), (1, 5, 12, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ROWS_CASES, ids=str)
def test_rotary_emb_rows_matches_ltx_bitwise(case, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    b, s, c, tb = case
    for seed, strided in [(0, False), (1, True)]:  # fresh inputs each round; the second a view of a qkv projection
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = (torch.randn(b, s, 3 * c if strided else c, generator=gen, device="cuda") * 4).to(dtype)[..., :c]
        cos, sin = ltx_tables(tb, s, c, "cuda", seed)
        ref = ltx_apply_rotary_emb(x, (cos, sin))
        assert torch.equal(ref, rotary_emb_rows_ref(x, cos, sin))
        poison = torch.full((b, s, c), float("nan"), dtype=dtype, device="cuda")
        del poison  # its block is what the caching allocator hands the kernel's output next: NaN unless written
        site = Site("rotary_emb")
        assert torch.equal(rotary_emb_rows(x, cos, sin, site), ref)
        assert site.fast == 1 and not site.fallback
        for head_dim in {4, 128 if c % 128 == 0 else 4, c}:  # any split of the row into heads: the same bits
            assert torch.equal(torch.ops.diffusers_fastpath._rotary_emb_rows_cuda(x, cos, sin, head_dim), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_emb_rows_special_values_bitwise(dtype):
    gen = torch.Generator(device="cuda").manual_seed(5)
    info = torch.finfo(dtype)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, info.tiny / 4, info.max, -1.0],
                            dtype=dtype, device="cuda")
    x = torch.randn(2, 64, 512, generator=gen, device="cuda").to(dtype)
    pick = torch.randint(0, len(specials), x.shape, generator=gen, device="cuda")
    x = torch.where(torch.rand(x.shape, generator=gen, device="cuda") < 0.3, specials[pick], x)
    cos, sin = ltx_tables(2, 64, 512, "cuda", 6)
    cos[:, ::7, ::5], sin[:, 3::11, 1::3] = -0.0, float("inf")
    ref = ltx_apply_rotary_emb(x, (cos, sin))
    assert ref.isnan().any() and ref.isinf().any()
    assert torch.equal(_bits(rotary_emb_rows(x, cos, sin)), _bits(ref))


def wan_tables(seq_shape, device):
    """Wan's own fp32 [1, S, 1, 128] cos/sin (WanRotaryPosEmbed of head_dim 128, patch (1, 2, 2)) for a latent of
    `seq_shape` (frames, height, width)."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    f, h, w = seq_shape
    rope = WanRotaryPosEmbed(128, (1, 2, 2), 1024).to(device)
    return rope(torch.empty(1, 16, f, 2 * h, 2 * w, device=device))


# (batch, (frames, height, width) of the patched latent, heads): Wan 2.1 14B at 832x480x81 (21 x 30 x 52 = 32,760
# tokens, 40 heads of 128), a CFG-sized batch, a small odd one
WAN_CASES = [(1, (21, 30, 52), 40), (2, (3, 5, 7), 12), (1, (1, 3, 3), 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", WAN_CASES, ids=str)
def test_rotary_emb_wan_matches_eager_bitwise(case, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    b, grid, heads = case
    cos, sin = wan_tables(grid, "cuda")
    seq = cos.shape[1]
    for seed, own in [(0, True), (1, False)]:  # Wan's own tables, then random ones (each pair's two entries differ)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = activations((b, seq, heads, 128), dtype, "cuda", gen)
        if not own:
            cos, sin = (t.reshape(seq, 128).contiguous().view(1, seq, 1, 128) for t in rope_tables(seq, 128, "cuda", seed))
        ref = rotary_emb_wan_ref(x, cos, sin)
        poison = torch.full_like(x, float("nan"))
        del poison  # its block is what the caching allocator hands the kernel's output next: NaN unless written
        site = Site("rotary_emb")
        assert torch.equal(rotary_emb_wan(x, cos, sin, site), ref)
        assert site.fast == 1 and not site.fallback


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_emb_wan_special_values_bitwise(dtype):
    gen = torch.Generator(device="cuda").manual_seed(7)
    info = torch.finfo(dtype)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, info.tiny / 4, info.max, -1.0],
                            dtype=dtype, device="cuda")
    x = torch.randn(1, 64, 4, 128, generator=gen, device="cuda").to(dtype)
    pick = torch.randint(0, len(specials), x.shape, generator=gen, device="cuda")
    x = torch.where(torch.rand(x.shape, generator=gen, device="cuda") < 0.3, specials[pick], x)
    cos, sin = (t.view(1, 64, 1, 128) for t in rope_tables(64, 128, "cuda", 8))
    cos[:, ::7, :, ::5], sin[:, 3::11, :, 1::3] = -0.0, float("inf")
    ref = rotary_emb_wan_ref(x, cos, sin)
    assert ref.isnan().any() and ref.isinf().any()
    assert torch.equal(_bits(rotary_emb_wan(x, cos, sin)), _bits(ref))


# (txt, img, heads, dim, batch, grid): FLUX.1-dev dual block at 1024x1024, single block (all 4608 tokens as one
# source), a CFG batch at 384x640 with 77 text tokens, odd small ones, head_dim 64; at head_dim 128 (the
# head_norm_rotary kernel) FLUX.2-dev's 48 heads (two rounds of the four warps' six slots) and 30 (a partial round).
QK_CASES = [
    (512, 4096, 24, 128, 1, (64, 64)),
    (0, 4608, 24, 128, 1, None),
    (77, 960, 24, 128, 2, (24, 40)),
    (7, 13, 3, 128, 2, None),
    (5, 11, 2, 64, 1, None),
    (64, 300, 48, 128, 1, None),
    (3, 29, 30, 128, 2, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", QK_CASES, ids=str)
def test_qk_norm_rope_matches_eager_bitwise_and_verifies(case, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    ops = torch.ops.diffusers_fastpath
    txt, img, heads, dim, batch, grid = case
    for seed, strided in [(0, False), (1, True)]:
        norm_txt, x_txt, norm_img, x_img, cos, sin = qk_inputs(txt, img, heads, dim, dtype, "cuda", seed, batch, grid, strided)
        ref = qk_norm_rope_ref(norm_txt, x_txt, norm_img, x_img, cos, sin)
        assert torch.isfinite(ref).all() and ref.std() > 0.1
        out = torch.full_like(ref, float("nan"))  # poisoned
        w_txt, eps_txt = (None, 0.0) if x_txt is None else (norm_txt.weight, norm_txt.eps)
        ops._qk_norm_rope_cuda_out(out, x_txt, w_txt, eps_txt, x_img, norm_img.weight, norm_img.eps, cos, sin)
        assert torch.equal(out, ref)
        site, rope_site = Site("qk_norm_rope"), Site("rotary_emb")
        assert torch.equal(qk_norm_rope(norm_txt, x_txt, norm_img, x_img, cos, sin, site, rope_site), ref)
        # the fused path really ran, verified itself against eager and stayed enabled
        assert site.fast == 1 and not site.fallback and rope_site.fast == 0
    assert QK_NORM_ROPE.disabled is None and (str(dtype).removeprefix("torch."), dim) in QK_NORM_ROPE.verified


@pytest.mark.gpu
def test_qk_norm_rope_fallback_keeps_the_fused_rope_on_cuda(monkeypatch):
    """A norm kernel that fails verification: eager result, the op disabled once, the exact rotary kernel still runs."""
    def off_by_one_ulp(*args):
        out = qk_norm_rope_ref(*args)
        return (out.view(torch.int16) + 1).view(out.dtype)

    monkeypatch.setattr(QK_NORM_ROPE, "kernel", off_by_one_ulp)
    args = qk_inputs(512, 1024, 24, 128, torch.bfloat16, "cuda", 5, grid=(32, 32))
    ref = qk_norm_rope_ref(*args)
    site, rope_site = Site("qk_norm_rope"), Site("rotary_emb")
    for _ in range(2):
        assert torch.equal(qk_norm_rope(*args, site, rope_site), ref)
    assert QK_NORM_ROPE.disabled and site.fast == 0 and rope_site.fast == 2 and not rope_site.fallback


@pytest.mark.gpu
def test_rotary_opcheck_cuda():
    norm_txt, x_txt, norm_img, x_img, cos, sin = qk_inputs(7, 13, 3, 128, torch.bfloat16, "cuda", 0, batch=2)
    ops = torch.ops.diffusers_fastpath
    torch.library.opcheck(ops.rotary_emb.default, (x_img, cos[7:], sin[7:]))
    torch.library.opcheck(
        ops.qk_norm_rope.default, (x_txt, norm_txt.weight, norm_txt.eps, x_img, norm_img.weight, norm_img.eps, cos, sin)
    )
    torch.library.opcheck(ops.qk_norm_rope.default, (None, None, 0.0, x_img, norm_img.weight, norm_img.eps, cos[7:], sin[7:]))


# --- CPU: references, guards, self-verification, fallbacks --------------------------------------------------------


def test_references_are_the_flux_processor_expressions():
    from diffusers.models.embeddings import apply_rotary_emb

    norm_txt, x_txt, norm_img, x_img, cos, sin = qk_inputs(5, 11, 2, 16, torch.bfloat16, "cpu", 0, batch=2)
    with torch.no_grad():
        expected = apply_rotary_emb(torch.cat([norm_txt(x_txt), norm_img(x_img)], dim=1), (cos, sin), sequence_dim=1)
        assert torch.equal(qk_norm_rope_ref(norm_txt, x_txt, norm_img, x_img, cos, sin), expected)
        assert torch.equal(rotary_emb_ref(x_img, cos[5:], sin[5:]), apply_rotary_emb(x_img, (cos[5:], sin[5:]), sequence_dim=1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernels_rope_formula_is_eager_bit_for_bit(dtype):
    """csrc/rotary.cu's per-pair formula, emulated with separate fp32 ops, against diffusers' apply_rotary_emb on
    random and special values (NaN, inf, signed zeros): the same bits."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 16, 3, 32, generator=gen).to(dtype)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, torch.finfo(dtype).max], dtype=dtype)
    mask = torch.rand(x.shape, generator=gen) < 0.3
    x = torch.where(mask, specials[torch.randint(0, 6, x.shape, generator=gen)], x)
    cos, sin = rope_tables(16, 32, "cpu", 9)
    cos[::3, ::4], sin[1::5, ::3] = -0.0, float("inf")
    xf, c, s = x.float(), cos[None, :, None, :], sin[None, :, None, :]
    a, b = xf[..., 0::2], xf[..., 1::2]
    out = torch.empty_like(xf)
    out[..., 0::2] = a * c[..., 0::2] + (-b) * s[..., 0::2]
    out[..., 1::2] = b * c[..., 1::2] + a * s[..., 1::2]
    ref = rotary_emb_ref(x, cos, sin)
    assert ref.isnan().any() and torch.equal(out.to(dtype).view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_rows_form_is_ltx_rotary_and_the_kernels_formula_bit_for_bit(dtype):
    """LTX-Video's apply_rotary_emb (the reference, as the adapter's digest pins it) against csrc/rotary.cu's per-pair
    formula with per-sample tables broadcast over the batch or not, on random and special values."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 16, 48, generator=gen).to(dtype)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, torch.finfo(dtype).max], dtype=dtype)
    x = torch.where(torch.rand(x.shape, generator=gen) < 0.3, specials[torch.randint(0, 6, x.shape, generator=gen)], x)
    for tb in (1, 2):
        cos, sin = ltx_tables(tb, 16, 48, "cpu", tb)
        cos[:, ::3, ::4], sin[:, 1::5, ::3] = -0.0, float("inf")
        ref = ltx_apply_rotary_emb(x, (cos, sin))
        assert torch.equal(_bits(rotary_emb_rows_ref(x, cos, sin)), _bits(ref)) and ref.isnan().any()
        a, b = x.float()[..., 0::2], x.float()[..., 1::2]
        out = torch.empty(2, 16, 48)
        out[..., 0::2] = a * cos[..., 0::2] + (-b) * sin[..., 0::2]  # the negation first: a NaN's sign follows it
        out[..., 1::2] = b * cos[..., 1::2] + a * sin[..., 1::2]
        assert torch.equal(_bits(out.to(dtype)), _bits(ref))
        assert torch.equal(_bits(rotary_emb_rows(x, cos, sin)), _bits(ref))  # CPU: the reference itself


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_wans_rotary_is_the_reference_and_the_kernels_formula_bit_for_bit(dtype):
    """The function Wan's processor defines (pinned by the adapter's digest: the rewritten processor fuses both its
    calls) against `rotary_emb_wan_ref` and csrc/rotary.cu's rotate_pair_wan, on random and special values."""
    from diffusers_fastpath.models import wan

    assert wan._PROCESSOR.rotary_named == 2  # the installed definition has the digest: q and k rewritten
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(1, 16, 3, 32, generator=gen).to(dtype)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, torch.finfo(dtype).max], dtype=dtype)
    x = torch.where(torch.rand(x.shape, generator=gen) < 0.3, specials[torch.randint(0, 6, x.shape, generator=gen)], x)
    cos, sin = (t.view(1, 16, 1, 32) for t in rope_tables(16, 32, "cpu", 12))
    cos[:, ::3, :, ::4], sin[:, 1::5, :, ::3] = -0.0, float("inf")
    ref = rotary_emb_wan_ref(x, cos, sin)
    a, b, c0, s1 = x.float()[..., 0::2], x.float()[..., 1::2], cos[..., 0::2], sin[..., 1::2]
    out = torch.empty(x.shape)
    out[..., 0::2], out[..., 1::2] = a * c0 - b * s1, a * s1 + b * c0  # rotate_pair_wan: fp32 ops, one rounding
    out = out.to(dtype)
    # bit for bit but a NaN's sign and payload, which the CPU's operations choose as they go (the GPU tests compare
    # those too)
    assert ref.isnan().any() and torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(_bits(out)[~ref.isnan()], _bits(ref)[~ref.isnan()])
    assert torch.equal(_bits(rotary_emb_wan(x, cos, sin)), _bits(ref))  # CPU: the reference itself


@pytest.mark.parametrize(
    "case, reason",
    [("per_sample_tables", "cos/sin shape"), ("strided_tables", "cos/sin strided"), ("fp32", "dtype float32"),
     ("tables_requiring_grad", "requires grad"), ("cpu", "device cpu")],
)
def test_rotary_wan_guard_falls_back_with_reason(case, reason, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 3, 16, generator=gen).to(torch.float32 if case == "fp32" else torch.bfloat16)
    cos, sin = (t.view(1, 9, 1, 16) for t in rope_tables(9, 16, "cpu", 3))
    if case == "per_sample_tables":
        cos, sin = cos.expand(2, -1, -1, -1), sin.expand(2, -1, -1, -1)
    elif case == "strided_tables":
        cos = torch.cat([cos, cos], dim=3)[..., ::2]
    elif case == "tables_requiring_grad":  # eager's result records their gradient, the kernel's nothing
        sin = sin.clone().requires_grad_()
    if case != "cpu":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    site = Site("rotary_emb")
    assert torch.equal(rotary_emb_wan(x, cos, sin, site), rotary_emb_wan_ref(x, cos, sin))
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}


@pytest.mark.parametrize(
    "case, reason",
    [
        ("fp32", "dtype float32"),
        ("odd_width", "C not a multiple of 4"),
        ("2d_tables", "shape"),
        ("strided_x", "x strided"),
        ("fp64_tables", "cos/sin not float32"),
        ("table_batch", "cos/sin shape"),
        ("strided_tables", "cos/sin strided"),
        ("requires_grad", "requires grad"),
        ("tables_requiring_grad", "requires grad"),
        ("cpu", "device cpu"),
    ],
)
def test_rotary_rows_guard_falls_back_with_reason(case, reason, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    c = 6 if case == "odd_width" else 16
    batch = 1 if case == "table_batch" else 2
    x = torch.randn(batch, 9, c, generator=gen).to(torch.float32 if case == "fp32" else torch.bfloat16)
    cos, sin = ltx_tables(2, 9, c, "cpu", 2)
    if case == "2d_tables":  # eager broadcasts them; the kernel takes LTX's [B or 1, S, C] only
        cos, sin = cos[0], sin[0]
    elif case == "strided_x":
        x = torch.cat([x, x], dim=2)[..., ::2]
    elif case == "fp64_tables":
        cos, sin = cos.double(), sin.double()
    elif case == "strided_tables":
        cos = torch.cat([cos, cos], dim=2)[..., ::2]
    elif case == "requires_grad":
        x = x.clone().requires_grad_()
    elif case == "tables_requiring_grad":  # eager's result records their gradient, the kernel's nothing
        cos = cos.clone().requires_grad_()
    if case != "cpu":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    site = Site("rotary_emb")
    assert torch.equal(rotary_emb_rows(x, cos, sin, site), rotary_emb_rows_ref(x, cos, sin))
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))


@pytest.mark.parametrize(
    "case, reason",
    [
        ("fp32", "dtype float32"),
        ("odd_dim", "D not a multiple of 4"),
        ("strided_x", "x strided"),
        ("fp64_tables", "cos/sin not float32"),
        ("strided_tables", "cos/sin strided"),
        ("requires_grad", "requires grad"),
        ("tables_requiring_grad", "requires grad"),
        ("cpu", "device cpu"),
    ],
)
def test_rotary_guard_falls_back_with_reason(case, reason, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    d = 6 if case == "odd_dim" else 16
    x = torch.randn(2, 9, 3, d, generator=gen).to(torch.float32 if case == "fp32" else torch.bfloat16)
    cos, sin = rope_tables(9, d, "cpu", 1)
    if case == "strided_x":
        x = torch.cat([x, x], dim=3)[..., ::2]
    elif case == "fp64_tables":
        cos, sin = cos.double(), sin.double()
    elif case == "strided_tables":
        cos = torch.cat([cos, cos], dim=1)[:, ::2]
    elif case == "requires_grad":
        x = x.clone().requires_grad_()
    elif case == "tables_requiring_grad":  # eager's result records their gradient, the kernel's nothing
        cos = cos.clone().requires_grad_()
    if case != "cpu":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    site = Site("rotary_emb")
    assert torch.equal(rotary_emb(x, cos, sin, site), rotary_emb_ref(x, cos, sin))
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}


@pytest.mark.parametrize(
    "case, reason",
    [
        ("fp32", "dtype float32"),
        ("wide_head", "D outside the reproduced reduction"),
        ("no_weight", "norm not a plain torch.nn.RMSNorm with weight"),
        ("diffusers_rmsnorm", "norm not a plain torch.nn.RMSNorm with weight"),
        ("eps_none", "norm not a plain torch.nn.RMSNorm with weight"),
        ("hooked", "RMSNorm has hooks"),  # the policy refuses a hooked module before the guard
        ("fp32_weight", "norm weight dtype differs"),
        ("strided_x", "x strided"),
        ("requires_grad", "requires grad"),
        ("tables_requiring_grad", "requires grad"),
        ("cpu", "device cpu"),
    ],
)
def test_qk_norm_rope_guard_falls_back_to_the_fused_rope(case, reason, monkeypatch):
    """Each refusal: the eager result, the reason counted, and the rotary part still on its (exact) fast path."""
    dim = 256 if case == "wide_head" else 16
    norm_txt, x_txt, norm_img, x_img, cos, sin = qk_inputs(5, 11, 2, dim, torch.bfloat16, "cpu", 2, batch=2)
    if case == "fp32":
        norm_txt, x_txt, norm_img, x_img = norm_txt.float(), x_txt.float(), norm_img.float(), x_img.float()
    elif case == "no_weight":
        norm_img = torch.nn.RMSNorm(dim, eps=1e-6, elementwise_affine=False)
    elif case == "diffusers_rmsnorm":
        norm_img = DiffusersRMSNorm(dim, eps=1e-6).to(torch.bfloat16).requires_grad_(False)
    elif case == "eps_none":
        norm_txt = torch.nn.RMSNorm(dim).to(torch.bfloat16).requires_grad_(False)
    elif case == "hooked":
        norm_img.register_forward_hook(lambda m, i, o: o)
    elif case == "fp32_weight":
        norm_img = norm_img.float()
    elif case == "strided_x":
        x_img = torch.cat([x_img, x_img], dim=3)[..., ::2]
    elif case == "requires_grad":
        x_txt = x_txt.clone().requires_grad_()
    elif case == "tables_requiring_grad":  # eager's result records their gradient, the kernel's nothing
        cos = cos.clone().requires_grad_()
    if case != "cpu":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
        monkeypatch.setattr(ROTARY_EMB, "kernel", rotary_emb_ref)  # stands in for the exact CUDA kernel
    site, rope_site = Site("qk_norm_rope"), Site("rotary_emb")
    out = qk_norm_rope(norm_txt, x_txt, norm_img, x_img, cos, sin, site, rope_site)
    assert torch.equal(out, qk_norm_rope_ref(norm_txt, x_txt, norm_img, x_img, cos, sin))
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}
    rope_fast = case not in ("cpu", "fp32", "requires_grad", "tables_requiring_grad")  # the rotary guard's own refusals
    assert rope_site.fast == int(rope_fast) and sum(rope_site.fallback.values()) == int(not rope_fast)


def test_flux_layouts_pass_the_guards(fake_cuda):
    for txt, strided in [(5, False), (0, False), (5, True)]:
        args = qk_inputs(txt, 11, 2, 128, torch.bfloat16, "cpu", 0, batch=2, strided=strided)
        assert QK_NORM_ROPE.guard(*args) is None
        assert ROTARY_EMB.guard(args[3], args[4][txt:], args[5][txt:]) is None


@pytest.mark.parametrize("form", ["rotary_emb", "rows", "wan"])
def test_only_x_whose_eager_result_is_contiguous_takes_the_kernel(form, fake_cuda, monkeypatch):
    """The kernel's result is contiguous, eager's laid out after x: a permuted x (``[B, S, H, D]`` of heads-first
    memory; LTX's ``[B, S, C]`` of sequence-first memory) runs eager, counted, and the result has eager's strides;
    x contiguous, or a fused projection's slice (eager's result contiguous), still takes the kernel."""
    gen = torch.Generator().manual_seed(5)
    if form == "rows":
        op, ref, fused = rotary_emb_rows, rotary_emb_rows_ref, ROTARY_EMB_ROWS
        cos, sin = ltx_tables(1, 9, 48, "cpu", 5)
        permuted = torch.randn(9, 2, 48, generator=gen).to(torch.bfloat16).transpose(0, 1)
    else:
        op, ref, fused = (rotary_emb, rotary_emb_ref, ROTARY_EMB) if form == "rotary_emb" else (
            rotary_emb_wan, rotary_emb_wan_ref, ROTARY_EMB_WAN)
        cos, sin = rope_tables(9, 16, "cpu", 5)
        if form == "wan":
            cos, sin = cos.view(1, 9, 1, 16), sin.view(1, 9, 1, 16)
        permuted = torch.randn(2, 3, 9, 16, generator=gen).to(torch.bfloat16).transpose(1, 2)
    monkeypatch.setattr(fused, "kernel", lambda *a: ref(*a).contiguous())  # the kernel's values and allocation
    contiguous = permuted.contiguous()
    fused_slice = torch.cat([contiguous, contiguous], dim=-1)[..., :contiguous.shape[-1]]  # strides in their order
    for x, fast in ((permuted, False), (contiguous, True), (fused_slice, True)):
        site = Site(fused.name)
        out, expect = op(x, cos, sin, site), ref(x, cos, sin)
        assert torch.equal(out, expect) and out.stride() == expect.stride()
        assert (site.fast, dict(site.fallback)) == ((1, {}) if fast else (0, {_policy.REASON_LAYOUT: 1}))


@pytest.mark.parametrize("form", ["rotary_emb", "rows", "wan"])
def test_the_layout_refusal_is_exactly_where_eagers_result_is_not_contiguous(form, fake_cuda):
    """Over x of random strides (any order, slices, broadcast and overlapping dimensions, sizes of 1): the guard
    refuses x's layout exactly where eager's result is not contiguous, i.e. would differ from the kernel's."""
    import random

    rng, buf = random.Random(7), torch.randn(4096).to(torch.bfloat16)
    guard, ref = {"rotary_emb": (ROTARY_EMB.guard, rotary_emb_ref),
                  "rows": (ROTARY_EMB_ROWS.guard, rotary_emb_rows_ref),
                  "wan": (ROTARY_EMB_WAN.guard, rotary_emb_wan_ref)}[form]
    refused = 0
    for _ in range(200):
        shape = [rng.choice([1, 2, 3]) for _ in range(2 if form == "rows" else 3)] + [8]
        x = buf.as_strided(shape, [rng.choice([0, 8, 16, 24, 48, 96]) for _ in shape[:-1]] + [1])
        seq, dim = shape[1], shape[-1]
        cos, sin = rope_tables(seq, dim, "cpu", 7)
        cos, sin = {"rotary_emb": (cos, sin), "rows": (cos[None], sin[None]),
                    "wan": (cos.view(1, seq, 1, dim), sin.view(1, seq, 1, dim))}[form]
        layout = guard(x, cos, sin) == _policy.REASON_LAYOUT
        assert layout == (not ref(x, cos, sin).is_contiguous()), (x.shape, x.stride())
        refused += layout
    assert 0 < refused < 200


@pytest.fixture
def guards_open(monkeypatch):
    for op in (QK_NORM_ROPE, ROTARY_EMB):
        monkeypatch.setattr(op, "guard", lambda *a, **k: None)
    monkeypatch.setattr(ROTARY_EMB, "kernel", rotary_emb_ref)  # exact by construction, like the CUDA kernel


def _off_by_one_ulp(*args):
    out = qk_norm_rope_ref(*args)
    return (out.view(torch.int16) + 1).view(out.dtype)  # wrong in the last bit everywhere


def test_a_norm_kernel_that_is_not_bit_exact_is_disabled_and_the_fused_rope_kept(guards_open, monkeypatch, fastpath_log):
    monkeypatch.setattr(QK_NORM_ROPE, "kernel", _off_by_one_ulp)
    args = qk_inputs(5, 11, 2, 16, torch.bfloat16, "cpu", 3, batch=2)
    ref = qk_norm_rope_ref(*args)
    site, rope_site = Site("qk_norm_rope"), Site("rotary_emb")
    for _ in range(3):
        assert torch.equal(qk_norm_rope(*args, site, rope_site), ref)
    assert "not bit-exact against this platform's eager result for ('bfloat16', 16)" in QK_NORM_ROPE.disabled
    assert not QK_NORM_ROPE.verified and site.fast == 0 and dict(site.fallback) == {_policy.REASON_DISABLED: 3}
    assert rope_site.fast == 3 and not rope_site.fallback  # the rotary embedding stayed fused
    warnings = [r for r in fastpath_log.records if "disabling the fused op 'qk_norm_rope'" in r.getMessage()]
    assert len(warnings) == 1 and "not bit-exact" in warnings[0].getMessage()


def test_a_bit_exact_norm_kernel_is_verified_once_per_signature(guards_open, monkeypatch):
    calls = {"ref": 0}
    real_ref = QK_NORM_ROPE.ref

    def counting_ref(*args):
        calls["ref"] += 1
        return real_ref(*args)

    monkeypatch.setattr(QK_NORM_ROPE, "ref", counting_ref)
    monkeypatch.setattr(QK_NORM_ROPE, "kernel", real_ref)  # exact by construction
    site = Site("qk_norm_rope")
    for seed, txt in [(0, 5), (1, 0), (2, 7)]:
        qk_norm_rope(*qk_inputs(txt, 11, 2, 16, torch.bfloat16, "cpu", seed, batch=2), site)
    qk_norm_rope(*qk_inputs(5, 11, 2, 32, torch.bfloat16, "cpu", 3), site)  # another head_dim: verified again
    assert calls["ref"] == 2 and site.fast == 4
    assert QK_NORM_ROPE.verified == {("bfloat16", 16), ("bfloat16", 32)}
    assert QK_NORM_ROPE.status == "enabled, verified for bfloat16/16, bfloat16/32"


def test_unverified_norm_stays_eager_under_compile_and_the_rope_is_the_custom_op(guards_open, monkeypatch):
    emitted = []
    monkeypatch.setattr(QK_NORM_ROPE, "custom_op", lambda *a: (_ for _ in ()).throw(AssertionError("emitted")))
    monkeypatch.setattr(ROTARY_EMB, "custom_op", lambda *a: emitted.append(1) or rotary_emb_ref(*a))
    args = qk_inputs(5, 11, 2, 16, torch.bfloat16, "cpu", 4, batch=2)
    fn = torch.compile(lambda *a: qk_norm_rope(*a), fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(*args), qk_norm_rope_ref(*args))
    assert emitted  # traced through the rotary op's custom-op branch


def test_verified_norm_is_the_custom_op_under_compile(guards_open, monkeypatch):
    monkeypatch.setattr(QK_NORM_ROPE, "kernel", QK_NORM_ROPE.ref)
    args = qk_inputs(5, 11, 2, 16, torch.bfloat16, "cpu", 5, batch=2)
    qk_norm_rope(*args)  # eager: verifies ("bfloat16", 16)
    emitted = []
    monkeypatch.setattr(QK_NORM_ROPE, "custom_op", lambda *a: emitted.append(1) or qk_norm_rope_ref(*a))
    fn = torch.compile(lambda *a: qk_norm_rope(*a), fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(*args), qk_norm_rope_ref(*args)) and emitted


@pytest.mark.parametrize("txt", [0, 5])
def test_custom_ops_opcheck_cpu(txt):
    norm_txt, x_txt, norm_img, x_img, cos, sin = qk_inputs(txt, 11, 2, 16, torch.bfloat16, "cpu", 0, batch=2)
    ops = torch.ops.diffusers_fastpath
    w_txt, eps_txt = (None, 0.0) if x_txt is None else (norm_txt.weight, norm_txt.eps)
    qk_args = (x_txt, w_txt, eps_txt, x_img, norm_img.weight, norm_img.eps, cos, sin)
    torch.library.opcheck(ops.qk_norm_rope.default, qk_args)
    torch.library.opcheck(ops.rotary_emb.default, (x_img, cos[txt:], sin[txt:]))
    rows_cos, rows_sin = ltx_tables(2, 11, 32, "cpu", txt)
    torch.library.opcheck(ops.rotary_emb_rows.default, (x_img.flatten(2), rows_cos, rows_sin))
    wan_cos, wan_sin = (t.view(1, 11, 1, 16) for t in rope_tables(11, 16, "cpu", txt))
    torch.library.opcheck(ops.rotary_emb_wan.default, (x_img, wan_cos, wan_sin))
    assert torch.equal(ops.qk_norm_rope(*qk_args), qk_norm_rope_ref(norm_txt, x_txt, norm_img, x_img, cos, sin))


# --- the FLUX attention processor, on CPU, with stand-ins for the CUDA kernels ----------------------------------


def _flux_run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


def _attention_sites(model):
    import diffusers_fastpath as fp

    rep = fp.report(model)
    return [s for s in rep.sites if s.op == "qk_norm_rope"], [s for s in rep.sites if s.op == "rotary_emb"]


@pytest.mark.parametrize("fused_projections", [False, True])
def test_flux_processor_runs_the_fused_op_for_q_and_k(fused_projections, guards_open, monkeypatch, unpatch_after):
    import diffusers_fastpath as fp
    from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs

    monkeypatch.setattr(QK_NORM_ROPE, "kernel", QK_NORM_ROPE.ref)  # exact by construction: verifies
    model = build_flux_transformer("flux-tiny", torch.bfloat16, seed=40)
    if fused_projections:
        model.fuse_qkv_projections()
    inputs = flux_transformer_inputs(model, batch=2, grid=(4, 6), txt_tokens=7, seed=41)
    ref = _flux_run(model, inputs)
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(_flux_run(model, inputs), ref)
    qk_sites, rope_sites = _attention_sites(model)
    assert len(qk_sites) == len(rope_sites) == 4
    assert all(s.fast == 2 and s.fallback == 0 for s in qk_sites)  # q and k of each attention
    assert all(s.fast == 0 and s.fallback == 0 for s in rope_sites)
    assert QK_NORM_ROPE.verified == {("bfloat16", 16)}


def test_flux_output_stays_exact_and_rope_fused_when_the_norm_fails_verification(
    guards_open, monkeypatch, unpatch_after, fastpath_log
):
    import diffusers_fastpath as fp
    from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs

    monkeypatch.setattr(QK_NORM_ROPE, "kernel", _off_by_one_ulp)
    model = build_flux_transformer("flux-tiny", torch.bfloat16, seed=42)
    inputs = flux_transformer_inputs(model, batch=2, grid=(4, 6), txt_tokens=7, seed=43)
    ref = _flux_run(model, inputs)
    fp.patch(model)
    unpatch_after(model)
    for _ in range(2):
        assert torch.equal(_flux_run(model, inputs), ref)
    qk_sites, rope_sites = _attention_sites(model)
    assert all(s.fast == 0 and s.reasons == {_policy.REASON_DISABLED: 4} for s in qk_sites)
    assert all(s.fast == 4 and s.fallback == 0 for s in rope_sites)  # the pure rotary op took over
    assert fp.report(model).ops["qk_norm_rope"].startswith("disabled (RuntimeError: the fused kernel is not bit-exact")
    assert len([r for r in fastpath_log.records if "disabling the fused op 'qk_norm_rope'" in r.getMessage()]) == 1


@pytest.mark.parametrize("joint", [True, False])
@pytest.mark.parametrize("with_rope", [True, False])
def test_processor_matches_diffusers_on_a_lone_attention_module(joint, with_rope, guards_open, monkeypatch):
    """The processor outside a patched model (no sites): dual- and single-stream attention, with and without a
    rotary embedding, equal to diffusers' ``FluxAttnProcessor``."""
    from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor

    from diffusers_fastpath.models.flux import FastpathFluxAttnProcessor
    from diffusers_fastpath.testing import randomize_

    monkeypatch.setattr(QK_NORM_ROPE, "kernel", QK_NORM_ROPE.ref)
    kw = dict(added_kv_proj_dim=32, context_pre_only=False) if joint else dict(pre_only=True)
    attn = randomize_(FluxAttention(query_dim=32, heads=2, dim_head=16, bias=True, eps=1e-6, **kw), seed=50)
    attn = attn.to(torch.bfloat16).requires_grad_(False)
    gen = torch.Generator().manual_seed(51)
    hidden = torch.randn(2, 12, 32, generator=gen).to(torch.bfloat16)
    context = torch.randn(2, 5, 32, generator=gen).to(torch.bfloat16) if joint else None
    rope = rope_tables(12 + (5 if joint else 0), 16, "cpu", 52) if with_rope else None
    ref = FluxAttnProcessor()(attn, hidden, context, None, rope)
    out = FastpathFluxAttnProcessor()(attn, hidden, context, None, rope)
    for got, want in zip(out if joint else (out,), ref if joint else (ref,)):
        assert torch.equal(got, want)
    assert QK_NORM_ROPE.verified == ({("bfloat16", 16)} if with_rope else set())
