"""The Wan siblings: classes built from Wan's blocks (VACE, SkyReels-V2, ChronoEdit, Wan-Animate, Helios, AnyFlow,
AnyFlow-FAR, Wan-Animate 2). Tiny configs: 2 heads of 64 (width 128), so Wan's fp32 chains and its rotary run at a
head dim the fused kernels take."""

from __future__ import annotations

import torch

from ._entry import ZooEntry, latent_frames

_T = "diffusers.models.transformers."
# Wan's tiny block: 2 x 64 heads = 128 wide, FFN 256, text 64 (the published 14B: 40 x 128, FFN 13824, text 4096)
_WAN_TINY = dict(num_attention_heads=2, attention_head_dim=64, in_channels=16, out_channels=16, text_dim=64,
                 freq_dim=256, ffn_dim=256, num_layers=2)
# Wan2.1 14B's block stack (Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json), for the 14B siblings whose
# class defaults are another size
_WAN_14B = dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40, text_dim=4096)
_VIDEO_480P = dict(frames=81, height=480, width=832, text=512)


def _wan_text(d, batch, text, dim):
    """T5 states as the Wan pipelines pass them: every prompt zero-padded to `text` tokens, no mask (the first
    prompt's last quarter zero)."""
    return d.randn(batch, text, dim) * d.mask(batch, text).to(d.dtype)[..., None]


def _wan_latents(d, cfg, batch, frames, height, width, channels=None):
    return d.randn(batch, channels or cfg.in_channels, latent_frames(frames), height // 8, width // 8)


def _wan_vace_inputs(model, d, batch, frames=5, height=64, width=64, text=8):
    # WanVACEPipeline: control = 96 channels (the 16 latent channels of the reference and masked video, 64 mask
    # channels); timestep t.expand(batch) in fp32 on [0, 1000)
    cfg = model.config
    f, h, w = latent_frames(frames), height // 8, width // 8
    return dict(hidden_states=_wan_latents(d, cfg, batch, frames, height, width),
                timestep=d.rand(batch, scale=1000.0, dtype=torch.float32),
                encoder_hidden_states=_wan_text(d, batch, text, cfg.text_dim),
                control_hidden_states=d.randn(batch, cfg.vace_in_channels, f, h, w),
                control_hidden_states_scale=d.to(1.0 + 0.1 * torch.randn(len(cfg.vace_layers), generator=d.gen)),
                return_dict=False)


def _skyreels_inputs(model, d, batch, frames=9, height=64, width=64, text=8, diffusion_forcing=None):
    # SkyReelsV2DiffusionForcingPipeline (batch 1; CFG runs two forwards): one noise level per latent frame (B, F),
    # enable_diffusion_forcing, and the fps flag (0 for 16 fps, else 1) of the inject_sample_info models. Diffusion
    # forcing breaks at batch > 1 in diffusers 0.42.1 (the fps rows repeat along the batch), so by default a batch
    # runs SkyReelsV2Pipeline's mode: one timestep per sample
    cfg = model.config
    df = batch == 1 if diffusion_forcing is None else diffusion_forcing
    t = d.rand(batch, latent_frames(frames) if df else 1, scale=1000.0, dtype=torch.float32)
    return dict(hidden_states=_wan_latents(d, cfg, batch, frames, height, width), timestep=t if df else t[:, 0],
                encoder_hidden_states=_wan_text(d, batch, text, cfg.text_dim), enable_diffusion_forcing=df,
                fps=[1] * batch, return_dict=False)


def _chronoedit_inputs(model, d, batch, frames=5, height=64, width=64, text=8, image_tokens=9):
    # ChronoEditPipeline (Wan 2.1 I2V layout): latents (16) + the image condition (4 mask + 16 latent) = 36 channels,
    # CLIP image states (257 x 1280 at full size) prepended to the text
    cfg = model.config
    return dict(hidden_states=_wan_latents(d, cfg, batch, frames, height, width),
                timestep=d.rand(batch, scale=1000.0, dtype=torch.float32),
                encoder_hidden_states=_wan_text(d, batch, text, cfg.text_dim),
                encoder_hidden_states_image=d.randn(batch, image_tokens, cfg.image_dim), return_dict=False)


def _wan_animate_inputs(model, d, batch, frames=5, height=64, width=64, text=8, image_tokens=9, face=16):
    # WanAnimatePipeline: (2 x 16 + 4)-channel latents over F + 1 latent frames (the reference frame first), pose
    # latents over the F segment frames, face crops over the segment's pixel frames (4 per latent frame - 3: 77 for
    # 20 latent frames), CLIP image states
    cfg = model.config
    f, h, w = latent_frames(frames), height // 8, width // 8
    return dict(hidden_states=d.randn(batch, cfg.in_channels, f + 1, h, w),
                timestep=d.rand(batch, scale=1000.0, dtype=torch.float32),
                encoder_hidden_states=_wan_text(d, batch, text, cfg.text_dim),
                encoder_hidden_states_image=d.randn(batch, image_tokens, cfg.image_dim),
                pose_hidden_states=d.randn(batch, cfg.latent_channels, f, h, w),
                face_pixel_values=d.randn(batch, 3, 4 * f - 3, face, face), return_dict=False)


def _helios_inputs(model, d, batch, frames=5, height=64, width=64, text=8):
    # HeliosPipeline (stage 1): the chunk's noisy latents after short / mid / long history latents (1, 2 and 16
    # frames at full size; the mid and long ones patchified 2x / 4x coarser), their frame indices, t on [0, 1000)
    cfg = model.config
    f, h, w = latent_frames(frames), height // 8, width // 8
    hist = lambda n: d.randn(batch, cfg.in_channels, n, h, w)  # noqa: E731
    idx = lambda a, b: d.to(torch.arange(a, b)).expand(batch, -1)  # noqa: E731
    return dict(hidden_states=hist(f), timestep=d.rand(batch, scale=1000.0, dtype=torch.float32),
                encoder_hidden_states=_wan_text(d, batch, text, cfg.text_dim),
                indices_latents_history_long=idx(0, 4), latents_history_long=hist(4),
                indices_latents_history_mid=idx(4, 6), latents_history_mid=hist(2),
                indices_latents_history_short=idx(6, 7), latents_history_short=hist(1),
                indices_hidden_states=idx(7, 7 + f), return_dict=False)


def _anyflow_inputs(model, d, batch, frames=5, height=64, width=64, text=8):
    # AnyFlowPipeline: frame-major latents (B, F, C, H, W); t and the flow-map target r per frame (r <= t)
    cfg = model.config
    f = latent_frames(frames)
    t = d.rand(batch, 1, scale=1000.0, dtype=torch.float32)
    return dict(hidden_states=d.randn(batch, f, cfg.in_channels, height // 8, width // 8),
                timestep=t.repeat(1, f), r_timestep=(t * 0.5).repeat(1, f),
                encoder_hidden_states=_wan_text(d, batch, text, cfg.text_dim), return_dict=False)


def _anyflow_far_inputs(model, d, batch, frames=9, height=64, width=64, text=8):
    # AnyFlowFARPipeline runs chunk by chunk with a KV cache; the zoo runs the model's no-cache causal path over the
    # whole chunk partition (diffusers' own test does the same): 1 + 2 latent frames in chunks [1, 2]
    cfg = model.config
    f = latent_frames(frames)
    t = d.rand(batch, 1, scale=1000.0, dtype=torch.float32)
    return dict(hidden_states=d.randn(batch, f, cfg.in_channels, height // 8, width // 8),
                timestep=t.repeat(1, f), r_timestep=(t * 0.5).repeat(1, f),
                encoder_hidden_states=_wan_text(d, batch, text, cfg.text_dim),
                chunk_partition=[1, f - 1], return_dict=False)


def _wan_animate2_inputs(model, d, batch, frames=5, height=64, width=64, text=8):
    # WanAnimate2 modular pipeline, one segment's generation pass: per-sample lists of (C, F + 1, H, W) latents (one
    # reference frame), 20 condition channels, the reference pass's K/V cached first ("extract", run here once on the
    # same weights), then the "cached" pass that every step runs
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

    cfg = model.config
    f, h, w = latent_frames(frames), height // 8, width // 8
    noise = [d.randn(cfg.out_dim, f + 1, h, w) for _ in range(batch)]
    cond = [d.randn(cfg.in_dim - cfg.out_dim, f + 1, h, w) for _ in range(batch)]
    texts = [d.randn(text, cfg.text_dim) for _ in range(batch)]
    image = d.randn(batch, 257, 1280) if cfg.use_img_emb else None
    t = d.rand(batch, scale=1000.0, dtype=torch.float32)
    grid = torch.tensor([[f, h // 2, w // 2]] * batch)
    cache = WanAnimate2KVCache(len(model.blocks))
    with torch.no_grad():
        model(hidden_states=[x[:, :f] for x in noise], condition_latents=[c[:, :f] for c in cond],
              encoder_hidden_states=texts, encoder_hidden_states_image=image, timestep=t, kv_cache=cache,
              kv_cache_mode="extract", seq_len=f * (h // 2) * (w // 2), offset_grid_sizes=grid, return_dict=False)
    return dict(hidden_states=noise, condition_latents=cond, encoder_hidden_states=texts,
                encoder_hidden_states_image=image, timestep=t, kv_cache=cache, kv_cache_mode="cached",
                seq_len=(f + 1) * (h // 2) * (w // 2), reference_grid_sizes=grid, origin_len=frames,
                origin_area=[height, width], return_dict=False)


ENTRIES = {
    "wan-vace": ZooEntry(
        _T + "transformer_wan_vace.WanVACETransformer3DModel",
        dict(_WAN_TINY, vace_layers=[0], vace_in_channels=96),
        _wan_vace_inputs, full_config={}, full_size=_VIDEO_480P,
        notes="Wan2.1-VACE-14B = the class defaults (40 blocks + 8 VACE blocks at 0, 5, ..., 35). Its main blocks ARE "
              "WanTransformerBlock; the VACE block runs Wan's forward on the control stream and returns a hint. fp32 "
              "islands (_keep_in_fp32_modules): time_embedder, scale_shift_table, norm1/2/3. Unlike Wan's forward, the "
              "stream after the patch embedding is a transposed view (flatten(2).transpose(1, 2)), not contiguous."),
    "skyreels-v2": ZooEntry(
        _T + "transformer_skyreels_v2.SkyReelsV2Transformer3DModel",
        dict(_WAN_TINY, inject_sample_info=True),
        _skyreels_inputs, full_config=dict(_WAN_14B, inject_sample_info=True), full_size=dict(_VIDEO_480P, frames=97),
        notes="Diffusion-forcing mode at batch 1: per-frame timesteps (B, F) expanded to per-token modulation rows (B, "
              "6, S, D) made contiguous in the forward; fps embedding added (inject_sample_info). At batch > 1 that "
              "mode fails in diffusers 0.42.1 (fps rows repeated along the wrong dim), so the builder passes one "
              "timestep per sample (SkyReelsV2Pipeline's mode) unless diffusion_forcing=True. Full config: the Wan2.1 "
              "14B block stack with inject_sample_info (the DF-14B layout; class defaults are the 1.3B). Stream after "
              "the patch embedding not contiguous (transposed view)."),
    "chronoedit": ZooEntry(
        _T + "transformer_chronoedit.ChronoEditTransformer3DModel",
        dict(_WAN_TINY, in_channels=36, image_dim=64, added_kv_proj_dim=128),
        _chronoedit_inputs, full_config=dict(in_channels=36, image_dim=1280, added_kv_proj_dim=5120),
        full_size=dict(frames=5, height=480, width=832, text=512, image_tokens=257),
        notes="Wan 2.1 I2V copy (image cross-attention via added K/V). Full config: class defaults (14B) with the I2V "
              "image branch (in 36, CLIP 1280). Stream after the patch embedding not contiguous (transposed view)."),
    "wan-animate": ZooEntry(
        _T + "transformer_wan_animate.WanAnimateTransformer3DModel",
        dict(_WAN_TINY, in_channels=36, latent_channels=16, image_dim=64, motion_encoder_channel_sizes={
            "4": 16, "8": 16, "16": 16}, motion_encoder_size=16, motion_style_dim=32, motion_dim=8,
            motion_encoder_dim=32, face_encoder_hidden_dim=64, face_encoder_num_heads=2, inject_face_latents_blocks=2),
        _wan_animate_inputs, full_config={},
        full_size=dict(frames=77, height=720, width=1280, text=512, image_tokens=257, face=512),
        notes="Wan2.2-Animate-14B = the class defaults. Pose latents are added in place into frames 1: of the patch "
              "embedding, then the stream is made contiguous; face adapter cross-attention after every "
              "inject_face_latents_blocks-th block; the motion encoder is a StyleGAN-like conv stack on the face crops "
              "(the slowest part on CPU)."),
    "helios": ZooEntry(
        _T + "transformer_helios.HeliosTransformer3DModel",
        dict(_WAN_TINY, rope_dim=(24, 20, 20)),
        _helios_inputs, full_config={}, full_size=dict(frames=33, height=384, width=640, text=512),
        notes="Helios 14B = the class defaults. History latents (short / mid / long, the last two through coarser "
              "patch embeddings) are concatenated before the chunk; with zero_history_timestep the modulation is per "
              "token (B, S, 6, D): history rows from t = 0, chunk rows from t, so Wan's LN+mod runs in its rows form. "
              "The forward makes the stream contiguous before the blocks."),
    "anyflow": ZooEntry(
        _T + "transformer_anyflow.AnyFlowTransformer3DModel",
        dict(_WAN_TINY),
        _anyflow_inputs, full_config={}, full_size=_VIDEO_480P,
        notes="AnyFlow 14B = the class defaults (a Wan 2.1 block copy). Frame-major input (B, F, C, H, W) permuted to "
              "Wan's layout; t and r embedded per frame, so the modulation is per token (B, S, 6, D) and temb 3-D; "
              "complex fp64 rotary; stream after the patch embedding not contiguous (transposed view)."),
    "anyflow-far": ZooEntry(
        _T + "transformer_anyflow_far.AnyFlowFARTransformer3DModel",
        dict(_WAN_TINY, chunk_partition=(1, 2), full_chunk_limit=1),
        _anyflow_far_inputs, full_config={}, full_size=_VIDEO_480P,
        notes="AnyFlow-FAR 14B = the class defaults. Causal chunks: chunks past full_chunk_limit (1 in the tiny "
              "config, so the first of the [1, 2] partition) through the 4x4 compressed far_patch_embedding, attention "
              "through flex_attention with a BlockMask (uncompiled on CPU: dense, exact, ~0.7 s); the pipeline runs "
              "chunk by chunk with a KV cache, the zoo the no-cache path over the whole partition (as diffusers' "
              "test)."),
    "wan-animate-2": ZooEntry(
        _T + "transformer_wan_animate_2.WanAnimate2Transformer3DModel",
        dict(dim=128, ffn_dim=256, num_heads=2, num_layers=2, freq_dim=256, text_dim=64, text_len=8),
        _wan_animate2_inputs, full_config={}, full_size=_VIDEO_480P,
        skip="its forward builds the flex BlockMask with create_block_mask(_compile=True), an inductor compile on "
             "every fresh process: 42 s cold on this 2-core CPU (5 s with a warm inductor cache), over the CPU test "
             "budget; the GPU test runs it",
        notes="Wan-Animate-2 14B = the class defaults. List-of-samples inputs (C, F, H, W) each; the reference pass "
              "fills a KV cache (run once by the inputs builder: a pipeline-made input), the step runs 'cached'. "
              "Attention through flex_attention with a BlockMask (compiled on CUDA by the profile script; uncompiled "
              "on CPU); complex128 rope_apply per sample; fp32 islands incl. modulation."),
}
