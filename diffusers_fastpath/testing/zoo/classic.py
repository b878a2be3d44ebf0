"""The classes of the BasicTransformerBlock / CogVideoX era (2023-2024), video and image: CogVideoX, ConsisID,
EasyAnimate, Mochi, Allegro, Latte, PixArt, DiT, HunyuanDiT, Lumina-Next, OmniGen. Several have no
``_repeated_blocks`` / ``_no_split_modules`` and take rotary tables their pipelines make (made here by the pipelines'
own helpers, not copies of them)."""

from __future__ import annotations

import types

import torch

from ._entry import ZooEntry, latent_frames

_T = "diffusers.models.transformers."
_1024 = dict(height=1024, width=1024)


def _pipeline_rope(pipeline_cls, model, height, width, frames, vae_spatial=8):
    """The rotary tables a pipeline makes for its transformer, by the pipeline's own method (not a copy of it)."""
    fake = types.SimpleNamespace(transformer=model, vae_scale_factor_spatial=vae_spatial)
    return pipeline_cls._prepare_rotary_positional_embeddings(fake, height, width, frames, model.device)


def _cogvideox_inputs(model, d, batch, frames=9, height=64, width=64, text=8):
    # CogVideoXPipeline: frame-major latents (B, F, C, H, W), integer DDIM timesteps, T5 226 tokens at full size,
    # the 3-D rotary tables the pipeline makes (CogVideoX-5B / 1.5 layout)
    from diffusers import CogVideoXPipeline

    cfg = model.config
    f = latent_frames(frames)
    kw = dict(hidden_states=d.randn(batch, f, cfg.in_channels, height // 8, width // 8),
              encoder_hidden_states=d.randn(batch, text, cfg.text_embed_dim), timestep=d.randint(1000, batch),
              return_dict=False)
    if cfg.use_rotary_positional_embeddings:
        kw["image_rotary_emb"] = _pipeline_rope(CogVideoXPipeline, model, height, width, f)
    return kw


def _consisid_inputs(model, d, batch, frames=9, height=64, width=64, text=8):
    # ConsisIDPipeline: as CogVideoX (I2V: noise + image latents = 2 C channels) plus the face identity: id_cond
    # (ArcFace 512 + CLIP 768) and the EVA-CLIP hidden states of LFE_num_scale layers
    from diffusers.pipelines.consisid.pipeline_consisid import ConsisIDPipeline  # diffusers.ConsisIDPipeline: a dummy

    cfg = model.config
    f = latent_frames(frames)
    return dict(hidden_states=d.randn(batch, f, cfg.in_channels, height // 8, width // 8),
                encoder_hidden_states=d.randn(batch, text, cfg.text_embed_dim), timestep=d.randint(1000, batch),
                image_rotary_emb=_pipeline_rope(ConsisIDPipeline, model, height, width, f),
                id_cond=d.randn(batch, cfg.LFE_id_dim),
                id_vit_hidden=[d.randn(batch, 5, cfg.LFE_vit_dim) for _ in range(cfg.LFE_num_scale)],
                return_dict=False)


def _easyanimate_inputs(model, d, batch, frames=9, height=64, width=64, text=8):
    # EasyAnimatePipeline: (B, C, F, H, W) latents, t (DDIM-style integers as floats) in the model dtype,
    # Qwen2-VL text states
    cfg = model.config
    return dict(hidden_states=d.randn(batch, cfg.in_channels, latent_frames(frames), height // 8, width // 8),
                timestep=d.to(d.randint(1000, batch).float()), encoder_hidden_states=d.randn(batch, text,
                                                                                           cfg.text_embed_dim),
                return_dict=False)


def _mochi_inputs(model, d, batch, frames=13, height=64, width=64, text=8):
    # MochiPipeline: (B, 12, F, H, W) latents (temporal ratio 6), T5 256 tokens with mask, t = 1000 - sigma x 1000
    # cast to the latents' dtype (fp32: Mochi's pipeline keeps latents in fp32)
    cfg = model.config
    return dict(hidden_states=d.randn(batch, cfg.in_channels, latent_frames(frames, 6), height // 8, width // 8),
                encoder_hidden_states=d.randn(batch, text, cfg.text_embed_dim),
                timestep=d.rand(batch, scale=1000.0, dtype=torch.float32),
                encoder_attention_mask=d.mask(batch, text), return_dict=False)


def _allegro_inputs(model, d, batch, frames=9, height=64, width=64, text=8):
    # AllegroPipeline: (B, 4, F, H, W) latents, T5 512 tokens with mask, integer timesteps
    cfg = model.config
    return dict(hidden_states=d.randn(batch, cfg.in_channels, latent_frames(frames), height // 8, width // 8),
                encoder_hidden_states=d.randn(batch, text, cfg.caption_channels), timestep=d.randint(1000, batch),
                encoder_attention_mask=d.mask(batch, text), return_dict=False)


def _latte_inputs(model, d, batch, frames=4, height=64, width=64, text=8):
    # LattePipeline: (B, 4, F, H, W) latents (no temporal compression), T5 120 tokens (no mask: the model's mask
    # path breaks on its frame-repeated batch), integer t
    cfg = model.config
    return dict(hidden_states=d.randn(batch, cfg.in_channels, frames, height // 8, width // 8),
                encoder_hidden_states=d.randn(batch, text, cfg.caption_channels), timestep=d.randint(1000, batch),
                return_dict=False)


def _pixart_inputs(model, d, batch, height=64, width=64, text=8):
    # PixArtSigmaPipeline: (B, 4, H, W) latents, T5 300 tokens with mask, integer t, no resolution conditions
    cfg = model.config
    return dict(hidden_states=d.randn(batch, cfg.in_channels, height // 8, width // 8),
                encoder_hidden_states=d.randn(batch, text, cfg.caption_channels), timestep=d.randint(1000, batch),
                added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                encoder_attention_mask=d.mask(batch, text), return_dict=False)


def _dit_inputs(model, d, batch, height=64, width=64):
    # DiTPipeline: (B, 4, H, W) latents, integer t, ImageNet class labels
    cfg = model.config
    return dict(hidden_states=d.randn(batch, cfg.in_channels, height // 8, width // 8), timestep=d.randint(1000, batch),
                class_labels=d.randint(1000, batch), return_dict=False)


def _hunyuandit_inputs(model, d, batch, height=64, width=64, text=8, text_t5=8):
    # HunyuanDiTPipeline: (B, 4, H, W) latents, CLIP and mT5 states with masks, integer t in the latents' dtype,
    # image meta sizes (B, 6),
    # style, and the 2-D rotary the pipeline makes with diffusers' get_2d_rotary_pos_embed
    from diffusers.models.embeddings import get_2d_rotary_pos_embed
    from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid

    cfg = model.config
    gh, gw = height // 8 // cfg.patch_size, width // 8 // cfg.patch_size
    crops = get_resize_crop_region_for_grid((gh, gw), 512 // 8 // cfg.patch_size)
    rope = get_2d_rotary_pos_embed(model.inner_dim // model.num_heads, crops, (gh, gw), device=d.device,
                                   output_type="pt")
    meta = torch.tensor([[height, width, height, width, 0, 0]] * batch, dtype=torch.float32)
    return dict(hidden_states=d.randn(batch, cfg.in_channels, height // 8, width // 8),
                timestep=d.to(d.randint(1000, batch).float()),
                encoder_hidden_states=d.randn(batch, text, cfg.cross_attention_dim),
                text_embedding_mask=d.mask(batch, text),
                encoder_hidden_states_t5=d.randn(batch, text_t5, cfg.cross_attention_dim_t5),
                text_embedding_mask_t5=d.mask(batch, text_t5), image_meta_size=d.to(meta),
                style=d.to(torch.zeros(batch, dtype=torch.long)), image_rotary_emb=rope, return_dict=False)


def _lumina_next_inputs(model, d, batch, height=64, width=64, text=8):
    # LuminaPipeline: (B, 4, H, W) latents, Gemma text with mask, t = 1 - t / 1000 (0 = noise), and the 2-D rotary
    # the pipeline makes with diffusers' get_2d_rotary_pos_embed_lumina over a 384 x 384 grid
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    cfg = model.config
    return dict(hidden_states=d.randn(batch, cfg.in_channels, height // 8, width // 8), timestep=d.rand(batch),
                encoder_hidden_states=d.randn(batch, text, cfg.cross_attention_dim),
                encoder_mask=d.mask(batch, text), image_rotary_emb=get_2d_rotary_pos_embed_lumina(
                    model.head_dim, 384, 384).to(d.device), cross_attention_kwargs={}, return_dict=False)


def _omnigen_inputs(model, d, batch, height=64, width=64, text=8, images=1):
    # OmniGenPipeline: Phi-3 token ids of the instruction, where each sample's first `images` reference image
    # (half the output size) replaces placeholder tokens 1.. of its text (input_image_sizes: sample -> [start, end]);
    # one attention mask over [text | time token | image tokens] (causal text, full images), positions 0..n-1,
    # t on [0, 1]; images=0 is text-to-image
    cfg = model.config
    p = cfg.patch_size
    n_img = (height // 8 // p) * (width // 8 // p)
    n_ref = (height // 16 // p) * (width // 16 // p)
    n = text + 1 + n_img
    mask = torch.tril(torch.ones(n, n))
    mask[text:, text:] = 1
    spans = [[1 + i * n_ref, 1 + (i + 1) * n_ref] for i in range(images)]
    for s, e in spans:
        mask[s:e, s:e] = 1
    refs = [d.randn(1, cfg.in_channels, height // 16, width // 16) for _ in range(images * batch)]
    return dict(hidden_states=d.randn(batch, cfg.in_channels, height // 8, width // 8), timestep=d.rand(batch),
                input_ids=d.randint(cfg.vocab_size, batch, text), input_img_latents=refs,
                input_image_sizes={b: spans for b in range(batch)} if images else {},
                attention_mask=d.to(mask.expand(batch, n, n).contiguous()),
                position_ids=d.to(torch.arange(n).expand(batch, n).contiguous()), return_dict=False)


ENTRIES = {
    "cogvideox": ZooEntry(
        _T + "cogvideox_transformer_3d.CogVideoXTransformer3DModel",
        dict(num_attention_heads=2, attention_head_dim=64, in_channels=16, out_channels=16, time_embed_dim=64,
             text_embed_dim=64, num_layers=2, sample_width=8, sample_height=8, sample_frames=9,
             use_rotary_positional_embeddings=True),
        _cogvideox_inputs,
        full_config=dict(num_attention_heads=48, num_layers=42, use_rotary_positional_embeddings=True),
        full_size=dict(frames=49, height=480, width=720, text=226),
        notes="CogVideoX-5B (THUDM/CogVideoX-5b transformer/config.json: 48 x 64, 42 layers, 3-D rotary); the class "
              "defaults are the 2B. Rotary tables from CogVideoXPipeline's own helper; integer timesteps."),
    "consisid": ZooEntry(
        _T + "consisid_transformer_3d.ConsisIDTransformer3DModel",
        # 6 x 64 = 384 wide: the face cross-attention's K/V width is 2/3 of it (2048 of 3072 at full size) and must
        # equal LFE_output_dim
        dict(num_attention_heads=6, attention_head_dim=64, in_channels=32, out_channels=16, time_embed_dim=64,
             text_embed_dim=64, num_layers=2, sample_width=8, sample_height=8, sample_frames=9,
             use_rotary_positional_embeddings=True, is_train_face=True, cross_attn_interval=1, cross_attn_dim_head=64,
             cross_attn_num_heads=2, LFE_id_dim=64, LFE_vit_dim=64, LFE_depth=2, LFE_dim_head=32, LFE_num_heads=2,
             LFE_num_id_token=2, LFE_num_querie=4, LFE_output_dim=256, LFE_ff_mult=1, LFE_num_scale=2),
        _consisid_inputs,
        notes="ConsisID (CogVideoX-5B I2V + a face adapter: local facial extractor and face cross-attention every "
              "cross_attn_interval blocks); no published config in the zoo. Rotary tables from ConsisIDPipeline's "
              "helper (imported from its module: diffusers.ConsisIDPipeline is a dummy without its optional deps). No "
              "_repeated_blocks / _no_split_modules: the blocks are found from the module tree only."),
    "easyanimate": ZooEntry(
        _T + "transformer_easyanimate.EasyAnimateTransformer3DModel",
        dict(num_attention_heads=2, attention_head_dim=64, in_channels=16, out_channels=16, num_layers=2,
             mmdit_layers=2, patch_size=2, time_embed_dim=64, text_embed_dim=64, time_position_encoding_type="3d_rope"),
        _easyanimate_inputs,
        notes="EasyAnimate V5.1 layout (3-D rope, MMDiT blocks); no published config in the zoo (~12 B at 3072 x 48). "
              "The first block's stream is a transposed view (not contiguous)."),
    "mochi": ZooEntry(
        _T + "transformer_mochi.MochiTransformer3DModel",
        dict(num_attention_heads=2, attention_head_dim=64, num_layers=2, pooled_projection_dim=64, in_channels=12,
             text_embed_dim=64, time_embed_dim=64, max_sequence_length=8),
        _mochi_inputs, full_config={}, full_size=dict(frames=163, height=480, width=848, text=256),
        notes="Mochi 1 = the class defaults (10 B). fp32 RMSNorm * scale and tanh gates inside its norm modules; the "
              "last block is context_pre_only; the text must fit max_sequence_length; pipeline latents in fp32; its "
              "rotary runs under torch.autocast(float32), which CPU autocast ignores (warns)."),
    "allegro": ZooEntry(
        _T + "transformer_allegro.AllegroTransformer3DModel",
        dict(num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4, num_layers=2,
             cross_attention_dim=128, caption_channels=64, sample_height=8, sample_width=8, sample_frames=3),
        _allegro_inputs, full_config={}, full_size=dict(frames=88, height=720, width=1280, text=512),
        notes="Allegro = the class defaults (2.8 B). Own block class (gates found by the rewriter); "
              "AdaLayerNormSingle. No _repeated_blocks / _no_split_modules: the blocks are found from the module tree "
              "only."),
    "latte": ZooEntry(
        _T + "latte_transformer_3d.LatteTransformer3DModel",
        dict(num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=8, num_layers=2,
             cross_attention_dim=128, sample_size=8, patch_size=2, activation_fn="gelu-approximate",
             num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
             caption_channels=64, video_length=4),
        _latte_inputs,
        full_config=dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
                         cross_attention_dim=1152, sample_size=64, patch_size=2, activation_fn="gelu-approximate",
                         num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False,
                         norm_eps=1e-6, caption_channels=4096, video_length=16),
        full_size=dict(frames=16, height=512, width=512, text=120),
        notes="Latte-1 (from memory of maxin-cn/Latte-1: PixArt-alpha's blocks, spatial and temporal alternated). "
              "BasicTransformerBlock with AdaLayerNormSingle; learn-sigma output (8 = 2 x 4 channels). Its text mask "
              "path fails on the frame-repeated batch (the pipeline passes none). No _repeated_blocks / "
              "_no_split_modules: the blocks are found from the module tree only."),
    "pixart": ZooEntry(
        _T + "pixart_transformer_2d.PixArtTransformer2DModel",
        dict(num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=8, num_layers=2,
             cross_attention_dim=128, sample_size=8, caption_channels=64, interpolation_scale=1),
        _pixart_inputs,
        full_config=dict(sample_size=128, caption_channels=4096, interpolation_scale=2,
                         use_additional_conditions=False),
        full_size=dict(_1024, text=300),
        notes="PixArt-Sigma-XL-2-1024-MS: the class defaults (16 x 72 = 1152, 28 layers) at sample 128, T5 4096, "
              "interpolation 2, no resolution conditions. BasicTransformerBlock with AdaLayerNormSingle: gates in `if "
              "norm_type` branches. The first block's stream is a transposed view (not contiguous)."),
    "dit": ZooEntry(
        _T + "dit_transformer_2d.DiTTransformer2DModel",
        dict(num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=8, num_layers=2,
             sample_size=8),
        _dit_inputs, full_config=dict(out_channels=8, sample_size=64), full_size=dict(height=512, width=512),
        notes="DiT-XL-2-512: the class defaults (16 x 72, 28 layers) at sample 64, learn-sigma output. "
              "BasicTransformerBlock with AdaLayerNormZero (class labels). No _repeated_blocks / _no_split_modules: "
              "the blocks are found from the module tree only."),
    "hunyuan-dit": ZooEntry(
        _T + "hunyuan_transformer_2d.HunyuanDiT2DModel",
        dict(num_attention_heads=2, attention_head_dim=64, in_channels=4, patch_size=2, hidden_size=128, num_layers=2,
             cross_attention_dim=64, cross_attention_dim_t5=64, pooled_projection_dim=64, text_len=8, text_len_t5=8,
             sample_size=8),
        _hunyuandit_inputs, full_size=dict(_1024, text=77, text_t5=256),
        notes="HunyuanDiT (v1.x layout: shift-only AdaLayerNormShift, long skips, 2-D rotary from the pipeline's "
              "get_2d_rotary_pos_embed); no published config in the zoo. Its text pooler calls "
              "F.multi_head_attention_forward with the pooler's weights (module hooks never see them). No "
              "_repeated_blocks / _no_split_modules: the blocks are found from the module tree only."),
    "lumina-next": ZooEntry(
        _T + "lumina_nextdit2d.LuminaNextDiT2DModel",
        dict(sample_size=8, patch_size=2, in_channels=4, hidden_size=640, num_layers=2, num_attention_heads=5,
             num_kv_heads=1, multiple_of=16, cross_attention_dim=64),
        _lumina_next_inputs, full_config=dict(num_layers=24, num_kv_heads=8), full_size=dict(_1024, text=256),
        notes="Lumina-Next-SFT: the class defaults (2304 wide, 32 heads) with 24 layers and 8 KV heads (from memory of "
              "Alpha-VLLM/Lumina-Next-SFT-diffusers; the class defaults alone do not build: num_kv_heads None). RMS + "
              "scale and tanh gates (LuminaRMSNormZero, shared with Lumina2); rotary from the pipeline's "
              "get_2d_rotary_pos_embed_lumina (384 x 384 grid). No _repeated_blocks / _no_split_modules: the blocks "
              "are found from the module tree only."),
    "omnigen": ZooEntry(
        _T + "transformer_omnigen.OmniGenTransformer2DModel",
        dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256, num_layers=2,
             pad_token_id=0, vocab_size=1000, in_channels=4, time_step_dim=64,
             rope_scaling={"long_factor": [1.0] * 32, "short_factor": [1.0] * 32}),
        _omnigen_inputs,
        notes="OmniGen v1 (Phi-3 LLM backbone, 3072 x 32, no adaLN); no published config in the zoo (its rope_scaling "
              "factors are a checkpoint fact). Token ids in, a reference image's tokens written over placeholder ids "
              "(editing: input_image_proj runs); one (B, N, N) float mask. Its patch embedding's pos_embed is an fp32 "
              "persistent buffer: without the checkpoint's bf16 copy, bf16 latents + it promote to fp32 and the next "
              "linear fails (build loads it in bf16, as from_pretrained does)."),
}
