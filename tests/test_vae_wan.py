"""The Wan / Qwen-Image VAE adapter (models/vae_wan.py) and its ops (ops/channel_rmsnorm_silu.py,
ops/causal_conv_pad.py): tiny bf16 ``AutoencoderKLWan`` (2.1 and 2.2's residual blocks) and
``AutoencoderKLQwenImage``, decode and encode patched == unpatched (``torch.equal``) with every site on its fast path
(on CPU under the emulated kernels), also tiled and sliced; unpatch, state dicts, hooks, copies; the ops' reference
arithmetic against eager. On the GPU: the kernel at Wan's real shapes with poisoned outputs, and the full-size
Wan 2.1 VAE decode, md5-identical with every site fast."""

from __future__ import annotations

import copy
import hashlib
import importlib
import io
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan
from diffusers.models.autoencoders import autoencoder_kl_wan as wan
from torch import nn

import diffusers_fastpath as fp
from diffusers_fastpath.models import vae_wan
causal_conv_pad = importlib.import_module("diffusers_fastpath.ops.causal_conv_pad")  # (ops binds the names to the ops)
crms = importlib.import_module("diffusers_fastpath.ops.channel_rmsnorm_silu")
from diffusers_fastpath.ops._policy import Site, bits
from diffusers_fastpath.testing._common import randomize_
from diffusers_fastpath.testing.checks import state_dict_round_trip

NORMS = (wan.WanRMS_norm, vae_wan.qwen.QwenImageRMS_norm)
CONVS = (wan.WanCausalConv3d, vae_wan.qwen.QwenImageCausalConv3d)
UPSAMPLES = (wan.WanUpsample, vae_wan.qwen.QwenImageUpsample)


def _build(kind: str, dtype=torch.bfloat16, seed=0, base_dim=4):
    """A tiny VAE of each kind with random weights (diffusers zero-initialises nothing here, but the norms' gamma is
    ones and their bias zeros: random, so that every multiply and add of the chain matters): /8 spatial, /4 temporal."""
    common = dict(base_dim=base_dim, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True])
    if kind == "wan":
        vae = AutoencoderKLWan(**common)
    elif kind == "wan2.2":  # the residual down/up blocks (avg_shortcut, DupUp3D), patchified 2x2 input
        vae = AutoencoderKLWan(**{**common, "z_dim": 4}, is_residual=True, patch_size=2, in_channels=12,
                               out_channels=12, decoder_base_dim=base_dim, scale_factor_spatial=16)
    else:
        vae = AutoencoderKLQwenImage(**common)
    randomize_(vae, seed)
    gen = torch.Generator().manual_seed(seed + 1)  # (two builds of one seed are one model)
    with torch.no_grad():  # the norms' gamma around 1 (randomize_ draws small values; their product would vanish)
        for m in vae.modules():
            if isinstance(m, NORMS):
                m.gamma.copy_(1 + 0.25 * torch.randn(m.gamma.shape, generator=gen))
    return vae.to(dtype).eval()


KINDS = ("wan", "wan2.2", "qwen")


def _latents(vae, frames=2, size=4, seed=3, batch=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vae.config.z_dim, frames, size, size, generator=gen).to(torch.bfloat16)


def _video(vae, frames=5, size=4, seed=4, batch=1):
    """A video whose latent is `size` x `size` (the deepest norms then see rows of 16 elements: whole vectors)."""
    size *= getattr(vae.config, "scale_factor_spatial", 8)
    gen = torch.Generator().manual_seed(seed)
    channels = vae.config.in_channels if hasattr(vae.config, "in_channels") else 3
    channels = 3 if channels == 12 else channels  # Wan 2.2 patchifies RGB itself
    return (torch.rand(batch, channels, frames, size, size, generator=gen) * 2 - 1).to(torch.bfloat16)


def _decode(vae, z):
    return vae.decode(z).sample


def _encode(vae, x):
    return vae.encode(x).latent_dist.mean


def _expected_sites(vae) -> Counter:
    """One channel_rmsnorm_silu per norm that the block's SiLU follows (the residual blocks' two, the encoder's and
    decoder's norm_out), one channel_rmsnorm per other norm (the mid-block attentions'), one causal_conv3d per causal
    convolution, one upsample_nearest2x per 2x upsampling of the decoder, one conv_bias per convolution with a bias
    (the causal ones and the plain ones), one causal_conv3d_cl per causal convolution that pads (its channels-last
    path), one conv_bias_residual per residual block (its add of ``conv2``'s pending result)."""
    resnets = sum(type(m).__name__.endswith("ResidualBlock") for m in vae.modules())
    norms = sum(isinstance(m, NORMS) for m in vae.modules())
    convs = sum(isinstance(m, CONVS) for m in vae.modules())
    padding = sum(isinstance(m, CONVS) and any(m._padding) for m in vae.modules())
    upsamples = sum(isinstance(m, UPSAMPLES) for m in vae.modules())
    paired = 2 * resnets + 2
    plain = sum(type(m) in (nn.Conv2d, nn.Conv3d) and m.bias is not None for m in vae.modules())
    return Counter({"channel_rmsnorm_silu": paired, "channel_rmsnorm": norms - paired, "causal_conv3d": convs,
                    "upsample_nearest2x": upsamples, "conv_bias": convs + plain, "causal_conv3d_cl": padding,
                    "conv_bias_residual": resnets})


def _sites(model) -> dict[str, tuple]:
    """Per site: (op, fast, fallback, reasons); a causal convolution's conv_bias site is left out where its
    channels-last site ran fast (that path adds the bias itself: the conv_bias site is its fallback's), and the
    residual blocks' conv_bias_residual sites: their add takes ``conv2``'s pending result from the second call of its
    signature on (a first call returns eager's tensor, checked; the add then runs as written, uncounted), which the
    short calls here may not reach: `test_wan_norm_into_conv` runs calls where each is reached."""
    rows = {r.site: (r.op, r.fast, r.fallback, dict(r.reasons)) for r in fp.report(model).sites}
    folded = {name.rsplit(":", 1)[0] for name, (op, fast, _, _) in rows.items() if op == "causal_conv3d_cl" and fast}
    return {name: row for name, row in rows.items() if row[0] != "conv_bias_residual"
            and not (row[0] == "conv_bias" and name.rsplit(":", 1)[0] in folded and row[1:3] == (0, 0))}


def _every_site_fast(model) -> bool:
    return all(fast > 0 and fallback == 0 for _, fast, fallback, _ in _sites(model).values())


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_patched_vae_decode_and_encode_equal_unpatched_every_site_fast(kind, emulated_kernels, unpatch_after):
    vae = _build(kind)
    z, x = _latents(vae), _video(vae)
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    assert torch.isfinite(ref_dec).all() and ref_dec.float().std() > 0.01 and ref_enc.float().std() > 0.01
    expected = _expected_sites(vae)
    unpatch_after(fp.patch(vae))
    assert Counter(r.op for r in fp.report(vae).sites) == expected, str(fp.report(vae))
    assert torch.equal(_decode(vae, z), ref_dec)
    sites = _site_counts = _sites(vae)
    for name, (op, fast, fallback, reasons) in sites.items():
        if name.startswith("decoder.") or name.startswith("post_quant_conv"):
            assert fast > 0 and fallback == 0, (name, sites[name])
        else:
            assert (fast, fallback) == (0, 0), (name, sites[name])
    assert torch.equal(_encode(vae, x), ref_enc)
    assert _every_site_fast(vae), str(fp.report(vae, verbose=True))
    assert any(op == "causal_conv3d_cl" and fast for op, fast, _, _ in _sites(vae).values())
    del _site_counts


@torch.no_grad()
def test_tiled_and_sliced_decode_and_encode_equal_unpatched(emulated_kernels, unpatch_after):
    """``enable_tiling`` and ``enable_slicing`` run the same modules per tile and per sample: patched == unpatched,
    every site fast (tiles of 64 pixels, 32-pixel stride over a 96 x 96 video: overlapping tiles and blends, the
    latent tiles strided views of the latents, edge tiles of half the size)."""
    vae = _build("wan")
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=32,
                      tile_sample_stride_width=32)
    vae.enable_slicing()
    z, x = _latents(vae, size=12, batch=2, frames=1), _video(vae, size=12, batch=2, frames=1)
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref_dec)
    assert torch.equal(_encode(vae, x), ref_enc)
    report = fp.report(vae)  # (one frame: the encoder's temporal downsampling convolutions are not called)
    assert all(r.fallback == 0 for r in report.sites) and sum(r.fast > 0 for r in report.sites) >= 90, str(report)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["wan", "qwen"])
def test_fp32_vae_patched_equal_unpatched_every_site_fast_but_channels_last(kind, emulated_kernels, unpatch_after):
    """The pipelines keep Wan's VAE in fp32 (its model card): the convolutions' buffers, bias adds and the upsampling
    (copies and one fp32 add: the same kernels for fp32) and the norms (their fp32 tail, its SiLU proven on every fp32
    value) run fused, decode and encode equal to eager; the channels-last path refuses (cuDNN's fp32 engine gave other
    bits channels-last on an H100), counted by dtype."""
    vae = _build(kind, torch.float32)
    z = _latents(vae).float()
    x = torch.rand(1, 3, 5, 32, 32, generator=torch.Generator().manual_seed(4)) * 2 - 1
    ref, ref_enc = _decode(vae, z), _encode(vae, x)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref) and torch.equal(_encode(vae, x), ref_enc)
    rows = _sites(vae)
    assert any(op.startswith("channel_rmsnorm") for op, *_ in rows.values())
    for name, (op, fast, fallback, reasons) in rows.items():
        if op == "causal_conv3d_cl":  # (fp32 channels-last: other bits, H100)
            assert fast == 0 and reasons == {"dtype float32": fallback} and fallback, name
        else:
            assert fast > 0 and fallback == 0, (name, rows[name])


@torch.no_grad()
def test_the_channels_last_signature_reads_tf32_as_torchs_new_api_leaves_it(emulated_kernels, unpatch_after,
                                                                              set_precision):
    """torch >= 2.9 keeps TF32 per op (``torch.backends.cudnn.conv.fp32_precision``); set that way (conv and RNN
    apart), the legacy ``torch.backends.cudnn.allow_tf32`` raises when read. The channels-last path's signature must
    still be read (it ran outside the kernel's try: the error disabled causal_conv3d, bf16 VAEs too), and a change
    of the conv's setting must still change the signature."""
    conv_flags = getattr(torch.backends.cudnn, "conv", None)
    if conv_flags is None or not hasattr(conv_flags, "fp32_precision"):
        pytest.skip("torch without the per-op fp32_precision API")
    from diffusers_fastpath.ops import causal_conv_cl, causal_conv_pad

    set_precision(conv_flags, "ieee")
    vae = _build("wan")
    z = _latents(vae)
    ref = _decode(vae, z)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref)
    assert causal_conv_pad.CAUSAL_CONV3D.disabled is None and causal_conv_cl.CAUSAL_CONV3D_CL.disabled is None
    assert any(op == "causal_conv3d_cl" and fast for op, fast, _, _ in _sites(vae).values())
    conv = next(m for m in vae.modules() if causal_conv_cl.NAMED_SITE in m.__dict__)
    x = torch.zeros(1, conv.in_channels, 2, 4, 4, dtype=conv.weight.dtype)
    key = causal_conv_cl._signature(conv, x)
    set_precision(conv_flags, "tf32")
    assert causal_conv_cl._signature(conv, x) != key


@torch.no_grad()
def test_unpatch_restores_classes_and_state_dict():
    vae = _build("wan")
    with state_dict_round_trip(vae):
        assert type(vae.decoder).__name__ == "FastpathWanDecoder3d"
        assert type(vae.decoder.mid_block.attentions[0].norm) is vae_wan.FastpathWanRMS_norm
        assert type(vae.decoder.mid_block.resnets[0]).__name__ == "FastpathWanResidualBlock"
        assert type(vae.decoder.mid_block.resnets[0].norm1) is wan.WanRMS_norm  # a pair's norm keeps its class
        assert type(vae.decoder.conv_in) is vae_wan.FastpathWanCausalConv3d


@torch.no_grad()
def test_hooks_run_and_refuse_the_pair(emulated_kernels, unpatch_after):
    """A forward hook on a paired norm makes the pair run as the two module calls (hook included); a hook on a
    patched convolution runs (the fused build is the module's own forward), and its site stays fast."""
    vae = _build("wan")
    z = _latents(vae)
    ref = _decode(vae, z)
    unpatch_after(fp.patch(vae))
    resnet = vae.decoder.mid_block.resnets[0]
    seen = []
    handles = [resnet.norm1.register_forward_hook(lambda m, i, o: seen.append("norm")),
               resnet.conv1.register_forward_hook(lambda m, i, o: seen.append("conv"))]
    assert torch.equal(_decode(vae, z), ref)
    for h in handles:
        h.remove()
    site = resnet.norm1._fastpath_site_channel_rmsnorm_silu
    assert "norm" in seen and "conv" in seen and site.fast == 0 and dict(site.fallback) == {"hooks": site.fallback.total()}
    assert resnet.conv1._fastpath_site.fast == seen.count("conv") and not resnet.conv1._fastpath_site.fallback


@torch.no_grad()
def test_patched_vae_deep_copies_and_pickles(emulated_kernels):
    vae = _build("qwen")
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
        assert sum(r.fast for r in fp.report(model).sites) > 0
        fp.unpatch(model)
        assert type(model.decoder).__name__ == "QwenImageDecoder3d"
    fp.unpatch(vae)


@pytest.mark.parametrize("how", ["replaced", "wrapped"])
def test_a_replaced_norm_forward_is_left_unpatched(how, monkeypatch, emulated_kernels, fastpath_log):
    """Another library replaced ``WanRMS_norm.forward`` (with other code, or with a ``functools.wraps`` wrapper whose
    ``inspect.getsource`` is the original's): not provably the checked code, so the norms keep their class and get
    no site (one warning), and what the class holds runs (the wrapper's calls counted)."""
    import functools

    original, calls = wan.WanRMS_norm.forward, []

    def replaced(self, x):
        return F.normalize(x.float(), dim=1).to(x.dtype) * self.gamma  # no scale: another computation

    @functools.wraps(original)
    def wrapped(self, x):
        calls.append(1)
        return original(self, x)

    monkeypatch.setattr(wan.WanRMS_norm, "forward", replaced if how == "replaced" else wrapped)
    vae = _build("wan")
    z = _latents(vae)
    with torch.no_grad():
        ref = _decode(vae, z)
        eager_calls = len(calls)
        fp.patch(vae)
        try:
            assert torch.equal(_decode(vae, z), ref)
            assert len(calls) == 2 * eager_calls  # (0 == 0 for the replacement)
            assert not [r for r in fp.report(vae).sites if r.op.startswith("channel_rmsnorm")]
            assert any(r.op == "causal_conv3d" and r.fast for r in fp.report(vae).sites)
        finally:
            fp.unpatch(vae)
    assert "WanRMS_norm.forward is not the form" in fastpath_log.text


@pytest.mark.parametrize("when", ["before_patch", "after_patch"])
def test_a_torch_forward_replaced_on_a_parent_class_runs(when, emulated_kernels):
    """``nn.Upsample.forward`` (which ``WanUpsample.forward`` calls) replaced on torch's class by another library,
    before or after `patch`: the upsampling runs it (`_policy.forward_replaced`: the fused 2x nearest, which never
    calls it, would stand in for it); the decode equals unpatched with the same replacement."""
    def bilinear(self, x):
        return F.interpolate(x, scale_factor=self.scale_factor, mode="bilinear", align_corners=False)

    vae, ref_vae = _build("wan"), _build("wan")
    z = _latents(vae)

    def upsampled() -> int:
        return sum(r.fast for r in fp.report(vae).sites if r.op == "upsample_nearest2x")

    original = nn.Upsample.forward
    with torch.no_grad():
        try:
            if when == "after_patch":
                fp.patch(vae)
                _decode(vae, z)
            nn.Upsample.forward = bilinear
            ref = _decode(ref_vae, z)
            fp.patch(vae)
            fast = upsampled()
            assert torch.equal(_decode(vae, z), ref) and upsampled() == fast  # (none ran fused)
            nn.Upsample.forward = original
            assert torch.equal(_decode(vae, z), _decode(ref_vae, z))  # put back: the fused upsampling again
            assert upsampled() > fast
        finally:
            nn.Upsample.forward = original
            fp.unpatch(vae)


def test_a_parametrization_registered_after_patch(emulated_kernels):
    """``weight_norm`` (any ``torch.nn.utils.parametrize``) on a patched causal convolution and a parametrized
    ``gamma`` of a patched norm: torch gives each module a subclass of this package's class; they run diffusers'
    forward (the fallback finds it through the MRO instead of recursing into the fused forward), and `unpatch`
    leaves torch's parametrized class over diffusers' one, which torch's removal unwraps."""
    from test_vae import Doubled
    from torch.nn.utils import parametrizations, parametrize

    vae, ref_vae = _build("wan"), _build("wan")
    z = _latents(vae)
    for model in (ref_vae, vae):
        if model is vae:
            fp.patch(vae)
        parametrizations.weight_norm(model.decoder.conv_out)
        parametrize.register_parametrization(model.decoder.mid_block.attentions[0].norm, "gamma", Doubled())
    with torch.no_grad():
        ref = _decode(ref_vae, z)
        assert torch.equal(_decode(vae, z), ref)
        fp.unpatch(vae)
        assert torch.equal(_decode(vae, z), ref)
    for module in (vae.decoder.conv_out, vae.decoder.mid_block.attentions[0].norm):
        assert not any(c.__module__.startswith("diffusers_fastpath") for c in type(module).__mro__)
    parametrize.remove_parametrizations(vae.decoder.conv_out, "weight")
    assert type(vae.decoder.conv_out) is wan.WanCausalConv3d


@pytest.mark.parametrize("model", ["wan-tiny", "qwen-image-tiny"])
def test_bench_vae_level_builds_wan_and_qwen_vaes(model, tmp_path):
    """``--levels vae`` for the step-level models' VAEs (the published configs' classes, random weights): decode and
    encode bit-identical, every site counted (on a CPU each falls back, by the device)."""
    import json

    from diffusers_fastpath import bench

    path = tmp_path / "vae.json"
    assert bench.main(["--model", model, "--levels", "vae", "--device", "cpu", "--repeats", "1", "--no-progress",
                       "--height", "32", "--width", "32", "--frames", "5", "--json", str(path)]) == 0
    vae = json.loads(path.read_text())["vae"]
    assert vae["ran"] and vae["vae"] == ("AutoencoderKLWan" if model == "wan-tiny" else "AutoencoderKLQwenImage")
    frames = [("decode", 2), ("encode", 5)] if model == "wan-tiny" else [("decode", 1), ("encode", 1)]  # Wan: 4x
    assert [(r["call"], r["input_shape"][2]) for r in vae["rows"]] == frames
    assert all(r["bit_identical"] for r in vae["rows"])
    assert vae["sites"]["sites"] > 40 and set(vae["sites"]["reasons"]) == {"device cpu"}


# --- the ops alone --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("images,bias", [(False, False), (True, False), (False, True)])
def test_channel_rmsnorm_arithmetic_equals_the_module_then_silu(dtype, images, bias):
    """The kernel's rounding points, written in torch, equal eager (the module, then ``F.silu``) on a CPU, with random
    gamma and bias, fresh random inputs including large and tiny rows (norms clamped at eps), a python-float bias and
    a tensor one."""
    norm = wan.WanRMS_norm(24, images=images, bias=bias)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        norm.gamma.copy_(torch.randn(norm.gamma.shape, generator=gen) * 2)
        if bias:
            norm.bias.copy_(torch.randn(norm.bias.shape, generator=gen))
    norm = norm.to(dtype)
    shape = (2, 24, 4, 8) if images else (2, 24, 3, 4, 8)
    x = (torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[-1])).to(dtype)
    x[0, :, 0] = 0  # rows of zeros: the norm clamps to eps, 0 / eps
    with torch.no_grad():
        for silu in (False, True):
            ref = norm(x)
            ref = F.silu(ref) if silu else ref
            out = crms.channel_rmsnorm_arithmetic(x, crms.denominator(x), norm.gamma, norm.bias, norm.scale, silu)
            assert torch.equal(out, ref), silu


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernel_wrapper_lays_rows_out_as_eager(dtype, monkeypatch):
    """`_kernel` hands the launch ``[rows, C, spatial]`` memory (x contiguous, or time-major as the upsamplers leave
    it: ``B * T`` rows) with the denominator in the same row order, and returns eager's layout: the launch replaced
    by the kernel's arithmetic on exactly those rows, the result equals the module's, strides included."""
    def launch(x, denom, gamma, bias, scale, bias_value, silu, probe):  # bindings.cpp's view: [B, C, *] as [B, C, S]
        rows = x.view(x.shape[0], x.shape[1], -1)
        assert x.is_contiguous() and denom.is_contiguous() and denom.numel() == rows.shape[0] * rows.shape[2]
        assert gamma.shape == (x.shape[1],) and not probe
        out = crms.channel_rmsnorm_arithmetic(rows, denom.view(rows.shape[0], 1, rows.shape[2]), gamma.view(-1, 1),
                                              bias_value if bias is None else bias.view(-1, 1), scale, silu)
        return out.view(x.shape)

    monkeypatch.setattr(crms, "_raw", launch)
    norm = wan.WanRMS_norm(16, images=False)
    norm.gamma.data.normal_(1, 0.5)
    norm = norm.to(dtype)
    base = torch.randn(2, 3, 16, 4, 8).to(dtype)
    one_frame = torch.randn(1, 1, 16, 4, 8).to(dtype).transpose(1, 2)  # contiguous, T's stride C * H * W
    last = torch.randn(2, 3, 4, 8, 16).to(dtype)  # channels-last memory: HunyuanVideo-1.5's mid-block
    for x in (base.transpose(1, 2), base.transpose(1, 2).contiguous(), one_frame,  # time-major, contiguous, T = 1
              last.permute(0, 4, 1, 2, 3), last[:1].permute(0, 4, 1, 2, 3), last[:1, :1].clone(memory_format=torch.contiguous_format).permute(0, 4, 1, 2, 3),
              last[:, :, :1].contiguous().permute(0, 4, 1, 2, 3), last[:1, :, :, :1].contiguous().permute(0, 4, 1, 2, 3),
              last[:, :1, :1].contiguous().permute(0, 4, 1, 2, 3)):  # (sliced ones keep strides the guard refuses)
        for silu in (False, True):
            ref = norm(x)
            ref = F.silu(ref) if silu else ref
            out = crms._kernel(norm, x, silu)
            assert out.shape == ref.shape and out.stride() == ref.stride() and torch.equal(out, ref)


@torch.no_grad()
def test_channels_last_x_the_guard_admits_gets_eager_strides(monkeypatch):
    """Channels-last x whose size-1 dimensions carry strides of their own (any stride is valid there): where the
    guard admits x (it reaches the device check), the kernel's result has eager's strides. aten's TensorIterator (CPU
    and CUDA alike) keeps such strides through the norm's multiply; a meta run (torch's Python meta kernels, which
    place size-1 dimensions by another rule) does not, so it cannot stand for eager. And a channels-last x with
    H = W = 1 also reads as time-major: its SiLU result must still have eager's (x's) strides."""
    def launch(x, denom, gamma, bias, scale, bias_value, silu, probe):
        rows = x.view(x.shape[0], x.shape[1], -1)
        out = crms.channel_rmsnorm_arithmetic(rows, denom.view(rows.shape[0], 1, rows.shape[2]), gamma.view(-1, 1),
                                              bias_value if bias is None else bias.view(-1, 1), scale, silu)
        return out.view(x.shape)

    monkeypatch.setattr(crms, "_raw", launch)
    crms.add_norm_class(wan.WanRMS_norm)
    image_norm = wan.WanRMS_norm(2, images=True).to(torch.bfloat16)
    video_norm = wan.WanRMS_norm(3, images=False).to(torch.bfloat16)
    storage = torch.randn(64).to(torch.bfloat16)
    cases = [(image_norm, storage.as_strided((1, 2, 1, 3), (1, 1, 1, 2))),  # B, H of size 1, strides 1
             (image_norm, storage.as_strided((1, 2, 2, 1), (5, 1, 2, 7))),
             (video_norm, torch.randn(2, 2, 1, 1, 3).to(torch.bfloat16).movedim(-1, 1))]  # [B, T, H, W, C], H = W = 1
    for norm, x in cases:
        if crms._guard(norm, x) != "device cpu":
            continue  # refused: eager runs
        for silu in (False, True):
            ref = norm(x)
            ref = F.silu(ref) if silu else ref
            out = crms._kernel(norm, x, silu)
            assert out.stride() == ref.stride() and torch.equal(out, ref), (tuple(x.shape), x.stride(), silu)


def _probe_launch(planted: int | None = None, way: str = "vectors", seen: list | None = None):
    """A stand-in for the kernel's launch in its probe mode (y = x, then the SiLU): eager's SiLU, with the result for
    the bit pattern `planted` one ulp off where the kernel runs `way` (16-byte vectors: rows of a multiple of 4 fp32
    values; elements: other rows)."""
    def raw(x, denom, gamma, bias, scale, bias_value, silu, probe):
        assert probe and silu and x.dtype == torch.float32 and denom.numel() == x.numel() and x.dim() == 3
        vectors = x.shape[-1] % 4 == 0
        if seen is not None:
            seen.append((vectors, bits(x).flatten().clone()))
        out = F.silu(x)
        if planted is not None and way == ("vectors" if vectors else "elements"):
            bits(out)[bits(x) == planted] += 1
        return out
    return raw


@pytest.mark.parametrize("planted, way", [
    (None, "vectors"), (0x3F800005, "vectors"), (0x3F800005, "elements"), (0x7F800005, "vectors"),
    (0x7F800005, "elements"), (0x3F900000, "vectors"), (0x3F800000 + 1100, "elements"),
    (0x7F800000 + 100, "elements"), (0x3F800000 + 1100, "vectors")], ids=str)
def test_the_fp32_silu_proof_checks_every_value_of_its_span_both_ways(planted, way, monkeypatch):
    """`_prove_silu_fp32` over a span of bit patterns (on the GPU it runs all 2^32: the GPU test below) compares every
    value's SiLU both ways the kernel runs: one pattern one ulp off, in vectors or in elements (the row of one more
    value), a NaN's payload included, in the first chunk, a later one or the last (shorter) one, fails it; a pattern
    outside the span does not; every pattern of the span is seen once by the vector way and by the element way,
    across chunk boundaries and a last chunk shorter than the others."""
    seen, starts = [], (0x3F800000 - 1000, 0x7F800000 - 1000)  # around 1.0; the infinity and the NaNs after it
    monkeypatch.setattr(crms, "_raw", _probe_launch(planted, way, seen))
    for start in starts:
        inside = planted is not None and start <= planted < start + 2500
        assert crms._prove_silu_fp32(torch.device("cpu"), start, start + 2500, chunk=1024) is not inside
    span = torch.cat([torch.arange(s, s + 2500, dtype=torch.int32) for s in starts])
    assert torch.equal(torch.cat([row for vectors, row in seen if vectors]), span)
    elements = [row for vectors, row in seen if not vectors]  # (each the chunk and its first value again)
    assert torch.equal(torch.cat([row[:-1] for row in elements]), span) and all(row[-1] == row[0] for row in elements)


def test_the_fp32_proof_runs_once_per_device_and_a_failure_is_not_remembered(monkeypatch):
    calls = []
    monkeypatch.setattr(crms, "_FP32_PROVEN", set())
    monkeypatch.setattr(crms, "_prove_silu_fp32", lambda device: calls.append(device) or len(calls) > 1)
    x = torch.zeros(1, 4, 8)
    assert not crms._prove_silu(None, x) and crms._prove_silu(None, x) and crms._prove_silu(None, x)
    assert calls == [x.device, x.device]


@torch.no_grad()
def test_channel_rmsnorm_guard_refuses_what_the_kernel_does_not_take():
    crms.add_norm_class(wan.WanRMS_norm)
    norm = wan.WanRMS_norm(16, images=False).to(torch.bfloat16)
    x = torch.randn(1, 16, 2, 4, 8).to(torch.bfloat16)
    assert crms._guard(norm, x) == "device cpu"
    assert crms._guard(norm, x.double()) == "dtype float64"
    assert crms._guard(norm, x.float()) == "gamma not of x's dtype"  # (an fp32 x with fp32 gamma: an fp32 VAE, taken)
    assert crms._guard(copy.deepcopy(norm).float(), x.float()) == "device cpu"
    assert crms._guard(norm, x[..., :7]) == "x not contiguous"
    assert crms._guard(norm, x.permute(0, 2, 3, 4, 1).contiguous().permute(0, 4, 1, 2, 3)) == "device cpu"
    assert crms._guard(norm, x.contiguous(memory_format=torch.channels_last_3d)[..., :7]) == "x not contiguous"
    last = x.permute(0, 2, 3, 4, 1).contiguous()[:, :1].permute(0, 4, 1, 2, 3)  # one frame sliced: B's stride 2 frames'
    assert crms._guard(norm, last) == "x not contiguous"
    assert crms._guard(norm, x[:, :, :1, :, :3].contiguous()) == "device cpu"  # any trailing size (elements)
    assert crms._guard(norm, x[:, :, :0]) == "empty"
    assert crms._guard(norm, x.view(1, 16, 64)) == "gamma does not broadcast over x's channels"
    assert crms._guard(nn.LayerNorm(16), x).endswith("is not a checked channel RMS norm")
    norm.channel_first = False
    assert crms._guard(norm, x) == "not channel first"


@torch.no_grad()
def test_padded_input_equals_cat_then_pad(monkeypatch):
    """The one-buffer input (its kernel's arithmetic, `pad_arithmetic`, on a CPU) equals ``F.pad(torch.cat([cache_x,
    x], 2), padding)`` bit for bit, layout included: the 3x3x3 convolution with no cache, one cached frame, two; the
    time convolution (3, 1, 1); a 1x1x1 (x itself, no launch)."""
    launched = []
    monkeypatch.setattr(causal_conv_pad, "_launch",
                        lambda *args: launched.append(args) or causal_conv_pad.pad_arithmetic(*args))
    causal_conv_pad.add_conv_class(wan.WanCausalConv3d)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, 3, 5, 8, generator=gen).to(torch.bfloat16)
    for conv, frames in ((wan.WanCausalConv3d(6, 6, 3, padding=1), (None, 1, 2)),
                         (wan.WanCausalConv3d(6, 12, (3, 1, 1), padding=(1, 0, 0)), (None, 1, 2)),
                         (wan.WanCausalConv3d(6, 6, 1), (None, 2))):
        for t in frames:
            cache = None if t is None else torch.randn(2, 6, t, 5, 8, generator=gen).to(torch.bfloat16)
            padding = list(conv._padding)
            ref = x
            if cache is not None and padding[4] > 0:
                ref = torch.cat([cache, x], dim=2)
                padding[4] -= t
            ref = F.pad(ref, padding)
            count = len(launched)
            out = causal_conv_pad.padded_input(conv, x, cache)
            assert out.shape == ref.shape and out.stride() == ref.stride() and torch.equal(out, ref)
            assert causal_conv_pad._guard(conv, x, cache) == "device cpu"
            assert (out is x) == (len(launched) == count) == (conv.kernel_size == (1, 1, 1))


@torch.no_grad()
def test_causal_conv3d_equals_the_module(emulated_kernels):
    causal_conv_pad.add_conv_class(wan.WanCausalConv3d)
    conv = randomize_(wan.WanCausalConv3d(6, 8, 3, padding=1), 1).to(torch.bfloat16)
    x, cache = torch.randn(1, 6, 2, 8, 8).to(torch.bfloat16), torch.randn(1, 6, 2, 8, 8).to(torch.bfloat16)
    site = Site("causal_conv3d")
    for c in (None, cache, cache[:, :, -1:].contiguous()):
        assert torch.equal(causal_conv_pad.causal_conv3d(conv, x, c, site), conv(x, c))
    assert site.fast == 3 and not site.fallback
    strided = torch.randn(1, 6, 4, 8, 8).to(torch.bfloat16)[:, :, 1:3, :, :7]  # a time slice, cropped: strided rows
    assert torch.equal(causal_conv_pad.causal_conv3d(conv, strided, cache[..., :7], site), conv(strided, cache[..., :7]))
    assert site.fast == 4 and not site.fallback
    x_cl = x.contiguous(memory_format=torch.channels_last_3d)
    assert torch.equal(causal_conv_pad.causal_conv3d(conv, x_cl, cache, site), conv(x_cl, cache))
    assert dict(site.fallback) == {"x of a channels-last layout": 1}


def test_causal_conv3d_channels_last_guard_and_its_other_ways(monkeypatch):
    """`causal_conv_cl`'s guard beyond the one-buffer guard it starts with (taken as passing here: a CPU), and the
    kernel's ways out where cuDNN is not the backend or its result is not channels-last: each the module's numbers."""
    causal_conv_cl = importlib.import_module("diffusers_fastpath.ops.causal_conv_cl")
    causal_conv_pad.add_conv_class(wan.WanCausalConv3d)
    monkeypatch.setattr(causal_conv_cl._pad, "_guard", lambda *args, **kwargs: None)
    conv = randomize_(wan.WanCausalConv3d(4, 8, 3, padding=1), 3).to(torch.bfloat16)
    x = torch.randn(1, 4, 2, 8, 8).to(torch.bfloat16)
    assert causal_conv_cl._guard(conv, x) == "not patched"
    conv.__dict__[causal_conv_cl.NAMED_SITE] = Site("causal_conv3d_cl")
    assert causal_conv_cl._guard(conv, x) is None
    flat = wan.WanCausalConv3d(4, 8, 1).to(torch.bfloat16)  # pads nothing: x itself goes to the convolution
    flat.__dict__[causal_conv_cl.NAMED_SITE] = Site("causal_conv3d_cl")
    assert causal_conv_cl._guard(flat, x) == "nothing padded"
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert causal_conv_cl._guard(conv, x) == "cudnn.benchmark on"
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    bias = conv.bias
    conv.bias = None
    assert causal_conv_cl._guard(conv, x) == "no bias"
    conv.bias = nn.Parameter(bias.float())
    assert causal_conv_cl._guard(conv, x) == "mixed dtypes"
    conv.bias = bias
    monkeypatch.setattr(conv, "padding_mode", "reflect")
    assert causal_conv_cl._guard(conv, x) == "padding mode"
    monkeypatch.setattr(conv, "padding_mode", "zeros")
    monkeypatch.setattr(causal_conv_pad, "_launch", causal_conv_pad.pad_arithmetic)
    cache = torch.randn(1, 4, 2, 8, 8).to(torch.bfloat16)
    ref = conv(x, cache)
    monkeypatch.setattr(causal_conv_cl, "_backend", lambda *args: torch._C._ConvBackend.Slow3d)  # not cuDNN
    assert torch.equal(causal_conv_cl._kernel(conv, x, cache), ref)
    monkeypatch.setattr(causal_conv_cl, "_backend", lambda *args: torch._C._ConvBackend.Cudnn)
    monkeypatch.setattr(causal_conv_cl, "_convolution", lambda c, padded, padding: c._conv_forward(
        padded.contiguous(), c.weight, None))  # a channels-first result: aten's own bias add
    out = causal_conv_cl._kernel(conv, x, cache)
    assert out.is_contiguous() and torch.equal(out, nn.Conv3d._conv_forward(
        conv, causal_conv_pad.pad_arithmetic(x, cache, list(conv._padding)), conv.weight, None).add_(
        conv.bias.reshape(1, -1, 1, 1, 1)))


def _patched_causal_conv(cin=4, cout=8, seed=3):
    """A Wan causal convolution (3x3x3, padded) with the sites `vae_conv.causal_conv_site` gives it: its forward is
    `causal_conv3d`, which hands the channels-last path `causal_conv_cl` the call first."""
    from diffusers_fastpath._state import SITE_ATTR

    causal_conv_cl = importlib.import_module("diffusers_fastpath.ops.causal_conv_cl")
    causal_conv_pad.add_conv_class(wan.WanCausalConv3d)
    conv = randomize_(wan.WanCausalConv3d(cin, cout, 3, padding=1), seed).to(torch.bfloat16)
    conv.__class__ = vae_wan.CONVS[wan.WanCausalConv3d]
    sites = {SITE_ATTR: Site("causal_conv3d"), causal_conv_cl.NAMED_SITE: Site("causal_conv3d_cl"),
             "_fastpath_site_conv_bias": Site("conv_bias")}
    conv.__dict__.update(sites)
    return conv, sites, causal_conv_cl


@torch.no_grad()
def test_causal_conv3d_channels_last_guard_runs_its_own_checks_under_emulation(emulated_kernels, monkeypatch):
    """The CPU tests' emulation takes a guard's "device cpu" for a pass; `causal_conv_cl`'s guard returned the
    one-buffer guard's "device cpu" before its own checks, so under `emulated_kernels` none of them ran (cudnn.benchmark
    on, a mixed-dtype bias, ...: the channels-last path still ran fast) and the CPU tests of the wiring could not see
    them."""
    conv, sites, causal_conv_cl = _patched_causal_conv()
    x = torch.randn(1, 4, 2, 8, 8).to(torch.bfloat16)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert torch.equal(conv(x), wan.WanCausalConv3d.forward(conv, x))
    site = sites[causal_conv_cl.NAMED_SITE]
    assert site.fast == 0 and dict(site.fallback) == {"cudnn.benchmark on": 1}
    assert causal_conv_cl._guard(conv, x) == "cudnn.benchmark on"  # (the real guard, on a CPU x)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    assert causal_conv_cl._guard(conv, x) == "device cpu"


@torch.no_grad()
def test_causal_conv3d_channels_last_keeps_eager_layout_for_a_channels_last_weight(emulated_kernels):
    """A VAE moved to ``memory_format=torch.channels_last_3d`` has channels-last weights: eager's convolution of the
    contiguous padded input then returns a channels-last result (cuDNN's suggested format follows the weight, as the
    CPU's does), with its bias added in place. The channels-last path always returned a contiguous tensor: the same
    values (the first-call ``torch.equal`` check does not see strides), another layout than eager's."""
    conv, sites, causal_conv_cl = _patched_causal_conv()
    conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last_3d)
    x, cache = torch.randn(1, 4, 2, 8, 8).to(torch.bfloat16), torch.randn(1, 4, 2, 8, 8).to(torch.bfloat16)
    ref = wan.WanCausalConv3d.forward(conv, x, cache)
    assert not ref.is_contiguous()  # (eager's layout here: channels-last, the weight's)
    out = conv(x, cache)
    assert out.stride() == ref.stride() and torch.equal(out, ref)


@torch.no_grad()
def test_causal_conv3d_a_wrong_input_raises_eagers_error_and_disables_nothing(emulated_kernels):
    """x of another channel count than the weight's: eager raises its error, and the fused ops stay on. Before, the
    error came from inside the kernels (the backend query of `causal_conv_cl`, the fallback convolution of
    `causal_conv3d`), which `FusedOp` takes for a kernel failure: both ops were disabled for the process, so one
    mistaken call (a notebook's) left every later decode on eager's path."""
    conv, sites, causal_conv_cl = _patched_causal_conv()
    wrong = torch.randn(1, 6, 2, 8, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError):
        conv(wrong)
    assert causal_conv_cl.CAUSAL_CONV3D_CL.disabled is None and causal_conv_pad.CAUSAL_CONV3D.disabled is None
    flat = randomize_(wan.WanCausalConv3d(4, 8, 1), 2).to(torch.bfloat16)  # pads nothing: x itself is convolved
    flat.__class__ = vae_wan.CONVS[wan.WanCausalConv3d]
    with pytest.raises(RuntimeError):
        flat(wrong)
    assert causal_conv_cl.CAUSAL_CONV3D_CL.disabled is None and causal_conv_pad.CAUSAL_CONV3D.disabled is None
    x = torch.randn(1, 4, 2, 8, 8).to(torch.bfloat16)
    assert torch.equal(conv(x), wan.WanCausalConv3d.forward(conv, x))
    assert sites[causal_conv_cl.NAMED_SITE].fast == 1
    assert causal_conv_pad._guard(conv, wrong) == causal_conv_pad._guard(flat, wrong) == "shape"



def test_causal_conv3d_channels_last_signature_names_the_device_and_determinism(monkeypatch):
    """One torch.equal check vouches for a signature: it must name all that cuDNN's engine choice depends on. The
    engine comes from cuDNN's heuristics per GPU (a process with two kinds of GPU: one check on cuda:0 vouched for
    cuda:1) and, in deterministic mode (``torch.use_deterministic_algorithms`` / ``cudnn.deterministic``), from the
    deterministic engines only: a signature verified with the mode off vouched for the channels-last engine with it
    on, an engine choice nobody compared with the channels-first one."""
    causal_conv_cl = importlib.import_module("diffusers_fastpath.ops.causal_conv_cl")
    conv = wan.WanCausalConv3d(4, 8, 3, padding=1).to(torch.bfloat16)
    x = torch.randn(1, 4, 2, 8, 8).to(torch.bfloat16)
    key = causal_conv_cl._signature(conv, x)
    assert causal_conv_cl._signature(conv, x.to("meta")) != key  # another device
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    assert causal_conv_cl._signature(conv, x) != key
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    assert causal_conv_cl._signature(conv, x) == key
    torch.use_deterministic_algorithms(True)
    try:
        assert causal_conv_cl._signature(conv, x) != key
    finally:
        torch.use_deterministic_algorithms(False)

def test_nvrtc_launcher_passes_what_bindings_cpp_passes(monkeypatch):
    """The NVRTC launcher's arguments, field by field, as bindings.cpp's channel_rmsnorm fills them, and the .cu's
    grid (one thread per 16-byte vector, at most kBlocksPerSm blocks per SM); the driver call captured on CPU."""
    from test_nvrtc import captured_launches  # noqa: F401 - the fixture's body, called directly below

    launches = captured_launches.__wrapped__(monkeypatch)
    x, gamma = torch.randn(2, 16, 3, 4, 8).to(torch.bfloat16), torch.randn(16).to(torch.bfloat16)
    denom, bias = torch.rand(2, 1, 3, 4, 8) + 1, torch.randn(16).to(torch.bfloat16)
    out = crms._nvrtc_kernel(x, denom, gamma, None, 4.0, 0.5, True, False)
    kernel, key, grid, block, a = launches[-1]
    assert (kernel, key, block) == (crms._NVRTC, (torch.bfloat16, True), (256, 1, 1)) and out.shape == x.shape
    assert grid == (2, 1, 1)  # 2 * 16 * 96 / 8 = 384 vectors: two blocks of 256 threads, below the resident limit
    assert (a.a.out, a.a.x, a.a.denom, a.a.gamma, a.a.bias) == (out.data_ptr(), x.data_ptr(), denom.data_ptr(),
                                                                gamma.data_ptr(), None)  # NULL
    assert (a.a.batch, a.a.channels, a.a.spatial, a.a.scale, a.a.bias_value, a.a.silu, a.a.probe, a.a.dtype) == (
        2, 16, 96, 4.0, 0.5, 1, 0, 1)
    crms._nvrtc_kernel(x.half(), denom, gamma.half(), bias.half(), 2.0, 0.0, False, True)
    _, key, _, _, a = launches[-1]
    assert key == (torch.float16, True) and (a.a.silu, a.a.probe, a.a.dtype) == (0, 1, 0) and a.a.bias
    # trailing sizes of no 8 multiple (Qwen-Image's 166x166 latents): the element kernel, one thread per element
    odd = torch.randn(1, 16, 1, 6, 5).to(torch.bfloat16)
    crms._nvrtc_kernel(odd, torch.rand(1, 1, 1, 6, 5) + 1, gamma, None, 1.0, 0.0, False, False)
    _, key, grid, _, a = launches[-1]
    assert key == (torch.bfloat16, False) and grid == (2, 1, 1) and a.a.spatial == 30  # 480 elements: two blocks
    big = torch.empty(1, 8, 132 * 8 * 256 * 8 * 2, dtype=torch.bfloat16)
    crms._nvrtc_kernel(big, torch.empty(1, 1, big.shape[2]), torch.ones(8, dtype=torch.bfloat16), None, 1.0, 0.0,
                       False, False)
    assert launches[-1][2] == (132 * 8, 1, 1)


def test_causal_pad_nvrtc_launch_arguments(monkeypatch):
    """The NVRTC way's launch of csrc/causal_pad.cu: the output's shape, a thread per output column of a row (b, c, t,
    h), x's and the cache's strides, the time padding without the cache's frames; the constants the .cu has."""
    import re
    from pathlib import Path

    launches = []
    monkeypatch.setattr(causal_conv_pad._NVRTC, "launch", lambda *args: launches.append(args))
    source = (Path(causal_conv_pad.__file__).parents[2] / "csrc" / "causal_pad.cu").read_text()
    assert [int(re.search(rf"constexpr int {n} = (\d+);", source).group(1)) for n in ("kThreads", "kMaxRowBlocks")] == [
        causal_conv_pad._THREADS, causal_conv_pad._MAX_ROW_BLOCKS]
    x = torch.randn(2, 6, 5, 9, 300).to(torch.bfloat16)[:, :, 1:4]  # a time slice: strided frames
    cache = torch.randn(2, 6, 1, 9, 300).to(torch.bfloat16)
    out = causal_conv_pad._nvrtc_kernel(x, cache, [1, 1, 1, 1, 2, 0])
    (device, key, grid, block, *args), = launches
    assert out.shape == (2, 6, 5, 11, 302) and out.is_contiguous() and key == torch.bfloat16
    assert grid == (2, 2 * 6 * 5 * 11, 1) and block == (256, 1, 1)
    assert args == [out.data_ptr(), x.data_ptr(), cache.data_ptr(), 2, 6, 3, 9, 300, 1, 1, 0, 1, 1, 1, 1,
                    *x.stride()[:4], *cache.stride()[:4], 1, False, False, False]
    causal_conv_pad._nvrtc_kernel(x.half(), None, [0, 0, 0, 0, 2, 0])
    (_, key, grid, _, *args) = launches[-1]
    assert key == torch.float16 and grid == (2, 2 * 6 * 5 * 9, 1) and args[2] == 0 and args[8:11] == [0, 2, 0]
    # channels-last: the tiled kernel, a 32 x 8 block per 32 columns x 32 channels of an output row (b, t, h)
    tiled = []
    monkeypatch.setattr(causal_conv_pad._NVRTC_CL, "launch", lambda *args: tiled.append(args))
    assert [int(re.search(rf"constexpr int {n} = (\d+);", source).group(1)) for n in ("kTile", "kTileRows")] == [
        causal_conv_pad._TILE, causal_conv_pad._TILE_ROWS]
    out = causal_conv_pad._nvrtc_kernel(x, cache, [1, 1, 1, 1, 2, 0], True)
    (_, key, grid, block, *args), = tiled
    assert out.shape == (2, 6, 5, 11, 302) and out.is_contiguous(memory_format=torch.channels_last_3d)
    assert grid == (10, 1, 2 * 5 * 11) and block == (32, 8, 1) and args[-3:] == [True, False, False] and args[:3] == [
        out.data_ptr(), x.data_ptr(), cache.data_ptr()]



def test_wide_kernels_launch_where_every_vector_is_whole(monkeypatch):
    """The NVRTC launchers pick the wide kernels (16-byte vectors both ways: csrc/causal_pad.cu's causal_pad_cl_wide /
    ltx_rmsnorm_pad_cl_wide, csrc/conv_bias.cu's bias_contiguous_wide) as the .cu's wide_fits does: 16-bit values,
    channels and the vectors' axis multiples of 8, x's (and the cache's) strides multiples of 8, data 16-byte aligned;
    each with its grid (a 32 x 64 tile a block of 128 threads) and the .cu's constants; anything else the tiled
    kernels, with the same fields."""
    import re
    from pathlib import Path

    from test_nvrtc import captured_launches  # noqa: F401 - the fixture's body, called directly below

    conv_bias_module = importlib.import_module("diffusers_fastpath.ops.conv_bias")
    rms_conv = importlib.import_module("diffusers_fastpath.ops.ltx_vae_rmsnorm_conv")
    csrc = Path(causal_conv_pad.__file__).parents[2] / "csrc"
    for source, module, names in (("causal_pad.cu", causal_conv_pad, ("Channels", "Columns", "Threads")),
                                  ("conv_bias.cu", conv_bias_module, ("Positions", "Channels", "Threads"))):
        text = (csrc / source).read_text()
        assert [int(re.search(rf"constexpr int kWide{n} = (\d+);", text).group(1)) for n in names] == [
            getattr(module, f"_WIDE_{n.upper()}") for n in names]
    launches = captured_launches.__wrapped__(monkeypatch)
    x = torch.randn(2, 40, 4, 5, 72).to(torch.bfloat16)
    cache = torch.randn(2, 40, 2, 5, 72).to(torch.bfloat16)
    out = causal_conv_pad._nvrtc_kernel(x[:, :, 1:], cache, [1, 1, 1, 1, 2, 0], True)  # (a time slice: strides of 8s)
    kernel, _, grid, block, a = launches[-1]
    assert kernel is causal_conv_pad._NVRTC_WIDE and grid == (2, 2, 2 * 5 * 7) and block == (128, 1, 1)
    assert (a.a.out, a.a.x, a.a.cache, a.a.channels, a.a.width, a.a.cache_frames) == (
        out.data_ptr(), x[:, :, 1:].data_ptr(), cache.data_ptr(), 40, 72, 2)
    causal_conv_pad._nvrtc_kernel(x, None, [1, 1, 1, 1, 2, 0], True, True, True)
    assert launches[-1][0] is causal_conv_pad._NVRTC_WIDE_MODES
    shifted = torch.randn(cache.numel() + 1).to(torch.bfloat16)[1:].view(cache.shape)  # (2 bytes past 16)
    not_wide = [(x[:, :36], None), (x[..., :68], None), (x.float(), None), (x[..., 1:65], None), (x, shifted),
                (x[..., :64], cache[..., :64])]  # (channels, columns, fp32, x's alignment, the cache's; then columns
    #                                             of 64 with strides of 72: wide)
    kinds = []
    for xi, ci in not_wide:
        causal_conv_pad._nvrtc_kernel(xi, ci, [1, 1, 1, 1, 2, 0], True)
        kinds.append(launches[-1][0])
    assert kinds[:5] == [causal_conv_pad._NVRTC_CL] * 5 and kinds[5] is causal_conv_pad._NVRTC_WIDE
    assert launches[-2][3] == (32, 8, 1)
    # LTX-Video's norm written into the buffer: the wide kernel and its rsqrt where aligned
    r = torch.rand(2, 4 * 5 * 72)
    rms_conv._nvrtc_kernel(x, r, [1, 1, 1, 1, 2, 0], True)
    kernel, _, grid, block, a = launches[-1]
    assert kernel is rms_conv._NVRTC_WIDE and (grid, block) == ((2, 2, 2 * 6 * 7), (128, 1, 1))
    assert a.rsqrt == r.data_ptr()
    rms_conv._nvrtc_kernel(x, r.view(-1)[1:].view(1, -1).expand(2, -1)[:, :1440], [1, 1, 1, 1, 2, 0], True)
    assert launches[-1][0] is rms_conv._NVRTC  # (an rsqrt of no 16-byte alignment)
    # bias_contiguous: the wide kernel at channels and positions multiples of 8, its residual variant too
    raw = x.contiguous(memory_format=torch.channels_last_3d)
    bias = torch.randn(40).to(torch.bfloat16)
    out = conv_bias_module._nvrtc_contiguous(raw, bias)
    kernel, key, grid, block, a = launches[-1]
    assert (kernel, key, grid, block) == (conv_bias_module._NVRTC_CONTIGUOUS_WIDE, (torch.bfloat16, False),
                                          (23, 2, 2), (128, 1, 1))
    assert (a.a.out, a.a.x, a.a.residual, a.a.spatial, a.a.channels) == (out.data_ptr(), raw.data_ptr(), None, 1440, 40)
    conv_bias_module._nvrtc_contiguous(raw, bias, x)
    assert launches[-1][:2] == (conv_bias_module._NVRTC_CONTIGUOUS_WIDE, (torch.bfloat16, True))
    conv_bias_module._nvrtc_contiguous(raw.float(), bias.float())
    assert launches[-1][0] is conv_bias_module._NVRTC_CONTIGUOUS and launches[-1][3] == (32, 8, 1)
    odd = x[..., :5].contiguous(memory_format=torch.channels_last_3d)  # (positions 100: no multiple of 8)
    conv_bias_module._nvrtc_contiguous(odd, bias)
    assert launches[-1][0] is conv_bias_module._NVRTC_CONTIGUOUS


def test_transpose_copy_probe_launches_what_the_launchers_launch(monkeypatch, tool):
    """tools/transpose_copy_probe.py launches each kernel as the product's launchers would: its wide grids and
    arguments are those `causal_conv_pad._nvrtc_kernel`, `channel_rmsnorm_silu._nvrtc_pad` and
    `conv_bias._nvrtc_contiguous` pick for the same inputs, its tiled ones those they pick where the wide kernel does
    not fit (so its timings are of the kernels that run)."""
    from test_nvrtc import captured_launches  # noqa: F401 - the fixture's body, called directly below

    from pathlib import Path

    conv_bias_module = importlib.import_module("diffusers_fastpath.ops.conv_bias")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))  # (as a script sees its folder)
    probe = tool("transpose_copy_probe")
    launches = captured_launches.__wrapped__(monkeypatch)
    x = torch.randn(2, 40, 3, 5, 72).to(torch.bfloat16)
    cache = torch.randn(2, 40, 2, 5, 72).to(torch.bfloat16)

    def fields(a):
        return [getattr(a.a, f) for f, _ in causal_conv_pad._ARGS.fields if f not in ("out",)]

    for run, _ in probe._pad_launchers(x, cache, [1, 1, 1, 1, 0, 0]).values():
        run()
    tiled, wide = launches[-2], launches[-1]
    causal_conv_pad._nvrtc_kernel(x, cache, [1, 1, 1, 1, 0, 0], True)
    assert launches[-1][0] is wide[0] is causal_conv_pad._NVRTC_WIDE and launches[-1][2:4] == wide[2:4]
    assert fields(launches[-1][4]) == fields(wide[4]) == fields(tiled[4])
    causal_conv_pad._nvrtc_kernel(x[:, :36], cache[:, :36], [1, 1, 1, 1, 0, 0], True)  # (36 channels: the tiled one)
    assert tiled[0] is causal_conv_pad._NVRTC_CL and tiled[3] == launches[-1][3] == (32, 8, 1)
    assert tiled[2][0] == launches[-1][2][0] and tiled[2][2] == launches[-1][2][2]  # (columns, rows; channels 2 both)
    # the channel norm written into the buffer: the wide kernel and the tiled one, as `channel_rmsnorm_silu` launches
    # them (its fields, the denominator's pointer after them; the tiled grid where the wide kernel does not fit)
    runs = probe._norm_launchers(x, [1, 1, 1, 1, 2, 0])
    for run, _ in runs.values():
        run()
    tiled, wide = launches[-2], launches[-1]
    denom = crms.denominator(x).contiguous().view(x.shape[0], -1)
    crms._nvrtc_pad(x, denom, torch.ones(40, dtype=x.dtype), None, 40 ** 0.5, 0.0, [1, 1, 1, 1, 2, 0])
    assert launches[-1][0] is wide[0] is crms._NVRTC_PAD_WIDE and launches[-1][2:4] == wide[2:4]
    assert fields(launches[-1][4]) == fields(wide[4]) == fields(tiled[4])
    assert (wide[4].scale, wide[4].bias_value, wide[4].bias) == (launches[-1][4].scale, 0.0, None)
    crms._nvrtc_pad(x[:, :36], denom, torch.ones(36, dtype=x.dtype), None, 6.0, 0.0, [1, 1, 1, 1, 2, 0])
    assert tiled[0] is crms._NVRTC_PAD and tiled[3] == launches[-1][3] == (32, 8, 1)
    assert tiled[2][0] == launches[-1][2][0] and tiled[2][2] == launches[-1][2][2]
    raw = x.contiguous(memory_format=torch.channels_last_3d)
    bias = torch.randn(40).to(torch.bfloat16)
    for run, _ in probe._bias_launchers(raw, bias).values():
        run()
    tiled, wide = launches[-2], launches[-1]
    conv_bias_module._nvrtc_contiguous(raw, bias)
    assert launches[-1][0] is wide[0] is conv_bias_module._NVRTC_CONTIGUOUS_WIDE and launches[-1][1:4] == wide[1:4]
    conv_bias_module._nvrtc_contiguous(raw.float(), bias.float())  # (fp32: the tiled one)
    assert tiled[0] is conv_bias_module._NVRTC_CONTIGUOUS and tiled[2:4] == launches[-1][2:4]
    assert (wide[4].a.x, wide[4].a.spatial, wide[4].a.channels) == (raw.data_ptr(), 1080, 40)


def test_channels_last_tile_kernels_launch_within_the_grid_limits(monkeypatch):
    """causal_pad's channels-last kernel and conv_bias's bias_contiguous put the channel tiles on grid.y, whose limit
    is 65535: a tensor of more than 65535 * 32 channels had a launch the driver refuses (the op then disabled for the
    process). grid.y is capped and the kernels loop over the channel tiles (the NVRTC launchers, as the .cu's)."""
    conv_bias_module = importlib.import_module("diffusers_fastpath.ops.conv_bias")
    launches = []
    monkeypatch.setattr(causal_conv_pad._NVRTC_CL, "launch", lambda *args: launches.append(args))
    monkeypatch.setattr(conv_bias_module._NVRTC_CONTIGUOUS, "launch", lambda *args: launches.append(args))
    channels = 65535 * 32 + 1
    x = torch.zeros(1, channels, 1, 1, 1, dtype=torch.bfloat16)
    causal_conv_pad._nvrtc_kernel(x, None, [0, 0, 0, 0, 1, 0], True)
    conv_bias_module._nvrtc_contiguous(x.contiguous(memory_format=torch.channels_last_3d),
                                       torch.zeros(channels, dtype=torch.bfloat16))
    assert len(launches) == 2
    for _, _, grid, block, *_ in launches:
        assert all(0 < g <= limit for g, limit in zip(grid, (2 ** 31 - 1, 65535, 65535))), grid


def test_bias_contiguous_raw_guard_takes_what_bindings_cpp_takes():
    """The NVRTC way's ``_conv_bias_contiguous_cuda`` stands for bindings.cpp's, which takes any x that
    ``is_contiguous(ChannelsLast3d)`` says yes to, also one contiguous both ways (one output channel, or one output
    position): the raw guard asked `_layout`, which calls such a tensor contiguous, and refused it (the direct call
    raised where the nvcc extension's runs)."""
    conv_bias_module = importlib.import_module("diffusers_fastpath.ops.conv_bias")

    class OnCuda(torch.Tensor):  # (the guard's device check, passed on a CPU)
        is_cuda = property(lambda self: True)

    def on_cuda(t):
        return torch.Tensor._make_subclass(OnCuda, t)

    for shape in [(2, 1, 3, 4, 5), (2, 6, 1, 1, 1), (2, 6, 3, 4, 5), (2, 1, 4, 5)]:
        x = torch.randn(shape).to(torch.bfloat16)
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
        assert conv_bias_module._raw_contiguous_guard(on_cuda(x), on_cuda(torch.zeros(shape[1]).to(x.dtype))) is None
    x = torch.randn(2, 6, 3, 4, 5).to(torch.bfloat16)  # contiguous only: refused
    assert conv_bias_module._raw_contiguous_guard(on_cuda(x), on_cuda(torch.zeros(6).to(x.dtype))) is not None

# --- GPU ------------------------------------------------------------------------------------------------------------


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.float().cpu().numpy().tobytes()).hexdigest()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape, kernel, cached", [
    ((1, 384, 1, 60, 104), 3, 0), ((1, 384, 1, 60, 104), 3, 2), ((1, 192, 4, 240, 416), 3, 1),
    ((1, 96, 4, 480, 832), 3, 2), ((1, 384, 1, 166, 166), 3, 1), ((1, 384, 2, 60, 104), (3, 1, 1), 1),
    ((2, 40, 2, 5, 72), 3, 1), ((2, 16, 3, 4, 8), 3, 2)], ids=str)
@torch.no_grad()
def test_causal_pad_kernel_equals_cat_then_pad_at_wan_shapes(shape, kernel, cached, dtype):
    """csrc/causal_pad.cu's buffer against eager's ``F.pad(torch.cat([cache_x, x], 2), padding)`` at the Wan and
    Qwen-Image decodes' shapes (no cache, one or two cached frames, the time convolution), x also a strided slice;
    the channels-last wide kernel's with parts of its 32 x 64 tiles (40 channels, 72 columns; batch 2) and of one
    (16 x 8); both ways it launches (the nvcc build's raw op and NVRTC); every element written (the allocator's
    blocks of its size poisoned first)."""
    from test_nvrtc import both_ways

    both_ways.__wrapped__()  # (the extension and the NVRTC cubins, whichever way the loader took)
    conv = wan.WanCausalConv3d(shape[1], shape[1], kernel, padding=1 if kernel == 3 else (1, 0, 0))
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, c, t, h, w = shape
    for strided in (False, True):
        x = (torch.randn(b, c, t + 2 * strided, h, w, generator=gen, device="cuda") * 3).to(dtype)
        x = x[:, :, 1:1 + t] if strided else x
        cache = (torch.randn(b, c, cached, h, w, generator=gen, device="cuda") * 3).to(dtype) if cached else None
        padding = list(conv._padding)
        ref = x if cache is None else torch.cat([cache, x], dim=2)
        if cache is not None:
            padding[4] -= cached
        ref = F.pad(ref, padding)
        for way in (torch.ops.diffusers_fastpath._causal_pad_cuda, causal_conv_pad._nvrtc_kernel):
            torch.full_like(ref, float("nan"))  # (freed: the next block of this size the kernel's output)
            out = way(x, cache, list(conv._padding))
            assert out.shape == ref.shape and out.stride() == ref.stride() and torch.equal(out, ref), way
            # channels-last (`causal_conv_cl`'s buffer): the same values, laid out as channels_last_3d
            ref_cl = ref.contiguous(memory_format=torch.channels_last_3d)
            torch.full_like(ref_cl, float("nan"))
            out = way(x, cache, list(conv._padding), True)
            assert out.shape == ref.shape and out.stride() == ref_cl.stride() and torch.equal(out, ref), way


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@torch.no_grad()
def test_bias_contiguous_kernel_equals_add_then_contiguous(dtype):
    """csrc/conv_bias.cu's bias_contiguous: a channels-last convolution output plus its bias, written contiguous, equals
    aten's ``x + bias`` then ``.contiguous()`` (one fp32 add, rounded), both ways it launches, every element written
    (poisoned first); at the Wan decoder's shapes, odd ones (channels and positions no multiple of the 32 x 32 tile),
    4-D and 5-D, a batch of 3; the wide kernel's (multiples of 8) with parts of its 64 x 32 tiles."""
    from test_nvrtc import both_ways

    nvcc = both_ways.__wrapped__()
    conv_bias_module = importlib.import_module("diffusers_fastpath.ops.conv_bias")
    gen = torch.Generator(device="cuda").manual_seed(4)
    for shape in [(1, 384, 1, 60, 104), (1, 96, 4, 480, 832), (1, 192, 2, 240, 416), (3, 5, 2, 7, 9), (1, 33, 65, 31),
                  (2, 3, 1, 1, 1), (1, 1024, 1, 1, 3), (2, 40, 3, 5, 72), (1, 8, 13, 8)]:
        x = (torch.randn(shape, generator=gen, device="cuda") * 4).to(dtype)
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
        bias = torch.randn(shape[1], generator=gen, device="cuda").to(dtype)
        ref = conv_bias_module.bias_contiguous_arithmetic(x, bias)
        ways = [conv_bias_module._nvrtc_contiguous] + ([torch.ops.diffusers_fastpath._conv_bias_contiguous_cuda]
                                                       if nvcc else [])
        for way in ways:
            torch.full_like(ref, float("nan"))
            out = way(x, bias)
            assert out.is_contiguous() and torch.equal(out, ref), (shape, way)


@pytest.mark.gpu
@pytest.mark.parametrize("cin, cout, shape, cached", [
    (384, 384, (1, 384, 1, 60, 104), 2), (384, 384, (1, 384, 2, 120, 208), 1), (192, 192, (1, 192, 4, 240, 416), 2),
    (192, 96, (1, 192, 4, 480, 832), 0), (96, 3, (1, 96, 4, 480, 832), 2), (16, 384, (1, 16, 1, 60, 104), 0),
    (384, 384, (1, 384, 1, 166, 166), 1)], ids=str)
@torch.no_grad()
def test_causal_conv3d_channels_last_equals_the_module_at_wan_shapes(cin, cout, shape, cached):
    """The channels-last causal convolution (`causal_conv_cl`) against the module's eager forward at the Wan 2.1 and
    Qwen-Image decoders' convolutions (3x3x3, padded; cached frames or none): its first call per signature is
    compared with eager by the op itself (a mismatch would disable it: the site's fast count says it ran), and again
    here, strides included."""
    from diffusers_fastpath._state import SITE_ATTR

    causal_conv_cl = importlib.import_module("diffusers_fastpath.ops.causal_conv_cl")
    conv = randomize_(wan.WanCausalConv3d(cin, cout, 3, padding=1), 2).to("cuda", torch.bfloat16)
    conv.__class__ = vae_wan.CONVS[wan.WanCausalConv3d]
    sites = {SITE_ATTR: Site("causal_conv3d"), causal_conv_cl.NAMED_SITE: Site("causal_conv3d_cl"),
             "_fastpath_site_conv_bias": Site("conv_bias")}
    conv.__dict__.update(sites)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
    cache = torch.randn(*shape[:2], cached, *shape[3:], generator=gen, device="cuda").to(torch.bfloat16) if cached \
        else None
    for _ in range(2):
        out = conv(x, cache)
        ref = wan.WanCausalConv3d.forward(conv, x, cache)
        assert out.stride() == ref.stride() and torch.equal(out, ref)
    assert sites[causal_conv_cl.NAMED_SITE].fast == 2, (dict(sites[causal_conv_cl.NAMED_SITE].fallback),
                                                         causal_conv_cl.CAUSAL_CONV3D_CL.status)


# The norms of a Wan 2.1 decode at 832x480 (latents 104x60; channels 384/384/192/96 as the decoder widens; one latent
# frame, then 2 and 4 after the temporal upsamplings) and the attention's [frames, C, H, W] norm
WAN_NORM_SHAPES = [(1, 384, 1, 60, 104), (1, 384, 2, 120, 208), (1, 192, 4, 240, 416), (1, 96, 4, 480, 832),
                   (1, 384, 60, 104),
                   # Qwen-Image's decode at 1328x1328 (latents 166x166): rows of no multiple of 8, the element kernel
                   (1, 384, 1, 166, 166), (1, 192, 1, 664, 664), (1, 384, 166, 166)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", WAN_NORM_SHAPES + [(1, 96, 3, 37, 45)])  # (+ an fp32 row of no multiple of 4)
@pytest.mark.parametrize("layout", ["contiguous", "time-major"])
@torch.no_grad()
def test_channel_rmsnorm_kernel_equals_eager_at_wan_shapes(shape, dtype, layout):
    """The kernel (both modes) against the module (then ``F.silu``), torch.equal, strides included, the allocator's
    blocks of the output's size poisoned with NaN first; x contiguous or time-major (the upsamplers' layout)."""
    if layout == "time-major" and len(shape) == 4:
        pytest.skip("the attention's norm takes [B*T, C, H, W]")
    images = len(shape) == 4
    norm = wan.WanRMS_norm(shape[1], images=images).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    norm.gamma.copy_(1 + 0.5 * torch.randn(norm.gamma.shape, generator=gen, device="cuda"))
    norm = norm.to(dtype)
    if layout == "time-major":
        b, c, t, h, w = shape
        x = (torch.randn(b, t, c, h, w, generator=gen, device="cuda") * 3).to(dtype).transpose(1, 2)
    else:
        x = (torch.randn(shape, generator=gen, device="cuda") * 3).to(dtype)
    x[:, 1::5, ..., ::11] = 0  # some zeros; positions whose channels are all zero (their norm clamped at eps)
    x[0, :, 0, 0] = 0
    crms.add_norm_class(wan.WanRMS_norm)
    for op, silu in ((crms.CHANNEL_RMSNORM, False), (crms.CHANNEL_RMSNORM_SILU, True)):
        poison = [torch.full_like(x, float("nan")) for _ in range(3)]  # freed below: the next blocks of this size
        del poison
        site = Site(op.name)
        out = op(site, norm, x)
        ref = norm(x)
        ref = F.silu(ref) if silu else ref
        assert site.fast == 1, (op.name, dict(site.fallback), op.status)
        assert out.stride() == ref.stride() and torch.equal(out, ref), op.name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@torch.no_grad()
def test_norm_reduction_reading_half_equals_the_fp32_upcast(dtype):
    """`reads_half_directly`: aten's norm over the channels reading x itself (``linalg.vector_norm(..., dtype=float32)``)
    equals F.normalize's reduction of the fp32 upcast, bit for bit, at the shapes and layouts the VAEs run (Wan's and
    Qwen-Image's, time-major, channels-last, a batch of 2) and at sizes that move aten's launch configuration
    (channels from 3 to 768, odd rows, rows of 1, 2 and 4-element output vectors); and it is refused where the two
    could be launched apart (an address that is no multiple of 4 elements, an fp32 operand past 2 GiB)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    shapes = WAN_NORM_SHAPES + [(2, 384, 2, 60, 104), (1, 3, 5, 33, 47), (1, 12, 1, 7, 9), (1, 768, 1, 17, 19),
                                (1, 96, 1, 1, 1), (3, 160, 2, 2), (1, 512, 4, 3, 3), (1, 256, 1, 1, 6)]
    checked = 0
    for shape in shapes:
        for layout in ("contiguous", "time-major", "channels-last"):
            if layout == "time-major" and len(shape) != 5:
                continue
            if layout == "time-major":
                b, c, t, h, w = shape
                x = (torch.randn(b, t, c, h, w, generator=gen, device="cuda") * 3).to(dtype).transpose(1, 2)
            elif layout == "channels-last":  # HunyuanVideo-1.5's mid-block; C on the fastest dimension: aten's
                last = (torch.randn(shape[0], *shape[2:], shape[1], generator=gen, device="cuda") * 3).to(dtype)
                x = last.movedim(-1, 1)  # other reduction scheme (across a warp's lanes, vectorised input)
            else:
                x = (torch.randn(shape, generator=gen, device="cuda") * 3).to(dtype)
            x[:, ::7, ..., ::3] = 0  # zeros, and positions whose channels are all zero
            x[0, :, 0] = 0
            assert crms.reads_half_directly(x), shape
            got = crms.denominator(x)
            ref = x.float().norm(2.0, 1, keepdim=True).clamp_min(1e-12)
            assert got.shape == ref.shape and got.stride() == ref.stride(), (shape, layout)
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (shape, layout)
            checked += 1
    assert checked == 45
    flat = torch.randn(8 * 1000 + 1, generator=gen, device="cuda").to(dtype)
    assert not crms.reads_half_directly(flat[1:].view(1, 8, 1000))  # 2 bytes past a 16-byte boundary
    assert not crms.reads_half_directly(torch.zeros(1, device="cuda", dtype=dtype).expand(2**29 + 1))
    assert not crms.reads_half_directly(torch.zeros(8, dtype=dtype))  # a CPU tensor: the upcast, as eager


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@torch.no_grad()
def test_channel_rmsnorm_through_nvrtc_equals_nvcc_and_eager(dtype):
    """The NVRTC cubin's launch against the nvcc extension's op (where a toolkit built it) and eager, at Wan's
    largest norm (96 channels, 4 frames of 480x832), both modes, a tensor bias and a python-float one."""
    from test_nvrtc import both_ways

    nvcc = both_ways.__wrapped__()
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(1, 96, 4, 480, 832, generator=gen, device="cuda") * 3).to(dtype)
    gamma = (1 + torch.randn(96, generator=gen, device="cuda")).to(dtype)
    bias = torch.randn(96, generator=gen, device="cuda").to(dtype)
    denom = crms.denominator(x)
    for b, value in ((None, 0.0), (bias, 0.0)):
        for silu in (False, True):
            got = crms._nvrtc_kernel(x, denom, gamma, b, 96 ** 0.5, value, silu, False)
            ref = crms.channel_rmsnorm_arithmetic(x, denom, gamma.view(-1, 1, 1, 1),
                                                  value if b is None else b.view(-1, 1, 1, 1), 96 ** 0.5, silu)
            assert torch.equal(got, ref), (b is None, silu)
            if nvcc:
                assert torch.equal(got, torch.ops.diffusers_fastpath._channel_rmsnorm_cuda(
                    x, denom, gamma, b, 96 ** 0.5, value, silu, False))


@pytest.mark.gpu
@torch.no_grad()
def test_the_fp32_silu_proof_passes_on_every_fp32_value():
    """The norm kernel's SiLU (probe mode) equals aten's ``F.silu`` on all 2^32 fp32 bit patterns, both ways the
    kernel runs (what an fp32 VAE's first norm + SiLU call runs before the op is trusted); timed for the docs."""
    import time

    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    torch.cuda.synchronize()
    start = time.perf_counter()
    assert crms._prove_silu_fp32(torch.device("cuda"))
    print(f"fp32 SiLU proof: {time.perf_counter() - start:.3f} s")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@torch.no_grad()
def test_wan_vae_decode_and_encode_md5_identical_every_site_fast(dtype, unpatch_after):
    """Wan 2.1's VAE (the published config, random weights) on a representative crop (17 frames of 256x256): decode
    and encode md5-identical patched and unpatched, every site fast; in fp32 (Wan's model card's VAE) every site but
    the channels-last path (other bits in fp32 on an H100): refused by dtype (the norms' SiLU proven on every fp32
    value on their first call)."""
    vae = AutoencoderKLWan()
    randomize_(vae, 0)
    with torch.no_grad():
        for m in vae.modules():
            if isinstance(m, NORMS):
                m.gamma.copy_(1 + 0.25 * torch.randn_like(m.gamma))
    vae = vae.to("cuda", dtype).eval()
    gen = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(1, 16, 5, 32, 32, generator=gen, device="cuda").to(dtype)
    x = (torch.rand(1, 3, 17, 256, 256, generator=gen, device="cuda") * 2 - 1).to(dtype)
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    unpatch_after(fp.patch(vae))
    dec, enc = _decode(vae, z), _encode(vae, x)
    assert torch.equal(dec, ref_dec) and _md5(dec) == _md5(ref_dec)
    assert torch.equal(enc, ref_enc) and _md5(enc) == _md5(ref_enc)
    if dtype == torch.bfloat16:
        assert _every_site_fast(vae), str(fp.report(vae, verbose=True))
        return
    for name, (op, fast, fallback, reasons) in _sites(vae).items():
        if op == "causal_conv3d_cl":  # (fp32 channels-last: other bits, H100)
            assert fast == 0 and reasons == {"dtype float32": fallback}, name
        else:
            assert fast > 0 and fallback == 0, (name, op, fast, fallback, reasons)


def test_a_norm_kernel_that_differs_is_caught_on_its_first_call_and_eager_runs(monkeypatch, emulated_kernels):
    """The tail is exact by construction, and still compared with eager on the first call of each signature: a kernel
    one ulp off (a platform where it is not what it claims) is disabled there, and the decode is eager's."""
    import sys

    crms = sys.modules["diffusers_fastpath.ops.channel_rmsnorm_silu"]
    exact = crms.CHANNEL_RMSNORM.kernel

    def off_by_one_ulp(norm, x):
        out = exact(norm, x)
        return (out.view(torch.int16) + 1).view(out.dtype)

    monkeypatch.setattr(crms.CHANNEL_RMSNORM, "kernel", off_by_one_ulp)
    vae = _build("wan")
    z = _latents(vae)
    with torch.no_grad():
        ref = _decode(vae, z)
        fp.patch(vae)
        try:
            assert torch.equal(_decode(vae, z), ref) and torch.equal(_decode(vae, z), ref)
        finally:
            fp.unpatch(vae)
    assert "not bit-exact" in (crms.CHANNEL_RMSNORM.disabled or "")


def test_an_fp32_vae_is_patched_without_the_nothing_runs_fused_warning(monkeypatch, fastpath_log):
    """An fp32 model is told that nothing of it runs fused, but an fp32 VAE has sites that do (bias adds, buffers,
    upsampling): no such warning for it, and a transformer in fp32 still gets it."""
    from diffusers_fastpath import patching

    monkeypatch.setattr(patching, "_on_cuda", lambda model: True)  # (the warning is for models on a GPU)
    vae = _build("wan", torch.float32)
    fp.patch(vae)
    try:
        assert not [r for r in fastpath_log.records if "the fused kernels take bfloat16" in r.getMessage()]
    finally:
        fp.unpatch(vae)
    from diffusers_fastpath.testing import zoo

    model = zoo.build("sana", dtype=torch.float32)
    fp.patch(model)
    try:
        assert [r for r in fastpath_log.records if "the fused kernels take bfloat16" in r.getMessage()]
    finally:
        fp.unpatch(model)


@torch.no_grad()
def test_a_verification_key_that_raises_disables_its_op_alone(monkeypatch, emulated_kernels, fastpath_log):
    """A self-verified op whose signature cannot be read (a bug, or a torch setting its getter refuses) is turned off
    with one warning and eager runs for it; the op whose kernel called it (the one-buffer causal convolution, which
    tries the channels-last path first) keeps running: the error does not escape into it."""
    causal_conv_cl = importlib.import_module("diffusers_fastpath.ops.causal_conv_cl")

    def raising(*args):
        raise RuntimeError("cannot read the key")

    monkeypatch.setattr(causal_conv_cl.CAUSAL_CONV3D_CL, "verify_key", raising)
    vae = _build("wan")
    z = _latents(vae)
    ref = _decode(vae, z)
    fp.patch(vae)
    try:
        assert torch.equal(_decode(vae, z), ref)
        assert causal_conv_cl.CAUSAL_CONV3D_CL.disabled and causal_conv_pad.CAUSAL_CONV3D.disabled is None, str(fp.report(vae))
        assert sum("disabling the fused op 'causal_conv3d_cl'" in r.getMessage() for r in fastpath_log.records) == 1
        rows = fp.report(vae).sites
        assert all(r.fast > 0 for r in rows if r.op == "causal_conv3d" and r.site.startswith("decoder."))
    finally:
        fp.unpatch(vae)
