"""Benchmark FLUX.1-dev: eager, lossless, high and torch.compile side by side, exactness proven in the same run.

A thin wrapper of the benchmark command, ``python -m diffusers_fastpath.bench`` (also installed as
``diffusers-fastpath-bench``), with the settings of the README's results: the published FLUX.1-dev transformer and
VAE configs with random bf16 weights (nothing is downloaded), 1024x1024, 28 steps, transformer step and whole
generation, every fused kernel against its eager chain, and a profile of one step per mode.

    python examples/benchmark_flux.py --json flux.json             # on a CUDA GPU
    python examples/benchmark_flux.py --modes eager,lossless       # skip the slow compiles (about 100 s each)
    python -m diffusers_fastpath.bench --from-json flux.json --plot flux.png   # chart it later (needs matplotlib)

Any other argument goes to the command (``python -m diffusers_fastpath.bench --help`` lists them); a later
argument overrides these defaults.
"""

from __future__ import annotations

import sys

from diffusers_fastpath.bench import main

DEFAULTS = ["--model", "flux-dev", "--height", "1024", "--width", "1024", "--steps", "28", "--repeats", "10",
            "--kernels", "--profile"]

if __name__ == "__main__":
    sys.exit(main(DEFAULTS + sys.argv[1:]))
