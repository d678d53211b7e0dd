"""Built-in model shapes, for benchmarks and tests without a checkpoint (weights are random).

Each preset is a plain dict of ``ModelConfig`` fields.
"""

from __future__ import annotations

from .config import ModelConfig

__all__ = ["PRESETS", "preset_config"]

_NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
# the hybrid_override_pattern of NVIDIA-Nemotron-3-Nano-30B-A3B and of NVIDIA-Nemotron-Nano-9B-v2
_NEMOTRON_3_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
_NEMOTRON_NANO_9B_V2_PATTERN = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
_KIND = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def _granite_blocks(attention: tuple[int, ...], layers: int, mlp: str) -> tuple[str, ...]:
    """A Granite-4.0-H layer pattern as blocks: each layer's mixer, then its MLP (or MoE) block."""
    return tuple(kind for i in range(layers) for kind in ("attention" if i in attention else "mamba", mlp))


# the released Granite-4.0-H configs' common fields: attention at layers 5, 15, 25 and 35 of 40,
# NoPE, one group, tied embeddings; muP multipliers of the releases' order (with random weights
# they change no timing)
_GRANITE = dict(
    architecture="granite_hybrid", vocab_size=100352, mamba_head_dim=64, ssm_state_size=128, n_groups=1,
    conv_kernel=4, chunk_size=256, attention_scale=0.0078125, mlp_activation="swiglu", moe_scoring="softmax",
    norm_topk_prob=False, embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=6.0,
    tie_word_embeddings=True,
    max_position_embeddings=131072, eos_token_id=100257,
)
_GRANITE_ATTENTION = (5, 15, 25, 35)

PRESETS: dict[str, dict] = {
    # A few-layer hybrid with every layer kind, small enough for CPU tests and the CPU default run.
    "tiny-hybrid": dict(
        architecture="nemotron_h", vocab_size=512, hidden_size=64,
        layer_types=("mamba", "attention", "mlp", "mamba", "moe", "mamba"),
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
        chunk_size=32,
        num_attention_heads=4, num_key_value_heads=2, attention_head_dim=16,
        intermediate_size=128, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=64,
        max_position_embeddings=4096, eos_token_id=2,
        # Nemotron 3's multi-token prediction layers (read only to draft with: runtime.mtp)
        mtp_layer_types=("attention", "moe"), mtp_depths=1,
    ),
    # A few Mamba2 layers: the pure-Mamba2 path (fused decode) at test size.
    "tiny-mamba2": dict(
        architecture="mamba2", vocab_size=512, hidden_size=64, layer_types=("mamba",) * 3,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
        chunk_size=32, tie_word_embeddings=True, residual_in_fp32=True,
        max_position_embeddings=4096, eos_token_id=0,
    ),
    # The hybrid without experts: the hybrid fused decode path (Mamba2, attention, MLP) at test size.
    "tiny-nemotron-h": dict(
        architecture="nemotron_h", vocab_size=512, hidden_size=64,
        layer_types=("mamba", "attention", "mlp", "mamba", "mlp", "mamba"),
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
        chunk_size=32,
        num_attention_heads=4, num_key_value_heads=2, attention_head_dim=16, intermediate_size=128,
        max_position_embeddings=4096, eos_token_id=2,
    ),
    # Granite-4.0-H's blocks at test size: Mamba2 and NoPE attention, each followed by softmax-
    # routed SwiGLU experts beside the shared SwiGLU MLP; the multipliers
    "tiny-granite": dict(
        _GRANITE, vocab_size=512, hidden_size=64, layer_types=_granite_blocks((1,), 3, "moe"),
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, chunk_size=32,
        num_attention_heads=4, num_key_value_heads=2, attention_head_dim=16, intermediate_size=64,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=64, max_position_embeddings=4096, eos_token_id=2,
    ),
    # Falcon-H1's blocks at test size: Mamba2 (no gated norm) beside rotary attention in every
    # layer, then a SwiGLU MLP; its muP multipliers
    "tiny-falcon-h1": dict(
        architecture="falcon_h1", vocab_size=512, hidden_size=64, layer_types=("parallel", "mlp") * 3,
        mamba_num_heads=6, mamba_head_dim=16, ssm_state_size=32, n_groups=1, conv_kernel=4, chunk_size=32,
        mamba_gated_norm=False, num_attention_heads=4, num_key_value_heads=2, attention_head_dim=16, rotary_dim=16,
        rope_theta=1e11, intermediate_size=96, mlp_activation="swiglu", embedding_multiplier=5.65,
        logits_scaling=1 / 0.0390625, ssm_in_multiplier=1.25, ssm_out_multiplier=0.2357,
        ssm_multipliers=(0.3535, 0.25, 0.3535, 0.5, 0.3535), key_multiplier=0.39, attention_out_multiplier=0.9375,
        mlp_multipliers=(0.8838, 0.5859), max_position_embeddings=4096, eos_token_id=2,
    ),
    "mamba2-130m": dict(
        architecture="mamba2", vocab_size=50288, hidden_size=768, layer_types=("mamba",) * 24,
        mamba_num_heads=24, mamba_head_dim=64, ssm_state_size=128, n_groups=1, conv_kernel=4,
        chunk_size=256, tie_word_embeddings=True, residual_in_fp32=True,
        max_position_embeddings=1 << 20, eos_token_id=0,
    ),
    "nemotron-h-8b": dict(
        architecture="nemotron_h", vocab_size=131072, hidden_size=4096,
        layer_types=tuple(_KIND[c] for c in _NEMOTRON_H_8B_PATTERN),
        mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
        chunk_size=128,
        num_attention_heads=32, num_key_value_heads=8, attention_head_dim=128,
        intermediate_size=21504, max_position_embeddings=8192, eos_token_id=2,
    ),
    # 52 layers: 23 Mamba2, 23 MoE (128 routed relu2 experts, top-6, sigmoid router scaled by
    # 2.5, one shared expert of twice the width), 6 attention (32 query, 2 KV heads)
    "nemotron-3-nano-30b-a3b": dict(
        architecture="nemotron_h", vocab_size=131072, hidden_size=2688,
        layer_types=tuple(_KIND[c] for c in _NEMOTRON_3_NANO_PATTERN),
        mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
        chunk_size=128,
        num_attention_heads=32, num_key_value_heads=2, attention_head_dim=128,
        n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, max_position_embeddings=262144, eos_token_id=2,
    ),
    # 56 layers: 27 Mamba2 (128 heads of 80), 25 MLP, 4 attention (40 query, 8 KV heads)
    "nemotron-nano-9b-v2": dict(
        architecture="nemotron_h", vocab_size=131072, hidden_size=4480,
        layer_types=tuple(_KIND[c] for c in _NEMOTRON_NANO_9B_V2_PATTERN),
        mamba_num_heads=128, mamba_head_dim=80, ssm_state_size=128, n_groups=8, conv_kernel=4,
        chunk_size=128,
        num_attention_heads=40, num_key_value_heads=8, attention_head_dim=128,
        intermediate_size=15680, max_position_embeddings=131072, eos_token_id=2,
    ),
    # ibm-granite/granite-4.0-h-micro: 3B dense; 40 layers (36 Mamba2, 4 attention), each with
    # the shared SwiGLU MLP
    "granite-4.0-h-micro": dict(
        _GRANITE, hidden_size=2048, layer_types=_granite_blocks(_GRANITE_ATTENTION, 40, "mlp"),
        mamba_num_heads=64, num_attention_heads=32, num_key_value_heads=8, attention_head_dim=64,
        intermediate_size=8192,
    ),
    # ibm-granite/granite-4.0-h-tiny: 7B, 1B active; 64 SwiGLU experts top-6 beside the shared MLP
    "granite-4.0-h-tiny": dict(
        _GRANITE, hidden_size=1536, layer_types=_granite_blocks(_GRANITE_ATTENTION, 40, "moe"),
        mamba_num_heads=48, num_attention_heads=12, num_key_value_heads=4, attention_head_dim=128,
        n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=6, moe_intermediate_size=512,
        moe_shared_expert_intermediate_size=1024,
    ),
    # ibm-granite/granite-4.0-h-small: 32B, 9B active; 72 SwiGLU experts top-10 beside the shared MLP
    "granite-4.0-h-small": dict(
        _GRANITE, hidden_size=4096, layer_types=_granite_blocks(_GRANITE_ATTENTION, 40, "moe"),
        mamba_num_heads=128, num_attention_heads=32, num_key_value_heads=8, attention_head_dim=128,
        n_routed_experts=72, n_shared_experts=1, num_experts_per_tok=10, moe_intermediate_size=768,
        moe_shared_expert_intermediate_size=1536,
    ),
    # ibm-ai-platform/Bamba-9B: 32 layers (29 Mamba2, attention at 9, 18 and 27 with half of each
    # head rotated), each followed by a SwiGLU MLP
    "bamba-9b": dict(
        architecture="bamba", vocab_size=128256, hidden_size=4096,
        layer_types=tuple(kind for i in range(32) for kind in ("attention" if i in (9, 18, 27) else "mamba", "mlp")),
        mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=1, conv_kernel=4, chunk_size=256,
        num_attention_heads=32, num_key_value_heads=8, attention_head_dim=128, rotary_dim=64, rope_theta=10000.0,
        intermediate_size=14336, mlp_activation="swiglu", max_position_embeddings=262144,
    ),
    # tiiuae/Falcon-H1-7B: 44 layers, each Mamba2 (24 heads of 128, d_state 256, its own width
    # 3072) beside rotary attention (12 query, 2 KV heads of 128), then a SwiGLU MLP (multipliers
    # left at 1: with random weights they change no timing)
    "falcon-h1-7b": dict(
        architecture="falcon_h1", vocab_size=130048, hidden_size=3072, layer_types=("parallel", "mlp") * 44,
        mamba_num_heads=24, mamba_head_dim=128, ssm_state_size=256, n_groups=1, conv_kernel=4, chunk_size=128,
        mamba_gated_norm=False, num_attention_heads=12, num_key_value_heads=2, attention_head_dim=128,
        rotary_dim=128, rope_theta=1e11, intermediate_size=12288, mlp_activation="swiglu",
        max_position_embeddings=262144,
    ),
    # tiiuae/Falcon-H1-34B-Instruct (its config.json): 72 layers, each Mamba2 (32 heads of 128, d_state
    # 256, two groups, gated and normalised per group) beside rotary attention (20 query, 4 KV heads of
    # 128), then a SwiGLU MLP of 21504; a 261120-token vocabulary, untied
    "falcon-h1-34b": dict(
        architecture="falcon_h1", vocab_size=261120, hidden_size=5120, layer_types=("parallel", "mlp") * 72,
        mamba_num_heads=32, mamba_head_dim=128, ssm_state_size=256, n_groups=2, conv_kernel=4, chunk_size=128,
        num_attention_heads=20, num_key_value_heads=4, attention_head_dim=128, rotary_dim=128, rope_theta=1e11,
        intermediate_size=21504, mlp_activation="swiglu", max_position_embeddings=262144,
    ),
}

# Nemotron 3.5 Lightning 30B-A3B: its published signature is Nano's (52 layers, hidden 2688, 128
# experts top-6 of 1856, a shared one of 3712) and one MTP depth, attention then MoE (HF's default
# kinds); its layer pattern is taken as Nano's
PRESETS["nemotron-3.5-lightning-30b-a3b"] = dict(PRESETS["nemotron-3-nano-30b-a3b"],
                                                 mtp_layer_types=("attention", "moe"), mtp_depths=1)


def preset_config(name: str) -> ModelConfig:
    """The ModelConfig of a built-in preset; a clear error lists the names."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return ModelConfig(**PRESETS[name])
