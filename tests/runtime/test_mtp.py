"""Nemotron 3's multi-token prediction layers: read from the checkpoint in NVIDIA's layout, and
run as a model (``runtime.mtp``) whose logits equal HF's NemotronH blocks run over the same
fused inputs (HF has the blocks but no MTP stage: the test writes the fusion's three lines)."""

import itertools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from hf_models import VOCAB, nemotron_h_config, perturb, save_tiny
from mambastep.graphs import BucketSet
from mambastep.runtime.config import ConfigError, ModelConfig
from mambastep.runtime.decode_options import DecodeOptions
from mambastep.runtime.engine import Engine, SamplingParams
from mambastep.runtime.model import Model
from mambastep.runtime.mtp import MTPModel
from mambastep.runtime.mtp_drafter import MTPDrafter
from mambastep.runtime.plan import StepPlan
from mambastep.runtime.speculative import Speculative
from mambastep.runtime.state_pool import StatePool
from mambastep.runtime.step_runner import StepRunner
from mambastep.runtime.weights import WeightError
from support import assert_close
from transformers import NemotronHForCausalLM

MOE = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5)
BUCKETS = BucketSet(decode=(1, 2, 4), mixed_decode=(0, 2), prefill=(16, 32), max_prefill_seqs=4)


def hf_dict(**kw) -> dict:
    return nemotron_h_config(**MOE, **kw).to_dict()


@pytest.mark.parametrize("fields, kinds", [
    ({"mtp_layers_block_type": ["attention", "moe"]}, ("attention", "moe")),
    ({"mtp_layers_block_type": ["full_attention", "mlp", "moe"]}, ("attention", "mlp", "moe")),
])
def test_the_mtp_layers_kinds_are_read(fields, kinds):
    cfg = ModelConfig.from_hf_dict({**hf_dict(), "num_nextn_predict_layers": 1, **fields})
    assert cfg.mtp_layer_types == kinds and cfg.mtp_depths == 1
    assert cfg.mtp_config().layer_types == kinds and cfg.mtp_config().mtp_layer_types == ()
    assert ModelConfig.from_hf_dict({**hf_dict(), "num_nextn_predict_layers": 0}).mtp_layer_types == ()


def test_an_older_configs_pattern_is_read_and_bad_ones_are_named():
    hf = {k: v for k, v in hf_dict().items() if k != "mtp_layers_block_type"}
    assert ModelConfig.from_hf_dict({**hf, "num_nextn_predict_layers": 1,
                                     "mtp_hybrid_override_pattern": "*-E"}).mtp_layer_types == ("attention", "mlp", "moe")
    assert ModelConfig.from_hf_dict({**hf, "num_nextn_predict_layers": 1}).mtp_layer_types == ("attention", "moe")
    with pytest.raises(ConfigError, match=r"mtp_hybrid_override_pattern: unknown layer characters \['X'\]"):
        ModelConfig.from_hf_dict({**hf, "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*X"})
    with pytest.raises(ConfigError, match="mtp_layers_block_type: unknown layer types"):
        ModelConfig.from_hf_dict({**hf, "num_nextn_predict_layers": 1, "mtp_layers_block_type": ["conv"]})
    with pytest.raises(ConfigError, match="num_nextn_predict_layers: expected an int >= 0"):
        ModelConfig.from_hf_dict({**hf, "num_nextn_predict_layers": -1})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny NemotronH checkpoint with an MTP depth (attention, then MoE) as NVIDIA stores one:
    ``mtp.layers.{j}`` blocks, the fusion tensors on the first, ``final_layernorm`` on the last;
    and the oracle: HF's NemotronH over those two blocks, with the target's embeddings and head."""
    path = tmp_path_factory.mktemp("mtp")
    target = save_tiny("nemotron_h", path, **MOE)
    torch.manual_seed(1)
    oracle = NemotronHForCausalLM(nemotron_h_config(**MOE, layers_block_type=["attention", "moe"]))
    perturb(oracle)
    with torch.no_grad():  # attention that matters: drafts then tell where a chained row's keys went
        oracle.model.layers[0].mixer.q_proj.weight.mul_(4)
        oracle.model.layers[0].mixer.o_proj.weight.mul_(16)
    oracle.model.embeddings.weight.data.copy_(target.model.embeddings.weight)
    oracle.lm_head.weight.data.copy_(target.lm_head.weight)
    D = oracle.config.hidden_size
    tensors = load_file(path / "model.safetensors")
    for name, t in oracle.state_dict().items():
        if not name.startswith("model.layers."):
            continue
        name = "mtp." + name.removeprefix("model.")
        if name.endswith(("experts.up_proj", "experts.down_proj")):  # one by one, as NVIDIA stores them
            base, proj = name.rsplit(".", 1)
            tensors.update({f"{base}.{j}.{proj}.weight": e.contiguous() for j, e in enumerate(t)})
        else:
            tensors[name] = t.contiguous()
    tensors["mtp.layers.1.final_layernorm.weight"] = oracle.model.norm_f.weight.detach().clone()
    fusion = {"enorm.weight": 1 + 0.1 * torch.randn(D), "hnorm.weight": 1 + 0.1 * torch.randn(D),
              "eh_proj.weight": torch.randn(D, 2 * D) / (2 * D) ** 0.5}
    tensors.update({f"mtp.layers.0.{k}": v for k, v in fusion.items()})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(num_nextn_predict_layers=1, mtp_layers_block_type=["attention", "moe"])
    (path / "config.json").write_text(json.dumps(cfg))
    return path, oracle, fusion, target


@torch.no_grad()
def reference(oracle, fusion, embed, tokens: list[int], hidden: torch.Tensor):
    """(logits, h') at every position of one sequence: position i fuses token i's embedding with
    hidden[i], then HF's blocks and final norm run over the whole sequence."""
    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    e = embed[torch.tensor(tokens)]
    fused = torch.cat([rms(e, fusion["enorm.weight"]), rms(hidden, fusion["hnorm.weight"])], -1)
    x = F.linear(fused, fusion["eh_proj.weight"])
    out = oracle.model(inputs_embeds=x[None]).last_hidden_state[0]
    return oracle.lm_head(out).float(), out


def feeding(plan: StepPlan, slots: list[int]) -> StepPlan:
    """``plan`` with greedy rows whose draws feed ``slots`` (where the MTP leaves their h')."""
    n = len(slots)
    plan.sample_slots = np.asarray(slots, np.int32)
    plan.temperature, plan.top_p = np.zeros(n, np.float32), np.ones(n, np.float32)
    plan.top_k, plan.seed, plan.position = np.zeros(n, np.int32), np.zeros(n, np.int64), np.zeros(n, np.int64)
    return plan


def runner_for(path):
    target = Model.from_pretrained(path, dtype=torch.float32, mtp=True)
    mtp = MTPModel(target, target.mtp_weights, num_slots=4, max_tokens=32)
    pool = StatePool(mtp.cfg, 4, max_context=64, dtype=mtp.dtype, device=mtp.device)
    return target, mtp, StepRunner(mtp, pool, BUCKETS, max_prefill_tokens=32)


def test_a_checkpoints_mtp_layers_load_as_stored(checkpoint):
    path, oracle, fusion, _ = checkpoint
    target = Model.from_pretrained(path, dtype=torch.float32, mtp=True)
    w = target.mtp_weights
    assert torch.equal(w["mtp.layers.0.eh_proj.weight"], fusion["eh_proj.weight"])
    assert torch.equal(w["mtp.layers.0.mixer.q_proj.weight"], oracle.model.layers[0].mixer.q_proj.weight)
    assert Model.from_pretrained(path, dtype=torch.float32).mtp_weights is None  # read only when asked


@torch.no_grad()
def test_mtp_logits_equal_hfs_blocks_over_the_fused_inputs(checkpoint):
    """Two sequences in their slots: a prefill chunk of target positions each (tokens shifted by
    one beside the target's hidden states), then decode rows chained on the drafted token and
    the h' of the row before, two steps; every row's logits equal the oracle's over the whole
    sequence so far."""
    path, oracle, fusion, _ = checkpoint
    target, mtp, runner = runner_for(path)
    embed = target.embed
    g = torch.Generator().manual_seed(2)
    D = target.cfg.hidden_size
    seqs = {1: (torch.randint(1, VOCAB, (9,), generator=g).tolist(), torch.randn(9, D, generator=g)),
            3: (torch.randint(1, VOCAB, (5,), generator=g).tolist(), torch.randn(5, D, generator=g))}
    mtp.hidden_in[:14] = torch.cat([h for _, h in seqs.values()])
    logits = runner.logits(feeding(StepPlan.make(prefill=[(toks, slot, 0) for slot, (toks, _) in seqs.items()]),
                                   list(seqs))).clone()
    for row, (slot, (toks, h)) in enumerate(seqs.items()):
        want, _ = reference(oracle, fusion, embed, toks, h)
        assert_close(logits[row], want[-1])
    # chained: each row fed its last draft and the h' of its row before
    for step in range(2):
        drafts = {slot: int(l.argmax()) for slot, l in zip(seqs, logits)}
        for slot, (toks, h) in seqs.items():
            _, out = reference(oracle, fusion, embed, toks, h)
            seqs[slot] = (toks + [drafts[slot]], torch.cat([h, out[-1:]]))
        plan = StepPlan.make(decode=[(drafts[slot], slot, len(toks) - 1) for slot, (toks, _) in seqs.items()])
        logits = runner.logits(feeding(plan, list(seqs))).clone()
        for row, (slot, (toks, h)) in enumerate(seqs.items()):
            want, _ = reference(oracle, fusion, embed, toks, h)
            assert_close(logits[row], want[-1])


def test_what_the_mtp_cannot_draft_with_is_named(checkpoint, tmp_path):
    path, _, _, _ = checkpoint
    with pytest.raises(ValueError, match="no multi-token prediction layers"):
        Model.from_preset("tiny-nemotron-h", dtype=torch.float32, mtp=True)
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 2}))
    tensors = load_file(path / "model.safetensors")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    target = Model.from_pretrained(tmp_path, dtype=torch.float32, mtp=True)
    with pytest.raises(ValueError, match="num_nextn_predict_layers: 2 MTP depths"):
        MTPModel(target, target.mtp_weights, num_slots=2, max_tokens=16)
    del tensors["mtp.layers.0.eh_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightError, match="mtp.layers.0.eh_proj.weight: missing"):
        Model.from_pretrained(tmp_path, dtype=torch.float32, mtp=True)


@torch.no_grad()
@pytest.mark.parametrize("fused", [False, True])
def test_the_targets_steps_keep_every_rows_hidden_state(checkpoint, fused):
    """keep_hidden: a step leaves each packed row's final hidden state (what the MTP reads) in
    ``runner.hidden``, equal to HF's last hidden state there: prompt chunks, then decode rows
    (layer by layer, or on the fused decode path)."""
    path, _, _, hf = checkpoint
    target = Model.from_pretrained(path, dtype=torch.float32, options=DecodeOptions(fused=fused))
    pool = StatePool(target.cfg, 4, max_context=64, dtype=target.dtype, device=target.device)
    runner = StepRunner(target, pool, BUCKETS, max_prefill_tokens=32, keep_hidden=True)
    g = torch.Generator().manual_seed(3)
    prompts = {0: torch.randint(1, VOCAB, (7,), generator=g).tolist(), 2: torch.randint(1, VOCAB, (12,), generator=g).tolist()}
    plan = StepPlan.make(prefill=[(p, slot, 0) for slot, p in prompts.items()])
    logits = runner.logits(plan)
    start = 0
    for p in prompts.values():
        want = hf.model(torch.tensor([p])).last_hidden_state[0]
        assert_close(runner.hidden[start : start + len(p)], want)
        start += len(p)
    nxt = {slot: int(l.argmax()) for slot, l in zip(prompts, logits)}
    bucket = runner.bucket_for(StepPlan.make(decode=[(nxt[s], s, len(p)) for s, p in prompts.items()]))
    runner.logits(StepPlan.make(decode=[(nxt[s], s, len(p)) for s, p in prompts.items()]))
    assert target.takes_fused(runner.buffers.inputs(bucket)) == fused
    for b, (slot, p) in enumerate(prompts.items()):
        want = hf.model(torch.tensor([p + [nxt[slot]]])).last_hidden_state[0, -1]
        assert_close(runner.hidden[bucket.prefill + b], want)


# the engine's steps: prompts chunk (16 tokens a step), verify sequences beside prompt chunks
ENGINE_BUCKETS = BucketSet(decode=(1, 2, 4), mixed_decode=(0, 2, 4), prefill=(8, 16), max_prefill_seqs=3)


def mtp_engine(path, **kw):
    return Engine.from_pretrained(path, dtype=torch.float32, device="cpu", buckets=ENGINE_BUCKETS, num_slots=4,
                                  max_context=96, **kw)


def engine_prompts():
    g = np.random.default_rng(4)
    return [g.integers(1, VOCAB, n).tolist() for n in (6, 37, 1, 11)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                    SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_mtp_drafts_are_the_mtp_layers_predictions_and_the_tokens_stay_the_targets(checkpoint, params, monkeypatch):
    """Speculative(mtp=True): every draft a request gets is what the MTP layers predict after its
    context (the oracle: HF's blocks over the target's hidden states from HF, chained on h'), for
    prompts that chunk and requests arriving mid-run; and the tokens are the plain engine's."""
    path = checkpoint[0]
    seen = spy_on_drafts(monkeypatch)
    ps = engine_prompts()
    spec = mtp_engine(path, speculative=Speculative(mtp=True, num_drafts=3, adaptive=False))
    ids = [spec.add_request(p, params) for p in ps[:2]]
    got = {}
    for step in itertools.count():
        if step == 2:
            ids += [spec.add_request(p, params) for p in ps[2:]]
        for o in spec.step():
            got.setdefault(o.id, []).extend(o.new_tokens)
        if not spec.has_unfinished():
            break
    assert [got[i] for i in ids] == mtp_engine(path).generate(ps, params)
    assert spec.speculative_stats["verified"] > 0 and len(seen) > 10
    assert all(drafts for _, drafts in seen)  # (fewer than 3 where the request has fewer tokens left)
    assert_the_oracles_drafts(seen, checkpoint)


def spy_on_drafts(monkeypatch) -> list:
    """Every (context, drafts) an MTP drafter gives, from here on."""
    seen, draft = [], MTPDrafter.draft
    monkeypatch.setattr(MTPDrafter, "draft", lambda self, context, k: seen.append(
        (list(map(int, context)), out := draft(self, context, k))) or out)
    return seen


@torch.no_grad()
def assert_the_oracles_drafts(seen, checkpoint) -> None:
    """Each drafts list is what the oracle predicts after its context: HF's MTP blocks over HF's
    target hidden states, each further draft chained on the draft before and its h'."""
    _, oracle, fusion, hf = checkpoint
    embed = hf.model.embeddings.weight
    for context, drafts in seen:
        hidden = hf.model(torch.tensor([context[:-1]])).last_hidden_state[0]
        toks, want = context[1:], []
        for _ in drafts:
            logits, out = reference(oracle, fusion, embed, toks, hidden)
            want.append(int(logits[-1].argmax()))
            toks, hidden = toks + [want[-1]], torch.cat([hidden, out[-1:]])
        assert drafts == want, context


def test_mtp_drafting_beside_a_prefix_cache(checkpoint, monkeypatch):
    """With a prefix cache, a prompt that restores a snapshot drafts from the MTP's keys and
    values kept with it and the target's hidden state at its boundary: its drafts are the
    oracle's (one prompt diverges from the cached one right at a block boundary, where the MTP's
    position before it reads another token), and every token the plain engine's."""
    path = checkpoint[0]
    g = np.random.default_rng(6)
    a = g.integers(1, VOCAB, 30).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = mtp_engine(path)
    want_a = plain.generate([a], params)[0]
    follow_ups = [a[:24] + g.integers(1, VOCAB, 9).tolist(), a + want_a + g.integers(1, VOCAB, 5).tolist()]
    want = plain.generate(follow_ups, params)
    spec = mtp_engine(path, prefix_cache_slots=4, speculative=Speculative(mtp=True, num_drafts=3, adaptive=False))
    assert spec.generate([a], params)[0] == want_a
    seen = spy_on_drafts(monkeypatch)
    for prompt, tokens in zip(follow_ups, want):
        assert spec.generate([prompt], params)[0] == tokens
    assert spec.prefix_cache.stats["hits"] == 2
    assert {len(c) for c, _ in seen} >= {len(p) + 1 for p in follow_ups}  # both drafted from their first token
    assert all(drafts for _, drafts in seen)
    assert_the_oracles_drafts(seen, checkpoint)


def test_mtp_positions_wait_in_the_stash_while_more_decode_than_verify(checkpoint, monkeypatch):
    """max_batch 1: a request followed from its prompt, then two more arriving while it decodes.
    While two or more decode, the MTP runs no step for the first's decode positions (their
    hidden states wait in the stash), and the prompts that run then are not taken in: those two
    draft nothing. Left alone, the first catches up from the stash and drafts the oracle's
    drafts; a stash too small for the wait leaves it drafting nothing. The tokens stay the plain
    engine's either way."""
    path = checkpoint[0]
    ps = [engine_prompts()[i] for i in (2, 0, 3)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (20, 4, 8)]
    want = [mtp_engine(path).generate([p], q)[0] for p, q in zip(ps, params)]
    for stash, drafts_alone in ((64, True), (2, False)):
        spec = mtp_engine(path, speculative=Speculative(mtp=True, num_drafts=3, max_batch=1, adaptive=False))
        spec.mtp.stash = stash
        seen = spy_on_drafts(monkeypatch)
        first = spec.add_request(ps[0], params[0])
        got = {first: []}
        while not got[first]:  # its prompt ran alone: the MTP took it in
            for o in spec.step():
                got[o.id] += o.new_tokens
        ids = [first] + [spec.add_request(p, q) for p, q in zip(ps[1:], params[1:])]
        got.update({i: [] for i in ids[1:]})
        stashed, late = 0, set()
        while spec.has_unfinished():
            for o in spec.step():
                got[o.id] += o.new_tokens
            running = spec.scheduler.running
            stashed = max(stashed, max((r.drafter.stashed for r in running), default=0))
            late |= {r.drafter.lost for r in running if r.id != first and r.prompt_done}
        assert [got[i] for i in ids] == want
        assert stashed >= 2  # positions waited
        assert late == {True}  # their prompts ran while wide: they draft nothing
        alone = [(c, d) for c, d in seen if c[: len(ps[0])] == ps[0] and len(c) > len(ps[0]) + 12]
        assert alone and all(bool(d) == drafts_alone for _, d in alone)
        assert_the_oracles_drafts(seen, checkpoint)


def test_mtp_speculation_beside_choices_and_what_it_refuses(checkpoint, monkeypatch):
    """Two choices of one prompt (forked from its prefix, which the MTP followed as the whole
    prompt: its keys and values go with the fork) beside a speculating request: every token the
    plain engine's, and the choices' drafts, from their first token, the oracle's. Refused by
    name: a model without its MTP layers, a drafter beside."""
    path = checkpoint[0]
    ps = engine_prompts()
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=10, ignore_eos=True)

    def outputs(e):
        ids = e.add_choices(ps[1], params, n=2) + [e.add_request(ps[3], params)]
        got = {i: [] for i in ids}
        while e.has_unfinished():
            for o in e.step():
                got[o.id].extend(o.new_tokens)
        return [got[i] for i in ids]

    spec = mtp_engine(path, speculative=Speculative(mtp=True, num_drafts=2, adaptive=False))
    seen = spy_on_drafts(monkeypatch)
    assert outputs(spec) == outputs(mtp_engine(path))
    assert sum(len(c) == len(ps[1]) + 1 and drafts != [] for c, drafts in seen) == 2  # each choice's first
    assert_the_oracles_drafts(seen, checkpoint)
    with pytest.raises(ValueError, match="loaded without its MTP layers; load it with mtp=True"):
        Engine(Model.from_pretrained(path, dtype=torch.float32), speculative=Speculative(mtp=True))
    with pytest.raises(ValueError, match="mtp: the MTP layers are the drafter"):
        Speculative(mtp=True, draft_model=str(path))


@pytest.mark.gpu
def test_mtp_drafting_in_graphs_drafts_as_it_does_eagerly(checkpoint, monkeypatch):
    """On the GPU with graphs (the target's and the MTP's captured): the drafts each request gets
    are those of the same run eagerly, and the tokens the plain engine's."""
    path = checkpoint[0]
    ps = engine_prompts()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seen = {True: [], False: []}
    draft = MTPDrafter.draft

    def run(graphs: bool):
        monkeypatch.setattr(MTPDrafter, "draft", lambda self, context, k: seen[graphs].append(
            (list(map(int, context)), out := draft(self, context, k))) or out)
        e = Engine.from_pretrained(path, dtype=torch.float32, device="cuda", buckets=ENGINE_BUCKETS, num_slots=4,
                                   max_context=96, use_graphs=graphs,
                                   speculative=Speculative(mtp=True, num_drafts=3, adaptive=False))
        assert (e.mtp.runner.graphs.graphs > 0) == graphs
        return e.generate(ps, params)

    plain = Engine.from_pretrained(path, dtype=torch.float32, device="cuda", buckets=ENGINE_BUCKETS, num_slots=4,
                                   max_context=96).generate(ps, params)
    assert run(True) == run(False) == plain
    assert seen[True] == seen[False] and len(seen[True]) > 10
