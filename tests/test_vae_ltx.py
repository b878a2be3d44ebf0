"""The LTX-Video VAE adapter (models/vae_ltx.py) and its op (ops/ltx_vae_rmsnorm.py: the norm, and the pair with the
SiLU after it): tiny bf16 ``AutoencoderKLLTXVideo`` of 0.9.0's form and of 0.9.5's (``LTXVideo095DownBlock3D``,
residual upsamplers, the timestep-conditioned decoder), decode and encode patched == unpatched (``torch.equal``) with
every site on its fast path (on CPU under the emulated kernels; each norm with its SiLU and the causal convolution
after them as one chain, `ltx_vae_rmsnorm_conv`, or alone where a modulate stands between), also tiled and sliced; unpatch, state dicts, hooks (on a norm, on a paired norm, on the
SiLU), a replaced or wrapped ``RMSNorm.forward``; the op's arithmetic against eager, its guard, the pair's proof. On
the GPU: the kernel (norm and pair) at LTX-Video's real shapes with poisoned outputs, the proof on every value,
through NVRTC and nvcc, and the full-size VAE's decode and encode md5-identical. The chain op's own tests are in
test_ltx_vae_rmsnorm_conv.py."""

from __future__ import annotations

import functools
import hashlib
import importlib
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLLTXVideo
from diffusers.models.autoencoders.autoencoder_kl_ltx import LTXVideoResnetBlock3d
from diffusers.models.normalization import RMSNorm

import diffusers_fastpath as fp
from diffusers_fastpath.models import vae_ltx
from diffusers_fastpath.ops._policy import REASON_DISABLED, Site, bits, tensors_equal
from diffusers_fastpath.ops.gelu_cat import every_value
from diffusers_fastpath.testing._common import randomize_
from diffusers_fastpath.testing.checks import ltx_vae_sites, state_dict_round_trip

ltx_norm = importlib.import_module("diffusers_fastpath.ops.ltx_vae_rmsnorm")  # (ops binds the names to the ops)
ltx_norm_conv = importlib.import_module("diffusers_fastpath.ops.ltx_vae_rmsnorm_conv")

# 0.9.0's form (the bench's ltx-video-tiny: the published compression, 8 channels) and 0.9.5's (spatial / temporal /
# spatiotemporal downsamplers, residual upsamplers, the timestep-conditioned decoder)
CONFIGS = {
    "0.9.0": dict(latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
                  layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1)),
    "0.9.5": dict(latent_channels=8, block_out_channels=(8, 16, 32, 32), decoder_block_out_channels=(8, 16, 32),
                  layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
                  spatio_temporal_scaling=(True, True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
                  decoder_inject_noise=(False, False, False, False),
                  downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
                  upsample_residual=(True, True, True), upsample_factor=(2, 2, 2), timestep_conditioning=True,
                  down_block_types=("LTXVideo095DownBlock3D",) * 4),
}


def _build(kind: str = "0.9.0", dtype=torch.bfloat16, seed=0):
    """A tiny VAE with random weights (the timestep tables and every convolution drawn: `randomize_`)."""
    return randomize_(AutoencoderKLLTXVideo(**CONFIGS[kind]), seed).to(dtype).eval()


def _latents(vae, frames=2, size=2, seed=3, batch=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vae.config.latent_channels, frames, size, size, generator=gen).to(torch.bfloat16)


def _video(frames=9, size=64, seed=4, batch=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(batch, 3, frames, size, size, generator=gen) * 2 - 1).to(torch.bfloat16)


def _decode(vae, z):
    temb = torch.tensor([0.05] * z.shape[0]) if vae.config.timestep_conditioning else None
    return vae.decode(z, temb).sample


def _encode(vae, x):
    return vae.encode(x).latent_dist.mean


def _unsliced_decode(vae, z, temb=None):
    vae.use_slicing = False
    try:
        return AutoencoderKLLTXVideo.decode(vae, z, temb)
    finally:
        vae.use_slicing = True


def _norms(vae) -> int:
    return sum(type(m) is RMSNorm and m.weight is None for m in vae.modules())


PAIR = "ltx_vae_rmsnorm_silu"  # the pair's op (and site name, on the norm)
NORM_OPS = ("ltx_rmsnorm", PAIR)
CHAIN = "ltx_vae_rmsnorm_conv"  # the norm -> SiLU -> convolution chain's op (and site name, on the convolution)
_NORM_OF = {"conv1": "norm1", "conv2": "norm2", "conv_out": "norm_out"}  # a chain's convolution -> the norm it reads


def _module(r) -> str:
    return r.site.split(":")[0]  # (a named site's row is "<module path>:<name>")


def _chain_norm(r) -> str:
    """The norm whose chain a chain site (on the convolution) stands for."""
    path, conv = _module(r).rsplit(".", 1)
    return f"{path}.{_NORM_OF[conv]}"


def _sites(vae) -> list:
    """`ltx_vae_sites`, less each norm's site that never ran where its other site ran fast: every norm carries its own
    site (`ltx_rmsnorm`: the calls that run it alone), its pair's where a SiLU follows it (`ltx_vae_rmsnorm_silu`), and
    the convolution after the SiLU its chain's (`ltx_vae_rmsnorm_conv`), and each call takes one of them
    (`ltx_vae_sites` already leaves out the norms' sites of a chain that ran)."""
    rows = ltx_vae_sites(fp.report(vae))
    ran = {_module(r) for r in rows if r.op in NORM_OPS and r.fast} | {_chain_norm(r) for r in rows
                                                                       if r.op == CHAIN and r.fast}
    return [r for r in rows if not (r.fast == r.fallback == 0 and (r.op in NORM_OPS and _module(r) in ran
                                                                   or r.op == CHAIN and _chain_norm(r) in ran))]


def _fused_ways(vae) -> dict[str, str]:
    """Each norm's way that ran fast: its module path -> ``ltx_vae_rmsnorm_conv`` (with its SiLU and the convolution
    after them), ``ltx_vae_rmsnorm_silu`` (with its SiLU) or ``ltx_rmsnorm`` (alone)."""
    sites = fp.report(vae).sites
    return {**{_module(r): r.op for r in sites if r.op in NORM_OPS and r.fast},
            **{_chain_norm(r): CHAIN for r in sites if r.op == CHAIN and r.fast}}


@pytest.mark.parametrize("kind", list(CONFIGS))
@torch.no_grad()
def test_patched_vae_decode_and_encode_equal_unpatched_every_site_fast(kind, emulated_kernels, unpatch_after):
    vae = _build(kind)
    z, x = _latents(vae), _video()
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    assert torch.isfinite(ref_dec).all() and ref_dec.float().std() > 0.01 and ref_enc.float().std() > 0.01
    norms = _norms(vae)
    assert norms == 2 * sum(type(m).__name__ == "LTXVideoResnetBlock3d" for m in vae.modules()) + 2
    convs = sum(type(m) is torch.nn.Conv3d and m.bias is not None for m in vae.modules())  # (each causal conv's `conv`)
    upsamplers = sum(type(m).__name__ == "LTXVideoUpsampler3d" and m.residual for m in vae.modules())
    assert upsamplers == (3 if kind == "0.9.5" else 0)  # (0.9.0's upsamplers add no residual: left as they are)
    unpatch_after(fp.patch(vae))
    assert convs and Counter(r.op for r in fp.report(vae).sites) == Counter(  # (a conv_bias site on each `.conv`)
        {"ltx_rmsnorm": norms, PAIR: norms, CHAIN: norms,  # (each norm: a pair, joined with its convolution)
         "conv_bias": convs, "ltx_causal_conv3d": convs, "ltx_upsampler3d": upsamplers})
    assert torch.equal(_decode(vae, z), ref_dec)
    for r in _sites(vae):  # the decoder's sites ran fast, the encoder's not yet
        assert (r.fast > 0 and not r.fallback) if r.site.startswith("decoder.") else (r.fast, r.fallback) == (0, 0), r
    assert torch.equal(_encode(vae, x), ref_enc)
    assert all(r.fast > 0 and r.fallback == 0 for r in _sites(vae)), str(fp.report(vae))
    # every norm with its SiLU and the convolution after them in one pass, but where the timestep-conditioned decoder
    # modulates between the norm and the SiLU (its resnets and its norm_out: the norm alone, the modulate, the SiLU and
    # the convolution as written)
    ways = _fused_ways(vae)
    assert len(ways) == norms and all(
        op == ("ltx_rmsnorm" if kind == "0.9.5" and site.startswith("decoder.") else CHAIN) for site, op in ways.items())


_SHORTCUT = "x of a channels-last layout"  # (ltx_causal_conv's refusal of the shortcuts' input)


def _refused_shortcut(r) -> bool:
    """A resnet's ``conv_shortcut`` row of `ltx_causal_conv3d`: a ``kernel_size=1`` ``LTXVideoCausalConv3d`` called
    on ``norm3(x.movedim(1, -1)).movedim(-1, 1)``, channels-last memory, which the op refuses on every call (its
    kernel reads rows of unit W stride); the module's forward runs, its ``conv`` fast through `conv_bias`."""
    return r.op == "ltx_causal_conv3d" and r.site.endswith(".conv_shortcut")


def assert_every_site_fast_but_the_shortcuts(vae) -> None:
    """Every site of a patched LTX-Video VAE ran fast and never fell back (`ltx_vae_sites`), but the resnets'
    shortcuts (published 0.9.0 has four: where a block changes its channel count), each refused for its layout on
    every call and never fast."""
    for r in _sites(vae):
        if _refused_shortcut(r):
            assert r.fast == 0 and set(r.reasons) == {_SHORTCUT}, str(fp.report(vae))
        else:
            assert r.fast > 0 and r.fallback == 0, str(fp.report(vae))


@torch.no_grad()
def test_resnet_shortcuts_fall_back_by_layout_every_other_site_fast(emulated_kernels, unpatch_after):
    """0.9.0's form with blocks that change their channel count (as the published VAE's do: a ``norm3`` and a
    ``kernel_size=1`` causal ``conv_shortcut`` in those resnets, which the tiny configs above have none of): decode
    and encode equal unpatched; the shortcuts' causal convolutions refused for their channels-last input, each call
    (what the GPU test at the published size expects too), their ``conv`` fast; every other site fast."""
    config = {**CONFIGS["0.9.0"], "block_out_channels": (8, 16, 16, 16), "decoder_block_out_channels": (8, 16, 16, 16)}
    vae = randomize_(AutoencoderKLLTXVideo(**config), 0).to(torch.bfloat16).eval()
    shortcuts = [n for n, m in vae.named_modules() if n.endswith(".conv_shortcut")]
    assert len(shortcuts) == 2 and all(type(vae.get_submodule(n)).__name__ == "LTXVideoCausalConv3d"
                                       for n in shortcuts)
    z, x = _latents(vae), _video()
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref_dec)
    assert torch.equal(_encode(vae, x), ref_enc)
    assert sorted(r.site for r in _sites(vae) if _refused_shortcut(r)) == sorted(shortcuts)
    assert_every_site_fast_but_the_shortcuts(vae)
    inner = {r.site: r for r in _sites(vae) if r.op == "conv_bias"}
    assert all(inner[f"{n}.conv"].fast > 0 and not inner[f"{n}.conv"].fallback for n in shortcuts)


@pytest.mark.parametrize("kind", list(CONFIGS))
@torch.no_grad()
def test_tiled_and_sliced_decode_and_encode_equal_unpatched(kind, emulated_kernels, unpatch_after):
    """``enable_tiling`` and ``enable_slicing`` run the same modules per tile and per sample: patched == unpatched
    (0.9.0: tiles of 64 pixels at a 32-pixel stride over a 96 x 96 video of two samples); the tiles whose rows the
    kernel does not take (fewer than 8 latent positions) fall back by their size, nothing else."""
    vae = _build(kind)
    if kind == "0.9.0":  # (the tiny 0.9.5's decoder does not invert its encoder's compression, which tiling assumes)
        vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=32,
                          tile_sample_stride_width=32)
        vae.enable_slicing()
    else:  # diffusers 0.42.1's sliced decode with a temb does not run (it zips the two splits wrongly): encode sliced
        vae.enable_slicing()
        vae.decode = functools.partial(_unsliced_decode, vae)
    size = 3 if kind == "0.9.0" else 2
    z, x = _latents(vae, size=size, batch=2), _video(size=32 * size, batch=2)
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref_dec)
    assert torch.equal(_encode(vae, x), ref_enc)
    report = fp.report(vae)
    # (a refused chain runs its pair, which calls its norm, whose guards refuse too: those sites count the fallbacks)
    assert all(r.fast > 0 for r in _sites(vae) if not (r.op in NORM_OPS and r.fallback)), str(report)
    assert all(reason.startswith("trailing sizes") for r in report.sites for reason in r.reasons), str(report)


@torch.no_grad()
def test_fp32_vae_patched_equal_unpatched_norms_refuse_by_dtype(emulated_kernels, unpatch_after):
    vae = _build(dtype=torch.float32)
    z = _latents(vae).float()
    ref = _decode(vae, z)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref)
    report = fp.report(vae)
    assert report.sites and all(r.fast == 0 and set(r.reasons) == {"dtype float32"} for r in report.sites
                                if r.fallback), str(report)


def test_unpatch_restores_classes_and_state_dict():
    vae = _build("0.9.5")
    with state_dict_round_trip(vae):
        assert type(vae.decoder.norm_out) is vae_ltx.FastpathLTXRMSNorm
        assert type(vae.decoder.up_blocks[0].resnets[0].norm1) is vae_ltx.FastpathLTXRMSNorm
        assert type(vae.decoder.up_blocks[0].resnets[0]).__name__ == "FastpathLTXVideoResnetBlock3d"
        assert type(vae.decoder) is vae_ltx.BLOCKS[2].sub and type(vae.encoder) is vae_ltx.BLOCKS[1].sub
        assert hasattr(vae.decoder.norm_out, "_fastpath_site_" + PAIR)
    assert type(vae.decoder.up_blocks[0].resnets[0]) is LTXVideoResnetBlock3d
    assert type(vae.decoder.norm_out) is RMSNorm and not hasattr(vae.decoder.norm_out, "_fastpath_site_" + PAIR)
    assert all(type(m).__module__.startswith(("diffusers.", "torch.")) for m in vae.modules())


def test_the_blocks_forwards_pair_each_norm_with_its_silu():
    """The pair rewrite of the installed forwards (the moved form ``V = self.norm(V.movedim(1, -1)).movedim(-1, 1)``):
    the resnet's two norms with its ``nonlinearity`` (across the optional modulate), each ``norm_out`` with
    ``conv_act`` (the decoder's across its optional modulate)."""
    assert [block.current()._fastpath_pairs for block in vae_ltx.BLOCKS] == [
        (("norm1", "nonlinearity"), ("norm2", "nonlinearity")), (("norm_out", "conv_act"),),
        (("norm_out", "conv_act"),)]


@torch.no_grad()
def test_hooks_run_inside_the_patched_norm(emulated_kernels, unpatch_after):
    """The fused norm is the module's own forward: a forward hook on it (and a global one) runs, the site stays fast."""
    vae = _build("0.9.5")
    z = _latents(vae)
    ref = _decode(vae, z)
    unpatch_after(fp.patch(vae))
    norm = vae.decoder.mid_block.resnets[0].norm1
    seen = []
    handle = norm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    glob = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: seen.append("global") if m is norm else None)
    try:
        assert torch.equal(_decode(vae, z), ref)
    finally:
        handle.remove()
        glob.remove()
    assert seen.count("global") == 1 and len(seen) == 2 and norm._fastpath_site.fast == 1


@torch.no_grad()
@pytest.mark.parametrize("hooked", ["norm", "silu", "global"])
def test_hooks_on_a_paired_norm_or_its_silu_run_the_two_modules(hooked, emulated_kernels, unpatch_after):
    """A hook on a paired norm, on the SiLU module after it (the resnet's ``nonlinearity``, which both its pairs
    share) or a global one: those chains are refused (counted on the convolution's chain site with the module that has
    hooks) and run their statements as written: the pair refused too (counted "hooks"), so the norm and the SiLU run as
    two module calls (the norm still `ltx_rmsnorm` inside its call), then the convolution's call; the hook sees what it
    sees unpatched; every other chain stays fast."""
    vae = _build()
    z = _latents(vae)
    resnet = vae.decoder.mid_block.resnets[0]
    target = {"norm": resnet.norm1, "silu": resnet.nonlinearity}.get(hooked)
    seen = []

    def hook(m, i, o):
        if hooked != "global" or m is resnet.norm1:
            seen.append((i[0].shape, i[0].stride(), o.shape, o.stride()))

    def decode():
        handle = (target.register_forward_hook(hook) if target is not None
                  else torch.nn.modules.module.register_module_forward_hook(hook))
        try:
            return _decode(vae, z)
        finally:
            handle.remove()

    ref, ref_seen = decode(), list(seen)
    seen.clear()
    unpatch_after(fp.patch(vae))
    assert torch.equal(decode(), ref) and seen == ref_seen and seen
    hooked_pairs = {"norm": {"norm1"}, "silu": {"norm1", "norm2"}}.get(hooked)  # (one SiLU module after both norms)
    refusal = f"{type(target if hooked == 'silu' else resnet.norm1).__name__} has hooks"  # (the first hooked module)
    pairs = {_module(r): r for r in fp.report(vae).sites if r.op == PAIR and r.site.startswith("decoder.")}
    chains = [r for r in fp.report(vae).sites if r.op == CHAIN and r.site.startswith("decoder.")]
    assert chains and len(chains) == len(pairs)
    for r in chains:
        path, norm = _chain_norm(r).rsplit(".", 1)
        pair = pairs[f"{path}.{norm}"]
        if hooked == "global" or (path == "decoder.mid_block.resnets.0" and norm in hooked_pairs):
            # (a global hook: norm2's chain finds it on the dropout between, which the chain checks first)
            assert (r.fast, r.reasons) == (0, {"hooks" if hooked == "global" and norm == "norm2" else refusal: 1}), r
            assert (pair.fast, pair.reasons) == (0, {"hooks": 1}), pair
        else:
            assert r.fast == 1 and not r.fallback, r
            assert pair.fast == pair.fallback == 0, pair
    assert resnet.norm1._fastpath_site.fast == 1  # (the norm's own forward, inside its call: fast, hooks or not)


@pytest.mark.parametrize("how", ["replaced", "wrapped"])
def test_a_replaced_norm_forward_is_left_unpatched(how, monkeypatch, emulated_kernels, fastpath_log):
    """Another library replaced ``RMSNorm.forward`` (with other code, or with a ``functools.wraps`` wrapper whose
    ``inspect.getsource`` is the original's): not provably the checked code, so the norms keep their class and get
    no site (one warning), and what the class holds runs (the wrapper's calls counted)."""
    original, calls = RMSNorm.forward, []

    def replaced(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)

    @functools.wraps(original)
    def wrapped(self, x):
        calls.append(1)
        return original(self, x)

    monkeypatch.setattr(RMSNorm, "forward", replaced if how == "replaced" else wrapped)
    vae = _build()
    z = _latents(vae)
    with torch.no_grad():
        ref = _decode(vae, z)
        eager_calls = len(calls)
        fp.patch(vae)
        try:
            assert torch.equal(_decode(vae, z), ref)
            assert len(calls) == 2 * eager_calls  # (0 == 0 for the replacement)
            assert {r.op for r in fp.report(vae).sites} == {"conv_bias", "ltx_causal_conv3d"}
            assert type(vae.decoder.norm_out) is RMSNorm
        finally:
            fp.unpatch(vae)
    assert "RMSNorm.forward is not the form" in fastpath_log.text


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_arithmetic_equals_the_module(dtype):
    """The kernel's arithmetic (after aten's reduction and rsqrt) is the module's output, bits and strides, on the
    channel-last view of channel-first memory; and the kernel wrapper's [B, C, spatial] form gives the same."""
    norm = RMSNorm(24, eps=1e-8, elementwise_affine=False)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 24, 3, 4, 8, generator=gen) * 5).to(dtype)
    x[:, :, 0, 0, 0] = 0  # a position whose channels are all zero (rsqrt of eps)
    view = x.movedim(1, -1)
    ref = RMSNorm.forward(norm, view)
    got = ltx_norm.ltx_rmsnorm_arithmetic(view, ltx_norm.reciprocal(view, norm.eps))
    assert got.stride() == ref.stride() and torch.equal(got, ref)
    squares = ltx_norm.square_arithmetic(x).movedim(1, -1)  # the square mode: eager's fp32 squares, bits and strides
    eager = view.to(torch.float32).pow(2)
    assert squares.stride() == eager.stride() and torch.equal(squares, eager)
    got = ltx_norm.ltx_rmsnorm_arithmetic(view, ltx_norm.reciprocal(view, norm.eps, ltx_norm.square_arithmetic))
    assert torch.equal(got, ref)
    pair = ltx_norm.ltx_rmsnorm_arithmetic(view, ltx_norm.reciprocal(view, norm.eps), silu=True)  # the pair's epilogue
    eager = torch.nn.SiLU()(RMSNorm.forward(norm, view).movedim(-1, 1))  # as the blocks run it: on the moved-back view
    assert pair.movedim(-1, 1).stride() == eager.stride() and torch.equal(pair.movedim(-1, 1), eager)
    assert torch.equal(ltx_norm.ltx_vae_rmsnorm_silu_ref(norm, view), eager.movedim(1, -1))


def test_kernel_wrapper_lays_the_kernel_out_as_eager(monkeypatch):
    """`_fused` hands the kernel x's channel-first memory (first for the squares, where x is dense) and the reciprocal
    as [B, spatial] rows, and returns the channel-last view eager returns (the launch replaced by the arithmetic on
    what it is given)."""
    seen = []

    def launch(x, r, square, silu, probe):
        seen.append((x.shape, x.is_contiguous(), None if square else (r.shape, r.is_contiguous()), square, silu, probe))
        return ltx_norm.launch_arithmetic(x, r, square, silu, probe)

    monkeypatch.setattr(ltx_norm, "_launch", launch)
    norm = RMSNorm(16, eps=1e-8, elementwise_affine=False)
    for silu in (False, True):
        seen.clear()
        x = torch.randn(2, 16, 3, 4, 8).to(torch.bfloat16).movedim(1, -1)
        out, ref = ltx_norm._fused(x, norm.eps, silu), RMSNorm.forward(norm, x)
        ref = F.silu(ref) if silu else ref
        assert seen == [((2, 16, 3, 4, 8), True, None, True, False, False),
                        ((2, 16, 3, 4, 8), True, ((2, 3, 4, 8, 1), True), False, silu, False)]
        assert out.shape == ref.shape and out.stride() == ref.stride() and torch.equal(out, ref)
        seen.clear()
        x = torch.randn(2, 16, 5, 4, 8).to(torch.bfloat16)[:, :, 2:].movedim(1, -1)  # channels apart: aten's squares
        out, ref = ltx_norm._fused(x, norm.eps, silu), RMSNorm.forward(norm, x)
        ref = F.silu(ref) if silu else ref
        assert seen == [((2, 16, 3, 4, 8), False, ((2, 3, 4, 8, 1), True), False, silu, False)]
        assert out.shape == ref.shape and out.stride() == ref.stride() and torch.equal(out, ref)


def test_custom_op_fake_lays_out_as_eager():
    """What torch.compile traces with (the op's fake) has eager's shape and strides, for x with channels apart too (an
    upsampler's output with its first frames sliced off); the op's CPU form is eager's norm."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    norm = RMSNorm(16, eps=1e-8, elementwise_affine=False)
    for x in (torch.randn(2, 16, 3, 4, 8), torch.randn(2, 16, 5, 4, 8)[:, :, 2:]):
        view = x.to(torch.bfloat16).movedim(1, -1)
        for silu in (False, True):
            ref = RMSNorm.forward(norm, view)
            ref = F.silu(ref) if silu else ref
            got = torch.ops.diffusers_fastpath.ltx_rmsnorm.default(view, 1e-8, silu)
            assert got.stride() == ref.stride() and torch.equal(got, ref)
            with FakeTensorMode() as mode:
                fake = torch.ops.diffusers_fastpath.ltx_rmsnorm.default(mode.from_tensor(view), 1e-8, silu)
            assert fake.shape == ref.shape and fake.stride() == ref.stride()
    assert torch.equal(torch.ops.diffusers_fastpath.ltx_rmsnorm.default(view, 1e-8), RMSNorm.forward(norm, view))


def test_guard_refuses_what_the_kernel_does_not_take():
    norm = vae_ltx.FastpathLTXRMSNorm(16, eps=1e-8, elementwise_affine=False)
    x = torch.randn(1, 16, 2, 4, 8).to(torch.bfloat16)
    assert ltx_norm._guard(norm, x.movedim(1, -1), check_pointers=False) == "device cpu"
    assert ltx_norm._guard(norm, x.movedim(1, -1).contiguous()) == "x not the channel-last view of channel-first memory"
    assert ltx_norm._guard(norm, x.float().movedim(1, -1)) == "dtype float32"
    assert ltx_norm._guard(norm, x[:, :, :1, :1, :4].contiguous().movedim(1, -1)).startswith("trailing sizes")
    assert ltx_norm._guard(vae_ltx.FastpathLTXRMSNorm(16, eps=1e-8), x.movedim(1, -1)) == "norm with weight or bias"
    assert ltx_norm._guard(RMSNorm(16, eps=1e-8, elementwise_affine=False), x.movedim(1, -1)).endswith(
        "is not a checked RMS norm")
    assert ltx_norm._guard(norm, "x") == "input not a tensor"


def test_nvrtc_launcher_passes_what_bindings_cpp_passes(monkeypatch):
    """The NVRTC launcher's arguments, field by field, as bindings.cpp's ltx_rmsnorm fills them, and the .cu's grid
    (one thread per 16-byte vector, at most kBlocksPerSm blocks per SM); the driver call captured on CPU."""
    from test_nvrtc import captured_launches  # noqa: F401 - the fixture's body, called directly below

    launches = captured_launches.__wrapped__(monkeypatch)
    x, r = torch.randn(2, 16, 3, 4, 8).to(torch.bfloat16), torch.rand(2, 3, 4, 8, 1)
    out = ltx_norm._nvrtc_kernel(x, r, False, False, False)
    kernel, key, grid, block, a = launches[-1]
    assert (kernel, key, block) == (ltx_norm._NVRTC, torch.bfloat16, (256, 1, 1)) and out.shape == x.shape
    assert grid == (2, 1, 1)  # 2 * 16 * 96 / 8 = 384 vectors: two blocks of 256 threads
    assert (a.a.out, a.a.x, a.a.rsqrt) == (out.data_ptr(), x.data_ptr(), r.data_ptr())
    assert (a.a.batch, a.a.channels, a.a.spatial, a.a.x_batch_stride, a.a.x_channel_stride, a.a.square, a.a.silu,
            a.a.probe, a.a.dtype) == (2, 16, 96, 16 * 96, 96, 0, 0, 0, 1)
    sliced = torch.randn(2, 16, 5, 4, 8).to(torch.bfloat16)[:, :, 2:]
    pair = ltx_norm._nvrtc_kernel(sliced, r, False, True, False)
    a = launches[-1][4].a
    assert (a.x_batch_stride, a.x_channel_stride, a.square, a.silu, a.probe) == (16 * 160, 160, 0, 1, 0)
    assert pair.dtype == torch.bfloat16 and pair.is_contiguous() and a.out == pair.data_ptr()
    squares = ltx_norm._nvrtc_kernel(x.half(), None, True, False, False)
    a = launches[-1][4].a
    assert launches[-1][1] == torch.float16 and (a.dtype, a.square, a.rsqrt, a.out) == (0, 1, None, squares.data_ptr())
    assert squares.dtype == torch.float32 and squares.shape == x.shape
    row = torch.zeros(1, 1, 65536, dtype=torch.bfloat16)
    probed = ltx_norm._nvrtc_kernel(row, None, False, False, True)
    a = launches[-1][4].a
    assert (a.rsqrt, a.square, a.silu, a.probe, a.batch, a.channels, a.spatial, a.out) == (
        None, 0, 0, 1, 1, 1, 65536, probed.data_ptr()) and probed.dtype == torch.bfloat16
    big = torch.empty(1, 8, 132 * 8 * 256 * 8 * 2, dtype=torch.bfloat16)
    ltx_norm._nvrtc_kernel(big, torch.empty(1, big.shape[2]), False, False, False)
    assert launches[-1][2] == (132 * 8, 1, 1)


def test_raw_op_guard_refuses_what_bindings_cpp_refuses():
    x, r = torch.randn(2, 16, 96).to(torch.bfloat16), torch.rand(2, 96)
    assert ltx_norm._raw_guard(x, r, False, False, False) == "device"
    assert ltx_norm._raw_guard(x, r, False, True, False) == "device"
    assert ltx_norm._raw_guard(x, None, False, True, False) == "rsqrt"
    assert ltx_norm._raw_guard(x, None, False, False, True) == "device"  # (the probe reads no reciprocal)
    assert ltx_norm._raw_guard(x, None, True, False, True) == "mode"
    assert ltx_norm._raw_guard(x, r, False, True, True) == "mode"
    assert ltx_norm._raw_guard(x[..., :95], r, False, True, False) == "x"
    assert ltx_norm._raw_guard(x.float(), r, False, True, False) == "x"


def test_launch_constants_match_the_source():
    from test_nvrtc import _constant

    assert (ltx_norm._THREADS, ltx_norm._BLOCKS_PER_SM) == tuple(
        _constant("ltx_vae_rmsnorm.cu", n) for n in ("kThreads", "kBlocksPerSm"))


# (the op, and a VAE whose decoder runs it: the norm alone where a timestep-conditioned decoder modulates between;
# the pair where the chain is off, as where the convolution after the SiLU does not take it)
WAYS = {"ltx_rmsnorm": (ltx_norm.LTX_RMSNORM, {**CONFIGS["0.9.0"], "timestep_conditioning": True}),
        PAIR: (ltx_norm.LTX_VAE_RMSNORM_SILU, CONFIGS["0.9.0"]),
        CHAIN: (ltx_norm_conv.LTX_VAE_RMSNORM_CONV, CONFIGS["0.9.0"])}


def _build_way(way: str, monkeypatch):
    if way == PAIR:
        monkeypatch.setattr(ltx_norm_conv.LTX_VAE_RMSNORM_CONV, "disabled", "off for this test")
    return randomize_(AutoencoderKLLTXVideo(**WAYS[way][1]), 0).to(torch.bfloat16).eval()


@pytest.mark.parametrize("way", list(WAYS))
def test_a_norm_kernel_that_differs_is_caught_on_its_first_call_and_eager_runs(way, monkeypatch, emulated_kernels):
    """Exact by construction (the pair's SiLU proven on every value, the chain's tail too), and still compared with
    eager on the first call of each signature: a kernel one ulp off is disabled there (one warning), and the decode is
    eager's."""
    op = WAYS[way][0]
    exact = op.kernel

    def off_by_one_ulp(*args):
        out = exact(*args)
        return (out.view(torch.int16) + 1).view(out.dtype)

    monkeypatch.setattr(op, "kernel", off_by_one_ulp)
    vae = _build_way(way, monkeypatch)
    z = _latents(vae)
    with torch.no_grad():
        ref = _decode(vae, z)
        fp.patch(vae)
        try:
            assert torch.equal(_decode(vae, z), ref) and torch.equal(_decode(vae, z), ref)
        finally:
            fp.unpatch(vae)
    assert "not bit-exact" in (op.disabled or "")


@pytest.mark.parametrize("way", list(WAYS))
def test_each_layout_is_verified_on_its_first_call(way, monkeypatch, emulated_kernels, unpatch_after):
    """The first call of each signature (dtype, dense or channels apart: the kernel's two paths) is compared with
    eager: a decode through the upsamplers verifies both, for the chain, for the pair (the chain off) and for the norm
    alone (a conditioned decoder's)."""
    op = WAYS[way][0]
    vae = _build_way(way, monkeypatch)
    z = _latents(vae)
    with torch.no_grad():
        ref = _decode(vae, z)
        unpatch_after(fp.patch(vae))
        assert torch.equal(_decode(vae, z), ref)
    verified = {key[0] for key in op.verified} if op is ltx_norm_conv.LTX_VAE_RMSNORM_CONV else op.verified
    assert {("bfloat16", "dense"), ("bfloat16", "strided")} <= set(verified)


def _probe_launch(planted=None):
    """The launch as the emulated kernels run it, its probe mode's result for the bf16 bit pattern `planted` one ulp
    off."""
    def launch(x, r, square, silu, probe):
        out = ltx_norm.launch_arithmetic(x, r, square, silu, probe)
        if probe and planted is not None:
            bits(out)[bits(x) == planted] += 1
        return out
    return launch


@torch.no_grad()
@pytest.mark.parametrize("planted", [None, 0x3F80, -0x0080, 0x7FC1, 0x0001], ids=str)
def test_a_silu_proof_that_fails_disables_the_pair(planted, monkeypatch, emulated_kernels):
    """The pair's proof runs on the first call of a signature: the kernel's SiLU (its probe mode) on all 65536 bf16
    values; one value off anywhere (1.0, -0.0, a NaN's payload, a subnormal) and the pair is disabled, that call's
    result eager's; the norm alone is not."""
    monkeypatch.setattr(ltx_norm, "_launch", _probe_launch(planted))
    monkeypatch.setattr(ltx_norm.LTX_VAE_RMSNORM_SILU, "prove", ltx_norm._prove_silu)
    norm = vae_ltx.FastpathLTXRMSNorm(16, eps=1e-8, elementwise_affine=False)
    x = (torch.randn(2, 16, 3, 4, 8) * 3).to(torch.bfloat16).movedim(1, -1)
    site = Site(PAIR)
    assert torch.equal(ltx_norm.ltx_vae_rmsnorm_silu(norm, x, site), F.silu(RMSNorm.forward(norm, x)))
    assert (site.fast == 1) is (planted is None), (site, ltx_norm.LTX_VAE_RMSNORM_SILU.status)
    assert ltx_norm._prove_silu(norm, x) is (planted is None)
    if planted is not None:
        assert "not bit-exact" in ltx_norm.LTX_VAE_RMSNORM_SILU.disabled and ltx_norm.LTX_RMSNORM.disabled is None
        assert dict(site.fallback) == {REASON_DISABLED: 1}


def test_the_silu_probe_pads_a_row_to_whole_vectors(monkeypatch):
    """The kernel runs 16-byte vectors only: `silu_probe` hands it a row padded to a multiple of 8 values (the proof's
    second row, of 65537) and returns the row's own results."""
    seen = []

    def launch(x, r, square, silu, probe):
        seen.append((tuple(x.shape), r, square, silu, probe))
        return ltx_norm.launch_arithmetic(x, r, square, silu, probe)

    monkeypatch.setattr(ltx_norm, "_launch", launch)
    for n, padded in ((65536, 65536), (65537, 65544), (3, 8)):
        row = torch.randn(1, 1, n).to(torch.float16)
        assert torch.equal(ltx_norm.silu_probe(row), F.silu(row))
        assert seen[-1] == ((1, 1, padded), None, False, False, True)


@torch.no_grad()
def test_hooks_on_the_norm_refuse_the_pair_and_run(emulated_kernels):
    """The pair stands for the norm's call: a hook on the norm (or a global one) refuses it, and the fallback calls
    the module, so the hook runs once (and the norm's own op inside its call is fast)."""
    norm = vae_ltx.FastpathLTXRMSNorm(16, eps=1e-8, elementwise_affine=False)
    norm._fastpath_site = Site("ltx_rmsnorm")
    x = (torch.randn(2, 16, 3, 4, 8) * 3).to(torch.bfloat16).movedim(1, -1)
    ref = F.silu(RMSNorm.forward(norm, x))
    seen = []
    site = Site(PAIR)
    handle = norm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        assert torch.equal(ltx_norm.ltx_vae_rmsnorm_silu(norm, x, site), ref)
    finally:
        handle.remove()
    assert seen == [x.shape] and site.fast == 0 and dict(site.fallback) == {"FastpathLTXRMSNorm has hooks": 1}
    assert norm._fastpath_site.fast == 1
    glob = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append("global"))
    try:
        assert torch.equal(ltx_norm.ltx_vae_rmsnorm_silu(norm, x, site), ref)
    finally:
        glob.remove()
    assert seen[-1] == "global" and site.fallback["FastpathLTXRMSNorm has hooks"] == 2
    assert torch.equal(ltx_norm.ltx_vae_rmsnorm_silu(norm, x, site), ref) and site.fast == 1


@torch.no_grad()
def test_torch_compile_emits_the_pair_once_verified(emulated_kernels):
    norm = vae_ltx.FastpathLTXRMSNorm(16, eps=1e-8, elementwise_affine=False)
    x = (torch.randn(2, 16, 3, 4, 8) * 3).to(torch.bfloat16).movedim(1, -1)
    ref = F.silu(RMSNorm.forward(norm, x))
    site = Site(PAIR)
    assert torch.equal(ltx_norm.ltx_vae_rmsnorm_silu(norm, x, site), ref) and site.fast == 1  # verified
    compiled = torch.compile(lambda t: ltx_norm.ltx_vae_rmsnorm_silu(norm, t), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), ref)


# --- GPU ------------------------------------------------------------------------------------------------------------


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.float().cpu().numpy().tobytes()).hexdigest()


# The norms of LTX-Video's decode at 768x512x121 (latents 24x16, 16 frames; channels 512, 256 and 128 as the decoder
# widens, 8x in space and time across its three upsamplers, the last at the 4x4-patchified 192x128, 121 frames)
LTX_NORM_SHAPES = [(1, 512, 16, 16, 24), (1, 512, 31, 32, 48), (1, 256, 61, 64, 96), (1, 128, 121, 128, 192)]


def _gpu_input(shape, dtype, layout, seed=0):
    """x ``[B, C, T, H, W]`` on the GPU: contiguous, or with its first frame sliced off (channels apart); zeros
    scattered, and positions whose channels are all zero (rsqrt of eps: the norm's output 0, the SiLU's 0)."""
    b, c, t, h, w = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(b, c, t + (layout == "sliced"), h, w, generator=gen, device="cuda") * 3).to(dtype)
    x = x[:, :, 1:] if layout == "sliced" else x
    x[:, 1::5, ..., ::11] = 0
    x[0, :, 0, 0] = 0
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("way", [w for w in WAYS if w != CHAIN])  # (the chain's own: test_ltx_vae_rmsnorm_conv.py)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", LTX_NORM_SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "sliced"])
@torch.no_grad()
def test_ltx_rmsnorm_kernel_equals_eager_at_ltx_shapes(shape, dtype, layout, way):
    """The op (the norm alone, or the pair: its SiLU proof on every value included, the op's first call) against the
    module on the channel-last view (the pair: then the ``nn.SiLU`` as the resnets call it, on the moved-back view),
    torch.equal, strides included, the allocator's blocks of the output's size poisoned with NaN first; x contiguous
    channel-first, or with its first frame sliced off (the upsamplers' ``[:, :, stride - 1:]``: channels apart)."""
    op = WAYS[way][0]
    norm = RMSNorm(shape[1], eps=1e-8, elementwise_affine=False).cuda()
    view = _gpu_input(shape, dtype, layout).movedim(1, -1)
    ltx_norm.add_norm_class(RMSNorm)
    ref = RMSNorm.forward(norm, view)
    ref = torch.nn.SiLU()(ref.movedim(-1, 1)).movedim(1, -1) if op is ltx_norm.LTX_VAE_RMSNORM_SILU else ref
    poison = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for _ in range(3)]  # the next blocks
    del poison
    site = Site(way)
    out = op(site, norm, view)
    assert site.fast == 1 and op.disabled is None, (dict(site.fallback), op.status)
    assert out.stride() == ref.stride() and torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_the_silu_proof_passes_on_every_value(dtype):
    """The kernel's SiLU (its probe mode) equals eager's ``F.silu`` on all 65536 values of the dtype (NaN payloads,
    infinities, subnormals), as one row of vectors and as the padded row of one more value."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    norm = RMSNorm(8, eps=1e-8, elementwise_affine=False)
    assert ltx_norm._prove_silu(norm, torch.zeros(1, 8, 8, dtype=dtype, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_ltx_rmsnorm_through_nvrtc_equals_nvcc_and_eager(dtype):
    """The NVRTC cubin's launch against the nvcc extension's op (where a toolkit built it) and eager, at LTX-Video's
    largest norm (128 channels, 121 frames of 128x192 patches), each mode: the norm, the squares, the pair, and the
    SiLU probe on every value of the dtype (bits, NaN payloads included)."""
    from test_nvrtc import both_ways

    nvcc = both_ways.__wrapped__()
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(1, 128, 121, 128, 192, generator=gen, device="cuda") * 3).to(dtype)
    view = x.movedim(1, -1)
    r = ltx_norm.reciprocal(view, 1e-8).contiguous()
    ref = RMSNorm.forward(RMSNorm(128, eps=1e-8, elementwise_affine=False), view).movedim(-1, 1)
    squares = view.to(torch.float32).pow(2).movedim(-1, 1)
    row = every_value(dtype, "cuda").reshape(1, 1, -1)
    modes = {(False, False, False): (r, ref), (True, False, False): (None, squares),
             (False, True, False): (r, F.silu(ref)), (False, False, True): (None, F.silu(row))}  # (square, silu, probe)
    for (square, silu, probe), (rsqrt, want) in modes.items():
        t = row if probe else x
        assert tensors_equal(ltx_norm._nvrtc_kernel(t, rsqrt, square, silu, probe), want), (square, silu, probe)
        if nvcc:
            got = torch.ops.diffusers_fastpath._ltx_rmsnorm_cuda(t, rsqrt, square, silu, probe)
            assert tensors_equal(got, want), (square, silu, probe)


@pytest.mark.gpu
@torch.no_grad()
def test_ltx_vae_decode_and_encode_md5_identical_every_site_fast(unpatch_after):
    """LTX-Video's VAE (the published 0.9.0 config, random weights) on a representative crop (17 frames of 256x256):
    decode and encode md5-identical patched and unpatched, every site fast but the four resnet shortcuts' causal
    convolutions, refused for their channels-last input (`assert_every_site_fast_but_the_shortcuts`)."""
    vae = randomize_(AutoencoderKLLTXVideo(), 0).to("cuda", torch.bfloat16).eval()
    gen = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(1, 128, 3, 8, 8, generator=gen, device="cuda").to(torch.bfloat16)
    x = (torch.rand(1, 3, 17, 256, 256, generator=gen, device="cuda") * 2 - 1).to(torch.bfloat16)
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    unpatch_after(fp.patch(vae))
    dec, enc = _decode(vae, z), _encode(vae, x)
    assert torch.equal(dec, ref_dec) and _md5(dec) == _md5(ref_dec)
    assert torch.equal(enc, ref_enc) and _md5(enc) == _md5(ref_enc)
    assert_every_site_fast_but_the_shortcuts(vae)
    # (every norm with its SiLU and the convolution after them: the published 0.9.0 modulates none)
    assert set(_fused_ways(vae).values()) == {CHAIN}
