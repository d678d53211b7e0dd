"""The logits processors against HF's processors and OpenAI's published formulas, and the draw's
log-probabilities against log_softmax; on the CPU and, where there is one, the GPU."""

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from mambastep.kernels.logits_processors import MAX_LOGPROBS, add_bias, logprobs, penalize_torch, penalize_triton

V = 97


def _logits(rows, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, V, generator=g) * 3).to(device)


def _history(rows, seed=0):
    """Per row: prompt ids and output ids (repeats included)."""
    g = np.random.default_rng(seed)
    return [(g.integers(0, V, g.integers(1, 30)).tolist(), g.integers(0, V, g.integers(0, 40)).tolist())
            for _ in range(rows)]


def _counts_and_seen(history, device):
    """Slot tables with two rows of poison around each row's, and each row's slot."""
    counts = torch.randint(0, 50, (3 * len(history), V), dtype=torch.int32)
    seen = torch.rand(3 * len(history), V) < 0.5
    rows = torch.arange(len(history)) * 3 + 1
    for r, (prompt, output) in zip(rows, history):
        counts[r], seen[r] = 0, False
        for t in output:
            counts[r, t] += 1
        seen[r, prompt] = True
    return counts.to(device), seen.to(device), rows.to(device)


# the kernel (compiled on CUDA, else in Triton's interpreter) and its torch reference
IMPLS = pytest.mark.parametrize("penalize", [penalize_torch, penalize_triton], ids=["torch", "triton"])


@IMPLS
@pytest.mark.parametrize("penalty", [1.0, 1.3, 0.7])
def test_repetition_penalty_equals_hf_over_prompt_and_output(device, penalize, penalty):
    history = _history(6, seed=1)
    logits = _logits(6, device=device)
    counts, seen, rows = _counts_and_seen(history, device)
    zeros = torch.zeros(6, device=device)
    got = penalize(logits.clone(), counts, seen, rows, zeros, zeros, torch.full((6,), penalty, device=device))
    for r, (prompt, output) in enumerate(history):
        ids = torch.tensor([prompt + output])
        ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[r : r + 1].cpu())
        torch.testing.assert_close(got[r : r + 1].cpu(), ref, rtol=0, atol=0)


@IMPLS
def test_frequency_and_presence_equal_openais_formula(device, penalize):
    # mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, over the output only
    history = _history(5, seed=2)
    logits = _logits(5, seed=3, device=device)
    counts, seen, rows = _counts_and_seen(history, device)
    presence = torch.tensor([0.0, 0.5, -1.0, 2.0, 1.5], device=device)
    frequency = torch.tensor([0.0, 0.25, 1.0, -2.0, 0.75], device=device)
    got = penalize(logits.clone(), counts, seen, rows, presence, frequency, torch.ones(5, device=device))
    for r, (_, output) in enumerate(history):
        ref = logits[r].cpu().clone()
        for j in set(output):
            c = output.count(j)
            ref[j] = ref[j] - c * float(frequency[r]) - float(c > 0) * float(presence[r])
        torch.testing.assert_close(got[r].cpu(), ref, rtol=1e-6, atol=1e-6)


@IMPLS
def test_rows_without_penalties_are_left_bit_for_bit(device, penalize):
    history = _history(4, seed=4)
    logits = _logits(4, seed=5, device=device)
    counts, seen, rows = _counts_and_seen(history, device)
    zeros = torch.zeros(4, device=device)
    got = penalize(logits.clone(), counts, seen, rows, zeros, zeros, torch.ones(4, device=device))
    assert torch.equal(got, logits)


def test_the_kernel_equals_its_reference_bit_for_bit_over_blocks(device):
    """Rows over several vocabulary blocks and a ragged last one, every penalty on at once."""
    history = _history(7, seed=8)
    g = torch.Generator().manual_seed(9)
    logits = (torch.randn(7, V, generator=g) * 3).to(device)
    counts, seen, rows = _counts_and_seen(history, device)
    params = [(torch.rand(7, generator=g) * 4 - 2).to(device) for _ in range(2)]
    repetition = (torch.rand(7, generator=g) + 0.5).to(device)
    ref = penalize_torch(logits.clone(), counts, seen, rows, *params, repetition)
    got = penalize_triton(logits.clone(), counts, seen, rows, *params, repetition, block=32)
    assert torch.equal(got, ref)


def test_bias_equals_hf_sequence_bias_and_min_tokens_equals_hf(device):
    logits = _logits(3, seed=6, device=device)
    bias = {5: -100.0, 17: 3.5, 96: 100.0}
    stops, min_tokens = [2, 9], 4
    E = 8
    ids = torch.zeros(3, E, dtype=torch.int64)
    values = torch.zeros(3, E)
    until = torch.zeros(3, E, dtype=torch.int64)
    for e, (t, b) in enumerate(bias.items()):
        ids[:, e], values[:, e], until[:, e] = t, b, 2**31 - 1
    for e, t in enumerate(stops, start=len(bias)):
        ids[:, e], values[:, e], until[:, e] = t, -float("inf"), min_tokens
    position = torch.tensor([0, 3, 4])  # the draw's index: the first two rows are short of min_tokens
    got = add_bias(logits.clone(), ids.to(device), values.to(device), until.to(device), position.to(device))
    seq_bias = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    prompt = [1, 2, 3]
    for r in range(3):
        ids_so_far = torch.tensor([prompt + [7] * int(position[r])])
        ref = seq_bias(ids_so_far, logits[r : r + 1].cpu().clone())
        ref = MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, stops)(ids_so_far, ref)
        torch.testing.assert_close(got[r : r + 1].cpu(), ref, rtol=0, atol=0)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.8])
def test_logprobs_equal_log_softmax_of_the_scaled_logits(device, temperature):
    logits = _logits(5, seed=7, device=device)
    t = torch.full((5,), temperature, device=device)
    top_k = torch.zeros(5, dtype=torch.int32, device=device)
    tokens = torch.tensor([0, 5, 96, 50, 3], device=device)
    out = (torch.zeros(5, device=device), torch.zeros(5, MAX_LOGPROBS, device=device),
           torch.zeros(5, MAX_LOGPROBS, dtype=torch.int64, device=device))
    logprobs(logits, t, top_k, tokens, out)
    ref = torch.log_softmax(logits.cpu().double() / (temperature or 1.0), dim=-1)
    drawn, top_values, top_ids = (x.cpu() for x in out)
    torch.testing.assert_close(drawn.double(), ref.gather(1, tokens.cpu().unsqueeze(-1)).squeeze(-1),
                               rtol=0, atol=1e-5)
    order = ref.argsort(dim=-1, descending=True)[:, :MAX_LOGPROBS]
    assert torch.equal(top_ids, order)
    torch.testing.assert_close(top_values.double(), ref.gather(1, order), rtol=0, atol=1e-5)
