"""The scheduler: every running decode each step, then prompt chunks under the token budget,
first-come first-served, queueing when no slot is free."""

import numpy as np

from mambastep.runtime.request import Request, SamplingParams
from mambastep.runtime.scheduler import Scheduler


def request(i, n, **params):
    return Request(i, np.arange(1, n + 1, dtype=np.int64), SamplingParams(**params), seed=100 + i)


def test_a_long_prompt_is_chunked_under_the_budget_and_then_decodes():
    s = Scheduler(num_slots=2, token_budget=8, max_prefill_seqs=2, max_decode=4)
    r = request(0, 20)
    s.add(r)
    plan, rows = s.schedule()
    assert plan.prefill_lens.tolist() == [8] and plan.prefill_context.tolist() == [0] and rows == [None]
    assert plan.prefill_tokens.tolist() == list(range(1, 9)) and r.slot == 0
    plan, rows = s.schedule()
    assert plan.prefill_lens.tolist() == [8] and plan.prefill_context.tolist() == [8] and rows == [None]
    plan, rows = s.schedule()  # the last chunk ends the prompt: its row draws the first token
    assert plan.prefill_lens.tolist() == [4] and plan.num_decode == 0 and rows == [r]
    assert plan.sample_slots.tolist() == [0] and plan.seed.tolist() == [100]
    r.output.append(7)
    plan, rows = s.schedule()
    assert plan.num_prefill == 0 and plan.decode_slots.tolist() == [0] and plan.decode_context.tolist() == [20]
    assert plan.decode_tokens.tolist() == [-1] and rows == [r] and r.computed == 21
    assert plan.position.tolist() == [1]


def test_admission_is_fcfs_and_queues_when_slots_run_out():
    s = Scheduler(num_slots=2, token_budget=100, max_prefill_seqs=4, max_decode=4)
    reqs = [request(i, 3) for i in range(3)]
    for r in reqs:
        s.add(r)
    plan, rows = s.schedule()
    assert rows == reqs[:2] and plan.prefill_slots.tolist() == [0, 1] and list(s.waiting) == [reqs[2]]
    plan, rows = s.schedule()  # both decode; the third still waits for a slot
    assert plan.num_prefill == 0 and rows == reqs[:2]
    reqs[0].finish_reason = "stop"
    s.release(reqs[0])
    plan, rows = s.schedule()  # the freed slot goes to the queued request, beside the decode
    assert plan.prefill_slots.tolist() == [0] and plan.decode_slots.tolist() == [1]
    assert rows == [reqs[2], reqs[1]] and not s.waiting


def test_prefill_continues_before_new_prompts_and_respects_the_sequence_limit():
    s = Scheduler(num_slots=4, token_budget=10, max_prefill_seqs=2, max_decode=4)
    a, b, c = request(0, 14), request(1, 3), request(2, 3)
    for r in (a, b, c):
        s.add(r)
    plan, _ = s.schedule()
    assert plan.prefill_lens.tolist() == [10] and [r.slot for r in (a, b, c)] == [0, -1, -1]
    plan, _ = s.schedule()  # a's rest first, then b; c waits: two sequences a step
    assert plan.prefill_lens.tolist() == [4, 3] and plan.prefill_slots.tolist() == [0, 1] and list(s.waiting) == [c]


def test_decode_rows_are_capped_and_releasing_a_queued_request_drops_it():
    s = Scheduler(num_slots=3, token_budget=100, max_prefill_seqs=4, max_decode=2)
    reqs = [request(i, 2) for i in range(3)]
    for r in reqs:
        s.add(r)
    s.schedule()
    plan, rows = s.schedule()
    assert plan.num_decode == 2 and rows == reqs[:2]
    q = request(9, 2)
    s.add(q)
    s.release(q)
    assert q not in s.waiting and sorted(s.free_slots) == []
    for r in reqs:
        s.release(r)
    assert sorted(s.free_slots) == [0, 1, 2] and not s.has_work()


def test_a_snapshot_inside_a_chunk_adds_no_step():
    """With a prefix cache (blocks of 4): a 14-token prompt wants a snapshot at 12, inside its
    second 8-token chunk, which starts on a block boundary: the plan names the snapshot's slot
    and the chunk's tokens before it, and the prompt ends in two steps as without a cache. So
    does a second prompt whose chunk starts off a boundary (the budget's rest): the kernels cut
    their chunk grid at the snapshot's row."""
    from mambastep.runtime.prefix_cache import PrefixCache

    s = Scheduler(num_slots=2, token_budget=8, max_prefill_seqs=2, max_decode=4,
                  prefix_cache=PrefixCache(slots=[2, 3], block=4))
    a = request(0, 14)
    s.add(a)
    plan, _ = s.schedule()
    assert plan.prefill_lens.tolist() == [8] and len(plan.snapshot_slots) == 0
    b = request(1, 10)
    s.add(b)
    plan, rows = s.schedule()  # a's rest, 6 tokens, its snapshot 4 in; b gets 2 of the budget
    assert plan.prefill_lens.tolist() == [6, 2] and rows == [a, None]
    assert plan.snapshot_slots.tolist() == [2, -1] and plan.snapshot_tokens.tolist()[0] == 4
    assert s.snapshots == [(a.slot, 2, 12)]
    a.output.append(5)
    plan, _ = s.schedule()  # b from 2, off a boundary: its rest in one chunk, the snapshot at 8
    assert plan.prefill_lens.tolist() == [8] and plan.prefill_context.tolist() == [2]
    assert plan.snapshot_slots.tolist() == [3] and plan.snapshot_tokens.tolist() == [6]
