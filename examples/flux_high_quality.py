"""Generate with the "high" quality tier inside a context manager and compare it with lossless (PSNR/SSIM).

    python examples/flux_high_quality.py                                   # offline: a tiny FLUX, random weights
    python examples/flux_high_quality.py --device cuda --height 512 --width 512
    python examples/flux_high_quality.py --model black-forest-labs/FLUX.1-dev --prompt "a tiny astronaut"

By default nothing is downloaded: the pipeline is a tiny FLUX built from a config with random weights, called with
random prompt embeddings. With ``--model`` the real weights are loaded with ``DiffusionPipeline.from_pretrained``
(the high tier's fusions are FLUX.1's; other families run lossless where they have none).
The same seed gives an unpatched image, a lossless one (md5-identical to it) and a high one (within PSNR >= 35 dB
and SSIM >= 0.97 of lossless). On a CPU the high tier's sites are mounted but every call falls back to the lossless
path (the fused ops are CUDA-only); the report says so, and the images are then identical.
"""

from __future__ import annotations

import sys

import diffusers_fastpath as fp
from _pipeline import md5, parse_args, pipeline  # examples/_pipeline.py
from diffusers_fastpath.metrics import psnr, ssim


def main() -> int:
    args = parse_args(__doc__)
    pipe, generate, title = pipeline(args)

    generate()  # warm-up
    unpatched, eager_s = generate()
    fp.patch(pipe)  # the default tier: lossless
    generate()  # warm-up (the first CUDA call builds the extension once per machine)
    lossless, lossless_s = generate()
    with fp.quality(pipe, "high"):  # mounted on entry, restored on exit (also on an exception)
        high, high_s = generate()
        rep = fp.report(pipe)
    after, _ = generate()  # outside the context: lossless again

    approx = sum(s.fast for s in rep.tier_sites)
    sent_back = sum(s.fallback for s in rep.tier_sites)
    kernels_ran = rep.kernel_calls > 0  # else (a CPU) a time ratio would be noise: say so instead
    ratio = (lambda s: f"{s * 1000:.1f} ms, {s / eager_s:.3f}x") if kernels_ran else (lambda s: "no fused kernel ran")
    print(title)
    print(f"unpatched: {eager_s * 1000:.1f} ms  md5 {md5(unpatched)}" if kernels_ran else f"unpatched: md5 {md5(unpatched)}")
    print(f"lossless:  md5 {md5(lossless)}  ({ratio(lossless_s)})")
    print(f"lossless identical to unpatched: {md5(lossless) == md5(unpatched)}")
    print(f"high:      md5 {md5(high)}  ({ratio(high_s)})")
    print(f"high vs lossless: PSNR {psnr(high, lossless):.2f} dB, SSIM {ssim(high, lossless):.5f}")
    print(f"high-tier calls: {approx} on the approximate path, {sent_back} sent to the lossless path"
          + (" (this device has no fused ops: high ran the lossless path)" if approx == 0 and sent_back else ""))
    print(f"after the context: identical to unpatched: {md5(after) == md5(unpatched)}\n")
    print(rep)
    fp.unpatch(pipe)
    return 0 if md5(lossless) == md5(unpatched) == md5(after) else 1


if __name__ == "__main__":
    sys.exit(main())
