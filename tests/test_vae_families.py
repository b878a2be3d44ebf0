"""The VAEs patched through pieces other families brought (models/vae_hunyuan.py, models/vae_wan.py): HunyuanVideo's
and HunyuanImage-2.1's (GroupNorm + SiLU, as FLUX.1's), HunyuanVideo-1.5's, the HunyuanImage refiner's and Qwen-Image
2.1's (Wan's channel RMS norm, Qwen-Image 2.1's 2-D causal convolutions). Tiny configs, random weights: decode and
encode patched == unpatched (``torch.equal``) with every site on its fast path (on CPU under the emulated kernels),
every site counted, tiled and sliced where the class tiles; unpatch restores classes and state dicts."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from diffusers import (AutoencoderKLHunyuanImage, AutoencoderKLHunyuanImageRefiner, AutoencoderKLHunyuanVideo,
                       AutoencoderKLHunyuanVideo15, AutoencoderKLQwenImage21)
from diffusers.models.autoencoders import autoencoder_kl_qwenimage21 as qwen21
from torch import nn

import diffusers_fastpath as fp
from diffusers_fastpath.models import vae_hunyuan, vae_wan
from diffusers_fastpath.testing._common import randomize_
from diffusers_fastpath.testing.checks import state_dict_round_trip
from test_vae import _joined

# name -> (builder, latent shape, sample shape): the published block layouts, narrow and shallow
FAMILIES = {
    "hunyuanvideo": (lambda: AutoencoderKLHunyuanVideo(block_out_channels=(32, 32, 32, 32), norm_num_groups=8,
                                                       layers_per_block=1, latent_channels=4),
                     (1, 4, 2, 4, 4), (1, 3, 5, 32, 32)),
    "hunyuanimage": (lambda: AutoencoderKLHunyuanImage(in_channels=3, out_channels=3, latent_channels=8,
                                                       block_out_channels=(32, 32, 64, 64, 64, 64), layers_per_block=1,
                                                       spatial_compression_ratio=32, sample_size=128),
                     (1, 8, 4, 4), (1, 3, 128, 128)),
    "hunyuanvideo-1.5": (lambda: AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 16, 16, 32, 32),
                                                             layers_per_block=1),
                         (1, 4, 2, 4, 4), (1, 3, 5, 64, 64)),
    "hunyuanimage-refiner": (lambda: AutoencoderKLHunyuanImageRefiner(latent_channels=4,
                                                                      block_out_channels=(8, 16, 16, 32, 32),
                                                                      layers_per_block=1),
                             (1, 4, 2, 4, 4), (1, 3, 5, 64, 64)),
    "qwen-image-2.1": (lambda: AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2, 2],
                                                        num_res_blocks=1, latents_mean=[0.0] * 4, latents_std=[1.0] * 4),
                       (1, 4, 1, 4, 4), (1, 4, 1, 64, 64)),
}
RMS_NORMS = tuple(vae_wan.NORMS)


def _build(name: str, seed: int = 0):
    vae = randomize_(FAMILIES[name][0](), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # Wan-style norms: gamma around 1 (ones as built), so that every multiply matters
        for m in vae.modules():
            if isinstance(m, RMS_NORMS):
                m.gamma.copy_(1 + 0.25 * torch.randn(m.gamma.shape, generator=gen))
    return vae.to(torch.bfloat16).eval()


def _inputs(name: str, seed: int = 3, batch: int = 1):
    _, z_shape, x_shape = FAMILIES[name]
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn((batch, *z_shape[1:]), generator=gen).to(torch.bfloat16)
    x = (torch.rand((batch, *x_shape[1:]), generator=gen) * 2 - 1).to(torch.bfloat16)
    return z, x


def _run(vae, z, x):
    return vae.decode(z).sample, vae.encode(x).latent_dist.mean


def _expected_sites(vae) -> Counter:
    """One fused norm + SiLU per resnet norm and per encoder / decoder output norm, one plain fused norm per other norm
    (the attention blocks'), one upsampling per Wan-style 2x upsampling, one conv_bias per convolution with a bias
    (the plain ones and Qwen-Image 2.1's causal ones)."""
    resnets = sum(type(m).__name__.endswith(("ResnetBlock", "ResnetBlockCausal3D", "ResidualBlock"))
                  for m in vae.modules())
    paired = 2 * resnets + 2
    convs = sum(type(m) in (nn.Conv2d, nn.Conv3d, qwen21.QwenImage21CausalConv3d) and m.bias is not None
                for m in vae.modules())
    group_norms = sum(type(m) is nn.GroupNorm for m in vae.modules())
    if group_norms:
        expected = Counter({"group_norm_silu": paired, "group_norm": group_norms - paired, "conv_bias": convs})
        if isinstance(vae, AutoencoderKLHunyuanImage):  # (the 2-D one: each pair joined with its convolution)
            expected["group_norm_silu_conv"] = paired
        return expected
    norms = sum(isinstance(m, RMS_NORMS) for m in vae.modules())
    upsamples = sum(isinstance(m, tuple(vae_wan.UPSAMPLES)) for m in vae.modules())
    expected = Counter({"channel_rmsnorm_silu": paired, "channel_rmsnorm": norms - paired, "conv_bias": convs})
    if upsamples:
        expected["upsample_nearest2x"] = upsamples
    return expected


def _rows(model):
    return {r.site: (r.op, r.fast, r.fallback, dict(r.reasons)) for r in fp.report(model).sites}


def _every_site_fast(model) -> bool:
    """No fallback anywhere, and every site called: but Qwen-Image 2.1's resamplers' ``time_conv``, which its
    one-frame image VAE never calls (diffusers keeps them from Wan's video network)."""
    rows = _rows(model)
    idle = {n for n in rows if n.endswith("sampler.time_conv")} if type(model).__name__.endswith("QwenImage21") else set()
    idle |= _joined(rows)  # (the sites a fast joined norm -> SiLU -> convolution call stands in for)
    return (all(fallback == 0 for _, _, fallback, _ in rows.values())
            and all((fast == 0) == (n in idle) for n, (_, fast, _, _) in rows.items()))


@pytest.mark.parametrize("name", sorted(FAMILIES))
@torch.no_grad()
def test_patched_vae_decode_and_encode_equal_unpatched_every_site_fast(name, emulated_kernels, unpatch_after):
    vae = _build(name)
    z, x = _inputs(name)
    ref_dec, ref_enc = _run(vae, z, x)
    assert torch.isfinite(ref_dec).all() and ref_dec.float().std() > 0.01 and ref_enc.float().std() > 0.01
    expected = _expected_sites(vae)
    unpatch_after(fp.patch(vae))
    assert Counter(r.op for r in fp.report(vae).sites) == expected, str(fp.report(vae))
    dec, enc = _run(vae, z, x)
    assert torch.equal(dec, ref_dec) and torch.equal(enc, ref_enc)
    assert _every_site_fast(vae), str(fp.report(vae, verbose=True))


@pytest.mark.parametrize("name", ["hunyuanvideo", "qwen-image-2.1"])
@torch.no_grad()
def test_tiled_and_sliced_decode_and_encode_equal_unpatched(name, emulated_kernels, unpatch_after):
    """``enable_tiling`` and ``enable_slicing`` call the same blocks per tile and sample: the same results, every
    site fast (tiles the kernels take)."""
    vae = _build(name)
    vae.enable_slicing()
    if name == "hunyuanvideo":
        vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=24,
                          tile_sample_stride_width=24)
        z, x = _inputs(name, batch=2)
        z = torch.randn(2, 4, 2, 8, 8, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        x = (torch.rand(2, 3, 5, 64, 64, generator=torch.Generator().manual_seed(6)) * 2 - 1).to(torch.bfloat16)
    else:
        vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=48,
                          tile_sample_stride_width=48)
        z = torch.randn(2, 4, 1, 8, 8, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        x = (torch.rand(2, 4, 1, 128, 128, generator=torch.Generator().manual_seed(6)) * 2 - 1).to(torch.bfloat16)
    ref_dec, ref_enc = _run(vae, z, x)
    unpatch_after(fp.patch(vae))
    dec, enc = _run(vae, z, x)
    assert torch.equal(dec, ref_dec) and torch.equal(enc, ref_enc)
    assert _every_site_fast(vae), str(fp.report(vae, verbose=True))


@pytest.mark.parametrize("name", sorted(FAMILIES))
@torch.no_grad()
def test_unpatch_restores_classes_and_state_dict(name):
    vae = _build(name)
    with state_dict_round_trip(vae) as classes:
        assert {n for n, m in vae.named_modules() if type(m) is not classes[n]}, "nothing swapped"


def test_the_new_vae_classes_are_supported_and_registered_where_pickles_find_them():
    names = set(fp.supported_classes())
    assert {"AutoencoderKLHunyuanVideo", "AutoencoderKLHunyuanImage", "AutoencoderKLHunyuanVideo15",
            "AutoencoderKLHunyuanImageRefiner", "AutoencoderKLQwenImage21"} <= names
    for block in (*vae_hunyuan.BLOCKS, *vae_wan.BLOCKS):
        sub = block.current()
        assert sub is not None and getattr(__import__(block.module, fromlist=["x"]), block.name) is sub, block.name
    sub = vae_wan.FastpathQwenImage21CausalConv3d  # diffusers' forward, then FastpathConv2d's, then nn.Conv2d's
    assert sub.__mro__[1:4] == (qwen21.QwenImage21CausalConv3d, vae_wan.FastpathConv2d, nn.Conv2d)


@pytest.mark.parametrize("model, cls, size, frames", [
    ("hunyuanvideo-tiny", "AutoencoderKLHunyuanVideo", 32, [("decode", 2), ("encode", 5)]),  # 4x in time
    ("qwen-image-2.1-tiny", "AutoencoderKLQwenImage21", 64, [("decode", 1), ("encode", 1)]),  # one frame, RGBA
])
def test_bench_vae_level_builds_the_vae_only_models(model, cls, size, frames, tmp_path):
    """``--levels vae`` for a model whose VAE alone is benched: decode and encode bit-identical, every site counted
    (on a CPU each falls back, by the device); another level is refused with a clear error."""
    import json

    from diffusers_fastpath import bench

    path = tmp_path / "vae.json"
    assert bench.main(["--model", model, "--levels", "vae", "--device", "cpu", "--repeats", "1", "--no-progress",
                       "--height", str(size), "--width", str(size), "--frames", "5", "--json", str(path)]) == 0
    vae = json.loads(path.read_text())["vae"]
    assert vae["ran"] and vae["vae"] == cls
    assert [(r["call"], r["input_shape"][2]) for r in vae["rows"]] == frames
    assert cls != "AutoencoderKLQwenImage21" or vae["rows"][1]["input_shape"][1] == 4
    assert all(r["bit_identical"] for r in vae["rows"])
    assert vae["sites"]["sites"] > 40 and set(vae["sites"]["reasons"]) == {"device cpu"}
    with pytest.raises(SystemExit):
        bench.main(["--model", model, "--levels", "step", "--device", "cpu"])


# the published configs (the bench's `VAE_MODELS`) on representative crops: latent and sample shapes
FULL_SIZE = {
    "hunyuanvideo": ("hunyuanvideo", (1, 16, 5, 32, 32), (1, 3, 17, 256, 256)),
    "hunyuanvideo-1.5": ("hunyuanvideo-1.5", (1, 32, 5, 16, 16), (1, 3, 17, 256, 256)),
    "hunyuanimage": ("hunyuan-image", (1, 64, 16, 16), (1, 3, 512, 512)),
    "qwen-image-2.1": ("qwen-image-2.1", (1, 64, 1, 32, 32), (1, 4, 1, 512, 512)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FULL_SIZE))
@torch.no_grad()
def test_full_size_vae_decode_and_encode_md5_identical_every_site_fast(name, unpatch_after):
    import hashlib

    import diffusers

    from diffusers_fastpath.bench.levels.vae import VAE_MODELS

    model, z_shape, x_shape = FULL_SIZE[name]
    cls, config = VAE_MODELS[model]
    vae = randomize_(getattr(diffusers, cls)(**config), 0)
    with torch.no_grad():
        for m in vae.modules():
            if isinstance(m, RMS_NORMS):
                m.gamma.copy_(1 + 0.25 * torch.randn_like(m.gamma))
    vae = vae.to("cuda", torch.bfloat16).eval()
    gen = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(z_shape, generator=gen, device="cuda").to(torch.bfloat16)
    x = (torch.rand(x_shape, generator=gen, device="cuda") * 2 - 1).to(torch.bfloat16)
    ref_dec, ref_enc = _run(vae, z, x)
    assert torch.isfinite(ref_dec).all() and ref_dec.float().std() > 0.01
    expected = _expected_sites(vae)
    unpatch_after(fp.patch(vae))
    dec, enc = _run(vae, z, x)
    md5 = lambda t: hashlib.md5(t.float().cpu().numpy().tobytes()).hexdigest()  # noqa: E731
    assert torch.equal(dec, ref_dec) and md5(dec) == md5(ref_dec)
    assert torch.equal(enc, ref_enc) and md5(enc) == md5(ref_enc)
    assert Counter(r.op for r in fp.report(vae).sites) == expected
    assert _every_site_fast(vae), str(fp.report(vae, verbose=True))
