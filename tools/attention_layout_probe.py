"""Does this platform's attention compute the same values from token-major operands as from contiguous ones?

SD3's joint attention processor concatenates its image and text q, k and v into contiguous ``[B, H, S, D]``
tensors, runs ``F.scaled_dot_product_attention`` and copies the output back to ``[B, S, H * D]``.
`diffusers_fastpath.ops.attention_seq_major` writes the concatenations token-major (``[B, S, H, D]`` memory) instead,
so that the attention's output comes out token-major and that copy disappears. That is exact only if the attention
kernel's values do not depend on the layout of its operands, a property of each backend (cuDNN, flash,
memory-efficient, math) and build. This script runs every backend on both layouts at SD3.5's and FLUX's shapes and
reports, per case, whether the outputs are bit-identical and which layout the output has. The op itself verifies its
first call of each signature the same way, and falls back to eager's layout on a mismatch.

    python tools/attention_layout_probe.py          (a CUDA GPU; a developer's tool, see docs/design.md)
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# (batch, heads, tokens, head_dim): SD3.5-large 1024x1024 (4096 image + 333 text tokens) and its CFG batch, FLUX.1
# (4096 + 512, 24 heads of 128), SD3.5-medium-like (24 heads of 64), a small case
CASES = [(1, 38, 4429, 64), (2, 38, 4429, 64), (1, 24, 4608, 128), (1, 24, 4173, 64), (2, 3, 200, 64)]
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("a CUDA GPU is needed: the question is about its attention kernels")
    gen = torch.Generator("cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for batch, heads, tokens, dim in CASES:
            q, k, v = (torch.randn(batch, tokens, heads, dim, device="cuda", generator=gen).to(dtype).transpose(1, 2)
                       for _ in range(3))  # token-major [B, H, S, D] views
            qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()  # eager's layout
            for name, backend in BACKENDS.items():
                try:
                    with sdpa_kernel([backend]) if backend is not None else nullcontext():
                        ref = F.scaled_dot_product_attention(qc, kc, vc)
                        got = F.scaled_dot_product_attention(q, k, v)
                    torch.cuda.synchronize()
                except RuntimeError as exc:
                    print(f"{str(dtype):15s} {(batch, heads, tokens, dim)!s:20s} {name:9s} not available: "
                          f"{str(exc).splitlines()[0][:80]}")
                    continue
                layout = "token-major" if got.transpose(1, 2).is_contiguous() else "contiguous"
                print(f"{str(dtype):15s} {(batch, heads, tokens, dim)!s:20s} {name:9s} "
                      f"{'bit-identical' if torch.equal(ref, got) else 'DIFFERENT'}, output {layout}")


if __name__ == "__main__":
    main()
