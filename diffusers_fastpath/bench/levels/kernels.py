"""The kernels level: every fused op at the model's real shapes against its eager chain (`KERNEL_CASES`), with the
GB/s of a device-to-device copy measured in the same run and the host cost of one call."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..subject import DTYPES, Subject
from ..timing import equal, max_abs_diff, progress


@dataclass
class Shapes:
    """The shapes a model really gives its fused ops at the benchmark's resolution, batch and text length."""

    family: str
    model: nn.Module
    hidden: int
    image_tokens: int
    text_tokens: int
    batch: int
    dtype: torch.dtype
    device: torch.device

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, device=self.device, dtype=self.dtype)


@dataclass
class KernelCase:
    """One fused op at one shape: ``eager(*s)`` and ``fused(*s)`` for each input set ``s`` in `sets` (rotated past
    the L2 cache; ``s[0]`` is the activation, which the reference copy moves), `nbytes` read plus written by the
    fused kernel per call."""

    op: str
    shape: tuple[int, ...]
    sets: list[tuple[Any, ...]]
    eager: Callable[..., Any]
    fused: Callable[..., Any]
    nbytes: int
    exact: bool = True  # False for the "high" tier's approximate fusions: the row gives the max abs difference
    checked: Callable[..., Any] | None = None  # `fused` as the equality check calls it (poisoned outputs), if not it


KERNEL_CASES: dict[str, Callable[[Shapes], list[KernelCase]]] = {}
KERNEL_FAMILIES = {"flux": "FLUX.1 and Chroma", "flux2": "FLUX.2", "ernie": "ERNIE-Image", "sd3": "SD3 and SD3.5",
                   "qwen": "Qwen-Image", "ltx": "LTX-Video"}  # Subject.family
# families whose step inputs are packed tokens ([B, T, C]): their image tokens are the inputs', not (H / 16) (W / 16)
PACKED_FAMILIES = ("qwen", "ltx")


def kernel_cases(fn: Callable[[Shapes], list[KernelCase]]) -> Callable[[Shapes], list[KernelCase]]:
    """Register ``fn(shapes) -> [KernelCase, ...]`` (an empty list where the op is not used by the model)."""
    KERNEL_CASES[fn.__name__] = fn
    return fn


def _input_sets(make: Callable[[], tuple[Any, ...]], budget_bytes: int = 256 * 2**20, most: int = 16) -> list:
    """Fresh input sets until they span `budget_bytes` (well past an H200's 60 MB L2), at least 2, at most `most`."""
    sets, total = [], 0
    while len(sets) < 2 or (total < budget_bytes and len(sets) < most):
        s = make()
        sets.append(s)
        total += sum(t.numel() * t.element_size() for t in s if isinstance(t, torch.Tensor))
    return sets


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _flux_adaln_inputs(sh: Shapes, tokens: int):
    """An adaLN site's inputs: activations and the (shift, scale) chunk views of the adaLN linear output."""
    b, d = sh.batch, sh.hidden

    def make():
        shift, scale = sh.randn(b, 6 * d).chunk(6, dim=1)[:2]  # the AdaLayerNormZero views
        return sh.randn(b, tokens, d), scale, shift

    return _input_sets(make)


def _flux_token_counts(sh: Shapes) -> tuple[int, ...]:
    """The rows of an adaLN site: image and text streams, and FLUX's single blocks (image + text); SD3 and
    Qwen-Image have no single blocks."""
    streams = (sh.image_tokens, sh.text_tokens)
    return (*streams, sh.image_tokens + sh.text_tokens) if sh.family in ("flux", "flux2") else streams


@kernel_cases
def modulate_scale_shift_cases(sh: Shapes) -> list[KernelCase]:
    """FLUX's adaLN modulate: image, text and single-block (image + text) rows."""
    if sh.family != "flux":
        return []
    from ...ops import modulate_scale_shift_ref

    op = torch.ops.diffusers_fastpath._modulate_scale_shift_cuda.default
    cases = []
    for tokens in _flux_token_counts(sh):
        sets = _flux_adaln_inputs(sh, tokens)
        x, scale, shift = sets[0]
        cases.append(KernelCase("modulate_scale_shift", (sh.batch, tokens, sh.hidden), sets, modulate_scale_shift_ref,
                                op, 2 * _nbytes(x) + 2 * _nbytes(scale)))
    return cases


@kernel_cases
def layernorm_scale_shift_cases(sh: Shapes) -> list[KernelCase]:
    """The adaLN LayerNorm + modulate of FLUX.1, FLUX.2 (up to D = 6144), SD3 and Qwen-Image (lossless, one
    kernel)."""
    if sh.family not in ("flux", "flux2", "sd3", "qwen"):
        return []
    from ...ops import layernorm_scale_shift_ref

    ops = torch.ops.diffusers_fastpath
    norm = nn.LayerNorm(sh.hidden, elementwise_affine=False, eps=1e-6)
    cases = []
    for tokens in _flux_token_counts(sh):
        sets = _flux_adaln_inputs(sh, tokens)
        x, scale, shift = sets[0]
        shape, nbytes = (sh.batch, tokens, sh.hidden), 2 * _nbytes(x) + 2 * _nbytes(scale)
        eager = lambda x, s, h: layernorm_scale_shift_ref(norm, x, s, h)  # noqa: E731
        cases.append(KernelCase("layernorm_scale_shift", shape, sets, eager,
                                lambda x, s, h: ops._layernorm_scale_shift_cuda(x, s, h, norm.eps), nbytes))
    return cases


@kernel_cases
def gated_residual_cases(sh: Shapes) -> list[KernelCase]:
    """``residual + gate.unsqueeze(1) * update`` at the image, text and single-block sites of FLUX.1, FLUX.2, SD3
    and Qwen-Image."""
    if sh.family not in ("flux", "flux2", "sd3", "qwen"):
        return []
    from ...ops import gated_residual_ref

    op = torch.ops.diffusers_fastpath._gated_residual_cuda.default
    b, d = sh.batch, sh.hidden
    cases = []
    for tokens in _flux_token_counts(sh):
        def make():
            gate = sh.randn(b, 6 * d).chunk(6, dim=1)[2].unsqueeze(1)  # gate_msa, as the block passes it
            return sh.randn(b, tokens, d), gate, sh.randn(b, tokens, d)

        sets = _input_sets(make)
        x, gate, _ = sets[0]
        cases.append(KernelCase("gated_residual", (b, tokens, d), sets, gated_residual_ref, op,
                                3 * _nbytes(x) + _nbytes(gate)))
    return cases


@kernel_cases
def gated_layernorm_scale_shift_cases(sh: Shapes) -> list[KernelCase]:
    """FLUX.1's closing update of a stream and the LayerNorm-modulate that reads it next, in one kernel (a dual block's
    norm2, the next block's adaLN): its rows beside the `gated_residual` and `layernorm_scale_shift` rows of the same
    shape tell what the two kernels it replaces took."""
    if sh.family != "flux":
        return []
    from ...ops import gated_layernorm_scale_shift_ref

    op = torch.ops.diffusers_fastpath._gated_layernorm_scale_shift_cuda.default
    norm = nn.LayerNorm(sh.hidden, elementwise_affine=False, eps=1e-6)
    b, d = sh.batch, sh.hidden
    cases = []
    for tokens in _flux_token_counts(sh):
        def make():
            table = sh.randn(b, 6 * d).chunk(6, dim=1)  # the receiving adaLN's shift and scale, the sender's gate
            return sh.randn(b, tokens, d), table[2].unsqueeze(1), sh.randn(b, tokens, d), table[1], table[0]

        sets = _input_sets(make)
        x, gate, _, scale, _ = sets[0]
        cases.append(KernelCase(
            "gated_layernorm_scale_shift", (b, tokens, d), sets,
            lambda r, g, u, s, h: gated_layernorm_scale_shift_ref(norm, r, g, u, s, h),
            lambda r, g, u, s, h: op(r, g, u, s, h, norm.eps), 4 * _nbytes(x) + 3 * _nbytes(scale)))
    return cases


@kernel_cases
def gelu_cat_cases(sh: Shapes) -> list[KernelCase]:
    """FLUX's single block: ``cat([attn_output, gelu_tanh(proj_mlp(x))], dim=2)`` in one pass."""
    if sh.family != "flux":
        return []
    from ...ops import gelu_cat_ref

    op = torch.ops.diffusers_fastpath._gelu_cat_cuda.default
    b, d, tokens = sh.batch, sh.hidden, sh.image_tokens + sh.text_tokens
    mlp_dim = int(getattr(sh.model.single_transformer_blocks[0].proj_mlp, "out_features", 4 * d))
    sets = _input_sets(lambda: (sh.randn(b, tokens, d), sh.randn(b, tokens, mlp_dim) * 4))
    attn, mlp = sets[0]
    nbytes = 2 * (_nbytes(attn) + _nbytes(mlp))
    return [KernelCase("gelu_cat", (b, tokens, d + mlp_dim), sets, gelu_cat_ref, op, nbytes)]


@kernel_cases
def rotary_cases(sh: Shapes) -> list[KernelCase]:
    """FLUX.1's and FLUX.2's attention: the rotary embedding alone, and fused with the QK RMSNorm and the
    text/image concatenation (dual blocks: text + image sources; single blocks: one joint source)."""
    if sh.family not in ("flux", "flux2"):
        return []
    from ...ops import qk_norm_rope_ref, rotary_emb_ref

    ops = torch.ops.diffusers_fastpath
    cfg = sh.model.config
    heads, dim, b = cfg.num_attention_heads, cfg.attention_head_dim, sh.batch
    norms = [torch.nn.RMSNorm(dim, eps=1e-6).to(sh.device, sh.dtype).requires_grad_(False) for _ in range(2)]
    with torch.no_grad():
        for n in norms:
            n.weight.normal_(1.0, 0.1)

    def cases_for(txt: int, img: int) -> list[KernelCase]:
        seq = txt + img
        cos, sin = (torch.rand(seq, dim, device=sh.device) * 2 - 1 for _ in range(2))
        sets = _input_sets(lambda: (sh.randn(b, img, heads, dim), sh.randn(b, txt, heads, dim) if txt else None))
        nbytes = 2 * _nbytes(sets[0][0]) * seq // img + 2 * _nbytes(cos)
        n_txt, n_img = (norms[0] if txt else None), norms[1]
        w_txt, eps_txt = (n_txt.weight, n_txt.eps) if txt else (None, 0.0)
        out = []
        if not txt and sh.family == "flux":  # FLUX.1's single blocks' rotary alone (FLUX.2 fuses their QK norms too)
            out.append(KernelCase("rotary_emb", (b, seq, heads, dim), sets, lambda i, t: rotary_emb_ref(i, cos, sin),
                                  lambda i, t: ops._rotary_emb_cuda(i, cos, sin), nbytes))
        out.append(KernelCase(
            "qk_norm_rope" + (" (text+image)" if txt else ""), (b, seq, heads, dim), sets,
            lambda i, t: qk_norm_rope_ref(n_txt, t, n_img, i, cos, sin),
            lambda i, t: ops._qk_norm_rope_cuda(t, w_txt, eps_txt, i, n_img.weight, n_img.eps, cos, sin), nbytes))
        return out

    return cases_for(sh.text_tokens, sh.image_tokens) + cases_for(0, sh.image_tokens + sh.text_tokens)


@kernel_cases
def linear_gelu_cases(sh: Shapes) -> list[KernelCase]:
    """The "high" tier's FFN up-projection + tanh-GELU in one cuBLASLt call (GEMM-bound: bytes are the operands)."""
    if sh.family != "flux":
        return []
    from ...ops.linear_gelu import linear_gelu_epilogue, linear_gelu_ref

    d, b = sh.hidden, sh.batch
    tokens = sh.image_tokens + sh.text_tokens  # the single block's proj_mlp
    weight, bias = sh.randn(4 * d, d) / d**0.5, sh.randn(4 * d) * 0.05
    sets = _input_sets(lambda: (sh.randn(b, tokens, d),), budget_bytes=64 * 2**20, most=4)
    nbytes = _nbytes(sets[0][0]) + _nbytes(weight) + _nbytes(bias) + 4 * _nbytes(sets[0][0])
    return [KernelCase("linear_gelu (high)", (b, tokens, d), sets,
                       lambda x: linear_gelu_ref(x, weight, bias), lambda x: linear_gelu_epilogue(x, weight, bias),
                       nbytes, exact=False)]


@kernel_cases
def linear_cat_cases(sh: Shapes) -> list[KernelCase]:
    """FLUX's dual-block values: the text and image value projections written into their joint tensor (two GEMMs
    against two GEMMs and the ``cat``; bytes are the operands and the output). Batch 1 only (the guard's)."""
    if sh.family != "flux" or sh.batch != 1:
        return []
    from ...ops.linear_cat import _linear_cat_out, linear_cat_ref

    d = sh.hidden
    wa, ba, wb, bb = sh.randn(d, d) / d**0.5, sh.randn(d) * 0.05, sh.randn(d, d) / d**0.5, sh.randn(d) * 0.05
    sets = _input_sets(lambda: (sh.randn(1, sh.text_tokens, d), sh.randn(1, sh.image_tokens, d)),
                       budget_bytes=64 * 2**20, most=4)
    nbytes = 2 * _nbytes(*sets[0]) + _nbytes(wa, ba, wb, bb)  # inputs read, the joint output (as wide) written
    return [KernelCase("linear_cat", (1, sh.text_tokens + sh.image_tokens, d), sets,
                       lambda xa, xb: linear_cat_ref(xa, wa, ba, xb, wb, bb),
                       lambda xa, xb: _linear_cat_out(xa, wa, ba, xb, wb, bb), nbytes)]


@kernel_cases
def rmsnorm_scale_shift_cases(sh: Shapes) -> list[KernelCase]:
    """ERNIE-Image's adaLN: RMSNorm + fp32 modulate, and its gated-residual variant, at [seq, batch, dim]."""
    if sh.family != "ernie":
        return []
    from diffusers.models.normalization import RMSNorm

    from ...ops import gated_rmsnorm_scale_shift_ref, rmsnorm_scale_shift_ref

    ops = torch.ops.diffusers_fastpath
    seq, b, d = sh.image_tokens + sh.text_tokens, sh.batch, sh.hidden
    norm = RMSNorm(d, eps=1e-6).to(sh.device, sh.dtype).requires_grad_(False)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)

    def make():
        rows = [sh.randn(1, b, d).expand(seq, -1, -1).contiguous() for _ in range(3)]  # scale, shift, gate
        update = sh.randn(b, seq, d).permute(1, 0, 2)  # the attention output, back to sequence-first
        return (sh.randn(seq, b, d), *rows, update)

    sets = _input_sets(make)
    e = _nbytes(sets[0][0])
    return [
        KernelCase("rmsnorm_scale_shift", (seq, b, d), sets,
                   lambda x, s, h, g, u: rmsnorm_scale_shift_ref(norm, x, s, h),
                   lambda x, s, h, g, u: ops._rmsnorm_scale_shift_cuda(x, norm.weight, s, h, norm.eps), 4 * e),
        KernelCase("gated_rmsnorm_scale_shift", (seq, b, d), sets,
                   lambda x, s, h, g, u: gated_rmsnorm_scale_shift_ref(norm, x, g, u, s, h),
                   lambda x, s, h, g, u: ops._gated_rmsnorm_scale_shift_cuda(x, g, u, norm.weight, s, h, norm.eps),
                   7 * e),
    ]


def _sd3_heads_inputs(sh: Shapes) -> list:
    """SD3's joint attention: image and text q (or k, v) as ``[B, H, S, D]`` views of their ``[B, S, H, D]``
    projections."""
    cfg = sh.model.config
    heads, dim, b = cfg.num_attention_heads, cfg.attention_head_dim, sh.batch
    return _input_sets(lambda: tuple(sh.randn(b, s, heads, dim).transpose(1, 2)
                                     for s in (sh.image_tokens, sh.text_tokens)))


@kernel_cases
def rmsnorm_cases(sh: Shapes) -> list[KernelCase]:
    """SD3's QK norms: diffusers' RMSNorm over the head_dim rows of the image and the text q."""
    if sh.family != "sd3":
        return []
    from diffusers.models.normalization import RMSNorm

    from ...ops import rmsnorm_ref

    plain = torch.ops.diffusers_fastpath._rmsnorm_plain_cuda
    dim = sh.model.config.attention_head_dim
    norm = RMSNorm(dim, eps=1e-6).to(sh.device, sh.dtype).requires_grad_(False)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)

    def eager(x, rows):  # diffusers' forward on the [B, H, S, D] view, its result as the kernel's rows
        return rmsnorm_ref(norm, x).transpose(1, 2).reshape(rows.shape)

    cases = []
    for stream, name in ((0, "image"), (1, "text")):  # x, and its rows in memory order ([B * S * H, 1, D], a view)
        sets = [(s[stream], s[stream].transpose(1, 2).reshape(-1, 1, dim)) for s in _sd3_heads_inputs(sh)]
        x = sets[0][0]
        cases.append(KernelCase(f"rmsnorm ({name} q)", tuple(x.shape), sets, eager,
                                lambda x, rows: plain(rows, norm.weight, norm.eps), 2 * _nbytes(x)))
    return cases


@kernel_cases
def cat_heads_cases(sh: Shapes) -> list[KernelCase]:
    """SD3's joint attention: ``torch.cat([image, text], dim=2)`` of its q, k and v."""
    if sh.family != "sd3":
        return []
    from ...ops import cat_heads_ref

    sets = _sd3_heads_inputs(sh)
    a, b = sets[0]
    shape = (a.shape[0], a.shape[1], a.shape[2] + b.shape[2], a.shape[3])
    return [KernelCase("cat_heads", shape, sets, cat_heads_ref, torch.ops.diffusers_fastpath._cat_heads_cuda.default,
                       2 * (_nbytes(a) + _nbytes(b)))]


@kernel_cases
def silu_mul_cases(sh: Shapes) -> list[KernelCase]:
    """FLUX.2's SwiGLU (``Flux2SwiGLU``): ``silu(x[..., :h]) * x[..., h:]`` of the dual blocks' FFN projection."""
    if sh.family != "flux2":
        return []
    from ...ops import silu_mul_ref

    op = torch.ops.diffusers_fastpath._silu_mul_cuda.default
    b, tokens = sh.batch, sh.image_tokens
    hidden = int(sh.hidden * sh.model.config.mlp_ratio)
    sets = _input_sets(lambda: tuple(sh.randn(b, tokens, 2 * hidden).chunk(2, dim=-1)))
    gate, _ = sets[0]
    return [KernelCase("silu_mul", (b, tokens, hidden), sets, silu_mul_ref, op, 3 * _nbytes(gate))]


@kernel_cases
def rmsnorm_rope_complex_cases(sh: Shapes) -> list[KernelCase]:
    """Qwen-Image's QK norms with the complex rotary after them: image and text q, ``[B, S, H, 128]``."""
    if sh.family != "qwen":
        return []
    from diffusers.models.normalization import RMSNorm

    from ...ops import rmsnorm_rope_complex_ref
    from ...ops.rmsnorm_rope import _pairs

    op = torch.ops.diffusers_fastpath._rmsnorm_rope_complex_cuda
    cfg = sh.model.config
    heads, dim, b = cfg.num_attention_heads, cfg.attention_head_dim, sh.batch
    norm = RMSNorm(dim, eps=1e-6).to(sh.device, sh.dtype).requires_grad_(False)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    cases = []
    for tokens, name in ((sh.image_tokens, "image"), (sh.text_tokens, "text")):
        angle = torch.rand(tokens, dim // 2, device=sh.device) * 100
        freqs = torch.polar(torch.ones_like(angle), angle)  # complex64 [S, D / 2], as the model's table
        pairs = _pairs(freqs)

        def make():
            x = sh.randn(b, tokens, heads, dim)
            return x, x.view(b * tokens * heads, 1, dim)

        sets = _input_sets(make)
        x = sets[0][0]
        cases.append(KernelCase(
            f"rmsnorm_rope_complex ({name} q)", tuple(x.shape), sets,
            lambda x, rows, freqs=freqs: rmsnorm_rope_complex_ref(norm, x, freqs).view(rows.shape),
            lambda x, rows, pairs=pairs, tokens=tokens: op(rows, norm.weight, pairs, heads, tokens, norm.eps),
            2 * _nbytes(x) + _nbytes(freqs)))
    if b == 1:  # both streams written into their joint concatenation (the processor's torch.cat of q, and of k)
        from ...ops.rmsnorm_rope import _cat_kernel, rmsnorm_rope_complex_cat_ref

        f_txt, f_img = (torch.polar(torch.ones(n, dim // 2, device=sh.device),
                                    torch.rand(n, dim // 2, device=sh.device) * 100)
                        for n in (sh.text_tokens, sh.image_tokens))
        sets = _input_sets(lambda: (sh.randn(1, sh.text_tokens, heads, dim), sh.randn(1, sh.image_tokens, heads, dim)))
        txt, img = sets[0]
        cases.append(KernelCase(
            "rmsnorm_rope_complex_cat (text+image q)", (1, sh.text_tokens + sh.image_tokens, heads, dim), sets,
            lambda t, i: rmsnorm_rope_complex_cat_ref(norm, t, f_txt, norm, i, f_img),
            lambda t, i: _cat_kernel(norm, t, f_txt, norm, i, f_img),
            2 * (_nbytes(txt) + _nbytes(img)) + _nbytes(f_txt) + _nbytes(f_img)))
    return cases


@kernel_cases
def rmsnorm_modulate_cases(sh: Shapes) -> list[KernelCase]:
    """LTX-Video's adaLN sites: its weightless RMSNorm and the per-token modulate, ``[B, T, D]``."""
    if sh.family != "ltx":
        return []
    from diffusers.models.normalization import RMSNorm

    from ...ops import rmsnorm_modulate_ref

    op = torch.ops.diffusers_fastpath._rmsnorm_modulate_cuda
    b, tokens, d = sh.batch, sh.image_tokens, sh.hidden
    norm = RMSNorm(d, eps=1e-6, elementwise_affine=False)

    def make():
        shift, scale = sh.randn(b, tokens, 6, d).unbind(dim=2)[:2]  # views of the adaLN table, as the block has them
        return sh.randn(b, tokens, d), scale, shift

    sets = _input_sets(make)
    x = sets[0][0]
    return [KernelCase("rmsnorm_modulate", (b, tokens, d), sets, lambda x, s, h: rmsnorm_modulate_ref(norm, x, s, h),
                       lambda x, s, h: op(x, None, s, h, norm.eps), 4 * _nbytes(x))]


@kernel_cases
def rotary_emb_rows_cases(sh: Shapes) -> list[KernelCase]:
    """LTX-Video's rotary of q (and k): ``[B, T, D]`` rows of all heads, with its per-sample fp32 ``[B, T, D]`` tables."""
    if sh.family != "ltx":
        return []
    from ...ops import rotary_emb_rows_ref
    from ...ops.rotary import rows_head_dim

    op = torch.ops.diffusers_fastpath._rotary_emb_rows_cuda
    b, tokens, d = sh.batch, sh.image_tokens, sh.hidden
    angle = torch.rand(b, tokens, d // 2, device=sh.device) * 100
    cos, sin = (f(angle).repeat_interleave(2, dim=-1).contiguous() for f in (torch.cos, torch.sin))
    sets = _input_sets(lambda: (sh.randn(b, tokens, d),))
    x = sets[0][0]
    return [KernelCase("rotary_emb_rows (q)", (b, tokens, d), sets, lambda x: rotary_emb_rows_ref(x, cos, sin),
                       lambda x: op(x, cos, sin, rows_head_dim(d)), 2 * _nbytes(x) + 2 * _nbytes(cos))]


@kernel_cases
def qk_norm_rows_rope_cases(sh: Shapes) -> list[KernelCase]:
    """LTX-Video's QK norm across all heads (``torch.nn.RMSNorm(D)``) with its rotary, of q alone and of q and k in one
    call (the pair: the tables read once)."""
    if sh.family != "ltx":
        return []
    from ...ops import qk_norm_rows_rope_pair_ref, qk_norm_rows_rope_ref
    from ...ops.qk_norm_rope import _pair_kernel, _rows_kernel

    b, tokens, d = sh.batch, sh.image_tokens, sh.hidden
    norm = torch.nn.RMSNorm(d, eps=1e-6).to(device=sh.device, dtype=sh.dtype).requires_grad_(False)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * sh.randn(d).float())
    angle = torch.rand(b, tokens, d // 2, device=sh.device) * 100
    cos, sin = (f(angle).repeat_interleave(2, dim=-1).contiguous() for f in (torch.cos, torch.sin))
    sets = _input_sets(lambda: (sh.randn(b, tokens, d),))
    x = sets[0][0]
    pairs = _input_sets(lambda: (sh.randn(b, tokens, d), sh.randn(b, tokens, d)))
    return [KernelCase("qk_norm_rows_rope (q)", (b, tokens, d), sets, lambda x: qk_norm_rows_rope_ref(norm, x, cos, sin),
                       lambda x: _rows_kernel(norm, x, cos, sin), 2 * _nbytes(x) + 2 * _nbytes(cos)),
            KernelCase("qk_norm_rows_rope_pair (q, k)", (b, tokens, d), pairs,
                       lambda q, k: qk_norm_rows_rope_pair_ref(norm, q, norm, k, cos, sin),
                       lambda q, k: _pair_kernel(norm, q, norm, k, cos, sin), 4 * _nbytes(x) + 2 * _nbytes(cos))]


@kernel_cases
def group_norm_silu_cases(sh: Shapes) -> list[KernelCase]:
    """The VAE decode's GroupNorm + SiLU (FLUX.1's and FLUX.2's ``AutoencoderKL``-style decoders, 32 groups) at each of
    its (channels, resolution) at the run's image size: the mid block at the latent's, then every 2x up to the
    image's. Bytes: x read twice (the statistics, then the output pass) and the output written once."""
    if sh.family not in ("flux", "flux2"):
        return []
    from ...ops.group_norm_silu import _platform_variant, group_norm_silu_ref

    ops = torch.ops.diffusers_fastpath
    cases = []
    height, width = _image_size(sh)
    for channels, scale in ((512, 8), (512, 4), (512, 2), (256, 2), (256, 1), (128, 1)):
        norm = torch.nn.GroupNorm(32, channels, eps=1e-6).to(device=sh.device, dtype=sh.dtype).requires_grad_(False)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(channels, device=sh.device))
            norm.bias.copy_(0.1 * torch.randn(channels, device=sh.device))
        shape = (sh.batch, channels, height // scale, width // scale)
        sets = _input_sets(lambda shape=shape: (sh.randn(*shape),))
        x = sets[0][0]
        variant = _platform_variant(x.device, x.dtype)
        cases.append(KernelCase("group_norm_silu", shape, sets, lambda x, norm=norm: group_norm_silu_ref(norm, x),
                                lambda x, norm=norm, v=variant: ops._group_norm_silu_cuda(
                                    x, norm.weight, norm.bias, 32, norm.eps, True, v),
                                3 * _nbytes(x)))
    return cases


def _image_size(sh: Shapes) -> tuple[int, int]:
    """The run's image size in pixels, taken as square: FLUX's image tokens are 2x2 patches of the 8x latent."""
    side = int(round(sh.image_tokens ** 0.5)) * 16
    return side, side


def gpu_time_us(fn: Callable[..., Any], sets: list, iters: int = 40, rounds: int = 5) -> tuple[float, bool]:
    """Median over `rounds` of the mean time of `iters` back-to-back calls (CUDA events), rotating input sets, and
    whether they ran as one CUDA graph. They are captured as one where they can be: a stream of separately launched
    calls measures the host wherever a call's enqueue takes longer than its kernels (tens of µs through the
    dispatcher, more than many of these kernels run), and the replayed graph measures the kernels."""
    for s in sets[:2]:  # warm-up: lazy initialisation and the ops' first-call self-verification, outside the capture
        fn(*s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(iters):
                fn(*sets[i % len(sets)])
        run, graphed = graph.replay, True
    except RuntimeError:  # something in `fn` cannot be captured: time the launches as they come
        torch.cuda.synchronize()
        run, graphed = (lambda: [fn(*sets[i % len(sets)]) for i in range(iters)]), False
    run()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times), graphed


def _first_tensor(args) -> torch.Tensor:
    """The first tensor among an op's arguments (a recorded call may begin with the module the op stands for)."""
    return next(a for a in args if isinstance(a, torch.Tensor))


def _kernel_row(case: KernelCase) -> dict[str, Any]:
    x = _first_tensor(case.sets[0])
    # the bandwidth bar: a contiguous copy of as many bytes as the first input (a strided view, such as a chunk of a
    # fused projection's output, copies slower than the card can, which would flatter the kernel's share of it)
    copies = [(t.contiguous(), torch.empty(t.shape, dtype=t.dtype, device=t.device))
              for t in map(_first_tensor, case.sets)]
    (eager_us, eager_graphed), (fused_us, fused_graphed), (copy_us, copy_graphed) = (
        gpu_time_us(case.eager, case.sets), gpu_time_us(case.fused, case.sets),
        gpu_time_us(lambda src, dst: dst.copy_(src), copies))
    fused_gbps = case.nbytes / fused_us / 1e3
    copy_gbps = 2 * _nbytes(x) / copy_us / 1e3
    return dict(
        op=case.op,
        shape=list(case.shape),
        dtype=str(x.dtype).removeprefix("torch."),
        eager_us=eager_us,
        fused_us=fused_us,
        speedup=eager_us / fused_us,
        bytes=case.nbytes,
        fused_GBps=fused_gbps,
        copy_us=copy_us,
        copy_GBps=copy_gbps,
        pct_of_copy=100 * fused_gbps / copy_gbps,
        exact=case.exact,
        graphed=eager_graphed and fused_graphed and copy_graphed,  # timed as replayed CUDA graphs (gpu_time_us)
        equal=all(equal((case.checked or case.fused)(*s), case.eager(*s)) for s in case.sets[:2]),
        max_abs_diff=max(max_abs_diff(case.fused(*s), case.eager(*s)) for s in case.sets[:2]),
    )


def host_us_per_call(sh: Shapes, calls: int = 2000) -> dict[str, float]:
    """Host time to enqueue one call of the modulate in its forms (tiny tensors, so the GPU is never the limit)."""
    from ...ops import _build, modulate_scale_shift, modulate_scale_shift_ref
    from ...ops.modulate_scale_shift import _nvrtc_kernel as nvrtc_modulate

    x = torch.randn(1, 17, 64, device=sh.device, dtype=sh.dtype)
    shift, scale = torch.randn(1, 6 * 64, device=sh.device, dtype=sh.dtype).chunk(6, dim=1)[:2]
    ops = torch.ops.diffusers_fastpath
    candidates = {
        "x.add(1) (baseline)": lambda: x.add(1),
        "eager chain (3 kernels)": lambda: modulate_scale_shift_ref(x, scale, shift),
        f"fused, direct CUDA op ({_build.backend})": lambda: ops._modulate_scale_shift_cuda.default(x, scale, shift),
        "fused, Python custom op": lambda: ops.modulate_scale_shift.default(x, scale, shift),
        "fused, public entry (guard + policy)": lambda: modulate_scale_shift(x, scale, shift),
    }
    if _build.backend == "nvrtc":  # the launcher the public entry calls on that way (no dispatcher in between)
        candidates["fused, NVRTC launcher"] = lambda: nvrtc_modulate(x, scale, shift)
    out = {}
    for name, fn in candidates.items():
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
    return out


def run_kernels(subject: Subject, args: argparse.Namespace, device: torch.device, show: bool) -> dict[str, Any]:
    """The hand-written cases of `subject`'s family (`KERNEL_FAMILIES`; any other model's are recorded from a step of
    it: `kernels_recorded.run_recorded`, which the runner calls instead)."""
    if subject.family not in KERNEL_FAMILIES:
        return dict(ran=False, reason=f"no hand-written kernel cases for {subject.name} (kernels_recorded has them)",
                    rows=[], host_us_per_call={})
    if device.type != "cuda":
        return dict(ran=False, reason="needs CUDA (the fused kernels are CUDA kernels)", rows=[], host_us_per_call={})
    from ...ops._build import load_extension

    load_extension()
    cfg = subject.transformer.config
    hidden = cfg.hidden_size if subject.family == "ernie" else cfg.num_attention_heads * cfg.attention_head_dim
    image_tokens = (subject.step_inputs["hidden_states"].shape[1] if subject.family in PACKED_FAMILIES
                    else (args.height // 16) * (args.width // 16))
    sh = Shapes(subject.family, subject.transformer, hidden, image_tokens, args.text_tokens, args.batch,
                DTYPES[args.dtype], device)
    builders = list(KERNEL_CASES.values())
    rows = []
    with progress(len(builders), "kernels", show) as bar:
        for build in builders:
            for case in build(sh):
                rows.append(_kernel_row(case))
                del case
            bar.update()
    return dict(ran=True, reason=None, rows=rows, host_us_per_call=host_us_per_call(sh))
