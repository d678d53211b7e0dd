"""A Hypothesis state machine over the public Engine: requests added (prompts that chunk, at the
SSD chunk and conv-width edges; greedy or seeded sampling with top-k / top-p; stop tokens;
short max_tokens; penalties, logit bias, min_tokens and logprobs, or none; n choices of one
prompt, each like the request alone with seed + i), steps, aborts in every state, and every buffer region a step does not own
poisoned between steps; variants pipelined, with a prefix cache, speculating (drafts accepted,
in part, or not at all), and over the other families' blocks.

After every rule: no slot is held twice and free plus held slots are the pool; every step ran
in the smallest bucket that holds it; every request is either live in the engine or ended, none
lost. A request that finishes has exactly the tokens it gets run alone on a fresh engine. At the
end every request has ended.

CPU (CI): the tiny hybrid, eager, a fixed derandomised budget. GPU (``gpu`` marker): the tiny
Nemotron-H (fused decode steps too) in CUDA graphs, fp32, and a larger budget.
``MAMBASTEP_FUZZ_EXAMPLES`` scales the budget for long runs.
"""

import dataclasses
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mambastep.graphs import Bucket, BucketSet
from mambastep.runtime.engine import Engine
from mambastep.runtime.model import Model
from mambastep.runtime.ngram_drafter import NgramDrafter
from mambastep.runtime.request import SamplingParams
from mambastep.runtime.speculative import Speculative

# A 40-token prefill budget in at most two sequences a step: long prompts chunk; 4 slots: queueing.
BUCKETS = BucketSet(decode=(1, 2, 4), mixed_decode=(0, 2, 4), prefill=(16, 40), max_prefill_seqs=2)
SLOTS, MAX_CONTEXT = 4, 96
BUDGET = BUCKETS.max_prefill_tokens
# the conv width and SSD chunk edges, the prefill budget's, and prompts whose output meets max_context
PROMPT_LENS = [1, 2, 3, 4, 5, 31, 32, 33, BUDGET - 1, BUDGET, BUDGET + 1, 2 * BUDGET + 3, MAX_CONTEXT - 3,
               MAX_CONTEXT - 1]
EXAMPLES = int(os.environ.get("MAMBASTEP_FUZZ_EXAMPLES", "0"))

_models: dict[tuple[str, str, bool], Model] = {}
_alone: dict[tuple, list[int]] = {}


def new_engine(preset: str, device: str, mtp: bool = False, **kw) -> Engine:
    """An engine over the preset's model (``mtp``: with its MTP layers, the same weights else)."""
    if (preset, device, mtp) not in _models:
        _models[preset, device, mtp] = Model.from_preset(preset, dtype=torch.float32, device=device, mtp=mtp)
    return Engine(_models[preset, device, mtp], num_slots=SLOTS, max_context=MAX_CONTEXT, buckets=BUCKETS,
                  progress=False, **kw)


def alone(preset: str, device: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """The request's tokens run alone on a fresh eager engine (cached)."""
    key = (preset, device, tuple(prompt), params)
    if key not in _alone:
        _alone[key] = new_engine(preset, device, use_graphs=False).generate([prompt], params)[0]
    return _alone[key]


@st.composite
def prompts(draw):
    n = draw(st.sampled_from(PROMPT_LENS))
    return draw(st.lists(st.integers(0, 511), min_size=n, max_size=n))


@st.composite
def processors(draw, max_tokens: int) -> dict:
    """None, or some of the logits processors, and logprobs or not."""
    kw = {}
    if draw(st.booleans()):
        kw = dict(presence_penalty=draw(st.sampled_from([0.0, 1.5, -0.5])),
                  frequency_penalty=draw(st.sampled_from([0.0, 2.0])),
                  repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.8])),
                  logit_bias=draw(st.dictionaries(st.integers(0, 511), st.sampled_from([-100.0, 5.0]), max_size=3)),
                  min_tokens=draw(st.integers(0, max_tokens)))
    kw["logprobs"] = draw(st.sampled_from([None, 0, 3]))
    return kw


@st.composite
def sampling(draw):
    max_tokens = draw(st.integers(1, 8))
    common = dict(max_tokens=max_tokens, ignore_eos=draw(st.booleans()),
                  stop_token_ids=draw(st.lists(st.integers(0, 511), max_size=2)), **draw(processors(max_tokens)),
                  # a speculating engine's default, or opted out: verified beside those that speculate
                  speculative=draw(st.sampled_from([None, None, False])))
    if draw(st.booleans()):
        return SamplingParams(temperature=0, **common)
    return SamplingParams(temperature=draw(st.sampled_from([0.7, 1.0])), top_k=draw(st.sampled_from([0, 5, 50])),
                          top_p=draw(st.sampled_from([1.0, 0.9, 0.5])), seed=draw(st.integers(0, 2**40)), **common)


class EngineMachine(RuleBasedStateMachine):
    # every mixer kind (chunk_size 32, conv_kernel 4, eos 2); its MoE layers keep every step layered
    preset = "tiny-hybrid"
    device = "cpu"
    pipelined = False
    graphs = False
    cache_slots = 0  # a prefix cache's snapshots
    speculative = False  # draft and verify (``MachineDrafter``; "mtp": the preset's MTP layers)

    def __init__(self):
        super().__init__()
        spec = None
        mtp = self.speculative == "mtp"
        if self.speculative:
            # not adaptive: which steps verify does not hang on the host's timing
            spec = Speculative(drafter=lambda: MachineDrafter(self), num_drafts=3, max_batch=3, adaptive=False)
            if mtp:
                spec = Speculative(mtp=True, num_drafts=3, max_batch=3, adaptive=False)
        self.engine = new_engine(self.preset, self.device, mtp, pipelined=self.pipelined, use_graphs=self.graphs,
                                 trace=True, prefix_cache_slots=self.cache_slots, speculative=spec)
        self.added: dict[int, tuple[list[int], SamplingParams]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.ended: dict[int, str] = {}
        self.checked_steps = 0
        self.poison = torch.Generator().manual_seed(0)

    @rule(prompt=prompts(), params=sampling(), data=st.data())
    def add(self, prompt, params, data):
        if data.draw(st.booleans(), label="stop on a token it draws"):
            # random stop ids rarely come up: stop on one the request draws when run alone
            drawn = self._alone(prompt, params)
            stop = data.draw(st.sampled_from(drawn), label="stop token")
            params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, stop))
        rid = self.engine.add_request(prompt, params)
        assert rid == len(self.added)  # ids count up from 0, generate()'s included
        self.added[rid], self.tokens[rid] = (prompt, params), []

    @rule(prompt=prompts(), params=sampling(), n=st.integers(2, SLOTS))
    def add_choices(self, prompt, params, n):
        """n choices, prefilled once: choice i is the request alone with seed + i."""
        for i, rid in enumerate(self.engine.add_choices(prompt, params, n)):
            assert rid == len(self.added)
            seeded = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            self.added[rid], self.tokens[rid] = (prompt, seeded), []

    @precondition(lambda self: self.added)
    @rule(params=sampling(), data=st.data())
    def resend(self, params, data):
        """A conversation's next turn: an earlier prompt (cut anywhere) and what it has drawn so
        far, then new tokens: with a prefix cache it restores what is cached of it."""
        earlier = data.draw(st.sampled_from(sorted(self.added)), label="earlier request")
        prompt = list(self.added[earlier][0]) + self.tokens[earlier]
        # mostly the whole of it, as a conversation resends itself
        cut = data.draw(st.one_of(st.just(len(prompt)), st.integers(1, len(prompt))), label="tokens kept")
        extra = data.draw(st.lists(st.integers(3, 511), max_size=BUDGET), label="new tokens")
        prompt = (prompt[:cut] + extra)[: MAX_CONTEXT - 1]
        rid = self.engine.add_request(prompt, params)
        self.added[rid], self.tokens[rid] = (prompt, params), []

    @rule(prompt=prompts(), params=sampling())
    def generate(self, prompt, params):
        """generate() steps the whole engine: its own request comes back whole, the others'
        outputs wait for the next step()."""
        rid = len(self.added)
        self.added[rid], self.tokens[rid] = (prompt, params), []
        self.tokens[rid] = self.engine.generate([prompt], params)[0]
        self.ended[rid] = "generate"
        assert self.tokens[rid] == self._alone(prompt, params), f"generate({rid}) differs from alone"
        self._poison_what_no_step_owns()

    @rule()
    def step(self):
        for out in self.engine.step():
            self._take(out)
        self._poison_what_no_step_owns()

    @precondition(lambda self: self.added)
    @rule(data=st.data())
    def abort(self, data):
        """Any request: queued, in prefill, decoding, finished, or an id never handed out."""
        rid = data.draw(st.sampled_from(sorted(self.added) + [max(self.added) + 7]), label="abort")
        if rid in self.engine.requests:
            assert rid not in self.ended
            self.engine.abort(rid)
            self.ended[rid] = "abort"
        else:
            with pytest.raises(KeyError, match="unknown"):
                self.engine.abort(rid)

    def _alone(self, prompt, params):
        return alone(self.preset, self.device, prompt, params)

    def _take(self, out):
        assert out.id in self.added and out.id not in self.ended, f"output for request {out.id} after it ended"
        self.tokens[out.id] += out.new_tokens
        prompt, params = self.added[out.id]
        if params.logprobs is None:
            assert out.logprobs is None
        else:
            assert len(out.logprobs) == len(out.new_tokens)
            for lp in out.logprobs:
                values = [v for _, v in lp.top]
                assert len(lp.top) == params.logprobs and values == sorted(values, reverse=True)
                assert lp.logprob <= 1e-6
                if params.greedy and values:  # the drawn token is the most likely one
                    assert lp.logprob >= values[0] - 1e-5
        assert len(self.tokens[out.id]) <= params.max_tokens and len(prompt) + len(self.tokens[out.id]) <= MAX_CONTEXT
        if out.finished:
            assert out.finish_reason in ("stop", "length")
            self.ended[out.id] = out.finish_reason
            assert self.tokens[out.id] == self._alone(prompt, params), f"request {out.id} differs from alone"

    def _poison_what_no_step_owns(self):
        """Garbage in the whole host arena (a refill must rewrite what a step reads); NaN in the
        state of every slot no request holds, a wrong token in its drawn-token entry, and counts,
        prompt marks and large biases in what it has seen (a request must start clean)."""
        if self.device == "cuda":
            torch.cuda.synchronize()  # a pipelined step's copy of the arena may still be in flight
        runner = self.engine.runner
        runner.buffers.arena.host.fill_(0xA5)
        free = list(self.engine.scheduler.free_slots)
        if free:
            for t in runner.pool.tensors():
                t[free] = float("nan")
            junk = torch.randint(0, 512, (len(free),), generator=self.poison)
            runner.slot_tokens[free] = junk.to(runner.slot_tokens.device)
            seen = runner.seen
            seen.counts[free] = 7
            seen.prompt[free] = True
            seen.bias_ids[free] = junk.to(seen.bias_ids.device).unsqueeze(-1)
            seen.bias_values[free] = 50.0
            seen.bias_until[free] = 1 << 40

    @invariant()
    def slots_are_held_once(self):
        sched = self.engine.scheduler
        # running requests' slots, and those a prefix reserves for its choices
        held = [r.slot for r in sched.running] + [c.slot for r in sched.running for c in r.choices or [] if c.slot >= 0]
        assert len(set(held)) == len(held), held
        assert sorted(held + sched.free_slots) == list(range(SLOTS))

    @invariant()
    def the_prefix_cache_keeps_to_its_slots(self):
        cache = self.engine.prefix_cache
        if cache is not None:
            assert len(cache) <= len(cache.slots) and not set(cache.slots) & set(self.engine.scheduler.free_slots)

    @invariant()
    def steps_ran_in_their_bucket(self):
        buckets = self.engine.buckets  # BUCKETS, with verify buckets where the engine speculates
        for s in self.engine.trace[self.checked_steps:]:
            want = (buckets.choose(s.decode, s.prefill_tokens, s.prefill_seqs, s.drafts)
                    or Bucket(s.decode, s.prefill_tokens, s.drafts))
            assert s.bucket == want and s.bucket.fits(s.decode, s.prefill_tokens, s.prefill_seqs,
                                                      buckets.max_prefill_seqs, s.drafts)
        self.checked_steps = len(self.engine.trace)

    @invariant()
    def no_request_is_lost(self):
        """Live in the engine, or ended here; or finished inside a generate() call, its last
        output waiting for the next step()."""
        live = set(self.engine.requests)
        for rid in self.added:
            assert not (rid in live and rid in self.ended), f"request {rid} ended here but is live in the engine"
            if rid not in live and rid not in self.ended:
                assert self.engine.has_unfinished(), f"request {rid} is gone with its output undelivered"

    def teardown(self):
        for _ in range(400):
            if not self.engine.has_unfinished():
                break
            for out in self.engine.step():
                self._take(out)
        assert not self.engine.has_unfinished()
        assert set(self.ended) == set(self.added), f"never ended: {set(self.added) - set(self.ended)}"


class PipelinedMachine(EngineMachine):
    pipelined = True


def _settings(examples: int, steps: int):
    return settings(max_examples=EXAMPLES or examples, stateful_step_count=steps, deadline=None,
                    derandomize=not EXAMPLES, suppress_health_check=[HealthCheck.too_slow])


TestEngine = EngineMachine.TestCase
TestEngine.settings = _settings(12, 25)
TestPipelinedEngine = PipelinedMachine.TestCase
TestPipelinedEngine.settings = _settings(12, 25)


class CachedMachine(EngineMachine):
    # a prefix cache of two snapshots (evicted often), pipelined: resent prompts restore
    cache_slots = 2
    pipelined = True


TestCachedEngine = CachedMachine.TestCase
TestCachedEngine.settings = _settings(12, 25)


class GraniteMachine(EngineMachine):
    # Granite-4.0-H's blocks: softmax-routed SwiGLU experts, the multipliers
    preset = "tiny-granite"


TestGraniteEngine = GraniteMachine.TestCase
TestGraniteEngine.settings = _settings(12, 25)


class FalconMachine(EngineMachine):
    # Falcon-H1's parallel blocks (Mamba2 beside rotary attention), the muP multipliers
    preset = "tiny-falcon-h1"


TestFalconEngine = FalconMachine.TestCase
TestFalconEngine.settings = _settings(12, 25)


class MachineDrafter:
    """Drafts what a request added to the machine draws alone (the first added whose prompt the
    context starts with), each draft wrong with probability 0.3, so drafts are accepted whole,
    in part and not at all; else prompt lookup."""

    def __init__(self, machine):
        self.machine, self.rng, self.ngram = machine, np.random.default_rng(len(machine.added)), NgramDrafter()

    def draft(self, context, k):
        for prompt, params in self.machine.added.values():
            if len(context) >= len(prompt) and list(context[: len(prompt)]) == list(prompt):
                drawn = self.machine._alone(prompt, params)[len(context) - len(prompt) :][:k]
                return [(t + 1) % 512 if self.rng.random() < 0.3 else t for t in drawn]
        return self.ngram.draft(context, k)


class SpeculativeMachine(EngineMachine):
    # draft and verify: a request's tokens are still those it draws alone
    speculative = True


TestSpeculativeEngine = SpeculativeMachine.TestCase
TestSpeculativeEngine.settings = _settings(12, 25)


class MTPMachine(EngineMachine):
    # the preset's MTP layers draft (random: drafts mostly rejected), beside a prefix cache whose
    # snapshots keep the MTP's keys and values; choices draft nothing
    speculative, cache_slots = "mtp", 2


TestMTPEngine = MTPMachine.TestCase
TestMTPEngine.settings = _settings(8, 25)


class GPUMachine(EngineMachine):
    # no MoE: decode steps of up to 4 rows take the fused path, the rest layered, all in graphs
    preset, device, graphs = "tiny-nemotron-h", "cuda", True


class GPUPipelinedMachine(GPUMachine):
    pipelined = True


class GPUGraniteMachine(GPUMachine):
    preset = "tiny-granite"


class GPUCachedMachine(GPUMachine):
    cache_slots = 2


class GPUSpeculativeMachine(GPUMachine):
    speculative = True


class GPUMTPMachine(GPUMachine):
    preset, speculative, cache_slots = "tiny-hybrid", "mtp", 2


class GPUFalconMachine(GPUMachine):
    # decode steps fork each block's attention onto the side stream, in the graphs
    preset = "tiny-falcon-h1"


@pytest.mark.gpu
@pytest.mark.parametrize("machine", [GPUMachine, GPUPipelinedMachine, GPUCachedMachine, GPUGraniteMachine,
                                     GPUFalconMachine, GPUSpeculativeMachine, GPUMTPMachine],
                         ids=["default", "pipelined", "prefix-cache", "granite", "falcon-h1", "speculative", "mtp"])
def test_engine_machine_on_gpu(machine):
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(machine, settings=_settings(20, 30))
