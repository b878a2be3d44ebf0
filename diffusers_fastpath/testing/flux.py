"""The FLUX architecture's families, from their published configs with random weights: FLUX.1, Chroma, the FLUX
clones, FLUX.2; FLUX.1's and FLUX.2's VAEs and the FLUX, Chroma, FLUX.2 and FLUX-clone (Ovis-Image, Bria) pipelines
without text encoders."""

from __future__ import annotations

import torch

from ._common import _random_model, _latents_and_ids
from ._common import _quiet_image_processor_fallback


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
# https://huggingface.co/black-forest-labs/FLUX.1-schnell/blob/main/transformer/config.json: FLUX.1-dev's blocks
# without the guidance embedding (timestep-distilled, 1-4 steps). Its scheduler config (shift 1.0, no dynamic
# shifting) is FlowMatchEulerDiscreteScheduler's default, which `flux_pipeline` builds; its VAE is FLUX.1-dev's.
FLUX_SCHNELL_CONFIG = dict(FLUX_DEV_CONFIG, guidance_embeds=False)
FLUX_CONFIGS = {"flux-dev": FLUX_DEV_CONFIG, "flux-schnell": FLUX_SCHNELL_CONFIG, "flux-tiny": TINY_FLUX_CONFIG}


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


def build_flux_transformer(config="flux-tiny", dtype=torch.bfloat16, device="cpu", seed=0, **overrides):
    """A ``FluxTransformer2DModel`` from a named config (``"flux-dev"``, ``"flux-schnell"``, ``"flux-tiny"``) or a
    dict, random weights."""
    from diffusers import FluxTransformer2DModel

    return _random_model(FluxTransformer2DModel, FLUX_CONFIGS, config, dtype, device, seed, overrides)


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


@_quiet_image_processor_fallback()
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
# FLUX.2-klein-4B: 5 dual + 20 single blocks at hidden 3072 (24 heads), 128 latent channels, Qwen3-4B text (three
# hidden layers of 2560 stacked: 7680), no guidance embedding (the distilled model). diffusers ships no copy of its
# config.json; these are the published block counts and widths (black-forest-labs/FLUX.2-klein-4B)
FLUX2_KLEIN_CONFIG = dict(FLUX2_DEV_CONFIG, num_layers=5, num_single_layers=20, num_attention_heads=24,
                          joint_attention_dim=7680, guidance_embeds=False)
TINY_FLUX2_KLEIN_CONFIG = dict(TINY_FLUX2_CONFIG, guidance_embeds=False)  # klein's structure: no guidance embedding
FLUX2_CONFIGS = {"flux2-dev": FLUX2_DEV_CONFIG, "flux2-klein": FLUX2_KLEIN_CONFIG, "flux2-tiny": TINY_FLUX2_CONFIG,
                 "flux2-klein-tiny": TINY_FLUX2_KLEIN_CONFIG}


def build_flux2_transformer(config="flux2-tiny", dtype=torch.bfloat16, device="cpu", seed=0, **overrides):
    """A ``Flux2Transformer2DModel`` from a named config (``"flux2-dev"``, ``"flux2-klein"``, ``"flux2-tiny"``,
    ``"flux2-klein-tiny"``) or a dict, random weights."""
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


# https://huggingface.co/black-forest-labs/FLUX.2-dev/blob/main/vae/config.json: diffusers' class defaults (four blocks
# of 128 to 512 channels, 32 latent channels, the quant convs, a batch norm over the 2x2-patchified latents, whose
# running stats Flux2Pipeline (de)normalises with); FLUX.2-klein uses the same VAE. A tiny one with the same structure
# (the 8x downsampling Flux2Pipeline's vae_scale_factor assumes, 8 channels); the latent_channels of a tiny pipeline
# follow its transformer (in_channels // 4)
FLUX2_VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    act_fn="silu",
    latent_channels=32,
    norm_num_groups=32,
    sample_size=1024,
    use_quant_conv=True,
    use_post_quant_conv=True,
    mid_block_add_attention=True,
    batch_norm_eps=1e-4,
    batch_norm_momentum=0.1,
    patch_size=(2, 2),
)
TINY_FLUX2_VAE_CONFIG = dict(FLUX2_VAE_CONFIG, block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=2,
                             norm_num_groups=4, sample_size=32)
FLUX2_VAE_CONFIGS = {"flux2-dev": FLUX2_VAE_CONFIG, "flux2-tiny": TINY_FLUX2_VAE_CONFIG}


def build_flux2_vae(config="flux2-tiny", dtype=torch.bfloat16, device="cpu", seed=0, **overrides):
    """An ``AutoencoderKLFlux2`` from a named config (``"flux2-dev"``: FLUX.2's published VAE, klein's too;
    ``"flux2-tiny"``) or a dict, random weights, and random running stats in its latent batch norm (a buffer,
    not a parameter: at its init of zero mean and unit variance the pipeline's (de)normalisation would be the
    identity)."""
    from diffusers import AutoencoderKLFlux2

    vae = _random_model(AutoencoderKLFlux2, FLUX2_VAE_CONFIGS, config, dtype, device, seed, overrides)
    gen = torch.Generator().manual_seed(seed)
    bn = vae.bn
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(bn.num_features, generator=gen) * 0.5)
        bn.running_var.copy_(torch.rand(bn.num_features, generator=gen) * 1.5 + 0.25)
    return vae


def flux2_pipeline(transformer, vae):
    """A FLUX.2 pipeline around `transformer` and `vae` with no text encoder: call it with
    `flux2_prompt_embeddings`. ``Flux2Pipeline`` for a transformer with a guidance embedding (FLUX.2-dev, the
    tiny config), ``Flux2KleinPipeline`` (step-distilled: no CFG, no guidance) for one without (FLUX.2-klein)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline

    parts = dict(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                 transformer=transformer)
    if transformer.config.guidance_embeds:
        return Flux2Pipeline(**parts)
    return Flux2KleinPipeline(**parts, is_distilled=True)


def tiny_flux2_pipeline(transformer=None, dtype=torch.bfloat16, device="cpu", seed=0):
    """A FLUX.2 pipeline (`flux2_pipeline`) with a tiny random VAE (8x downsampling, 8 channels, random latent
    batch-norm stats) and no text encoder: call it with `flux2_prompt_embeddings`. Works with any FLUX.2
    transformer, the full-size ones included."""
    transformer = transformer if transformer is not None else build_flux2_transformer("flux2-tiny", dtype, device, seed)
    vae = build_flux2_vae("flux2-tiny", dtype, device, seed + 1, latent_channels=transformer.config.in_channels // 4)
    return flux2_pipeline(transformer, vae)


def flux2_prompt_embeddings(pipe, batch=1, txt_tokens=8, seed=2, device=None):
    """Random ``prompt_embeds`` for a FLUX.2 pipeline without a text encoder (``joint_attention_dim`` wide: the
    text encoder's three hidden layers stacked), on `device` (default: the transformer's); for klein's distilled
    pipeline with ``guidance_scale=1.0``, as its model card calls it (above 1 it is ignored, with a warning)."""
    gen = torch.Generator().manual_seed(seed)
    dim = pipe.transformer.config.joint_attention_dim
    dtype, device = pipe.transformer.dtype, device or pipe.transformer.device
    call = dict(prompt_embeds=torch.randn(batch, txt_tokens, dim, generator=gen).to(device, dtype))
    if not pipe.transformer.config.guidance_embeds:
        call["guidance_scale"] = 1.0
    return call


# FLUX.1's architecture under other names (models/flux_clones.py): tiny configs, and the published configs at the
# class defaults (LongCat-Image, Ovis-Image; Bria 3.2 at FLUX.1's size)
_TINY_FLUX_LIKE = dict(in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                       joint_attention_dim=32, axes_dims_rope=(4, 4, 8))
FLUX_CLONE_CONFIGS = {
    "LongCatImageTransformer2DModel": dict(_TINY_FLUX_LIKE, pooled_projection_dim=32),
    "OvisImageTransformer2DModel": dict(_TINY_FLUX_LIKE, out_channels=4),
    "BriaTransformer2DModel": dict(_TINY_FLUX_LIKE),
    # head dim 128: its single blocks' diffusers RMSNorm + rotary kernel takes only that row length
    "BriaFiboTransformer2DModel": dict(_TINY_FLUX_LIKE, text_encoder_dim=24, attention_head_dim=128,
                                       axes_dims_rope=(16, 56, 56)),
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


# The FLUX clones' pipelines that run from given embeddings (no text encoder), by transformer class. LongCat-Image's
# and Bria-FIBO's do not (diffusers 0.42): `FLUX_CLONES_WITHOUT_PIPELINE` says why
FLUX_CLONE_PIPELINES = {"OvisImageTransformer2DModel": "OvisImagePipeline", "BriaTransformer2DModel": "BriaPipeline"}
FLUX_CLONES_WITHOUT_PIPELINE = {
    "LongCatImageTransformer2DModel": "LongCatImagePipeline takes prompt_embeds but its encode_prompt calls "
                                      "len(prompt) on prompt=None first, a TypeError (diffusers 0.42.1)",
    "BriaFiboTransformer2DModel": "BriaFiboPipeline takes no prompt embeddings: its __call__ always runs the "
                                  "text encoder (SmolLM3) on the prompt",
}


@_quiet_image_processor_fallback()
def flux_clone_pipeline(transformer, vae):
    """The pipeline of a `build_flux_clone` transformer (`FLUX_CLONE_PIPELINES`: ``OvisImagePipeline``,
    ``BriaPipeline``) around it and `vae` (an ``AutoencoderKL`` of FLUX.1's kind, `build_flux_vae`), with no text
    encoder: call it with `flux_clone_prompt_embeddings`. LongCat-Image's and Bria-FIBO's pipelines cannot run
    without their text encoders (`FLUX_CLONES_WITHOUT_PIPELINE`): a ``ValueError`` says why."""
    import diffusers

    name = type(transformer).__name__
    if name in FLUX_CLONES_WITHOUT_PIPELINE:
        raise ValueError(f"no pipeline without a text encoder for {name}: {FLUX_CLONES_WITHOUT_PIPELINE[name]}")
    return getattr(diffusers, FLUX_CLONE_PIPELINES[name])(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
        transformer=transformer)


def tiny_flux_clone_pipeline(name, transformer=None, dtype=torch.bfloat16, device="cpu", seed=0):
    """`flux_clone_pipeline` for the clone `name` (a transformer class name of `FLUX_CLONE_PIPELINES`) with a tiny
    random VAE (FLUX's 8x downsampling, 8 channels, ``in_channels // 4`` latent channels) and no text encoder: call
    it with `flux_clone_prompt_embeddings`. Works with any transformer of that class, the full-size ones included."""
    transformer = transformer if transformer is not None else build_flux_clone(name, dtype, device, seed)
    vae = build_flux_vae("flux-tiny", dtype, device, seed + 1, latent_channels=transformer.config.in_channels // 4)
    return flux_clone_pipeline(transformer, vae)


def flux_clone_prompt_embeddings(pipe, batch=1, txt_tokens=8, seed=2, device=None, padding=3):
    """Random ``prompt_embeds`` and ``negative_prompt_embeds`` (``joint_attention_dim`` wide, `txt_tokens` long:
    ``BriaPipeline`` wants the two of one shape) for a `flux_clone_pipeline`, for true classifier-free guidance
    (``guidance_scale`` > 1, both pipelines' default). The prompt's last `padding` tokens are zeros, as both pipelines
    pad their text encoder's output (no attention mask: their transformers take none). For ``OvisImagePipeline``
    also ``negative_prompt=None`` (its default ``""`` with ``negative_prompt_embeds`` is refused). On `device`
    (default: the transformer's)."""
    gen = torch.Generator().manual_seed(seed)
    dim = pipe.transformer.config.joint_attention_dim
    dtype, device = pipe.transformer.dtype, device or pipe.transformer.device
    prompt = torch.randn(batch, txt_tokens, dim, generator=gen)
    prompt[:, txt_tokens - padding:] = 0
    call = dict(prompt_embeds=prompt.to(device, dtype),
                negative_prompt_embeds=torch.randn(batch, txt_tokens, dim, generator=gen).to(device, dtype))
    if type(pipe).__name__ == "OvisImagePipeline":
        call["negative_prompt"] = None
    return call


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


@_quiet_image_processor_fallback()
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
