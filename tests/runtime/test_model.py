"""mambastep's model, loaded through its own checkpoint loader, equals HF transformers (CPU, fp32)."""

import dataclasses
import json
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import HF_LATENT_MOE, VOCAB, save_tiny
from mambastep.graphs import Bucket, BucketSet
from mambastep.runtime.config import ConfigError, ModelConfig
from mambastep.runtime import multipliers
from mambastep.runtime.decode_options import DecodeOptions
from mambastep.runtime.mixers import Mixer
from mambastep.runtime.mixers import attention as attention_mixer
from mambastep.runtime.model import Model
from mambastep.runtime.plan import StepPlan
from mambastep.runtime.presets import preset_config
from mambastep.runtime.state_pool import StatePool
from mambastep.runtime.step_runner import StepRunner
from mambastep.runtime.weights import WeightError, load_weights, random_weights
from support import assert_close

KINDS = ["mamba2", "nemotron_h", "granite", "bamba", "falcon_h1"]
PROMPT_LENS = [1, 7, 8, 9, 21]


def prompts(lens=PROMPT_LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lens]


# Checkpoints beside the two architectures' defaults: many experts (empty ones at every step,
# group-limited choice), and experts in a latent space, where the installed HF implements it.
MOE = dict(layers_block_type=["mamba", "moe", "attention", "moe", "mamba", "moe"], n_routed_experts=16,
           num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5)
# Granite-4.0-H: MoE (tiny, small) and dense (micro)
GRANITE_DENSE = {"num_local_experts": 0}
VARIANTS = {"mamba2": ("mamba2", {}), "nemotron_h": ("nemotron_h", {}), "moe": ("nemotron_h", MOE),
            "latent_moe": ("nemotron_h", {**MOE, "moe_latent_size": 16}), "granite": ("granite", {}),
            "granite_dense": ("granite", GRANITE_DENSE),
            "granite_rope": ("granite", {"position_embedding_type": "rope"}),
            "bamba": ("bamba", {}), "falcon_h1": ("falcon_h1", {}),
            # Falcon-H1-34B: its Mamba2 gates, then normalises each of its two groups
            "falcon_h1_norm": ("falcon_h1", {"mamba_rms_norm": True, "mamba_n_groups": 2}),
            # attention's biases beside Mamba2's projections without: the joint projections' biases
            "falcon_h1_bias": ("falcon_h1", {"attention_bias": True})}
_gpu = pytest.mark.gpu
_latent = pytest.mark.skipif(not HF_LATENT_MOE, reason="the installed transformers has no latent MoE")


@pytest.fixture(scope="module", params=[
    "mamba2", "nemotron_h", "moe", pytest.param("latent_moe", marks=_latent), "granite", "granite_dense",
    "granite_rope", "bamba", "falcon_h1", "falcon_h1_norm", "falcon_h1_bias",
    # on a GPU, fp32 through the Triton kernels (the grouped experts among them)
    pytest.param("moe@cuda", marks=_gpu), pytest.param("latent_moe@cuda", marks=[_gpu, _latent]),
    pytest.param("granite@cuda", marks=_gpu), pytest.param("bamba@cuda", marks=_gpu),
    pytest.param("falcon_h1@cuda", marks=_gpu), pytest.param("falcon_h1_norm@cuda", marks=_gpu),
])
def pair(request, tmp_path_factory):
    """(HF model, our model loaded from the HF checkpoint) for each checkpoint variant."""
    name, _, device = request.param.partition("@")
    kind, kw = VARIANTS[name]
    path = tmp_path_factory.mktemp(name)
    hf = save_tiny(kind, path, **kw)
    return hf, Model.from_pretrained(path, dtype=torch.float32, device=device or "cpu")


# Small buckets, so steps are padded (rows, tokens and sequences) as they are on a GPU.
BUCKETS = BucketSet(decode=(1, 2, 4, 8), mixed_decode=(0, 2, 8), prefill=(16, 32, 64), max_prefill_seqs=6)


def new_runner(model, slots=8):
    pool = StatePool(model.cfg, slots, max_context=96, dtype=model.dtype, device=model.device)
    return StepRunner(model, pool, BUCKETS, max_prefill_tokens=96)


def step(runner, prefill=(), decode=()):
    """Logits of one step: prefill = [(ids, slot, context)], decode = [(id, slot, context)]."""
    return runner.logits(StepPlan.make(prefill, decode)).clone()


def greedy(model, prompt_list, n_new):
    """Prefill every prompt in one step, then decode them together, greedily."""
    runner = new_runner(model, len(prompt_list))
    logits = step(runner, [(p, slot, 0) for slot, p in enumerate(prompt_list)])
    out = [[t] for t in logits.argmax(-1).tolist()]
    lens = [len(p) for p in prompt_list]
    for _ in range(n_new - 1):
        logits = step(runner, decode=[(o[-1], slot, n) for slot, (o, n) in enumerate(zip(out, lens))])
        lens = [n + 1 for n in lens]
        for o, t in zip(out, logits.argmax(-1).tolist()):
            o.append(t)
    return out


@torch.no_grad()
def test_prefill_logits_match_hf(pair):
    hf, ours = pair
    ps = prompts()
    runner = new_runner(ours)
    plan = StepPlan.make([(p, slot, 0) for slot, p in enumerate(ps)])
    bucket = Bucket(0, 64)
    runner.buffers.fill(plan, bucket)
    runner.buffers.upload()
    # logits at every position of every prompt, not just the last
    inputs = dataclasses.replace(runner.buffers.inputs(bucket),
                                 logit_rows=torch.arange(plan.num_prefill_tokens, device=ours.device))
    logits = ours.forward(inputs, runner.pool)
    ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in ps])
    assert_close(logits.cpu(), ref)


@torch.no_grad()
def test_greedy_tokens_match_hf_generate(pair):
    hf, ours = pair
    ps = prompts(seed=1)
    got = greedy(ours, ps, 32)
    # no stop token: HF must generate all 32 tokens, as our loop does
    hf.generation_config.eos_token_id = None
    for p, tokens in zip(ps, got):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)
        assert tokens == ref[0, len(p):].tolist()


@torch.no_grad()
def test_chunked_prefill_equals_one_prefill(pair):
    _, ours = pair
    p = prompts([29], seed=2)[0]
    whole = step(new_runner(ours), [(p, 3, 0)])
    runner = new_runner(ours)
    for start, end in ((0, 5), (5, 17), (17, 29)):
        last = step(runner, [(p[start:end], 3, start)])
    assert_close(last, whole)


@torch.no_grad()
def test_mixed_step_equals_separate_steps(pair):
    """One forward with prompts in prefill and others in decode equals running them apart."""
    _, ours = pair
    a, b, c = prompts([11, 6, 17], seed=3)
    mixed, apart = new_runner(ours), new_runner(ours)
    for runner in (mixed, apart):
        step(runner, [(a, 0, 0), (b, 5, 0)])
    decode = [(7, 0, 11), (9, 5, 6)]
    both = step(mixed, [(c, 2, 0)], decode)
    alone_prefill = step(apart, [(c, 2, 0)])
    alone_decode = step(apart, decode=decode)
    assert_close(both, torch.cat([alone_prefill, alone_decode]))
    for x, y in zip(mixed.pool.tensors(), apart.pool.tensors()):
        assert_close(x, y)


# Nemotron-H without experts (for bf16 comparisons, where near-tied expert choices may flip)
DENSE_HYBRID = ["mamba", "attention", "mlp", "mamba", "mlp", "attention", "mamba"]


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_fused_decode_equals_layer_by_layer(kind, tmp_path):
    """The fused decode path (norms and residual adds fused into the projections) gives the
    layer-by-layer logits and states, at four rows, two and one (as many as the model takes
    fused). On CPU it runs the fused ops' references, which checks the wiring: slices, orders,
    the residual stream, the KV cache; the Triton kernels are checked against the same
    references."""
    _fused_against_layered(kind, tmp_path)


@pytest.mark.parametrize("kind", ["granite", "bamba"])
@torch.no_grad()
def test_streamed_fused_decode_equals_layer_by_layer(kind, tmp_path):
    """Every fused projection streaming K, as the large models' do: a one-group Mamba2 block's
    gate then rides in the state update and its norm in out_proj's stream (``NORM_IN_STREAM``),
    layer by layer's logits and states all the same."""
    _fused_against_layered(kind, tmp_path, options=DecodeOptions(fused=True, tile_k=16))


@pytest.mark.parametrize("in_projection", [True, False], ids=["epilogue", "launch"])
@pytest.mark.parametrize("kind", ["falcon_h1", "bamba"])
@torch.no_grad()
def test_fused_decode_rotates_in_the_projection_or_after_it(kind, in_projection, monkeypatch, tmp_path):
    """A fused decode step's rotary embedding, in the QKV (or joint) projection's epilogue or as
    the rope launch after it (``ROPE_IN_PROJECTION``): layer by layer's logits and states either
    way."""
    monkeypatch.setattr(attention_mixer, "ROPE_IN_PROJECTION", in_projection)
    _fused_against_layered(kind, tmp_path)


@pytest.mark.parametrize("tile_k", [None, 16])
@torch.no_grad()
def test_fused_decode_equals_layer_by_layer_with_a_gated_norm_per_group(tile_k, tmp_path):
    """Falcon-H1-34B's Mamba2 branch gates and then normalises each of its two groups: its fused
    parallel block keeps the gated norm (the gate alone rides in the state update only where
    there is no norm, ``GATE_IN_UPDATE``), its projections one tile or streamed."""
    _fused_against_layered("falcon_h1", tmp_path, options=DecodeOptions(fused=True, tile_k=tile_k),
                           mamba_rms_norm=True, mamba_n_groups=2)


@torch.no_grad()
def test_fused_decode_equals_layer_by_layer_with_attention_biases(tmp_path):
    """Falcon-H1 whose attention has biases and whose Mamba2 has none: the joint projections'
    biases (zeros for in_proj's rows, o_proj's alone out), fused as layer by layer."""
    _fused_against_layered("falcon_h1", tmp_path, attention_bias=True)


def _fused_against_layered(kind, tmp_path, options=DecodeOptions(fused=True), **kw):
    save_tiny(kind, tmp_path, **kw)  # Nemotron-H with every layer kind, experts included
    fused = Model.from_pretrained(tmp_path, dtype=torch.float32, options=options)
    layered = Model.from_pretrained(tmp_path, dtype=torch.float32)
    assert fused.options.max_rows >= 2 and layered.options.max_rows == 0  # CPU: layered unless asked
    ps = prompts([5, 12, 7, 9], seed=7)
    runs = []
    for model in (layered, fused):
        runner = new_runner(model, 4)
        step(runner, [(p, slot, 0) for slot, p in enumerate(ps)])
        pos = [len(p) for p in ps]
        logits = []
        for width in (4, 2, 1):
            fuses = model is fused and width <= fused.options.max_rows
            assert model.takes_fused(runner.buffers.inputs(Bucket(width))) == fuses
            for i in range(2):
                logits.append(step(runner, decode=[(3 + i + s, s, pos[s]) for s in range(width)]))
                pos[:width] = [n + 1 for n in pos[:width]]
        runs.append((logits, runner.pool.tensors()))
    (a, states_a), (b, states_b) = runs
    for x, y in zip(a + states_a, b + states_b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_folded_norms_give_the_checkpoints_logits(kind, tmp_path):
    """Block norm weights folded into the projections that read them (the default only where the
    fused decode streams K; asked for here): prefill and decode logits, layered and fused, equal
    the unfolded model's in fp32, and greedy tokens HF's. MoE blocks keep their norms (several
    readers; a parallel block's two first projections are one); the checkpoint's tensors are left
    as they were."""
    hf = save_tiny(kind, tmp_path, **(MOE if kind == "nemotron_h" else {}))
    cfg = ModelConfig.from_pretrained(tmp_path)
    weights = load_weights(tmp_path, cfg, dtype=torch.float32)
    before = {name: t.clone() for name, t in weights.items()}
    folded = Model(cfg, weights, DecodeOptions(fused=True), fold_norms=True)
    assert all(torch.equal(weights[name], t) for name, t in before.items())
    plain = Model.from_pretrained(tmp_path, dtype=torch.float32)
    assert not any(block.norm.unit for block in plain.blocks)
    for i, kind_ in enumerate(cfg.layer_types):
        kept = kind_ == "moe"  # several readers
        assert folded.blocks[i].norm.unit != kept
        assert torch.equal(folded.blocks[i].norm.weight, plain.blocks[i].norm.weight) == kept
    ps = prompts([5, 12], seed=9)
    runs = []
    for model in (plain, folded, folded.with_options(DecodeOptions(fused=False))):
        runner = new_runner(model, 2)
        logits = [step(runner, [(p, slot, 0) for slot, p in enumerate(ps)])]
        pos = [len(p) for p in ps]
        for i in range(3):
            logits.append(step(runner, decode=[(3 + i, s, pos[s]) for s in range(2)]))
            pos = [n + 1 for n in pos]
        runs.append(torch.cat(logits))
    for other in runs[1:]:
        torch.testing.assert_close(other, runs[0], rtol=1e-4, atol=1e-5)
    hf.generation_config.eos_token_id = None
    for p, tokens in zip(ps, greedy(folded, ps, 12)):
        assert tokens == hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()


def _tensors(model):
    """Every tensor a model holds, by where: its embeddings, norms and mixers' attributes."""
    out = {"embed": model.embed, "lm_head": model.lm_head, "norm_f": model.final_norm.weight}
    for i, block in enumerate(model.blocks):
        out[f"{i}.norm"] = block.norm.weight
        out.update({f"{i}.{k}": v for k, v in vars(block.mixer).items() if isinstance(v, torch.Tensor)})
    return out


@pytest.mark.parametrize("preset", ["tiny-falcon-h1", "tiny-granite"])
@torch.no_grad()
def test_a_consumed_dict_lets_each_replaced_tensor_go_as_it_is_replaced(preset, monkeypatch):
    """Built from a dict it may take apart (``from_pretrained``, ``from_preset``), the model lets
    each tensor it replaces (a multiplier or a norm folded in) go before it makes the next
    replacement, so loading peaks one tensor over the model, not at the replaced tensors twice
    (Falcon-H1-34B did not fit an 80 GB card); a dict it may not consume keeps every tensor; both
    build the same model."""
    cfg = preset_config(preset)
    replaced, held = [], []  # weak references to the tensors replaced so far; at each replacement, any still held?
    scaled, absorb = multipliers._scaled, Mixer.absorb_norm

    def note(w):
        held.append(any(r() is not None for r in replaced))
        replaced.append(weakref.ref(w))

    def noted_scaled(w, factor):
        note(w)
        return scaled(w, factor)

    def noted_absorb(mixer, weight):
        if isinstance(getattr(mixer, mixer.norm_reader or "", None), torch.Tensor):
            note(getattr(mixer, mixer.norm_reader))
        return absorb(mixer, weight)

    monkeypatch.setattr(multipliers, "_scaled", noted_scaled)
    monkeypatch.setattr(Mixer, "absorb_norm", noted_absorb)
    models = {}
    for consume in (False, True):
        replaced.clear()
        held.clear()
        weights = random_weights(cfg, dtype=torch.bfloat16, seed=3)
        names = len(weights)
        models[consume] = Model(cfg, weights, fold_norms=True, consume=consume)
        assert len(replaced) > 10
        if consume:
            assert not any(held) and weights == {}
            assert all(r() is None for r in replaced)
        else:
            assert all(held[1:]) and len(weights) == names
    kept, consumed = _tensors(models[False]), _tensors(models[True])
    assert kept.keys() == consumed.keys()
    for name, t in kept.items():
        assert torch.equal(t, consumed[name]), name


def test_fused_rows_follow_the_projection_shapes():
    """The fused decode path takes 1-4 rows where every projection's K fits one register tile
    (Mamba2-130M), 1-2 rows where the projections stream K (Nemotron-H-8B); none where a mixer
    has no fused decode or the options turn it off."""
    def resolve(name, **kw):
        return DecodeOptions(fused=True, **kw).resolve(preset_config(name), torch.device("cpu"), True)

    assert resolve("mamba2-130m").max_rows == 4
    assert resolve("nemotron-h-8b").max_rows == 2
    assert resolve("mamba2-130m", tile_k=64).max_rows == 2
    assert resolve("mamba2-130m", max_rows=2).max_rows == 2
    assert resolve("nemotron-3-nano-30b-a3b").max_rows == 2
    cfg = preset_config("tiny-hybrid")
    assert DecodeOptions(fused=True).resolve(cfg, torch.device("cpu"), False).max_rows == 0
    assert DecodeOptions().resolve(cfg, torch.device("cpu"), True).max_rows == 0  # CPU default: layered
    with pytest.raises(ValueError, match="tile_k"):
        DecodeOptions(tile_k=24)


def test_missing_tensor_is_named(tmp_path):
    save_tiny("nemotron_h", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    victim = next(k for k in tensors if "mixer.A_log" in k)
    del tensors[victim]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightError, match="A_log: missing"):
        Model.from_pretrained(tmp_path, dtype=torch.float32)


def test_misshaped_tensor_is_named(tmp_path):
    save_tiny("mamba2", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    key = next(k for k in tensors if k.endswith("layers.1.mixer.out_proj.weight"))
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightError, match=r"layers\.1\.mixer\.out_proj\.weight: expected shape"):
        Model.from_pretrained(tmp_path, dtype=torch.float32)


def test_router_weight_stays_fp32_in_a_bf16_model(tmp_path):
    """The router's weight keeps the checkpoint's fp32 values in a bf16 model, as HF's NemotronH
    keeps them where it declares the router fp32 (checked there too; transformers 5.17 rounded
    it); every other projection takes the model's dtype."""
    from transformers import NemotronHForCausalLM

    from mambastep.runtime.mixers.moe import MoEMixer

    save_tiny("nemotron_h", tmp_path, **MOE)
    tensors = load_file(tmp_path / "model.safetensors")
    ours = Model.from_pretrained(tmp_path, dtype=torch.bfloat16)
    hf_keeps_fp32 = "gate.weight" in (getattr(NemotronHForCausalLM, "_keep_in_fp32_modules_strict", None) or [])
    hf = NemotronHForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16) if hf_keeps_fp32 else None
    routers = [b.mixer for b in ours.blocks if isinstance(b.mixer, MoEMixer)]
    assert len(routers) == 3
    for m in routers:
        saved = next(v for k, v in tensors.items() if k.endswith(f"layers.{m.layer}.mixer.gate.weight"))
        assert saved.dtype == torch.float32 and torch.equal(m.gate, saved)
        if hf is not None:
            assert torch.equal(m.gate, hf.model.layers[m.layer].mixer.gate.weight)
        assert m.up.dtype == torch.bfloat16


def test_unknown_architecture_is_refused(tmp_path):
    save_tiny("mamba2", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type: unsupported 'llama'"):
        Model.from_pretrained(tmp_path)


def test_sharded_checkpoint_loads_the_same(tmp_path):
    hf = save_tiny("nemotron_h", tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    one = Model.from_pretrained(tmp_path / "one", dtype=torch.float32)
    sharded = Model.from_pretrained(tmp_path / "sharded", dtype=torch.float32)
    plan = [(p, slot, 0) for slot, p in enumerate(prompts([5, 9]))]
    assert torch.equal(step(new_runner(one), plan), step(new_runner(sharded), plan))


def test_mtp_layers_load_and_leave_the_model_alone(tmp_path):
    """A checkpoint with multi-token-prediction layers (num_nextn_predict_layers, mtp.* tensors,
    as NVIDIA's Nemotron 3 ship) loads; the layers only draft (``runtime.mtp``), read where asked
    for, and the logits are the model's."""
    save_tiny("nemotron_h", tmp_path / "base", **MOE)
    plain = Model.from_pretrained(tmp_path / "base", dtype=torch.float32)
    mtp = tmp_path / "mtp"
    mtp.mkdir()
    cfg = json.loads((tmp_path / "base" / "config.json").read_text())
    cfg.update(num_nextn_predict_layers=1, mtp_layers_block_type=["attention", "moe"])
    (mtp / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(tmp_path / "base" / "model.safetensors")
    tensors["mtp.layers.0.mixer.q_proj.weight"] = torch.randn(32, 32)
    save_file(tensors, mtp / "model.safetensors", metadata={"format": "pt"})
    plan = [(p, slot, 0) for slot, p in enumerate(prompts([5, 9]))]
    with_mtp = Model.from_pretrained(mtp, dtype=torch.float32)
    assert torch.equal(step(new_runner(plain), plan), step(new_runner(with_mtp), plan))


def test_an_expert_choice_that_cannot_be_made_names_its_fields():
    base = preset_config("tiny-hybrid")
    with pytest.raises(ConfigError, match="n_group/topk_group: 3 of 4 experts in 1 of 2 groups"):
        dataclasses.replace(base, num_experts_per_tok=3, n_group=2, topk_group=1)
    with pytest.raises(ConfigError, match="moe_latent_size"):
        dataclasses.replace(base, moe_latent_size=0)
    granite = preset_config("tiny-granite")  # a softmax router: no groups, no routed scale to ignore
    with pytest.raises(ConfigError, match="a softmax router takes no groups and no routed scale, got 1, 1, 2.5"):
        dataclasses.replace(granite, routed_scaling_factor=2.5)


def test_inconsistent_config_names_the_field():
    with pytest.raises(ConfigError, match="n_groups"):
        ModelConfig(architecture="mamba2", vocab_size=10, hidden_size=8, layer_types=("mamba",),
                    mamba_num_heads=6, n_groups=4)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_bf16_on_gpu_matches_hf(kind, tmp_path):
    """bf16 Triton path vs HF in fp32: prefill logits, then decode logits teacher-forced with
    HF's greedy tokens (so a near-tie flipping one token cannot derail the comparison). No MoE
    layer here: bf16 rounding flips near-tied expert choices, a discontinuity no tolerance bounds."""
    no_moe = {"mamba2": {}, "nemotron_h": {"layers_block_type": DENSE_HYBRID}, "granite": GRANITE_DENSE,
              "bamba": {}, "falcon_h1": {}}[kind]
    hf = save_tiny(kind, tmp_path, **no_moe)
    hf.generation_config.eos_token_id = None
    ours = Model.from_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda")
    runner = new_runner(ours)
    ps = prompts(seed=4)
    got = step(runner, [(p, slot, 0) for slot, p in enumerate(ps)])
    ref_tokens = [hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
                  for p in ps]
    full = [hf(torch.tensor([p + t])).logits[0] for p, t in zip(ps, ref_tokens)]
    assert_close(got.cpu(), torch.stack([f[len(p) - 1] for f, p in zip(full, ps)]), torch.bfloat16, factor=2)
    for i in range(15):
        got = step(runner, decode=[(t[i], slot, len(p) + i) for slot, (p, t) in enumerate(zip(ps, ref_tokens))])
        ref = torch.stack([f[len(p) + i] for f, p in zip(full, ps)])
        assert_close(got.cpu(), ref, torch.bfloat16, factor=2)
    # one request alone: batch-1 decode steps take the fused decode path
    assert ours.options.fused
    runner = new_runner(ours)
    p, t, f = ps[1], ref_tokens[1], full[1]
    step(runner, [(p, 0, 0)])
    for i in range(15):
        got = step(runner, decode=[(t[i], 0, len(p) + i)])
        assert_close(got.cpu(), f[len(p) + i][None], torch.bfloat16, factor=2)
