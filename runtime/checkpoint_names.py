"""Where a family's checkpoint keeps each tensor the model reads.

The model's names (``runtime.weights``) are NemotronH's, without the ``model.``/``backbone.``
prefix: ``embeddings.weight``, ``layers.{i}.norm.weight``, ``layers.{i}.mixer.<tensor>``,
``norm_f.weight``, ``lm_head.weight``, where block i is one (norm, mixer) pair. Mamba2 and
NemotronH checkpoints use them as they are. A Granite-4.0-H layer is two blocks, 2L and 2L + 1:
its Mamba2 (``mamba.``) or attention (``self_attn.``) mixer after ``input_layernorm``, then its
MLP after ``post_attention_layernorm``: the shared SwiGLU MLP (``shared_mlp.input_linear``, gate
rows first, and ``output_linear``), with a routed MoE beside it in the MoE sizes, stored as IBM
wrote it (``block_sparse_moe.input_linear`` ...) or as HF transformers 5 renames it
(``block_sparse_moe.experts.gate_up_proj`` ...).
"""

from __future__ import annotations

import re

from .config import ModelConfig

__all__ = ["checkpoint_names"]

_GRANITE_TOP = {"embeddings.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight"}
_GRANITE_MIXER = {"mamba": "mamba.", "attention": "self_attn."}
# the MLP block's tensors: each one's names in the checkpoint, in the order they are tried
_GRANITE_MLP = {
    "up_proj.weight": ("shared_mlp.input_linear.weight",),
    "down_proj.weight": ("shared_mlp.output_linear.weight",),
    "shared_experts.up_proj.weight": ("shared_mlp.input_linear.weight",),
    "shared_experts.down_proj.weight": ("shared_mlp.output_linear.weight",),
    "gate.weight": ("block_sparse_moe.router.layer.weight", "block_sparse_moe.router.weight"),
    "experts.up_proj": ("block_sparse_moe.input_linear.weight", "block_sparse_moe.experts.gate_up_proj"),
    "experts.down_proj": ("block_sparse_moe.output_linear.weight", "block_sparse_moe.experts.down_proj"),
}
_BLOCK = re.compile(r"layers\.(\d+)\.(norm\.weight|mixer\.(.+))")


def checkpoint_names(cfg: ModelConfig, name: str) -> tuple[str, ...]:
    """The names (without a ``model.`` prefix) under which ``cfg``'s family stores the model's
    tensor ``name``, first the one to try first; the first of them is the one errors name."""
    if cfg.architecture != "granite_hybrid":
        return (name,)
    if name in _GRANITE_TOP:
        return (_GRANITE_TOP[name],)
    block = _BLOCK.fullmatch(name)
    if block is None:
        return (name,)
    i, tensor = int(block[1]), block[3]
    layer = f"layers.{i // 2}."
    if tensor is None:  # the block's norm
        return (layer + ("input_layernorm.weight" if i % 2 == 0 else "post_attention_layernorm.weight"),)
    kind = cfg.layer_types[i]
    if kind in _GRANITE_MIXER:
        return (layer + _GRANITE_MIXER[kind] + tensor,)
    return tuple(layer + source for source in _GRANITE_MLP.get(tensor, (tensor,)))
