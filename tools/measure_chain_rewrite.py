"""The measurement behind docs/families.md: rewriting block forwards (`diffusers_fastpath.models._chains`) against
capturing the model with `torch.compile`, on a 4 + 8 block bf16 FLUX.1 (a CPU is enough: first-call cost, time per
forward, exactness). The torch.compile part takes minutes on a CPU (its first calls took 9-15 s each there, and
every timed forward runs the compiled model); ``--backends`` picks fewer, ``--backends none`` skips it.

    python tools/measure_chain_rewrite.py
    python tools/measure_chain_rewrite.py --backends none --repeats 5     # the rewrite and the patch only
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from diffusers.models.transformers import transformer_chroma, transformer_flux

import diffusers_fastpath as fp
from diffusers_fastpath.models import _chains
from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs

FORWARDS = (transformer_flux.FluxTransformerBlock, transformer_flux.FluxSingleTransformerBlock,
            transformer_chroma.ChromaTransformerBlock, transformer_chroma.ChromaSingleTransformerBlock,
            transformer_chroma.ChromaAdaLayerNormZeroPruned, transformer_chroma.ChromaAdaLayerNormZeroSinglePruned)
CONFIG = dict(num_layers=4, num_single_layers=8, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
              pooled_projection_dim=32, in_channels=4, axes_dims_rope=[4, 4, 8], guidance_embeds=False)


def ms_per_call(fn, n: int) -> float:
    fn(), fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="timed forwards per measurement, median (default: 20)")
    parser.add_argument("--backends", default="eager,aot_eager",
                        help="comma-separated torch.compile backends to measure, or 'none' (default: eager,aot_eager)")
    args = parser.parse_args()
    args.backends = [] if args.backends == "none" else [b.strip() for b in args.backends.split(",") if b.strip()]
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


@torch.no_grad()
def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    for i, cls in enumerate(FORWARDS):
        _chains.rewrite_forward(cls.forward, f"Measured{i}.forward")
    print(f"rewrite of {len(FORWARDS)} forwards: {(time.perf_counter() - start) * 1e3:.1f} ms")

    model = build_flux_transformer(CONFIG, torch.bfloat16, seed=0)
    inputs = flux_transformer_inputs(model, grid=(4, 4), txt_tokens=8, seed=1)
    ref = model(**inputs).sample
    print(f"eager: {ms_per_call(lambda: model(**inputs), args.repeats):.2f} ms per forward")
    fp.patch(model)
    print(f"patched (hand mirrors): {ms_per_call(lambda: model(**inputs), args.repeats):.2f} ms per forward, "
          f"bit-identical {torch.equal(model(**inputs).sample, ref)}")
    fp.unpatch(model)
    for backend in args.backends:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        start = time.perf_counter()
        out = compiled(**inputs).sample
        first = time.perf_counter() - start
        print(f"torch.compile(backend={backend!r}): first call {first:.2f} s, "
              f"{ms_per_call(lambda: compiled(**inputs), args.repeats):.2f} ms per forward, "
              f"bit-identical {torch.equal(out, ref)}")


if __name__ == "__main__":
    main()
