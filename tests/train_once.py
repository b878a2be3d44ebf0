"""One training step of a FLUX transformer in a fresh process, for `tests/test_compat_gpu.py`.

    python tests/train_once.py OUT.pt [--patched] [--checkpointing] [--backend NAME] [--deterministic]

Builds the FLUX transformer that the compatibility issue trained (2 dual + 4 single blocks, hidden 3072, 24 heads,
bf16, 16x16 latents, 32 text tokens), runs one forward in training mode and one backward of
``out.float().square().mean()``, and saves the output, the latents' gradient and every parameter's gradient to
OUT.pt. One backward per process: on the H200 image a second backward in one process can fault even unpatched
(see DESIGN.md, "Rules learnt"), so each run stands alone and patched runs are compared with unpatched runs of the
same setup.
"""

from __future__ import annotations

import argparse
import os

import torch

import diffusers_fastpath as fp
from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--patched", action="store_true")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--backend", default=None, help="diffusers attention backend (default: diffusers' default)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny test config instead (a quick run on a CPU)")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True) (and cuBLAS's fixed workspace), set before any CUDA work")
    args = p.parse_args()
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if args.tiny:
        model = build_flux_transformer("flux-tiny", torch.bfloat16, args.device, seed=0)
        inputs = flux_transformer_inputs(model, grid=(4, 4), txt_tokens=8, seed=1)
    else:
        model = build_flux_transformer("flux-dev", torch.bfloat16, args.device, seed=0, num_layers=2, num_single_layers=4)
        inputs = flux_transformer_inputs(model, grid=(16, 16), txt_tokens=32, seed=1)
    if args.backend:
        model.set_attention_backend(args.backend)
    if args.patched:
        fp.patch(model)
    model.train()
    if args.checkpointing:
        model.enable_gradient_checkpointing()
    latents = inputs["hidden_states"].clone().requires_grad_()
    out = model(**{**inputs, "hidden_states": latents}).sample
    out.float().square().mean().backward()
    if out.is_cuda:
        torch.cuda.synchronize()
    torch.save({"out": out.detach().cpu(), "latents": latents.grad.cpu(),
                "grads": {n: None if q.grad is None else q.grad.cpu() for n, q in model.named_parameters()}}, args.out)


if __name__ == "__main__":
    main()
