"""Audio DiTs: Stable Audio Open 1.0 and Stable Audio 3, ACE-Step, LongCat-AudioDiT, MiniMax-Music 3."""

from __future__ import annotations

import torch

from ._entry import ZooEntry

_T = "diffusers.models.transformers."


def _stable_audio_inputs(model, d, batch, frames=16, text=8):
    # StableAudioPipeline: (B, 64, T) latents, T5 states with the two duration tokens appended, the durations as the
    # global state (B, 1, 2 x 768), ONE timestep for the whole batch (t.unsqueeze(0): the CFG halves share it), and
    # the rotary the pipeline makes with diffusers' get_1d_rotary_pos_embed over T + 1 positions
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    cfg = model.config
    rope = get_1d_rotary_pos_embed(cfg.attention_head_dim // 2, frames + 1, use_real=True, repeat_interleave_real=False)
    return dict(hidden_states=d.randn(batch, cfg.in_channels, frames), timestep=d.rand(1, dtype=torch.float32),
                encoder_hidden_states=d.randn(batch, text + 2, cfg.cross_attention_dim),
                global_hidden_states=d.randn(batch, 1, cfg.global_states_input_dim),
                rotary_embedding=tuple(r.to(d.device) for r in rope), return_dict=False)


def _stable_audio3_inputs(model, d, batch, frames=16, text=8):
    # StableAudio3Pipeline: (B, C, T) latents, T5-Gemma text with its mask, the global conditioning vector, t on [0, 1]
    cfg = model.config
    return dict(hidden_states=d.randn(batch, cfg.io_channels, frames), timestep=d.rand(batch, dtype=torch.float32),
                encoder_hidden_states=d.randn(batch, text, cfg.cond_token_dim),
                global_hidden_states=d.randn(batch, cfg.global_cond_dim),
                encoder_attention_mask=d.mask(batch, text, dtype=torch.bool), return_dict=False)


def _ace_step_inputs(model, d, batch, frames=32, text=8):
    # AceStepPipeline: (B, T, 64) acoustic latents, t and the mean-flow target r on [0, 1], the condition encoder's
    # states, context latents (source + chunk mask: 2 x 64 channels)
    cfg = model.config
    a = cfg.audio_acoustic_hidden_dim
    t = d.rand(batch, dtype=torch.float32)
    return dict(hidden_states=d.randn(batch, frames, a), timestep=d.to(t), timestep_r=d.to(t * 0.5),
                encoder_hidden_states=d.randn(batch, text, cfg.encoder_hidden_size or cfg.hidden_size),
                context_latents=d.randn(batch, frames, cfg.in_channels - a), return_dict=False)


def _longcat_audio_inputs(model, d, batch, frames=16, text=8):
    # LongCatAudioDiTPipeline: (B, T, 64) latents with their mask, UMT5 text with its mask, t on [0, 1], the latent
    # condition (zeros past the prompt audio)
    cfg = model.config
    return dict(hidden_states=d.randn(batch, frames, cfg.latent_dim),
                encoder_hidden_states=d.randn(batch, text, cfg.dit_text_dim),
                encoder_attention_mask=d.mask(batch, text, dtype=torch.bool),
                timestep=d.rand(batch, dtype=torch.float32),
                attention_mask=d.mask(batch, frames, 0, dtype=torch.bool),
                latent_cond=d.randn(batch, frames, cfg.latent_dim), return_dict=False)


def _minimax_music3_inputs(model, d, batch, frames=16):
    # MiniMax-Music 3 modular pipeline: (B, C, T) latents, a frame-aligned condition sequence (B, T, 2048), t on
    # [0, 1] (0 = noise) in the latents' dtype (its Fourier timestep embedding is a matmul with a weight)
    cfg = model.config
    return dict(hidden_states=d.randn(batch, cfg.in_channels, frames),
                encoder_hidden_states=d.randn(batch, frames, cfg.condition_dim), timestep=d.rand(batch),
                return_dict=False)


ENTRIES = {
    "stable-audio": ZooEntry(
        _T + "stable_audio_transformer.StableAudioDiTModel",
        dict(sample_size=16, in_channels=64, num_layers=2, attention_head_dim=64, num_attention_heads=2,
             num_key_value_attention_heads=1, out_channels=64, cross_attention_dim=64, time_proj_dim=64,
             global_states_input_dim=128, cross_attention_input_dim=64),
        _stable_audio_inputs, full_config={}, full_size=dict(frames=1024, text=128),
        notes="Stable Audio Open 1.0 = the class defaults (24 x 64, GQA 12 kv heads). No adaLN: the global state is "
              "prepended; one timestep for the whole batch; rotary from the pipeline's get_1d_rotary_pos_embed. No "
              "_repeated_blocks / _no_split_modules: the blocks are found from the module tree only."),
    "stable-audio-3": ZooEntry(
        _T + "transformer_stable_audio3.StableAudio3DiTModel",
        dict(io_channels=64, embed_dim=128, depth=2, num_heads=2, cond_token_dim=64, global_cond_dim=64,
             local_add_cond_dim=9, timestep_features_dim=64, ff_mult=2.0, num_memory_tokens=4,
             use_differential_attention=True),
        _stable_audio3_inputs, full_config={}, full_size=dict(frames=1024, text=128),
        notes="Stable Audio 3 Medium = the class defaults (1536 x 24, heads of 64, differential attention, 64 memory "
              "tokens). _modulate helper, sigmoid gates, partial rotate-half rope; to_local_embed is zero-initialised "
              "(randomised here; the zoo passes no local_add_cond, as text-to-audio)."),
    "ace-step": ZooEntry(
        _T + "ace_step_transformer.AceStepTransformer1DModel",
        dict(hidden_size=640, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=64, in_channels=192, audio_acoustic_hidden_dim=64, patch_size=2, sliding_window=4),
        _ace_step_inputs, full_config={}, full_size=dict(frames=1500, text=256),
        notes="ACE-Step 1.5 = the class defaults (2048 x 24, 16 x 128 GQA 8). Layers alternate sliding-window and full "
              "attention (window 4 tokens here so both differ on 16 tokens, enough rows for the fused RMSNorm, 640 "
              "wide for its reduction); Wan-like modulate without .float(). No _repeated_blocks / _no_split_modules: "
              "the blocks are found from the module tree only."),
    "longcat-audio": ZooEntry(
        _T + "transformer_longcat_audio_dit.LongCatAudioDiTTransformer",
        dict(dit_dim=128, dit_depth=2, dit_heads=2, dit_text_dim=64, latent_dim=64),
        _longcat_audio_inputs, full_config={}, full_size=dict(frames=1000, text=256),
        notes="LongCat-AudioDiT = the class defaults (1536 x 24). Long skip connections, text convolution, global "
              "adaLN; fp32 rotate-half rope."),
    "minimax-music3": ZooEntry(
        _T + "transformer_minimax_music3.MiniMaxMusic3Transformer1DModel",
        dict(in_channels=64, condition_dim=64, num_layers=2, num_attention_heads=2, attention_head_dim=64,
             ff_inner_dim=256, rotary_dim=32, fourier_embedding_dim=64),
        _minimax_music3_inputs, full_config={}, full_size=dict(frames=2048),
        notes="MiniMax-Music 3 = the class defaults (2048 x 36). Plain pre-norm blocks, partial rope (rotary_dim of "
              "each head), SwiGLU."),
}
