"""The LTX-2 VAE adapter (models/vae_ltx2.py): tiny bf16 ``AutoencoderKLLTX2Video`` (the published block structure,
8 channels; its timestep-conditioned decoder too), decode and encode patched == unpatched (``torch.equal``) with
every site on its fast path (on CPU under the emulated kernels), also tiled, sliced, non-causal (and modulated) and in fp32; unpatch
and state dicts, hooks on a paired norm, a replaced ``PerChannelRMSNorm.forward``. The op's own tests are in
test_per_channel_rmsnorm.py; the full-size decode on the GPU at the end."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest
import torch
from diffusers import AutoencoderKLLTX2Video
from diffusers.models.autoencoders.autoencoder_kl_ltx2 import LTX2VideoResnetBlock3d, PerChannelRMSNorm

import diffusers_fastpath as fp
from diffusers_fastpath.bench.levels.vae import VAE_MODELS
from diffusers_fastpath.models import vae_ltx2
from diffusers_fastpath.models.vae_ltx2_norm import FastpathPerChannelRMSNorm
from diffusers_fastpath.testing._common import randomize_
from diffusers_fastpath.testing.checks import ltx_vae_sites, state_dict_round_trip

_TINY = VAE_MODELS["ltx2-tiny"][1]  # (the bench's: the published structure and compression, 8 channels)
CONFIGS = {"published": _TINY, "conditioned": {**_TINY, "timestep_conditioning": True, "decoder_causal": False}}


def _build(kind: str = "published", dtype=torch.bfloat16, seed=0):
    """A tiny VAE with random weights (every convolution and the timestep tables drawn: `randomize_`)."""
    return randomize_(AutoencoderKLLTX2Video(**CONFIGS[kind]), seed).to(dtype).eval()


def _latents(vae, frames=2, size=2, seed=3, batch=1, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vae.config.latent_channels, frames, size, size, generator=gen).to(dtype)


def _video(frames=9, size=64, seed=4, batch=1, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(batch, 3, frames, size, size, generator=gen) * 2 - 1).to(dtype)


def _decode(vae, z, causal=None):
    temb = torch.tensor([0.05] * z.shape[0]) if vae.config.timestep_conditioning else None
    return vae.decode(z, temb, causal=causal).sample


def _encode(vae, x):
    return vae.encode(x).latent_dist.mean


def _norms(vae) -> int:
    return sum(type(m) is PerChannelRMSNorm for m in vae.modules())


@torch.no_grad()
def test_patched_vae_decode_and_encode_equal_unpatched_every_site_fast(emulated_kernels, unpatch_after):
    """Every norm of the published form is paired with its SiLU (the resnets' two, each ``norm_out``); the encoder's
    zero-padded convolutions take `conv_bias`. (The non-causal decoder: the conditioned config's, below; a
    ``causal=False`` argument does not reach it, ``causal or self.is_causal``.)"""
    vae = _build()
    z, x = _latents(vae), _video()
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    assert torch.isfinite(ref_dec).all() and ref_dec.float().std() > 0.01 and ref_enc.float().std() > 0.01
    norms = _norms(vae)
    assert norms == 2 * sum(type(m) is LTX2VideoResnetBlock3d for m in vae.modules()) + 2
    convs = sum(type(m).__name__ == "LTX2VideoCausalConv3d" for m in vae.modules())
    unpatch_after(fp.patch(vae))
    ops = Counter(r.op for r in fp.report(vae).sites)
    assert ops["per_channel_rmsnorm_silu"] == norms and ops["ltx_causal_conv3d"] == convs and ops["conv_bias"], ops
    assert torch.equal(_decode(vae, z), ref_dec)
    assert torch.equal(_encode(vae, x), ref_enc)
    assert all(r.fast > 0 and r.fallback == 0 for r in ltx_vae_sites(fp.report(vae))), str(fp.report(vae))


@torch.no_grad()
def test_a_timestep_conditioned_decoder_runs_its_modulate_between_norm_and_silu(emulated_kernels, unpatch_after):
    """With ``timestep_conditioning`` the resnets modulate between the norm and the SiLU: those run as written (the
    rewritten forward's other branch), the rest fused; patched == unpatched."""
    vae = _build("conditioned")
    z, x = _latents(vae), _video()
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref_dec)
    assert torch.equal(_encode(vae, x), ref_enc)
    report = fp.report(vae)
    decoder_resnets = [r for r in report.sites if r.site.startswith("decoder.") and ".resnets." in r.site
                       and r.op == "per_channel_rmsnorm_silu"]
    assert decoder_resnets and all(r.fast == 0 and r.fallback == 0 for r in decoder_resnets), str(report)
    assert all(r.fallback == 0 for r in report.sites) and any(r.fast for r in report.sites), str(report)


@torch.no_grad()
def test_tiled_and_sliced_decode_and_encode_equal_unpatched(emulated_kernels, unpatch_after):
    vae = _build()
    # (tiles of two latents without overlap: a one-latent tile is narrower than the decoder's reflection padding,
    # which eager refuses too)
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=64,
                      tile_sample_stride_width=64)
    vae.enable_slicing()
    z, x = _latents(vae, size=4, batch=2), _video(size=128, batch=2)
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref_dec)
    assert torch.equal(_encode(vae, x), ref_enc)
    assert all(r.fast > 0 and r.fallback == 0 for r in ltx_vae_sites(fp.report(vae))), str(fp.report(vae))


@torch.no_grad()
def test_fp32_vae_patched_equal_unpatched(emulated_kernels, unpatch_after):
    vae = _build(dtype=torch.float32)
    z, x = _latents(vae, dtype=torch.float32), _video(dtype=torch.float32)
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref_dec)
    assert torch.equal(_encode(vae, x), ref_enc)
    report = fp.report(vae)
    assert all(r.fast > 0 for r in report.sites if r.op == "per_channel_rmsnorm_silu"), str(report)


def test_unpatch_restores_classes_and_state_dict():
    vae = _build()
    with state_dict_round_trip(vae):
        assert type(vae.decoder.up_blocks[0].resnets[0]).__name__ == "FastpathLTX2VideoResnetBlock3d"
        assert type(vae.decoder) is vae_ltx2.BLOCKS[2].sub
    assert type(vae.decoder.up_blocks[0].resnets[0]) is LTX2VideoResnetBlock3d
    assert all(type(m).__module__.startswith("diffusers.") or type(m).__module__.startswith("torch.")
               for m in vae.modules())


@torch.no_grad()
def test_a_hooked_paired_norm_runs_its_modules_with_their_hooks(emulated_kernels, unpatch_after):
    """A forward hook on a paired norm: that pair runs the norm and the SiLU as two module calls (the hook sees the
    norm's output), counted "hooks"; every other pair stays fast."""
    vae = _build()
    z = _latents(vae)
    ref = _decode(vae, z)
    unpatch_after(fp.patch(vae))
    norm = vae.decoder.mid_block.resnets[0].norm1
    seen = []
    handle = norm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        assert torch.equal(_decode(vae, z), ref)
    finally:
        handle.remove()
    assert len(seen) == 1
    site = norm._fastpath_site_per_channel_rmsnorm_silu
    assert (site.fast, dict(site.fallback)) == (0, {"hooks": 1})


def test_a_replaced_norm_forward_is_left_unpatched(monkeypatch, emulated_kernels, fastpath_log):
    """Another library replaced ``PerChannelRMSNorm.forward``: not provably the checked code, so the norms get no
    site and keep their class (one warning); the replacement runs; the convolutions are still patched."""
    calls = []
    original = PerChannelRMSNorm.forward

    def replaced(self, x, channel_dim=None):
        calls.append(1)
        return original(self, x, channel_dim)

    monkeypatch.setattr(PerChannelRMSNorm, "forward", replaced)
    vae = _build()
    z = _latents(vae)
    with torch.no_grad():
        ref = _decode(vae, z)
        eager_calls = len(calls)
        fp.patch(vae)
        try:
            assert torch.equal(_decode(vae, z), ref)
            assert len(calls) == 2 * eager_calls > 0
            assert {r.op for r in fp.report(vae).sites} == {"conv_bias", "ltx_causal_conv3d"}
            assert type(vae.decoder.norm_out) is PerChannelRMSNorm
        finally:
            fp.unpatch(vae)
    assert "PerChannelRMSNorm.forward is not the form" in fastpath_log.text


# --- GPU: the full-size LTX-2 VAE ----------------------------------------------------------------------------------


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.float().cpu().numpy().tobytes()).hexdigest()


@pytest.mark.gpu
@pytest.mark.full_size
@torch.no_grad()
def test_ltx2_vae_decode_md5_identical_every_site_fast(unpatch_after):
    """The published VAE (random bf16 weights) decoding 768x512x121 (latents 16 x 16 x 24): md5-identical with every
    site fast, no fallback."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cls, config = VAE_MODELS["ltx2"]
    vae = randomize_(AutoencoderKLLTX2Video(**config), 0).to("cuda", torch.bfloat16).eval()
    z = torch.randn(1, 128, 16, 16, 24, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    ref = _md5(vae.decode(z).sample)
    unpatch_after(fp.patch(vae))
    assert _md5(vae.decode(z).sample) == ref
    report = fp.report(vae)
    assert all(r.fallback == 0 for r in report.sites) and sum(r.fast for r in report.sites) > 0, str(report)
