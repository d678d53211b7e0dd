"""Load HF safetensors checkpoints (single file or sharded with an index), or mamba_ssm's
``pytorch_model.bin``, into a flat dict.

Names are HF's without the ``model.``/``backbone.`` prefix (``layers.3.mixer.in_proj.weight``);
``weight_shapes`` lists every tensor a config needs and its shape. Every needed tensor's name,
shape and dtype are checked before any is read, so a missing, mis-shaped or quantized tensor is
reported by name and nothing is half-loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig

__all__ = ["WeightError", "weight_shapes", "load_weights", "random_weights"]

_PREFIXES = ("model.", "backbone.", "")
# mamba_ssm's names where they differ from HF's
_ALIASES = {"embeddings.weight": "embedding.weight"}
# weight dtypes read exactly (safetensors' names and torch's)
_FLOATS = {"F16", "BF16", "F32", "F64", torch.float16, torch.bfloat16, torch.float32, torch.float64}
# tensors that only quantized checkpoints carry (ModelOpt and FP8 scales, GPTQ/AWQ packs)
_QUANT_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".weight_scale_2", ".input_scale", ".k_scale",
                   ".v_scale", ".qweight", ".qzeros", ".scales")


def _keeps_fp32(name: str) -> bool:
    """A_log, D, dt_bias and the router (its weight and score bias) stay fp32: the SSM and routing
    math use them so. HF's NemotronH declares its router fp32 whatever the model's dtype (5.24
    does; 5.17 rounded it); rounded to bf16, its weight moves the logits by about 1e-3 and can
    change near-tied expert choices."""
    return name.endswith(("A_log", ".D", "dt_bias", "mixer.gate.weight", "e_score_correction_bias"))


class WeightError(ValueError):
    """A checkpoint tensor is missing, mis-shaped or unreadable; the message names it."""


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by name, with its shape."""
    D = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embeddings.weight": (cfg.vocab_size, D), "norm_f.weight": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, D)
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        shapes[p + "norm.weight"] = (D,)
        m = p + "mixer."
        if kind == "mamba":
            H = cfg.mamba_num_heads
            shapes.update({
                m + "in_proj.weight": (cfg.in_proj_dim, D),
                m + "conv1d.weight": (cfg.conv_dim, 1, cfg.conv_kernel),
                m + "dt_bias": (H,), m + "A_log": (H,), m + "D": (H,),
                m + "norm.weight": (cfg.mamba_inner,),
                m + "out_proj.weight": (D, cfg.mamba_inner),
            })
            if cfg.use_conv_bias:
                shapes[m + "conv1d.bias"] = (cfg.conv_dim,)
            if cfg.mamba_proj_bias:
                shapes[m + "in_proj.bias"] = (cfg.in_proj_dim,)
                shapes[m + "out_proj.bias"] = (D,)
        elif kind == "attention":
            q = cfg.num_attention_heads * cfg.attention_head_dim
            kv = cfg.num_key_value_heads * cfg.attention_head_dim
            for name, rows, cols in (("q_proj", q, D), ("k_proj", kv, D), ("v_proj", kv, D), ("o_proj", D, q)):
                shapes[m + name + ".weight"] = (rows, cols)
                if cfg.attention_bias:
                    shapes[m + name + ".bias"] = (rows,)
        elif kind == "mlp":
            shapes[m + "up_proj.weight"] = (cfg.intermediate_size, D)
            shapes[m + "down_proj.weight"] = (D, cfg.intermediate_size)
            if cfg.mlp_bias:
                shapes[m + "up_proj.bias"] = (cfg.intermediate_size,)
                shapes[m + "down_proj.bias"] = (D,)
        elif kind == "moe":
            E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
            L = cfg.moe_latent_size or D  # the routed experts' width
            shapes.update({
                m + "gate.weight": (E, D),
                m + "gate.e_score_correction_bias": (E,),
                m + "experts.up_proj": (E, I, L),
                m + "experts.down_proj": (E, L, I),
            })
            linears = []
            if cfg.moe_latent_size:
                linears += [("fc1_latent_proj", L, D), ("fc2_latent_proj", D, L)]
            if cfg.n_shared_experts:
                S = cfg.moe_shared_expert_intermediate_size * cfg.n_shared_experts
                linears += [("shared_experts.up_proj", S, D), ("shared_experts.down_proj", D, S)]
            for name, rows, cols in linears:
                shapes[m + name + ".weight"] = (rows, cols)
                if cfg.mlp_bias:
                    shapes[m + name + ".bias"] = (rows,)
    return shapes


def _open_shard(path: Path):
    """A safetensors file opened for reading; a WeightError naming it if it is not one."""
    try:
        return safe_open(path, framework="pt")
    except FileNotFoundError:
        raise WeightError(f"{path}: missing") from None
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) on bad files
        raise WeightError(f"{path}: not a readable safetensors file ({e})") from None


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WeightError(f"{index}: not a safetensors index with a weight_map ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightError(f"{index}: weight_map must map tensor names to shard file names")
    return weight_map


class _Checkpoint:
    """Name -> file lookup over a single safetensors file, an indexed set of shards, or a
    ``pytorch_model.bin`` (mamba_ssm's checkpoints, read as plain tensors: ``weights_only``)."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        self._open: dict[Path, object] = {}
        self._state: dict[str, torch.Tensor] | None = None
        if not index.exists() and not single.exists() and (path / "pytorch_model.bin").exists():
            try:
                self._state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # pickle, zip and torch's own errors on a bad file
                raise WeightError(f"{path / 'pytorch_model.bin'}: not a readable tensor file ({e})") from None
            if not isinstance(self._state, dict):
                raise WeightError(f"{path / 'pytorch_model.bin'}: expected a state dict of tensors")
            self.files = {name: path / "pytorch_model.bin" for name in self._state}
        elif index.exists():
            self.files = {name: path / shard for name, shard in _read_index(index).items()}
        elif single.exists():
            with _open_shard(single) as f:
                self.files = {name: single for name in f.keys()}
        else:
            shards = sorted(path.glob("*.safetensors"))
            if not shards:
                raise WeightError(f"no safetensors checkpoint in {path}")
            self.files = {}
            for shard in shards:
                with _open_shard(shard) as f:
                    self.files.update({name: shard for name in f.keys()})

    def find(self, name: str) -> str | None:
        for candidate in (name, _ALIASES.get(name)):
            for prefix in _PREFIXES if candidate else ():
                if prefix + candidate in self.files:
                    return prefix + candidate
        return None

    def _shard(self, full_name: str):
        path = self.files[full_name]
        if path not in self._open:
            if not path.exists():
                raise WeightError(f"{full_name}: shard {path.name} listed in the index is missing")
            self._open[path] = _open_shard(path)
        return self._open[path]

    def describe(self, full_name: str) -> tuple[object, tuple[int, ...]]:
        """(dtype, shape) of a tensor, from the file's header alone."""
        if self._state is not None:
            t = self._state[full_name]
            return t.dtype, tuple(t.shape)
        meta = self._shard(full_name).get_slice(full_name)
        return meta.get_dtype(), tuple(meta.get_shape())

    def get(self, full_name: str) -> torch.Tensor:
        if self._state is not None:
            return self._state[full_name]
        try:
            return self._shard(full_name).get_tensor(full_name)
        except Exception as e:  # a truncated file fails only when its tensor is read
            raise WeightError(f"{self.files[full_name]}: cannot read {full_name} ({e})") from None


def _stacked_expert_names(ckpt: _Checkpoint, name: str, n_experts: int) -> list[str] | None:
    """Older NemotronH checkpoints store experts one by one (``experts.{j}.up_proj.weight``)."""
    base, proj = name.rsplit(".", 1)  # "...mixer.experts", "up_proj"
    parts = [ckpt.find(f"{base}.{j}.{proj}.weight") for j in range(n_experts)]
    return None if any(p is None for p in parts) else parts


def load_weights(path: str | Path, cfg: ModelConfig, *, dtype: torch.dtype, device="cpu") -> dict[str, torch.Tensor]:
    """Read every tensor ``weight_shapes(cfg)`` names from the checkpoint at ``path``.

    Tensors are converted to ``dtype``, except the few ``_keeps_fp32`` keeps in fp32. Raises
    WeightError naming the first missing or mis-shaped tensor.
    """
    ckpt = _Checkpoint(Path(path))
    scales = sorted(n for n in ckpt.files if n.endswith(_QUANT_SUFFIXES))
    if scales:
        raise WeightError(f"{scales[0]}: a quantized checkpoint's scale tensor ({len(scales)} such) with no "
                          "quantization_config; mambastep reads bf16, fp16 and fp32 weights")
    found: dict[str, tuple[list[str], bool]] = {}  # name -> (its tensors in the file, stacked?)
    for name, shape in weight_shapes(cfg).items():  # everything checked before anything is read
        full, stacked = ckpt.find(name), False
        if full is None and name.endswith(("experts.up_proj", "experts.down_proj")):
            parts, stacked = _stacked_expert_names(ckpt, name, cfg.n_routed_experts), True
        else:
            parts = None if full is None else [full]
        if parts is None:
            raise WeightError(f"{name}: missing from the checkpoint at {path}")
        for part in parts:
            stored, got = ckpt.describe(part)
            label = part if stacked else name  # an expert of the stack by its own name
            if stored not in _FLOATS:
                raise WeightError(f"{label}: stored as {stored} (quantized weights); mambastep reads bf16, fp16 "
                                  "and fp32 weights")
            if stacked:  # one expert of the stack
                got = (len(parts), *got)
            if got != shape:
                raise WeightError(f"{label}: expected shape {list(shape[stacked:])}, checkpoint has "
                                  f"{list(got[stacked:])}")
        found[name] = parts, stacked
    out: dict[str, torch.Tensor] = {}
    for name, (parts, stacked) in found.items():
        t = torch.stack([ckpt.get(p) for p in parts]) if stacked else ckpt.get(parts[0])
        out[name] = t.to(device=device, dtype=torch.float32 if _keeps_fp32(name) else dtype)
    return out


def random_weights(cfg: ModelConfig, *, dtype: torch.dtype, device="cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of the right shapes, made directly on ``device`` in ``dtype`` (an 8B model
    in fp32 does not fit a CPU machine), scaled so activations stay O(1) through many layers."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith("A_log"):
            t = torch.log(torch.rand(shape, generator=gen, device=device) * 15 + 1)
        elif name.endswith("dt_bias"):
            # softplus^-1 of dt drawn log-uniformly in [1e-3, 1e-1], as HF initialises it
            dt = torch.exp(torch.rand(shape, generator=gen, device=device) * 4.6 - 6.9)
            t = dt + torch.log(-torch.expm1(-dt))
        elif name.endswith((".D", "norm.weight", "norm_f.weight")):
            t = torch.ones(shape, device=device)
        elif name.endswith("e_score_correction_bias") or name.endswith("bias"):
            t = torch.zeros(shape, device=device)
        else:
            fan_in = shape[-1]
            t = torch.randn(shape, generator=gen, device=device, dtype=dtype) * fan_in**-0.5
        out[name] = t.to(torch.float32 if _keeps_fp32(name) else dtype)
    return out
