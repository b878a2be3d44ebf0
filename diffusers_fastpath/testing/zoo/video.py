"""Video (and audio-video) DiTs of 2025-2026 not built from Wan's blocks: HunyuanVideo-Framepack, MotifVideo, LTX-2
and SANA-WM's LTX-2 refiner, Kandinsky 5 / 6 / 6-SR, MiniMax-H3, Cosmos 1-2.5 and Cosmos 3, Sana-Video, SANA-WM."""

from __future__ import annotations

import torch

from ._entry import ZooEntry, latent_frames

_T = "diffusers.models.transformers."


def _t1000(d, batch, dtype=torch.float32):
    """One flow-matching timestep per sample on [0, 1000), as ``t.expand(batch)`` of the pipelines."""
    return d.rand(batch, scale=1000.0, dtype=dtype)


# ---------------------------------------------------------------- Hunyuan-like

def _framepack_inputs(model, d, batch, window=2, history=(1, 2, 4), height=64, width=64, text=8, image_tokens=9):
    # HunyuanVideoFramepackPipeline (vanilla sampling): a window of noisy latents after the clean prefix + 1x history
    # (latents_clean) and the 2x / 4x history latents (patchified 2x / 4x coarser), each with its 1-D frame indices
    # from one arange; Llama text with its mask, CLIP pooled, SigLIP image states, the distilled guidance 6.0 x 1000
    cfg = model.config
    h, w = height // 8, width // 8
    h1, h2, h4 = history
    idx = torch.arange(1 + h4 + h2 + h1 + window)
    i_pre, i4, i2, i1, i_lat = idx.split([1, h4, h2, h1, window])
    lat = lambda n: d.randn(batch, cfg.in_channels, n, h, w)  # noqa: E731
    return dict(hidden_states=lat(window), timestep=_t1000(d, batch),
                encoder_hidden_states=d.randn(batch, text, cfg.text_embed_dim),
                encoder_attention_mask=d.mask(batch, text),
                pooled_projections=d.randn(batch, cfg.pooled_projection_dim),
                image_embeds=d.randn(batch, image_tokens, cfg.image_proj_dim), indices_latents=d.to(i_lat),
                guidance=d.to(torch.full((batch,), 6000.0)), latents_clean=lat(1 + h1),
                indices_latents_clean=d.to(torch.cat([i_pre, i1])), latents_history_2x=lat(h2),
                indices_latents_history_2x=d.to(i2), latents_history_4x=lat(h4), indices_latents_history_4x=d.to(i4),
                return_dict=False)


def _motif_inputs(model, d, batch, frames=5, height=64, width=64, text=8):
    # MotifVideoPipeline (t2v): [noise 16 | zero image condition 16 | zero mask 1] = 33 channels, T5 text + mask
    cfg = model.config
    f, h, w = latent_frames(frames), height // 8, width // 8
    noise = d.randn(batch, cfg.out_channels, f, h, w)
    cond = torch.zeros(batch, cfg.in_channels - cfg.out_channels, f, h, w, device=d.device, dtype=d.dtype)
    return dict(hidden_states=torch.cat([noise, cond], 1), timestep=_t1000(d, batch),
                encoder_hidden_states=d.randn(batch, text, cfg.text_embed_dim),
                encoder_attention_mask=d.mask(batch, text), return_dict=False)


# ---------------------------------------------------------------- LTX-2

def _ltx2_inputs(model, d, batch, frames=17, height=128, width=128, text=8, fps=24.0):
    # LTX2Pipeline: packed video tokens (VAE /32 spatial, /8 temporal, 128 ch) and audio latents (25 per second),
    # the connector's text states for each branch with an all-ones mask, sigma = timestep on [0, 1000]
    cfg = model.config
    f, h, w = latent_frames(frames, 8), height // 32, width // 32
    a = max(1, round(frames / fps * 25))
    t = _t1000(d, batch)
    return dict(hidden_states=d.randn(batch, f * h * w, cfg.in_channels),
                audio_hidden_states=d.randn(batch, a, cfg.audio_in_channels),
                encoder_hidden_states=d.randn(batch, text, cfg.caption_channels),
                audio_encoder_hidden_states=d.randn(batch, text, cfg.caption_channels), timestep=t, sigma=t,
                encoder_attention_mask=d.mask(batch, text, 0), audio_encoder_attention_mask=d.mask(batch, text, 0),
                num_frames=f, height=h, width=w, fps=fps, audio_num_frames=a, return_dict=False)


def _sana_wm_refiner_inputs(model, d, batch, frames=2, height=4, width=4, text=8, fps=24.0):
    # SanaWMLTX2Refiner (stage 2): packed video tokens of one block, a per-token timestep already x1000, the video
    # rotary built by the model's own helper at the block's absolute frame positions
    cfg = model.config
    n = frames * height * width
    rope = model.build_rotary_emb_for_absolute_positions(batch_size=batch, frame_positions=list(range(1, 1 + frames)),
                                                        height=height, width=width, device=d.device, fps=fps)
    return dict(hidden_states=d.randn(batch, n, cfg.in_channels),
                encoder_hidden_states=d.randn(batch, text, cfg.caption_channels),
                timestep=d.rand(batch, 1, scale=1000.0, dtype=torch.float32).expand(batch, n).contiguous(),
                video_rotary_emb=rope, encoder_attention_mask=d.mask(batch, text), return_dict=False)


# ---------------------------------------------------------------- Kandinsky

def _k6_inputs(model, d, batch, frames=5, height=64, width=64, text=8, valid=6, fps=24.0):
    # Kandinsky6TI2VAPipeline: channel-last latents (B, F, H, W, C) = [noise | zero condition | zero mask], audio
    # latents (44.1 kHz / 1024 hop), Qwen2.5-VL text padded with its mask, CLIP pooled, t on [0, 1000)
    cfg = model.config
    f, h, w = latent_frames(frames), height // 8, width // 8
    c = cfg.in_visual_dim
    lat = torch.cat([d.randn(batch, f, h, w, c), d.to(torch.zeros(batch, f, h, w, c + 1))], -1)
    a = max(2, int(((f - 1) * 4 + 1) / fps * 44100 / 1024))
    mask = torch.zeros(batch, text, dtype=torch.bool)
    mask[:, :valid] = True
    mask[1:, :] = True
    return dict(hidden_states=lat, audio_hidden_states=d.randn(batch, a, cfg.in_audio_dim),
                encoder_hidden_states=d.randn(batch, text, cfg.in_text_dim),
                pooled_projections=d.randn(batch, cfg.in_text_dim2), timestep=_t1000(d, batch),
                encoder_attention_mask=d.to(mask), return_dict=False)


def _k6sr_inputs(model, d, batch, frames=5, height=128, width=128):
    # Kandinsky6SRPipeline: channel-last [noisy | anchor latent | anchor mask] (2 C + 1 channels), t on [0, 1000)
    cfg = model.config
    f, h, w = latent_frames(frames), height // 8, width // 8
    return dict(hidden_states=d.randn(batch, f, h, w, 2 * cfg.in_visual_dim + 1), timestep=_t1000(d, batch),
                return_dict=False)


def _k5_inputs(model, d, batch, frames=5, height=64, width=64, text=8):
    # Kandinsky5T2VPipeline: channel-last [noise | zero condition | zero mask] when visual_cond, rope positions as
    # aranges over (frames, H/16, W/16) and the text length, the resolution's scale factor, t on [0, 1000)
    cfg = model.config
    f, h, w = latent_frames(frames), height // 8, width // 8
    c = cfg.in_visual_dim
    lat = d.randn(batch, f, h, w, c)
    if cfg.visual_cond:
        lat = torch.cat([lat, d.to(torch.zeros(batch, f, h, w, c + 1))], -1)
    return dict(hidden_states=lat, encoder_hidden_states=d.randn(batch, text, cfg.in_text_dim),
                pooled_projections=d.randn(batch, cfg.in_text_dim2), timestep=_t1000(d, batch, d.dtype),
                visual_rope_pos=[d.to(torch.arange(n)) for n in (f, h // 2, w // 2)],
                text_rope_pos=d.to(torch.arange(text)), scale_factor=(1, 2, 2), sparse_params=None, return_dict=False)


# ---------------------------------------------------------------- MiniMax-H3, Cosmos

def _minimax_h3_inputs(model, d, batch, frames=22, height=64, width=64, text=8, fps=24):
    # MiniMax-H3 modular pipeline: one packed sequence [text][audio rows, channel-major][video rows] with 3-D
    # positions (fp64), a token tag per row and per-row timestep indices (video t, audio its own)
    cfg = model.config
    lf = (frames - 5) // 17 * 5 + 2
    gh, gw = height // 32, width // 32
    v = lf * gh * gw
    a = round(frames / fps * 40) * 2
    s = text + a + v
    pos = torch.zeros(s, 3, dtype=torch.float64)
    pos[:text, 0] = torch.arange(text)
    pos[text:text + a, 0] = text + torch.arange(a // 2).repeat(2)
    pos[text + a:] = torch.cartesian_prod(torch.arange(lf), torch.arange(gh), torch.arange(gw)).double()
    pos[text + a:, 0] += text
    tags = torch.cat([torch.ones(text), torch.full((a,), 2), torch.zeros(v)]).long()
    tidx = torch.zeros(s, dtype=torch.long)
    tidx[text:text + a] = 1
    return dict(hidden_states=d.randn(batch, v, cfg.in_channels * 4),
                audio_hidden_states=d.randn(batch, a, cfg.audio_in_channels),
                encoder_hidden_states=d.randn(batch, text, cfg.text_dim), timestep=d.rand(2, dtype=torch.float32),
                timestep_indices=d.to(tidx), token_tags=d.to(tags), position_ids=d.to(pos, torch.float64),
                video_indices=d.to(torch.arange(text + a, s)), audio_indices=d.to(torch.arange(text, text + a)),
                text_indices=d.to(torch.arange(text)), return_dict=False)


def _cosmos3_inputs(model, d, batch, frames=9, height=64, width=64, text=8):
    # Cosmos3OmniPipeline (t2v): a causal text prefix ("und" pathway) then the vision patches ("gen" pathway) of one
    # packed sequence; 3-row MRoPE positions, one timestep per vision token; batch = samples in the lists
    cfg = model.config
    f, h, w = latent_frames(frames), height // 16, width // 16
    hp, wp = (h + 1) // 2, (w + 1) // 2
    n = f * hp * wp
    L = text + n
    pos = torch.zeros(3, L, dtype=torch.long)
    pos[:, :text] = torch.arange(text)
    vis = torch.cartesian_prod(torch.arange(f), torch.arange(hp), torch.arange(wp))
    pos[0, text:] = vis[:, 0] + text
    pos[1, text:] = vis[:, 1]
    pos[2, text:] = vis[:, 2]
    vi = d.to(torch.arange(text, L))
    return dict(input_ids=d.randint(cfg.vocab_size, text), text_indexes=d.to(torch.arange(text)),
                position_ids=d.to(pos), und_len=text, sequence_length=L,
                vision_tokens=[d.randn(1, cfg.latent_channel, f, h, w)], vision_token_shapes=[(f, hp, wp)],
                vision_sequence_indexes=vi, vision_mse_loss_indexes=vi,
                vision_timesteps=d.to(torch.full((n,), float(torch.rand(1, generator=d.gen)) * 1000.0), torch.float32),
                vision_noisy_frame_indexes=[d.to(torch.arange(f))], return_dict=False)


def _cosmos_inputs(model, d, batch, frames=9, height=64, width=64, text=8, fps=30):
    # CosmosTextToWorldPipeline (Cosmos 1.0): EDM timestep 0.25 log(sigma) per sample (sigma in [0.002, 80]), a
    # zero padding mask (1, 1, H, W), the fps for the rotary
    cfg = model.config
    f, h, w = latent_frames(frames, 8), height // 8, width // 8
    sigma = torch.exp(torch.rand(batch, generator=d.gen) * (torch.log(torch.tensor(80.0)) - torch.log(
        torch.tensor(0.002))) + torch.log(torch.tensor(0.002)))
    kw = dict(hidden_states=d.randn(batch, cfg.in_channels, f, h, w), timestep=d.to(0.25 * sigma.log()),
              encoder_hidden_states=d.randn(batch, text, cfg.text_embed_dim), fps=fps, return_dict=False)
    if cfg.concat_padding_mask:
        kw["padding_mask"] = d.to(torch.zeros(1, 1, h, w))
    return kw


# ---------------------------------------------------------------- Sana

def _sana_video_inputs(model, d, batch, frames=9, height=64, width=64, text=8):
    # SanaVideoPipeline: (B, C, F, H, W) latents (Wan VAE), Gemma text 300 tokens with mask, t on [0, 1000)
    cfg = model.config
    return dict(hidden_states=d.randn(batch, cfg.in_channels, latent_frames(frames), height // 8, width // 8),
                encoder_hidden_states=d.randn(batch, text, cfg.caption_channels), timestep=_t1000(d, batch),
                encoder_attention_mask=d.mask(batch, text), return_dict=False)


def _sana_wm_inputs(model, d, batch, frames=4, height=8, width=8, text=8):
    # SanaWMPipeline: (B, C, F, H, W) latents; per-frame timesteps (B, 1, F) with the first (anchor) frame pinned to
    # 0; Gemma text (B, 1, L, C) and its mask as `mask`; the camera raymap (B, F, 20: a flat 4x4 relative pose then
    # fx, fy, cx, cy) and chunk Plucker rays in the model dtype; data_info's image size
    cfg = model.config
    c2w = torch.eye(4).repeat(batch, frames, 1, 1)
    c2w[..., 2, 3] = torch.arange(frames) * 0.1 + torch.rand(batch, 1, generator=d.gen)
    intr = torch.tensor([float(width), float(height), width / 2, height / 2]).expand(batch, frames, 4)
    t = d.rand(batch, 1, frames, scale=1000.0, dtype=torch.float32)
    t[..., 0] = 0
    return dict(hidden_states=d.randn(batch, cfg.in_channels, frames, height, width), timestep=t,
                encoder_hidden_states=d.randn(batch, 1, text, cfg.caption_channels), mask=d.mask(batch, text),
                camera_conditions=d.to(torch.cat([c2w.flatten(-2), intr], -1)),
                chunk_plucker=d.randn(batch, cfg.chunk_plucker_channels, frames, height, width),
                data_info={"img_hw": d.to(torch.tensor([[height * 32.0, width * 32.0]]), torch.float32)},
                return_dict=False)


ENTRIES = {
    "hunyuan-framepack": ZooEntry(
        _T + "transformer_hunyuan_video_framepack.HunyuanVideoFramepackTransformer3DModel",
        dict(in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=128, num_layers=1,
             num_single_layers=1, num_refiner_layers=1, text_embed_dim=64, pooled_projection_dim=32,
             rope_axes_dim=(16, 56, 56), has_image_proj=True, image_proj_dim=64, has_clean_x_embedder=True),
        _framepack_inputs,
        full_config=dict(has_image_proj=True, image_proj_dim=1152, has_clean_x_embedder=True),
        full_size=dict(window=9, history=(1, 2, 16), height=720, width=1280, text=256, image_tokens=729),
        notes="FramePack (lllyasviel/FramePackI2V_HY): HunyuanVideo 13B's defaults + SigLIP image projection and the "
              "clean-latent embedders. Same block, refiner, processor classes as HunyuanVideo; clean / 2x / 4x history "
              "tokens are concatenated before the window's; guidance embedded (x1000)."),
    "motif-video": ZooEntry(
        _T + "transformer_motif_video.MotifVideoTransformer3DModel",
        dict(in_channels=33, out_channels=16, num_attention_heads=2, attention_head_dim=64, num_layers=1,
             num_single_layers=1, patch_size=2, text_embed_dim=64, rope_axes_dim=(16, 24, 24)),
        _motif_inputs, full_config={}, full_size=dict(frames=121, height=720, width=1280, text=512),
        notes="MotifVideo = the class defaults (HunyuanVideo-like, diffusers AdaLayerNormZero / Single). Its patch "
              "embedding returns transposed tokens, so the first blocks see a non-contiguous stream."),
    "ltx2": ZooEntry(
        _T + "transformer_ltx2.LTX2VideoTransformer3DModel",
        dict(num_attention_heads=10, attention_head_dim=64, cross_attention_dim=640, audio_num_attention_heads=10,
             audio_attention_head_dim=64, audio_cross_attention_dim=640, num_layers=2, caption_channels=64),
        _ltx2_inputs, full_config={}, full_size=dict(frames=121, height=512, width=768, text=1024),
        notes="LTX-2 19B = the class defaults (video 32 x 128, audio 32 x 64). Video and audio streams with a2v / v2a "
              "cross-attention in every block; sigma passed as well as the timestep; video rotary interleaved. The "
              "fused RMSNorm takes D % 128 == 0 in (512, 8192): the tiny width is 640 (10 x 64) so that it runs."),
    "sana-wm-refiner": ZooEntry(
        _T + "transformer_sana_wm_refiner.SanaWMLTX2RefinerTransformer3DModel",
        dict(in_channels=128, out_channels=128, num_attention_heads=10, attention_head_dim=64, cross_attention_dim=640,
             audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=8,
             audio_cross_attention_dim=16, num_layers=2, caption_channels=64),
        _sana_wm_refiner_inputs, full_config={}, full_size=dict(frames=8, height=15, width=26, text=1024),
        notes="LTX-2 block copy, video only (the audio modules are built, never run). The video rotary is a caller "
              "input (made here by model.build_rotary_emb_for_absolute_positions, as the refiner pipeline does); "
              "timestep per token; no KV cache in the zoo (the pipeline injects a sink)."),
    "kandinsky6": ZooEntry(
        _T + "transformer_kandinsky6.Kandinsky6Transformer3DModel",
        dict(text_token_padding=True, ca_rope=True, cross_gates=True, fix_modulation=True, in_text_dim=64,
             in_text_dim2=32, time_dim=64, model_dim=256, ff_dim=512, num_text_blocks=1, num_visual_blocks=2,
             axes_dims=(32, 48, 48), in_audio_dim=4, out_audio_dim=4),
        _k6_inputs, full_config=dict(text_token_padding=True, ca_rope=True, cross_gates=True, fix_modulation=True),
        full_size=dict(frames=121, height=512, width=768, text=1024, valid=256),
        notes="Kandinsky 6 TI2VA: the class defaults + the four flags the released checkpoints set (48.2 B). Head dim "
              "= sum(axes_dims) = 128; channel-last video; fused video + audio blocks; fp32 modulation "
              "(_keep_in_fp32_modules: time_embeddings, modulation)."),
    "kandinsky6-sr": ZooEntry(
        _T + "transformer_kandinsky6_sr.Kandinsky6SRTransformer3DModel",
        dict(in_visual_dim=4, out_visual_dim=16, time_dim=64, model_dim=128, ff_dim=256, num_visual_blocks=2,
             axes_dims=(16, 24, 24)),
        _k6sr_inputs, full_config={}, full_size=dict(frames=121, height=1024, width=1536),
        notes="Kandinsky 6 SR = the class defaults (1792 x 32, head 64). Attention is NABLA sparse through a flex "
              "BlockMask: uncompiled (CPU) flex attention materialises the full score matrix and warns once."),
    "kandinsky5": ZooEntry(
        _T + "transformer_kandinsky.Kandinsky5Transformer3DModel",
        dict(in_visual_dim=16, out_visual_dim=16, in_text_dim=64, in_text_dim2=32, time_dim=64, model_dim=128,
             ff_dim=256, num_text_blocks=1, num_visual_blocks=2, axes_dims=(16, 24, 24), visual_cond=True),
        _k5_inputs, full_config=dict(in_visual_dim=16, out_visual_dim=16, visual_cond=True),
        full_size=dict(frames=121, height=512, width=768, text=256),
        notes="Kandinsky 5 T2V Lite layout: class defaults (2048 x 32, head 64) with the 16-channel VAE and visual "
              "conditioning (from the T2V pipelines' latents layout). Inline fp32 modulate / gate arithmetic; rope "
              "positions passed by the pipeline; sparse_params None (regular attention). Its QK nn.RMSNorm gets fp32 "
              "activations against bf16 weights (torch warns: no fused dispatch)."),
    "minimax-h3": ZooEntry(
        _T + "transformer_minimax_h3.MiniMaxH3Transformer3DModel",
        dict(num_attention_heads=2, attention_head_dim=64, hidden_size=128, num_layers=2, num_refiner_layers=1,
             ffn_dim=256, text_dim=64, time_embed_hidden_dim=128, time_embed_dim=64, rope_freq_dim=8),
        _minimax_h3_inputs, full_config={}, full_size=dict(frames=124, height=768, width=1344, text=256),
        notes="MiniMax-H3 = the class defaults (5376 x 50). One packed sequence per batch of text, audio and video "
              "rows: the model takes batch 1 only in its pipeline (two timesteps: video, audio). fp32 islands: proj_in "
              "/ proj_out, time_embedder, rope."),
    "cosmos3": ZooEntry(
        _T + "transformer_cosmos3.Cosmos3OmniTransformer",
        dict(head_dim=64, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
             num_hidden_layers=2, latent_channel=4, patch_latent_dim=16, vocab_size=128, rope_axes_dim=(12, 10, 10)),
        _cosmos3_inputs, full_config={}, full_size=dict(frames=189, height=720, width=1280, text=320),
        notes="Cosmos 3 Omni = the class defaults (Qwen3-style MoT, 4096 x 36, GQA 32/8). LLM-style: token ids in, one "
              "packed sequence, the batch is the vision_tokens list (the zoo's batch is ignored: one sample). "
              "time_embedder in fp32."),
    "cosmos": ZooEntry(
        _T + "transformer_cosmos.CosmosTransformer3DModel",
        dict(in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=64, num_layers=2,
             text_embed_dim=64, adaln_lora_dim=32, max_size=(16, 32, 32), concat_padding_mask=False),
        _cosmos_inputs, full_config={}, full_size=dict(frames=121, height=704, width=1280, text=512),
        notes="Cosmos-1.0-Diffusion-7B-Text2World = the class defaults. The published models concatenate a "
              "padding-mask channel resized by torchvision, which this CPU machine lacks (the forward raises NameError "
              "'transforms'): the tiny config sets concat_padding_mask=False, the full one needs torchvision. EDM "
              "timestep 0.25 log(sigma); learnable positional embedding kept in fp32."),
    "sana-video": ZooEntry(
        _T + "transformer_sana_video.SanaVideoTransformer3DModel",
        dict(in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=64, num_layers=2,
             num_cross_attention_heads=2, cross_attention_head_dim=64, cross_attention_dim=128, caption_channels=64,
             sample_size=8, rope_max_seq_len=32),
        _sana_video_inputs, full_config={}, full_size=dict(frames=81, height=480, width=832, text=300),
        notes="Sana-Video 2B = the class defaults (2240 x 20, linear attention + GLUMB temporal conv FFN, Wan's rotary "
              "as a local def). The first block's input is a transposed view of the patch embedding."),
    "sana-wm": ZooEntry(
        _T + "transformer_sana_wm.SanaWMTransformer3DModel",
        dict(in_channels=16, num_layers=2, hidden_size=128, num_attention_heads=2, patch_size=(1, 1, 1),
             softmax_every_n=2, linear_head_dim=64, caption_channels=64, mlp_ratio=2.0, chunk_plucker_channels=8,
             chunk_plucker_post_attn_blocks=2),
        _sana_wm_inputs, full_config={}, full_size=dict(frames=21, height=45, width=80, text=300),
        cpu_dtype=torch.float32,
        notes="SANA-WM bidirectional = the class defaults (2240 x 20). Camera control (UCPE rays, chunk Plucker), GDN "
              "linear attention in most blocks (block 0 here) and softmax every softmax_every_n-th (block 1); its "
              "temporal short convolutions are zero-initialised (randomised here, else the GDN branch is dead); "
              "fp32_attention by default; the first block's stream is a transposed view. bf16 cannot run on CPU: its "
              "camera ray grid (create_grid) raises 'bfloat16 is not supported by cpu', so the CPU test builds it in "
              "fp32."),
}
