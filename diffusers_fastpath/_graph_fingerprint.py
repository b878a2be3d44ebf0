"""What a captured CUDA graph stands for besides its inputs (`graphs`), checked before each replay.

- `_global_state`: the process-wide settings that choose the kernels a forward launches (inference mode, autocast,
  SDPA backends, matmul and cuDNN flags, diffusers' attention backend), part of every call's signature; `verify`
  reads it too.
- `ModelFingerprint`: the model as captured (module classes, parameters, buffers, hooks, processors, plain
  attributes, weight addresses, the classes' own forwards) and `ModelFingerprint.blocker`, the reason no graph may
  stand for it (weights off the device, offload hooks, PEFT or bitsandbytes int8 layers, submodule hooks).

Split out of `graphs`, which re-exports `ModelFingerprint` and `_global_state`.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import nn

from diffusers.models.attention_dispatch import _AttentionBackendRegistry

from .ops._policy import fp32_precision_state, setting_reader

# plain values, compared by value: a call's arguments (`graphs.call_signature`) and a module's attributes
_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.memory_format)
# nn.Module's own dicts, fingerprinted entry by entry (`ModelFingerprint`)
_MODULE_DICTS = frozenset({"_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks"})


def _plain_value(v: Any) -> bool:
    """An immutable plain value (a number, a string, a dtype, ...) or a tuple / list of them: compared by value."""
    if isinstance(v, (tuple, list)):
        return all(isinstance(x, _LEAF_TYPES) for x in v)
    return isinstance(v, _LEAF_TYPES)


_CUDA, _CUDNN = torch.backends.cuda, torch.backends.cudnn
_MATMUL = _CUDA.matmul
_CUDNN_ENABLED, _CUDNN_BENCHMARK, _CUDNN_DETERMINISTIC = (
    setting_reader(_CUDNN, name) for name in ("enabled", "benchmark", "deterministic"))


def _global_state() -> tuple:
    """The process-wide settings that choose which kernels a forward launches (part of every signature). Read on
    every call of a verified model and of a CUDA graph: torch.backends' modules bound once (each ``torch.backends.X``
    goes through a Python ``__getattr__``), cuDNN's flags through their C getters (`setting_reader`)."""
    return (
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
        _CUDA.flash_sdp_enabled(),
        _CUDA.mem_efficient_sdp_enabled(),
        _CUDA.math_sdp_enabled(),
        _CUDA.cudnn_sdp_enabled(),
        *fp32_precision_state(),  # (the matmul precision and cuDNN's TF32, read as torch >= 2.9 keeps them)
        _MATMUL.allow_bf16_reduced_precision_reduction,
        _MATMUL.allow_fp16_reduced_precision_reduction,
        torch.are_deterministic_algorithms_enabled(),
        getattr(_AttentionBackendRegistry, "_active_backend", None),
        _flag(_CUDA, "fp16_bf16_reduction_math_sdp_allowed"),  # the math SDPA's bf16 reduction
        getattr(_MATMUL, "allow_fp16_accumulation", None),
        _flag(_CUDA, "preferred_blas_library"),
        _CUDNN_ENABLED(),  # the convolutions' (patch embeddings, VAEs) algorithm choice
        _CUDNN_BENCHMARK(),
        _CUDNN_DETERMINISTIC(),
    )


def _flag(namespace: Any, name: str) -> Any:
    """``namespace.name()`` where this torch has it, else None."""
    fn = getattr(namespace, name, None)
    return fn() if fn is not None else None


def _is_peft_layer(module: nn.Module) -> bool:
    return type(module).__module__.split(".")[0] == "peft"


def _is_bnb_int8_layer(module: nn.Module) -> bool:
    # bitsandbytes' LLM.int8() linear (diffusers' BitsAndBytesConfig(load_in_8bit=True)): on the H200 its forward
    # fails under capture (bitsandbytes 0.50.2: "operation not permitted when stream is capturing")
    kind = type(module)
    return kind.__module__.split(".")[0] == "bitsandbytes" and kind.__name__ == "Linear8bitLt"


def _own(method: tuple[type, str]):
    return vars(method[0])[method[1]]


class ModelFingerprint:
    """What a captured graph bakes in about a model, re-checked before every replay.

    A replay reads each weight's memory, so in-place writes (``load_state_dict``, ``fuse_lora``) are seen as eager
    sees them; what it cannot follow is a weight or module that is *replaced* or *moved*, or Python that no longer
    runs on replay (hooks, processors, module classes). So the fingerprint holds: the class of every module; the
    length of each module's ``__dict__`` (hooks of accelerate and diffusers, per-instance ``forward``), of its
    ``_parameters``, ``_buffers``, ``_modules`` and forward-hook dicts; the identity of every entry of those three
    and of every attention processor (and its attributes, e.g. the attention backend); the value of every plain
    attribute of a module (``eps``, ``theta``, ``axes_dim``: a graph bakes them in; lists kept as copies) and the
    identity of every tensor held as one and of a model's diffusers config; each tensor's data pointer (``.to()``
    keeps the Parameter object and changes its storage); and the ``forward`` each module class (and each class it
    inherits from) holds in its own dict, and each processor class its ``__call__`` (one replaced on torch's or
    diffusers' class after the capture).

    `matches` is one C-level ``map`` per list, no Python loop: for FLUX.1-dev (1279 modules, 1160 weights, 7731
    dicts, 2725 entries) 290 µs per call on the 2-core CI VM (best of 20x50 calls; building it takes 3.5 ms),
    against 48.5 ms of eager host time per 512x512 step; the plain values (5378 entries at FLUX.1-dev's structure)
    add about a third (431 -> 590 µs, measured side by side on a loaded VM). A replay is enqueued asynchronously and
    the GPU step takes tens of milliseconds, so this host time is hidden behind the GPU work.

    `blocker` is the reason no graph may stand for the model as it is (weights off the GPU, offload hooks, PEFT
    layers, bitsandbytes int8 layers, submodule hooks), or None.
    """

    def __init__(self, model: nn.Module, device_type: str = "cuda") -> None:
        named = list(model.named_modules())
        self.modules = [m for _, m in named]
        self.types = list(map(type, self.modules))
        self.dicts: list[dict] = []
        owners: list[dict] = []
        keys: list[str] = []
        values: list[Any] = []
        leaf_owners: list[dict] = []
        leaf_keys: list[str] = []
        processor_types: set[type] = set()
        for m in self.modules:
            self.dicts += [m.__dict__, m._parameters, m._buffers, m._modules, m._forward_hooks, m._forward_pre_hooks]
            # the plain values a forward may read (``eps``, ``theta``, ``axes_dim``), compared by value (a graph bakes
            # them in); tensors held as plain attributes, by identity and address; this package's own per-call
            # state (``_fastpath*``: hand-off slots, sites, caches keyed by those values) is not the model's
            for k, v in m.__dict__.items():
                if k.startswith("_fastpath") or k in _MODULE_DICTS:
                    continue
                if isinstance(v, torch.Tensor) or k == "_internal_dict":  # (diffusers' config: replaced, not edited,
                    # by `register_to_config`, e.g. SkyReels-V2's `_set_ar_attention`, which its forward reads)
                    owners.append(m.__dict__), keys.append(k), values.append(v)
                elif _plain_value(v):
                    leaf_owners.append(m.__dict__), leaf_keys.append(k)
            for d in (m._parameters, m._buffers, m._modules):
                for k, v in d.items():
                    owners.append(d), keys.append(k), values.append(v)
            registry = m.__dict__.get("_diffusers_hook")
            if registry is not None and isinstance(getattr(registry, "hooks", None), dict):
                self.dicts.append(registry.hooks)  # a hook registered later shows as a longer dict
            processor = m.__dict__.get("processor")
            if processor is not None:
                processor_types.add(type(processor))
                owners.append(m.__dict__), keys.append("processor"), values.append(processor)
                if hasattr(processor, "__dict__"):
                    self.dicts.append(vars(processor))
                    for k, v in vars(processor).items():
                        owners.append(vars(processor)), keys.append(k), values.append(v)
        self.lens = list(map(len, self.dicts))
        self.owners, self.keys, self.values = owners, keys, values
        self.leaf_owners, self.leaf_keys = leaf_owners, leaf_keys
        # a list is kept as a copy, so that a change made in place shows
        self.leaf_values = [v[:] if isinstance(v, list) else v for v in map(operator.getitem, leaf_owners, leaf_keys)]
        # every module class's own ``forward`` and every processor class's own ``__call__`` (a library that replaces
        # ``nn.LayerNorm.forward`` or ``WanAttnProcessor.__call__`` after a capture: the replay would run what the
        # old one launched), read from the class dicts
        methods = [(c, "forward") for c in {c for t in set(self.types) for c in t.__mro__}]
        methods += [(c, "__call__") for c in {c for t in processor_types for c in t.__mro__}]
        self.methods = [(c, name) for c, name in methods if name in vars(c)]
        self.functions = [vars(c)[name] for c, name in self.methods]
        self.tensors = [v for v in values if isinstance(v, torch.Tensor)]
        self.ptrs = list(map(torch.Tensor.data_ptr, self.tensors))
        devices = {t.device for t in self.tensors}
        self.device = devices.pop() if len(devices) == 1 else None
        self.blocker = self._blocker(named, devices | ({self.device} if self.device else set()), device_type)

    def _blocker(self, named, devices, device_type) -> str | None:
        if self.device is None or self.device.type != device_type:
            return f"weights on {', '.join(sorted(map(str, devices))) or 'no device'} (need one {device_type} device)"
        for name, m in named:
            label = name or "the model"
            if "_hf_hook" in m.__dict__:
                return f"accelerate hook on {label} (offloading): it runs Python on every call"
            # diffusers' HookRegistry: pipelines create an empty one on the transformer (``cache_context``), which
            # runs nothing; a registered hook (offloading, caching) runs Python on every call
            if getattr(m.__dict__.get("_diffusers_hook"), "hooks", None):
                return f"diffusers hook on {label} (offloading or caching): it runs Python on every call"
            if _is_peft_layer(m):
                return (
                    f"PEFT/LoRA layer {label}: its adapter scales are Python state a graph would freeze "
                    "(fuse and unload the LoRA to use CUDA graphs)"
                )
            if _is_bnb_int8_layer(m):
                return f"bitsandbytes int8 layer {label}: its matmul cannot be captured in a CUDA graph"
            if name and (m._forward_hooks or m._forward_pre_hooks):
                return f"forward hooks on {label} (a replay would skip them)"
            if name and "forward" in m.__dict__:
                return f"{label}.forward is replaced per instance (a replay would skip it)"
        return None

    def matches(self) -> bool:
        try:
            return (
                list(map(type, self.modules)) == self.types
                and list(map(len, self.dicts)) == self.lens
                and all(map(operator.is_, map(operator.getitem, self.owners, self.keys), self.values))
                and list(map(operator.getitem, self.leaf_owners, self.leaf_keys)) == self.leaf_values
                and list(map(torch.Tensor.data_ptr, self.tensors)) == self.ptrs
                and all(map(operator.is_, map(_own, self.methods), self.functions))
            )
        except KeyError:  # an entry renamed (same count)
            return False
