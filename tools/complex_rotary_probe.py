"""Which roundings does this platform's eager complex multiply use (the complex-form rotary embedding)?

Qwen-Image's ``apply_rotary_emb_qwen(x, freqs_cis, use_real=False)`` and diffusers' ``apply_rotary_emb(...,
use_real=False)`` (Z-Image, Lumina2) rotate q and k as ``view_as_complex(x.float().reshape(..., -1, 2)) *
freqs_cis``: aten's complex multiply, ``(a + bi)(c + di) = (ac - bd) + (ad + bc)i`` as ``c10::complex`` writes it,
compiled by nvcc, which may contract either product into an FMA. A fused rotary is bit-identical only if it rounds as
that build does, so this script emulates each candidate exactly (an FMA as the float64 sum of the exact product and
the rounded addend, rounded once to float32) and reports, for the real and the imaginary part, the fraction of
elements that match aten bit for bit. Run it once per torch build; the kernel takes the candidate that matches
every element (and verifies itself on first use all the same).

``--complex128``: Lumina2's rotary table is complex128 (diffusers builds it in float64), so aten promotes the product
to complex128 and ``.type_as`` converts the float64 result to the storage dtype; the candidates are then emulated in
exact rational arithmetic (``fractions.Fraction``: a double FMA's product is not exact in float64) on a sample of
``--sample`` pairs, and the conversion is checked as float64 -> float32 -> T.

    python tools/complex_rotary_probe.py [--rows 65536] [--dim 128] [--complex128 [--sample 4000]]
"""

from __future__ import annotations

import argparse
from fractions import Fraction

import torch


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 ``fma(a, b, c)``: the product of two float32 is exact in float64; one rounding of the sum to float32
    (a double rounding only where the float64 sum itself rounded: rare, and visible as a near-100% match)."""
    return (a.double() * b.double() + c.double()).float()


def candidates(a, b, c, d):
    real = {
        "ac - bd (no FMA)": a * c - b * d,
        "fma(a, c, -bd)": fma(a, c, -(b * d)),
        "fma(-b, d, ac)": fma(-b, d, a * c),
    }
    imag = {
        "ad + bc (no FMA)": a * d + b * c,
        "fma(a, d, bc)": fma(a, d, b * c),
        "fma(b, c, ad)": fma(b, c, a * d),
    }
    return real, imag


def fma_exact(a: float, b: float, c: float) -> float:
    """float64 ``fma(a, b, c)``: the exact rational result, rounded once (``float`` of a ``Fraction`` rounds to
    nearest even)."""
    return float(Fraction(a) * Fraction(b) + Fraction(c))


def probe_complex128(rows: int, dim: int, sample: int, device: str) -> None:
    """Lumina2's form: ``view_as_complex(x.float()) * freqs`` with complex128 ``freqs``, then ``.type_as(x)``."""
    gen = torch.Generator(device).manual_seed(0)
    real = {"ac - bd (no FMA)": lambda a, b, c, d: a * c - b * d,
            "fma(a, c, -bd)": lambda a, b, c, d: fma_exact(a, c, -(b * d)),
            "fma(-b, d, ac)": lambda a, b, c, d: fma_exact(-b, d, a * c)}
    imag = {"ad + bc (no FMA)": lambda a, b, c, d: a * d + b * c,
            "fma(a, d, bc)": lambda a, b, c, d: fma_exact(a, d, b * c),
            "fma(b, c, ad)": lambda a, b, c, d: fma_exact(b, c, a * d)}
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randn(rows, dim, device=device, generator=gen) * 3).to(dtype)
        angles = torch.rand(rows, dim // 2, device=device, generator=gen, dtype=torch.float64) * 1000
        freqs = torch.polar(torch.ones_like(angles), angles)  # complex128, as Lumina2's embedder builds it
        wide = torch.view_as_real(torch.view_as_complex(x.float().reshape(rows, -1, 2)) * freqs)  # float64
        out = wide.flatten(1).type_as(x)
        pick = torch.randperm(wide[..., 0].numel(), generator=torch.Generator().manual_seed(1))[:sample]
        a, b = (x.float().reshape(rows, -1, 2)[..., i].flatten()[pick.to(device)].double().tolist() for i in (0, 1))
        c, d = (t.flatten()[pick.to(device)].tolist() for t in (freqs.real, freqs.imag))
        for part, cands, want in (("real", real, wide[..., 0]), ("imag", imag, wide[..., 1])):
            want = want.flatten()[pick.to(device)].tolist()
            for name, fn in cands.items():
                match = sum(fn(*abcd) == w for abcd, w in zip(zip(a, b, c, d), want)) / len(want)
                print(f"{str(dtype):15s} complex128 {part}: {name:18s} {100 * match:7.3f}% of {len(want)} float64 "
                      "elements match")
        via_float = torch.equal(wide.flatten(1).float().to(dtype), out)
        print(f"{str(dtype):15s} complex128 cast: float64 -> float32 -> {str(dtype).split('.')[-1]} "
              f"{'matches' if via_float else 'does NOT match'} .type_as on every element")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--complex128", action="store_true", help="Lumina2's complex128 factors")
    parser.add_argument("--sample", type=int, default=4000, help="pairs emulated exactly with --complex128")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.complex128:
        probe_complex128(args.rows, args.dim, args.sample, device)
        return
    gen = torch.Generator(device).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randn(args.rows, args.dim, device=device, generator=gen) * 3).to(dtype)
        angles = torch.rand(args.rows, args.dim // 2, device=device, generator=gen) * 1000
        freqs = torch.polar(torch.ones_like(angles), angles)  # complex64, as the pipelines build it
        pairs = x.float().reshape(args.rows, -1, 2)
        aten = torch.view_as_real(torch.view_as_complex(pairs) * freqs)  # float32, before type_as
        a, b = pairs[..., 0], pairs[..., 1]
        c, d = freqs.real.contiguous(), freqs.imag.contiguous()
        real, imag = candidates(a, b, c, d)
        for part, cands, want in (("real", real, aten[..., 0]), ("imag", imag, aten[..., 1])):
            for name, got in cands.items():
                match = (got == want).float().mean().item()
                also = (got.to(dtype) == want.to(dtype)).float().mean().item()
                print(f"{str(dtype):15s} {part}: {name:18s} {100 * match:7.3f}% of fp32 elements match "
                      f"({100 * also:7.3f}% after the cast to {str(dtype).split('.')[-1]})")


if __name__ == "__main__":
    main()
