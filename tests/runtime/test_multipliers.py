"""A family's multipliers folded into the weights: plain weights scaled and rounded once, FP8
weights through their scales (exact), and what cannot fold exactly refused."""

import dataclasses

import pytest
import torch

from mambastep.kernels.fp8 import quantize_fp8
from mambastep.runtime.multipliers import fold_multipliers
from mambastep.runtime.presets import preset_config
from mambastep.runtime.quantization import online_fp8
from mambastep.runtime.weights import quantize_online, random_weights


def _falcon():
    return preset_config("tiny-falcon-h1")


def test_falcon_multipliers_scale_the_projections_they_follow():
    cfg = _falcon()
    w = random_weights(cfg, dtype=torch.float32)
    folded = fold_multipliers(cfg, w)
    m = "layers.0.mixer."
    inner, gn, heads = cfg.mamba_inner, cfg.n_groups * cfg.ssm_state_size, cfg.mamba_num_heads
    rows = torch.cat([torch.full((n,), f) for n, f in zip((inner, inner, gn, gn, heads), cfg.ssm_multipliers)])
    torch.testing.assert_close(folded[m + "in_proj.weight"], w[m + "in_proj.weight"] * rows[:, None] * cfg.ssm_in_multiplier)
    torch.testing.assert_close(folded[m + "out_proj.weight"], w[m + "out_proj.weight"] * cfg.ssm_out_multiplier)
    torch.testing.assert_close(folded[m + "k_proj.weight"], w[m + "k_proj.weight"] * cfg.key_multiplier)
    torch.testing.assert_close(folded[m + "o_proj.weight"], w[m + "o_proj.weight"] * cfg.attention_out_multiplier)
    gate, down = cfg.mlp_multipliers
    up = w["layers.1.mixer.up_proj.weight"]
    I = cfg.intermediate_size
    torch.testing.assert_close(folded["layers.1.mixer.up_proj.weight"], torch.cat([up[:I] * gate, up[I:]]))
    torch.testing.assert_close(folded["layers.1.mixer.down_proj.weight"], w["layers.1.mixer.down_proj.weight"] * down)
    torch.testing.assert_close(folded["norm_f.weight"], w["norm_f.weight"] / cfg.logits_scaling)
    assert folded[m + "q_proj.weight"] is w[m + "q_proj.weight"]  # attention_in_multiplier is 1: untouched
    assert folded["embeddings.weight"] is w["embeddings.weight"]  # the gather applies its multiplier


def test_fp8_weights_fold_through_their_scales():
    """An FP8 weight's values stay as stored; its per-channel scales take the factors."""
    cfg = _falcon()
    w = quantize_online(random_weights(cfg, dtype=torch.float32), dataclasses.replace(online_fp8(()), exclude=()))
    folded = fold_multipliers(cfg, w)
    name = "layers.0.mixer.in_proj.weight"
    assert folded[name].values is w[name].values
    plain = fold_multipliers(cfg, {**w, name: w[name].dequantize()})[name]
    torch.testing.assert_close(folded[name].dequantize(), plain)


def test_a_factor_that_differs_inside_an_fp8_block_is_refused():
    cfg = dataclasses.replace(_falcon(), ssm_multipliers=(0.5, 0.25, 1.0, 1.0, 2.0))
    w = random_weights(cfg, dtype=torch.float32)
    name = "layers.0.mixer.in_proj.weight"
    blocked = {**w, name: quantize_fp8(w[name], 64)}  # z and x (96 rows each) share a 64-row block
    with pytest.raises(ValueError, match=r"layers\.0\.mixer\.in_proj\.weight: a multiplier that differs within a "
                                          "scale block"):
        fold_multipliers(cfg, blocked)


def test_granite_residual_multiplier_scales_every_block_output():
    cfg = preset_config("tiny-granite")
    w = random_weights(cfg, dtype=torch.float32)
    folded = fold_multipliers(cfg, w)
    r = cfg.residual_multiplier
    for name in ("layers.0.mixer.out_proj.weight", "layers.2.mixer.o_proj.weight", "layers.1.mixer.experts.down_proj",
                 "layers.1.mixer.shared_experts.down_proj.weight"):
        torch.testing.assert_close(folded[name], w[name] * r)
    assert folded["layers.1.mixer.experts.up_proj"] is w["layers.1.mixer.experts.up_proj"]


def test_online_fp8_keeps_parallel_blocks_whole():
    """Falcon-H1 quantized at load: its parallel blocks hold attention, so they stay in full
    precision, as NVIDIA's recipe keeps attention; its MLPs take FP8."""
    quant = online_fp8(_falcon().layer_types)
    assert quant.excludes("layers.0.mixer.in_proj") and quant.excludes("layers.2.mixer.q_proj")
    assert not quant.excludes("layers.1.mixer.up_proj")
