"""The benchmark command: eager, lossless, high and torch.compile side by side, exactness proven in the same run.

    python -m diffusers_fastpath.bench                                    # flux-tiny: runs anywhere, CPU included
    python -m diffusers_fastpath.bench --model flux-dev --kernels --profile --json run.json
    python -m diffusers_fastpath.bench --model flux-dev --levels step,parts --modes eager,lossless --sensors
    python -m diffusers_fastpath.bench --model ernie-image --levels step --modes eager,lossless
    python -m diffusers_fastpath.bench --model flux-schnell --levels generation   # 4 steps, split into its parts
    python -m diffusers_fastpath.bench --model ltx-video-distilled --levels generation  # 8 steps, 768x512x121
    python -m diffusers_fastpath.bench --model black-forest-labs/FLUX.1-dev     # real weights (a Hub id or a folder)
    python -m diffusers_fastpath.bench --from-json run.json --plot run.png      # re-render a saved run, run nothing

Models: ``flux-tiny`` (default), ``flux-dev`` (the published FLUX.1-dev transformer and VAE configs with random
weights: speed and exactness do not depend on the weights, and nothing is downloaded), ``flux-schnell``
(FLUX.1-schnell: FLUX.1-dev's blocks without the guidance embedding, FLUX.1's VAE; 4 steps and 256 prompt tokens by
default), ``chroma`` and ``chroma-tiny`` (Chroma1-HD's transformer config with FLUX.1's VAE, a half-padded prompt
with guidance), ``flux2-dev``, ``flux2-klein`` (4B, distilled: through ``Flux2KleinPipeline``, with FLUX.2-dev's VAE
config; 4 steps by default) and ``flux2-tiny``, ``flux2-klein-tiny``, ``ltx-video`` (LTX-Video 2B through
``LTXPipeline`` with classifier-free guidance, 50 steps, and diffusers' default ``AutoencoderKLLTXVideo``, LTX-Video
0.9.0's VAE; 768x512, 121 frames, 128 prompt tokens by default), ``ltx-video-distilled`` (the same without guidance,
8 steps) and their ``-tiny`` forms, ``ernie-image`` and ``ernie-image-tiny`` (step level and kernels),
``sd3.5-large``, ``qwen-image``,
``hunyuan-image`` (HunyuanImage-2.1: give ``--height 2048 --width 2048``), ``z-image``, ``lumina2`` (Lumina-Image
2.0), ``wan-14b`` (Wan 2.1 T2V 14B: give ``--height 480 --width 832 --frames 81``), ``hunyuanvideo-1.5`` (480p:
give ``--height 480 --width 848 --frames 33 --text-tokens 1000``) and their ``sd3-tiny``, ``qwen-image-tiny``,
``hunyuan-image-tiny``, ``z-image-tiny``, ``lumina2-tiny``, ``wan-tiny``, ``hunyuanvideo-1.5-tiny`` (step level), or
any FLUX pipeline path/id for ``FluxPipeline.from_pretrained`` (its own text encoders encode the prompt in each call).

Levels (``--levels``, default ``step,generation``; ``--kernels`` adds ``kernels``, ``--profile`` adds ``profile``):

- **step**: one transformer forward; median of ``--repeats`` timed calls (CUDA events; ``perf_counter`` on CPU),
  warm-up excluded, host enqueue time (the Python call returning, before the GPU finishes) beside it. The
  non-compiled modes run round-robin, one warm-up and one timed call per mode and round, so clock drift lands in
  the spread, not in the ratio.
- **generation**: a whole pipeline call (FLUX.1, Chroma, FLUX.2, LTX-Video) from precomputed prompt embeddings
  (random weights: no text encoder), VAE decode included, each patching mode applied to the pipeline as a user does
  (``fp.patch(pipe)``: the VAE too; the report names the models patched); md5 of the final latents (captured by a
  step-end callback of the same call) and of the decoded image, and the call's time split into text encoding,
  denoising (transformer and scheduler) and decode (CUDA events on a GPU, the host clock on a CPU), each against
  eager's (`levels.generation`).
- **profile**: one step per mode under ``torch.profiler``: kernel count and time per category (`CATEGORIES`).
- **parts**: one step per mode recorded op by op and replayed as CUDA graphs, whole, as its floor (GEMMs, GEMVs and
  attention alone) and without each category of work: what each part costs the step at the clock the power limit
  leaves, which a sum of kernel times does not say (`levels.parts`).
- **kernels**: every fused op at the model's real shapes, eager chain against fused kernel, with the GB/s of a
  device-to-device copy measured in the same run, and the host cost of one call.

Exactness is computed in the run: every mode's output is compared with eager's by ``torch.equal`` and by md5 of
its raw bytes, with max abs diff, PSNR and (images) SSIM. Compiled modes run after the others, each after
``torch._dynamo.reset()`` on the same weights, with the first call reported as compile time. The exit status is 1
when a mode that promises bit-identity (eager, lossless) or a fused kernel is not bit-identical, 2 on a usage error.

Modes are the `MODES` registry: adding one is one `register_mode` call.

The package, one file per part: ``cli`` (arguments, `main`), ``modes`` (`MODES`), ``subject`` (the model and its
inputs), ``quant`` (quantized builds, ``--quant``), ``timing`` (`Clock`, `Samples`, output comparison), ``levels/``
(``step``, ``generation``, ``profile``, ``parts``, ``kernels``), ``runner`` (one run, `violations`), ``conditions`` and
``render`` (markdown, plot).
"""

from __future__ import annotations

from .cli import main
from .conditions import commit, conditions
from .levels.kernels import KERNEL_CASES, KernelCase, Shapes, kernel_cases
from .levels.profile import CATEGORIES, CATEGORY_NAMES, categorize, idle_gaps
from .modes import MODES, Context, Mode, register_mode
from .render import markdown, plot
from .runner import LEVELS, SCHEMA, run, violations
from .subject import (CHROMA_MODELS, DTYPES, ERNIE_MODELS, FLUX2_MODELS, FLUX_MODELS, LTX_MODELS, Subject,
                      build_subject)
from .timing import Clock, Samples, md5

__all__ = [
    "CATEGORIES", "CATEGORY_NAMES", "CHROMA_MODELS", "Clock", "Context", "DTYPES", "ERNIE_MODELS", "FLUX2_MODELS",
    "FLUX_MODELS", "KERNEL_CASES", "LTX_MODELS", "KernelCase", "LEVELS", "MODES", "Mode", "SCHEMA", "Samples",
    "Shapes", "Subject", "build_subject", "categorize", "commit", "conditions", "idle_gaps", "kernel_cases", "main",
    "markdown", "md5", "plot", "register_mode", "run", "violations",
]
