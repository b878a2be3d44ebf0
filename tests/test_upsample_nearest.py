"""upsample_nearest2x: the 2x nearest upsampling of Wan's and Qwen-Image's VAE decoders (``nn.Upsample`` of
``x.float()``, cast back) in one pass, exact by construction: bit-exact on the GPU at their shapes (poisoned outputs;
NaNs with payloads and signs, infinities, signed zeros, subnormals compared as bits), and on a CPU the arithmetic,
the guard and the module swap."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.autoencoders import autoencoder_kl_qwenimage as qwen
from diffusers.models.autoencoders import autoencoder_kl_wan as wan

from diffusers_fastpath.ops import Site, upsample_nearest2x
from diffusers_fastpath.ops.upsample_nearest import UPSAMPLE_NEAREST2X

DTYPES = [torch.bfloat16, torch.float16]


def _module(cls=wan.WanUpsample, **config):
    return cls(**{"scale_factor": (2.0, 2.0), "mode": "nearest-exact", **config})


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _registered(module):
    """`module` as the VAE adapter leaves it (its class this package's subclass, registered with the op)."""
    from diffusers_fastpath.models.vae_wan import UPSAMPLES

    module.__class__ = UPSAMPLES[type(module)]
    return module


# --- GPU: the contract ---------------------------------------------------------------------------------------

# [frames of a chunk, C, H, W] (contiguous, and time-major below) at the upsamplings of Wan 2.1's decoder for 832x480 (latent 60x104; 384, 384 and 192
# channels), Qwen-Image's at 1328x1328 (166x166 latents: odd rows), odd small ones
SHAPES = [(4, 384, 60, 104), (4, 384, 120, 208), (4, 192, 240, 416), (1, 384, 166, 166), (3, 5, 7, 9), (1, 2, 1, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_upsample_matches_eager_bitwise(shape, dtype):
    """At the decoders' shapes, bf16 / fp16 and fp32 (an fp32 VAE's: a copy, NaN payloads kept as eager's)."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    module = _registered(_module())
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(shape, generator=gen, device="cuda") * 4).to(dtype)
    if dtype == torch.float32:  # NaNs of other payloads and signs, infinities: a copy keeps every bit
        specials = torch.tensor([0x7FC00001, 0xFFC12345, 0x7F800000, 0xFF800000, 0x80000000], dtype=torch.int64)
        x.view(-1)[:5] = specials.to(torch.int32).view(torch.float32).to(x.device)
    for x in (x, x.transpose(0, 1).contiguous().transpose(0, 1)):  # ... and WanResample's time-major view
        _check_one(module, x)


def _check_one(module, x):
    ref = wan.WanUpsample.forward(module, x)
    poison = torch.full_like(ref, float("nan"))
    del poison  # its block is what the caching allocator hands the kernel's output next: NaN unless written
    site = Site("upsample_nearest2x")
    out = upsample_nearest2x(module, x, site)
    assert torch.equal(_bits(out), _bits(ref)) and out.is_contiguous() and out.shape == ref.shape
    assert site.fast == 1 and not site.fallback and UPSAMPLE_NEAREST2X.disabled is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_upsample_every_bit_pattern_bitwise(dtype):
    """Every 16-bit pattern (NaNs of every payload and sign included): the cast back canonicalises them as eager's."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    x = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32, device="cuda").to(torch.int16).view(dtype)
    x = x.view(1, 256, 16, 16)
    for mode in ("nearest-exact", "nearest"):
        module = _registered(_module(mode=mode))
        ref = wan.WanUpsample.forward(module, x)
        assert torch.equal(_bits(upsample_nearest2x(module, x, Site("u"))), _bits(ref))
    assert torch.equal(_bits(torch.ops.diffusers_fastpath._upsample_nearest2x_cuda(x)), _bits(ref))


# --- CPU: the arithmetic, the guard ----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [wan.WanUpsample, qwen.QwenImageUpsample])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernels_arithmetic_is_the_modules_forward(cls, dtype):
    """Each value's float round trip written to its 2x2 block is the module's forward (nearest-exact and nearest alike
    at a factor of 2), on every 16-bit pattern."""
    x = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype).view(2, 128, 16, 16)
    arithmetic = x.float().to(dtype).repeat_interleave(2, dim=-1).repeat_interleave(2, dim=-2)
    for mode in ("nearest-exact", "nearest"):
        ref = cls.forward(_module(cls, mode=mode), x)
        assert torch.equal(_bits(arithmetic), _bits(ref)) and ref.is_contiguous()


@pytest.mark.parametrize(
    "case, reason",
    [
        ("other_class", "Upsample is not a checked upsampling"),
        ("bilinear", "not a 2x nearest upsampling"),
        ("factor_3", "not a 2x nearest upsampling"),
        ("size", "not a 2x nearest upsampling"),
        ("fp64", "dtype float64"),
        ("five_dims", "x not [N, C, H, W]"),
        ("channels_last", "layout"),
        ("one_column", "layout"),
        ("time_major", None),
        ("requires_grad", "requires grad"),
        ("cpu", "device cpu"),
    ],
)
def test_guard_refuses_with_reason_and_the_forward_runs(case, reason, monkeypatch):
    module = _registered(_module())
    x = torch.randn(2, 6, 5, 7).bfloat16()
    if case == "other_class":
        module = torch.nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact")
    elif case == "bilinear":
        module = _registered(_module(mode="bilinear"))
    elif case == "factor_3":
        module = _registered(_module(scale_factor=(3.0, 3.0)))
    elif case == "size":
        module = _registered(wan.WanUpsample(size=(10, 14), mode="nearest-exact"))
    elif case == "fp64":  # (fp32 runs: an fp32 VAE's upsampling is a copy)
        x = x.double()
    elif case == "five_dims":
        x = x[:, :, None]
    elif case == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif case == "one_column":
        x = x[..., :1].contiguous()
    elif case == "time_major":  # WanResample's [T, C, H, W] view of [C, T, H, W] memory: taken, eager's result
        x = x.transpose(0, 1).contiguous().transpose(0, 1)  # contiguous as the kernel's
        assert wan.WanUpsample.forward(module, x).is_contiguous()
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
        assert UPSAMPLE_NEAREST2X.guard(module, x) is None
        return
    elif case == "requires_grad":
        x = x.clone().requires_grad_()
    if case != "cpu":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(UPSAMPLE_NEAREST2X, "kernel", lambda *a: pytest.fail("the kernel ran"))
    site = Site("upsample_nearest2x")
    with torch.set_grad_enabled(case == "requires_grad"):
        if case == "five_dims":  # (the 2-D upsampling refuses a 5-D input itself: only the guard's answer is asked)
            assert UPSAMPLE_NEAREST2X.guard(module, x) == reason
            return
        out = upsample_nearest2x(module, x, site)
        ref = type(module).__mro__[1 if case != "other_class" else 0].forward(module, x)
    assert torch.equal(out, ref) and out.stride() == ref.stride() and dict(site.fallback) == {reason: 1}


def test_the_subclass_runs_the_op_and_hooks_around_it(emulated_kernels):
    """The VAE adapter's subclass: its forward is the op (a site counted), inside the module call (a forward hook
    sees its result)."""
    module = _registered(_module())
    from diffusers_fastpath._state import SITE_ATTR

    site = Site("upsample_nearest2x")
    module.__dict__[SITE_ATTR] = site
    seen = []
    module.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    x = torch.randn(1, 4, 3, 5).bfloat16()
    out = module(x)
    assert torch.equal(_bits(out), _bits(wan.WanUpsample.forward(module, x))) and site.fast == 1
    assert seen == [(1, 4, 6, 10)]
