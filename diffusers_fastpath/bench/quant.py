"""Quantized and memory-saving builds of a transformer through diffusers' own backends (``--quant``), for the
benchmark and the tests.

Every build starts from a model with random weights, as a user's starts from a published checkpoint, and goes the
way a user's goes: the backends that quantize while loading (bitsandbytes, torchao, quanto) load the model back
from a ``save_pretrained`` folder with ``quantization_config=...``; GGUF loads a ``.gguf`` file written from the
same weights with the ``gguf`` package (Q8_0 where a row splits into 32-value blocks, float32 elsewhere, as
llama.cpp's converters keep norms and biases) through ``from_single_file``; layerwise casting is
``enable_layerwise_casting`` on the live model. Nothing is downloaded.

    >>> from diffusers_fastpath.bench import quant
    >>> q = quant.quantize(model, "torchao-int8", torch.device("cpu"))  # doctest: +SKIP

The backends that can also quantize a live model (torchao's ``quantize_``, quanto's ``quantize`` + ``freeze``,
layerwise casting) have `Quant.in_place`, so that a test can patch first and quantize after.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

COMPUTE_DTYPE = torch.bfloat16  # the activations' dtype: every backend here computes in bf16
GGUF_BLOCK = 32  # values per Q8_0 block (ggml's QK8_0)


@dataclass(frozen=True)
class Quant:
    """One backend and setting.

    Args:
        name: the ``--quant`` value.
        description: one line for ``--help``, the report and the docs.
        packages: import names it needs (``pip install`` names in `PIP_NAMES`).
        load: ``load(model, folder, device) -> model``: the quantized model, built from `model`'s weights through
            the backend's loader (`folder` is a scratch directory the caller removes afterwards).
        in_place: ``in_place(model) -> None``: the same quantization applied to a live model, or ``None`` where
            only loading quantizes.
        cuda_only: why it cannot run without CUDA, or ``None``.
    """

    name: str
    description: str
    packages: tuple[str, ...]
    load: Callable[[nn.Module, str, torch.device], nn.Module]
    in_place: Callable[[nn.Module], None] | None = None
    cuda_only: str | None = None


PIP_NAMES = {"bitsandbytes": "bitsandbytes", "torchao": "torchao", "optimum.quanto": "optimum-quanto",
             "gguf": "gguf", "accelerate": "accelerate"}


def _reloaded(model: nn.Module, folder: str, device: torch.device, config) -> nn.Module:
    """`model` saved to `folder` and loaded back with ``quantization_config=config``, then moved to `device`.

    No ``device_map``: with ``device_map={"": "cpu"}`` diffusers 0.42.1 loads a TorchAoConfig model unquantized,
    without a word (bitsandbytes picks the current CUDA device itself)."""
    model.save_pretrained(folder)
    loaded = type(model).from_pretrained(folder, quantization_config=config, torch_dtype=COMPUTE_DTYPE)
    if not getattr(loaded, "is_loaded_in_8bit", False) and not getattr(loaded, "is_loaded_in_4bit", False):
        loaded = loaded.to(device)  # bitsandbytes models refuse .to(); they are already on the GPU
    return loaded.eval()


def _bnb(**kwargs) -> Callable[[nn.Module, str, torch.device], nn.Module]:
    def load(model: nn.Module, folder: str, device: torch.device) -> nn.Module:
        from diffusers import BitsAndBytesConfig

        return _reloaded(model, folder, device, BitsAndBytesConfig(**kwargs))

    return load


def _torchao_config(kind: str):
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

    return {"int8": Int8WeightOnlyConfig, "fp8": Float8WeightOnlyConfig}[kind]()


def _torchao(kind: str) -> tuple[Callable, Callable]:
    def load(model: nn.Module, folder: str, device: torch.device) -> nn.Module:
        from diffusers import TorchAoConfig

        return _reloaded(model, folder, device, TorchAoConfig(_torchao_config(kind)))

    def in_place(model: nn.Module) -> None:
        import torchao

        torchao.quantize_(model, _torchao_config(kind))

    return load, in_place


def quanto_skipped(model: nn.Module) -> list[str]:
    """Linears quanto must leave in bf16 on a CPU: torch 2.13's CPU ``_weight_int8pack_mm`` (quanto's bf16 x int8
    path) crashes the process with a segmentation fault when the input width is not a multiple of 8 and there is
    more than one row (seen at 4, 12, 20 and 36; 8, 16 and 32 pass). Only the tiny test configs have such a linear
    (FLUX's ``x_embedder`` with 4 input channels); FLUX.1-dev's widths are all multiples of 64."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m.in_features % 8]


def _quanto_load(model: nn.Module, folder: str, device: torch.device) -> nn.Module:
    from diffusers import QuantoConfig

    skip = quanto_skipped(model) if device.type == "cpu" else []
    return _reloaded(model, folder, device, QuantoConfig(weights_dtype="int8", modules_to_not_convert=skip))


def _quanto_in_place(model: nn.Module) -> None:
    from optimum.quanto import freeze, qint8, quantize

    device = next(model.parameters()).device
    quantize(model, weights=qint8, exclude=quanto_skipped(model) if device.type == "cpu" else None)
    freeze(model)


def write_gguf_q8_0(model: nn.Module, path: str) -> None:
    """Write `model`'s state dict as a GGUF file: Q8_0 for 2-D weights whose rows split into 32-value blocks,
    float32 (exact for bf16 values) for the rest, under the model's own (diffusers) names, so that
    ``from_single_file`` loads it without a key conversion."""
    import gguf

    writer = gguf.GGUFWriter(path, arch="diffusers_fastpath")
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().cpu().numpy()
        if array.ndim == 2 and array.shape[-1] % GGUF_BLOCK == 0:
            writer.add_tensor(name, gguf.quants.quantize(array, q8_0), raw_dtype=q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_load(model: nn.Module, folder: str, device: torch.device) -> nn.Module:
    from diffusers import GGUFQuantizationConfig

    path = os.path.join(folder, "transformer-q8_0.gguf")
    write_gguf_q8_0(model, path)
    model.save_config(folder)
    loaded = type(model).from_single_file(path, config=folder, torch_dtype=COMPUTE_DTYPE, device=str(device),
                                          quantization_config=GGUFQuantizationConfig(compute_dtype=COMPUTE_DTYPE))
    return loaded.to(device).eval()


def _layerwise_in_place(model: nn.Module) -> None:
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=COMPUTE_DTYPE)


def _layerwise_load(model: nn.Module, folder: str, device: torch.device) -> nn.Module:
    _layerwise_in_place(model)
    return model.to(device)


_BNB_CPU = "diffusers' bitsandbytes quantizer needs a CUDA GPU (it refuses with 'No GPU found')"
_torchao_int8, _torchao_fp8 = _torchao("int8"), _torchao("fp8")

QUANTS: dict[str, Quant] = {q.name: q for q in (
    Quant("bnb-nf4", "bitsandbytes 4-bit NF4 weights, bf16 compute (BitsAndBytesConfig)",
          ("bitsandbytes", "accelerate"),
          _bnb(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=COMPUTE_DTYPE),
          cuda_only=_BNB_CPU),
    Quant("bnb-int8", "bitsandbytes LLM.int8() weights (BitsAndBytesConfig(load_in_8bit=True))",
          ("bitsandbytes", "accelerate"), _bnb(load_in_8bit=True), cuda_only=_BNB_CPU),
    Quant("torchao-fp8", "torchao float8 weight-only (TorchAoConfig(Float8WeightOnlyConfig()))", ("torchao",),
          *_torchao_fp8),
    Quant("torchao-int8", "torchao int8 weight-only (TorchAoConfig(Int8WeightOnlyConfig()))", ("torchao",),
          *_torchao_int8),
    Quant("quanto-int8", "optimum-quanto int8 weights (QuantoConfig(weights_dtype='int8'))",
          ("optimum.quanto", "accelerate"), _quanto_load, _quanto_in_place),
    Quant("gguf-q8_0", "GGUF Q8_0 file written from the weights, loaded by from_single_file (GGUFQuantizationConfig)",
          ("gguf",), _gguf_load),
    Quant("layerwise-fp8", "enable_layerwise_casting: float8_e4m3fn storage, bf16 compute", (), _layerwise_load,
          _layerwise_in_place),
)}
CHOICES = ("none", *QUANTS)


def unavailable(name: str, device: torch.device) -> str | None:
    """Why the backend `name` cannot run on `device` here (a package missing, no CUDA), or ``None``."""
    q = QUANTS[name]
    if q.cuda_only is not None and device.type != "cuda":  # first: installing a package would not help
        return q.cuda_only
    missing = [p for p in q.packages if importlib.util.find_spec(p.split(".")[0]) is None
               or importlib.util.find_spec(p) is None]
    if missing:
        return f"needs {', '.join(missing)} (pip install {' '.join(PIP_NAMES[p] for p in missing)})"
    return None


def quantize(model: nn.Module, name: str, device: torch.device) -> nn.Module:
    """`model` (bf16, random or real weights) quantized by the backend `name` (a key of `QUANTS`) on `device`.

    The loading backends return a new model (drop `model` to free its memory); ``layerwise-fp8`` changes `model`
    in place and returns it.

    Raises:
        RuntimeError: the backend cannot run here (`unavailable` says why).
    """
    reason = unavailable(name, device)
    if reason is not None:
        raise RuntimeError(f"--quant {name}: {reason}")
    with tempfile.TemporaryDirectory(prefix=f"fastpath-{name}-") as folder:
        quantized = QUANTS[name].load(model, folder, device)
    if not any(map(is_quantized, quantized.modules())):
        raise RuntimeError(f"--quant {name}: the loaded model has no quantized linear (the backend ignored its config)")
    return quantized


# --- what a quantized model holds -----------------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds, through tensor subclasses (torchao's and quanto's keep their data in inner tensors and
    report the dtype they compute in)."""
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, nn.Parameter):
        inner, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in inner)
    return t.numel() * t.element_size()


def weights_gib(model: nn.Module) -> float:
    """What the model's parameters and buffers hold, in GiB."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(map(tensor_bytes, tensors.values())) / 2**30


def is_quantized(module: nn.Module) -> bool:
    """Whether `module` is a linear whose weight is stored quantized (not a plain bf16/fp16/fp32 tensor)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or not hasattr(module, "in_features"):
        return False
    return type(weight) not in (torch.Tensor, nn.Parameter) or weight.dtype not in (
        torch.bfloat16, torch.float16, torch.float32)


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """The weight a quantized linear computes with, as a float32 tensor of shape (out_features, in_features)."""
    weight = module.weight
    if hasattr(weight, "quant_type"):  # diffusers' GGUFParameter
        from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

        return dequantize_gguf_tensor(weight).float()
    if hasattr(weight, "dequantize"):  # torchao and quanto tensor subclasses
        return weight.dequantize().float()
    if hasattr(module, "qweight"):  # quanto's QLinear before freeze
        return module.qweight.dequantize().float()
    return weight.float()  # float8 storage (layerwise casting)
