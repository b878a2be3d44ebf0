"""Benchmark FLUX.1-dev: eager, lossless, high, lossless+graphs and torch.compile side by side, exactness proven in
the same run.

A thin wrapper of the benchmark command, ``python -m diffusers_fastpath.bench`` (also installed as
``diffusers-fastpath-bench``), with the settings of the README's results: the published FLUX.1-dev transformer and
VAE configs with random bf16 weights (nothing is downloaded), 1024x1024, 28 steps, transformer step and whole
generation, every fused kernel against its eager chain, and a profile of one step per mode.

    python examples/benchmark_flux.py --json flux.json             # on a CUDA GPU (about 24 GB of weights)
    python examples/benchmark_flux.py --modes eager,lossless       # skip the slow compiles (about 100 s each)
    python examples/benchmark_flux.py --model flux-tiny            # the same levels on a tiny FLUX, CPU included
    python -m diffusers_fastpath.bench --from-json flux.json --plot flux.png   # chart it later (needs matplotlib)

Any other argument goes to the command (its options are listed below); a later argument overrides these defaults.
Without a CUDA GPU it builds a full-size model only when asked to with ``--device cpu``: on a CPU that takes about
24 GB of memory and hours.
"""

from __future__ import annotations

import sys

import torch

DEFAULTS = ["--model", "flux-dev", "--height", "1024", "--width", "1024", "--steps", "28", "--repeats", "10",
            "--kernels", "--profile"]
CPU_REFUSAL = (
    "benchmark_flux.py: no CUDA GPU here, and this script builds the full-size FLUX.1-dev (about 24 GB of weights; "
    "hours per mode on a CPU). For a run that fits a CPU: python examples/benchmark_flux.py --model flux-tiny (or "
    "python -m diffusers_fastpath.bench). To build the full-size model on this CPU anyway, say so: --device cpu.")


def _option(argv: list[str], name: str) -> str | None:
    """The last value given for ``--name`` (``--name value`` or ``--name=value``), as argparse would take it."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        sys.stdout.flush()
    elif (not torch.cuda.is_available() and _option(argv, "--device") is None
          and not (_option(argv, "--model") or "flux-dev").endswith("-tiny")):
        print(CPU_REFUSAL, file=sys.stderr)
        return 2
    from diffusers_fastpath.bench import main as bench

    return bench(DEFAULTS + argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
