"""How a model's linear weights are quantized: read from a checkpoint's config as its producer
wrote it, or chosen at load time (``--quantization fp8``).

Read exactly (``parse_quantization``), all FP8 e4m3 with fp32 scales, ``W = values * scale``:

- ModelOpt ``FP8`` (NVIDIA's FP8 releases): a per-tensor ``weight_scale`` and a static
  ``input_scale`` per linear; ``exclude_modules`` (or ``ignore``) names the modules kept in bf16;
  ``kv_cache_quant_algo`` asks for an FP8 KV cache;
- ModelOpt ``FP8_PER_CHANNEL_PER_TOKEN``: ``weight_scale`` per output channel, no input scale;
- ModelOpt ``FP8_PB_WO``: 128 x 128 block scales, ``weight_scale`` as [N/128, 1, K/128, 1];
- ``quant_method: fp8`` (HF's fine-grained FP8, the community's DeepSeek-style checkpoints):
  ``weight_block_size`` [128, 128] and ``weight_scale_inv`` per block; without a block size, a
  per-tensor ``weight_scale``.

Anything else (NVFP4, mixed precision, GPTQ/AWQ, compressed-tensors, ...) is refused by name.
An FP8 KV cache asked for is kept so: the attention layers' keys and values in e4m3 over the
checkpoint's ``k_scale`` and ``v_scale`` (``runtime.state_pool.kv_cache_dtype``,
``kernels.attention``).

Only the block linears are ever quantized (``QUANTIZABLE``): Mamba2's in/out projections,
attention's q/k/v/o, the MLP's and the experts' up/down and MoE latent projections. Embeddings,
the LM head, conv1d, norms and the router stay as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatch

__all__ = ["Quantization", "QuantizationError", "QUANTIZABLE", "module_of", "online_fp8", "parse_quantization",
           "quantizable"]

# weight names (without the checkpoint's model./backbone. prefix) of the linears that may be FP8
QUANTIZABLE = re.compile(
    r"layers\.\d+\.mixer\.(in_proj|out_proj|q_proj|k_proj|v_proj|o_proj|up_proj|down_proj"
    r"|shared_experts\.(up_proj|down_proj)|fc1_latent_proj|fc2_latent_proj)\.weight"
    r"|layers\.\d+\.mixer\.experts\.(up_proj|down_proj)"
)
_PREFIXES = ("", "model.", "backbone.")


class QuantizationError(ValueError):
    """A quantization config mambastep does not read; the message names the method."""


@dataclass(frozen=True)
class Quantization:
    """scheme: "tensor", "channel" or "block" (``block`` x ``block`` tiles); scale_name: the
    checkpoint's scale tensor suffix (``weight_scale`` or ``weight_scale_inv``); exclude: the
    producer's patterns of modules kept unquantized; kv_cache: the KV cache dtype asked for
    ("fp8") or None; label: the method in words, for messages; online: quantized at load time
    from full-precision weights (per channel), not read from a checkpoint."""

    scheme: str
    block: int = 0
    scale_name: str = "weight_scale"
    exclude: tuple[str, ...] = ()
    kv_cache: str | None = None
    label: str = ""
    online: bool = False

    def excludes(self, module: str) -> bool:
        """Whether the producer kept ``module`` (a name without the model./backbone. prefix, e.g.
        ``layers.4.mixer``) or a module above it unquantized: an exact name, an fnmatch wildcard,
        or ModelOpt's ``path*`` for a module and everything under it."""
        parts = module.split(".")
        names = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        for pattern in self.exclude:
            for prefix in _PREFIXES:
                for name in names:
                    if fnmatch(prefix + name, pattern) or prefix + name == pattern:
                        return True
        return False


def quantizable(name: str) -> bool:
    """Whether a weight (``runtime.weights``'s names) is a linear that may be stored in FP8."""
    return QUANTIZABLE.fullmatch(name) is not None


def module_of(name: str) -> str:
    """The module a weight belongs to: ``layers.3.mixer.in_proj.weight`` -> ``layers.3.mixer.in_proj``."""
    return name.removesuffix(".weight")


def online_fp8(layer_types: tuple[str, ...]) -> Quantization:
    """FP8 at load time, per output channel, with NVIDIA's recipe for its hybrid releases: the
    attention layers and the Mamba layer before each stay in full precision (the LM head and
    embeddings always do); a parallel block (Falcon-H1), which holds attention, stays whole."""
    keep = []
    for i, kind in enumerate(layer_types):
        if kind in ("attention", "parallel"):
            keep.append(f"layers.{i}.*")
            before = [j for j in range(i) if layer_types[j] == "mamba"]
            if before:
                keep.append(f"layers.{before[-1]}.*")
    return Quantization("channel", exclude=tuple(keep), label="fp8 (quantized at load)", online=True)


def parse_quantization(quant) -> Quantization:
    """A checkpoint's ``quantization_config`` (config.json, or ModelOpt's hf_quant_config.json
    folded into that form) as a Quantization; QuantizationError naming anything else."""
    if not isinstance(quant, dict):
        raise QuantizationError(f"expected an object, got {quant!r}")
    method = str(quant.get("quant_method", "")).lower()
    if method.startswith("modelopt") or "quant_algo" in quant:
        return _modelopt(quant)
    if method == "fp8":
        return _fine_grained_fp8(quant)
    raise QuantizationError(f"{method or repr(quant)} weights are not read; mambastep reads FP8 checkpoints "
                            "(ModelOpt FP8, or quant_method fp8) and bf16 ones")


def _modelopt(quant: dict) -> Quantization:
    algo = str(quant.get("quant_algo", "")).upper()
    exclude = quant.get("exclude_modules", quant.get("ignore", [])) or []
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise QuantizationError(f"exclude_modules: expected a list of module names, got {exclude!r}")
    kv = quant.get("kv_cache_quant_algo")
    scheme = quant.get("kv_cache_scheme")
    if kv is None and isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8:
        kv = "FP8"
    if kv is not None and str(kv).upper() != "FP8":
        raise QuantizationError(f"kv_cache_quant_algo: ModelOpt {kv} KV cache is not read (FP8 is)")
    kv = None if kv is None else "fp8"
    common = dict(exclude=tuple(exclude), kv_cache=kv)
    if algo == "FP8":
        return Quantization("tensor", label="ModelOpt FP8", **common)
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return Quantization("channel", label="ModelOpt FP8_PER_CHANNEL_PER_TOKEN", **common)
    if algo == "FP8_PB_WO":
        return Quantization("block", block=128, label="ModelOpt FP8_PB_WO", **common)
    raise QuantizationError(f"ModelOpt {algo or 'without a quant_algo'} ({quant.get('quant_method')}) weights are "
                            "not read; mambastep reads ModelOpt FP8, FP8_PER_CHANNEL_PER_TOKEN and FP8_PB_WO "
                            "(NVFP4 and mixed precision are Blackwell formats)")


def _fine_grained_fp8(quant: dict) -> Quantization:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"fmt: FP8 {fmt} weights are not read (e4m3 are)")
    # static: the checkpoint's input_scale tensors, read with each weight; dynamic: per token
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantizationError(f"activation_scheme: expected dynamic or static, got {scheme!r}")
    exclude = quant.get("modules_to_not_convert") or quant.get("ignored_layers") or []
    block = quant.get("weight_block_size")
    if block is None:
        return Quantization("tensor", exclude=tuple(exclude), label="FP8 with per-tensor scales (fp8)")
    if (not isinstance(block, (list, tuple)) or len(block) != 2 or block[0] != block[1]
            or not isinstance(block[0], int) or block[0] < 16):
        raise QuantizationError(f"weight_block_size: square blocks of at least 16 are read, got {block!r}")
    return Quantization("block", block=block[0], scale_name="weight_scale_inv", exclude=tuple(exclude),
                        label=f"FP8 with {block[0]}x{block[0]} block scales (fp8)")
