"""aten's ``setReduceConfig`` (``aten/src/ATen/native/cuda/Reduce.cuh``), ported once for the ops whose reductions
reproduce aten's order: `per_channel_rmsnorm` (``torch.mean(x**2, dim=1)``: the reduced dim is not the fastest-striding
one, the outputs are vectorised) and `rmsnorm` (``x.float().pow(2).mean(-1)`` of a dense fp32 copy: the reduced dim is
the fastest, the input is vectorised). Read in torch 2.13's header (the same lines as 2.11's for what is used here;
each op verifies its order against eager on its first call, because the order is a property of the aten build).

The port, for a reduction of ``num_outputs`` outputs of ``inputs_per_output`` inputs each, over one dim, whose
fastest-moving stride is the element size (contiguous data); warp size 32, MAX_NUM_THREADS 512 (every real dtype):

- on the fastest dim: ``dim0 = inputs_per_output``, ``dim1 = num_outputs``; with ``dim0 >= 128`` the input is read
  in vectors of ``input_vec_size`` (the kernel's template argument: 4 for fp32 ``mean``, 8 for bf16 / fp16 inputs)
  and ``dim0 /= input_vec_size``; block.x splits the inputs (``input_mult[0]``, ``step_input = width``: a thread's
  vectors are ``lane + width * k``, or its elements where the input is not vectorised);
- not on it: ``dim0 = num_outputs / output_vec_size``, ``dim1 = inputs_per_output``; block.x maps the outputs;
- ``set_block_dimension``: width = min(p2(dim0), 32), height = min(p2(dim1), threads / width), width = min(p2(dim0),
  threads / height), p2(n) the largest power of two <= n, capped at threads = 512 / output_vec_size;
- ``values_per_thread = ceil(inputs_per_output / step_input)`` (elements, even where the input is read in vectors)
  ``>= min(16 height, 256)`` splits the inputs across the block's rows too (``input_mult[1]``: row y starts at input
  ``y * step_input``, then ``step_input *= height``; the rows combine by ``block_y_reduce``), else each row takes
  other outputs;
- with that split, ``values_per_thread`` (recomputed) ``>= 256`` and a grid of ``ceil(num_outputs / ovs /
  step_output)`` blocks no larger than ``SMs * (threads per SM // threads)``, the inputs split across
  ``ctas = max(min(ceil(target / grid), ceil(vpt / 16)), ceil(vpt / 256))`` blocks (``global_reduce``).
"""

from __future__ import annotations

from typing import NamedTuple

WARP = 32
MAX_THREADS = 512  # mnt_wrapper<T>::MAX_NUM_THREADS for every real dtype
MIN_VALUES_PER_THREAD, MAX_VALUES_PER_THREAD = 16, 256  # setReduceConfig's constants on CUDA


def div_up(a: int, b: int) -> int:
    return -(-a // b)


def last_pow2(n: int) -> int:
    """Reduce.cuh's last_pow2: the largest power of two <= n (1 for n < 2)."""
    return 1 << (n.bit_length() - 1) if n >= 2 else 1


class ReduceConfig(NamedTuple):
    """What ``setReduceConfig`` decides."""

    output_vec_size: int
    block_width: int
    block_height: int
    split_across_warps: bool  # input_mult[1] != 0: the inputs split across the block's rows
    ctas_per_output: int  # > 1: across blocks too (global_reduce)
    input_vec_size: int = 1  # > 1: vectorize_input (a reduction over the fastest dim of at least 128 inputs)
    step_input: int = 1  # the stride between a thread's inputs (in vectors where the input is vectorised)


def set_reduce_config(num_outputs: int, inputs_per_output: int, on_fastest_dim: bool, sms: int, threads_per_sm: int,
                      input_vec_size: int = 4, output_vec_size: int = 1) -> ReduceConfig:
    """``setReduceConfig`` for one reduced dim of contiguous data (the module docstring): `on_fastest_dim` whether the
    reduced dim is the fastest-striding one; `input_vec_size` the kernel's (used where it vectorises the input),
    `output_vec_size` what ``get_output_vec_size`` gives (used where it does not); `sms` and `threads_per_sm` the
    device's ``multiProcessorCount`` and ``maxThreadsPerMultiProcessor``."""
    ivs, ovs = 1, 1
    if on_fastest_dim:
        dim0, dim1 = inputs_per_output, num_outputs
        if dim0 >= 128:
            ivs = input_vec_size
            dim0 //= ivs
    else:
        ovs = output_vec_size
        dim0, dim1 = num_outputs // ovs, inputs_per_output
    max_threads = MAX_THREADS // ovs
    dim0_pow2 = last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(dim0_pow2, WARP)
    height = min(dim1_pow2, max_threads // width)
    width = min(dim0_pow2, max_threads // height)
    step_input = step_output = 1
    if on_fastest_dim:
        step_input *= width  # input_mult[0] = split_input(block_width)
    else:
        step_output *= width  # output_mult[0] = split_output(block_width)
    split = div_up(inputs_per_output, step_input) >= min(height * MIN_VALUES_PER_THREAD, MAX_VALUES_PER_THREAD)
    if split:
        step_input *= height  # input_mult[1] = split_input(block_height)
    else:
        step_output *= height  # output_mult[1] = split_output(block_height)
    target = sms * (threads_per_sm // (width * height))
    grid = div_up(num_outputs // ovs, step_output)
    values = div_up(inputs_per_output, step_input)
    ctas = 1
    if split and values >= MAX_VALUES_PER_THREAD and grid <= target:
        ctas = max(min(div_up(target, grid), div_up(values, MIN_VALUES_PER_THREAD)),
                   div_up(values, MAX_VALUES_PER_THREAD))
    if ctas > 1:
        step_input *= ctas  # input_mult[2] = split_input(ctas_per_output)
    return ReduceConfig(ovs, width, height, split, ctas, ivs, step_input)
