"""One flat, validated model config, read from an HF ``config.json`` or built from a preset.

Five HF architectures map onto it: ``Mamba2ForCausalLM`` (every layer a Mamba2 mixer),
``NemotronHForCausalLM`` (a hybrid pattern of Mamba2, attention, MLP and MoE layers),
``GraniteMoeHybridForCausalLM`` (Granite-4.0-H: each HF layer a Mamba2 or attention block, then
a SwiGLU MLP block, or a softmax-routed MoE block with a shared SwiGLU expert; muP multipliers)
``BambaForCausalLM`` (Bamba: each layer a Mamba2 or attention block with partial rotary
embeddings, then a SwiGLU MLP block) and ``FalconH1ForCausalLM`` (Falcon-H1: each layer a
``parallel`` block, Mamba2 and rotary attention side by side on one norm, then a SwiGLU MLP
block; muP multipliers); and mamba_ssm's own ``config.json`` (``d_model``, ``n_layer``, ``ssm_cfg``: the official
state-spaces/mamba2-* checkpoints). A block here is one (norm, mixer) pair: a Granite layer is
two. A ``quantization_config`` (or ModelOpt's
``hf_quant_config.json``) is read into ``quantization`` (``runtime.quantization``). What cannot be
read exactly (other quantization methods, other families, multimodal wrappers) is refused by name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from .quantization import Quantization, QuantizationError, parse_quantization

__all__ = ["ARCHITECTURES", "ConfigError", "LAYER_KINDS", "MLP_ACTIVATIONS", "MOE_SCORINGS", "ModelConfig"]

LAYER_KINDS = ("mamba", "attention", "mlp", "moe", "parallel")
# a kind whose block holds the mixers of other kinds (and their states)
_PARTS = {"parallel": ("mamba", "attention")}

# NemotronH's pattern characters and HF's layer type names, to our layer kinds.
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_HF_LAYER_TYPES = {
    "mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
    "full_attention": "attention", "mlp": "mlp", "moe": "moe",
}


# hybrid families known and not read, with what they would take (docs/ARCHITECTURE.md)
_NOT_READ = {
    "zamba2": "Zamba2's attention blocks are shared across layers, each use adapted by a LoRA of its own and "
              "fed the original embeddings beside the residual stream; mambastep's blocks own their weights",
    "jamba": "Jamba's Mamba layers are Mamba-1 (a selective scan with per-channel dt), not Mamba2",
}


class ConfigError(ValueError):
    """A config field is missing, unsupported or inconsistent; the message names the field."""


# the architectures (checkpoint families) a config comes from: how their tensors are named
# (``runtime.checkpoint_names``) and how their norms round
ARCHITECTURES = ("mamba2", "nemotron_h", "granite_hybrid", "bamba", "falcon_h1")
# what follows an MLP's (or expert's) up projection: NemotronH's relu(x)^2, or SwiGLU's
# silu(gate) * up over an up projection twice as wide (gate rows first)
MLP_ACTIVATIONS = ("relu2", "swiglu")
# how a MoE router scores experts: NemotronH's sigmoid, Granite's softmax over the top-k logits
MOE_SCORINGS = ("sigmoid", "softmax")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str  # one of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    residual_in_fp32: bool = False
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    max_position_embeddings: int = 4096
    # Mamba2 mixer
    mamba_num_heads: int = 0
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 256
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    # prefill dt is clamped to this range (config.json's time_step_limit), decode dt is not, as in HF
    dt_limit: tuple[float, float] = (0.0, math.inf)
    # the output y * silu(z) is RMS-normed in groups before out_proj (Falcon-H1: not)
    mamba_gated_norm: bool = True
    # attention (GQA, no rotary embedding: NemotronH, Granite-4.0-H)
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    attention_head_dim: int = 0
    attention_bias: bool = False
    # the softmax scale; None: attention_head_dim ** -0.5 (Granite's attention_multiplier)
    attention_scale: float | None = None
    # rotary embedding of the first rotary_dim dims of each query and key head (0: none), HF's
    # default frequencies at rope_theta
    rotary_dim: int = 0
    rope_theta: float = 10000.0
    # dense MLP
    intermediate_size: int = 0
    mlp_bias: bool = False
    mlp_activation: str = "relu2"  # of the MLP, the experts and the shared expert: MLP_ACTIVATIONS
    # mixture of experts (NemotronH: sigmoid router with group-limited top-k)
    moe_scoring: str = "sigmoid"
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # routed experts in a smaller latent space (None: the hidden size), as the larger Nemotron 3
    moe_latent_size: int | None = None
    # muP multipliers (Granite): the embeddings are scaled by the first, every block's output by
    # the second before its residual add, and the logits divided by the third
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Falcon-H1's: the Mamba2 input and output scaled, and its in_proj's z, x, B, C and dt columns
    # each by one of ssm_multipliers; attention's input, keys and output; the MLP's gate and output
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)
    attention_in_multiplier: float = 1.0
    key_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    mlp_multipliers: tuple[float, ...] = (1.0, 1.0)
    # how the block linears are stored (runtime.quantization); None: as the activations
    quantization: Quantization | None = None
    # multi-token prediction (Nemotron 3's MTP layers, a drafter for speculative decoding,
    # ``runtime.mtp``): the block kinds of one depth, and the depths the checkpoint holds (0: none)
    mtp_layer_types: tuple[str, ...] = ()
    mtp_depths: int = 0

    def __post_init__(self):
        for f in fields(self):
            _check_type(f.name, f.type, getattr(self, f.name))
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"architecture: unsupported {self.architecture!r}")
        for name, allowed in (("mlp_activation", MLP_ACTIVATIONS), ("moe_scoring", MOE_SCORINGS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}: expected one of {allowed}, got {getattr(self, name)!r}")
        if self.logits_scaling == 0 or (self.attention_scale is not None and self.attention_scale <= 0):
            raise ConfigError("logits_scaling and attention_scale: must be nonzero and positive")
        bad = [t for t in self.layer_types if t not in LAYER_KINDS]
        if bad or not self.layer_types:
            raise ConfigError(f"layer_types: expected a non-empty list of {LAYER_KINDS}, got {bad or 'none'}")
        for name in ("vocab_size", "hidden_size"):
            _positive(self, name)
        bad = [t for t in self.mtp_layer_types if t not in LAYER_KINDS]
        if bad or (self.mtp_depths > 0) != bool(self.mtp_layer_types) or self.mtp_depths < 0:
            raise ConfigError(f"mtp_layers_block_type: expected {self.mtp_depths} depth(s) of {LAYER_KINDS}, got "
                              f"{list(self.mtp_layer_types)}")
        if len(self.ssm_multipliers) != 5 or len(self.mlp_multipliers) != 2:
            raise ConfigError(f"ssm_multipliers and mlp_multipliers: expected 5 and 2 numbers, got "
                              f"{list(self.ssm_multipliers)} and {list(self.mlp_multipliers)}")
        if self.has("mamba"):
            for name in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "chunk_size"):
                _positive(self, name)
            if self.mamba_num_heads % self.n_groups:
                raise ConfigError(f"n_groups: {self.n_groups} does not divide mamba_num_heads={self.mamba_num_heads}")
            if self.conv_kernel < 2:
                raise ConfigError(f"conv_kernel: must be at least 2, got {self.conv_kernel}")
            if not 0 <= self.dt_limit[0] <= self.dt_limit[1]:
                raise ConfigError(f"dt_limit: expected 0 <= low <= high, got {self.dt_limit}")
        if self.has("attention"):
            for name in ("num_attention_heads", "num_key_value_heads", "attention_head_dim"):
                _positive(self, name)
            if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.attention_head_dim or self.rope_theta <= 0:
                raise ConfigError(f"rotary_dim: expected an even number of dims up to the head's "
                                  f"{self.attention_head_dim} and a positive rope_theta, got {self.rotary_dim}, "
                                  f"{self.rope_theta}")
            if self.num_attention_heads % self.num_key_value_heads:
                raise ConfigError(
                    f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                    f"num_attention_heads={self.num_attention_heads}"
                )
        if self.has("mlp"):
            _positive(self, "intermediate_size")
        if self.has("moe"):
            for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
                _positive(self, name)
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ConfigError("num_experts_per_tok: exceeds n_routed_experts")
            if (self.n_routed_experts % self.n_group or not 1 <= self.topk_group <= self.n_group
                    or self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group)):
                raise ConfigError(f"n_group/topk_group: {self.num_experts_per_tok} of {self.n_routed_experts} "
                                  f"experts in {self.topk_group} of {self.n_group} groups do not fit")
            if self.moe_scoring == "softmax" and (self.n_group, self.topk_group, self.routed_scaling_factor) != (1, 1, 1):
                raise ConfigError(f"n_group/topk_group/routed_scaling_factor: a softmax router takes no groups and no "
                                  f"routed scale, got {self.n_group}, {self.topk_group}, {self.routed_scaling_factor}")
            if self.moe_latent_size is not None and self.moe_latent_size < 1:
                raise ConfigError(f"moe_latent_size: must be positive or null, got {self.moe_latent_size}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def mtp_config(self) -> "ModelConfig":
        """The MTP layers' blocks as a model of their own: these fields, the MTP's block kinds. Their
        keys and values stay in the activations' dtype where the target's cache is FP8 (the
        checkpoint's KV scales are the backbone's attention layers')."""
        if not self.mtp_layer_types:
            raise ConfigError("num_nextn_predict_layers: the checkpoint has no multi-token prediction layers")
        quant = self.quantization and replace(self.quantization, kv_cache=None)
        return replace(self, layer_types=self.mtp_layer_types, mtp_layer_types=(), mtp_depths=0, quantization=quant)

    @property
    def mamba_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_inner + 2 * self.n_groups * self.ssm_state_size

    @property
    def in_proj_dim(self) -> int:
        return self.mamba_inner + self.conv_dim + self.mamba_num_heads

    def layers_of(self, kind: str) -> list[int]:
        """The blocks with a mixer of ``kind``: of that kind, or holding one (a parallel block
        is a Mamba2 and an attention layer both)."""
        return [i for i, t in enumerate(self.layer_types) if t == kind or kind in _PARTS.get(t, ())]

    def has(self, kind: str) -> bool:
        """Whether any block has a mixer of ``kind`` (as ``layers_of``)."""
        return bool(self.layers_of(kind))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read ``config.json`` from a checkpoint directory (or the file itself)."""
        path = Path(path)
        path = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise ConfigError(f"config.json: not found at {path}")
        try:
            hf = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: unreadable ({e})") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
        modelopt = path.parent / "hf_quant_config.json"  # ModelOpt's exports carry it beside config.json
        if modelopt.exists() and isinstance(hf, dict) and "quantization_config" not in hf:
            try:
                quant = json.loads(modelopt.read_text()).get("quantization", {})
            except (OSError, ValueError, AttributeError):
                quant = {}
            hf = {**hf, "quantization_config": {"quant_method": "modelopt", **quant}}
        try:
            return cls.from_hf_dict(hf)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "ModelConfig":
        if not isinstance(hf, dict):
            raise ConfigError(f"expected a JSON object of config fields, got a {type(hf).__name__}")
        quant = hf.get("quantization_config")
        try:
            quantization = None if quant is None else parse_quantization(quant)
        except QuantizationError as e:
            raise ConfigError(f"quantization_config: {e}") from None
        cfg = cls._architecture(hf)
        return cfg if quantization is None else replace(cfg, quantization=quantization)

    @classmethod
    def _architecture(cls, hf: dict) -> "ModelConfig":
        model_type = hf.get("model_type")
        archs = hf.get("architectures") or []
        if model_type == "mamba2" or "Mamba2ForCausalLM" in archs:
            return cls._from_mamba2(hf)
        if model_type == "nemotron_h" or "NemotronHForCausalLM" in archs:
            return cls._from_nemotron_h(hf)
        if model_type == "granitemoehybrid" or "GraniteMoeHybridForCausalLM" in archs:
            return cls._from_granite_hybrid(hf)
        if model_type == "bamba" or "BambaForCausalLM" in archs:
            return cls._from_bamba(hf)
        if model_type == "falcon_h1" or "FalconH1ForCausalLM" in archs:
            return cls._from_falcon_h1(hf)
        if model_type is None and "d_model" in hf and "n_layer" in hf:
            return cls._from_mamba_ssm(hf)
        if model_type in _NOT_READ:
            raise ConfigError(f"model_type: {model_type!r} is not read: {_NOT_READ[model_type]}")
        inner = hf.get("text_config") or hf.get("llm_config")
        if isinstance(inner, dict):
            name = inner.get("model_type") or (inner.get("architectures") or [None])[0]
            raise ConfigError(f"text_config: a multimodal checkpoint ({model_type!r}, architectures {archs}) "
                              f"around a {name!r} text model; mambastep reads text-only checkpoints: "
                              "use the text model's own release")
        raise ConfigError(
            f"model_type: unsupported {model_type!r} (architectures {archs}); "
            "mambastep reads Mamba2ForCausalLM, NemotronHForCausalLM, GraniteMoeHybridForCausalLM, BambaForCausalLM "
            "and FalconH1ForCausalLM checkpoints, and mamba_ssm's Mamba2"
        )

    @classmethod
    def _from_mamba2(cls, hf: dict) -> "ModelConfig":
        _require(hf, "hidden_size", "num_heads", "head_dim", "vocab_size", "num_hidden_layers")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act: only silu is supported, got {hf['hidden_act']!r}")
        if hf.get("rms_norm", True) is not True:
            raise ConfigError("rms_norm: only the gated RMSNorm variant is supported")
        if hf["hidden_size"] * hf.get("expand", 2) != hf["num_heads"] * hf["head_dim"]:
            raise ConfigError("expand: hidden_size * expand must equal num_heads * head_dim")
        return cls(
            architecture="mamba2",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            layer_types=("mamba",) * hf["num_hidden_layers"],
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            residual_in_fp32=hf.get("residual_in_fp32", True),
            eos_token_id=_first(hf.get("eos_token_id")),
            pad_token_id=hf.get("pad_token_id"),
            max_position_embeddings=hf.get("max_position_embeddings", 1 << 20),
            mamba_num_heads=hf["num_heads"],
            mamba_head_dim=hf["head_dim"],
            ssm_state_size=hf.get("state_size", 128),
            n_groups=hf.get("n_groups", 1),
            conv_kernel=hf.get("conv_kernel", 4),
            chunk_size=hf.get("chunk_size", 256),
            use_conv_bias=hf.get("use_conv_bias", True),
            mamba_proj_bias=hf.get("use_bias", False),
            dt_limit=_pair("time_step_limit", hf.get("time_step_limit", (0.0, math.inf))),
        )

    @classmethod
    def _from_nemotron_h(cls, hf: dict) -> "ModelConfig":
        _require(hf, "hidden_size", "vocab_size")
        layer_types = _nemotron_layer_types(hf)
        for key, want in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
            if hf.get(key, want) != want:
                raise ConfigError(f"{key}: only {want} is supported, got {hf[key]!r}")
        if hf.get("sliding_window"):
            raise ConfigError("sliding_window: sliding-window attention is not supported")
        mamba_heads = hf.get("mamba_num_heads", 128)
        head_dim = hf.get("mamba_head_dim", 64)
        attn_heads = hf.get("num_attention_heads", 32)
        return cls(
            architecture="nemotron_h",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            layer_types=layer_types,
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            residual_in_fp32=hf.get("residual_in_fp32", False),
            eos_token_id=_first(hf.get("eos_token_id")),
            pad_token_id=hf.get("pad_token_id"),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            mamba_num_heads=mamba_heads,
            mamba_head_dim=head_dim,
            ssm_state_size=hf.get("ssm_state_size", 128),
            n_groups=hf.get("n_groups", hf.get("mamba_n_groups", 8)),
            conv_kernel=hf.get("conv_kernel", hf.get("mamba_d_conv", 4)),
            chunk_size=hf.get("chunk_size", 128),
            use_conv_bias=hf.get("use_conv_bias", True),
            mamba_proj_bias=hf.get("mamba_proj_bias", False),
            # prefill dt is clamped to time_step_limit, as HF (from 5.25), mamba_ssm and vLLM do;
            # time_step_min only sets dt_bias's initial range (HF up to 5.24 clamped at it instead)
            dt_limit=_pair("time_step_limit", hf.get("time_step_limit", hf.get("mamba_dt_limit", (0.0, math.inf)))),
            num_attention_heads=attn_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or attn_heads,
            attention_head_dim=_attention_head_dim(hf),
            attention_bias=hf.get("attention_bias", False),
            intermediate_size=hf.get("intermediate_size", 21504),
            mlp_bias=hf.get("mlp_bias", False),
            n_routed_experts=hf.get("n_routed_experts", 8),
            n_shared_experts=hf.get("n_shared_experts", 1),
            num_experts_per_tok=hf.get("num_experts_per_tok", 2),
            moe_intermediate_size=hf.get("moe_intermediate_size", 7688),
            moe_shared_expert_intermediate_size=hf.get("moe_shared_expert_intermediate_size", 7688),
            n_group=hf.get("n_group", 1),
            topk_group=hf.get("topk_group", 1),
            norm_topk_prob=hf.get("norm_topk_prob", True),
            routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
            moe_latent_size=hf.get("moe_latent_size"),
            **_nemotron_mtp(hf),
        )

    @classmethod
    def _from_granite_hybrid(cls, hf: dict) -> "ModelConfig":
        """Granite-4.0-H. Each HF layer is two blocks here: its Mamba2 or attention mixer (norm:
        ``input_layernorm``; the released models' attention has no positional embedding, HF's
        ``position_embedding_type="rope"`` rotates whole heads), then its MLP
        (``post_attention_layernorm``): the shared SwiGLU MLP, or with ``num_local_experts`` a
        softmax-routed MoE with that MLP as its shared expert."""
        _require(hf, "hidden_size", "vocab_size", "num_hidden_layers")
        _silu(hf)
        position = hf.get("position_embedding_type")
        if position not in (None, "nope", "rope"):
            raise ConfigError(f"position_embedding_type: {position!r}; expected none, \"nope\" or \"rope\"")
        layers = hf["num_hidden_layers"]
        # the released configs say mamba / attention, HF (5.x) saves linear_ / full_attention
        named = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * layers
        mixers = [_HF_LAYER_TYPES.get(t) for t in named]
        unknown = sorted({t for t, kind in zip(named, mixers) if kind not in ("mamba", "attention")})
        if unknown or len(mixers) != layers:
            raise ConfigError(f"layer_types: expected {layers} of 'mamba' and 'attention', got "
                              f"{len(mixers)} with {unknown or 'no unknown kinds'}")
        experts = hf.get("num_local_experts", 8) or 0
        mlp = "moe" if experts else "mlp"
        head_dim = hf["hidden_size"] // hf.get("num_attention_heads", 32)
        shared = hf.get("shared_intermediate_size", 1024)
        return cls(
            architecture="granite_hybrid",
            layer_types=tuple(kind for mixer in mixers for kind in (mixer, mlp)),
            **_common_fields(hf, norm_eps=1e-6, max_positions=2048),
            **_mamba_fields(hf),
            **_attention_fields(hf, head_dim),
            attention_scale=_float("attention_multiplier", hf.get("attention_multiplier", 1.0)),
            rotary_dim=head_dim if position == "rope" else 0,
            rope_theta=_rope_theta(hf) if position == "rope" else 10000.0,
            intermediate_size=shared,
            mlp_activation="swiglu",
            moe_scoring="softmax",
            n_routed_experts=experts,
            n_shared_experts=1 if experts else 0,
            num_experts_per_tok=hf.get("num_experts_per_tok", 2) if experts else 0,
            moe_intermediate_size=hf.get("intermediate_size", 11008) if experts else 0,
            moe_shared_expert_intermediate_size=shared,
            norm_topk_prob=False,
            embedding_multiplier=_float("embedding_multiplier", hf.get("embedding_multiplier", 1.0)),
            residual_multiplier=_float("residual_multiplier", hf.get("residual_multiplier", 1.0)),
            logits_scaling=_float("logits_scaling", hf.get("logits_scaling", 1.0)),
        )

    @classmethod
    def _from_bamba(cls, hf: dict) -> "ModelConfig":
        """Bamba. Each HF layer is two blocks here: its Mamba2 or attention mixer (norm:
        ``input_layernorm``; attention at ``attn_layer_indices``, rotary over half of each head as
        HF fixes it), then its SwiGLU MLP (``pre_ff_layernorm``)."""
        _require(hf, "hidden_size", "vocab_size", "num_hidden_layers")
        _silu(hf)
        layers = hf["num_hidden_layers"]
        attention = set(hf.get("attn_layer_indices") or [])
        if not attention <= set(range(layers)):
            raise ConfigError(f"attn_layer_indices: {sorted(attention)} are not all layers of {layers}")
        head_dim = hf["hidden_size"] // hf.get("num_attention_heads", 32)
        rotary = int(head_dim * 0.5)  # HF's Bamba fixes partial_rotary_factor at 0.5
        if hf.get("attn_rotary_emb", rotary) != rotary:
            raise ConfigError(f"attn_rotary_emb: {hf['attn_rotary_emb']} rotary dims, but HF's Bamba rotates half of "
                              f"each {head_dim}-dim head ({rotary}); mambastep reads it as HF does")
        return cls(
            architecture="bamba",
            layer_types=tuple(kind for i in range(layers)
                              for kind in ("attention" if i in attention else "mamba", "mlp")),
            **_common_fields(hf, norm_eps=1e-5, max_positions=262144),
            **_mamba_fields(hf),
            **_attention_fields(hf, head_dim),
            rotary_dim=rotary,
            rope_theta=_rope_theta(hf),
            intermediate_size=hf.get("intermediate_size", 14336),
            mlp_bias=hf.get("mlp_bias", False),
            mlp_activation="swiglu",
        )

    @classmethod
    def _from_falcon_h1(cls, hf: dict) -> "ModelConfig":
        """Falcon-H1. Each HF layer is two blocks here: a parallel block (norm:
        ``input_layernorm``), its Mamba2 mixer and its attention (rotary over whole heads) summed,
        then its SwiGLU MLP (``pre_ff_layernorm``); the muP multipliers fold into the weights
        (``runtime.multipliers``). The Mamba2 mixer gates its output by silu(z) alone
        (``mamba_rms_norm`` false: 0.5B to 7B) or, as Mamba2 does, gates and then RMS-normalises
        each group (true: 34B)."""
        _require(hf, "hidden_size", "vocab_size", "num_hidden_layers")
        _silu(hf)
        gated_norm = bool(hf.get("mamba_rms_norm", False))
        if gated_norm and hf.get("mamba_norm_before_gate", False):
            raise ConfigError("mamba_norm_before_gate: true (Falcon-H1's Mamba2 norm before its gate); mambastep "
                              "reads the released models' false: gate, then normalise")
        for key in ("projectors_bias", "mamba_proj_bias"):
            if hf.get(key, False):
                raise ConfigError(f"{key}: true; mambastep reads Falcon-H1's Mamba2 projections without biases, as "
                                  "released")
        layers = hf["num_hidden_layers"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf.get("num_attention_heads", 32)
        params = hf.get("rope_parameters") or {}
        rotary = int(head_dim * params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
        return cls(
            architecture="falcon_h1",
            layer_types=("parallel", "mlp") * layers,
            **_common_fields(hf, norm_eps=1e-5, max_positions=8192),
            **_mamba_fields(hf),
            mamba_gated_norm=gated_norm,
            **_attention_fields(hf, head_dim),
            rotary_dim=rotary,
            rope_theta=_rope_theta(hf),
            intermediate_size=hf.get("intermediate_size", 14336),
            mlp_bias=hf.get("mlp_bias", False),
            mlp_activation="swiglu",
            embedding_multiplier=_float("embedding_multiplier", hf.get("embedding_multiplier", 1.0)),
            logits_scaling=1.0 / _float("lm_head_multiplier", hf.get("lm_head_multiplier", 1.0)),
            ssm_in_multiplier=_float("ssm_in_multiplier", hf.get("ssm_in_multiplier", 1.0)),
            ssm_out_multiplier=_float("ssm_out_multiplier", hf.get("ssm_out_multiplier", 1.0)),
            ssm_multipliers=_floats("ssm_multipliers", hf.get("ssm_multipliers") or [1.0] * 5),
            attention_in_multiplier=_float("attention_in_multiplier", hf.get("attention_in_multiplier", 1.0)),
            key_multiplier=_float("key_multiplier", hf.get("key_multiplier", 1.0)),
            attention_out_multiplier=_float("attention_out_multiplier", hf.get("attention_out_multiplier", 1.0)),
            mlp_multipliers=_floats("mlp_multipliers", hf.get("mlp_multipliers") or [1.0, 1.0]),
        )

    @classmethod
    def _from_mamba_ssm(cls, hf: dict) -> "ModelConfig":
        """mamba_ssm's MambaConfig (the official state-spaces/mamba2-* checkpoints), with the
        defaults of its Mamba2 module where ``ssm_cfg`` names none."""
        ssm = hf.get("ssm_cfg") or {}
        if ssm.get("layer", "Mamba1") != "Mamba2":
            raise ConfigError(f"ssm_cfg.layer: {ssm.get('layer', 'Mamba1')!r} (mamba_ssm's default is Mamba1); "
                              "mambastep reads Mamba2 layers")
        for key, supported in (("d_intermediate", 0), ("attn_layer_idx", [])):
            if hf.get(key, supported) not in (supported, None):
                raise ConfigError(f"{key}: {hf[key]!r}; mambastep reads mamba_ssm checkpoints of Mamba2 layers only")
        for key, supported in (("rmsnorm", True), ("norm_before_gate", False), ("D_has_hdim", False)):
            if ssm.get(key, supported) != supported:
                raise ConfigError(f"ssm_cfg.{key}: only {supported} is supported, got {ssm[key]!r}")
        if hf.get("rms_norm", True) is not True:
            raise ConfigError("rms_norm: only RMSNorm blocks are supported")
        d_model, expand, head_dim = hf["d_model"], ssm.get("expand", 2), ssm.get("headdim", 64)
        if ssm.get("d_ssm") not in (None, d_model * expand):
            raise ConfigError(f"ssm_cfg.d_ssm: {ssm['d_ssm']} (a Mamba2 narrower than d_model * expand is not supported)")
        _require(hf, "vocab_size")
        pad = hf.get("pad_vocab_size_multiple", 8)
        vocab = hf["vocab_size"] + (-hf["vocab_size"] % pad)  # mamba_ssm pads the embedding table
        if d_model * expand % head_dim:
            raise ConfigError(f"ssm_cfg.headdim: {head_dim} does not divide d_model * expand = {d_model * expand}")
        return cls(
            architecture="mamba2",
            vocab_size=vocab,
            hidden_size=d_model,
            layer_types=("mamba",) * hf["n_layer"],
            norm_eps=1e-5,
            tie_word_embeddings=hf.get("tie_embeddings", True),
            residual_in_fp32=hf.get("residual_in_fp32", True),
            mamba_num_heads=d_model * expand // head_dim,
            mamba_head_dim=head_dim,
            ssm_state_size=ssm.get("d_state", 128),
            n_groups=ssm.get("ngroups", 1),
            conv_kernel=ssm.get("d_conv", 4),
            chunk_size=ssm.get("chunk_size", 256),
            use_conv_bias=ssm.get("conv_bias", True),
            mamba_proj_bias=ssm.get("bias", False),
            dt_limit=_pair("ssm_cfg.dt_limit", ssm.get("dt_limit", (0.0, math.inf))),
        )


def _silu(hf: dict) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: only silu is supported, got {hf['hidden_act']!r}")


def _common_fields(hf: dict, *, norm_eps: float, max_positions: int) -> dict:
    """The fields every family names alike (Granite's, Bamba's and Falcon-H1's names), with the
    family's defaults for the norm's epsilon and the context."""
    return dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], norm_eps=hf.get("rms_norm_eps", norm_eps),
        tie_word_embeddings=hf.get("tie_word_embeddings", False), eos_token_id=_first(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"), max_position_embeddings=hf.get("max_position_embeddings", max_positions),
    )


def _attention_fields(hf: dict, head_dim: int) -> dict:
    heads = hf.get("num_attention_heads", 32)
    return dict(num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
                attention_head_dim=head_dim, attention_bias=hf.get("attention_bias", False))


def _mamba_fields(hf: dict) -> dict:
    """The Mamba2 mixer's fields as Bamba's config names them (Granite-4.0-H's and Falcon-H1's too)."""
    # the mixer's width: Falcon-H1 names it (mamba_d_ssm), the others take mamba_expand * hidden_size
    inner = hf.get("mamba_d_ssm") or hf.get("mamba_expand", 2) * hf["hidden_size"]
    heads = hf.get("mamba_n_heads", 128)
    head_dim = hf.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = inner // heads
    if head_dim * heads != inner:
        raise ConfigError(f"mamba_d_head: mamba_n_heads * mamba_d_head must equal the Mamba2 width {inner} "
                          "(mamba_d_ssm, or mamba_expand * hidden_size)")
    return dict(
        mamba_num_heads=heads, mamba_head_dim=head_dim, ssm_state_size=hf.get("mamba_d_state", 256),
        n_groups=hf.get("mamba_n_groups", 1), conv_kernel=hf.get("mamba_d_conv", 4),
        chunk_size=hf.get("mamba_chunk_size", 256), use_conv_bias=hf.get("mamba_conv_bias", True),
        mamba_proj_bias=hf.get("mamba_proj_bias", False),
        dt_limit=_pair("time_step_limit", hf.get("time_step_limit") or (0.0, math.inf)),
    )


def _rope_theta(hf: dict) -> float:
    """The rotary base of HF's default rope (``rope_parameters``, or the older ``rope_theta`` and
    ``rope_scaling``); a scaled rope is refused by name."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ConfigError(f"rope_parameters.rope_type: {kind!r}; mambastep reads the default rotary embedding only")
    return _float("rope_theta", params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _attention_head_dim(hf: dict) -> int:
    """``head_dim`` (HF's name) or ``attention_head_dim`` (NVIDIA's); both default to 128."""
    names = [n for n in ("head_dim", "attention_head_dim") if hf.get(n) is not None]
    values = {hf[n] for n in names}
    if len(values) > 1:
        raise ConfigError(f"head_dim: {hf['head_dim']} disagrees with attention_head_dim: {hf['attention_head_dim']}")
    return values.pop() if values else 128


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and not (isinstance(v, float) and math.isnan(v))


# a field's annotation -> (what a value must be, in words)
_TYPE_CHECKS = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "int": (_is_int, "an integer"),
    "int | None": (lambda v: v is None or _is_int(v), "an integer or null"),
    "float": (_is_real, "a number"),
    "float | None": (lambda v: v is None or _is_real(v), "a number or null"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "tuple[str, ...]": (lambda v: isinstance(v, tuple) and all(isinstance(t, str) for t in v), "a list of names"),
    "tuple[float, float]": (lambda v: isinstance(v, tuple) and len(v) == 2 and all(map(_is_real, v)),
                            "a pair of numbers"),
    "tuple[float, ...]": (lambda v: isinstance(v, tuple) and all(map(_is_real, v)), "a list of numbers"),
    "Quantization | None": (lambda v: v is None or isinstance(v, Quantization), "a Quantization or null"),
}


def _check_type(name: str, annotation: str, value) -> None:
    ok, expected = _TYPE_CHECKS[annotation]
    if not ok(value):
        raise ConfigError(f"{name}: expected {expected}, got {value!r}")


def _nemotron_layer_types(hf: dict) -> tuple[str, ...]:
    return _block_kinds(hf, "layers_block_type", "hybrid_override_pattern")


def _block_kinds(hf: dict, names_key: str, pattern_key: str, default_pattern: str | None = None) -> tuple[str, ...]:
    """Block kinds as a NemotronH config gives them: HF's names listed under ``names_key``, or
    the characters of the pattern under ``pattern_key`` (older configs; ``default_pattern``
    where neither is there)."""
    if hf.get(names_key):
        types = hf[names_key]
        unknown = [t for t in types if t not in _HF_LAYER_TYPES]
        if unknown:
            raise ConfigError(f"{names_key}: unknown layer types {unknown}")
        return tuple(_HF_LAYER_TYPES[t] for t in types)
    pattern = hf.get(pattern_key) or default_pattern
    if not pattern:
        raise ConfigError(f"{names_key}: missing (nor {pattern_key})")
    unknown = sorted(set(pattern) - set(_PATTERN))
    if unknown:
        raise ConfigError(f"{pattern_key}: unknown layer characters {unknown}")
    return tuple(_PATTERN[c] for c in pattern)


def _nemotron_mtp(hf: dict) -> dict:
    """The MTP fields of a NemotronH config: ``num_nextn_predict_layers`` depths, each of the
    kinds ``mtp_layers_block_type`` lists (HF's names) or, in older configs,
    ``mtp_hybrid_override_pattern`` spells (default: attention, then MoE, as HF's)."""
    depths = hf.get("num_nextn_predict_layers") or 0
    if not _is_int(depths) or depths < 0:
        raise ConfigError(f"num_nextn_predict_layers: expected an int >= 0, got {depths!r}")
    if depths == 0:
        return {}
    kinds = _block_kinds(hf, "mtp_layers_block_type", "mtp_hybrid_override_pattern", default_pattern="*E")
    return {"mtp_layer_types": kinds, "mtp_depths": depths}


def _require(hf: dict, *keys: str) -> None:
    for key in keys:
        if hf.get(key) is None:
            raise ConfigError(f"{key}: missing from config.json")


def _positive(cfg: ModelConfig, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}: must be a positive integer, got {value!r}")


def _float(name: str, value) -> float:
    """A float from config.json, where HF writes infinity as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected a number, got {value!r}") from None


def _floats(name: str, values) -> tuple[float, ...]:
    if not isinstance(values, (list, tuple)):
        raise ConfigError(f"{name}: expected a list of numbers, got {values!r}")
    return tuple(_float(name, v) for v in values)


def _pair(name: str, value) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"{name}: expected [low, high], got {value!r}")
    return _float(name, value[0]), _float(name, value[1])


def _first(token_id):
    return token_id[0] if isinstance(token_id, list) and token_id else token_id
