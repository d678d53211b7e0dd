"""Where a family's checkpoint keeps each tensor the model reads.

The model's names (``runtime.weights``) are NemotronH's, without the ``model.``/``backbone.``
prefix: ``embeddings.weight``, ``layers.{i}.norm.weight``, ``layers.{i}.mixer.<tensor>``,
``norm_f.weight``, ``lm_head.weight``, where block i is one (norm, mixer) pair. Mamba2 and
NemotronH checkpoints use them as they are. In Granite-4.0-H and Bamba a layer is two blocks,
2L and 2L + 1: its Mamba2 (``mamba.``) or attention (``self_attn.``) mixer after
``input_layernorm``, then its MLP:

- Granite: after ``post_attention_layernorm``, the shared SwiGLU MLP (``shared_mlp.input_linear``,
  gate rows first, and ``output_linear``), with a routed MoE beside it in the MoE sizes, stored
  as IBM wrote it (``block_sparse_moe.input_linear`` ...) or as HF transformers 5 renames it
  (``block_sparse_moe.experts.gate_up_proj`` ...);
- Bamba: after ``pre_ff_layernorm``, ``feed_forward``'s gate_proj and up_proj (read as one
  projection, the gate's rows first) and down_proj; the final norm is ``final_layernorm``.

Falcon-H1 is laid out as Bamba, but its first block of a layer is a parallel one, holding both
the layer's ``mamba.`` and ``self_attn.`` tensors.
"""

from __future__ import annotations

import re

from .config import ModelConfig

__all__ = ["checkpoint_names"]

# a tensor's sources: alternatives tried in order, each the names of the tensors that, stacked
# along their first dimension, make it
Sources = tuple[tuple[str, ...], ...]

_BAMBA_TOP = {"embeddings.weight": "embed_tokens.weight", "norm_f.weight": "final_layernorm.weight"}
_TOP = {"granite_hybrid": {"embeddings.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight"},
        "bamba": _BAMBA_TOP, "falcon_h1": _BAMBA_TOP}
_MIXER = {"mamba": "mamba.", "attention": "self_attn."}
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_NORM = {"granite_hybrid": "post_attention_layernorm.weight", "bamba": "pre_ff_layernorm.weight",
             "falcon_h1": "pre_ff_layernorm.weight"}
_GRANITE_MLP = {
    "up_proj.weight": (("shared_mlp.input_linear.weight",),),
    "down_proj.weight": (("shared_mlp.output_linear.weight",),),
    "shared_experts.up_proj.weight": (("shared_mlp.input_linear.weight",),),
    "shared_experts.down_proj.weight": (("shared_mlp.output_linear.weight",),),
    "gate.weight": (("block_sparse_moe.router.layer.weight",), ("block_sparse_moe.router.weight",)),
    "experts.up_proj": (("block_sparse_moe.input_linear.weight",), ("block_sparse_moe.experts.gate_up_proj",)),
    "experts.down_proj": (("block_sparse_moe.output_linear.weight",), ("block_sparse_moe.experts.down_proj",)),
}
_BAMBA_MLP = {
    "up_proj.weight": (("feed_forward.gate_proj.weight", "feed_forward.up_proj.weight"),),
    "up_proj.bias": (("feed_forward.gate_proj.bias", "feed_forward.up_proj.bias"),),
    "down_proj.weight": (("feed_forward.down_proj.weight",),),
    "down_proj.bias": (("feed_forward.down_proj.bias",),),
}
_MLP = {"granite_hybrid": _GRANITE_MLP, "bamba": _BAMBA_MLP, "falcon_h1": _BAMBA_MLP}
_BLOCK = re.compile(r"layers\.(\d+)\.(norm\.weight|mixer\.(.+))")


def checkpoint_names(cfg: ModelConfig, name: str) -> Sources:
    """Where ``cfg``'s family stores the model's tensor ``name`` (names without a ``model.``
    prefix), the first alternative tried first; errors name its first tensor."""
    family = cfg.architecture
    if family not in _TOP:
        return ((name,),)
    if name in _TOP[family]:
        return ((_TOP[family][name],),)
    block = _BLOCK.fullmatch(name)
    if block is None:
        return ((name,),)
    i, tensor = int(block[1]), block[3]
    layer = f"layers.{i // 2}."
    if tensor is None:  # the block's norm
        return ((layer + ("input_layernorm.weight" if i % 2 == 0 else _MLP_NORM[family]),),)
    kind = cfg.layer_types[i]
    if kind == "parallel":
        kind = "attention" if tensor.split(".")[0] in _ATTENTION else "mamba"
    if kind in _MIXER:
        return ((layer + _MIXER[kind] + tensor,),)
    sources = _MLP[family].get(tensor, ((tensor,),))
    return tuple(tuple(layer + part for part in parts) for parts in sources)
