"""The VAE adapters (models/vae.py, models/vae_kl.py): FLUX.1's ``AutoencoderKL`` and FLUX.2's ``AutoencoderKLFlux2``
decode and encode patched == unpatched (``torch.equal``) with every GroupNorm site on its fast path (on CPU under the
emulated kernels), also tiled and sliced; unpatch, state dicts, hooks, copies, pipelines; the pair rewrite keeps
every branch's statements. On the GPU: the full-size FLUX.1 VAE at 1024x1024, md5-identical, every site fast."""

from __future__ import annotations

import copy
import hashlib
import io
import inspect
import linecache
from collections import Counter

import pytest
import torch
from diffusers.models.resnet import ResnetBlock2D
from torch import nn

import diffusers_fastpath as fp
from diffusers_fastpath.models import vae as vae_module
from diffusers_fastpath.models.vae_kl import BLOCKS
from diffusers_fastpath.testing import build_flux2_vae, build_flux_vae, tiny_flux_pipeline
from diffusers_fastpath.testing.checks import state_dict_round_trip

# (32 channels in 8 groups: the joined norm -> SiLU -> convolution takes 32 channels and more, `group_norm_silu_conv`)
BUILDERS = {"flux": lambda: build_flux_vae("flux-tiny", latent_channels=4, block_out_channels=(32,) * 4,
                                           norm_num_groups=8),
            "flux2": lambda: build_flux2_vae("flux2-tiny", block_out_channels=(32,) * 4, norm_num_groups=8)}


def _site_counts(model) -> dict[str, list]:
    """Per op, the (fast, fallback) of each site of `model`'s report, keyed by module path."""
    rows = fp.report(model).sites
    return {r.site: (r.op, r.fast, r.fallback, dict(r.reasons)) for r in rows}  # site: the module path[:name]


def _expected_sites(vae) -> Counter:
    """What the adapter must mark: one group_norm_silu per GroupNorm that a SiLU module follows (the resnets' two, the
    encoder's and decoder's conv_norm_out), one group_norm per other GroupNorm (the mid-block attentions'), and on
    the convolution each pair feeds (the resnets' conv1 and conv2, the conv_out) a group_norm_silu_conv site."""
    resnets = sum(1 for m in vae.modules() if isinstance(m, ResnetBlock2D))
    paired = 2 * resnets + 2
    total = sum(type(m) is nn.GroupNorm for m in vae.modules())
    return Counter({"group_norm_silu": paired, "group_norm": total - paired, "conv_bias": conv_sites(vae),
                    "group_norm_silu_conv": paired, "conv_bias_residual": resnets})


def _joined(sites: dict) -> set[str]:
    """The sites a fast joined norm -> SiLU -> convolution call stands in for (the pair's on the norm, the
    convolution's conv_bias): idle where the joined call ran fast. Every pair of these VAEs is joined (none where a
    VAE has no joined call)."""
    convs = {name.rpartition(":")[0] for name, (op, *_) in sites.items() if op == "group_norm_silu_conv"}
    return {name for name, (op, *_) in sites.items() if (op == "group_norm_silu" and convs) or name in convs}


def _ran_once(name: str, sites: dict, joined: set[str]) -> set[tuple[int, int]]:
    """The (fast, fallback) a site may show after one call: none for the joined calls' idle sites; a resnet's residual
    add (its block's conv_bias_residual) fast where its conv2's signature was checked before (the first call of a
    signature returns the tensor it checks, which the add takes as written, uncounted), refused where the block's
    input is not contiguous (`_residual_refusals_are_layouts`); every other site fast once."""
    if name in joined:
        return {(0, 0)}
    return {(0, 0), (1, 0), (0, 1)} if sites[name][0] == "conv_bias_residual" else {(1, 0)}


def _residual_refusals_are_layouts(sites: dict) -> bool:
    """Every residual add refused was refused for its input's layout: the decoder's mid-block attention leaves the
    stream laid out as its transposed view (aten's add keeps its first operand's strides), up to the first upsampler,
    and eager's sum there is not contiguous, which the kernel's output would be."""
    return all(set(reasons) <= {"residual not contiguous"} for op, _, _, reasons in sites.values()
               if op == "conv_bias_residual")


def conv_sites(vae) -> int:
    """One conv_bias site per plain convolution with a bias (every one of these VAEs')."""
    return sum(type(m) in (nn.Conv2d, nn.Conv3d) and m.bias is not None for m in vae.modules())


def _latents(vae, batch=1, size=8, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vae.config.latent_channels, size, size, generator=gen).to(torch.bfloat16)


def _image(batch=1, size=64, seed=4):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(batch, 3, size, size, generator=gen) * 2 - 1).to(torch.bfloat16)


def _encode(vae, x):
    return vae.encode(x).latent_dist.mean


def _decode(vae, z):
    return vae.decode(z).sample


@pytest.mark.parametrize("family", sorted(BUILDERS))
@torch.no_grad()
def test_patched_vae_decode_and_encode_equal_unpatched_every_site_fast(family, emulated_kernels, unpatch_after):
    vae = BUILDERS[family]()
    z, x = _latents(vae), _image()
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    assert torch.isfinite(ref_dec).all() and ref_dec.float().std() > 0.01
    expected = _expected_sites(vae)
    unpatch_after(fp.patch(vae))
    assert Counter(r.op for r in fp.report(vae).sites) == expected, str(fp.report(vae))
    assert torch.equal(_decode(vae, z), ref_dec)
    sites = _site_counts(vae)
    joined = _joined(sites)
    for name, (op, fast, fallback, _) in sites.items():  # the decoder's sites ran once each, the encoder's not yet
        decoding = name.startswith(("decoder.", "post_quant_conv"))
        assert (fast, fallback) in (_ran_once(name, sites, joined) if decoding else {(0, 0)}), (name, sites[name])
    assert torch.equal(_encode(vae, x), ref_enc)
    sites = _site_counts(vae)
    assert all((fast, fallback) in _ran_once(name, sites, joined) for name, (_, fast, fallback, _) in sites.items()), \
        str(fp.report(vae))
    assert _residual_refusals_are_layouts(sites), str(fp.report(vae, verbose=True))
    # a second decode: every signature checked, each resnet's residual add after the first upsampler takes its conv2's
    # pending result
    assert torch.equal(_decode(vae, z), ref_dec)
    sites = _site_counts(vae)
    after_upsampling = [fast for name, (op, fast, _, _) in sites.items()
                        if op == "conv_bias_residual" and name.startswith("decoder.up_blocks.") and
                        not name.startswith("decoder.up_blocks.0.")]
    assert after_upsampling and all(fast >= 1 for fast in after_upsampling), str(fp.report(vae, verbose=True))
    assert _residual_refusals_are_layouts(sites)


@torch.no_grad()
def test_tiled_and_sliced_decode_and_encode_equal_unpatched(emulated_kernels, unpatch_after):
    """``enable_tiling`` and ``enable_slicing`` run the same blocks per tile and per sample: the same sites, each once
    per tile and sample (tiles whose sizes the kernel takes: a 16x16 latent in 8x8 tiles with a 6-latent stride)."""
    vae = BUILDERS["flux"]()
    vae.enable_tiling()
    vae.enable_slicing()
    vae.tile_sample_min_size, vae.tile_latent_min_size = 64, 8  # 3 x 3 tiles of a 16 x 16 latent (128 x 128 image)
    z, x = _latents(vae, batch=2, size=16), _image(batch=2, size=128)
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref_dec)
    tiles, samples = 9, 2
    sites = _site_counts(vae)
    joined = _joined(sites)
    for name, (op, fast, fallback, _) in sites.items():
        ran = name.startswith("decoder.") and name not in joined
        if op == "conv_bias_residual":  # (uncounted where a signature is checked, refused for a layout: `_ran_once`)
            assert fast + fallback <= (tiles * samples if ran else 0), name
        else:
            assert (fast, fallback) == ((tiles * samples, 0) if ran else (0, 0)), name
    assert torch.equal(_encode(vae, x), ref_enc)
    sites = _site_counts(vae)
    for name, (op, fast, fallback, _) in sites.items():
        if op == "conv_bias_residual":
            assert fast + fallback <= tiles * samples, name
        else:
            assert (fast, fallback) == ((0, 0) if name in joined else (tiles * samples, 0)), name
    assert _residual_refusals_are_layouts(sites)
    assert sum(fast for op, fast, _, _ in sites.values() if op == "conv_bias_residual") > tiles * samples


@torch.no_grad()
def test_unpatch_restores_classes_and_state_dict():
    vae = BUILDERS["flux"]()
    with state_dict_round_trip(vae):
        assert type(vae.decoder).__name__ == "FastpathDecoder"
        assert type(vae.decoder.mid_block.attentions[0].group_norm) is vae_module.FastpathGroupNorm
        assert type(vae.decoder.up_blocks[0].resnets[0]).__name__ == "FastpathResnetBlock2D"
        assert type(vae.decoder.up_blocks[0].resnets[0].norm1) is nn.GroupNorm  # a pair's norm keeps its class


@torch.no_grad()
def test_a_hooked_pair_runs_its_modules_with_their_hooks(emulated_kernels, unpatch_after):
    """A forward hook on a paired norm (or its SiLU) makes the pair run as the two module calls, hooks included."""
    vae = BUILDERS["flux"]()
    z = _latents(vae)
    ref = _decode(vae, z)
    unpatch_after(fp.patch(vae))
    resnet = vae.decoder.mid_block.resnets[0]
    seen = []
    handle = resnet.norm1.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert torch.equal(_decode(vae, z), ref)
    handle.remove()
    site = resnet.norm1._fastpath_site_group_norm_silu
    assert seen and site.fast == 0 and dict(site.fallback) == {"hooks": 1}
    global_seen = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: global_seen.append(type(m)))
    try:
        assert torch.equal(_decode(vae, z), ref)
    finally:
        handle.remove()
    assert nn.GroupNorm in global_seen and dict(site.fallback) == {"hooks": 2}


@torch.no_grad()
def test_patch_of_a_pipeline_patches_its_vae(emulated_kernels, unpatch_after):
    pipe = tiny_flux_pipeline()
    unpatch_after(fp.patch(pipe))
    assert sorted(m.name for m in fp.report(pipe).models) == ["transformer", "vae"]
    assert type(pipe.vae.decoder).__name__ == "FastpathDecoder"


@torch.no_grad()
def test_patched_vae_deep_copies_and_pickles(emulated_kernels):
    vae = BUILDERS["flux"]()
    z = _latents(vae)
    ref = _decode(vae, z)
    fp.patch(vae)
    twin = copy.deepcopy(vae)
    buf = io.BytesIO()
    torch.save(vae, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for model in (twin, loaded):
        assert torch.equal(_decode(model, z), ref)
        sites = _site_counts(model)
        joined = _joined(sites)
        decoder = sum(1 for name in sites if name.startswith(("decoder.", "post_quant_conv")) and name not in joined)
        # (on the copy's own counters; a resnet's residual add fast where its conv2's signature was checked before)
        residual = sum(1 for name, (op, *_) in sites.items() if op == "conv_bias_residual" and name.startswith("decoder."))
        fast = sum(r.fast for r in fp.report(model).sites)
        assert decoder > 22 and decoder - residual <= fast <= decoder
        fp.unpatch(model)
        assert type(model.decoder).__name__ == "Decoder"
    fp.unpatch(vae)


def test_the_pair_rewrite_keeps_every_branch(emulated_kernels):
    """``ResnetBlock2D.forward``'s ``norm2 -> nonlinearity`` pair sits after a three-way ``if``: the activation moves
    into each branch, paired where the branch ends in the norm ("default", else) and as written after the
    scale-shift modulate. A block of each kind, patched == unpatched."""
    (resnet_pairs,) = [b for b in BLOCKS if b.base is ResnetBlock2D]
    assert resnet_pairs.sub._fastpath_pairs == (("norm1", "nonlinearity"), ("norm2", "nonlinearity"))
    with torch.no_grad():
        for kind, temb_channels in (("default", 16), ("scale_shift", 16), ("default", None)):
            block = ResnetBlock2D(in_channels=32, out_channels=32, temb_channels=temb_channels, groups=8,
                                  time_embedding_norm=kind).to(torch.bfloat16).eval()
            x = torch.randn(2, 32, 8, 8).to(torch.bfloat16)
            temb = torch.randn(2, 16).to(torch.bfloat16) if temb_channels else None
            ref = block(x, temb)
            block.__class__ = resnet_pairs.sub
            block.norm1._fastpath_site_group_norm_silu = site = fp.ops.Site("group_norm_silu")
            assert torch.equal(block(x, temb), ref), kind
            assert site.fast == 1


class _OptionalModulateBlock(nn.Module):
    """LTX-2's resnet form: a norm, an ``if`` on the block's own attribute (an optional modulate), the SiLU."""

    def __init__(self, modulate: bool) -> None:
        super().__init__()
        self.norm1, self.nonlinearity = nn.GroupNorm(8, 32), nn.SiLU()
        self.scale = nn.Parameter(torch.randn(32, 1, 1)) if modulate else None

    def forward(self, hidden_states):
        hidden_states = self.norm1(hidden_states)
        if self.scale is not None:
            hidden_states = hidden_states * (1 + self.scale)
        hidden_states = self.nonlinearity(hidden_states)
        return hidden_states * 2


def _test_reads_the_variable(self, hidden_states):
    hidden_states = self.norm1(hidden_states)
    if hidden_states.shape[1] > 64:
        hidden_states = hidden_states * 2
    hidden_states = self.nonlinearity(hidden_states)
    return hidden_states


def _test_calls(self, hidden_states):
    hidden_states = self.norm1(hidden_states)
    if self.check() is not None:
        hidden_states = hidden_states * 2
    hidden_states = self.nonlinearity(hidden_states)
    return hidden_states


def _test_has_elif(self, hidden_states):
    hidden_states = self.norm1(hidden_states)
    if self.scale is not None:
        hidden_states = hidden_states * 2
    elif self.other is None:
        hidden_states = hidden_states * 3
    hidden_states = self.nonlinearity(hidden_states)
    return hidden_states


def test_a_norm_and_its_activation_pair_around_an_if_on_the_blocks_own_attribute(emulated_kernels):
    """``V = self.norm(V)``, ``if self.x is not None: <modulate>``, ``V = self.act(V)`` (LTX-2's resnets): both
    statements move into each branch and pair on the one without the modulate; with the modulate on, the three run
    as written. A test that reads the variable, calls anything or has an ``elif`` is left as it is."""
    fn, pairs = vae_module.rewrite_pairs(_OptionalModulateBlock.forward, "X.forward", ("nonlinearity",))
    assert pairs == (("norm1", "nonlinearity"),)
    sub = type("X", (_OptionalModulateBlock,), {"forward": fn})
    with torch.no_grad():
        for modulate in (False, True):
            block = _OptionalModulateBlock(modulate).to(torch.bfloat16).eval()
            x = torch.randn(2, 32, 8, 8).to(torch.bfloat16)
            ref = block(x)
            block.__class__ = sub
            block.norm1._fastpath_site_group_norm_silu = site = fp.ops.Site("group_norm_silu")
            assert torch.equal(block(x), ref), modulate
            assert site.fast == (0 if modulate else 1)
    for other in (_test_reads_the_variable, _test_calls, _test_has_elif):
        assert vae_module.rewrite_pairs(other, "X.forward", ("nonlinearity",)) is None, other.__name__


class _MovedNormBlock(nn.Module):
    """LTX-Video's form: a channel-last norm of channel-first activations (``norm1``), then the SiLU; beside it the
    forms a moved `PairCalls` leaves as they are."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(16), nn.LayerNorm(16), nn.LayerNorm(16)
        self.nonlinearity = nn.SiLU()

    def forward(self, hidden_states):
        hidden_states = self.norm1(hidden_states.movedim(1, -1)).movedim(-1, 1)
        hidden_states = self.nonlinearity(hidden_states)
        hidden_states = self.norm2(hidden_states.movedim(1, -1)).movedim(-1, 2)  # (not moved back to where it was)
        hidden_states = self.nonlinearity(hidden_states)
        hidden_states = self.norm3(hidden_states)  # (the plain form)
        hidden_states = self.nonlinearity(hidden_states)
        return hidden_states


def test_a_moved_pair_calls_pairs_the_channel_last_norm_statement(emulated_kernels):
    """A `PairCalls` made with ``moved=True`` pairs ``V = self.N(V.movedim(1, -1)).movedim(-1, 1)`` and the activation
    after it, nothing else (the plain form is the default's); its fused op takes the channel-last view and its result
    is moved back; without a site, or unfit, the two modules run as written."""
    seen = []

    def fused(norm, x, site):
        seen.append(x.shape)
        site.fast += 1
        return torch.nn.functional.silu(norm(x))

    calls = vae_module.PairCalls("_test_moved_pairs", "test_pair", lambda norm, act: None, fused, moved=True)
    fn, pairs = vae_module.rewrite_pairs(_MovedNormBlock.forward, "X.forward", ("nonlinearity",), calls)
    assert pairs == (("norm1", "nonlinearity"),)
    assert vae_module.rewrite_pairs(_MovedNormBlock.forward, "X.forward", ("nonlinearity",))[1] == (
        ("norm3", "nonlinearity"),)
    block = _MovedNormBlock().eval()
    x = torch.randn(2, 16, 3, 4, 16)
    with torch.no_grad():
        ref = block(x)
        block.__class__ = type("X", (_MovedNormBlock,), {"forward": fn})
        assert torch.equal(block(x), ref) and not seen  # (no site: the modules as written)
        block.norm1._fastpath_site_test_pair = site = fp.ops.Site("test_pair")
        out = block(x)
    assert torch.equal(out, ref) and out.stride() == ref.stride() and seen == [(2, 3, 4, 16, 16)] and site.fast == 1


_REPLACED_CALLS = []


def _replaced_resnet_forward(self, input_tensor, temb, *args, **kwargs):
    """What another library might install as ``ResnetBlock2D.forward``: the same computation, counting its calls."""
    _REPLACED_CALLS.append(1)
    hidden_states = self.norm1(input_tensor)
    hidden_states = self.nonlinearity(hidden_states)
    hidden_states = self.conv1(hidden_states)
    hidden_states = self.norm2(hidden_states)
    hidden_states = self.nonlinearity(hidden_states)
    hidden_states = self.conv2(hidden_states)
    if self.conv_shortcut is not None:
        input_tensor = self.conv_shortcut(input_tensor)
    return (input_tensor + hidden_states) / self.output_scale_factor


def test_the_rewrite_is_made_from_the_forward_the_class_holds_at_patch(monkeypatch, emulated_kernels):
    """Another library replaced ``ResnetBlock2D.forward`` after this package was imported: the patch rewrites the
    replacement (its own statements run, its pairs fused), not diffusers' file."""
    monkeypatch.setattr(ResnetBlock2D, "forward", _replaced_resnet_forward)
    vae = BUILDERS["flux"]()
    with torch.no_grad():
        z = _latents(vae)
        ref = _decode(vae, z)
        _REPLACED_CALLS.clear()
        fp.patch(vae)
        try:
            assert torch.equal(_decode(vae, z), ref)
            resnet = vae.decoder.mid_block.resnets[0]
            # (the class's forward under `_state.bound_safe`'s wrapper, which keeps ``__wrapped__``)
            assert inspect.unwrap(type(resnet).forward).__code__.co_filename.startswith(
                "<diffusers_fastpath: FastpathResnetBlock2D")
            assert len(_REPLACED_CALLS) == 10  # the replacement's statements, rewritten: once per decoder resnet
            # (its pairs joined with the convolutions after them: the joined calls count on the convolutions)
            assert resnet.conv2._fastpath_site_group_norm_silu_conv.fast == 1
            assert resnet.norm2._fastpath_site_group_norm_silu.fast == 0
        finally:
            fp.unpatch(vae)
    monkeypatch.undo()
    (resnet_pairs,) = [b for b in BLOCKS if b.base is ResnetBlock2D]
    rewritten = linecache.getlines(inspect.unwrap(resnet_pairs.current().forward).__code__.co_filename)
    assert "time_embedding_norm" in "".join(rewritten)  # diffusers' own forward again, rewritten


def test_a_model_patched_before_a_rewrite_of_a_replaced_forward_still_pickles(emulated_kernels):
    """A library replaced ``ResnetBlock2D.forward`` for a while, and a VAE was patched meanwhile: the pair subclass is
    one object, rewritten in place (not a second class under the same name), so a VAE patched before still pickles;
    it runs what the class holds now (the replacement while it is there), and once the original is back, the next
    patch fuses its pairs again (a ``functools.wraps`` wrapper, which cannot be rewritten, does not lose them)."""
    import functools

    vae1, ref = BUILDERS["flux"](), BUILDERS["flux"]()
    z = _latents(vae1)
    original = ResnetBlock2D.forward

    @functools.wraps(original)
    def wrapped(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    with torch.no_grad():
        expected = _decode(ref, z)
        fp.patch(vae1)
        try:
            sites = Counter(r.op for r in fp.report(vae1).sites)
            for replacement in (_replaced_resnet_forward, wrapped):
                ResnetBlock2D.forward = replacement
                try:
                    vae2 = BUILDERS["flux"]()
                    fp.patch(vae2)
                    _REPLACED_CALLS.clear()
                    assert torch.equal(_decode(vae1, z), expected) and torch.equal(_decode(vae2, z), expected)
                    assert len(_REPLACED_CALLS) == (20 if replacement is _replaced_resnet_forward else 0)
                    fp.unpatch(vae2)
                finally:
                    ResnetBlock2D.forward = original
                torch.save(vae1, io.BytesIO())
            vae3 = BUILDERS["flux"]()
            fp.patch(vae3)
            assert Counter(r.op for r in fp.report(vae3).sites) == sites  # the pairs are back
            assert torch.equal(_decode(vae3, z), expected) and torch.equal(_decode(vae1, z), expected)
            fp.unpatch(vae3)
        finally:
            fp.unpatch(vae1)


class Doubled(nn.Module):
    """A parametrization (``torch.nn.utils.parametrize``) that doubles its tensor."""

    def forward(self, w):
        return w * 2


def test_a_parametrized_group_norm_unpatches_to_torchs_class(emulated_kernels):
    from torch.nn.utils import parametrize

    vae, ref_vae = BUILDERS["flux"](), BUILDERS["flux"]()
    z = _latents(vae)
    fp.patch(vae)
    for model in (ref_vae, vae):
        parametrize.register_parametrization(model.decoder.mid_block.attentions[0].group_norm, "weight", Doubled())
    with torch.no_grad():
        ref = _decode(ref_vae, z)
        assert torch.equal(_decode(vae, z), ref)
        fp.unpatch(vae)
        assert torch.equal(_decode(vae, z), ref)
    norm = vae.decoder.mid_block.attentions[0].group_norm
    assert type(norm).__mro__[1] is nn.GroupNorm
    parametrize.remove_parametrizations(norm, "weight")
    assert type(norm) is nn.GroupNorm


def test_bench_vae_level_times_decode_and_encode_without_a_transformer(tmp_path):
    """``--levels vae``: the model's VAE eager and patched, decode and encode, bit-identity per row; no transformer is
    built for it (on a CPU every site falls back, by the device)."""
    import json

    from diffusers_fastpath import bench

    path = tmp_path / "vae.json"
    argv = ["--model", "flux-tiny", "--levels", "vae", "--device", "cpu", "--repeats", "2", "--no-progress"]
    assert bench.main([*argv, "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    vae = result["vae"]
    assert vae["ran"] and vae["vae"] == "AutoencoderKL" and not result["step"]["ran"]
    assert result["conditions"]["weights_gib"] is None  # no transformer
    assert [r["call"] for r in vae["rows"]] == ["decode", "encode"]
    assert all(r["bit_identical"] and r["md5_eager"] == r["md5_patched"] and len(r["eager_ms_all"]) == 2
               for r in vae["rows"])
    # (the bench's VAE: 36 GroupNorm sites, a conv_bias per conv; of 8 channels, no joined call: `group_norm_silu_conv`)
    convs = conv_sites(build_flux_vae("flux-tiny"))
    assert vae["sites"]["sites"] == 36 + convs and vae["sites"]["fast"] == 0
    assert set(vae["sites"]["reasons"]) == {"device cpu"}
    assert bench.main(["--model", "sd3-tiny", "--levels", "vae", "--device", "cpu", "--no-progress", "--json",
                       str(path)]) == 0
    assert "no VAE config of sd3-tiny" in json.loads(path.read_text())["vae"]["reason"]


# --- GPU: the full-size FLUX.1 VAE ---------------------------------------------------------------------------------


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.float().cpu().numpy().tobytes()).hexdigest()


@pytest.mark.gpu
@torch.no_grad()
def test_flux_vae_1024_decode_and_encode_md5_identical_every_site_fast(unpatch_after):
    vae = build_flux_vae("flux-dev", torch.bfloat16, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(1, 16, 128, 128, generator=gen, device="cuda").to(torch.bfloat16)
    x = (torch.rand(1, 3, 1024, 1024, generator=gen, device="cuda") * 2 - 1).to(torch.bfloat16)
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    assert torch.isfinite(ref_dec).all() and ref_dec.float().std() > 0.01
    expected = _expected_sites(vae)  # 50 pairs (24 resnets' two, the two conv_norm_out), 2 attention norms, 62 convs
    unpatch_after(fp.patch(vae))
    dec, enc = _decode(vae, z), _encode(vae, x)
    assert torch.equal(dec, ref_dec) and _md5(dec) == _md5(ref_dec)
    assert torch.equal(enc, ref_enc) and _md5(enc) == _md5(ref_enc)
    report = fp.report(vae)
    assert Counter(r.op for r in report.sites) == expected == Counter({"group_norm_silu": 50, "group_norm": 2,
                                                                       "conv_bias": 62, "group_norm_silu_conv": 50,
                                                                       "conv_bias_residual": 24})
    sites = _site_counts(vae)
    joined = _joined(sites)
    assert all((fast, fallback) in _ran_once(name, sites, joined) for name, (_, fast, fallback, _) in sites.items()), \
        str(report)


@pytest.mark.parametrize("order", ["lora_then_patch", "patch_then_lora"])
@torch.no_grad()
def test_a_peft_lora_on_the_convolutions_stays_exact_and_unpatch_leaves_none_of_this_packages_classes(
        order, emulated_kernels):
    """PEFT's LoRA layers on the VAE's convolutions, injected before or after `patch`: the decode equals the unpatched
    LoRA model's; injected after, PEFT makes its ``lora_A`` / ``lora_B`` of the base layer's class
    (``type(base_layer)(...)``: `FastpathConv2d`), which `patch` gave no site: they run torch's forward, and `unpatch`
    gives them torch's class back (nothing of this package stays on the model)."""
    from peft import LoraConfig, inject_adapter_in_model

    from diffusers_fastpath.models.vae_conv import FastpathConv2d

    vae = BUILDERS["flux"]()
    config = LoraConfig(r=4, lora_alpha=4, target_modules=["conv1", "conv2", "conv_in"], init_lora_weights=False,
                        lora_bias=True)
    ref_model = inject_adapter_in_model(config, copy.deepcopy(vae))
    z = _latents(vae)
    ref = _decode(ref_model, z)
    model = copy.deepcopy(vae)
    if order == "lora_then_patch":
        model = inject_adapter_in_model(config, model)
        model.load_state_dict(ref_model.state_dict())
        fp.patch(model)
    else:
        fp.patch(model)
        model = inject_adapter_in_model(config, model)
        model.load_state_dict(ref_model.state_dict())
    assert torch.equal(_decode(model, z), ref)
    made_by_peft = [m for name, m in model.named_modules() if ".lora_" in name and isinstance(m, nn.Conv2d)]
    if order == "patch_then_lora":  # (before: PEFT's layers are plain convolutions, patched like the others)
        assert made_by_peft and all(vae_conv_sites(m) == 0 for m in made_by_peft)
    fp.unpatch(model)
    assert not [name for name, m in model.named_modules() if isinstance(m, FastpathConv2d)]
    assert torch.equal(_decode(model, z), ref)


def vae_conv_sites(module) -> int:
    return sum(1 for k in vars(module) if k.startswith("_fastpath_site"))
