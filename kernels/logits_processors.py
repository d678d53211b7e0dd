"""What a request asks of its logits before the draw, and the log-probabilities of the draw:
static shapes, no host sync and no branch on data, so they are captured in the step's sampling
graph as they are. The penalties are one Triton kernel on CUDA (``penalize_triton``: a pass
over the logits reading each row's slot of the count tables in place) beside their torch
reference (``penalize_torch``, the CPU path); the rest are torch ops on either.

Before the draw, in this order (each row's parameters; the neutral value leaves a row as it is):

1. penalties over the tokens the request has seen (``penalize``):
   repetition  HF's and vLLM's: a seen token's logit (prompt or output) is divided by the
               penalty where positive, multiplied where negative (1 = off)
   frequency   OpenAI's: ``logit -= frequency * count`` (count: times in the output; 0 = off)
   presence    OpenAI's: ``logit -= presence * (count > 0)`` (0 = off)
2. a sparse bias (``add_bias``): up to ``MAX_BIASED`` (token, value, until) entries per request,
   each added while the draw's position is below ``until``. ``logit_bias`` is an entry per token
   that never ends; ``min_tokens`` is ``-inf`` on each stop token until that many are drawn.

The bias comes last, so a ban (``-inf``, or OpenAI's -100) holds whatever the penalties did.

``logprobs``: of ``log_softmax(logits / T)`` over the processed logits, with T the row's
temperature (1 for a greedy row), as the draw sees them before any top-k / top-p cut: the drawn
token's, and the ``MAX_LOGPROBS`` most likely tokens' (ids and values, highest first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sample import _greedy, _scaled

__all__ = ["MAX_BIASED", "MAX_LOGPROBS", "add_bias", "logprobs", "penalize", "penalize_torch", "penalize_triton"]

MAX_BIASED = 128  # bias entries per request: logit_bias tokens, plus the stop tokens min_tokens masks
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs maximum)
BLOCK_V = 2048


def penalize(logits, counts, seen, rows, presence, frequency, repetition) -> torch.Tensor:
    """Apply the penalties to ``logits`` in place and return it.

    logits [R, V] float32; counts [S, V] int32, each output token's occurrences per slot;
    seen [S, V] bool, the prompt's tokens per slot; rows [R] int64, the slot row each logit row
    reads; presence, frequency, repetition [R] float32.
    """
    if logits.is_cuda:
        return penalize_triton(logits, counts, seen, rows, presence, frequency, repetition)
    return penalize_torch(logits, counts, seen, rows, presence, frequency, repetition)


@triton.jit
def _penalize_kernel(logits_ptr, counts_ptr, seen_ptr, rows_ptr, presence_ptr, frequency_ptr, repetition_ptr,
                     V, s_logits, s_table, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs < V
    row = tl.load(rows_ptr + r).to(tl.int64) * s_table
    x = tl.load(logits_ptr + r.to(tl.int64) * s_logits + offs, mask=live)
    c = tl.load(counts_ptr + row + offs, mask=live, other=0)
    output = c > 0
    seen = tl.load(seen_ptr + row + offs, mask=live, other=0) != 0
    rep = tl.load(repetition_ptr + r)
    x = tl.where(output | seen, tl.where(x > 0, tl.math.div_rn(x, rep), x * rep), x)
    # two products, then their sum, then the difference: the torch reference's roundings
    penalty = tl.load(frequency_ptr + r) * c.to(tl.float32) + tl.load(presence_ptr + r) * output.to(tl.float32)
    tl.store(logits_ptr + r.to(tl.int64) * s_logits + offs, x - penalty, mask=live)


def penalize_triton(logits, counts, seen, rows, presence, frequency, repetition, block: int = BLOCK_V):
    """``penalize`` in one kernel (the same arguments; the tables' last dim contiguous)."""
    R, V = logits.shape
    if R:
        _penalize_kernel[(R, triton.cdiv(V, block))](
            logits, counts, seen.view(torch.uint8), rows, presence, frequency, repetition, V, logits.stride(0),
            counts.stride(0), BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return logits


def penalize_torch(logits, counts, seen, rows, presence, frequency, repetition) -> torch.Tensor:
    """``penalize`` in torch ops: the reference, and the CPU path."""
    counts, seen = counts[rows], seen[rows]
    output = counts > 0
    rep = repetition.unsqueeze(-1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(output | seen, penalized, logits))
    logits -= frequency.unsqueeze(-1) * counts + presence.unsqueeze(-1) * output
    return logits


def add_bias(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, until: torch.Tensor,
             position: torch.Tensor) -> torch.Tensor:
    """Add each row's live bias entries to ``logits`` in place and return it.

    logits [R, V] float32; ids [R, E] int64 token ids, values [R, E] float32, until [R, E] int64:
    entry e of row r adds ``values[r, e]`` to token ``ids[r, e]`` while ``position[r] < until[r, e]``
    (unused entries: until 0). Entries on one token add up (a logit_bias and a min_tokens stop).
    """
    live = position.unsqueeze(-1) < until
    logits.scatter_add_(1, ids, torch.where(live, values, 0.0))
    return logits


def logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, tokens: torch.Tensor,
             out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """The draw's log-probabilities into ``out`` = (drawn [R] float32, top values [R, K] float32,
    top ids [R, K] int64), K = ``MAX_LOGPROBS`` (at most V).

    logits [R, V] float32 (processed); temperature [R] float32, top_k [R] int32 as the draw
    takes them (a greedy row is scaled by 1, as the draw scales it); tokens [R] int64, the drawn.
    """
    drawn, top_values, top_ids = out
    lp = torch.log_softmax(_scaled(logits, temperature, _greedy(temperature, top_k)), dim=-1)
    torch.gather(lp, 1, tokens.unsqueeze(-1), out=drawn.unsqueeze(-1))
    torch.topk(lp, top_values.shape[1], dim=-1, out=(top_values, top_ids))
