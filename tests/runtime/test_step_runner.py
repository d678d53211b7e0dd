"""The step runner over the model: padding is inert, graphs equal eager, drawn tokens feed the
next step on the device, no allocation or sync in steady state, one host-to-device copy per
step, and the fused decode path equals the layered one."""

import dataclasses
import gc
import weakref

import numpy as np
import pytest
import torch

from mambastep.graphs import Bucket, BucketSet
from mambastep.kernels.logits_processors import MAX_BIASED
from mambastep.runtime.decode_options import DecodeOptions
from mambastep.runtime.engine import Engine, SamplingParams
from mambastep.runtime.model import Model
from mambastep.runtime.plan import StepPlan
from mambastep.runtime.presets import preset_config
from mambastep.runtime.state_pool import StatePool
from mambastep.runtime.step_runner import StepRunner
from mambastep.runtime.weights import random_weights

BUCKETS = BucketSet(decode=(1, 4, 8), mixed_decode=(0, 4, 8), prefill=(32, 64), max_prefill_seqs=4)
SLOTS = 8


def make_runner(model, **kw):
    buckets = kw.pop("buckets", BUCKETS)
    pool = StatePool(model.cfg, SLOTS, max_context=128, dtype=model.dtype, device=model.device, drafts=buckets.drafts)
    return StepRunner(model, pool, buckets, max_prefill_tokens=128, **kw)


def tokens(n, seed):
    return np.random.default_rng(seed).integers(1, 500, n).tolist()


def script():
    """A few steps: prompts (one chunked), then mixed steps, then decodes."""
    return [
        StepPlan.make([(tokens(9, 1), 0, 0), (tokens(20, 2), 3, 0)]),
        StepPlan.make([(tokens(13, 3), 5, 0)], [(7, 0, 9), (8, 3, 20)]),
        StepPlan.make([(tokens(6, 4), 5, 13)], [(9, 0, 10), (10, 3, 21)]),
        StepPlan.make(decode=[(11, 0, 11), (12, 3, 22), (13, 5, 19)]),
        StepPlan.make(decode=[(14, 0, 12)]),
        StepPlan.make(decode=[(15, 0, 13), (16, 5, 20)]),
    ]


def run_script(runner, plans):
    return [runner.logits(p).clone() for p in plans]


UNUSED_SLOTS = [1, 2, 4, 6, 7]


def poison(runner):
    """Leave the buffers as a larger earlier step would, then garbage in every host arena byte
    and NaN in every slot the script does not use."""
    runner.logits(StepPlan.make([(tokens(60, 9), 6, 0)], [(1, s, 0) for s in (1, 2, 4, 7)]))
    runner.buffers.arena.host.fill_(0xAB)
    for t in runner.pool.tensors():
        t[UNUSED_SLOTS] = float("nan")


@pytest.fixture(scope="module")
def cpu_model():
    return Model.from_preset("tiny-hybrid", dtype=torch.float32)


def test_poisoned_buffers_change_nothing_cpu(cpu_model):
    clean = run_script(make_runner(cpu_model), script())
    dirty_runner = make_runner(cpu_model)
    poison(dirty_runner)
    dirty = run_script(dirty_runner, script())
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)


def test_plans_above_every_bucket_run_eagerly(cpu_model):
    runner = make_runner(cpu_model)
    big = StepPlan.make([(tokens(100, 5), 0, 0)])
    assert BUCKETS.choose(big.num_decode, big.num_prefill_tokens, big.num_prefill) is None
    assert runner.bucket_for(big) == Bucket(0, 100)
    assert runner.logits(big).shape == (1, cpu_model.cfg.vocab_size)


def test_plans_naming_slots_outside_the_pool_or_one_slot_twice_are_refused(cpu_model):
    """A slot past the pool (the kernels would write past its states) or held by two of a step's
    sequences and rows (they would race on one state) is a one-line error naming the field, before
    any buffer is touched; -1 stays "none" where a field allows it."""
    runner = make_runner(cpu_model)
    refused = {
        "decode_slots names slot 8, outside the pool's 8 slots": StepPlan.make(decode=[(3, 0, 4), (3, SLOTS, 4)]),
        "prefill_slots names slot -1": StepPlan.make([(tokens(5, 1), -1, 0)]),
        "slot 2 holds two": StepPlan.make([(tokens(5, 1), 2, 0)], [(3, 2, 4)]),
        "final_slots names slot 9": dataclasses.replace(StepPlan.make([(tokens(5, 1), 2, 0)]),
                                                        final_slots=np.array([9], np.int32)),
    }
    for message, plan in refused.items():
        for run in (runner.logits, runner.launch):
            with pytest.raises(ValueError, match=f"^plan: {message}"):
                run(plan)
    none = dataclasses.replace(StepPlan.make([(tokens(5, 1), 2, 0)]), final_slots=np.array([-1], np.int32))
    assert runner.logits(none).shape == (1, cpu_model.cfg.vocab_size)


def check_drawn_tokens_feed_the_next_step(runner):
    """Decode rows whose token is -1 take the tokens their slots drew in the last step (kept on
    the device): the same logits as rows fed those tokens from the host."""
    snapshot = [t.clone() for t in runner.pool.tensors()]
    prompts = StepPlan.make([(tokens(9, 1), 0, 0), (tokens(5, 2), 3, 0)])
    prompts.temperature, prompts.top_k = np.zeros(2, np.float32), np.zeros(2, np.int32)  # greedy
    prompts.top_p, prompts.seed, prompts.position = np.ones(2, np.float32), np.zeros(2, np.int64), np.zeros(2, np.int64)
    prompts.sample_slots = np.array([0, 3], np.int32)
    drawn = runner.launch(prompts).get()
    fed_on_device = runner.logits(StepPlan.make(decode=[(-1, 0, 9), (-1, 3, 5)])).clone()
    for t, s in zip(runner.pool.tensors(), snapshot):
        t.copy_(s)
    runner.logits(prompts)
    given = runner.logits(StepPlan.make(decode=[(int(drawn[0]), 0, 9), (int(drawn[1]), 3, 5)]))
    assert torch.equal(fed_on_device, given)


def test_a_dropped_engine_is_freed_without_the_collector(cpu_model):
    """Found on the GPU: a runner whose graph runner held its bound methods was a reference cycle,
    alive until a garbage collection; one that ran inside another engine's graph capture reset
    the dead runner's graphs there and broke the capture."""
    gc.disable()
    try:
        engine = Engine(cpu_model, num_slots=2, buckets=BUCKETS, progress=False)
        engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))
        refs = [weakref.ref(engine), weakref.ref(engine.runner), weakref.ref(engine.runner.graphs)]
        del engine
        assert [r() for r in refs] == [None, None, None]
    finally:
        gc.enable()


def test_drawn_tokens_feed_the_next_step_cpu(cpu_model):
    check_drawn_tokens_feed_the_next_step(make_runner(cpu_model))


@pytest.fixture(scope="module", params=["tiny-hybrid", "tiny-mamba2", "tiny-nemotron-h", "tiny-hybrid:fp8",
                                        "tiny-nemotron-h:fp8"])
def gpu_model(request):
    """Both decode paths: layer by layer (the hybrid with experts), fused with programmatic
    launches (Mamba2, and the hybrid without experts); and both with FP8 linears (quantized at
    load: the FP8 skinny projections and grouped experts, and FP8 tensor-core products)."""
    name, _, quantization = request.param.partition(":")
    return Model.from_preset(name, dtype=torch.bfloat16, device="cuda", quantization=quantization or None)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_graph_replay_equals_eager(gpu_model, overlap):
    eager = run_script(make_runner(gpu_model, overlap=overlap), script())
    runner = make_runner(gpu_model, overlap=overlap)
    report = runner.capture(progress=False)
    # a forward graph and a sampling graph per mode x processed x logprobs each
    assert report.graphs == len(BUCKETS.all()) * 13
    graphed = run_script(runner, script())
    for a, b in zip(eager, graphed):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_drawn_tokens_feed_the_next_step_gpu(gpu_model):
    """On both decode paths (fused: Mamba2, Nemotron-H; layer by layer: the hybrid with experts)
    the embedding kernel reads them."""
    runner = make_runner(gpu_model)
    runner.capture(progress=False)
    check_drawn_tokens_feed_the_next_step(runner)


@pytest.mark.gpu
def test_fork_changes_no_result(gpu_model):
    plain, forked = make_runner(gpu_model, overlap=False), make_runner(gpu_model, overlap=True)
    for r in (plain, forked):
        r.capture(progress=False)
    for a, b in zip(run_script(plain, script()), run_script(forked, script())):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_poisoned_buffers_change_nothing_gpu(gpu_model):
    clean_runner = make_runner(gpu_model)
    clean_runner.capture(progress=False)
    clean = run_script(clean_runner, script())
    dirty_runner = make_runner(gpu_model)
    dirty_runner.capture(progress=False)
    poison(dirty_runner)
    for a, b in zip(clean, run_script(dirty_runner, script())):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_steady_state_allocates_nothing_and_never_syncs(gpu_model):
    runner = make_runner(gpu_model)
    runner.capture(progress=False)
    plans = script()
    run_script(runner, plans)  # first use of every bucket outside the check
    assert_no_allocation_or_sync(lambda: [runner.logits(p) for _ in range(20) for p in plans])


def assert_no_allocation_or_sync(run) -> None:
    """``run()`` allocates no device memory and never syncs with the host."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


def drawn(plan: StepPlan, temperature: float, top_p: float, processed: bool, logprobs: bool) -> StepPlan:
    """``plan`` with every row drawn (kept in its slot), with or without processors and logprobs."""
    n = plan.num_rows
    slots = np.concatenate([plan.prefill_slots, plan.decode_slots]).astype(np.int32)
    plan.temperature, plan.top_k = np.full(n, temperature, np.float32), np.zeros(n, np.int32)
    plan.top_p, plan.seed, plan.position = np.full(n, top_p, np.float32), np.arange(n), np.full(n, 3)
    plan.sample_slots, plan.logprobs = slots, logprobs
    if processed:
        plan.presence, plan.frequency = np.full(n, 0.5, np.float32), np.full(n, 1.0, np.float32)
        plan.repetition, plan.processor_slots = np.full(n, 1.3, np.float32), slots
        E = MAX_BIASED
        plan.bias_ids = np.tile(np.arange(E, dtype=np.int32), (plan.num_prefill, 1))
        plan.bias_values = np.full((plan.num_prefill, E), -1.0, np.float32)
        plan.bias_until = np.full((plan.num_prefill, E), 2, np.int32)
    return plan


def verify_plan() -> StepPlan:
    """Two verify sequences (a kept draft replayed, 1 pending token, 3 drafts; 1 pending, 2
    drafts) after the script, checkpointed into their own slots, their final states dropped."""
    i32 = lambda v: np.asarray(v, dtype=np.int32)  # noqa: E731
    return StepPlan(prefill_tokens=np.asarray(tokens(4, 7) + tokens(3, 8)), prefill_lens=i32([4, 3]),
                    prefill_slots=i32([0, 3]), prefill_context=i32([15, 22]), snapshot_slots=i32([0, 3]),
                    snapshot_tokens=i32([1, 1]), final_slots=i32([-1, -1]), prefill_logits=i32([4, 3]),
                    replay_lens=i32([1, 0]))


@pytest.mark.gpu
def test_verify_steps_allocate_nothing_and_never_sync(gpu_model):
    """A speculative step in its verify bucket (1 + 3 logit rows a sequence), greedy and
    sampled: replays only, one copy of its inputs."""
    runner = make_runner(gpu_model, buckets=dataclasses.replace(BUCKETS, drafts=3))
    runner.capture(progress=False)
    run_script(runner, script())
    sampled = verify_plan()
    n = sampled.num_rows
    sampled.temperature, sampled.top_k = np.full(n, 0.8, np.float32), np.zeros(n, np.int32)
    sampled.top_p, sampled.seed, sampled.position = np.full(n, 0.9, np.float32), np.arange(n), np.arange(n)
    sampled.sample_slots = np.full(n, -1, np.int32)  # a verify step's tokens go back through the host
    steps = [verify_plan(), sampled]
    assert all(runner.graphs.captured(runner.bucket_for(p)) and runner.bucket_for(p).drafts == 3 for p in steps)
    for plan in steps:
        runner.launch(plan).get()
    assert_no_allocation_or_sync(lambda: [runner.launch(plan) for _ in range(5) for plan in steps])


@pytest.mark.gpu
def test_every_draw_variant_allocates_nothing_and_never_syncs(gpu_model):
    """Whole steps, forward and draw, in every sampling mode with and without processors and
    logprobs: replays only, and one copy of the processors' inputs where they run."""
    runner = make_runner(gpu_model)
    runner.capture(progress=False)
    variants = [(t, p, proc, lp) for t, p in ((0.0, 1.0), (0.8, 1.0), (0.8, 0.9))
                for proc in (False, True) for lp in (False, True)]
    steps = [drawn(plan, *v) for v in variants for plan in script()]
    for plan in steps:
        runner.launch(plan).get()
    assert_no_allocation_or_sync(lambda: [runner.launch(plan) for plan in steps])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for plan in steps:
            runner.launch(plan)
        torch.cuda.synchronize()
    h2d = [e for e in prof.events() if "HtoD" in e.name]
    assert len(h2d) == len(steps) + sum(plan.processed for plan in steps)


@pytest.mark.gpu
def test_one_host_to_device_copy_per_step(gpu_model):
    runner = make_runner(gpu_model)
    runner.capture(progress=False)
    plans = script()
    run_script(runner, plans)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for p in plans:
            runner.logits(p)
        torch.cuda.synchronize()
    h2d = [e for e in prof.events() if "HtoD" in e.name]
    assert len(h2d) == len(plans)


@pytest.mark.gpu
def test_folded_norms_in_the_streamed_fused_decode_gpu():
    """Block norm weights (moved off ones) folded into the projections, the fused decode
    streaming K: the Triton products skip the unit norm weight, and the graphs give the unfolded
    model's logits to bf16 rounding (the folded weights are rounded once; the CPU tests hold the
    fold to fp32 equality, the kernel tests the skipped weight)."""
    cfg = preset_config("tiny-hybrid")
    weights = random_weights(cfg, dtype=torch.bfloat16, device="cuda", seed=3)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for name, t in weights.items():
        if name.endswith("norm.weight"):
            t.add_(0.3 * torch.randn(t.shape, generator=gen, device="cuda").to(t.dtype))
    folded = Model(cfg, weights, DecodeOptions(tile_k=16), fold_norms=True)
    plain = Model(cfg, weights, DecodeOptions(tile_k=16), fold_norms=False)
    assert folded.options.fused and sum(b.norm.unit for b in folded.blocks) == 5  # all but the MoE block
    results = []
    for model in (folded, plain):
        runner = make_runner(model)
        runner.capture(progress=False)
        results.append(run_script(runner, script()))
    for a, b in zip(*results):
        # bf16 through six layers: 0.013 on average against logits of 0.8 on the H200; a norm
        # weight lost or applied twice (+-30% on every projection's input) moves them by far more
        diff = (a.float() - b.float()).abs()
        assert diff.mean() < 0.03 and diff.max() < 0.15, (diff.mean().item(), diff.max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("tile_k", [None, 16], ids=["one-tile", "streamed"])
@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-nemotron-h", "tiny-hybrid", "tiny-granite", "tiny-falcon-h1"])
def test_fused_decode_equals_layer_by_layer_gpu(preset, tile_k):
    """Graphs of the fused decode path (Triton skinny projections chained by programmatic
    dependent launch) against graphs of the layer-by-layer path: the same tokens and close
    logits over a script whose decode steps take the fused path; with K in one tile, and
    streamed as on Nemotron-H-8B (every projection, at the 1-2 rows Nemotron-H-8B takes fused:
    a grouped gated norm then a kernel of its own, a one-group one, Granite's, in out_proj's
    stream; Falcon-H1's gate in the state update either way)."""
    fused = Model.from_preset(preset, dtype=torch.bfloat16, device="cuda", options=DecodeOptions(tile_k=tile_k))
    assert fused.options.fused and fused.options.max_rows == (4 if tile_k is None else 2)
    layered = fused.with_options(DecodeOptions(fused=False))
    assert not layered.options.fused
    results = []
    for model in (fused, layered):
        runner = make_runner(model)
        runner.capture(progress=False)
        results.append(run_script(runner, script()))
    for a, b in zip(*results):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@torch.no_grad()
def test_padding_rows_add_no_expert_to_a_step(device):
    """A MoE layer reads the experts its live rows choose and no more: one decode row padded to
    a bucket of 8, and a verify-style chunk of 5 tokens padded to 32, route to the same experts
    as in buckets of their exact size, with the same logits (16 experts, 2 a token, so padding
    routed as itself would add some)."""
    cfg = dataclasses.replace(preset_config("tiny-hybrid"), n_routed_experts=16, num_experts_per_tok=2)
    dtype = torch.float32
    model = Model(cfg, random_weights(cfg, dtype=dtype, device=device, seed=1), DecodeOptions(fused=False))
    pool = StatePool(cfg, 4, max_context=64, dtype=dtype, device=device)
    for t in pool.tensors():
        t.normal_(0, 0.1)
    start = [t.clone() for t in pool.tensors()]  # each run from the same states
    plans = [StepPlan.make(decode=[(7, 0, 10)]), StepPlan.make([(tokens(5, 1), 1, 3)])]
    exact = BucketSet(decode=(1,), mixed_decode=(0,), prefill=(5,), max_prefill_seqs=1)
    padded = BucketSet(decode=(8,), mixed_decode=(0,), prefill=(32,), max_prefill_seqs=1)
    for plan in plans:
        seen, logits = [], []
        for buckets in (exact, padded):
            for t, t0 in zip(pool.tensors(), start):
                t.copy_(t0)
            runner = StepRunner(model, pool, buckets)
            bucket = runner.bucket_for(plan)
            runner.buffers.fill(plan, bucket)
            runner.buffers.upload()
            experts = {}
            out = model.forward(runner.buffers.inputs(bucket), pool,
                                observe=lambda layer, idx: experts.__setitem__(layer, set(idx.flatten().tolist())))
            seen.append(experts)
            logits.append(out[: plan.num_rows].clone())
        assert seen[0] == seen[1] and seen[0]
        torch.testing.assert_close(logits[0], logits[1])
