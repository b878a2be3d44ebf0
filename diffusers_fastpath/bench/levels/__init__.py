"""The benchmark's levels, one file each: a transformer step, a whole generation, a profiled step, the kernels."""
