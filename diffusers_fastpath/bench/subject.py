"""The model under test (`Subject`): built from the arguments, with one step's inputs as its pipeline passes them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn


@dataclass(frozen=True)
class PipelineFamily:
    """How the generation level builds a family's pipeline around its transformer: a random VAE of a published
    config, no text encoder, called with random prompt embeddings. Each builder is the name of a function of
    `diffusers_fastpath.testing` or a function."""

    kernels: str  # the family of its kernel cases
    transformer: str | Callable  # (config, dtype, device, seed) -> transformer
    vae: str | Callable  # (config, dtype, device, seed, latent_channels=) -> VAE
    pipeline: str | Callable  # (transformer, vae or None) -> pipeline
    embeddings: str | Callable  # (pipe, batch=, txt_tokens=, seed=) -> the call's keyword arguments
    packing: int = 4  # the transformer's input channels per VAE latent channel (FLUX's 2x2 patches: 4; LTX: 1)
    video: bool = False  # called with num_frames (--frames)

    def builder(self, part: str) -> Callable:
        from .. import testing

        fn = getattr(self, part)
        return getattr(testing, fn) if isinstance(fn, str) else fn


# LTX-Video's VAE: diffusers' AutoencoderKLLTXVideo defaults (LTX-Video 0.9.0's VAE, the config issue 42's table
# measured: 32x spatial and 8x temporal compression, 128 latent channels, no timestep conditioning) and a tiny
# config of the same compression. No text encoder; FlowMatchEulerDiscreteScheduler's default config, as
# `testing.ltx_pipeline` has it (the schedule changes the sigmas, not the work of a step).
LTX_VAE_CONFIGS = {"ltx-video": {}, "ltx-video-tiny": dict(block_out_channels=(8, 8, 8, 8),
                                                           decoder_block_out_channels=(8, 8, 8, 8),
                                                           layers_per_block=(1, 1, 1, 1, 1),
                                                           decoder_layers_per_block=(1, 1, 1, 1, 1))}


def build_ltx_vae(config="ltx-video-tiny", dtype=torch.bfloat16, device="cpu", seed=0, **overrides) -> nn.Module:
    """An ``AutoencoderKLLTXVideo`` from a named config of `LTX_VAE_CONFIGS` or a dict, random weights."""
    from diffusers import AutoencoderKLLTXVideo

    from ..testing._common import _random_model

    return _random_model(AutoencoderKLLTXVideo, LTX_VAE_CONFIGS, config, dtype, device, seed, overrides)


def _ltx_pipeline(transformer: nn.Module, vae: nn.Module | None):
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXPipeline

    return LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                       transformer=transformer)


def _ltx_embeddings(cfg: bool) -> Callable:
    """LTX-Video's call: with classifier-free guidance (the base model: the pipeline's guidance_scale 3.0, prompt
    and negative prompt in one batch-2 forward) or without (the distilled models: guidance_scale 1.0)."""

    def embeddings(pipe, batch: int, txt_tokens: int, seed: int) -> dict[str, Any]:
        from ..testing import ltx_prompt_embeddings

        call = ltx_prompt_embeddings(pipe, tokens=txt_tokens, padding=min(3, txt_tokens - 1), seed=seed)
        if not cfg:
            call = dict(prompt_embeds=call["prompt_embeds"], prompt_attention_mask=call["prompt_attention_mask"],
                        guidance_scale=1.0)
        return dict(call, num_videos_per_prompt=batch)

    return embeddings


PIPELINE_FAMILIES = {
    "flux": PipelineFamily("flux", "build_flux_transformer", "build_flux_vae", "flux_pipeline", "prompt_embeddings"),
    "chroma": PipelineFamily("flux", "build_chroma_transformer", "build_flux_vae", "chroma_pipeline",
                             "chroma_prompt_embeddings"),
    "flux2": PipelineFamily("flux2", "build_flux2_transformer", "build_flux2_vae", "flux2_pipeline",
                            "flux2_prompt_embeddings"),
    "ltx": PipelineFamily("ltx", "build_ltx_transformer", build_ltx_vae, _ltx_pipeline, _ltx_embeddings(cfg=True),
                          packing=1, video=True),
    "ltx-distilled": PipelineFamily("ltx", "build_ltx_transformer", build_ltx_vae, _ltx_pipeline,
                                    _ltx_embeddings(cfg=False), packing=1, video=True),
}
# model name -> (family, its transformer's config, its VAE's config)
PIPELINE_MODELS = {
    "flux-tiny": ("flux", "flux-tiny", "flux-tiny"), "flux-dev": ("flux", "flux-dev", "flux-dev"),
    "flux-schnell": ("flux", "flux-schnell", "flux-dev"),  # FLUX.1-schnell: FLUX.1-dev's VAE
    "chroma-tiny": ("chroma", "chroma-tiny", "flux-tiny"), "chroma": ("chroma", "chroma", "flux-dev"),  # FLUX.1's VAE
    "flux2-dev": ("flux2", "flux2-dev", "flux2-dev"), "flux2-klein": ("flux2", "flux2-klein", "flux2-dev"),
    "flux2-tiny": ("flux2", "flux2-tiny", "flux2-tiny"),
    "flux2-klein-tiny": ("flux2", "flux2-klein-tiny", "flux2-tiny"),
    # LTX-Video 2B (the base model, with CFG) and a distilled run of the same transformer config (no CFG, few steps)
    "ltx-video": ("ltx", "ltx-video", "ltx-video"), "ltx-video-tiny": ("ltx", "ltx-video-tiny", "ltx-video-tiny"),
    "ltx-video-distilled": ("ltx-distilled", "ltx-video", "ltx-video"),
    "ltx-video-distilled-tiny": ("ltx-distilled", "ltx-video-tiny", "ltx-video-tiny"),
}
FLUX_MODELS, CHROMA_MODELS, FLUX2_MODELS, LTX_MODELS = (
    tuple(m for m, (f, _, _) in PIPELINE_MODELS.items() if f in families)
    for families in (("flux",), ("chroma",), ("flux2",), ("ltx", "ltx-distilled")))
ERNIE_MODELS = ("ernie-image-tiny", "ernie-image")
# step level only (no VAE config of theirs is published with this package): model name -> (builder, config,
# inputs builder, how the latent size follows from the image size: "grid" 16x16 pixels per token, "size" the 8x latent,
# "latent8" the 8x latent as a grid, "latent32" the 32x latent, "video8" Wan's 8x, 4-frame latent of --frames frames,
# "video16" HunyuanVideo-1.5's 16x, 4-frame latent)
STEP_MODELS = {
    "sd3.5-large": ("build_sd3_transformer", "sd3.5-large", "sd3_transformer_inputs", "size"),
    "sd3-tiny": ("build_sd3_transformer", "sd3-tiny", "sd3_transformer_inputs", "size"),
    "qwen-image": ("build_qwenimage_transformer", "qwen-image", "qwenimage_transformer_inputs", "grid"),
    "qwen-image-tiny": ("build_qwenimage_transformer", "qwen-image-tiny", "qwenimage_transformer_inputs", "grid"),
    "hunyuan-image": ("build_hunyuan_transformer", "hunyuan-image", "hunyuan_transformer_inputs", "latent32"),
    "hunyuan-image-tiny": ("build_hunyuan_transformer", "hunyuan-image-tiny", "hunyuan_transformer_inputs", "latent32"),
    "z-image": ("build_zimage_transformer", "z-image", "zimage_transformer_inputs", "latent8"),
    "z-image-tiny": ("build_zimage_transformer", "z-image-tiny", "zimage_transformer_inputs", "latent8"),
    "lumina2": ("build_lumina2_transformer", "lumina2", "lumina2_transformer_inputs", "latent8"),
    "lumina2-tiny": ("build_lumina2_transformer", "lumina2-tiny", "lumina2_transformer_inputs", "latent8"),
    "hunyuanvideo-1.5": ("build_hunyuan_video15_transformer", "hunyuanvideo-1.5", "hunyuan_video15_transformer_inputs",
                         "video16"),
    "hunyuanvideo-1.5-tiny": ("build_hunyuan_video15_transformer", "hunyuanvideo-1.5-tiny",
                              "hunyuan_video15_transformer_inputs", "video16"),
    "wan-14b": ("build_wan_transformer", "wan-14b", "wan_transformer_inputs", "video8"),
    "wan-tiny": ("build_wan_transformer", "wan-tiny", "wan_transformer_inputs", "video8"),
}
# every class of the zoo (`testing.zoo`: the models no family adapter covers, patched by the generic path), step level
# only: "zoo:NAME" at its published config and resolution, "zoo:NAME-tiny" tiny
def _zoo_models() -> tuple[str, ...]:
    from ..testing import zoo

    return tuple(f"zoo:{n}{s}" for n, e in sorted(zoo.ZOO.items())
                 for s in (("", "-tiny") if e.full_config is not None else ("-tiny",)))  # ({}: the class defaults)


ZOO_MODELS = _zoo_models()


def zoo_knobs(values: list[str]) -> dict[str, int]:
    """``--zoo-size KNOB=INT`` values as the zoo's size kwargs; a clear error for any other form."""
    knobs = {}
    for value in values:
        key, sep, number = value.partition("=")
        if not sep or not key.isidentifier() or not number.lstrip("-").isdigit():
            raise SystemExit(f"--zoo-size wants KNOB=INT (e.g. cached=1, text=256), got {value!r}")
        knobs[key] = int(number)
    return knobs

# the family of a step model's kernel cases (default "other")
STEP_FAMILIES = {"build_sd3_transformer": "sd3", "build_qwenimage_transformer": "qwen"}
# fp32 is for the VAE level (Wan's model card loads its VAE in fp32); a transformer's fused ops take bf16 / fp16 only
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Subject:
    """The model under test: its transformer, one step's inputs and, for the `PIPELINE_MODELS` and a real FLUX
    pipeline, a pipeline around it with the keyword arguments of its call (prompt embeddings, or a real pipeline's
    prompt)."""

    name: str
    family: str  # "flux" (FLUX.1 and Chroma: the same kernels at the same shapes), "flux2", "ernie", "sd3", "qwen",
    # "ltx", or "other" (no kernel cases)
    transformer: nn.Module
    step_inputs: dict[str, Any]
    pipe: Any = None
    call_kwargs: dict[str, Any] = field(default_factory=dict)
    no_generation: str | None = None  # why the generation level cannot run for this model

    @property
    def embeddings_given(self) -> bool:
        """The pipeline is called with prompt embeddings (random weights, no text encoder): it encodes no text."""
        return "prompt_embeds" in self.call_kwargs

    def step(self) -> torch.Tensor:
        out = self.transformer(**self.step_inputs, return_dict=False)[0]
        while isinstance(out, (list, tuple)) and len(out) and isinstance(out[0], (list, tuple)):
            out = out[0]  # a model returning several modalities (MiniMax-H3, Cosmos 3): the first
        return torch.stack(out) if isinstance(out, (list, tuple)) else out  # Z-Image: one latent per sample


def build_subject(args: argparse.Namespace, device: torch.device, need_vae: bool) -> Subject:
    """The model the arguments name, with random weights unless it is a real pipeline, quantized as ``--quant``
    says (`quant.quantize`)."""
    from .. import testing

    dtype = DTYPES[args.dtype]
    grid = (args.height // 16, args.width // 16)
    if args.model in ERNIE_MODELS:
        model = testing.build_ernie_image_transformer(args.model, dtype, device, seed=args.seed)
        # before quantizing: the inputs take the dtype of the model's weights (float8 storage under layerwise casting)
        inputs = testing.ernie_image_inputs(model, batch=args.batch, grid=grid, text_lens=(args.text_tokens,),
                                            seed=args.seed + 1)
        model = _quantized(model, args, device)
        return Subject(args.model, "ernie", model, inputs,
                       no_generation="not for ERNIE-Image here (no VAE config is published with this package); "
                                     "use the step level")
    if args.model in ZOO_MODELS:
        from ..testing import zoo

        name = args.model[len("zoo:"):].removesuffix("-tiny")
        full = not args.model.endswith("-tiny")
        model = zoo.build(name, dtype=dtype, device=device, seed=args.seed, full=full)
        inputs = zoo.inputs(name, model, batch=args.batch, seed=args.seed + 1, full=full,
                            **zoo_knobs(getattr(args, "zoo_size", [])))
        inputs.pop("return_dict", None)
        return Subject(args.model, "other", _quantized(model, args, device), inputs,
                       no_generation=f"not for {args.model} here (the zoo builds transformers only); use the step level")
    if args.model in STEP_MODELS:
        build, config, make_inputs, layout = STEP_MODELS[args.model]
        model = getattr(testing, build)(config, dtype, device, seed=args.seed)
        latent = {"grid": dict(grid=grid), "size": dict(size=(args.height // 8, args.width // 8)),
                  "latent8": dict(grid=(args.height // 8, args.width // 8)),  # Z-Image, Lumina2: [C, H/8, W/8]
                  "latent32": dict(grid=(args.height // 32, args.width // 32)),  # HunyuanImage: 32x VAE, 1x1 patches
                  "video8": dict(grid=(args.height // 8, args.width // 8), frames=(args.frames - 1) // 4 + 1),
                  "video16": dict(grid=(args.height // 16, args.width // 16),
                                  frames=(args.frames - 1) // 4 + 1)}[layout]
        inputs = getattr(testing, make_inputs)(model, batch=args.batch, txt_tokens=args.text_tokens,
                                               seed=args.seed + 1, **latent)
        model = _quantized(model, args, device)
        return Subject(args.model, STEP_FAMILIES.get(build, "other"), model, inputs,
                       no_generation=f"not for {args.model} here (no pipeline with a VAE config of its own is "
                                     "published with this package); use the step level")
    if args.model in PIPELINE_MODELS:
        pipeline_family, config, vae_config = PIPELINE_MODELS[args.model]
        fam = PIPELINE_FAMILIES[pipeline_family]
        family = fam.kernels
        model = _quantized(fam.builder("transformer")(config, dtype, device, seed=args.seed), args, device)
        vae = None
        # Flux2KleinPipeline un-normalises its latents with the VAE's batch-norm statistics before it looks at
        # output_type (diffusers 0.42.1), so a klein pipeline needs its VAE for the step level's latent call too
        if need_vae or (pipeline_family == "flux2" and not model.config.guidance_embeds):
            vae = fam.builder("vae")(vae_config, dtype, device, seed=args.seed + 1,
                                     latent_channels=model.config.in_channels // fam.packing)
        pipe = fam.builder("pipeline")(model, vae)
        padding = dict(padding=args.text_tokens // 2) if pipeline_family == "chroma" else {}  # a half-padded prompt
        call_kwargs = fam.builder("embeddings")(pipe, batch=args.batch, txt_tokens=args.text_tokens,
                                                seed=args.seed + 2, **padding)
        if fam.video:
            call_kwargs["num_frames"] = args.frames
    else:  # a real FLUX pipeline (Hub id or folder): the call encodes the prompt with its own text encoders
        from diffusers import FluxPipeline

        pipe = FluxPipeline.from_pretrained(args.model, torch_dtype=dtype).to(device)
        pipe.transformer = model = _quantized(pipe.transformer, args, device)
        call_kwargs = dict(prompt=args.prompt, num_images_per_prompt=args.batch, max_sequence_length=args.text_tokens)
        family = "flux"
    pipe.set_progress_bar_config(disable=True)
    subject = Subject(args.model, family, model, {}, pipe=pipe, call_kwargs=call_kwargs)
    subject.step_inputs = _pipeline_step_inputs(subject, args, device)
    return subject


def _quantized(model: nn.Module, args: argparse.Namespace, device: torch.device) -> nn.Module:
    if args.quant == "none":
        return model
    from .quant import quantize

    return quantize(model, args.quant, device)


def _pipeline_step_inputs(subject: Subject, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The transformer's inputs exactly as the pipeline passes them at its first step (dtypes and strides
    included, so that a compiled step and a compiled generation share one graph)."""
    captured: dict[str, Any] = {}

    def grab(module, posargs, kwargs):
        if not captured:
            captured.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})

    handle = subject.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        generate(subject, args, device, steps=1, output_type="latent")
    finally:
        handle.remove()
    captured.pop("return_dict", None)
    return captured


def generate(subject: Subject, args: argparse.Namespace, device: torch.device, steps: int,
             output_type: str = "np") -> dict[str, Any]:
    """One pipeline call from the subject's prompt embeddings: its final latents (captured by a step-end callback
    of the same call) and its output."""
    captured = {}

    def on_step_end(pipe, i, t, kwargs):
        captured["latents"] = kwargs["latents"]  # the final latents, before unpacking and decoding
        return {}

    generator = torch.Generator(device).manual_seed(args.seed + 3)
    images = subject.pipe(**subject.call_kwargs, height=args.height, width=args.width, num_inference_steps=steps,
                          generator=generator, output_type=output_type, callback_on_step_end=on_step_end,
                          return_dict=False)[0]  # images, or a video's frames
    return dict(latents=captured["latents"], image=images)
