"""Tiny offline pipelines around the zoo's transformers: each diffusers pipeline of a zoo class that builds on a CPU
without a text encoder, for a short generation patched against unpatched (issue 39's "2-step pipeline" check; issue
40's for the 2026 families).

Each builder returns ``(pipe, call)``: the pipeline holding the zoo's tiny transformer (`zoo.build`, random weights),
a tiny random VAE of the pipeline's own class (every parameter drawn by `randomize_`), the pipeline's scheduler, no
tokenizer or text encoder; and the call's kwargs with random prompt (and negative-prompt) embeddings of the shapes the
pipeline's text encoders make, classifier-free guidance where the pipeline runs it, a tiny resolution, 2 steps and an
output type whose decode is cheap. The caller adds a fresh ``generator`` per run. Where a pipeline also encodes an
image (an image-to-video's CLIP or SigLIP encoder), a tiny random image encoder and its processor, built from a
config, stand in for the published one; where it needs other models around the transformer (LTX-2's text
connectors, Kandinsky 6's audio VAE and vocoder), tiny random ones of their classes.

A class whose pipeline is a ``ModularPipeline`` (FLUX.3, whose only pipeline is one; Qwen-Image 2.1 and Ideogram 4,
whose ``DiffusionPipeline`` cannot be built offline) gets it from its auto blocks with the steps that run a text
encoder (and a prompt upsampler) removed: its embeddings enter as the denoise steps' inputs. Such a pipeline returns
its state unless asked for a value: its call names ``output="images"``, and takes no ``return_dict``.

The builders of the 2026 families (FLUX.3, Qwen-Image 2.1, Krea 2, Ideogram 4, Bria FIBO 2, LTX-2, Kandinsky 6) take
``full=False, device="cpu"``: with ``full=True`` their transformer(s) are the published config (`zoo.build(name,
full=True)`, random bf16 weights; Ideogram 4's unconditional one too) built straight on `device`, so a GPU holds a
full-size model that never existed on the CPU; the rest (the tiny VAE, scheduler, guider, embeddings sized from the
transformer's config) is built as for the tiny one, on the CPU (``pipe.to(device)`` moves it), and FLUX.3's
reference image is 1024 px. The call keeps its tiny resolution and 2 steps: the caller sets ``height``, ``width``
(``num_frames``) and ``num_inference_steps`` (Ideogram 4's ``guidance_schedule`` has one weight per step), as
``tools/zoo_full_size.py --generation`` does. Called without arguments, each builds as before.

Not here: QwenImage21Pipeline (its ``__init__`` tokenizes its system prompt with the Qwen3-VL processor,
``processor.apply_chat_template`` and ``processor.tokenizer.encode("<|image_pad|>")``, so it cannot be built without a
tokenizer, though its ``__call__`` takes prompt embeddings) and Ideogram4Pipeline (its ``__call__`` takes no prompt
embeddings: it always runs its tokenizer and text encoder, ``encode_prompt``); their modular pipelines stand in.

Example:
    >>> import torch
    >>> from diffusers_fastpath.testing.zoo.pipelines import PIPELINES
    >>> pipe, call = PIPELINES["wan-vace"]()
    >>> video = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
"""

from __future__ import annotations

from typing import Callable

import torch

from .._common import _construct, _quiet_image_processor_fallback, randomize_
from ._zoo import ZOO, _as_loaded_, build

_STEPS = 2


def _embeds(seed: int, dtype=torch.bfloat16):
    """A seeded ``randn(*shape)`` in `dtype`: the prompt embeddings' source (one per builder)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return randn


def _mask(tokens: int, padding: int) -> torch.Tensor:
    """A ``[1, tokens]`` long mask whose last `padding` tokens are padding (as a tokenizer pads a short prompt)."""
    m = torch.ones(1, tokens, dtype=torch.long)
    if padding:
        m[0, tokens - padding:] = 0
    return m


def _masked_embeds(randn, dim: int, tokens: int = 8, padding: int = 2) -> dict:
    """Prompt and negative-prompt states with their masks (the prompt's last `padding` tokens padding), as the
    T5 / Gemma pipelines (Sana, PixArt, AuraFlow) take them; ``negative_prompt=None`` over their default ``""``,
    which would ask for a text encoder."""
    return dict(negative_prompt=None, prompt_embeds=randn(1, tokens, dim), prompt_attention_mask=_mask(tokens, padding),
                negative_prompt_embeds=randn(1, tokens, dim), negative_prompt_attention_mask=_mask(tokens, 0))


def _random(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """`module` (built in fp32, as the pipelines keep their VAEs and image encoders) with every parameter random
    (VAEs zero-initialise some convolutions), in eval mode."""
    return randomize_(module, seed).eval()


def _transformer(name: str, full: bool = False, device="cpu", seed: int = 0, **overrides) -> torch.nn.Module:
    """A builder's transformer: `zoo.build(name)` (bf16, random weights drawn from `seed`), at the published config
    built straight on `device` where `full` (the builder's own `full` and `device`); or, tiny only, with constructor
    `overrides` over the tiny config where the pipeline needs another variant of the class (SkyReels-V2's
    text-to-video models embed no fps)."""
    if not overrides:
        return build(name, device=device, seed=seed, full=full)
    if full:
        raise ValueError(f"{name}: constructor overrides apply to the tiny config only")
    entry = ZOO[name]
    with _construct("cpu", torch.bfloat16):
        model = entry.cls(**{**entry.tiny_config, **overrides})
    _as_loaded_(model, torch.bfloat16, keep_fp32=True)
    return randomize_(model, seed).eval()


def _image(seed: int, height: int, width: int) -> torch.Tensor:
    """A random ``[1, 3, H, W]`` image in [0, 1] (what a pipeline's image processor takes as a tensor)."""
    return torch.rand(1, 3, height, width, generator=torch.Generator().manual_seed(seed))


def _pil(seed: int, height: int, width: int):
    """A random RGB PIL image (a frame of a control video)."""
    import PIL.Image

    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return PIL.Image.fromarray(pixels.numpy())


def _modular(blocks, drop: tuple[str, ...], **components):
    """The ModularPipeline of `blocks` (a family's auto blocks) without its steps named in `drop` (those that run a
    text encoder or a prompt upsampler: the embeddings enter as the denoise steps' inputs), holding `components`."""
    for step in drop:
        blocks.sub_blocks.pop(step)
    pipe = blocks.init_pipeline()
    pipe.update_components(**components)
    return pipe


# ---------------------------------------------------------------- VAEs and image encoders

def _wan_vae(seed: int, z_dim: int = 16):
    # AutoencoderKLWan at diffusers' test size: /8 spatial, /4 temporal, z_dim latent channels
    from diffusers import AutoencoderKLWan

    return _random(AutoencoderKLWan(base_dim=3, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                    temperal_downsample=[False, True, True]), seed)


def _hunyuan_video_vae(seed: int, latent_channels: int):
    from diffusers import AutoencoderKLHunyuanVideo

    return _random(AutoencoderKLHunyuanVideo(
        latent_channels=latent_channels, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        norm_num_groups=4, spatial_compression_ratio=8, temporal_compression_ratio=4), seed)


def _kl_vae(seed: int, latent_channels: int, dtype=torch.float32):
    """AutoencoderKL, 4 blocks of 8 channels: /8 as the published image VAEs, cheap to decode at 64 px; in `dtype`
    (bf16 for the pipelines that decode the latents in the transformer's dtype, as their one-dtype checkpoints
    do)."""
    from diffusers import AutoencoderKL

    with _construct("cpu", dtype):
        vae = AutoencoderKL(block_out_channels=(8, 8, 8, 8), down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=latent_channels,
                            norm_num_groups=4, layers_per_block=1)
    return _random(vae, seed)


def _flux2_vae(seed: int, latent_channels: int):
    """AutoencoderKLFlux2 (FLUX.2's, which FLUX.3 and Bria FIBO 2 decode with), 4 blocks of 8 channels: /8 as
    published; its BatchNorm over the 2x2-patchified latents keeps its running statistics (mean 0, variance 1)."""
    from diffusers import AutoencoderKLFlux2

    return _random(AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), latent_channels=latent_channels,
                                      norm_num_groups=4, layers_per_block=1), seed)


def _dc_vae(seed: int, latent_channels: int):
    # AutoencoderDC (Sana's DC-AE) at diffusers' test size: 2 stages, so /2 (the published one is /32)
    from diffusers import AutoencoderDC

    return _random(AutoencoderDC(
        latent_channels=latent_channels, attention_head_dim=2, encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1), downsample_block_type="conv",
        upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
        scaling_factor=0.41407), seed)


def _cogvideox_vae(seed: int, latent_channels: int):
    # AutoencoderKLCogVideoX, 4 blocks of 8 channels: /8 spatial, /4 temporal as published
    from diffusers import AutoencoderKLCogVideoX

    return _random(AutoencoderKLCogVideoX(
        block_out_channels=(8, 8, 8, 8), down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4, latent_channels=latent_channels, layers_per_block=1,
        norm_num_groups=2, temporal_compression_ratio=4), seed)


def _qwen21_vae(seed: int, z_dim: int):
    # AutoencoderKLQwenImage21 at a test size: /16 spatial (its 4 downsamples), its default latents mean / std (64
    # channels) and image channels (4)
    from diffusers import AutoencoderKLQwenImage21

    vae = AutoencoderKLQwenImage21(base_dim=4, decoder_base_dim=4, z_dim=z_dim, dim_mult=[1, 1, 1, 1, 1],
                                   num_res_blocks=1)
    assert len(vae.config.latents_mean) == z_dim
    return _random(vae, seed)


def _qwen_vae(seed: int, z_dim: int = 16):
    # AutoencoderKLQwenImage at a test size: /8 spatial, its default latents mean / std (16 channels)
    from diffusers import AutoencoderKLQwenImage

    return _random(AutoencoderKLQwenImage(base_dim=4, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                          temperal_downsample=[False, True, True]), seed)


def _mmaudio(seed: int, latent_channels: int):
    """A tiny random MMAudio VAE (`latent_channels`, the transformer's audio width; hop 512 as published, so its
    latent hop 1024 gives a few audio tokens a second) and vocoder (upsampling 512 = the VAE's hop)."""
    from diffusers import MMAudioVAE, MMAudioVocoder

    vae = MMAudioVAE(mel_bins=8, latent_channels=latent_channels, hidden_channels=8, channel_multipliers=(1,),
                     layers_per_block=1, n_fft=1024, hop_length=512)
    vocoder = MMAudioVocoder(num_mels=8, upsample_initial_channel=8, upsample_rates=(8, 8, 8),
                             upsample_kernel_sizes=(16, 16, 16), resblock_kernel_sizes=(3,),
                             resblock_dilation_sizes=((1,),))
    return _random(vae, seed), _random(vocoder, seed + 1)


def _ltx2_parts(seed: int, cfg):
    """LTX-2's tiny random video VAE (/32 spatial, /8 temporal as published, `cfg.in_channels` latent channels), audio
    VAE (8 channels x 16 latent mel bins = `cfg.audio_in_channels`; 128 wide, its normalisation's length) and text
    connectors (Gemma states of 2 layers -> `cfg.caption_channels`, in bf16 as the pipeline loads them: they run on
    the prompt states in the transformer's dtype)."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    # (channels doubling per block as published: a decoder of (8, 8, 8) does not decode, its upsamplers' shuffle
    # halves the channels the next block expects)
    vae = AutoencoderKLLTX2Video(latent_channels=cfg.in_channels, block_out_channels=(8, 16, 32, 32),
                                 decoder_block_out_channels=(8, 16, 32), layers_per_block=(1, 1, 1, 1, 1),
                                 decoder_layers_per_block=(1, 1, 1, 1))
    # (its latents mean / std have base_channels entries: = 8 channels x 16 mel bins, as published)
    audio_vae = AutoencoderKLLTX2Audio(base_channels=cfg.audio_in_channels, ch_mult=(1, 1, 1), num_res_blocks=1,
                                       latent_channels=8, mel_bins=64)
    assert 8 * 64 // audio_vae.mel_compression_ratio == cfg.audio_in_channels
    dim = cfg.caption_channels
    with _construct("cpu", torch.bfloat16):
        connectors = LTX2TextConnectors(
            caption_channels=dim, text_proj_in_factor=2, video_connector_num_attention_heads=2,
            video_connector_attention_head_dim=dim // 2, video_connector_num_layers=1,
            video_connector_num_learnable_registers=8, audio_connector_num_attention_heads=2,
            audio_connector_attention_head_dim=dim // 2, audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=8)
    return _random(vae, seed), _random(audio_vae, seed + 1), _random(connectors, seed + 2)


def _clip_vision(seed: int, hidden: int, image: int = 32):
    """A tiny random CLIP vision tower (`hidden` wide, as the transformer's ``image_dim``) and its processor."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    cfg = CLIPVisionConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                           num_attention_heads=2, image_size=image, patch_size=8, projection_dim=hidden)
    with _construct("cpu", torch.float32):
        model = CLIPVisionModel(cfg)
    processor = CLIPImageProcessor(size={"shortest_edge": image}, crop_size={"height": image, "width": image})
    return _random(model, seed), processor


def _siglip_vision(seed: int, hidden: int, image: int = 32):
    """A tiny random SigLIP vision tower (`hidden` wide, as the transformer's ``image_proj_dim``) and its processor."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    cfg = SiglipVisionConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                             num_attention_heads=2, image_size=image, patch_size=8)
    with _construct("cpu", torch.float32):
        model = SiglipVisionModel(cfg)
    return _random(model, seed), SiglipImageProcessor(size={"height": image, "width": image})


# ---------------------------------------------------------------- Wan's siblings

def _wan_vace():
    # WanVACEPipeline: the VAE encodes the (default: zero) control video and its mask into the 96 control channels;
    # CFG as two forwards
    from diffusers import FlowMatchEulerDiscreteScheduler, WanVACEPipeline

    transformer = build("wan-vace")
    pipe = WanVACEPipeline(tokenizer=None, text_encoder=None, vae=_wan_vae(11), transformer=transformer,
                           scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0))
    randn, dim = _embeds(12), transformer.config.text_dim
    video = [_pil(13 + i, 32, 32) for i in range(5)]  # a control video: the control stream carries values
    return pipe, dict(prompt_embeds=randn(1, 8, dim), negative_prompt_embeds=randn(1, 8, dim), video=video,
                      height=32, width=32, num_frames=5, num_inference_steps=_STEPS, guidance_scale=5.0,
                      output_type="latent")


def _skyreels_v2():
    # SkyReelsV2Pipeline (text to video, one timestep per sample): UniPC with flow sigmas, CFG as two forwards
    from diffusers import SkyReelsV2Pipeline, UniPCMultistepScheduler

    transformer = _transformer("skyreels-v2", inject_sample_info=False)
    pipe = SkyReelsV2Pipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=_wan_vae(21),
                              scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction",
                                                                use_flow_sigmas=True, flow_shift=8.0))
    randn, dim = _embeds(22), transformer.config.text_dim
    return pipe, dict(prompt_embeds=randn(1, 8, dim), negative_prompt_embeds=randn(1, 8, dim), height=32, width=32,
                      num_frames=9, num_inference_steps=_STEPS, guidance_scale=6.0, output_type="latent")


def _chronoedit():
    # ChronoEditPipeline (image editing as a 2-frame video): the image through a tiny CLIP vision tower (the
    # pipeline takes `image` or `image_embeds`, never both, and needs the image for its VAE condition) and the VAE
    from diffusers import ChronoEditPipeline, UniPCMultistepScheduler

    transformer = build("chronoedit")
    encoder, processor = _clip_vision(31, transformer.config.image_dim)
    pipe = ChronoEditPipeline(tokenizer=None, text_encoder=None, image_encoder=encoder, image_processor=processor,
                              transformer=transformer, vae=_wan_vae(32),
                              scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction",
                                                                use_flow_sigmas=True, flow_shift=5.0))
    randn, dim = _embeds(33), transformer.config.text_dim
    return pipe, dict(image=_image(34, 32, 32), prompt_embeds=randn(1, 8, dim), negative_prompt_embeds=randn(1, 8, dim),
                      height=32, width=32, num_frames=5, num_inference_steps=_STEPS, guidance_scale=5.0,
                      output_type="latent")


# ---------------------------------------------------------------- Hunyuan's siblings

def _hunyuan_framepack():
    # HunyuanVideoFramepackPipeline (inverted anti-drifting sampling, one section): SigLIP image states, the VAE's
    # image latents, embedded guidance and true CFG (two forwards); 64 px so the 4x history embedding has a patch
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoFramepackPipeline

    transformer = build("hunyuan-framepack")
    cfg = transformer.config
    encoder, processor = _siglip_vision(41, cfg.image_proj_dim)
    with _quiet_image_processor_fallback():
        pipe = HunyuanVideoFramepackPipeline(
            text_encoder=None, tokenizer=None, transformer=transformer, vae=_hunyuan_video_vae(42, cfg.in_channels),
            scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder_2=None, tokenizer_2=None, image_encoder=encoder,
            feature_extractor=processor)
    randn = _embeds(43)
    return pipe, dict(image=_image(44, 64, 64), prompt_embeds=randn(1, 8, cfg.text_embed_dim),
                      prompt_attention_mask=_mask(8, 2), pooled_prompt_embeds=randn(1, cfg.pooled_projection_dim),
                      negative_prompt_embeds=randn(1, 8, cfg.text_embed_dim),
                      negative_prompt_attention_mask=_mask(8, 0),
                      negative_pooled_prompt_embeds=randn(1, cfg.pooled_projection_dim), true_cfg_scale=2.0,
                      guidance_scale=6.0, height=64, width=64, num_frames=5, latent_window_size=2,
                      num_inference_steps=_STEPS, output_type="latent")


def _sana_video():
    # SanaVideoPipeline: Gemma-2 states with masks, the Wan VAE's latents, CFG batched, flow DPM-Solver
    from diffusers import DPMSolverMultistepScheduler, SanaVideoPipeline

    transformer = build("sana-video")
    cfg = transformer.config
    pipe = SanaVideoPipeline(tokenizer=None, text_encoder=None, vae=_wan_vae(91, cfg.in_channels),
                             transformer=transformer, scheduler=DPMSolverMultistepScheduler(
                                 prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0))
    return pipe, dict(**_masked_embeds(_embeds(92), cfg.caption_channels), height=32, width=32, frames=9,
                      num_inference_steps=_STEPS, guidance_scale=6.0, use_resolution_binning=False,
                      output_type="latent")


def _motif_video():
    # MotifVideoPipeline (text to video): T5-Gemma states with masks, the Wan VAE, CFG through its guider (batched)
    from diffusers import FlowMatchEulerDiscreteScheduler, MotifVideoPipeline
    from diffusers.guiders import ClassifierFreeGuidance

    transformer = build("motif-video")
    cfg = transformer.config
    pipe = MotifVideoPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=_wan_vae(101, cfg.out_channels),
                              text_encoder=None, tokenizer=None, transformer=transformer,
                              guider=ClassifierFreeGuidance(guidance_scale=5.0))
    return pipe, dict(**_masked_embeds(_embeds(102), cfg.text_embed_dim), height=32, width=32, num_frames=5,
                      num_inference_steps=_STEPS, output_type="latent")


def _cogvideox():
    # CogVideoXPipeline: T5 states (no mask), the 3-D rotary it makes, CFG batched, CogVideoX's DDIM
    from diffusers import CogVideoXDDIMScheduler, CogVideoXPipeline

    transformer = build("cogvideox")
    cfg = transformer.config
    pipe = CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=_cogvideox_vae(111, cfg.in_channels),
                             transformer=transformer, scheduler=CogVideoXDDIMScheduler(timestep_spacing="trailing"))
    randn = _embeds(112)
    return pipe, dict(prompt_embeds=randn(1, 8, cfg.text_embed_dim), negative_prompt_embeds=randn(1, 8,
                      cfg.text_embed_dim), height=64, width=64, num_frames=9, num_inference_steps=_STEPS,
                      guidance_scale=6.0, output_type="latent")


def _kandinsky6(full: bool = False, device="cpu"):
    # Kandinsky6TI2VAPipeline (text to video + audio): Qwen2.5-VL states and CLIP pooled ones, the audio latents
    # sampled alongside (its MMAudio VAE and vocoder are required for that even for latent output), CFG as two
    # forwards; returns (video latents, audio latents)
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky6TI2VAPipeline

    transformer = _transformer("kandinsky6", full, device)
    cfg = transformer.config
    audio_vae, vocoder = _mmaudio(121, cfg.in_audio_dim)
    pipe = Kandinsky6TI2VAPipeline(transformer=transformer, vae=_hunyuan_video_vae(123, cfg.in_visual_dim),
                                   text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                   scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), audio_vae=audio_vae,
                                   vocoder=vocoder)
    randn = _embeds(124)
    return pipe, dict(prompt_embeds=randn(1, 8, cfg.in_text_dim), pooled_prompt_embeds=randn(1, cfg.in_text_dim2),
                      negative_prompt_embeds=randn(1, 6, cfg.in_text_dim),
                      negative_pooled_prompt_embeds=randn(1, cfg.in_text_dim2), height=64, width=64, num_frames=5,
                      num_inference_steps=_STEPS, guidance_scale=5.0, output_type="latent")


def _ltx2(full: bool = False, device="cpu"):
    # LTX2Pipeline (text to video + audio): stacked Gemma layer states with masks through the (random) connectors,
    # video and audio latents denoised together, CFG batched; returns (video latents, audio latents)
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    transformer = _transformer("ltx2", full, device)
    cfg = transformer.config
    vae, audio_vae, connectors = _ltx2_parts(141, cfg)
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae,
                        text_encoder=None, tokenizer=None, connectors=connectors, transformer=transformer,
                        vocoder=None)
    randn = _embeds(144)
    return pipe, dict(prompt_embeds=randn(1, 16, 2 * cfg.caption_channels), prompt_attention_mask=_mask(16, 4),
                      negative_prompt_embeds=randn(1, 16, 2 * cfg.caption_channels),
                      negative_prompt_attention_mask=_mask(16, 0), height=64, width=64, num_frames=9,
                      frame_rate=24.0, num_inference_steps=_STEPS, guidance_scale=4.0, output_type="latent")


# ---------------------------------------------------------------- image DiTs

def _sana():
    # SanaPipeline: Gemma-2 states with masks, the DC-AE latents (32 channels), CFG batched, flow DPM-Solver
    from diffusers import DPMSolverMultistepScheduler, SanaPipeline

    transformer = build("sana")
    cfg = transformer.config
    pipe = SanaPipeline(tokenizer=None, text_encoder=None, vae=_dc_vae(51, cfg.in_channels), transformer=transformer,
                        scheduler=DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                              flow_shift=3.0))
    return pipe, dict(**_masked_embeds(_embeds(52), cfg.caption_channels), height=32, width=32,
                      num_inference_steps=_STEPS, guidance_scale=4.5, use_resolution_binning=False,
                      output_type="latent")


def _pixart_sigma():
    # PixArtSigmaPipeline: T5 states with masks, CFG batched, DPM-Solver; learn-sigma output split by the pipeline;
    # decoded by the (family-patched) AutoencoderKL
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline

    transformer = build("pixart")
    cfg = transformer.config
    pipe = PixArtSigmaPipeline(tokenizer=None, text_encoder=None, vae=_kl_vae(61, cfg.in_channels),
                               transformer=transformer, scheduler=DPMSolverMultistepScheduler())
    return pipe, dict(**_masked_embeds(_embeds(62), cfg.caption_channels), height=64, width=64,
                      num_inference_steps=_STEPS, guidance_scale=4.5, use_resolution_binning=False, output_type="pt")


def _auraflow():
    # AuraFlowPipeline: Pile-T5 states with masks, CFG batched, flow-matching Euler; decoded by the AutoencoderKL
    from diffusers import AuraFlowPipeline, FlowMatchEulerDiscreteScheduler

    transformer = build("auraflow")
    cfg = transformer.config
    pipe = AuraFlowPipeline(tokenizer=None, text_encoder=None, vae=_kl_vae(71, cfg.in_channels),
                            transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler())
    return pipe, dict(**_masked_embeds(_embeds(72), cfg.joint_attention_dim), height=64, width=64,
                      num_inference_steps=_STEPS, guidance_scale=3.5, output_type="pt")


def _cogview4():
    # CogView4Pipeline: GLM-4 states (no mask), CFG as two forwards, dynamic-shift flow Euler; the AutoencoderKL
    from diffusers import CogView4Pipeline, FlowMatchEulerDiscreteScheduler

    transformer = build("cogview4")
    cfg = transformer.config
    pipe = CogView4Pipeline(tokenizer=None, text_encoder=None, vae=_kl_vae(81, cfg.in_channels),
                            transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(
                                base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True,
                                time_shift_type="linear"))
    randn = _embeds(82)
    return pipe, dict(prompt_embeds=randn(1, 16, cfg.text_embed_dim), negative_prompt_embeds=randn(1, 16,
                      cfg.text_embed_dim), height=64, width=64, num_inference_steps=_STEPS, guidance_scale=5.0,
                      output_type="pt")


def _krea2(full: bool = False, device="cpu"):
    # Krea2Pipeline: the tapped Qwen3-VL layers per token (B, L, layers, C) with boolean masks, 2x2-packed Qwen-Image
    # VAE latents, CFG as two forwards; decoded by the Qwen-Image VAE
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline

    transformer = _transformer("krea2", full, device)
    cfg = transformer.config
    pipe = Krea2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=_qwen_vae(131, cfg.in_channels // 4),
                         text_encoder=None, tokenizer=None, transformer=transformer)
    randn = _embeds(132)
    shape = (1, 12, cfg.num_text_layers, cfg.text_hidden_dim)
    return pipe, dict(prompt_embeds=randn(*shape), prompt_embeds_mask=_mask(12, 3).bool(),
                      negative_prompt_embeds=randn(*shape), negative_prompt_embeds_mask=_mask(12, 0).bool(),
                      height=64, width=64, num_inference_steps=_STEPS, guidance_scale=3.5, output_type="pt")


def _bria_fibo2(full: bool = False, device="cpu"):
    # BriaFibo2Pipeline, an edit (the image to edit through the VAE: its tokens the transformer's clean context, with
    # the per-token noise mask): one text bundle for the Perceiver plus one per injection block (B, bundles, L, C)
    # with a boolean mask (none for the unpadded negative prompt), CFG as two forwards; the AutoencoderKLFlux2
    from diffusers import BriaFibo2Pipeline, FlowMatchEulerDiscreteScheduler

    transformer = _transformer("bria-fibo2", full, device)
    cfg = transformer.config
    pipe = BriaFibo2Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(),
                             vae=_flux2_vae(181, cfg.in_channels), text_encoder=None, processor=None)
    randn, bundles = _embeds(182), 1 + len(cfg.injection_layer_ids)
    return pipe, dict(image=_pil(183, 64, 64), prompt_embeds=randn(1, bundles, 12, cfg.cap_feat_dim),
                      prompt_embeds_mask=_mask(12, 3).bool(), negative_prompt_embeds=randn(1, bundles, 8,
                      cfg.cap_feat_dim), height=64, width=64, num_inference_steps=_STEPS, guidance_scale=5.0,
                      output_type="pt")


def _flux3(full: bool = False, device="cpu"):
    # FLUX.3's modular pipeline (Flux3AutoBlocks without the prompt upsampler and text encoder steps), image to image:
    # the reference through the VAE (its tokens run the image_cond mode blocks; `full`: a 1024 px one, kept whole by the
    # pipeline, as many tokens as a 1024 px image), stacked Qwen3-VL layer states, CFG through its guider (two
    # forwards); 2x2-packed latents decoded by the AutoencoderKLFlux2
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.guiders import ClassifierFreeGuidance
    from diffusers.modular_pipelines.flux3 import Flux3AutoBlocks

    transformer = _transformer("flux3", full, device)
    cfg = transformer.config
    pipe = _modular(Flux3AutoBlocks(), ("prompt_upsampler", "text_encoder"), transformer=transformer,
                    vae=_flux2_vae(191, cfg.in_channels // 4), scheduler=FlowMatchEulerDiscreteScheduler(),
                    guider=ClassifierFreeGuidance(guidance_scale=4.0))
    randn, side = _embeds(192), 1024 if full else 64
    return pipe, dict(image=_pil(193, side, side), prompt_embeds=randn(1, 12, cfg.joint_attention_dim),
                      negative_prompt_embeds=randn(1, 8, cfg.joint_attention_dim), height=64, width=64,
                      num_inference_steps=_STEPS, output_type="pt", output="images")


def _qwen_image21(full: bool = False, device="cpu"):
    # Qwen-Image 2.1's modular pipeline (QwenImage21AutoBlocks without the text and VAE encoder steps), text to image:
    # Qwen3-VL states with long masks and their (here empty) vision-position masks, CFG through its guider (two
    # forwards), each branch's first forward prefilling its text KV cache ("extract") and the next reading it
    # ("cached"); prompt and negative prompt padded to one length, as their calls then share signatures
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.guiders import ClassifierFreeGuidance
    from diffusers.modular_pipelines.qwenimage21 import QwenImage21AutoBlocks

    transformer = _transformer("qwen-image-21", full, device)
    cfg = transformer.config
    pipe = _modular(QwenImage21AutoBlocks(), ("text_encoder", "vae_encoder"), transformer=transformer,
                    vae=_qwen21_vae(201, cfg.in_channels), scheduler=FlowMatchEulerDiscreteScheduler(),
                    guider=ClassifierFreeGuidance(guidance_scale=4.0))
    randn, no_vision = _embeds(202), torch.zeros(1, 12, dtype=torch.bool)
    return pipe, dict(prompt_embeds=randn(1, 12, cfg.context_in_dim), prompt_embeds_mask=_mask(12, 3),
                      image_pad_mask=no_vision, negative_prompt_embeds=randn(1, 12, cfg.context_in_dim),
                      negative_prompt_embeds_mask=_mask(12, 7), negative_image_pad_mask=no_vision, height=64,
                      width=64, num_inference_steps=_STEPS, output_type="pt", output="images")


def _ideogram4(full: bool = False, device="cpu"):
    # Ideogram 4's modular pipeline (Ideogram4AutoBlocks without the prompt upsampling and text encoder steps): the
    # tapped Qwen3-VL features of a left-padded prompt (float32, zero over the padding) and its length, packed by the
    # pipeline into [pad | text | image] with segment ids and indicators; asymmetric CFG over a second (unconditional)
    # transformer on the image tokens alone, a guidance weight per step; the AutoencoderKLFlux2
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.modular_pipelines.ideogram4 import Ideogram4AutoBlocks

    transformer = _transformer("ideogram4", full, device)
    cfg = transformer.config
    pipe = _modular(Ideogram4AutoBlocks(), ("prompt_upsample", "text_encoder"), transformer=transformer,
                    unconditional_transformer=_transformer("ideogram4", full, device, seed=211),
                    vae=_flux2_vae(212, cfg.in_channels // 4), scheduler=FlowMatchEulerDiscreteScheduler())
    features = _embeds(213, torch.float32)(1, 16, cfg.llm_features_dim)
    features[:, :6] = 0  # 10 prompt tokens, left-padded to 16
    return pipe, dict(text_features=features, text_lengths=[10], height=64, width=64, num_inference_steps=_STEPS,
                      guidance_schedule=[7.0, 3.0], output_type="pt", output="images")


def _cogview3plus():
    # CogView3PlusPipeline: T5 states (no mask), CFG batched, CogVideoX's DDIM; the AutoencoderKL
    from diffusers import CogVideoXDDIMScheduler, CogView3PlusPipeline

    transformer = build("cogview3plus")
    cfg = transformer.config
    pipe = CogView3PlusPipeline(tokenizer=None, text_encoder=None, vae=_kl_vae(151, cfg.in_channels, torch.bfloat16),
                                transformer=transformer, scheduler=CogVideoXDDIMScheduler(timestep_spacing="trailing"))
    randn = _embeds(152)
    return pipe, dict(prompt_embeds=randn(1, 8, cfg.text_embed_dim), negative_prompt_embeds=randn(1, 8,
                      cfg.text_embed_dim), height=64, width=64, num_inference_steps=_STEPS, guidance_scale=5.0,
                      output_type="pt")


def _dit():
    # DiTPipeline: ImageNet class labels (no text), CFG batched with the null class, DDIM; the AutoencoderKL
    from diffusers import DDIMScheduler, DiTPipeline

    transformer = build("dit")
    pipe = DiTPipeline(transformer=transformer, vae=_kl_vae(161, transformer.config.in_channels, torch.bfloat16),
                       scheduler=DDIMScheduler())
    return pipe, dict(class_labels=[207], guidance_scale=4.0, num_inference_steps=_STEPS, output_type="np")


def _latte():
    # LattePipeline: T5 states (no mask: mask_feature off, as the model's mask path breaks on its frame-repeated
    # batch), CFG batched, DDIM; learn-sigma output split by the pipeline
    from diffusers import DDIMScheduler, LattePipeline

    transformer = build("latte")
    cfg = transformer.config
    pipe = LattePipeline(tokenizer=None, text_encoder=None, vae=_kl_vae(171, cfg.in_channels),
                         transformer=transformer, scheduler=DDIMScheduler())
    randn = _embeds(172)
    return pipe, dict(negative_prompt=None, prompt_embeds=randn(1, 8, cfg.caption_channels),
                      negative_prompt_embeds=randn(1, 8, cfg.caption_channels), video_length=4, height=64, width=64,
                      num_inference_steps=_STEPS, guidance_scale=5.0, mask_feature=False, output_type="latent")


PIPELINES: dict[str, Callable[..., tuple]] = {
    "wan-vace": _wan_vace,
    "skyreels-v2": _skyreels_v2,
    "chronoedit": _chronoedit,
    "hunyuan-framepack": _hunyuan_framepack,
    "sana-video": _sana_video,
    "motif-video": _motif_video,
    "cogvideox": _cogvideox,
    "kandinsky6": _kandinsky6,
    "ltx2": _ltx2,
    "krea2": _krea2,
    "bria-fibo2": _bria_fibo2,
    "flux3": _flux3,
    "qwen-image-21": _qwen_image21,
    "ideogram4": _ideogram4,
    "cogview3plus": _cogview3plus,
    "dit": _dit,
    "latte": _latte,
    "sana": _sana,
    "pixart": _pixart_sigma,
    "auraflow": _auraflow,
    "cogview4": _cogview4,
}
