"""Load HF safetensors checkpoints (single file or sharded with an index), or mamba_ssm's
``pytorch_model.bin``, into a flat dict.

Names are NemotronH's without the ``model.``/``backbone.`` prefix (``layers.3.mixer.in_proj.weight``),
found in other families' checkpoints under their own names (``runtime.checkpoint_names``);
``weight_shapes`` lists every tensor a config needs and its shape. Every needed tensor's name,
shape and dtype are checked before any is read, so a missing, mis-shaped or quantized tensor is
reported by name and nothing is half-loaded.

FP8 checkpoints (``cfg.quantization``, read from the config): a block linear stored as
float8_e4m3fn is read with its scale (and static input scale, where given) into an ``Fp8Weight``
(``kernels.fp8``); scales are checked by shape with the rest. ``quantize_online`` turns a
full-precision model's linears into FP8 at load time instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..kernels.fp8 import Fp8Weight, quantize_fp8
from .checkpoint_names import checkpoint_names
from .config import ModelConfig
from .quantization import Quantization, module_of, quantizable

__all__ = ["WeightError", "weight_shapes", "load_weights", "mtp_weight_shapes", "quantize_online", "random_weights"]

_PREFIXES = ("model.", "backbone.", "")
# mamba_ssm's names where they differ from HF's
_ALIASES = {"embeddings.weight": "embedding.weight"}
# weight dtypes read exactly (safetensors' names and torch's)
_FLOATS = {"F16", "BF16", "F32", "F64", torch.float16, torch.bfloat16, torch.float32, torch.float64}
_FP8 = {"F8_E4M3", torch.float8_e4m3fn}
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
    # an up projection's rows per unit of width: SwiGLU's holds the gate's and the up's
    up = 2 if cfg.mlp_activation == "swiglu" else 1
    shapes: dict[str, tuple[int, ...]] = {"embeddings.weight": (cfg.vocab_size, D), "norm_f.weight": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, D)
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        shapes[p + "norm.weight"] = (D,)
        m = p + "mixer."
        if kind in ("mamba", "parallel"):  # a parallel block's Mamba2 and attention share its prefix
            H = cfg.mamba_num_heads
            shapes.update({
                m + "in_proj.weight": (cfg.in_proj_dim, D),
                m + "conv1d.weight": (cfg.conv_dim, 1, cfg.conv_kernel),
                m + "dt_bias": (H,), m + "A_log": (H,), m + "D": (H,),
                m + "out_proj.weight": (D, cfg.mamba_inner),
            })
            if cfg.mamba_gated_norm:
                shapes[m + "norm.weight"] = (cfg.mamba_inner,)
            if cfg.use_conv_bias:
                shapes[m + "conv1d.bias"] = (cfg.conv_dim,)
            if cfg.mamba_proj_bias:
                shapes[m + "in_proj.bias"] = (cfg.in_proj_dim,)
                shapes[m + "out_proj.bias"] = (D,)
        if kind in ("attention", "parallel"):
            q = cfg.num_attention_heads * cfg.attention_head_dim
            kv = cfg.num_key_value_heads * cfg.attention_head_dim
            for name, rows, cols in (("q_proj", q, D), ("k_proj", kv, D), ("v_proj", kv, D), ("o_proj", D, q)):
                shapes[m + name + ".weight"] = (rows, cols)
                if cfg.attention_bias:
                    shapes[m + name + ".bias"] = (rows,)
        elif kind == "mlp":
            shapes[m + "up_proj.weight"] = (up * cfg.intermediate_size, D)
            shapes[m + "down_proj.weight"] = (D, cfg.intermediate_size)
            if cfg.mlp_bias:
                shapes[m + "up_proj.bias"] = (up * cfg.intermediate_size,)
                shapes[m + "down_proj.bias"] = (D,)
        elif kind == "moe":
            E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
            L = cfg.moe_latent_size or D  # the routed experts' width
            shapes.update({
                m + "gate.weight": (E, D),
                m + "experts.up_proj": (E, up * I, L),
                m + "experts.down_proj": (E, L, I),
            })
            if cfg.moe_scoring == "sigmoid":
                shapes[m + "gate.e_score_correction_bias"] = (E,)
            linears = []
            if cfg.moe_latent_size:
                linears += [("fc1_latent_proj", L, D), ("fc2_latent_proj", D, L)]
            if cfg.n_shared_experts:
                S = cfg.moe_shared_expert_intermediate_size * cfg.n_shared_experts
                linears += [("shared_experts.up_proj", up * S, D), ("shared_experts.down_proj", D, S)]
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


def mtp_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors of ``cfg``'s multi-token prediction layers (one depth), by their checkpoint
    names, as NVIDIA's Nemotron 3 store them: ``mtp.layers.{j}.`` holds the j-th block (norm,
    mixer) as a backbone layer does; the first also the fusion of the token's embedding with the
    target's hidden state (``enorm``, ``hnorm``, ``eh_proj``), the last the depth's
    ``final_layernorm``. Embeddings and LM head are the target's."""
    D = cfg.hidden_size
    shapes = {"mtp." + name: shape for name, shape in weight_shapes(cfg.mtp_config()).items()
              if name.startswith("layers.")}
    last = len(cfg.mtp_layer_types) - 1
    shapes.update({"mtp.layers.0.enorm.weight": (D,), "mtp.layers.0.hnorm.weight": (D,),
                   "mtp.layers.0.eh_proj.weight": (D, 2 * D), f"mtp.layers.{last}.final_layernorm.weight": (D,)})
    return shapes


def load_weights(path: str | Path, cfg: ModelConfig, *, dtype: torch.dtype, device="cpu",
                 mtp: bool = False) -> dict[str, torch.Tensor]:
    """Read every tensor ``weight_shapes(cfg)`` names from the checkpoint at ``path`` (``mtp``:
    those of ``mtp_weight_shapes(cfg)`` instead).

    Tensors are converted to ``dtype``, except the few ``_keeps_fp32`` keeps in fp32; with an FP8
    ``cfg.quantization``, block linears stored in FP8 come as ``Fp8Weight``. Raises WeightError
    naming the first missing or mis-shaped tensor.
    """
    ckpt = _Checkpoint(Path(path))
    quant = cfg.quantization if cfg.quantization is not None and not cfg.quantization.online else None
    if quant is None:
        scales = sorted(n for n in ckpt.files if n.endswith(_QUANT_SUFFIXES))
        if scales:
            raise WeightError(f"{scales[0]}: a quantized checkpoint's scale tensor ({len(scales)} such) with no "
                              "quantization_config; mambastep reads bf16, fp16 and fp32 weights")
    # name -> (its tensors in the file, how they make it, fp8?): everything checked before anything is read
    shapes = mtp_weight_shapes(cfg) if mtp else weight_shapes(cfg)
    found = {name: _locate(ckpt, name, shape, cfg, quant, path) for name, shape in shapes.items()}
    out: dict[str, torch.Tensor] = {}
    for name, (parts, how, fp8) in found.items():
        if fp8:
            pieces = [_read_fp8(ckpt, p, quant) for p in parts]
            out[name] = {"one": lambda: pieces[0], "stack": lambda: _stack_fp8(pieces),
                         "cat": lambda: Fp8Weight.cat(pieces)}[how]().to(device)
            continue
        pieces = [ckpt.get(p) for p in parts]
        t = torch.stack(pieces) if how == "stack" else torch.cat(pieces) if how == "cat" else pieces[0]
        out[name] = t.to(device=device, dtype=torch.float32 if _keeps_fp32(name) else dtype)
    if quant is not None and quant.kv_cache == "fp8" and not mtp:
        for i in cfg.layers_of("attention"):
            scales = [_kv_scale(ckpt, found[f"layers.{i}.mixer.{proj}.weight"][0][0], what, quant)
                      for proj, what in (("k_proj", "k_scale"), ("v_proj", "v_scale"))]
            out[f"layers.{i}.mixer.kv_scale"] = torch.tensor(scales, dtype=torch.float32, device=device)
    return out


def _kv_scale(ckpt: _Checkpoint, part: str, what: str, quant: Quantization) -> float:
    """An FP8 KV cache's key or value scale (``what``) of the attention layer whose k_proj or
    v_proj is stored as ``part``: ModelOpt's beside the projection (``...k_proj.k_scale``), or
    on the attention module (``...k_scale``), a positive float (the cache holds k / scale)."""
    base = part.removesuffix(".weight")
    names = (f"{base}.{what}", f"{base.rsplit('.', 1)[0]}.{what}")
    name = next((n for n in names if n in ckpt.files), None)
    if name is None:
        raise WeightError(f"{names[0]}: missing; {quant.label} asks for an FP8 KV cache (kv_cache_quant_algo), "
                          "whose key and value scales it stores beside k_proj and v_proj")
    stored, shape = ckpt.describe(name)
    if stored not in _FLOATS or shape not in ((), (1,)):
        raise WeightError(f"{name}: expected one float scale, checkpoint has {stored} of shape {list(shape)}")
    value = float(ckpt.get(name).float().reshape(()))
    if not (value > 0 and value < float("inf")):
        raise WeightError(f"{name}: an FP8 KV cache scale must be positive and finite, got {value}")
    return value


def _locate(ckpt: _Checkpoint, name: str, shape: tuple[int, ...], cfg: ModelConfig, quant: Quantization | None,
            path) -> tuple[list[str], str, bool]:
    """Where tensor ``name`` is in the checkpoint, checked from the headers: (its tensors; how
    they make it: "one", an expert "stack", or rows to "cat" (a family's gate and up
    projections); whether FP8, its scales checked too)."""
    sources = checkpoint_names(cfg, name)
    parts = next(([ckpt.find(p) for p in alt] for alt in sources if all(map(ckpt.find, alt))), None)
    how = "one" if parts is None or len(parts) == 1 else "cat"
    if parts is None and name.endswith(("experts.up_proj", "experts.down_proj")):
        parts, how = _stacked_expert_names(ckpt, name, cfg.n_routed_experts), "stack"
    if parts is None:
        stored_as = "" if sources == ((name,),) else f" (stored as {' + '.join(sources[0])})"
        raise WeightError(f"{name}{stored_as}: missing from the checkpoint at {path}")
    kinds, rows = set(), 0
    for part in parts:
        stored, got = ckpt.describe(part)
        label = part if how != "one" else name  # a part by its own name
        kinds.add(_stored_kind(label, stored, name, quant))
        want = shape[1:] if how == "stack" else (got[0], *shape[1:]) if how == "cat" else shape
        if got != want:
            raise WeightError(f"{label}: expected shape {list(want)}, checkpoint has {list(got)}")
        rows += got[0] if got else 0
    if how == "cat" and rows != shape[0]:
        raise WeightError(f"{name}: {' + '.join(parts)} have {rows} rows together, expected {shape[0]}")
    if len(kinds) > 1:
        raise WeightError(f"{name}: its parts are stored in different precisions (FP8 and not)")
    fp8 = kinds == {"fp8"}
    if fp8:
        if how == "one" and name.endswith(("experts.up_proj", "experts.down_proj")):
            raise WeightError(f"{name}: an expert stack stored in FP8 as one tensor; FP8 experts are read one by one "
                              "(experts.{j}.up_proj.weight with their scales)")
        for part in parts:
            _check_scales(ckpt, part, ckpt.describe(part)[1][-2:], quant)
    return parts, how, fp8


def _stored_kind(label: str, stored, name: str, quant: Quantization | None) -> str:
    """"fp8" or "float" for a tensor stored as ``stored``; WeightError for anything unread."""
    if stored in _FLOATS:
        return "float"
    if stored in _FP8 and quant is not None:
        if not quantizable(name):
            raise WeightError(f"{label}: stored as {stored}; mambastep reads only the block linears in FP8, "
                              "this tensor in bf16, fp16 or fp32")
        if quant.excludes(module_of(name)):
            raise WeightError(f"{label}: stored as {stored}, but the quantization config's exclude_modules keeps "
                              "it unquantized")
        return "fp8"
    if quant is not None:
        raise WeightError(f"{label}: stored as {stored}; {quant.label} checkpoints are read with FP8 (F8_E4M3) "
                          "linears and bf16, fp16 or fp32 tensors")
    raise WeightError(f"{label}: stored as {stored} (quantized weights); mambastep reads bf16, fp16 and fp32 "
                      "weights")


def _scale_names(part: str, quant: Quantization) -> tuple[str, str]:
    """(weight scale, input scale) tensor names of an FP8 linear stored as ``part``."""
    base = part.removesuffix(".weight")
    return f"{base}.{quant.scale_name}", f"{base}.input_scale"


def _scale_shapes(quant: Quantization, n: int, k: int) -> list[tuple[int, ...]]:
    """The weight scale shapes the producer writes for an [n, k] weight."""
    if quant.scheme == "tensor":
        return [(), (1,)]
    if quant.scheme == "channel":
        return [(n,), (n, 1)]
    nb, kb = -(-n // quant.block), -(-k // quant.block)
    return [(nb, kb), (nb, 1, kb, 1)]  # the second: ModelOpt FP8_PB_WO's


def _check_scales(ckpt: _Checkpoint, part: str, nk: tuple[int, int], quant: Quantization) -> None:
    scale, inp = _scale_names(part, quant)
    if scale not in ckpt.files:
        raise WeightError(f"{scale}: missing; {quant.label} stores one beside each FP8 weight")
    stored, shape = ckpt.describe(scale)
    if stored not in _FLOATS:
        raise WeightError(f"{scale}: stored as {stored}; scales are read as floats")
    expected = _scale_shapes(quant, *nk)
    if shape not in expected:
        raise WeightError(f"{scale}: expected shape {list(expected[0])} ({quant.label}), checkpoint has {list(shape)}")
    if inp in ckpt.files and ckpt.describe(inp)[1] not in ((), (1,)):
        raise WeightError(f"{inp}: expected one static scale, checkpoint has shape {list(ckpt.describe(inp)[1])}")


def _read_fp8(ckpt: _Checkpoint, part: str, quant: Quantization) -> Fp8Weight:
    values = ckpt.get(part)
    scale_name, inp = _scale_names(part, quant)
    scale = ckpt.get(scale_name).float()
    n, k = values.shape
    if quant.scheme == "tensor":
        scale = scale.reshape(()).expand(n).contiguous()
    elif quant.scheme == "channel":
        scale = scale.reshape(n)
    else:
        scale = scale.reshape(-(-n // quant.block), -(-k // quant.block))
    input_scale = ckpt.get(inp).float().reshape(()) if inp in ckpt.files else None
    return Fp8Weight(values, scale, quant.block if quant.scheme == "block" else 0, input_scale)


def _stack_fp8(experts: list[Fp8Weight]) -> Fp8Weight:
    """Experts stored one by one as one [E, N, K] weight; static input scales merged to their
    largest, as the grouped GEMM quantizes every expert's input alike."""
    inputs = [e.input_scale for e in experts if e.input_scale is not None]
    input_scale = torch.stack(inputs).amax() if len(inputs) == len(experts) else None
    return Fp8Weight(torch.stack([e.values for e in experts]), torch.stack([e.scale for e in experts]),
                     experts[0].block, input_scale)


def quantize_online(weights: dict[str, torch.Tensor], quant: Quantization) -> dict[str, torch.Tensor]:
    """The block linears ``quant`` does not exclude, quantized to FP8 per output channel, in place
    (``weights`` itself, returned): each full-precision tensor is let go as its FP8 copy takes its
    place, so quantizing needs the full-precision model's memory plus one tensor's, not both
    models' (Nemotron-3-Nano's 63 GB of bf16 and 32 GB of FP8 on an 80 GB card)."""
    for name in list(weights):  # the names only: no second reference to any tensor
        if quantizable(name) and not quant.excludes(module_of(name)) and not isinstance(weights[name], Fp8Weight):
            weights[name] = quantize_fp8(weights[name], quant.block)
    return weights


def random_weights(cfg: ModelConfig, *, dtype: torch.dtype, device="cpu", seed: int = 0,
                   mtp: bool = False) -> dict[str, torch.Tensor]:
    """Random weights of the right shapes, made directly on ``device`` in ``dtype`` (an 8B model
    in fp32 does not fit a CPU machine), scaled so activations stay O(1) through many layers;
    ``mtp``: the MTP layers' (``mtp_weight_shapes``) instead."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in (mtp_weight_shapes(cfg) if mtp else weight_shapes(cfg)).items():
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
