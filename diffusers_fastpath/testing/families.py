"""The other families, from their published configs with random weights: ERNIE-Image, SD3.5, Qwen-Image,
HunyuanVideo / HunyuanImage-2.1 / HunyuanVideo-1.5, Z-Image, Lumina-Image 2.0, LTX-Video, Wan; their pipelines
without text encoders where the tests drive one."""

from __future__ import annotations

import torch

from ._common import _random_model, _text_mask
from ._common import _quiet_image_processor_fallback


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


# https://huggingface.co/stabilityai/stable-diffusion-3.5-large/blob/main/transformer/config.json; a tiny config with
# SD3.5's QK RMSNorm and one dual-attention block (SD3.5 medium's layout)
SD35_LARGE_CONFIG = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                         num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                         pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm")
TINY_SD3_CONFIG = dict(sample_size=16, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=64,  # SD3.5's
                       num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=128,
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
# head dim 128 as in the published config: the QK norm + complex rotary kernel takes only that row length
TINY_QWEN_IMAGE_CONFIG = dict(QWEN_IMAGE_CONFIG, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=128,
                              num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(16, 56, 56))
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
# the tiny ones at the published head_dim 128, the one the fused QK norm's reduction order is reproduced for
TINY_HUNYUAN_VIDEO_CONFIG = dict(HUNYUAN_VIDEO_CONFIG, in_channels=4, out_channels=4, num_attention_heads=2,
                                 attention_head_dim=128, num_layers=2, num_single_layers=2, num_refiner_layers=1,
                                 text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(16, 56, 56))
HUNYUAN_IMAGE_CONFIG = dict(in_channels=64, out_channels=64, num_attention_heads=28, attention_head_dim=128,
                            num_layers=20, num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=(1, 1),
                            qk_norm="rms_norm", guidance_embeds=False, text_embed_dim=3584, text_embed_2_dim=1472,
                            rope_theta=256.0, rope_axes_dim=(64, 64))
TINY_HUNYUAN_IMAGE_CONFIG = dict(HUNYUAN_IMAGE_CONFIG, in_channels=8, out_channels=8, num_attention_heads=2,
                                 attention_head_dim=128, num_layers=2, num_single_layers=2, num_refiner_layers=1,
                                 text_embed_dim=32, text_embed_2_dim=24, rope_axes_dim=(64, 64))
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
# head dim 128 as published: the QK norm + rotary kernel takes only that row length
TINY_HUNYUAN_VIDEO15_CONFIG = dict(HUNYUAN_VIDEO15_CONFIG, in_channels=9, out_channels=4, num_attention_heads=2,
                                   attention_head_dim=128, num_layers=2, num_refiner_layers=1, text_embed_dim=32,
                                   text_embed_2_dim=24, image_embed_dim=16, rope_axes_dim=(16, 56, 56))
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
# a tiny config (hidden 768, as the tiny Z-Image: a row length inside the RMSNorm kernel's reduction; 8 heads of 96,
# 2 key/value heads, as the published config's head_dim and grouping)
LUMINA2_CONFIG = dict(sample_size=128, patch_size=2, in_channels=16, hidden_size=2304, num_layers=26,
                      num_refiner_layers=2, num_attention_heads=24, num_kv_heads=8, multiple_of=256,
                      ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=(32, 32, 32),
                      axes_lens=(300, 512, 512), cap_feat_dim=2304)
TINY_LUMINA2_CONFIG = dict(LUMINA2_CONFIG, sample_size=16, in_channels=4, hidden_size=768, num_layers=2,
                           num_refiner_layers=1, num_attention_heads=8, num_kv_heads=2, axes_dim_rope=(32, 32, 32),
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
    cfg = model.config
    # the rotary table's positions: a caption's tokens count 0..L-1 and every image token sits at L on the first axis,
    # rows and columns of patches on the others; past the table, eager's gather asserts on the GPU
    rows, cols = grid[0] // cfg.patch_size, grid[1] // cfg.patch_size
    if txt_tokens >= cfg.axes_lens[0] or rows > cfg.axes_lens[1] or cols > cfg.axes_lens[2]:
        raise ValueError(f"Lumina2Transformer2DModel's rotary table (axes_lens={tuple(cfg.axes_lens)}) holds fewer than "
                         f"{txt_tokens} + 1 caption positions or {rows}x{cols} patches: give fewer text tokens "
                         f"(Lumina2Pipeline's max_sequence_length is 256) or a smaller image")
    device = device or next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(batch, cfg.in_channels, *grid, generator=gen).to(device, dtype),
        timestep=torch.rand(batch, generator=gen).to(device, dtype),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.cap_feat_dim, generator=gen).to(device, dtype),
        encoder_attention_mask=_text_mask(batch, txt_tokens, min(3, txt_tokens - 1) if batch > 1 else 0).bool().to(device),
    )


# https://huggingface.co/Lightricks/LTX-Video/blob/main/transformer/config.json (the class defaults); a tiny config
# whose hidden size (5 heads of 128: 640) is in the RMSNorm kernel's domain (a multiple of 128 above 512), so that
# the RMSNorm + modulate sites run their fast path
LTX_VIDEO_CONFIG = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                        attention_head_dim=64, cross_attention_dim=2048, num_layers=28, activation_fn="gelu-approximate",
                        qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6,
                        caption_channels=4096, attention_bias=True, attention_out_bias=True)
TINY_LTX_VIDEO_CONFIG = dict(LTX_VIDEO_CONFIG, in_channels=8, out_channels=8, num_attention_heads=5,
                             attention_head_dim=128, cross_attention_dim=640, num_layers=2, caption_channels=24)
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


@_quiet_image_processor_fallback()
def sd3_pipeline(transformer):
    """A ``StableDiffusion3Pipeline`` around `transformer` with no VAE or text encoders: call it with
    `sd3_prompt_embeddings` and ``output_type="latent"``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    return StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                                    vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                                    tokenizer_2=None, text_encoder_3=None, tokenizer_3=None)


def sd3_prompt_embeddings(pipe, tokens=12, seed=2):
    """Random prompt and negative-prompt embeddings (``tokens`` each: CLIP's 77 + T5's 256 at full size) and their
    pooled projections, for `sd3_pipeline` with CFG."""
    gen = torch.Generator().manual_seed(seed)
    cfg, dtype, device = pipe.transformer.config, pipe.transformer.dtype, pipe.transformer.device

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    return dict(prompt_embeds=rand(1, tokens, cfg.joint_attention_dim),
                negative_prompt_embeds=rand(1, tokens, cfg.joint_attention_dim),
                pooled_prompt_embeds=rand(1, cfg.pooled_projection_dim),
                negative_pooled_prompt_embeds=rand(1, cfg.pooled_projection_dim))


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


def qwenimage_pipeline(transformer):
    """A ``QwenImagePipeline`` around `transformer` with no VAE or text encoder: call it with
    `qwenimage_prompt_embeddings` and ``output_type="latent"``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                             transformer=transformer)


def qwenimage_prompt_embeddings(pipe, lengths=(12, 9), padding=2, seed=2):
    """Random prompt and negative-prompt embeddings with their masks (the prompt's last `padding` tokens masked out),
    of the given token counts, for `qwenimage_pipeline` with ``true_cfg_scale``."""
    gen = torch.Generator().manual_seed(seed)
    cfg, dtype, device = pipe.transformer.config, pipe.transformer.dtype, pipe.transformer.device
    pos, neg = (torch.randn(1, n, cfg.joint_attention_dim, generator=gen).to(device, dtype) for n in lengths)
    return dict(prompt_embeds=pos, prompt_embeds_mask=_text_mask(1, lengths[0], padding).to(device),
                negative_prompt_embeds=neg, negative_prompt_embeds_mask=_text_mask(1, lengths[1], 0).to(device))


def wan_pipeline(transformer):
    """A ``WanPipeline`` (Wan 2.1: one transformer) around `transformer`, no VAE or text encoder: call it with
    ``prompt_embeds``/``negative_prompt_embeds`` of the transformer's ``text_dim`` and ``output_type="latent"``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    return WanPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=None,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0))


def ltx_pipeline(transformer):
    """An ``LTXPipeline`` around `transformer`, no VAE or text encoder: call it with `ltx_prompt_embeddings` and
    ``output_type="latent"`` (the packed latents)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXPipeline

    return LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                       transformer=transformer)


def ltx_prompt_embeddings(pipe, tokens=12, padding=3, seed=2):
    """Random prompt and negative-prompt embeddings of `tokens` tokens with their masks (the prompt's last `padding`
    tokens masked out, as T5's padding is), for `ltx_pipeline` with CFG."""
    gen = torch.Generator().manual_seed(seed)
    cfg, dtype, device = pipe.transformer.config, pipe.transformer.dtype, pipe.transformer.device
    pos, neg = (torch.randn(1, tokens, cfg.caption_channels, generator=gen).to(device, dtype) for _ in range(2))
    return dict(prompt_embeds=pos, prompt_attention_mask=_text_mask(1, tokens, padding).to(device),
                negative_prompt_embeds=neg, negative_prompt_attention_mask=_text_mask(1, tokens, 0).to(device))


def hunyuan_video_pipeline(transformer):
    """A ``HunyuanVideoPipeline`` around `transformer` (its embedded guidance; true CFG when called with
    ``true_cfg_scale`` > 1 and negative embeddings), no VAE or text encoders: call it with
    `hunyuan_video_prompt_embeddings` and ``output_type="latent"``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline

    return HunyuanVideoPipeline(text_encoder=None, tokenizer=None, transformer=transformer, vae=None,
                                scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=None,
                                tokenizer_2=None)


def hunyuan_video_prompt_embeddings(pipe, tokens=12, padding=3, seed=2):
    """Random Llama prompt and negative-prompt states of `tokens` tokens with their masks (the prompt's last
    `padding` tokens masked out) and CLIP pooled projections, for `hunyuan_video_pipeline` with ``true_cfg_scale``."""
    gen = torch.Generator().manual_seed(seed)
    cfg, dtype, device = pipe.transformer.config, pipe.transformer.dtype, pipe.transformer.device

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    return dict(prompt_embeds=rand(1, tokens, cfg.text_embed_dim),
                prompt_attention_mask=_text_mask(1, tokens, padding).to(device),
                pooled_prompt_embeds=rand(1, cfg.pooled_projection_dim),
                negative_prompt_embeds=rand(1, tokens, cfg.text_embed_dim),
                negative_prompt_attention_mask=_text_mask(1, tokens, 0).to(device),
                negative_pooled_prompt_embeds=rand(1, cfg.pooled_projection_dim))


def hunyuan_video15_pipeline(transformer):
    """A ``HunyuanVideo15Pipeline`` around `transformer` with classifier-free guidance (its guider), no text encoders
    and a tiny random VAE (only its config is read for ``output_type="latent"``): call it with
    `hunyuan_video15_prompt_embeddings`."""
    from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
    from diffusers.guiders import ClassifierFreeGuidance

    vae = AutoencoderKLHunyuanVideo15(latent_channels=transformer.config.out_channels, block_out_channels=(8,) * 5,
                                      layers_per_block=1)
    return HunyuanVideo15Pipeline(text_encoder=None, tokenizer=None, transformer=transformer, vae=vae,
                                  scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder_2=None, tokenizer_2=None,
                                  guider=ClassifierFreeGuidance(guidance_scale=6.0))


def hunyuan_video15_prompt_embeddings(pipe, tokens=12, valid=9, tokens_2=6, valid_2=3, seed=2):
    """Random Qwen2.5-VL and ByT5 prompt and negative-prompt embeddings with their masks (the prompt's first `valid`
    and `valid_2` tokens real, the rest padding; the negative prompt's all real), for `hunyuan_video15_pipeline`."""
    gen = torch.Generator().manual_seed(seed)
    cfg, dtype, device = pipe.transformer.config, pipe.transformer.dtype, pipe.transformer.device

    def embeds(n, dim):
        return torch.randn(1, n, dim, generator=gen).to(device, dtype)

    def mask(n, v):  # the first v of n tokens real
        return _text_mask(1, n, n - v).to(device)

    return dict(prompt_embeds=embeds(tokens, cfg.text_embed_dim), prompt_embeds_mask=mask(tokens, valid),
                negative_prompt_embeds=embeds(tokens, cfg.text_embed_dim),
                negative_prompt_embeds_mask=mask(tokens, tokens),
                prompt_embeds_2=embeds(tokens_2, cfg.text_embed_2_dim), prompt_embeds_mask_2=mask(tokens_2, valid_2),
                negative_prompt_embeds_2=embeds(tokens_2, cfg.text_embed_2_dim),
                negative_prompt_embeds_mask_2=mask(tokens_2, tokens_2))


def wan22_pipeline(transformer, transformer_2, boundary_ratio=0.5):
    """A ``WanPipeline`` with Wan 2.2's two experts (`transformer` for the high-noise steps, `transformer_2` after
    `boundary_ratio`), no VAE or text encoder: call it with ``prompt_embeds``/``negative_prompt_embeds`` of the
    transformer's ``text_dim`` and ``output_type="latent"``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    return WanPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=None,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), transformer_2=transformer_2,
                       boundary_ratio=boundary_ratio)


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
