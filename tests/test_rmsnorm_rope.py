"""rmsnorm_rope_complex (Qwen-Image's, Z-Image's and Lumina2's QK norm + complex rotary): the reference is diffusers'
chain, the bit-exact contract on the GPU at their shapes (Lumina2's: head_dim 96, complex128 factors), guards,
fallback and custom op everywhere."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

from diffusers_fastpath.ops import Site, rmsnorm_rope_complex, rmsnorm_rope_complex_ref
from diffusers_fastpath.ops.rmsnorm_rope import RMSNORM_ROPE_COMPLEX

# [B, S, H, D] q or k of Qwen-Image at 1024x1024 (24 heads of 128): the image stream, the text stream, a CFG batch
SHAPES = [(1, 4096, 24, 128), (1, 512, 24, 128), (2, 1024, 24, 128), (1, 7, 3, 128)]
# Lumina-Image 2.0 at 1024x1024 (head_dim 96; q of 24 heads, k of 8, over 4096 image + 256 caption tokens), a CFG
# batch, a small case: per-sample complex128 factors, as its rotary embedder builds them
LUMINA2_SHAPES = [(1, 4352, 24, 96), (1, 4352, 8, 96), (2, 1100, 24, 96), (1, 7, 3, 96)]
DTYPES = [torch.bfloat16, torch.float16]


def make(shape, dtype, device, seed, per_batch=False, factors=torch.complex64):
    gen = torch.Generator(device=device).manual_seed(seed)
    batch, tokens, heads, dim = shape
    norm = RMSNorm(dim, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=gen, device=device))  # not ones: the weight matters
    x = (torch.randn(shape, generator=gen, device=device) * 3).to(dtype)
    angles = torch.rand((batch, tokens, dim // 2) if per_batch else (tokens, dim // 2), generator=gen, device=device)
    angles = angles.to(torch.float64 if factors is torch.complex128 else torch.float32)
    freqs = torch.polar(torch.ones_like(angles), angles * 100)  # complex64 (Lumina2: complex128), as the pipelines build it
    return norm, x, freqs


def zimage_rotary(x_in, freqs_cis):
    """Z-Image's processor-local complex rotary (diffusers 0.42 ``ZSingleStreamAttnProcessor``), the form that takes
    per-sample ``[B, S, D/2]`` factors (Qwen-Image's ``apply_rotary_emb_qwen`` unsqueezes dim 1: ``[S, D/2]`` only)."""
    x = torch.view_as_complex(x_in.float().reshape(*x_in.shape[:-1], -1, 2))
    return torch.view_as_real(x * freqs_cis.unsqueeze(2)).flatten(3).type_as(x_in)


def eager(norm, x, freqs):
    """The diffusers chain each factor layout comes from: Qwen-Image's for ``[S, D/2]``, Z-Image's for ``[B, S, D/2]``
    (Lumina2's, complex128: diffusers' ``apply_rotary_emb(y, f, use_real=False)``)."""
    if freqs.dtype is torch.complex128:
        return apply_rotary_emb(norm(x), freqs, use_real=False)
    return (zimage_rotary if freqs.dim() == 3 else lambda y, f: apply_rotary_emb_qwen(y, f, use_real=False))(norm(x), freqs)


def test_reference_is_diffusers_chain():
    """The op's reference is, bit for bit, ``apply_rotary_emb_qwen(norm(x), freqs, use_real=False)``."""
    for dtype in DTYPES:
        norm, x, freqs = make((2, 9, 3, 128), dtype, "cpu", 0)
        with torch.no_grad():
            assert torch.equal(rmsnorm_rope_complex_ref(norm, x, freqs),
                               apply_rotary_emb_qwen(norm(x), freqs, use_real=False))
        norm, x, freqs = make((2, 9, 3, 128), dtype, "cpu", 1, per_batch=True)
        with torch.no_grad():
            assert torch.equal(rmsnorm_rope_complex_ref(norm, x, freqs), zimage_rotary(norm(x), freqs))
        norm, x, freqs = make((2, 9, 3, 96), dtype, "cpu", 2, per_batch=True, factors=torch.complex128)
        with torch.no_grad():
            assert torch.equal(rmsnorm_rope_complex_ref(norm, x, freqs),
                               apply_rotary_emb(norm(x), freqs, use_real=False))


def _check_on_the_gpu(shape, dtype, per_batch, factors=torch.complex64):
    """The raw op into a NaN-poisoned output and the public op (fast, no fallback): `torch.equal` to diffusers' chain."""
    from diffusers_fastpath.ops._build import load_extension
    from diffusers_fastpath.ops.rmsnorm_rope import _pairs

    load_extension()
    batch, tokens, heads, dim = shape
    with torch.no_grad():
        for seed in range(2):
            norm, x, freqs = make(shape, dtype, "cuda", seed, per_batch, factors)
            ref = eager(norm, x, freqs)
            out = torch.full((batch * tokens * heads, 1, dim), float("nan"), dtype=dtype, device="cuda")
            torch.ops.diffusers_fastpath._rmsnorm_rope_complex_cuda_out(
                out, x.view(-1, 1, dim), norm.weight, _pairs(freqs), heads, tokens, norm.eps)
            torch.cuda.synchronize()
            assert torch.equal(out.view(shape), ref)
            site = Site("rmsnorm_rope_complex")
            assert torch.equal(rmsnorm_rope_complex(norm, x, freqs, site), ref)
            assert site.fast == 1 and not site.fallback, site
    assert RMSNORM_ROPE_COMPLEX.disabled is None


@pytest.mark.gpu
@pytest.mark.parametrize("per_batch", [False, True], ids=["freqs_tokens", "freqs_per_batch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_eager_bitwise_on_the_gpu(shape, dtype, per_batch):
    _check_on_the_gpu(shape, dtype, per_batch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", LUMINA2_SHAPES, ids=str)
def test_lumina2_rows_of_96_and_complex128_factors_match_eager_bitwise_on_the_gpu(shape, dtype):
    _check_on_the_gpu(shape, dtype, True, torch.complex128)


@pytest.mark.parametrize("case, reason", [
    ("fp32", "dtype float32"), ("weight", "mixed dtypes"), ("dim", "D outside the reproduced reduction"),
    ("few", "fewer than 16 rows"), ("strided", "x not contiguous"), ("freqs", "shape"), ("cpu", "device cpu")])
def test_guard_falls_back_with_reason(case, reason):
    norm, x, freqs = make((1, 9, 4, 128), torch.bfloat16, "cpu", 1)
    if case == "fp32":
        norm, x = norm.float(), x.float()
    elif case == "weight":
        norm = norm.float()
    elif case == "dim":
        norm, x, freqs = make((1, 9, 4, 160), torch.bfloat16, "cpu", 1)
    elif case == "few":
        norm, x, freqs = make((1, 3, 2, 128), torch.bfloat16, "cpu", 1)
    elif case == "strided":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    elif case == "freqs":
        freqs = freqs[:4]
    site = Site("rmsnorm_rope_complex")
    with torch.no_grad():  # the norm's weight is a parameter: with grad enabled the guard says "requires grad"
        assert RMSNORM_ROPE_COMPLEX.guard(norm, x, freqs) == reason
        if case == "freqs":  # eager cannot broadcast these either
            with pytest.raises(RuntimeError):
                rmsnorm_rope_complex(norm, x, freqs, site)
        else:
            assert torch.equal(rmsnorm_rope_complex(norm, x, freqs, site), rmsnorm_rope_complex_ref(norm, x, freqs))
    assert site.fast == 0 and site.fallback == {reason: 1}


@pytest.mark.parametrize("shape, factors", [((1, 9, 4, 128), torch.complex64), ((2, 9, 4, 96), torch.complex128)],
                         ids=["qwen", "lumina2"])
def test_custom_op_opcheck_cpu(shape, factors):
    norm, x, freqs = make(shape, torch.bfloat16, "cpu", 2, per_batch=factors is torch.complex128, factors=factors)
    torch.library.opcheck(torch.ops.diffusers_fastpath.rmsnorm_rope_complex.default, (x, norm.weight.detach(), freqs, 1e-6))
    with torch.no_grad():
        assert torch.equal(torch.ops.diffusers_fastpath.rmsnorm_rope_complex(x, norm.weight, freqs, 1e-6),
                           rmsnorm_rope_complex_ref(norm, x, freqs))


# --- the two streams written into their joint concatenation (Qwen-Image's q and k) -------------------------------

from diffusers_fastpath.ops import rmsnorm_rope_complex_cat, rmsnorm_rope_complex_cat_ref  # noqa: E402
from diffusers_fastpath.ops.rmsnorm_rope import RMSNORM_ROPE_COMPLEX_CAT  # noqa: E402

# (text tokens, image tokens, heads): Qwen-Image at 1024x1024, and an odd small one
CAT_SHAPES = [(512, 4096, 24), (9, 11, 2)]


def make_streams(tokens_a, tokens_b, heads, dtype, device, seed):
    (norm_a, x_a, f_a), (norm_b, x_b, f_b) = (make((1, n, heads, 128), dtype, device, seed + i)
                                              for i, n in enumerate((tokens_a, tokens_b)))
    return norm_a, x_a, f_a, norm_b, x_b, f_b


def test_cat_reference_is_the_processors_chain():
    """The reference is Qwen-Image's lines: each stream's ``apply_rotary_emb_qwen(norm(x), f)``, then the cat."""
    norm_a, x_a, f_a, norm_b, x_b, f_b = make_streams(5, 11, 3, torch.bfloat16, "cpu", 3)
    with torch.no_grad():
        expected = torch.cat([apply_rotary_emb_qwen(norm_a(x_a), f_a, use_real=False),
                              apply_rotary_emb_qwen(norm_b(x_b), f_b, use_real=False)], dim=1)
        assert torch.equal(rmsnorm_rope_complex_cat_ref(norm_a, x_a, f_a, norm_b, x_b, f_b), expected)


def test_cat_kernel_writes_each_stream_into_its_slice(rope_launches):
    """The fast path's own wrapper on a CPU (each launch emulated by the eager chain of its rows): two launches, each
    into the contiguous slice of the joint tensor its stream's rows belong to, the whole equal to the reference."""
    launches = rope_launches
    args = make_streams(9, 11, 2, torch.bfloat16, "cpu", 4)
    site, single = Site("rmsnorm_rope_complex_cat"), Site("rmsnorm_rope_complex")
    with torch.no_grad():
        out = rmsnorm_rope_complex_cat(*args, site, single)
        assert torch.equal(out, rmsnorm_rope_complex_cat_ref(*args))
    row = 2 * 128 * out.element_size()  # one token's heads
    assert launches == [(out.data_ptr(), (18, 1, 128)), (out.data_ptr() + 9 * row, (22, 1, 128))]
    assert (site.fast, site.fallback, single.fast, single.fallback) == (1, {}, 0, {})


@pytest.mark.parametrize("case, reason", [
    ("batch", "batch above 1 (the streams' slices of the joint tensor are strided)"),
    ("dtypes", "streams of different heads, dtypes or devices"), ("few", "fewer than 16 rows")])
def test_cat_guard_falls_back_to_the_single_op_with_reason(case, reason, emulated_kernels):
    """What the joint kernel does not take runs each stream through `rmsnorm_rope_complex` (fused where it can, and
    counted on the single op's site), then ``torch.cat``; the joint site counts why."""
    norm_a, x_a, f_a, norm_b, x_b, f_b = make_streams(9, 11, 2, torch.bfloat16, "cpu", 5)
    if case == "batch":
        (norm_a, x_a, f_a), (norm_b, x_b, f_b) = (make((2, n, 2, 128), torch.bfloat16, "cpu", 6) for n in (9, 11))
    elif case == "dtypes":  # (torch.cat promotes them; streams of different heads it refuses, as the guard does)
        norm_b, x_b, f_b = make((1, 11, 2, 128), torch.float16, "cpu", 6)
    elif case == "few":
        norm_a, x_a, f_a = make((1, 3, 2, 128), torch.bfloat16, "cpu", 6)
    site, single = Site("rmsnorm_rope_complex_cat"), Site("rmsnorm_rope_complex")
    with torch.no_grad():
        assert RMSNORM_ROPE_COMPLEX_CAT.guard(norm_a, x_a, f_a, norm_b, x_b, f_b, single) == reason
        assert torch.equal(rmsnorm_rope_complex_cat(norm_a, x_a, f_a, norm_b, x_b, f_b, site, single),
                           rmsnorm_rope_complex_cat_ref(norm_a, x_a, f_a, norm_b, x_b, f_b))
    assert site.fast == 0 and site.fallback == {reason: 1}
    assert single.fast + sum(single.fallback.values()) == 2  # each stream once through the single op


def test_cat_custom_op_opcheck_cpu():
    norm_a, x_a, f_a, norm_b, x_b, f_b = make_streams(7, 9, 2, torch.bfloat16, "cpu", 7)
    op = torch.ops.diffusers_fastpath.rmsnorm_rope_complex_cat.default
    torch.library.opcheck(op, (x_a, norm_a.weight.detach(), f_a, 1e-6, x_b, norm_b.weight.detach(), f_b, 1e-6))
    with torch.no_grad():
        assert torch.equal(op(x_a, norm_a.weight, f_a, 1e-6, x_b, norm_b.weight, f_b, 1e-6),
                           rmsnorm_rope_complex_cat_ref(norm_a, x_a, f_a, norm_b, x_b, f_b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens_a, tokens_b, heads", CAT_SHAPES, ids=str)
def test_cat_matches_eager_bitwise_on_the_gpu(tokens_a, tokens_b, heads, dtype):
    """The raw ``_out`` launches into the slices of a NaN-poisoned joint tensor, and the public op: `torch.equal` to
    the processor's chain at Qwen-Image's shapes."""
    from diffusers_fastpath.ops._build import load_extension
    from diffusers_fastpath.ops.rmsnorm_rope import _pairs

    load_extension()
    with torch.no_grad():
        for seed in range(2):
            args = make_streams(tokens_a, tokens_b, heads, dtype, "cuda", seed)
            ref = rmsnorm_rope_complex_cat_ref(*args)
            out = torch.full((1, tokens_a + tokens_b, heads, 128), float("nan"), dtype=dtype, device="cuda")
            for (norm, x, freqs), part in zip((args[:3], args[3:]), (out[:, :tokens_a], out[:, tokens_a:])):
                torch.ops.diffusers_fastpath._rmsnorm_rope_complex_cuda_out(
                    part.view(-1, 1, 128), x.view(-1, 1, 128), norm.weight, _pairs(freqs), heads, x.shape[1], norm.eps)
            torch.cuda.synchronize()
            assert torch.equal(out, ref)
            site = Site("rmsnorm_rope_complex_cat")
            assert torch.equal(rmsnorm_rope_complex_cat(*args, site), ref)
            assert site.fast == 1 and not site.fallback, site
    assert RMSNORM_ROPE_COMPLEX_CAT.disabled is None


# --- the real form (HunyuanVideo-1.5, Bria-FIBO's single blocks) ---------------------------------------------------

from diffusers.models.embeddings import apply_rotary_emb, get_1d_rotary_pos_embed  # noqa: E402

from diffusers_fastpath.ops import rmsnorm_rope_real, rmsnorm_rope_real_ref  # noqa: E402
from diffusers_fastpath.ops.rmsnorm_rope import RMSNORM_ROPE_REAL  # noqa: E402

# HunyuanVideo-1.5 at 848x480x33 (9 x 30 x 53 latent tokens, 16 heads of 128), a batch of two, a small case
REAL_SHAPES = [(1, 14310, 16, 128), (2, 1024, 16, 128), (1, 7, 3, 128)]


def make_real(shape, dtype, device, seed):
    norm, x, _ = make(shape, dtype, device, seed)
    cos, sin = get_1d_rotary_pos_embed(shape[3], torch.arange(shape[1]).float() * 1.7, use_real=True)
    return norm, x, cos.float().to(device), sin.float().to(device)


def test_real_reference_is_diffusers_chain():
    norm, x, cos, sin = make_real((2, 9, 3, 128), torch.bfloat16, "cpu", 0)
    with torch.no_grad():
        assert torch.equal(rmsnorm_rope_real_ref(norm, x, cos, sin),
                           apply_rotary_emb(norm(x), (cos, sin), sequence_dim=1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", REAL_SHAPES, ids=str)
def test_real_matches_eager_bitwise_on_the_gpu(shape, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    batch, tokens, heads, dim = shape
    with torch.no_grad():
        for seed in range(2):
            norm, x, cos, sin = make_real(shape, dtype, "cuda", seed)
            ref = apply_rotary_emb(norm(x), (cos, sin), sequence_dim=1)
            got = torch.ops.diffusers_fastpath._rmsnorm_rope_real_cuda(x.view(-1, 1, dim), norm.weight, cos, sin, heads,
                                                                      tokens, norm.eps)
            torch.cuda.synchronize()
            assert torch.equal(got.view(shape), ref)
            site = Site("rmsnorm_rope_real")
            assert torch.equal(rmsnorm_rope_real(norm, x, cos, sin, site), ref)
            assert site.fast == 1 and not site.fallback, site
    assert RMSNORM_ROPE_REAL.disabled is None


@pytest.mark.parametrize("case, reason", [
    ("fp32", "dtype float32"), ("tables", "cos/sin not float32"), ("dim", "D outside the reproduced reduction"),
    ("shape", "shape"), ("cpu", "device cpu")])
def test_real_guard_falls_back_with_reason(case, reason):
    norm, x, cos, sin = make_real((1, 9, 4, 128), torch.bfloat16, "cpu", 1)
    if case == "fp32":
        norm, x = norm.float(), x.float()
    elif case == "tables":
        cos, sin = cos.half(), sin.half()
    elif case == "dim":
        norm, x, cos, sin = make_real((1, 9, 4, 64), torch.bfloat16, "cpu", 1)
    elif case == "shape":
        cos, sin = cos[:4], sin[:4]
    site = Site("rmsnorm_rope_real")
    with torch.no_grad():
        assert RMSNORM_ROPE_REAL.guard(norm, x, cos, sin) == reason
        if case == "shape":
            with pytest.raises(RuntimeError):
                rmsnorm_rope_real(norm, x, cos, sin, site)
        else:
            assert torch.equal(rmsnorm_rope_real(norm, x, cos, sin, site), rmsnorm_rope_real_ref(norm, x, cos, sin))
    assert site.fast == 0 and site.fallback == {reason: 1}


def test_real_custom_op_opcheck_cpu():
    norm, x, cos, sin = make_real((1, 9, 4, 128), torch.bfloat16, "cpu", 2)
    torch.library.opcheck(torch.ops.diffusers_fastpath.rmsnorm_rope_real.default,
                          (x, norm.weight.detach(), cos, sin, 1e-6))


@pytest.mark.parametrize("local", [False, True], ids=["apply_rotary_emb_qwen", "zimage_local"])
def test_processor_call_fuses_only_the_factor_layout_its_function_broadcasts_like_the_op(local, emulated_kernels,
                                                                                        monkeypatch):
    """The rewritten processors' call: Qwen-Image's ``apply_rotary_emb_qwen`` unsqueezes the factors at dim 1, the op's
    broadcast for ``[S, D/2]`` factors only; Z-Image's local function unsqueezes dim 2, the op's for ``[B, S, D/2]``.
    The other layout runs the function as written (here S == H, so that Qwen-Image's broadcasts ``[B, S, D/2]`` its
    own way; Z-Image's raises diffusers' error for ``[S, D/2]``), and the site is not counted; the function's own
    layout fuses."""
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    from diffusers_fastpath.models import _chain_pending
    from diffusers_fastpath.models._chain_calls import _ChainsNamespace
    from diffusers_fastpath.models._chain_pending import _NormLater

    fn = zimage_rotary if local else apply_rotary_emb_qwen
    monkeypatch.setattr(_chain_pending, "COMPLEX_ROTARIES", {apply_rotary_emb_qwen: 2})  # as the adapter registers it
    call = (lambda y, f: fn(y, f)) if local else (lambda y, f: fn(y, f, use_real=False))
    for per_batch, fused in ((not local, False), (local, True)):
        norm, x, freqs = make((2, 8, 8, 128), torch.bfloat16, "cpu", 3, per_batch=per_batch)
        site = Site("rmsnorm_rope_complex")
        with torch.no_grad():
            if local and not fused:  # Z-Image's function cannot broadcast [S, D/2] factors: diffusers' error, as written
                for attempt in (lambda: call(norm(x), freqs),
                                lambda: _ChainsNamespace.rotary_complex(fn, _NormLater(norm, x), freqs, site, local=True)):
                    with pytest.raises(RuntimeError, match="must match the size"):
                        attempt()
            else:
                got = _ChainsNamespace.rotary_complex(fn, _NormLater(norm, x), freqs, site, local=local)
                assert torch.equal(got, call(norm(x), freqs))
        assert (site.fast, dict(site.fallback)) == ((1, {}) if fused else (0, {})), site


# --- the NVRTC way (most pip installs: no CUDA toolkit) ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, factors", [((1, 4096, 24, 128), torch.complex64), ((2, 1100, 24, 96), torch.complex128),
                                            ((1, 4352, 8, 96), torch.complex128)], ids=str)
def test_the_nvrtc_launcher_matches_eager_bitwise(shape, factors, dtype):
    """The complex form's NVRTC launcher (Qwen-Image's complex64 rows of 128, Lumina2's complex128 rows of 96) into a
    NaN-poisoned output, whichever way the process loaded its kernels."""
    from diffusers_fastpath.ops import _build, _nvrtc
    from diffusers_fastpath.ops.rmsnorm_rope import _nvrtc_kernel, _pairs

    major, minor = torch.cuda.get_device_capability()
    _nvrtc.build(_build.csrc_dir(), _build.cache_root(), f"{major}{minor}", _build.NVRTC_FLAGS)
    batch, tokens, heads, dim = shape
    with torch.no_grad():
        norm, x, freqs = make(shape, dtype, "cuda", 3, per_batch=factors is torch.complex128, factors=factors)
        out = torch.full((batch * tokens * heads, 1, dim), float("nan"), dtype=dtype, device="cuda")
        _nvrtc_kernel(x.view(-1, 1, dim), norm.weight, _pairs(freqs), heads, tokens, norm.eps, out=out)
        torch.cuda.synchronize()
        assert torch.equal(out.view(shape), eager(norm, x, freqs))
