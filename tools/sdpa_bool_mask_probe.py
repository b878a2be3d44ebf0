"""A boolean attention mask given to diffusers' native attention (torch SDPA) against the additive
mask torch would make of it, converted beforehand: the kernel torch picks for each, and the outputs' bits (the
question `diffusers_fastpath.ops.attention_bool_mask` rests on: which of aten's two expressions is eager's, and that
the additive mask leaves torch's choice alone).

    python tools/sdpa_bool_mask_probe.py      (a CUDA machine; Ideogram 4's full-size mask needs ~2 GB)
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn.attention import SDPBackend

CUDNN, EFFICIENT = int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.EFFICIENT_ATTENTION)


def choice(q, k, v, m):
    from diffusers_fastpath.ops.attention_bool_mask import sdpa_choice

    return sdpa_choice(q, k, v, m, {})


def run(name, B, S, H, D, mask, dtype=torch.bfloat16, Sk=None):
    g = torch.Generator(device="cuda").manual_seed(0)
    Sk = Sk or S
    q = torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Sk, H, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Sk, H, D, device="cuda", dtype=dtype, generator=g)
    m4 = mask if mask.dim() == 4 else mask[:, None, None, :]
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from diffusers_fastpath.ops.attention_bool_mask import additive_mask

    cud, inf = additive_mask(m4, CUDNN, dtype), additive_mask(m4, EFFICIENT, dtype)  # the op's own two forms

    ref = dispatch_attention_fn(q, k, v, attn_mask=mask)
    res = {}
    for tag, fm in (("cudnn_-65504", cud), ("aten_-inf", inf)):
        out = dispatch_attention_fn(q, k, v, attn_mask=fm)
        res[tag] = (torch.equal(out.view(torch.int16), ref.view(torch.int16)), choice(q, k, v, fm))
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        additive_mask(m4, CUDNN, dtype)
    torch.cuda.synchronize()
    conv_ms = (time.perf_counter() - t) / 5 * 1e3
    print(f"{name}: B{B} S{S} Sk{Sk} H{H} D{D} {str(dtype)[6:]} mask {tuple(mask.shape)}: backend(bool)={choice(q, k, v, m4)} "
          + " ".join(f"{t}: equal={e} backend={c}" for t, (e, c) in res.items()) + f"; conversion {conv_ms:.3f} ms", flush=True)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    # Ideogram 4 at 2048^2, text 2048 (valid 256): block-diagonal segment mask, [B, 1, S, S]
    S = 16384 + 2048
    seg = torch.zeros(1, S, dtype=torch.long, device="cuda"); seg[:, 16384 + 256:] = 1
    run("ideogram4", 1, S, 18, 256, (seg.unsqueeze(2) == seg.unsqueeze(1)).unsqueeze(1))
    seg2 = torch.zeros(2, 4096 + 512, dtype=torch.long, device="cuda"); seg2[:, 4096 + 100:] = 1
    run("ideogram4-small-b2", 2, 4096 + 512, 18, 256, (seg2.unsqueeze(2) == seg2.unsqueeze(1)).unsqueeze(1))
    run("ideogram4-small-fp16", 2, 4096 + 512, 18, 256, (seg2.unsqueeze(2) == seg2.unsqueeze(1)).unsqueeze(1), torch.float16)
    # a key padding mask [B, S] (Bria FIBO 2's encoder mask, Qwen-Image's text mask)
    pad = torch.ones(2, 512, dtype=torch.bool, device="cuda"); pad[1, 300:] = False
    run("padding-2d", 2, 4096, 28, 128, pad, Sk=512)
    run("padding-4d", 2, 4096, 28, 128, pad[:, None, None, :], Sk=512)
    # a fully masked row: -inf gives NaN, -65504 gives a uniform mean
    full = torch.ones(1, 1, 256, 256, dtype=torch.bool, device="cuda"); full[..., 7, :] = False
    run("full-row-masked", 1, 256, 8, 64, full)
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
