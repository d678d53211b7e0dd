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
}


def preset_config(name: str) -> ModelConfig:
    """The ModelConfig of a built-in preset; a clear error lists the names."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return ModelConfig(**PRESETS[name])
