"""Models built from published configs with random weights (no downloads), for tests, examples and benchmarks.

Bit-exactness holds for any weights, so a model built from the published config with random weights measures
the real shapes and the real speed; `randomize_` makes sure no parameter is left at a zero or identity init
(a fused path fed zeros proves nothing).
"""

from __future__ import annotations

import collections
import contextlib
import math

import torch

# https://huggingface.co/black-forest-labs/FLUX.1-dev/blob/main/transformer/config.json
FLUX_DEV_CONFIG = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=[16, 56, 56],
)
TINY_FLUX_CONFIG = dict(
    patch_size=1,
    in_channels=4,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=False,
    axes_dims_rope=[4, 4, 8],
)
FLUX_CONFIGS = {"flux-dev": FLUX_DEV_CONFIG, "flux-tiny": TINY_FLUX_CONFIG}

# https://huggingface.co/lodestones/Chroma1-HD/blob/main/transformer/config.json: diffusers' class defaults (FLUX.1's
# 19 + 38 blocks at hidden 3072, the 5-layer distilled guidance approximator at 5120)
CHROMA_CONFIG = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    axes_dims_rope=(16, 56, 56),
    approximator_num_channels=64,
    approximator_hidden_dim=5120,
    approximator_layers=5,
)
TINY_CHROMA_CONFIG = dict(CHROMA_CONFIG, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
                          num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8),
                          approximator_num_channels=8, approximator_hidden_dim=32, approximator_layers=1)
CHROMA_CONFIGS = {"chroma": CHROMA_CONFIG, "chroma-tiny": TINY_CHROMA_CONFIG}

# https://huggingface.co/baidu/ERNIE-Image/blob/main/transformer/config.json
ERNIE_IMAGE_CONFIG = dict(
    hidden_size=4096,
    num_attention_heads=32,
    num_layers=36,
    ffn_hidden_size=12288,
    in_channels=128,
    out_channels=128,
    patch_size=1,
    text_in_dim=3072,
    rope_theta=256,
    rope_axes_dim=(32, 48, 48),
    eps=1e-6,
    qk_layernorm=True,
)
# Small, but with a row length (768) inside the fused RMSNorm's domain, so the kernel runs on a GPU.
TINY_ERNIE_IMAGE_CONFIG = dict(ERNIE_IMAGE_CONFIG, hidden_size=768, num_attention_heads=6, num_layers=2,
                               ffn_hidden_size=1024, in_channels=16, out_channels=16, text_in_dim=64)
ERNIE_IMAGE_CONFIGS = {"ernie-image": ERNIE_IMAGE_CONFIG, "ernie-image-tiny": TINY_ERNIE_IMAGE_CONFIG}


@contextlib.contextmanager
def _construct(device, dtype):
    """Build modules directly on `device` in `dtype` (no fp32 copy first, and no cast warning from diffusers)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fresh random values for every parameter (zero-initialised layers included), scaled so that activations stay
    in range through deep stacks: matrices N(0, 1/fan_in), norm weights N(1, 0.1), other vectors N(0, 0.05)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    norm_weights = {
        id(m.weight) for m in model.modules() if "Norm" in type(m).__name__ and isinstance(getattr(m, "weight", None), torch.Tensor)
    }
    for p in model.parameters():
        if p.dim() >= 2:
            p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()), generator=gen)
        elif id(p) in norm_weights:
            p.normal_(1.0, 0.1, generator=gen)
        else:
            p.normal_(0.0, 0.05, generator=gen)
    return model


def _random_model(cls: type, configs: dict, config, dtype, device, seed: int, overrides: dict) -> torch.nn.Module:
    """`cls` from a named config of `configs` (or a config dict) with `overrides`, built on `device` in `dtype`,
    with `randomize_`'s weights, in eval mode: what every ``build_*`` below does for its family."""
    cfg = {**(configs[config] if isinstance(config, str) else config), **overrides}
    with _construct(device, dtype):
        model = cls(**cfg)
    return randomize_(model, seed).eval()


def _text_mask(batch: int, txt_tokens: int, padding: int) -> torch.Tensor:
    """A ``[batch, txt_tokens]`` long attention mask of ones, the last `padding` tokens of the first prompt zero."""
    mask = torch.ones(batch, txt_tokens, dtype=torch.long)
    if padding:
        mask[0, txt_tokens - padding:] = 0
    return mask


def build_flux_transformer(config="flux-tiny", dtype=torch.bfloat16, device="cpu", seed=0, **overrides):
    """A ``FluxTransformer2DModel`` from a named config (``"flux-dev"``, ``"flux-tiny"``) or a dict, random weights."""
    from diffusers import FluxTransformer2DModel

    return _random_model(FluxTransformer2DModel, FLUX_CONFIGS, config, dtype, device, seed, overrides)


def _latents_and_ids(cfg, batch, grid, txt_tokens, gen, dtype) -> dict:
    """The packed latents and text states of a FLUX-style transformer, image ids laid out on ``grid``, zero text ids."""
    h, w = grid
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return dict(
        hidden_states=torch.randn(batch, h * w, cfg.in_channels, generator=gen).to(dtype),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.joint_attention_dim, generator=gen).to(dtype),
        img_ids=img_ids.reshape(-1, 3),
        txt_ids=torch.zeros(txt_tokens, 3),
    )


def assert_every_site_fast(report, counts: dict[str, int], calls: dict, forwards: int = 1) -> None:
    """`report` (of one model) has `counts` sites per op, and each took its fast path ``calls[op]`` (default 1; a tuple:
    any of those) times per forward on each of `forwards` forwards, never falling back."""
    assert collections.Counter(s.op for s in report.sites) == counts, str(report)

    def expected(op):
        n = calls.get(op, 1)
        return {c * forwards for c in (n if isinstance(n, tuple) else (n,))}

    assert all(s.fast in expected(s.op) and s.fallback == 0 for s in report.sites), str(report)


def outputs_equal(a, b) -> bool:
    """`torch.equal` of two model outputs: tensors, or lists of them (Z-Image returns one tensor per sample)."""
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(outputs_equal, a, b))
    return isinstance(b, torch.Tensor) and torch.equal(a, b)


def _flat(out) -> torch.Tensor:
    return torch.cat([o.flatten() for o in out]) if isinstance(out, (list, tuple)) else out


def assert_patched_equals_unpatched(build, make_inputs, counts: dict[str, int], dtype=torch.bfloat16, seed: int = 1,
                                    **input_kwargs) -> None:
    """The CPU check every family runs first: two models ``build(dtype=dtype, seed=seed)`` (the same random weights),
    fresh inputs ``make_inputs(model, seed=seed + 1, **input_kwargs)``, the patched model's output `torch.equal` to
    the unpatched one's (a real-looking output: finite, not zeros) and `report`'s sites per op equal to `counts`;
    the model is unpatched again afterwards."""
    from . import patch, report, unpatch

    ref_model, model = build(dtype=dtype, seed=seed), build(dtype=dtype, seed=seed)
    inputs = make_inputs(model, seed=seed + 1, **input_kwargs)
    with torch.no_grad():
        ref = ref_model(**inputs).sample
        assert torch.isfinite(_flat(ref)).all() and _flat(ref).float().std() > 0.1
        patch(model)
        try:
            assert outputs_equal(model(**inputs).sample, ref)
            found = collections.Counter(s.op for s in report(model).sites)
            assert found == counts, f"sites {dict(found)}, expected {counts}"
        finally:
            unpatch(model)


def assert_patched_step_exact_and_fused(model, inputs: dict, counts: dict[str, int], calls: dict[str, int]) -> None:
    """The check every family runs, on a CPU with the kernels emulated and on the GPU at full size: one forward of
    `model` (real-looking output, not zeros), then patched into an output poisoned with NaN first is `torch.equal`
    to it, with every site fast (`assert_every_site_fast`); `model` is unpatched again afterwards."""
    from . import patch, report, unpatch

    with torch.no_grad():
        ref = model(**inputs).sample
        assert torch.isfinite(_flat(ref)).all() and _flat(ref).float().std() > 0.01
        patch(model)
        try:
            got = model(**inputs).sample
            out = [torch.full_like(g, float("nan")) for g in got] if isinstance(got, list) else torch.full_like(got, float("nan"))
            for o, g in zip(out, got) if isinstance(got, list) else [(out, got)]:
                o.copy_(g)
            assert outputs_equal(out, ref)
            assert_every_site_fast(report(model), counts, calls)
        finally:
            unpatch(model)


@contextlib.contextmanager
def patch_round_trip(model, inputs: dict):
    """The reversibility checks every family's CPU tests share, around a block where `model` is patched (for the
    family's own checks of what was swapped in): patching keeps the state dict, keys and values; a pickle of the
    patched model loads patched and computes the same output; on leaving, ``unpatch`` gives every module its class
    back and leaves no attribute of this package behind."""
    import pickle

    from . import patch, unpatch

    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = [type(m) for m in model.modules()]
    patch(model)
    loaded = None
    try:
        after = model.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
        loaded = pickle.loads(pickle.dumps(model))  # loads patched: the swapped-in classes are found by name
        assert [type(m) for m in loaded.modules()] == [type(m) for m in model.modules()]
        with torch.no_grad():
            assert outputs_equal(loaded(**inputs).sample, model(**inputs).sample)
        yield model
    finally:
        if loaded is not None:
            unpatch(loaded)
        unpatch(model)
    assert [type(m) for m in model.modules()] == types
    assert not any(k.startswith("_fastpath") for m in model.modules() for k in vars(m))


def assert_compiles_fullgraph_exactly(model, inputs: dict) -> None:
    """Patched `model` traces with ``torch.compile(fullgraph=True)`` (no graph break) and the compiled call is
    `torch.equal` to the unpatched eager output; `model` is unpatched again afterwards."""
    from . import patch, unpatch

    with torch.no_grad():
        ref = model(**inputs).sample
        patch(model)
        try:
            assert outputs_equal(torch.compile(model, fullgraph=True, backend="aot_eager")(**inputs).sample, ref)
        finally:
            unpatch(model)


def build_chroma_transformer(config="chroma-tiny", dtype=torch.bfloat16, device="cpu", seed=0, **overrides):
    """A ``ChromaTransformer2DModel`` from a named config (``"chroma"``: Chroma1-HD; ``"chroma-tiny"``) or a dict,
    random weights."""
    from diffusers import ChromaTransformer2DModel

    return _random_model(ChromaTransformer2DModel, CHROMA_CONFIGS, config, dtype, device, seed, overrides)


def chroma_transformer_inputs(model, batch=1, grid=(4, 4), txt_tokens=8, seed=1, device=None, masked=0):
    """Fresh random ``ChromaTransformer2DModel`` inputs, as ``ChromaPipeline`` passes them; with ``masked`` > 0 the
    last ``masked`` text tokens of every sample are padding (the pipeline's attention mask over text and image)."""
    device = device or next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(_latents_and_ids(model.config, batch, grid, txt_tokens, gen, dtype),
                  timestep=torch.rand(batch, generator=gen).to(dtype))
    if masked:
        mask = torch.ones(batch, txt_tokens + grid[0] * grid[1], dtype=torch.bool)
        mask[:, txt_tokens - masked:txt_tokens] = False
        inputs["attention_mask"] = mask
    return {k: v.to(device) for k, v in inputs.items()}


def chroma_pipeline(transformer, vae):
    """A ``ChromaPipeline`` around `transformer` and `vae` with no text encoder: call it with
    `chroma_prompt_embeddings`."""
    from diffusers import ChromaPipeline, FlowMatchEulerDiscreteScheduler

    return ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                          transformer=transformer)


def tiny_chroma_pipeline(transformer=None, dtype=torch.bfloat16, device="cpu", seed=0):
    """A ``ChromaPipeline`` with a tiny random VAE and no text encoder (see `tiny_flux_pipeline`)."""
    transformer = transformer if transformer is not None else build_chroma_transformer("chroma-tiny", dtype, device, seed)
    vae = build_flux_vae("flux-tiny", dtype, device, seed + 1, latent_channels=transformer.config.in_channels // 4)
    return chroma_pipeline(transformer, vae)


def chroma_prompt_embeddings(pipe, batch=1, txt_tokens=8, seed=2, device=None, padding=3):
    """Random ``prompt_embeds`` and ``negative_prompt_embeds`` with their attention masks (the last `padding`
    tokens of the prompt masked out, as T5 padding is), for classifier-free guidance."""
    gen = torch.Generator().manual_seed(seed)
    dim = pipe.transformer.config.joint_attention_dim
    dtype, device = pipe.transformer.dtype, device or pipe.transformer.device
    mask = torch.ones(batch, txt_tokens, dtype=torch.bool)
    mask[:, txt_tokens - padding:] = False
    return dict(
        prompt_embeds=torch.randn(batch, txt_tokens, dim, generator=gen).to(device, dtype),
        negative_prompt_embeds=torch.randn(batch, txt_tokens, dim, generator=gen).to(device, dtype),
        prompt_attention_mask=mask.to(device), negative_prompt_attention_mask=torch.ones_like(mask).to(device),
    )


# https://huggingface.co/black-forest-labs/FLUX.2-dev/blob/main/transformer/config.json: diffusers' class defaults
# (8 dual + 48 single blocks at hidden 6144, 48 heads); a tiny one with the same structure (4 rotary axes)
FLUX2_DEV_CONFIG = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                        num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256,
                        mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6,
                        guidance_embeds=True)
TINY_FLUX2_CONFIG = dict(FLUX2_DEV_CONFIG, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
                         num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=16,
                         axes_dims_rope=(4, 4, 4, 4))
FLUX2_CONFIGS = {"flux2-dev": FLUX2_DEV_CONFIG, "flux2-tiny": TINY_FLUX2_CONFIG}


def build_flux2_transformer(config="flux2-tiny", dtype=torch.bfloat16, device="cpu", seed=0, **overrides):
    """A ``Flux2Transformer2DModel`` from a named config (``"flux2-dev"``, ``"flux2-tiny"``) or a dict, random
    weights."""
    from diffusers import Flux2Transformer2DModel

    return _random_model(Flux2Transformer2DModel, FLUX2_CONFIGS, config, dtype, device, seed, overrides)


def flux2_transformer_inputs(model, batch=1, grid=(4, 4), txt_tokens=8, seed=1, device=None):
    """Fresh random ``Flux2Transformer2DModel`` inputs as ``Flux2Pipeline`` passes them: latents on a ``grid``,
    4-axis ids (time, height, width, layer), a timestep and a guidance scale."""
    device = device or next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    h, w = grid
    img_ids = torch.zeros(h, w, 4)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    txt_ids = torch.zeros(txt_tokens, 4)
    txt_ids[:, 3] = torch.arange(txt_tokens)
    inputs = dict(
        hidden_states=torch.randn(batch, h * w, cfg.in_channels, generator=gen).to(dtype),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.joint_attention_dim, generator=gen).to(dtype),
        timestep=torch.rand(batch, generator=gen).to(dtype),
        img_ids=img_ids.reshape(-1, 4).expand(batch, -1, -1),
        txt_ids=txt_ids.expand(batch, -1, -1),
    )
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), 4.0)
    return {k: v.to(device) for k, v in inputs.items()}


# https://huggingface.co/stabilityai/stable-diffusion-3.5-large/blob/main/transformer/config.json; a tiny config with
# SD3.5's QK RMSNorm and one dual-attention block (SD3.5 medium's layout)
SD35_LARGE_CONFIG = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                         num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                         pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm")
TINY_SD3_CONFIG = dict(sample_size=16, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=16,
                       num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                       pooled_projection_dim=32, out_channels=4, pos_embed_max_size=16, qk_norm="rms_norm",
                       dual_attention_layers=(0,))
SD3_CONFIGS = {"sd3.5-large": SD35_LARGE_CONFIG, "sd3-tiny": TINY_SD3_CONFIG}


def build_sd3_transformer(config="sd3-tiny", dtype=torch.bfloat16, device="cpu", seed=0, **overrides):
    """An ``SD3Transformer2DModel`` from a named config (``"sd3.5-large"``, ``"sd3-tiny"``) or a dict, random weights."""
    from diffusers import SD3Transformer2DModel

    return _random_model(SD3Transformer2DModel, SD3_CONFIGS, config, dtype, device, seed, overrides)


def sd3_transformer_inputs(model, batch=1, size=(8, 8), txt_tokens=8, seed=1, device=None):
    """Fresh random ``SD3Transformer2DModel`` inputs: latents of ``size`` (128x128 for a 1024x1024 image), text
    states, pooled projections and a timestep in the scheduler's range."""
    device = device or next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    inputs = dict(
        hidden_states=torch.randn(batch, cfg.in_channels, *size, generator=gen).to(dtype),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.joint_attention_dim, generator=gen).to(dtype),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=gen).to(dtype),
        timestep=(torch.rand(batch, generator=gen) * 1000).to(dtype),
    )
    return {k: v.to(device) for k, v in inputs.items()}


# https://huggingface.co/Qwen/Qwen-Image/blob/main/transformer/config.json (the class defaults); a tiny config with
# the same layout (rotary axes summing to the head dim)
QWEN_IMAGE_CONFIG = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                         num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                         axes_dims_rope=(16, 56, 56))
TINY_QWEN_IMAGE_CONFIG = dict(QWEN_IMAGE_CONFIG, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                              num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
QWEN_IMAGE_CONFIGS = {"qwen-image": QWEN_IMAGE_CONFIG, "qwen-image-tiny": TINY_QWEN_IMAGE_CONFIG}


def build_qwenimage_transformer(config="qwen-image-tiny", dtype=torch.bfloat16, device="cpu", seed=0, **overrides):
    """A ``QwenImageTransformer2DModel`` from a named config (``"qwen-image"``, ``"qwen-image-tiny"``) or a dict,
    random weights."""
    from diffusers import QwenImageTransformer2DModel

    return _random_model(QwenImageTransformer2DModel, QWEN_IMAGE_CONFIGS, config, dtype, device, seed, overrides)


def qwenimage_transformer_inputs(model, batch=1, grid=(4, 4), txt_tokens=8, seed=1, device=None, padding=0,
                                 edit_grids=()):
    """Fresh random ``QwenImageTransformer2DModel`` inputs as ``QwenImagePipeline`` passes them: packed latents on a
    ``grid`` (64x64 for 1024x1024), text states with their mask (the last `padding` tokens of the first prompt
    masked out), ``timestep / 1000`` and ``img_shapes``; `edit_grids` appends reference-image latents as the Edit
    pipelines do (the ``zero_cond_t`` models modulate those tokens with the second timestep)."""
    device = device or next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    shapes = [(1, *grid), *((1, *g) for g in edit_grids)]
    tokens = sum(f * h * w for f, h, w in shapes)
    mask = _text_mask(batch, txt_tokens, padding)
    inputs = dict(
        hidden_states=torch.randn(batch, tokens, cfg.in_channels, generator=gen).to(dtype),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.joint_attention_dim, generator=gen).to(dtype),
        encoder_hidden_states_mask=mask,
        timestep=torch.rand(batch, generator=gen).to(dtype),
    )
    inputs = {k: v.to(device) for k, v in inputs.items()}
    inputs["img_shapes"] = [shapes] * batch
    return inputs


# https://huggingface.co/hunyuanvideo-community/HunyuanVideo/blob/main/transformer/config.json and HunyuanImage-2.1's
# (https://huggingface.co/hunyuanvideo-community/HunyuanImage-2.1-Diffusers/blob/main/transformer/config.json); tiny
# configs with the same layout (rotary axes summing to the head dim, a refiner, guidance or a second text encoder)
HUNYUAN_VIDEO_CONFIG = dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128,
                            num_layers=20, num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2,
                            patch_size_t=1, qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096,
                            pooled_projection_dim=768, rope_theta=256.0, rope_axes_dim=(16, 56, 56))
TINY_HUNYUAN_VIDEO_CONFIG = dict(HUNYUAN_VIDEO_CONFIG, in_channels=4, out_channels=4, num_attention_heads=2,
                                 attention_head_dim=16, num_layers=2, num_single_layers=2, num_refiner_layers=1,
                                 text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(4, 6, 6))
HUNYUAN_IMAGE_CONFIG = dict(in_channels=64, out_channels=64, num_attention_heads=28, attention_head_dim=128,
                            num_layers=20, num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=(1, 1),
                            qk_norm="rms_norm", guidance_embeds=False, text_embed_dim=3584, text_embed_2_dim=1472,
                            rope_theta=256.0, rope_axes_dim=(64, 64))
TINY_HUNYUAN_IMAGE_CONFIG = dict(HUNYUAN_IMAGE_CONFIG, in_channels=8, out_channels=8, num_attention_heads=2,
                                 attention_head_dim=16, num_layers=2, num_single_layers=2, num_refiner_layers=1,
                                 text_embed_dim=32, text_embed_2_dim=24, rope_axes_dim=(8, 8))
HUNYUAN_CONFIGS = {"hunyuan-video": HUNYUAN_VIDEO_CONFIG, "hunyuan-video-tiny": TINY_HUNYUAN_VIDEO_CONFIG,
                   "hunyuan-image": HUNYUAN_IMAGE_CONFIG, "hunyuan-image-tiny": TINY_HUNYUAN_IMAGE_CONFIG}


def build_hunyuan_transformer(config="hunyuan-video-tiny", dtype=torch.bfloat16, device="cpu", seed=0, **overrides):
    """A ``HunyuanVideoTransformer3DModel`` (configs ``"hunyuan-video"``, ``"hunyuan-video-tiny"``) or
    ``HunyuanImageTransformer2DModel`` (``"hunyuan-image"``, ``"hunyuan-image-tiny"``), random weights."""
    from diffusers import HunyuanImageTransformer2DModel, HunyuanVideoTransformer3DModel

    cls = HunyuanImageTransformer2DModel if config.startswith("hunyuan-image") else HunyuanVideoTransformer3DModel
    return _random_model(cls, HUNYUAN_CONFIGS, config, dtype, device, seed, overrides)


def hunyuan_transformer_inputs(model, batch=1, grid=(4, 4), txt_tokens=8, seed=1, device=None, frames=1, padding=0):
    """Fresh random inputs as the HunyuanVideo / HunyuanImage-2.1 pipelines pass them: latents on a ``grid`` (video:
    ``frames`` latent frames, 2x2 patches; image: 1x1 patches), text states with their mask (the last `padding`
    tokens of the first prompt masked out), the timestep in the scheduler's range, and HunyuanVideo's pooled text
    projection and embedded guidance or HunyuanImage's second text encoder."""
    device = device or next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    video = "pooled_projection_dim" in cfg
    shape = (batch, cfg.in_channels, frames, *grid) if video else (batch, cfg.in_channels, *grid)
    mask = _text_mask(batch, txt_tokens, padding)
    inputs = dict(
        hidden_states=torch.randn(*shape, generator=gen).to(dtype),
        timestep=(torch.rand(batch, generator=gen) * 1000).to(dtype),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.text_embed_dim, generator=gen).to(dtype),
        encoder_attention_mask=mask,
    )
    if video:
        inputs["pooled_projections"] = torch.randn(batch, cfg.pooled_projection_dim, generator=gen).to(dtype)
    elif cfg.text_embed_2_dim:
        inputs["encoder_hidden_states_2"] = torch.randn(batch, 4, cfg.text_embed_2_dim, generator=gen).to(dtype)
        inputs["encoder_attention_mask_2"] = torch.ones(batch, 4, dtype=torch.long)
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), 6000.0).to(dtype)
    return {k: v.to(device) for k, v in inputs.items()}


# HunyuanVideo-1.5 480p (https://huggingface.co/hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v: the
# class defaults, 54 dual-stream blocks of 16 x 128; target_size and task_type change no compute); a tiny config with
# the same layout
HUNYUAN_VIDEO15_CONFIG = dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128,
                              num_layers=54, num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1,
                              qk_norm="rms_norm", text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152,
                              rope_theta=256.0, rope_axes_dim=(16, 56, 56))
TINY_HUNYUAN_VIDEO15_CONFIG = dict(HUNYUAN_VIDEO15_CONFIG, in_channels=9, out_channels=4, num_attention_heads=2,
                                   attention_head_dim=16, num_layers=2, num_refiner_layers=1, text_embed_dim=32,
                                   text_embed_2_dim=24, image_embed_dim=16, rope_axes_dim=(4, 6, 6))
HUNYUAN_VIDEO15_CONFIGS = {"hunyuanvideo-1.5": HUNYUAN_VIDEO15_CONFIG, "hunyuanvideo-1.5-tiny": TINY_HUNYUAN_VIDEO15_CONFIG}


def build_hunyuan_video15_transformer(config="hunyuanvideo-1.5-tiny", dtype=torch.bfloat16, device="cpu", seed=0,
                                      **overrides):
    """A ``HunyuanVideo15Transformer3DModel`` from a named config (``"hunyuanvideo-1.5"``, ``"hunyuanvideo-1.5-tiny"``)
    or a dict, random weights."""
    from diffusers import HunyuanVideo15Transformer3DModel

    return _random_model(HunyuanVideo15Transformer3DModel, HUNYUAN_VIDEO15_CONFIGS, config, dtype, device, seed,
                         overrides)


def hunyuan_video15_transformer_inputs(model, batch=1, grid=(4, 4), txt_tokens=8, seed=1, device=None, frames=2,
                                       valid=None, txt2_tokens=4, image_tokens=5):
    """Fresh random inputs as ``HunyuanVideo15Pipeline`` (text to video) passes them: latents ``[B, C, F, H, W]`` on a
    ``grid`` (the 16x latent) of ``frames`` latent frames, the noise channels random and the image-condition channels
    zero; Qwen2.5-VL text states of which the first ``valid`` tokens are real (the rest masked; the second prompt
    three shorter), ByT5 glyph states all masked (no quoted text), zero image embeddings; the timestep in [0, 1000)."""
    device = device or next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    noise = torch.randn(batch, cfg.out_channels, frames, *grid, generator=gen)
    cond = torch.zeros(batch, cfg.in_channels - cfg.out_channels, frames, *grid)
    valid = txt_tokens if valid is None else valid
    mask = torch.zeros(batch, txt_tokens, dtype=torch.long)
    for i in range(batch):
        mask[i, :max(1, valid - 3 * i)] = 1
    inputs = dict(
        hidden_states=torch.cat([noise, cond], dim=1).to(dtype),
        timestep=(torch.rand(batch, generator=gen) * 1000).to(dtype),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.text_embed_dim, generator=gen).to(dtype),
        encoder_attention_mask=mask,
        encoder_hidden_states_2=torch.zeros(batch, txt2_tokens, cfg.text_embed_2_dim).to(dtype),
        encoder_attention_mask_2=torch.zeros(batch, txt2_tokens, dtype=torch.long),
        image_embeds=torch.zeros(batch, image_tokens, cfg.image_embed_dim).to(dtype),
    )
    return {k: v.to(device) for k, v in inputs.items()}


# https://huggingface.co/Tongyi-MAI/Z-Image-Turbo/blob/main/transformer/config.json (the class defaults); a tiny config
# with the same layout
Z_IMAGE_CONFIG = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                      n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                      rope_theta=256.0, t_scale=1000.0, axes_dims=(32, 48, 48), axes_lens=(1024, 512, 512))
TINY_Z_IMAGE_CONFIG = dict(Z_IMAGE_CONFIG, in_channels=4, dim=768, n_layers=2, n_refiner_layers=1, n_heads=6,
                           n_kv_heads=6, cap_feat_dim=32, axes_dims=(32, 48, 48), axes_lens=(64, 32, 32))
# (dim 768: a row length inside the RMSNorm kernel's reproduced reduction (a multiple of 128 above 512), as 3840; and
# the feed-forward's int(dim / 3 * 8) = 2048 keeps the SwiGLU's rows whole 16-byte vectors, as 3840's 10240)
Z_IMAGE_CONFIGS = {"z-image": Z_IMAGE_CONFIG, "z-image-tiny": TINY_Z_IMAGE_CONFIG}


def build_zimage_transformer(config="z-image-tiny", dtype=torch.bfloat16, device="cpu", seed=0, **overrides):
    """A ``ZImageTransformer2DModel`` from a named config (``"z-image"``, ``"z-image-tiny"``) or a dict, random
    weights."""
    from diffusers import ZImageTransformer2DModel

    return _random_model(ZImageTransformer2DModel, Z_IMAGE_CONFIGS, config, dtype, device, seed, overrides)


def zimage_transformer_inputs(model, batch=1, grid=(8, 8), txt_tokens=8, seed=1, device=None):
    """Fresh random ``ZImageTransformer2DModel`` inputs as ``ZImagePipeline`` passes them: one latent ``[C, 1, H, W]``
    per sample (``grid`` = the 8x latent: 128x128 for 1024x1024), ``(1000 - t) / 1000`` timesteps, and one caption
    embedding per sample (the second one shorter, as prompts of different lengths give)."""
    device = device or next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    return dict(
        x=[torch.randn(cfg.in_channels, 1, *grid, generator=gen).to(device, dtype) for _ in range(batch)],
        t=torch.rand(batch, generator=gen).to(device, dtype),
        cap_feats=[torch.randn(max(1, txt_tokens - 3 * i), cfg.cap_feat_dim, generator=gen).to(device, dtype)
                   for i in range(batch)],
    )


# https://huggingface.co/Alpha-VLLM/Lumina-Image-2.0/blob/main/transformer/config.json (Gemma-2-2B captions: 2304);
# a tiny config (hidden 768, as the tiny Z-Image: a row length inside the RMSNorm kernel's reduction)
LUMINA2_CONFIG = dict(sample_size=128, patch_size=2, in_channels=16, hidden_size=2304, num_layers=26,
                      num_refiner_layers=2, num_attention_heads=24, num_kv_heads=8, multiple_of=256,
                      ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=(32, 32, 32),
                      axes_lens=(300, 512, 512), cap_feat_dim=2304)
TINY_LUMINA2_CONFIG = dict(LUMINA2_CONFIG, sample_size=16, in_channels=4, hidden_size=768, num_layers=2,
                           num_refiner_layers=1, num_attention_heads=6, num_kv_heads=2, axes_dim_rope=(32, 48, 48),
                           axes_lens=(64, 32, 32), cap_feat_dim=32)
LUMINA2_CONFIGS = {"lumina2": LUMINA2_CONFIG, "lumina2-tiny": TINY_LUMINA2_CONFIG}


def build_lumina2_transformer(config="lumina2-tiny", dtype=torch.bfloat16, device="cpu", seed=0, **overrides):
    """A ``Lumina2Transformer2DModel`` from a named config (``"lumina2"``, ``"lumina2-tiny"``) or a dict, random
    weights."""
    from diffusers import Lumina2Transformer2DModel

    return _random_model(Lumina2Transformer2DModel, LUMINA2_CONFIGS, config, dtype, device, seed, overrides)


def lumina2_transformer_inputs(model, batch=1, grid=(8, 8), txt_tokens=8, seed=1, device=None):
    """Fresh random ``Lumina2Transformer2DModel`` inputs as ``Lumina2Pipeline`` passes them: latents ``[B, C, H, W]``
    (``grid`` = the 8x latent: 128x128 for 1024x1024), timesteps in [0, 1), caption embeddings and their boolean
    mask (the second prompt shorter: its last tokens masked)."""
    device = device or next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    return dict(
        hidden_states=torch.randn(batch, cfg.in_channels, *grid, generator=gen).to(device, dtype),
        timestep=torch.rand(batch, generator=gen).to(device, dtype),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.cap_feat_dim, generator=gen).to(device, dtype),
        encoder_attention_mask=_text_mask(batch, txt_tokens, min(3, txt_tokens - 1) if batch > 1 else 0).bool().to(device),
    )


# https://huggingface.co/Lightricks/LTX-Video/blob/main/transformer/config.json (the class defaults); a tiny config
LTX_VIDEO_CONFIG = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                        attention_head_dim=64, cross_attention_dim=2048, num_layers=28, activation_fn="gelu-approximate",
                        qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6,
                        caption_channels=4096, attention_bias=True, attention_out_bias=True)
TINY_LTX_VIDEO_CONFIG = dict(LTX_VIDEO_CONFIG, in_channels=8, out_channels=8, num_attention_heads=2,
                             attention_head_dim=16, cross_attention_dim=32, num_layers=2, caption_channels=24)
LTX_VIDEO_CONFIGS = {"ltx-video": LTX_VIDEO_CONFIG, "ltx-video-tiny": TINY_LTX_VIDEO_CONFIG}


def build_ltx_transformer(config="ltx-video-tiny", dtype=torch.bfloat16, device="cpu", seed=0, **overrides):
    """An ``LTXVideoTransformer3DModel`` from a named config (``"ltx-video"``, ``"ltx-video-tiny"``) or a dict,
    random weights."""
    from diffusers import LTXVideoTransformer3DModel

    return _random_model(LTXVideoTransformer3DModel, LTX_VIDEO_CONFIGS, config, dtype, device, seed, overrides)


def ltx_transformer_inputs(model, batch=1, grid=(4, 4), frames=2, txt_tokens=8, seed=1, device=None, padding=0):
    """Fresh random ``LTXVideoTransformer3DModel`` inputs as ``LTXPipeline`` passes them: packed latents of
    ``frames`` x ``grid`` tokens (1x1 patches of the 32x, 8-frame latent: 512x768x121 gives 16x24x16), text states
    with their mask (the last `padding` tokens of the first prompt masked out), the timestep, and the latent sizes."""
    device = device or next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    mask = _text_mask(batch, txt_tokens, padding)
    inputs = dict(
        hidden_states=torch.randn(batch, frames * grid[0] * grid[1], cfg.in_channels, generator=gen).to(dtype),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.caption_channels, generator=gen).to(dtype),
        timestep=(torch.rand(batch, generator=gen) * 1000).to(dtype),
        encoder_attention_mask=mask,
    )
    return dict({k: v.to(device) for k, v in inputs.items()}, num_frames=frames, height=grid[0], width=grid[1])


# https://huggingface.co/Wan-AI/Wan2.1-T2V-14B-Diffusers/blob/main/transformer/config.json; a tiny config of the same
# layout (the rotary splits the head dim in three: 16 -> 8 + 4 + 4)
WAN_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
                  text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                  rope_max_seq_len=1024)
TINY_WAN_CONFIG = dict(WAN_CONFIG, num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                       text_dim=32, ffn_dim=64, num_layers=2)
WAN_CONFIGS = {"wan-14b": WAN_CONFIG, "wan-tiny": TINY_WAN_CONFIG}


def build_wan_transformer(config="wan-tiny", dtype=torch.bfloat16, device="cpu", seed=0, **overrides):
    """A ``WanTransformer3DModel`` from a named config (``"wan-14b"``: Wan 2.1 T2V 14B, ``"wan-tiny"``) or a dict,
    random weights."""
    from diffusers import WanTransformer3DModel

    return _random_model(WanTransformer3DModel, WAN_CONFIGS, config, dtype, device, seed, overrides)


def wan_transformer_inputs(model, batch=1, grid=(4, 4), frames=2, txt_tokens=8, seed=1, device=None, padding=0):
    """Fresh random ``WanTransformer3DModel`` inputs as ``WanPipeline`` passes them: latents ``[B, C, frames, *grid]``
    (2x2 patches; 832x480x81 is 21 x 60 x 104: 32,760 tokens), the timestep, and text states whose last `padding`
    tokens of the first prompt are zeros (the pipeline pads every prompt to 512 tokens with zeros, no mask)."""
    device = device or next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    text = torch.randn(batch, txt_tokens, cfg.text_dim, generator=gen) * _text_mask(batch, txt_tokens, padding)[..., None]
    inputs = dict(
        hidden_states=torch.randn(batch, cfg.in_channels, frames, *grid, generator=gen).to(dtype),
        timestep=(torch.rand(batch, generator=gen) * 1000).to(dtype),
        encoder_hidden_states=text.to(dtype),
    )
    return {k: v.to(device) for k, v in inputs.items()}


# FLUX.1's architecture under other names (models/flux_clones.py): tiny configs, and the published configs at the
# class defaults (LongCat-Image, Ovis-Image; Bria 3.2 at FLUX.1's size)
_TINY_FLUX_LIKE = dict(in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                       joint_attention_dim=32, axes_dims_rope=(4, 4, 8))
FLUX_CLONE_CONFIGS = {
    "LongCatImageTransformer2DModel": dict(_TINY_FLUX_LIKE, pooled_projection_dim=32),
    "OvisImageTransformer2DModel": dict(_TINY_FLUX_LIKE, out_channels=4),
    "BriaTransformer2DModel": dict(_TINY_FLUX_LIKE),
    "BriaFiboTransformer2DModel": dict(_TINY_FLUX_LIKE, text_encoder_dim=24),
}


def build_flux_clone(class_name: str, dtype=torch.bfloat16, device="cpu", seed=0, tiny=True, **overrides):
    """One of the FLUX-architecture transformers of `FLUX_CLONE_CONFIGS` by class name, tiny (or at the class
    defaults, ``tiny=False``), random weights."""
    import diffusers

    config = FLUX_CLONE_CONFIGS[class_name] if tiny else {}
    return _random_model(getattr(diffusers, class_name), FLUX_CLONE_CONFIGS, config, dtype, device, seed, overrides)


def flux_clone_inputs(model, batch=1, grid=(4, 4), txt_tokens=8, seed=1, device=None):
    """Fresh random inputs for a `build_flux_clone` model: FLUX's latents and ids, a timestep, and pooled projections
    or (Bria-FIBO) one text-encoder layer per block where the model takes them."""
    import inspect

    device = device or next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(_latents_and_ids(model.config, batch, grid, txt_tokens, gen, dtype),
                  timestep=torch.rand(batch, generator=gen).to(dtype))
    if "pooled_projections" in inspect.signature(model.forward).parameters and model.config.get("pooled_projection_dim"):
        inputs["pooled_projections"] = torch.randn(batch, model.config.pooled_projection_dim, generator=gen).to(dtype)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    if "text_encoder_layers" in inspect.signature(model.forward).parameters:
        cfg = model.config
        inputs["text_encoder_layers"] = [
            torch.randn(batch, txt_tokens, cfg.text_encoder_dim, generator=gen).to(device, dtype)
            for _ in range(cfg.num_layers + cfg.num_single_layers)]
    return inputs


def build_ernie_image_transformer(config="ernie-image-tiny", dtype=torch.bfloat16, device="cpu", seed=0, **overrides):
    """An ``ErnieImageTransformer2DModel`` from a named config (``"ernie-image"``, ``"ernie-image-tiny"``) or a
    dict, every parameter random (the model zero-initialises its modulation and output layers)."""
    from diffusers import ErnieImageTransformer2DModel

    return _random_model(ErnieImageTransformer2DModel, ERNIE_IMAGE_CONFIGS, config, dtype, device, seed, overrides)


def ernie_image_inputs(model, batch=1, grid=(8, 8), text_lens=(12,), seed=1, device=None):
    """Fresh random ``ErnieImageTransformer2DModel`` inputs: latents on a ``grid`` (64x64 for 1024x1024) and
    per-sample text lengths (padded to the longest, as the pipeline does)."""
    device = device or next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    lens = (list(text_lens) * batch)[:batch]
    text = torch.zeros(batch, max(lens), cfg.text_in_dim)
    for i, n in enumerate(lens):
        text[i, :n] = torch.randn(n, cfg.text_in_dim, generator=gen)
    inputs = dict(
        hidden_states=torch.randn(batch, cfg.in_channels, *grid, generator=gen).to(dtype),
        timestep=(torch.rand(batch, generator=gen) * 1000).to(dtype),
        text_bth=text.to(dtype),
        text_lens=torch.tensor(lens, dtype=torch.long),
    )
    return {k: v.to(device) for k, v in inputs.items()}


def flux_transformer_inputs(model, batch=1, grid=(4, 4), txt_tokens=8, seed=1, device=None):
    """Fresh random transformer inputs, as ``FluxPipeline`` passes them: ``grid`` is the packed latent grid
    (64x64 for a 1024x1024 image), image ids laid out on it, zero text ids."""
    device = device or next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    dtype = next(model.parameters()).dtype
    inputs = dict(
        _latents_and_ids(cfg, batch, grid, txt_tokens, gen, dtype),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=gen).to(dtype),
        timestep=torch.rand(batch, generator=gen).to(dtype),
    )
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), 3.5)
    return {k: v.to(device) for k, v in inputs.items()}


# https://huggingface.co/black-forest-labs/FLUX.1-dev/blob/main/vae/config.json
FLUX_VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    act_fn="silu",
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
# FLUX's 8x downsampling (four blocks, as FluxPipeline's vae_scale_factor assumes) with 8 channels; the
# latent_channels of a tiny pipeline follow its transformer (in_channels // 4).
TINY_FLUX_VAE_CONFIG = dict(
    sample_size=32,
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 8, 8, 8),
    layers_per_block=1,
    latent_channels=1,
    norm_num_groups=4,
    use_quant_conv=False,
    use_post_quant_conv=False,
    shift_factor=0.0609,
    scaling_factor=1.5035,
)
FLUX_VAE_CONFIGS = {"flux-dev": FLUX_VAE_CONFIG, "flux-tiny": TINY_FLUX_VAE_CONFIG}


def build_flux_vae(config="flux-tiny", dtype=torch.bfloat16, device="cpu", seed=0, **overrides):
    """An ``AutoencoderKL`` from a named config (``"flux-dev"``: FLUX.1's published VAE; ``"flux-tiny"``) or a dict,
    random weights."""
    from diffusers import AutoencoderKL

    return _random_model(AutoencoderKL, FLUX_VAE_CONFIGS, config, dtype, device, seed, overrides)


def flux_pipeline(transformer, vae):
    """A ``FluxPipeline`` around `transformer` and `vae` with no text encoders: call it with `prompt_embeddings`."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer,
    )


def tiny_flux_pipeline(transformer=None, dtype=torch.bfloat16, device="cpu", seed=0):
    """A ``FluxPipeline`` with a tiny random VAE (FLUX's 8x downsampling, 8 channels) and no text encoders: call it
    with `prompt_embeddings`. Works with any FLUX transformer, the full-size one included."""
    transformer = transformer if transformer is not None else build_flux_transformer("flux-tiny", dtype, device, seed)
    vae = build_flux_vae("flux-tiny", dtype, device, seed + 1, latent_channels=transformer.config.in_channels // 4)
    return flux_pipeline(transformer, vae)


def flux_dev_pipeline(transformer=None, dtype=torch.bfloat16, device="cpu", seed=0):
    """A ``FluxPipeline`` with FLUX.1-dev's transformer and VAE configs, random weights, no text encoders: call it
    with `prompt_embeddings` (``txt_tokens=512`` as FLUX.1-dev's T5 gives)."""
    transformer = transformer if transformer is not None else build_flux_transformer("flux-dev", dtype, device, seed)
    return flux_pipeline(transformer, build_flux_vae("flux-dev", dtype, device, seed + 1))


def prompt_embeddings(pipe, batch=1, txt_tokens=8, seed=2, device=None):
    """Random ``prompt_embeds``/``pooled_prompt_embeds`` for a pipeline without text encoders, on `device` (default:
    the transformer's; with model offloading, give the execution device: ``FluxPipeline`` does not move given
    embeddings)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = pipe.transformer.config
    dtype = pipe.transformer.dtype
    device = device or pipe.transformer.device
    return dict(
        prompt_embeds=torch.randn(batch, txt_tokens, cfg.joint_attention_dim, generator=gen).to(device, dtype),
        pooled_prompt_embeds=torch.randn(batch, cfg.pooled_projection_dim, generator=gen).to(device, dtype),
    )


def zimage_pipeline(transformer):
    """A ``ZImagePipeline`` around `transformer` with no VAE or text encoder: call it with `caption_embeddings`
    (lists) and ``output_type="latent"``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    return ZImagePipeline(transformer=transformer, vae=None, text_encoder=None, tokenizer=None,
                          scheduler=FlowMatchEulerDiscreteScheduler())


def lumina2_pipeline(transformer):
    """A ``Lumina2Pipeline`` around `transformer` with no VAE or text encoder: call it with `caption_embeddings`
    (``masked=True``) and ``output_type="latent"``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline

    return Lumina2Pipeline(transformer=transformer, vae=None, text_encoder=None, tokenizer=None,
                           scheduler=FlowMatchEulerDiscreteScheduler())


def caption_embeddings(pipe, lengths=(10, 4), seed=2, masked=False):
    """Random caption embeddings for one prompt and its negative, of the given token counts: as lists of ``[L, D]``
    (Z-Image), or ``masked``: ``[1, L, D]`` padded to the longer with their ``[1, L]`` masks (Lumina2)."""
    gen = torch.Generator().manual_seed(seed)
    cfg, dtype, device = pipe.transformer.config, pipe.transformer.dtype, pipe.transformer.device
    if not masked:
        pos, neg = (torch.randn(n, cfg.cap_feat_dim, generator=gen).to(device, dtype) for n in lengths)
        return dict(prompt_embeds=[pos], negative_prompt_embeds=[neg])
    width = max(lengths)
    embeds = [torch.randn(1, width, cfg.cap_feat_dim, generator=gen).to(device, dtype) for _ in lengths]
    masks = [(torch.arange(width) < n).long()[None].to(device) for n in lengths]
    return dict(prompt_embeds=embeds[0], prompt_attention_mask=masks[0], negative_prompt_embeds=embeds[1],
                negative_prompt_attention_mask=masks[1])


def assert_pipeline_generation_exact_and_fused(pipe, call: dict) -> None:
    """A 3-step generation of `pipe` (CFG as `call` asks) patched is md5-identical to unpatched on the latents, with
    every site taking its fast path (on a CPU: under emulated kernels) and never falling back; `pipe` is unpatched
    again afterwards."""
    import hashlib

    from . import patch, report, unpatch

    pipe.set_progress_bar_config(disable=True)

    def generate():
        out = pipe(**call, height=128, width=128, num_inference_steps=3, generator=torch.Generator().manual_seed(1),
                   output_type="latent")
        return hashlib.md5(out.images.float().cpu().numpy().tobytes()).hexdigest()

    ref = generate()
    patch(pipe)
    try:
        assert generate() == ref
        sites = report(pipe).sites
        assert sites and all(s.fast > 0 and s.fallback == 0 for s in sites), str(report(pipe))
    finally:
        unpatch(pipe)


def ernie_image_pipeline(transformer):
    """An ``ErnieImagePipeline`` around `transformer` with no VAE or text encoder: call it with
    `ernie_prompt_embeddings` and ``output_type="latent"``."""
    from diffusers import ErnieImagePipeline, FlowMatchEulerDiscreteScheduler

    return ErnieImagePipeline(
        transformer=transformer, vae=None, text_encoder=None, tokenizer=None, scheduler=FlowMatchEulerDiscreteScheduler()
    )


def ernie_prompt_embeddings(pipe, lengths=(12, 5), seed=2):
    """Random ``prompt_embeds``/``negative_prompt_embeds`` (one prompt) of the given token counts."""
    gen = torch.Generator().manual_seed(seed)
    dim = pipe.transformer.config.text_in_dim
    dtype, device = pipe.transformer.dtype, pipe.transformer.device
    pos, neg = (torch.randn(n, dim, generator=gen).to(device, dtype) for n in lengths)
    return dict(prompt_embeds=[pos], negative_prompt_embeds=[neg])
