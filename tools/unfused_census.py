"""What a patched model still runs outside the fused ops, on a CPU: every aten op of one forward, eager and patched,
by op and by the module that called it, with the bytes it reads and writes (the cost of an elementwise kernel on a
GPU, which moves them once). The fused ops' kernels are replaced by their eager references, not counted among the
ops but listed apart with the bytes a kernel reads and writes (each input and the output once); their guards take
everything, as if every site ran fused on a GPU. So, before any GPU time is spent, the census says
which chains of a new family the rewriter does not reach yet and what they weigh against the GEMMs.

    python tools/unfused_census.py cosmos3 --size "frames=9, height=256, width=256, text=64" [--layers 1]
    python tools/unfused_census.py ltx-video --vae decode --size "frames=9, height=128, width=128"

The model is the zoo entry's published config (`diffusers_fastpath.testing.zoo`) with its block counts cut to
`--layers` (the proportions of a block are the published ones), its random inputs at `--size` (the entry's builder
knobs over its full size). A CPU run of one or two blocks at a reduced resolution takes seconds to a minute. With
``--vae decode`` (or ``encode``) the model is instead the VAE of a bench model, whole, at the ``--size`` sample.
torch's own ``F.rms_norm`` decomposes on a CPU (pow, mean, ...) but is one fused kernel on CUDA: such rows overstate
what a GPU runs. The bytes of a GEMM are its operands', not its cost.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that move no data (views, allocation) are not counted
_VIEWS = {"view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze", "select",
          "slice", "split", "chunk", "unbind", "as_strided", "alias", "detach", "unflatten", "flatten", "narrow",
          "split_with_sizes", "view_as_complex", "view_as_real", "empty", "empty_strided", "lift_fresh", "_reshape_alias"}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


class Census(TorchDispatchMode):
    """Counts the aten ops run inside it (outside the fused ops' kernels), by op and by (calling module, op)."""

    def __init__(self, inside: list[int], stack: list[str]) -> None:
        super().__init__()
        self.inside, self.stack = inside, stack
        self.calls: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self.by_module: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.inside[0] and name not in _VIEWS:
            moved = _nbytes(out) + sum(_nbytes(a) for a in args)
            self.calls[name] += 1
            self.bytes[name] += moved
            self.by_module[(self.stack[-1] if self.stack else "-", name)] += moved
        return out


def build_cut(name: str, layers: int):
    """The zoo entry's published config with every block count (``num_*layers``, ``num_*blocks``, and ``n_*layers``
    as Bria FIBO 2 names them) cut to `layers`."""
    from diffusers_fastpath.testing import zoo
    from diffusers_fastpath.testing.zoo._zoo import _as_loaded_, _construct, randomize_

    entry = zoo.ZOO[name]
    if entry.full_config is None:
        raise SystemExit(f"{name}: no published config in the zoo ({entry.notes})")
    cfg = dict(entry.full_config)
    for key, param in inspect.signature(entry.cls.__init__).parameters.items():
        if re.fullmatch(r"(num|n)_\w*(layers|blocks)", key) and isinstance(param.default, int) and param.default > 0:
            cfg[key] = min(layers, cfg.get(key, param.default))
    with _construct("cpu", torch.bfloat16):
        model = entry.cls(**cfg)
    _as_loaded_(model, torch.bfloat16, True)
    return randomize_(model, 0).eval()


_GEMMS = ("mm", "addmm", "bmm", "baddbmm", "convolution")  # (a convolution's bytes are its operands', as a GEMM's)


def vae_call(name: str, call: str, frames: int = 9, height: int = 128, width: int = 128, device: str = "cpu",
             dtype: str = "bf16", seed: int = 0):
    """The VAE of bench model `name` (its published config, random weights of ``dtype``, on ``device``) and the call
    that runs it: a decode of latents of a ``frames x height x width`` sample, or an encode of such a sample."""
    from diffusers_fastpath.bench.levels.vae import _frames, build_vae

    dev = torch.device(device)
    vae, reason = build_vae(argparse.Namespace(model=name, dtype=dtype, seed=seed), dev)
    if vae is None:
        raise SystemExit(reason)
    vae = vae.eval()
    dt = next(vae.parameters()).dtype
    scale = getattr(vae, "spatial_compression_ratio", None) or 2 ** (len(vae.config.block_out_channels) - 1)
    latent_frames, sample_frames = _frames(vae, frames)
    channels = getattr(vae.config, "latent_channels", None) or vae.config.z_dim
    gen = torch.Generator().manual_seed(seed)
    if call == "decode":
        latents = torch.randn(1, channels, *latent_frames, height // scale, width // scale, generator=gen)
        return vae, lambda m: m.decode(latents.to(dev, dt))
    image = torch.rand(1, 3, *sample_frames, height, width, generator=gen) * 2 - 1
    return vae, lambda m: m.encode(image.to(dev, dt))


def main(argv=None) -> None:
    import diffusers_fastpath as fp
    from diffusers_fastpath.ops._policy import OPS
    from diffusers_fastpath.testing import zoo
    from diffusers_fastpath.testing.zoo._zoo import Draw

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="a zoo entry (diffusers_fastpath.testing.zoo.ZOO), or with --vae a bench model "
                        "whose VAE to run (ltx-video, wan-14b, qwen-image, flux-dev, ...)")
    parser.add_argument("--vae", choices=("decode", "encode"), help="the model's VAE (its published config) instead")
    parser.add_argument("--size", default="", help='builder knobs, e.g. "height=512, width=512, text=128"; with --vae '
                        '"frames=9, height=128, width=128"')
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)

    inside, stack = [0], []
    fused: collections.Counter = collections.Counter()  # op -> bytes its kernel would read and write (once each)

    def counted_out(name, fn):  # a fused op's kernel: its reference, not counted among the ops
        def kernel(*a, **k):
            outer = not inside[0]
            inside[0] += 1
            try:
                out = fn(*a, **k)
            finally:
                inside[0] -= 1
            if outer:
                fused[name] += _nbytes(out) + sum(_nbytes(t) for t in a)
            return out
        return kernel

    for op in OPS.values():
        op.kernel, op.guard, op.verify_key, op.prove = counted_out(op.name, op.ref), (lambda *a, **k: None), None, None
    call = torch.nn.Module.__call__

    def named_call(self, *a, **k):
        stack.append(type(self).__name__)
        try:
            return call(self, *a, **k)
        finally:
            stack.pop()

    torch.nn.Module.__call__ = named_call  # (the hooks dicts are untouched: the fused ops' hook checks see no hook)

    size = eval(f"dict({args.size})")  # noqa: S307 - a developer's own command line
    if args.vae:
        model, run = vae_call(args.name, args.vae, **size)
    else:
        model = build_cut(args.name, args.layers)
        entry = zoo.ZOO[args.name]
        kwargs = entry.inputs_fn(model, Draw(model, 1), 1, **{**entry.full_size, **size})
        run = lambda m: m(**kwargs)  # noqa: E731
    for patched in (False, True):
        if patched:
            fp.patch(model, verify=False)
        with torch.no_grad():
            run(model)
            fused.clear()
            census = Census(inside, stack)
            with census:
                run(model)
        total = sum(census.bytes.values())
        print(f"== {args.name} {'patched' if patched else 'eager'}: {sum(census.calls.values())} ops, "
              f"{total / 1e6:.1f} MB read + written")
        for op, moved in census.bytes.most_common(args.top):
            print(f"  {op:34s} {census.calls[op]:5d} calls {moved / 1e6:10.1f} MB {100 * moved / total:5.1f}%")
        if patched:
            print("  by calling module (not GEMMs or attention):")
            for (module, op), moved in census.by_module.most_common():
                if op in _GEMMS or "attention" in op or moved < 0.003 * total:
                    continue
                print(f"    {module:40s} {op:20s} {moved / 1e6:9.1f} MB")
            print("  the fused ops themselves (each input read and the output written once; a GEMM's operands where "
                  "the op holds one):")
            for op, moved in fused.most_common():
                print(f"    {op:40s} {moved / 1e6:9.1f} MB")


if __name__ == "__main__":
    main()
