"""Tiny random HF checkpoints of each architecture, saved with save_pretrained, and a tiny
byte-level BPE tokenizer to save beside one."""

import inspect
import json

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import (BambaConfig, BambaForCausalLM, FalconH1Config, FalconH1ForCausalLM, GraniteMoeHybridConfig,
                          GraniteMoeHybridForCausalLM, Mamba2Config, Mamba2ForCausalLM, NemotronHConfig,
                          NemotronHForCausalLM)

VOCAB = 96
# HF's Mamba2 gated norm ignores n_groups before transformers 5.23 (the GPU image has 5.17), so
# grouped Mamba2 checkpoints are only compared where HF computes them right; NemotronH covers
# groups everywhere. Tests that drive HF's layer-level APIs directly need 5.23 too.
HF_5_23 = Version(transformers.__version__) >= Version("5.23")
MAMBA2_GROUPS = 2 if HF_5_23 else 1
# NemotronH clamps prefill dt to time_step_limit from transformers 5.25, as mambastep does; before,
# it clamped at time_step_min, so older versions are no oracle for it (.ci/gpu carries 5.25)
HF_5_25 = Version(transformers.__version__) >= Version("5.25")
# routed experts in a latent space (moe_latent_size), where the installed NemotronH has them
HF_LATENT_MOE = "fc1_latent_proj" in inspect.getsource(transformers.models.nemotron_h.modeling_nemotron_h.NemotronHMoE)


def mamba2_config(**kw):
    base = dict(
        hidden_size=32, expand=2, num_heads=8, head_dim=8, n_groups=MAMBA2_GROUPS, state_size=16, conv_kernel=4,
        chunk_size=8, num_hidden_layers=3, vocab_size=VOCAB, tie_word_embeddings=True,
        residual_in_fp32=True, eos_token_id=0, pad_token_id=0, bos_token_id=0,
    )
    return Mamba2Config(**{**base, **kw})


def nemotron_h_config(**kw):
    base = dict(
        hidden_size=32, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16,
        conv_kernel=4, chunk_size=8, vocab_size=VOCAB,
        layers_block_type=["mamba", "attention", "mlp", "mamba", "moe", "attention", "mamba"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1,
        # the released configs' dt range: time_step_min 1e-3 sets dt_bias's initial range and
        # time_step_limit [0, inf] the clamp, so a clamp at time_step_min fails (DESIGN.md)
        time_step_min=1e-3, time_step_limit=(0.0, float("inf")), eos_token_id=0, pad_token_id=0, bos_token_id=0,
    )
    return NemotronHConfig(**{**base, **kw})


def granite_config(**kw):
    """Granite-4.0-H-tiny's fields and values (its muP multipliers, NoPE attention, one group,
    tied embeddings, softmax-routed SwiGLU experts beside the shared MLP), sizes shrunk;
    ``num_local_experts=0`` is the dense micro's layout."""
    base = dict(
        hidden_size=32, num_hidden_layers=6, layer_types=["mamba", "attention", "mamba", "mamba", "attention", "mamba"],
        mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=8, mamba_conv_bias=True, mamba_proj_bias=False, time_step_limit=(0.0, float("inf")),
        num_attention_heads=4, num_key_value_heads=2, attention_bias=False, position_embedding_type="nope",
        intermediate_size=16, shared_intermediate_size=48, num_local_experts=8, num_experts_per_tok=3,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=6.0,
        rms_norm_eps=1e-5, hidden_act="silu", vocab_size=VOCAB, tie_word_embeddings=True, initializer_range=0.1,
        eos_token_id=0, pad_token_id=0, bos_token_id=0,
    )
    return GraniteMoeHybridConfig(**{**base, **kw})


def bamba_config(**kw):
    """Bamba-9B's fields and values (attention at a few layers with half of each head rotated,
    SwiGLU MLPs, one group, untied embeddings), sizes shrunk."""
    base = dict(
        hidden_size=32, num_hidden_layers=6, attn_layer_indices=[1, 4], mamba_n_heads=8, mamba_d_head=8,
        mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
        mamba_conv_bias=True, mamba_proj_bias=False, time_step_limit=(0.0, float("inf")), num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, rms_norm_eps=1e-5, hidden_act="silu", vocab_size=VOCAB,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=0, pad_token_id=0, bos_token_id=0,
    )
    return BambaConfig(**{**base, **kw})


def falcon_h1_config(**kw):
    """Falcon-H1's fields and values (a Mamba2 width of its own, mamba_d_ssm; no gated norm; every
    muP multiplier, here at values of the releases' order; rotary over whole heads at a large
    theta; head_dim given), sizes shrunk."""
    base = dict(
        hidden_size=32, num_hidden_layers=4, mamba_d_ssm=48, mamba_n_heads=6, mamba_d_head=8, mamba_n_groups=1,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, mamba_conv_bias=True,
        mamba_proj_bias=False, mamba_rms_norm=False, mamba_norm_before_gate=False, projectors_bias=False,
        time_step_limit=(0.0, float("inf")), num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=48, rms_norm_eps=1e-5, hidden_act="silu", vocab_size=VOCAB, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e11}, embedding_multiplier=5.65,
        lm_head_multiplier=0.0390625, mlp_multipliers=[0.8838, 0.5859], key_multiplier=0.39,
        attention_in_multiplier=1.0, attention_out_multiplier=0.9375, ssm_in_multiplier=1.25,
        ssm_out_multiplier=0.2357, ssm_multipliers=[0.3535, 0.25, 0.3535, 0.5, 0.3535],
        eos_token_id=0, pad_token_id=0, bos_token_id=0,
    )
    return FalconH1Config(**{**base, **kw})


_MODELS = {"mamba2": (Mamba2ForCausalLM, mamba2_config), "nemotron_h": (NemotronHForCausalLM, nemotron_h_config),
           "granite": (GraniteMoeHybridForCausalLM, granite_config), "bamba": (BambaForCausalLM, bamba_config),
           "falcon_h1": (FalconH1ForCausalLM, falcon_h1_config)}


def save_tiny(kind: str, path, seed: int = 0, **kw):
    """Build a tiny random model of ``kind`` ("mamba2", "nemotron_h", "granite", "bamba" or "falcon_h1"), perturb the
    parameters HF initialises to constants (so the test sees them), save it to ``path`` and return it."""
    if kind == "nemotron_h" and not HF_5_25:
        pytest.skip(f"transformers {transformers.__version__} clamps NemotronH's prefill dt at time_step_min")
    torch.manual_seed(seed)
    model_class, config = _MODELS[kind]
    model = model_class(config(**kw))
    perturb(model)
    model.save_pretrained(path)
    return model


@torch.no_grad()
def perturb(model) -> None:
    """Perturb the parameters HF initialises to constants (so a test sees them), spread dt as
    trained models do, and give the router and experts weights large enough that expert choices
    differ between tokens."""
    for name, p in model.named_parameters():
        if name.endswith("dt_bias"):
            # dt spread log-uniformly over [1e-5, 1e-1], as in trained models, whose long-memory
            # heads sit far below time_step_min (HF's initial range, [1e-3, 1e-1], hides a clamp)
            dt = torch.exp(torch.empty_like(p).uniform_(-11.5, -2.3))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif name.endswith((".D", "norm.weight", "norm_f.weight", "conv1d.bias", "e_score_correction_bias",
                            "proj.bias")):  # a projection's bias, where the config asks for one
            p.add_(0.1 * torch.randn_like(p))
        elif name.endswith(("gate.weight", "router.weight", "experts.up_proj", "experts.gate_up_proj",
                            "experts.down_proj")):
            p.normal_(0, 0.3)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(0, 0.1)
    model.eval()


TEXT_VOCAB = 300  # a byte-level BPE: 256 bytes, 2 special tokens, merges
CORPUS = ["the cat sat on the mat", "héllo wörld, ça va?", "数据 和 模型", "emoji 🙂 and more 🙂",
          "the quick brown fox jumps over the lazy dog"] * 20
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[sys] {{ m['content'] }}\n"
                 "{% else %}<{{ m['role'] }}> {{ m['content'] | trim }}{{ eos_token }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant> {% endif %}")


def save_tokenizer(path):
    """A tiny byte-level BPE trained on CORPUS, saved as tokenizer.json with a tokenizer_config.json
    (bos, eos and a chat template) beside it; returns the tokenizers.Tokenizer."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TEXT_VOCAB, special_tokens=["<|endoftext|>", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "<|endoftext|>", "special": True},
        "chat_template": CHAT_TEMPLATE}))
    return tok


def save_text_checkpoint(path):
    """A tiny NemotronH checkpoint of TEXT_VOCAB tokens with the tiny tokenizer beside it; returns
    the HF model."""
    hf = save_tiny("nemotron_h", path, vocab_size=TEXT_VOCAB)
    save_tokenizer(path)
    return hf
