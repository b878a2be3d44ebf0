"""Patch a pipeline, check that the output is bit-identical to unpatched diffusers, and show the report.

    python examples/flux_lossless.py                                   # offline: a tiny FLUX, random weights
    python examples/flux_lossless.py --family chroma                   # offline: a tiny Chroma (or flux2)
    python examples/flux_lossless.py --device cuda --height 512 --width 512
    python examples/flux_lossless.py --model black-forest-labs/FLUX.1-dev --prompt "a tiny astronaut"
    python examples/flux_lossless.py --model stabilityai/stable-diffusion-3.5-large   # any supported pipeline

By default nothing is downloaded: the pipeline is a tiny FLUX (or ``--family``) built from a config with random
weights, called with random prompt embeddings (no text encoders). With ``--model`` the real weights are loaded with
``DiffusionPipeline.from_pretrained`` (a Hub id or a local folder), which picks the pipeline class of the model.
"""

from __future__ import annotations

import sys

import numpy as np

import diffusers_fastpath as fp
from _pipeline import md5, parse_args, pipeline  # examples/_pipeline.py


def main() -> int:
    args = parse_args(__doc__)
    pipe, generate, title = pipeline(args)

    generate()  # warm-up
    reference, eager_s = generate()
    fp.patch(pipe)  # quality="lossless"
    generate()  # warm-up (the first CUDA call builds the extension once per machine)
    patched, fast_s = generate()

    identical = np.array_equal(reference, patched)
    print(title)
    if fp.report(pipe).kernel_calls:
        print(f"unpatched: {eager_s * 1000:.1f} ms  md5 {md5(reference)}")
        print(f"patched:   {fast_s * 1000:.1f} ms  md5 {md5(patched)}  ({fast_s / eager_s:.3f}x, one run each: "
              "python -m diffusers_fastpath.bench measures speed)")
    else:  # no fused kernel ran (a CPU, or no kernels on this machine): a time ratio would be noise
        print(f"unpatched: md5 {md5(reference)}")
        print(f"patched:   md5 {md5(patched)}")
        print("no fused kernel ran (the kernels are CUDA-only; the report below says why): the patched pipeline ran "
              "diffusers' own expressions, so there is no speedup to show here")
    print(f"bit-identical: {identical}\n")
    print(fp.report(pipe))
    fp.unpatch(pipe)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
