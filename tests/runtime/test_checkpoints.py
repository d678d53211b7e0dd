"""Checkpoints read exactly, or refused with one line naming what is not read: quantized
weights, multimodal wrappers, mamba_ssm's own format, NVIDIA's attention_head_dim."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import VOCAB, save_tiny

from mambastep.runtime import weights as weights_module
from mambastep.runtime.config import ConfigError, ModelConfig
from mambastep.runtime.model import Model
from mambastep.runtime.weights import WeightError

from test_model import greedy, new_runner, prompts, step


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del cfg[key]
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("quant, named", [
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "ModelOpt NVFP4 (modelopt) weights are not read"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}, "ModelOpt MIXED_PRECISION"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"},
     "kv_cache_quant_algo: ModelOpt NVFP4 KV cache"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt: FP8 e5m2 weights are not read"),
    ({"quant_method": "fp8", "weight_block_size": [128, 64]}, "weight_block_size: square blocks"),
    ({"quant_method": "fp8", "activation_scheme": "per_group"}, "activation_scheme: expected dynamic or static"),
    ({"quant_method": "gptq", "bits": 4}, "gptq weights are not read"),
    ({"quant_method": "compressed-tensors"}, "compressed-tensors weights are not read"),
])
def test_a_quantization_config_is_refused_by_name(tmp_path, quant, named):
    """What is not FP8 (e4m3, per tensor, channel or square block) is refused before any weight is read."""
    save_tiny("nemotron_h", tmp_path)
    _edit_config(tmp_path, quantization_config=quant)
    with pytest.raises(ConfigError, match="quantization_config: " + named.replace("(", r"\(").replace(")", r"\)")):
        Model.from_pretrained(tmp_path, dtype=torch.float32)


def test_modelopt_hf_quant_config_beside_the_config_is_read(tmp_path):
    """ModelOpt's exports may keep the method in hf_quant_config.json only."""
    save_tiny("nemotron_h", tmp_path)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}}))
    with pytest.raises(ConfigError, match=r"quantization_config: ModelOpt NVFP4 \(modelopt\)"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                                             "exclude_modules": ["lm_head"]}}))
    quant = ModelConfig.from_pretrained(tmp_path).quantization
    assert (quant.scheme, quant.kv_cache, quant.exclude) == ("tensor", "fp8", ("lm_head",))


@pytest.mark.parametrize("dtype, shown", [(torch.float8_e4m3fn, "F8_E4M3"), (torch.uint8, "U8")])
def test_quantized_tensors_without_a_config_are_refused_before_any_is_read(tmp_path, monkeypatch, dtype, shown):
    """A float8 or packed weight (a quantization_config dropped): refused by name, and no tensor
    read, so nothing is half-loaded onto the device."""
    save_tiny("nemotron_h", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    victim = max(k for k in tensors if k.endswith("mixer.out_proj.weight"))  # the last Mamba2 layer's
    tensors[victim] = tensors[victim].to(dtype)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reads = []
    original = weights_module._Checkpoint.get
    monkeypatch.setattr(weights_module._Checkpoint, "get", lambda self, name: reads.append(name) or original(self, name))
    with pytest.raises(WeightError, match=rf"out_proj\.weight: stored as {shown} \(quantized weights\)"):
        Model.from_pretrained(tmp_path, dtype=torch.float32)
    assert reads == []


def test_scale_tensors_without_a_config_are_refused(tmp_path):
    save_tiny("nemotron_h", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mixer.in_proj.weight_scale"] = torch.ones(())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightError, match=r"in_proj\.weight_scale: a quantized checkpoint's scale tensor"):
        Model.from_pretrained(tmp_path, dtype=torch.float32)


def test_a_multimodal_wrapper_names_the_text_model_inside(tmp_path):
    save_tiny("nemotron_h", tmp_path)
    text = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "NemotronH_Nano_VL_V2", "architectures": ["NemotronH_Nano_VL_V2"], "llm_config": text}))
    with pytest.raises(ConfigError, match=r"text_config: a multimodal checkpoint .* around a 'nemotron_h' text model"):
        ModelConfig.from_pretrained(tmp_path)


@torch.no_grad()
def test_nvidia_attention_head_dim_is_read(tmp_path):
    """Nemotron-H's released configs name the attention head size attention_head_dim; with heads
    of 16 where hidden / heads is 8, the model loads and equals HF's (built with head_dim)."""
    hf = save_tiny("nemotron_h", tmp_path, head_dim=16)
    _edit_config(tmp_path, head_dim=None, attention_head_dim=16)
    ours = Model.from_pretrained(tmp_path, dtype=torch.float32)
    assert ours.cfg.attention_head_dim == 16
    hf.generation_config.eos_token_id = None
    for p, tokens in zip(prompts([5, 21]), greedy(ours, prompts([5, 21]), 8)):
        assert tokens == hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
    _edit_config(tmp_path, head_dim=8)
    with pytest.raises(ConfigError, match="head_dim: 8 disagrees with attention_head_dim: 16"):
        ModelConfig.from_pretrained(tmp_path)


def _as_mamba_ssm(hf_path, out, vocab_size: int):
    """An HF Mamba2 checkpoint rewritten in mamba_ssm's layout, as state-spaces/mamba2-* ship:
    MambaConfig fields, ``backbone.embedding``, and a pickled ``pytorch_model.bin``."""
    hf = json.loads((hf_path / "config.json").read_text())
    out.mkdir()
    (out / "config.json").write_text(json.dumps({
        "d_model": hf["hidden_size"], "d_intermediate": 0, "n_layer": hf["num_hidden_layers"],
        "vocab_size": vocab_size, "ssm_cfg": {"layer": "Mamba2", "d_state": hf["state_size"],
                                              "headdim": hf["head_dim"], "ngroups": hf["n_groups"],
                                              "chunk_size": hf["chunk_size"]},
        "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
        "pad_vocab_size_multiple": 16, "tie_embeddings": True}))
    tensors = {k.replace("backbone.embeddings.", "backbone.embedding."): v
               for k, v in load_file(hf_path / "model.safetensors").items()}
    tensors["lm_head.weight"] = tensors["backbone.embedding.weight"]
    torch.save(tensors, out / "pytorch_model.bin")


@torch.no_grad()
def test_mamba_ssm_checkpoints_are_read(tmp_path):
    """state-spaces/mamba2-*: mamba_ssm's config (its Mamba2 defaults, the vocabulary padded to
    pad_vocab_size_multiple) and pytorch_model.bin give HF's logits and greedy tokens."""
    hf = save_tiny("mamba2", tmp_path / "hf", n_groups=1)
    _as_mamba_ssm(tmp_path / "hf", tmp_path / "ssm", vocab_size=VOCAB - 7)  # padded back up to 96
    ours = Model.from_pretrained(tmp_path / "ssm", dtype=torch.float32)
    assert ours.cfg.vocab_size == VOCAB and ours.cfg.chunk_size == hf.config.chunk_size
    ps = prompts([1, 9, 21])
    ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in ps])
    torch.testing.assert_close(step(new_runner(ours), [(p, s, 0) for s, p in enumerate(ps)]), ref,
                               rtol=1e-4, atol=1e-4)
    hf.generation_config.eos_token_id = None
    for p, tokens in zip(ps, greedy(ours, ps, 8)):
        assert tokens == hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()


@pytest.mark.parametrize("change, named", [
    ({"ssm_cfg": {}}, "ssm_cfg.layer: 'Mamba1'"),
    ({"d_intermediate": 64}, "d_intermediate: 64"),
    ({"attn_layer_idx": [1]}, r"attn_layer_idx: \[1\]"),
    ({"ssm_cfg": {"layer": "Mamba2", "norm_before_gate": True}}, "ssm_cfg.norm_before_gate"),
])
def test_mamba_ssm_variants_not_read_are_named(tmp_path, change, named):
    save_tiny("mamba2", tmp_path / "hf", n_groups=1)
    _as_mamba_ssm(tmp_path / "hf", tmp_path / "ssm", vocab_size=VOCAB)
    _edit_config(tmp_path / "ssm", **change)
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_pretrained(tmp_path / "ssm")


@torch.no_grad()
def test_experts_stored_one_by_one_load_as_the_stack_and_a_misshaped_one_is_named(tmp_path):
    """Older NemotronH checkpoints store each expert's weight apart (experts.{j}.up_proj.weight):
    they load as the stacked tensor; one expert of the wrong shape is named, before any is read."""
    save_tiny("nemotron_h", tmp_path / "stacked")
    tensors = load_file(tmp_path / "stacked" / "model.safetensors")
    apart = {}
    for key, value in tensors.items():
        if key.endswith(("experts.up_proj", "experts.down_proj")):
            base, proj = key.rsplit(".", 1)
            apart.update({f"{base}.{j}.{proj}.weight": value[j].clone() for j in range(value.shape[0])})
        else:
            apart[key] = value
    (tmp_path / "apart").mkdir()
    (tmp_path / "apart" / "config.json").write_text((tmp_path / "stacked" / "config.json").read_text())
    save_file(apart, tmp_path / "apart" / "model.safetensors", metadata={"format": "pt"})
    plan = [(p, slot, 0) for slot, p in enumerate(prompts([5, 9]))]
    stacked = Model.from_pretrained(tmp_path / "stacked", dtype=torch.float32)
    one_by_one = Model.from_pretrained(tmp_path / "apart", dtype=torch.float32)
    assert torch.equal(step(new_runner(stacked), plan), step(new_runner(one_by_one), plan))
    victim = next(k for k in apart if k.endswith("experts.3.up_proj.weight"))
    apart[victim] = apart[victim][:, :-1].contiguous()
    save_file(apart, tmp_path / "apart" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightError, match=r"experts\.3\.up_proj\.weight: expected shape"):
        Model.from_pretrained(tmp_path / "apart", dtype=torch.float32)


@pytest.mark.parametrize("kind, change, named", [
    ("falcon_h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": True}, "mamba_norm_before_gate: true"),
    ("falcon_h1", {"projectors_bias": True}, "projectors_bias: true"),
    ("falcon_h1", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e11, "factor": 4.0}},
     "rope_parameters.rope_type: 'yarn'"),
    ("bamba", {"attn_rotary_emb": 8}, "attn_rotary_emb: 8 rotary dims"),
    ("granite", {"position_embedding_type": "alibi"}, "position_embedding_type: 'alibi'"),
    ("granite", {"model_type": "zamba2", "architectures": ["Zamba2ForCausalLM"]},
     "model_type: 'zamba2' is not read: Zamba2's attention blocks are shared"),
])
def test_family_variants_not_read_are_named(tmp_path, kind, change, named):
    """What a family's checkpoint may say that mambastep does not compute as HF does is refused
    in one line naming the field, before any weight is read."""
    save_tiny(kind, tmp_path)
    _edit_config(tmp_path, **change)
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_pretrained(tmp_path)


@torch.no_grad()
def test_bamba_gate_and_up_are_read_as_one_projection_and_a_misshaped_part_is_named(tmp_path):
    """Bamba's feed_forward.gate_proj and up_proj are read as one SwiGLU projection, the gate's
    rows first; parts that do not make the projection are named."""
    hf = save_tiny("bamba", tmp_path)
    ours = Model.from_pretrained(tmp_path, dtype=torch.float32)
    ff = hf.model.layers[0].feed_forward
    assert torch.equal(ours.blocks[1].mixer.up, torch.cat([ff.gate_proj.weight, ff.up_proj.weight]))
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.2.feed_forward.up_proj.weight"] = tensors["model.layers.2.feed_forward.up_proj.weight"][:-1]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    parts = r"model\.layers\.2\.feed_forward\.gate_proj\.weight \+ model\.layers\.2\.feed_forward\.up_proj\.weight"
    with pytest.raises(WeightError, match=r"layers\.5\.mixer\.up_proj\.weight: " + parts + " have 95 rows"):
        Model.from_pretrained(tmp_path, dtype=torch.float32)
