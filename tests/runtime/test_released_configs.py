"""Tiny checkpoints in the layout of each released config.json (every field and value kept, only
sizes shrunk) generate HF's greedy tokens through the Engine, in fp32: prompts of 1, 33, 70 and
300 tokens, the long ones prefilled in chunks beside the others' decodes; on a GPU through the
Triton kernels and CUDA graphs."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, BambaConfig, BambaForCausalLM, FalconH1Config, FalconH1ForCausalLM,
                          GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, Mamba2Config, Mamba2ForCausalLM,
                          NemotronHConfig, NemotronHForCausalLM)

from hf_models import HF_5_23, HF_5_25, HF_LATENT_MOE, VOCAB, perturb

from mambastep import Engine, SamplingParams
from mambastep.graphs import BucketSet

INF = float("inf")
_NEMOTRON_H = dict(
    architectures=["NemotronHForCausalLM"], model_type="nemotron_h", attention_bias=False, attention_dropout=0.0,
    bos_token_id=1, chunk_size=16, conv_kernel=4, eos_token_id=2, expand=2, hidden_dropout=0.0,
    initializer_range=0.02, layer_norm_epsilon=1e-5, mamba_hidden_act="silu", mamba_proj_bias=False,
    mlp_bias=False, mlp_hidden_act="relu2", num_logits_to_keep=1, pad_token_id=0, rescale_prenorm_residual=True,
    residual_in_fp32=False, sliding_window=None, tie_word_embeddings=False, time_step_floor=1e-4,
    time_step_limit=[0.0, INF], time_step_max=0.1, time_step_min=0.001, use_bias=False, use_cache=True,
    use_conv_bias=True, use_mamba_kernels=True, vocab_size=VOCAB, torch_dtype="bfloat16",
)
_MOE = dict(n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1)
# ibm-granite/granite-4.0-h-*: every field of the released config.json but the sizes
_GRANITE = dict(
    architectures=["GraniteMoeHybridForCausalLM"], model_type="granitemoehybrid", attention_bias=False,
    attention_dropout=0.0, attention_multiplier=0.0078125, bos_token_id=0, embedding_multiplier=12,
    eos_token_id=0, hidden_act="silu", init_method="mup", initializer_range=0.1, logits_scaling=6,
    mamba_chunk_size=16, mamba_conv_bias=True, mamba_d_conv=4, mamba_d_head=8, mamba_d_state=16,
    mamba_expand=2, mamba_n_groups=1, mamba_n_heads=8, mamba_proj_bias=False, normalization_function="rmsnorm",
    output_router_logits=False, pad_token_id=0, position_embedding_type="nope", residual_multiplier=0.22,
    rms_norm_eps=1e-5, rope_scaling=None, rope_theta=10000, router_aux_loss_coef=0.0, tie_word_embeddings=True,
    torch_dtype="bfloat16", use_cache=True, vocab_size=VOCAB, hidden_size=32, num_attention_heads=4,
    num_key_value_heads=2, num_hidden_layers=6, layer_types=["mamba", "mamba", "attention", "mamba", "mamba", "mamba"],
    max_position_embeddings=131072,
)
# Each: the released config's layout; sizes shrunk (hidden 32, heads of 8, a few layers); the
# released name in the comment. HF reads only `head_dim` (default 128), NVIDIA's configs name it
# `attention_head_dim`: tiny configs give both where the release gives the latter.
RELEASED = {
    # nvidia/Nemotron-H-8B-Base-8K: attention_head_dim, hybrid_override_pattern, max 8k
    "nemotron-h-8b": dict(_NEMOTRON_H, hidden_size=32, hybrid_override_pattern="M-M*-M-", num_hidden_layers=7,
                          mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16,
                          num_attention_heads=4, num_key_value_heads=2, attention_head_dim=8, head_dim=8,
                          intermediate_size=48, max_position_embeddings=8192),
    # nvidia/NVIDIA-Nemotron-Nano-9B-v2: head_dim (not hidden / heads), mamba heads of 80 -> 10
    "nemotron-nano-9b-v2": dict(_NEMOTRON_H, hidden_size=40, hybrid_override_pattern="M-MM*-M-", num_hidden_layers=8,
                                mamba_num_heads=8, mamba_head_dim=10, n_groups=2, ssm_state_size=16,
                                num_attention_heads=5, num_key_value_heads=1, head_dim=16, intermediate_size=56,
                                max_position_embeddings=131072),
    # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B: MoE (top-6, routed scaling 2.5, one shared expert)
    "nemotron-3-nano-30b-a3b": dict(_NEMOTRON_H, **_MOE, hidden_size=32, hybrid_override_pattern="MEM*EME",
                                    num_hidden_layers=7, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
                                    ssm_state_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    n_routed_experts=16, num_experts_per_tok=6, moe_intermediate_size=16,
                                    moe_shared_expert_intermediate_size=32, max_position_embeddings=262144),
    # the larger Nemotron 3 (Super, Ultra): routed experts in a latent space, and MTP layers
    "nemotron-3-latent-mtp": dict(_NEMOTRON_H, **_MOE, hidden_size=32, hybrid_override_pattern="MEM*EME",
                                  num_hidden_layers=7, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
                                  ssm_state_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  n_routed_experts=16, num_experts_per_tok=6, moe_intermediate_size=16,
                                  moe_shared_expert_intermediate_size=32, moe_latent_size=16,
                                  num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E",
                                  max_position_embeddings=262144),
    # ibm-granite/granite-4.0-h-tiny: 64 experts top-6 -> 16 top-6, SwiGLU experts beside the shared MLP
    "granite-4.0-h-tiny": dict(_GRANITE, num_local_experts=16, num_experts_per_tok=6, intermediate_size=16,
                               shared_intermediate_size=32),
    # ibm-granite/granite-4.0-h-micro: dense, the shared MLP alone
    "granite-4.0-h-micro": dict(_GRANITE, num_local_experts=0, num_experts_per_tok=0, intermediate_size=48,
                                shared_intermediate_size=48, logits_scaling=8),
    # ibm-ai-platform/Bamba-9B: attention at layers 9, 18, 27 of 32 (-> 2 and 5 of 7), half of each head
    # rotated (attn_rotary_emb), rope_theta 10000, untied embeddings
    "bamba-9b": dict(architectures=["BambaForCausalLM"], model_type="bamba", attention_dropout=0.0,
                     attn_layer_indices=[2, 5], attn_rotary_emb=4, bos_token_id=1, eos_token_id=2,
                     hidden_act="silu", hidden_size=32, initializer_range=0.02, intermediate_size=48,
                     mamba_chunk_size=16, mamba_conv_bias=True, mamba_d_conv=4, mamba_d_head=8, mamba_d_state=16,
                     mamba_expand=2, mamba_n_groups=1, mamba_n_heads=8, mamba_proj_bias=False,
                     max_position_embeddings=262144, num_attention_heads=4, num_hidden_layers=7,
                     num_key_value_heads=2, num_logits_to_keep=1, pad_token_id=0, rms_norm_eps=1e-5,
                     rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True,
                     use_mamba_kernels=True, vocab_size=VOCAB, z_loss_coefficient=0.0),
    # tiiuae/Falcon-H1-0.5B-Instruct: Mamba2 of its own width beside rotary attention (theta 1e11)
    # in every layer, no gated norm, every muP multiplier as released
    "falcon-h1-0.5b": dict(architectures=["FalconH1ForCausalLM"], model_type="falcon_h1", attention_bias=False,
                           attention_dropout=0.0, attention_in_multiplier=1.0, attention_out_multiplier=0.9375,
                           bos_token_id=1, embedding_multiplier=5.656854249492381, eos_token_id=11, head_dim=8,
                           hidden_act="silu", hidden_size=32, initializer_range=0.02, intermediate_size=64,
                           key_multiplier=0.390625, lm_head_multiplier=0.0390625, mamba_chunk_size=16,
                           mamba_conv_bias=True, mamba_d_conv=4, mamba_d_head=8, mamba_d_ssm=48, mamba_d_state=16,
                           mamba_expand=2, mamba_n_groups=1, mamba_n_heads=6, mamba_norm_before_gate=False,
                           mamba_proj_bias=False, mamba_rms_norm=False, mamba_use_mlp=True,
                           max_position_embeddings=16384, mlp_bias=False, mlp_expansion_factor=8,
                           mlp_multipliers=[0.8838834764831844, 0.5859375], num_attention_heads=4,
                           num_hidden_layers=4, num_key_value_heads=2, num_logits_to_keep=1, pad_token_id=0,
                           projectors_bias=False, rms_norm_eps=1e-5, rope_scaling=None, rope_theta=1e11,
                           ssm_in_multiplier=1.25,
                           ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
                           ssm_out_multiplier=0.23570226039551587, tie_word_embeddings=False, torch_dtype="bfloat16",
                           use_cache=True, vocab_size=VOCAB),
    # tiiuae/Falcon-H1-34B-Instruct: as the 0.5B, but its Mamba2 gates and then RMS-normalises each
    # of its two groups (mamba_rms_norm), 5 query heads to a KV head, and its own multipliers
    "falcon-h1-34b": dict(architectures=["FalconH1ForCausalLM"], model_type="falcon_h1", attention_bias=False,
                          attention_dropout=0.0, attention_in_multiplier=1.0, attention_out_multiplier=0.0375,
                          attn_layer_indices=None, bos_token_id=1, embedding_multiplier=5.656854249492381,
                          eos_token_id=11, head_dim=8, hidden_act="silu", hidden_size=32, initializer_range=0.02,
                          intermediate_size=64, key_multiplier=0.011048543456039804,
                          lm_head_multiplier=0.0078125, mamba_chunk_size=16, mamba_conv_bias=True, mamba_d_conv=4,
                          mamba_d_head=8, mamba_d_ssm=64, mamba_d_state=16, mamba_expand=2, mamba_n_groups=2,
                          mamba_n_heads=8, mamba_norm_before_gate=False, mamba_proj_bias=False,
                          mamba_rms_norm=True, mamba_use_mlp=True, max_position_embeddings=262144, mlp_bias=False,
                          mlp_expansion_factor=8, mlp_multipliers=[0.1767766952966369, 0.011160714285714284],
                          num_attention_heads=10, num_hidden_layers=4, num_key_value_heads=2, num_logits_to_keep=1,
                          pad_token_id=0, projectors_bias=False, rms_norm_eps=1e-5, rope_scaling=None,
                          rope_theta=1e11, ssm_in_multiplier=0.25,
                          ssm_multipliers=[0.3535533905932738, 0.25, 0.1767766952966369, 0.5, 0.3535533905932738],
                          ssm_out_multiplier=0.08838834764831845, tie_word_embeddings=False,
                          torch_dtype="bfloat16", use_cache=True, vocab_size=VOCAB),
    # the HF conversion of state-spaces/mamba2-130m
    "mamba2-130m": dict(architectures=["Mamba2ForCausalLM"], model_type="mamba2", hidden_size=32, expand=2,
                        num_heads=8, head_dim=8, n_groups=1, state_size=16, conv_kernel=4, chunk_size=16,
                        num_hidden_layers=3, vocab_size=VOCAB, tie_word_embeddings=True, residual_in_fp32=True,
                        rms_norm=True, norm_before_gate=False, use_bias=False, use_conv_bias=True,
                        layer_norm_epsilon=1e-5, time_step_limit=[0.0, INF], time_step_min=0.001,
                        time_step_max=0.1, time_step_floor=1e-4, hidden_act="silu", bos_token_id=0,
                        eos_token_id=0, pad_token_id=0),
    # mistralai/Mamba-Codestral-7B-v0.1: groups (8 -> 2), no tied embeddings
    "codestral-mamba": dict(architectures=["Mamba2ForCausalLM"], model_type="mamba2", hidden_size=32, expand=2,
                            num_heads=8, head_dim=8, n_groups=2, state_size=16, conv_kernel=4, chunk_size=16,
                            num_hidden_layers=3, vocab_size=VOCAB, tie_word_embeddings=False,
                            residual_in_fp32=True, rms_norm=True, norm_before_gate=False, use_bias=False,
                            use_conv_bias=True, layer_norm_epsilon=1e-5, time_step_limit=[0.0, INF],
                            time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4, hidden_act="silu",
                            bos_token_id=0, eos_token_id=0, pad_token_id=0),
}
NEEDS = {
    "codestral-mamba": (HF_5_23, "HF's Mamba2 gated norm ignores n_groups before transformers 5.23"),
    "nemotron-3-latent-mtp": (HF_LATENT_MOE, "the installed transformers has no latent MoE"),
}
PROMPT_LENS = (1, 33, 70, 300)
NEW_TOKENS = 12
# 64-token prefill chunks: the 300-token prompt takes five steps, beside the others' decodes
BUCKETS = BucketSet(decode=(1, 2, 4), mixed_decode=(0, 2, 4), prefill=(16, 64), max_prefill_seqs=4)


def save_released(name: str, path) -> torch.nn.Module:
    """HF's model of the released layout, with random weights, saved to ``path`` under that
    layout's config.json (HF rewrites its own on save); returns the HF model read back from it."""
    fields = RELEASED[name]
    hf_cls, cfg_cls = {"mamba2": (Mamba2ForCausalLM, Mamba2Config),
                       "nemotron_h": (NemotronHForCausalLM, NemotronHConfig),
                       "granitemoehybrid": (GraniteMoeHybridForCausalLM, GraniteMoeHybridConfig),
                       "bamba": (BambaForCausalLM, BambaConfig),
                       "falcon_h1": (FalconH1ForCausalLM, FalconH1Config)}[fields["model_type"]]
    torch.manual_seed(0)
    model = hf_cls(cfg_cls(**{k: v for k, v in fields.items() if k not in ("architectures", "model_type")}))
    perturb(model)
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(fields, indent=2))
    if fields.get("num_nextn_predict_layers"):  # MTP tensors, as the releases ship them (HF ignores them)
        tensors = load_file(path / "model.safetensors")
        tensors["mtp.layers.0.mixer.q_proj.weight"] = torch.randn(32, 32)
        tensors["mtp.layers.1.mixer.experts.0.up_proj.weight"] = torch.randn(16, 32)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf


def prompts(vocab: int):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


_gpu = pytest.mark.gpu


@pytest.fixture(scope="module", params=[
    pytest.param((name, device), id=f"{name}-{device}", marks=[_gpu] if device == "cuda" else [])
    for device in ("cpu", "cuda") for name in RELEASED
])
def released(request, tmp_path_factory):
    name, device = request.param
    ok, why = NEEDS.get(name, (True, ""))
    if not ok:
        pytest.skip(why)
    if RELEASED[name]["model_type"] == "nemotron_h" and not HF_5_25:
        pytest.skip("NemotronH clamps prefill dt to time_step_limit from transformers 5.25")
    path = tmp_path_factory.mktemp(name)
    return save_released(name, path), path, device


@torch.no_grad()
def test_greedy_tokens_equal_hf(released):
    hf, path, device = released
    ps = prompts(hf.config.vocab_size)
    engine = Engine.from_pretrained(path, dtype=torch.float32, device=device, buckets=BUCKETS, num_slots=4,
                                    max_context=512, progress=False)
    assert (engine.capture_report is not None) == (device == "cuda")
    got = engine.generate(ps, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for p, tokens in zip(ps, got):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
        assert tokens == ref, f"prompt of {len(p)} tokens"
