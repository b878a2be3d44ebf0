"""The model under test (`Subject`): built from the arguments, with one step's inputs as its pipeline passes them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# the generation level too: a pipeline around the transformer with a random VAE and no text encoder, called with
# random prompt embeddings. Per family: (the family of its kernel cases, transformer builder, VAE builder, pipeline,
# prompt embeddings); per model: (family, its VAE's config; the model's name is its transformer's config)
PIPELINE_FAMILIES = {
    "flux": ("flux", "build_flux_transformer", "build_flux_vae", "flux_pipeline", "prompt_embeddings"),
    "chroma": ("flux", "build_chroma_transformer", "build_flux_vae", "chroma_pipeline", "chroma_prompt_embeddings"),
    "flux2": ("flux2", "build_flux2_transformer", "build_flux2_vae", "flux2_pipeline", "flux2_prompt_embeddings"),
}
PIPELINE_MODELS = {
    "flux-tiny": ("flux", "flux-tiny"), "flux-dev": ("flux", "flux-dev"),
    "chroma-tiny": ("chroma", "flux-tiny"), "chroma": ("chroma", "flux-dev"),  # Chroma uses FLUX.1's VAE
    "flux2-dev": ("flux2", "flux2-dev"), "flux2-klein": ("flux2", "flux2-dev"), "flux2-tiny": ("flux2", "flux2-tiny"),
    "flux2-klein-tiny": ("flux2", "flux2-tiny"),
}
FLUX_MODELS, CHROMA_MODELS, FLUX2_MODELS = (
    tuple(m for m, (f, _) in PIPELINE_MODELS.items() if f == family) for family in ("flux", "chroma", "flux2"))
ERNIE_MODELS = ("ernie-image-tiny", "ernie-image")
# step level only (no VAE config of theirs is published with this package): model name -> (builder, config,
# inputs builder, how the latent size follows from the image size: "grid" 16x16 pixels per token, "size" the 8x latent,
# "latent8" the 8x latent as a grid, "latent32" the 32x latent, "video8" Wan's 8x, 4-frame latent of --frames frames,
# "video16" HunyuanVideo-1.5's 16x, 4-frame latent, "video32" LTX-Video's 32x, 8-frame latent)
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
    "ltx-video": ("build_ltx_transformer", "ltx-video", "ltx_transformer_inputs", "video32"),
    "ltx-video-tiny": ("build_ltx_transformer", "ltx-video-tiny", "ltx_transformer_inputs", "video32"),
    "wan-14b": ("build_wan_transformer", "wan-14b", "wan_transformer_inputs", "video8"),
    "wan-tiny": ("build_wan_transformer", "wan-tiny", "wan_transformer_inputs", "video8"),
}
# every class of the zoo (`testing.zoo`: the models no family adapter covers, patched by the generic path), step level
# only: "zoo:NAME" at its published config and resolution, "zoo:NAME-tiny" tiny
def _zoo_models() -> tuple[str, ...]:
    from ..testing import zoo

    return tuple(f"zoo:{n}{s}" for n, e in sorted(zoo.ZOO.items()) for s in (("", "-tiny") if e.full_config else ("-tiny",)))


ZOO_MODELS = _zoo_models()
# the family of a step model's kernel cases (default "other")
STEP_FAMILIES = {"build_sd3_transformer": "sd3", "build_qwenimage_transformer": "qwen", "build_ltx_transformer": "ltx"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Subject:
    """The model under test: its transformer, one step's inputs and, for the `PIPELINE_MODELS` and a real FLUX
    pipeline, a pipeline around it."""

    name: str
    family: str  # "flux" (FLUX.1 and Chroma: the same kernels at the same shapes), "flux2", "ernie", "sd3", "qwen",
    # "ltx", or "other" (no kernel cases)
    transformer: nn.Module
    step_inputs: dict[str, Any]
    pipe: Any = None
    call_kwargs: dict[str, Any] = field(default_factory=dict)
    no_generation: str | None = None  # why the generation level cannot run for this model

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
        inputs = zoo.inputs(name, model, batch=args.batch, seed=args.seed + 1, full=full)
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
                  "video16": dict(grid=(args.height // 16, args.width // 16), frames=(args.frames - 1) // 4 + 1),
                  "video32": dict(grid=(args.height // 32, args.width // 32), frames=(args.frames - 1) // 8 + 1)}[layout]
        inputs = getattr(testing, make_inputs)(model, batch=args.batch, txt_tokens=args.text_tokens,
                                               seed=args.seed + 1, **latent)
        model = _quantized(model, args, device)
        return Subject(args.model, STEP_FAMILIES.get(build, "other"), model, inputs,
                       no_generation=f"not for {args.model} here (no pipeline with a VAE config of its own is "
                                     "published with this package); use the step level")
    if args.model in PIPELINE_MODELS:
        pipeline_family, vae_config = PIPELINE_MODELS[args.model]
        family, build, build_vae, make_pipe, embeddings = PIPELINE_FAMILIES[pipeline_family]
        model = _quantized(getattr(testing, build)(args.model, dtype, device, seed=args.seed), args, device)
        vae = None
        # Flux2KleinPipeline un-normalises its latents with the VAE's batch-norm statistics before it looks at
        # output_type (diffusers 0.42.1), so a klein pipeline needs its VAE for the step level's latent call too
        if need_vae or (pipeline_family == "flux2" and not model.config.guidance_embeds):
            vae = getattr(testing, build_vae)(vae_config, dtype, device, seed=args.seed + 1,
                                              latent_channels=model.config.in_channels // 4)
        pipe = getattr(testing, make_pipe)(model, vae)
        padding = dict(padding=args.text_tokens // 2) if pipeline_family == "chroma" else {}  # a half-padded prompt
        call_kwargs = getattr(testing, embeddings)(pipe, batch=args.batch, txt_tokens=args.text_tokens,
                                                   seed=args.seed + 2, **padding)
    else:  # a real FLUX pipeline (Hub id or folder); prompt embeddings from its own text encoders
        from diffusers import FluxPipeline

        pipe = FluxPipeline.from_pretrained(args.model, torch_dtype=dtype).to(device)
        pipe.transformer = model = _quantized(pipe.transformer, args, device)
        with torch.no_grad():
            embeds, pooled, _ = pipe.encode_prompt(prompt=args.prompt, prompt_2=None, device=device,
                                                   num_images_per_prompt=args.batch,
                                                   max_sequence_length=args.text_tokens)
        call_kwargs = dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled)
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
                          generator=generator, output_type=output_type, callback_on_step_end=on_step_end).images
    return dict(latents=captured["latents"], image=images)
