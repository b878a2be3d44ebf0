"""Image DiTs of 2024-2026: FLUX.3, Qwen-Image 2.1, Krea 2, Ideogram 4, Bria FIBO 2, Sana, CogView3-Plus / CogView4 /
GLM-Image, AuraFlow, PRX, HiDream-I1, NucleusMoE-Image, JoyImage-Edit (and Plus)."""

from __future__ import annotations

import torch

from ._entry import ZooEntry

_T = "diffusers.models.transformers."
_1024 = dict(height=1024, width=1024)


def _flow_t(d, batch):
    """A flow-matching timestep per sample as ``t / 1000`` (on [0, 1)) in the model dtype."""
    return d.rand(batch)


# ---------------------------------------------------------------- 2026 families (facts from new_families_profile.py)

def _flux3_inputs(model, d, batch, height=64, width=64, text=16, cond_images=1):
    # Flux3 modular pipeline: 2x2-packed 128-channel latents (VAE /8), fp32 4-axis ids from the pipeline's own
    # _prepare_image_ids (t, h/2, w/2, l): l = 0 for the image, -1, -2, ... for reference images (image-to-image:
    # the image_cond mode blocks run; cond_images=0 is text-to-image); text ids (0, 0, 0, l); t / 1000
    from diffusers.modular_pipelines.flux3.before_denoise import _prepare_image_ids

    cfg = model.config
    h, w = height // 16, width // 16
    kw = dict(hidden_states=d.randn(batch, h * w, cfg.in_channels),
              encoder_hidden_states=d.randn(batch, text, cfg.joint_attention_dim), timestep=_flow_t(d, batch),
              img_ids=d.to(_prepare_image_ids(h, w, 0.5), torch.float32), txt_ids=d.ids(1, 1, 1, text),
              return_dict=False)
    if cond_images:
        ids = [_prepare_image_ids(h, w, 0.5, l_coord=-(1 + i)) for i in range(cond_images)]
        kw["image_cond_hidden_states"] = d.randn(batch, h * w * cond_images, cfg.cond_in_channels)
        kw["image_cond_ids"] = d.to(torch.cat(ids), torch.float32)
    return kw


def _qwen21_inputs(model, d, batch, height=64, width=64, text=8, cached=False):
    # QwenImage21Pipeline (t2i): 64-channel tokens (VAE /16, no packing), Qwen2.5-VL text (mask None at batch 1; a
    # padded first prompt here), img_mask = text slots + target tokens at 2x2 granularity, t / 1000. cached: the
    # pipeline's steps after the first: a prefill ("extract") forward of these inputs, run here on the model as it
    # is, caches the text prefix's K/V, and the kwargs are a "cached" step's, the target image's tokens alone against
    # that cache (only read: the kwargs serve any number of calls)
    cfg = model.config
    h, w = height // 16, width // 16
    img_mask = torch.ones(batch, text + h * w // 4, dtype=torch.bool)
    img_mask[:, :text] = False
    kw = dict(hidden_states=d.randn(batch, h * w, cfg.in_channels),
              encoder_hidden_states=d.randn(batch, text, cfg.context_in_dim), timestep=_flow_t(d, batch),
              img_shapes=[[(1, h, w)]] * batch, img_mask=d.to(img_mask),
              encoder_hidden_states_mask=d.mask(batch, text) if batch > 1 else None, return_dict=False)
    if not cached:
        return kw
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    cache = QwenImage21KVCache(len(model.transformer_blocks))
    with torch.no_grad():
        model(**kw, kv_cache=cache, kv_cache_mode="extract")
    return dict(kw, kv_cache=cache, kv_cache_mode="cached")



def kv_cached_steps(model, kwargs: dict, latents) -> list:
    """Qwen-Image 2.1's pipeline's first two steps on `model` (`inputs("qwen-image-21", ...)` as `kwargs`): a prefill
    ("extract") then a "cached" step through one `QwenImage21KVCache`, each on its own latents (`latents`: two
    tensors) and timestep; their outputs (cloned)."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    cache = QwenImage21KVCache(len(model.transformer_blocks))
    outs = []
    with torch.no_grad():
        for step, (mode, hidden) in enumerate(zip(("extract", "cached"), latents)):
            step_kwargs = dict(kwargs, hidden_states=hidden, timestep=kwargs["timestep"] * (1 - 0.3 * step))
            outs.append(model(**step_kwargs, kv_cache=cache, kv_cache_mode=mode)[0].clone())
    return outs

def _krea2_inputs(model, d, batch, height=64, width=64, text=16, valid=10):
    # Krea2Pipeline: [prompt | PAD | suffix] (a mask with its padding in the middle), the tapped Qwen3-VL layers
    # (B, L, layers, C), 3-axis positions (text zeros, image rows / cols), t / 1000
    cfg = model.config
    h, w = height // 16, width // 16
    mask = torch.zeros(batch, text, dtype=torch.bool)
    mask[:, :valid - 5] = True
    mask[:, -5:] = True
    mask[1:, :] = True
    img = torch.cartesian_prod(torch.zeros(1), torch.arange(float(h)), torch.arange(float(w)))
    pos = torch.cat([torch.zeros(text, 3), img])
    return dict(hidden_states=d.randn(batch, h * w, cfg.in_channels),
                encoder_hidden_states=d.randn(batch, text, cfg.num_text_layers, cfg.text_hidden_dim),
                timestep=_flow_t(d, batch), position_ids=d.to(pos, torch.float32), encoder_attention_mask=d.to(mask),
                return_dict=False)


def _ideogram4_inputs(model, d, batch, height=64, width=64, text=16, valid=10):
    # Ideogram4Pipeline._prepare_ids: [left pad][text][image] in one sequence; image ids offset by 65536; segment ids
    # (-1 = padding) and indicators (3 = LLM token, 2 = output image); tapped LLM features zero outside the text;
    # t on [0, 1] (0 = noise) in the model dtype
    cfg = model.config
    g = height // 16
    s = text + g * (width // 16)
    off = text - valid
    pos = torch.zeros(batch, s, 3, dtype=torch.long)
    pos[:, off:text] = torch.arange(valid)[:, None]
    pos[:, text:] = torch.cartesian_prod(torch.arange(1), torch.arange(g), torch.arange(width // 16)) + 65536
    seg = torch.full((batch, s), -1, dtype=torch.long)
    seg[:, off:] = 1
    ind = torch.zeros(batch, s, dtype=torch.long)
    ind[:, off:text] = 3
    ind[:, text:] = 2
    feats = d.randn(batch, s, cfg.llm_features_dim)
    feats[:, :off] = 0
    feats[:, text:] = 0
    return dict(hidden_states=d.randn(batch, s, cfg.in_channels), timestep=_flow_t(d, batch),
                encoder_hidden_states=feats, position_ids=d.to(pos), segment_ids=d.to(seg), indicator=d.to(ind),
                return_dict=False)


def _fibo2_inputs(model, d, batch, height=64, width=64, text=8):
    # BriaFibo2Pipeline: (B, C, H, W) latents, one text bundle for the Perceiver plus one per injection block
    # (B, bundles, L, C) with its mask, t / 1000
    cfg = model.config
    bundles = 1 + len(cfg.injection_layer_ids)
    return dict(hidden_states=d.randn(batch, cfg.in_channels, height // 8, width // 8), timestep=_flow_t(d, batch),
                encoder_hidden_states=d.randn(batch, bundles, text, cfg.cap_feat_dim),
                encoder_attention_mask=d.mask(batch, text, dtype=torch.bool), return_dict=False)


# ---------------------------------------------------------------- Sana, CogView, AuraFlow, PRX

def _sana_inputs(model, d, batch, height=128, width=128, text=8):
    # SanaPipeline: DC-AE /32 latents (32 channels), Gemma-2 300 tokens with mask, t x timestep_scale on [0, 1000)
    cfg = model.config
    return dict(hidden_states=d.randn(batch, cfg.in_channels, height // 32, width // 32),
                encoder_hidden_states=d.randn(batch, text, cfg.caption_channels),
                timestep=d.rand(batch, scale=1000.0 * cfg.timestep_scale), encoder_attention_mask=d.mask(batch, text),
                return_dict=False)


def _cogview_inputs(model, d, batch, height=64, width=64, text=8):
    # CogView3PlusPipeline / CogView4Pipeline: (B, 16, H, W) latents, GLM / T5 text, t on [0, 1000), the SDXL-style
    # size conditions (original size, target size, crop top-left) per sample
    cfg = model.config
    size = d.to(torch.tensor([[float(height), float(width)]] * batch))
    kw = dict(hidden_states=d.randn(batch, cfg.in_channels, height // 8, width // 8),
              encoder_hidden_states=d.randn(batch, text, cfg.text_embed_dim), timestep=d.rand(batch, scale=1000.0),
              original_size=size, target_size=size, crop_coords=torch.zeros_like(size), return_dict=False)
    return kw


def _glm_image_inputs(model, d, batch, height=64, width=64, text=8):
    # GlmImagePipeline (t2i): the AR model's prior token per latent patch (dropped for the unconditional pass),
    # glyph text states, t - 1 on [0, 1000), target size and crop
    cfg = model.config
    h, w = height // 8, width // 8
    size = d.to(torch.tensor([[float(height), float(width)]] * batch))
    ids = d.randint(cfg.prior_vq_quantizer_codebook_size, batch, (h // cfg.patch_size) * (w // cfg.patch_size))
    return dict(hidden_states=d.randn(batch, cfg.in_channels, h, w),
                encoder_hidden_states=d.randn(batch, text, cfg.text_embed_dim), prior_token_id=ids,
                prior_token_drop=torch.zeros_like(ids, dtype=torch.bool), timestep=d.rand(batch, scale=999.0),
                target_size=size, crop_coords=torch.zeros_like(size), return_dict=False)


def _auraflow_inputs(model, d, batch, height=64, width=64, text=8):
    # AuraFlowPipeline: (B, 4, H, W) latents, Pile-T5 256 tokens, t / 1000 in the latents' dtype
    cfg = model.config
    return dict(hidden_states=d.randn(batch, cfg.in_channels, height // 8, width // 8),
                encoder_hidden_states=d.randn(batch, text, cfg.joint_attention_dim), timestep=_flow_t(d, batch),
                return_dict=False)


def _prx_inputs(model, d, batch, height=64, width=64, text=8):
    # PRXPipeline: (B, 16, H, W) latents (Flux VAE), T5-Gemma text with its mask, continuous t on [0, 1]
    cfg = model.config
    return dict(hidden_states=d.randn(batch, cfg.in_channels, height // 8, width // 8), timestep=_flow_t(d, batch),
                encoder_hidden_states=d.randn(batch, text, cfg.context_in_dim),
                attention_mask=d.mask(batch, text, dtype=torch.bool), return_dict=False)


# ---------------------------------------------------------------- MoE: HiDream, NucleusMoE

def _hidream_inputs(model, d, batch, height=64, width=64, text=8):
    # HiDreamImagePipeline: (B, 16, H, W) latents, T5 and the tapped Llama-3.1 layers (layers, B, L, C), pooled CLIP,
    # t on [0, 1000)
    cfg = model.config
    layers = max(cfg.llama_layers) + 1
    return dict(hidden_states=d.randn(batch, cfg.in_channels, height // 8, width // 8),
                timesteps=d.rand(batch, scale=1000.0),
                encoder_hidden_states_t5=d.randn(batch, text, cfg.caption_channels[0]),
                encoder_hidden_states_llama3=d.randn(layers, batch, text, cfg.caption_channels[1]),
                pooled_embeds=d.randn(batch, cfg.text_emb_dim), return_dict=False)


def _nucleus_inputs(model, d, batch, height=64, width=64, text=8):
    # NucleusMoEImagePipeline: 2x2-packed tokens (Qwen-Image layout), text with mask, img_shapes, t / 1000
    cfg = model.config
    h, w = height // 16, width // 16
    return dict(hidden_states=d.randn(batch, h * w, cfg.in_channels), img_shapes=[(1, h, w)] * batch,
                encoder_hidden_states=d.randn(batch, text, cfg.joint_attention_dim),
                encoder_hidden_states_mask=d.mask(batch, text), timestep=_flow_t(d, batch), return_dict=False)


# ---------------------------------------------------------------- JoyImage

def _joyimage_inputs(model, d, batch, height=64, width=64, text=8):
    # JoyImageEditPipeline (editing): (B, items, C, T, H, W) with the reference image's latents before the noise,
    # Qwen text, t on [0, 1000)
    cfg = model.config
    return dict(hidden_states=d.randn(batch, 2, cfg.in_channels, 1, height // 16, width // 16),
                timestep=d.rand(batch, scale=1000.0), encoder_hidden_states=d.randn(batch, text, cfg.text_dim),
                return_dict=False)


def _joyimage_plus_inputs(model, d, batch, height=64, width=64, text=8):
    # JoyImageEditPlusPipeline: packed patches (B, N, C, pt, ph, pw) of the target then each reference image (here
    # one at half the height), shape_list per sample in patch units, text with mask, t on [0, 1000)
    cfg = model.config
    pt, ph, pw = cfg.patch_size
    h, w = height // 16 // ph, width // 16 // pw
    shapes = [(1, h, w), (1, max(1, h // 2), w)]
    n = sum(a * b * c for a, b, c in shapes)
    return dict(hidden_states=d.randn(batch, n, cfg.in_channels, pt, ph, pw), timestep=d.rand(batch, scale=1000.0),
                encoder_hidden_states=d.randn(batch, text, cfg.text_dim),
                encoder_hidden_states_mask=d.mask(batch, text), shape_list=[shapes] * batch, return_dict=False)


ENTRIES = {
    "flux3": ZooEntry(
        _T + "transformer_flux3.Flux3Transformer2DModel",
        dict(num_layers=1, num_single_layers=1, attention_head_dim=128, num_attention_heads=2, joint_attention_dim=64,
             axes_dims_rope=(32, 32, 32, 32)),
        _flux3_inputs, full_config={}, full_size=dict(_1024, text=160, cond_images=0),
        notes="FLUX.3 = the class defaults (5 per-mode + 28 joint blocks, 24 x 128, Qwen3-VL 8 x 2560 text). fp32 "
              "islands: norm_q / norm_k (QK norm + rotary in fp32, cast back); per-token LN + modulation rows. The "
              "tiny inputs are image-to-image (one reference: the image_cond mode blocks run), the full ones "
              "text-to-image."),
    "qwen-image-21": ZooEntry(
        _T + "transformer_qwenimage21.QwenImage21Transformer2DModel",
        dict(num_layers=2, attention_head_dim=128, num_attention_heads=2, context_in_dim=64,
             axes_dims_rope=(16, 56, 56)),
        _qwen21_inputs, full_config={}, full_size=dict(_1024, text=256),
        notes="Qwen-Image 2.1 = the class defaults (32 single-stream layers, 32 x 128). The pipeline prefills a text "
              "KV cache at step 0 and runs 'cached' after; the zoo runs the uncached forward (kv_cache None), which "
              "step 0 of the pipeline is; the size knob cached=True gives a later step (bench: --zoo-size cached=1). "
              "Scale-only modulation with per-token row select (torch.where)."),
    "krea2": ZooEntry(
        _T + "transformer_krea2.Krea2Transformer2DModel",
        dict(num_layers=2, attention_head_dim=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256,
             timestep_embed_dim=64, text_hidden_dim=64, num_text_layers=3, text_num_attention_heads=2,
             text_num_key_value_heads=2, text_intermediate_size=128, axes_dims_rope=(16, 24, 24)),
        _krea2_inputs, full_config={}, full_size=dict(_1024, text=512, valid=160),
        notes="Krea 2 = the class defaults (28 layers, 48 x 128 GQA 12 kv heads, 12 tapped Qwen3-VL layers). fp32 "
              "islands: norm, norm1, norm2, norm_q, norm_k (zero-centred fp32 RMSNorms); sigmoid output gate."),
    "ideogram4": ZooEntry(
        _T + "transformer_ideogram4.Ideogram4Transformer2DModel",
        dict(num_layers=2, attention_head_dim=128, num_attention_heads=5, intermediate_size=512, adaln_dim=64,
             llm_features_dim=96, mrope_section=(12, 10, 10)),
        _ideogram4_inputs, full_config={}, full_size=dict(height=2048, width=2048, text=2048, valid=256),
        notes="Ideogram 4 = the class defaults (34 layers, 18 x 256). One sequence [pad | text | image] with segment "
              "ids and indicators; the tiny head dim is 128 (published 256, over the fused RMSNorm's 128 limit)."),
    "bria-fibo2": ZooEntry(
        _T + "transformer_bria_fibo2.BriaFibo2Transformer2DModel",
        dict(in_channels=16, patch_size=2, dim=640, n_layers=2, n_refiner_layers=1, n_heads=5, cap_feat_dim=64,
             injection_layer_ids=(1,), perceiver_num_layers=1, min_num_gist_tokens=4, max_num_gist_tokens=8,
             gist_step=4, gist_min_text_len=4, gist_max_text_len=16, axes_dims=(32, 48, 48), axes_lens=(64, 64, 64)),
        _fibo2_inputs, full_config={}, full_size=dict(_1024, text=512),
        notes="Bria FIBO 2 = the class defaults (3584 x 44, head 128, Z-Image-style sandwich norms, gist Perceiver and "
              "injection blocks with cross-attention). Per-token timesteps in the main blocks."),
    "sana": ZooEntry(
        _T + "sana_transformer.SanaTransformer2DModel",
        dict(in_channels=32, out_channels=32, num_attention_heads=4, attention_head_dim=32, num_layers=2,
             num_cross_attention_heads=2, cross_attention_head_dim=64, cross_attention_dim=128, caption_channels=64,
             sample_size=4),
        _sana_inputs, full_config={}, full_size=dict(_1024, text=300),
        notes="Sana 1600M 1024px = the class defaults (2240 x 20; linear self-attention 70 x 32, cross-attention 20 x "
              "112). Head dim 32 in the linear attention as published; timestep_scale from the config. The first "
              "block's stream is a transposed view of the patch embedding (not contiguous)."),
    "cogview4": ZooEntry(
        _T + "transformer_cogview4.CogView4Transformer2DModel",
        dict(num_layers=2, attention_head_dim=64, num_attention_heads=2, text_embed_dim=64, time_embed_dim=64,
             condition_dim=32, pos_embed_max_size=16, sample_size=16),
        _cogview_inputs,
        full_config=dict(num_layers=28, attention_head_dim=128, num_attention_heads=32, text_embed_dim=4096),
        full_size=dict(_1024, text=256),
        notes="CogView4-6B: 32 x 128, 28 layers, GLM-4 4096 text (THUDM/CogView4-6B transformer/config.json, from "
              "memory: check before quoting); the class defaults are 2560 x 30. SD3-like dual stream; norm1 modulation "
              "with .unsqueeze(1)."),
    "cogview3plus": ZooEntry(
        _T + "transformer_cogview3plus.CogView3PlusTransformer2DModel",
        dict(num_layers=2, attention_head_dim=64, num_attention_heads=2, text_embed_dim=64, time_embed_dim=64,
             condition_dim=32, pos_embed_max_size=16, sample_size=16),
        _cogview_inputs, full_config={}, full_size=dict(_1024, text=224),
        notes="CogView3-Plus-3B = the class defaults (2560 x 30, T5 4096)."),
    "glm-image": ZooEntry(
        _T + "transformer_glm_image.GlmImageTransformer2DModel",
        dict(num_layers=2, attention_head_dim=64, num_attention_heads=2, text_embed_dim=64, time_embed_dim=64,
             condition_dim=32, prior_vq_quantizer_codebook_size=64),
        _glm_image_inputs, full_config={}, full_size=dict(_1024, text=256),
        notes="GLM-Image's diffusion decoder = the class defaults (2560 x 30). Needs the AR model's prior token ids "
              "per latent patch (a pipeline-made input: random ids here); image editing adds a KV cache (not here)."),
    "auraflow": ZooEntry(
        _T + "auraflow_transformer_2d.AuraFlowTransformer2DModel",
        dict(sample_size=8, num_mmdit_layers=1, num_single_dit_layers=1, attention_head_dim=64, num_attention_heads=2,
             joint_attention_dim=64, caption_projection_dim=128, pos_embed_max_size=64),
        _auraflow_inputs, full_config=dict(pos_embed_max_size=9216), full_size=dict(_1024, text=256),
        notes="AuraFlow v0.3: the class defaults (12 x 256 = 3072, 4 MMDiT + 32 single blocks) with pos_embed_max_size "
              "9216 (from memory of fal/AuraFlow-v0.3: 96 x 96 patches, enough for 1024 px). Its norm2s are "
              "FP32LayerNorm."),
    "prx": ZooEntry(
        _T + "transformer_prx.PRXTransformer2DModel",
        dict(in_channels=16, patch_size=2, context_in_dim=64, hidden_size=128, mlp_ratio=3.5, num_heads=2, depth=2,
             axes_dim=[32, 32]),
        _prx_inputs, full_config=dict(axes_dim=[32, 32]), full_size=dict(_1024, text=256),
        notes="PRX 1.2B = the class defaults (1792 x 16, 28 x 64; axes_dim [32, 32] as diffusers' test, the default "
              "None). Matrix-form rope. No _repeated_blocks / _no_split_modules: the blocks are found from the module "
              "tree only."),
    "hidream": ZooEntry(
        _T + "transformer_hidream_image.HiDreamImageTransformer2DModel",
        dict(patch_size=2, in_channels=16, out_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=64,
             num_attention_heads=2, caption_channels=[64, 64], text_emb_dim=64, num_routed_experts=4,
             num_activated_experts=2, axes_dims_rope=(32, 16, 16), max_resolution=(16, 16), llama_layers=[0, 1]),
        _hidream_inputs,
        notes="HiDream-I1 layout (16 dual + 32 single blocks, 20 x 128, MoE SwiGLU: 4 routed experts, 2 active); no "
              "published config in the zoo. Casts .to(wtype) around norms; each block reads one tapped Llama layer."),
    "nucleus-moe": ZooEntry(
        _T + "transformer_nucleusmoe_image.NucleusMoEImageTransformer2DModel",
        dict(in_channels=64, num_layers=2, attention_head_dim=64, num_attention_heads=2, joint_attention_dim=64,
             axes_dims_rope=(16, 24, 24), moe_enabled=True, dense_moe_strategy="leave_first_block_dense",
             num_experts=8, moe_intermediate_dim=128, capacity_factors=2.0),
        _nucleus_inputs, full_config={}, full_size=dict(_1024, text=256),
        notes="NucleusMoE-Image = the class defaults (2048 x 24, 128 experts, capacity factor 8: each expert takes "
              "S/16 tokens). Block 0 dense, block 1 MoE (expert choice: topk over tokens, so capacity_factor must not "
              "exceed num_experts: 8 experts x 2 here); scale-only modulation, clamped gates."),
    "joyimage-edit": ZooEntry(
        _T + "transformer_joyimage.JoyImageEditTransformer3DModel",
        dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=128, num_attention_heads=2, text_dim=64, num_layers=2,
             rope_dim_list=[16, 24, 24]),
        _joyimage_inputs, full_config={}, full_size=dict(_1024, text=256),
        notes="JoyImage-Edit = the class defaults (3072 x 20, 24 x 128). Multi-item input (reference + target) "
              "flattened to frames; fp32 islands: time_embedder, norm1, norm2, norm_out. The first block's stream is a "
              "transposed view (not contiguous)."),
    "joyimage-edit-plus": ZooEntry(
        _T + "transformer_joyimage_edit_plus.JoyImageEditPlusTransformer3DModel",
        dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=128, num_attention_heads=2, text_dim=64, num_layers=2,
             rope_dim_list=[16, 24, 24]),
        _joyimage_plus_inputs, full_config={}, full_size=dict(_1024, text=256),
        notes="JoyImage-Edit-Plus = the class defaults. Packed per-patch input (B, N, C, pt, ph, pw) with a shape list "
              "per sample (a pipeline-made input); per-sample rotary tables padded to N."),
}
