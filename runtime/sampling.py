"""Sampling inside the step graph: greedy, temperature, top-k and top-p, with per-request seeds.

``sample`` is a fixed sequence of kernels over static shapes: no host sync, no branch on data,
so it is captured into the step's CUDA graph (one graph per rows x mode) and its token ids stay
on the device as the next step's input. On CUDA the modes run Triton kernels
(``kernels/sample.py``; the filtered mode after a torch sort); on the CPU, torch ops
(``sample_torch``, also the kernels' reference).

Randomness is counter-based. Each (seed, position, token id) hashes to its own uniform with
integer ops, and the Gumbel-max trick turns the uniforms into a draw from softmax(logits / T)
restricted to the allowed tokens. A request's token therefore depends only on its own logits,
seed and position: not on the other rows of the batch, not on the row it sits in, and replaying
a request reproduces its tokens.

Modes are a static per-step choice of the host (``sampling_mode`` picks the cheapest that
serves every row):

    greedy    argmax only; every row must be greedy
    sample    temperature only: top-k and top-p are ignored, no sort
    filtered  top-k and/or top-p: one full-vocabulary sort per row

A row gets the same token from every mode that can serve it, so the mode is a cost choice, never
a semantic one. Greedy rows (temperature 0 or top_k 1) take the argmax of the raw logits in
every mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.sample import KEY_MUL, KEY_OFF, MUL1, MUL2, UNIFORM_BITS, filtered_draw_triton, sample_triton

__all__ = ["MODES", "SamplingParams", "sample", "sample_ref", "sample_torch", "sampling_mode"]

MODES = ("greedy", "sample", "filtered")

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_MASK32 = 0xFFFFFFFF
# The hash's constants live beside its Triton twin (kernels/sample.py). Both multipliers are
# below 2**31, so a 32-bit value times either stays below 2**63: the int64 math here never
# overflows and needs no wraparound guarantee from any device.


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request samples. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 are off
    (top-k applies first, then top-p on the renormalised rest). ``seed`` None lets the engine
    assign one from its own counter. ``stop_token_ids`` may be any iterable of ints."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        t = self.temperature
        if not (_is_real(t) and math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature: expected a finite number >= 0, got {t!r}")
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise ValueError(f"top_k: expected an int >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if not (_is_real(p) and 0 < p <= 1):
            raise ValueError(f"top_p: expected a number in (0, 1], got {p!r}")
        if self.seed is not None and not (_is_int(self.seed) and _INT64_MIN <= self.seed <= _INT64_MAX):
            raise ValueError(f"seed: expected None or an int that fits in int64, got {self.seed!r}")
        if not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens: expected an int >= 1, got {self.max_tokens!r}")
        try:
            stops = tuple(self.stop_token_ids)
        except TypeError:
            raise ValueError(f"stop_token_ids: expected an iterable of ints, got {self.stop_token_ids!r}") from None
        if not all(_is_int(s) and s >= 0 for s in stops):
            raise ValueError(f"stop_token_ids: expected token ids >= 0, got {stops!r}")
        # frozen: normalise lists to a hashable tuple of plain ints
        object.__setattr__(self, "stop_token_ids", tuple(int(s) for s in stops))
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ValueError(f"ignore_eos: expected a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def sampling_mode(temperature, top_k, top_p, vocab_size: int | None = None) -> str:
    """The cheapest mode that serves every row, from host arrays of the rows' parameters.

    temperature: [n] float, top_k: [n] int, top_p: [n] float (numpy or sequences). Without
    ``vocab_size`` any top_k > 0 counts as a filter; with it, top_k >= vocab_size is off.
    """
    t, k, p = np.asarray(temperature), np.asarray(top_k), np.asarray(top_p)
    drawn = (t > 0) & (k != 1)
    if not drawn.any():
        return "greedy"
    k_on = (k > 0) if vocab_size is None else (k > 0) & (k < vocab_size)
    return "filtered" if (drawn & (k_on | (p < 1))).any() else "sample"


def _mix32(x):
    """Mix 32-bit values held in int64 tensors (or Python ints) in [0, 2**32).

    The in-place operators update a tensor argument in place (callers pass temporaries) and
    rebind a Python int, so the same code is the exact-integer reference for the tests.
    """
    x ^= x >> 16
    x *= MUL1
    x &= _MASK32
    x ^= x >> 15
    x *= MUL2
    x &= _MASK32
    x ^= x >> 15
    return x


def _row_keys(seed, position):
    """Per-draw keys from seed and position: int64 ``[R]`` each (or Python ints).

    Returns ``(mult, offset)``, two 32-bit words from two independent hash chains over the
    four 32-bit halves of seed and position; ``mult`` is odd.
    """
    # & and >> on int64 keep two's-complement bits, so negative seeds split like unsigned ones
    words = (seed & _MASK32, (seed >> 32) & _MASK32, position & _MASK32, (position >> 32) & _MASK32)
    mult, offset = KEY_MUL, KEY_OFF
    for w in words:
        mult = _mix32(mult ^ w)
        offset = _mix32(offset ^ w)
    return mult | 1, offset


def _random_bits(mult, offset, token_ids):
    """``UNIFORM_BITS`` random bits per (draw, token): int64 ``[R, V]``.

    mult, offset: int64 ``[R, 1]`` from ``_row_keys``; token_ids: int64 ``[V]`` or ``[R, V]``.
    Each row walks a Weyl sequence ``token * mult + offset`` (mod 2**32) through the mixer, so
    two draws share a stream only if both key words collide. token_ids * mult stays below 2**63
    for any vocabulary under 2**31 tokens.
    """
    x = token_ids * mult
    x += offset
    x &= _MASK32
    return _mix32(x) >> (32 - UNIFORM_BITS)


def _gumbel(mult, offset, token_ids) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))``, float32 with ``_random_bits``'s shape."""
    u = _random_bits(mult, offset, token_ids).to(torch.float32)
    u.add_(0.5).mul_(2.0**-UNIFORM_BITS)
    return u.log_().neg_().log_().neg_()


def _check(logits, params, out) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [R, V], got {tuple(logits.shape)}")
    R = logits.shape[0]
    for name, t in params.items():
        if t.shape != (R,):
            raise ValueError(f"{name}: expected [{R}], got {tuple(t.shape)}")
    if out.shape != (R,) or out.dtype != torch.int64:
        raise ValueError(f"out: expected [{R}] int64, got {tuple(out.shape)} {out.dtype}")


def sample(logits, temperature, top_k, top_p, seed, position, *, mode: str, out) -> torch.Tensor:
    """Draw one token per row, without host sync; capturable in a CUDA graph.

    logits:      [R, V] float32 (other float dtypes are upcast)
    temperature: [R] float32, 0 = greedy
    top_k:       [R] int32, 0 (or >= V) = off, 1 = greedy
    top_p:       [R] float32 in (0, 1], 1 = off
    seed:        [R] int64, the request's seed
    position:    [R] int64, the index of this draw within its request
    mode:        "greedy", "sample" or "filtered" (see the module docstring)
    out:         [R] int64, written and returned
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    _check(logits, dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, position=position), out)
    if not logits.is_cuda:
        return sample_torch(logits, temperature, top_k, top_p, seed, position, mode=mode, out=out)
    if mode == "filtered":
        vals, order = _ranked(_scaled(logits.float(), temperature, _greedy(temperature, top_k)))
        return filtered_draw_triton(vals, order, temperature, top_k, top_p, seed, position, out=out)
    return sample_triton(logits.float(), temperature, top_k, seed, position, draw=mode == "sample", out=out)


def sample_torch(logits, temperature, top_k, top_p, seed, position, *, mode: str, out) -> torch.Tensor:
    """``sample`` in torch ops on any device (checked arguments: call ``sample``)."""
    logits = logits.float()
    argmax = logits.argmax(dim=-1)
    if mode == "greedy":
        return out.copy_(argmax)
    is_greedy = _greedy(temperature, top_k)
    scaled = _scaled(logits, temperature, is_greedy)
    mult, offset = (k.unsqueeze(-1) for k in _row_keys(seed, position))
    if mode == "sample":
        tokens = torch.arange(logits.shape[-1], device=logits.device)
        drawn = (scaled + _gumbel(mult, offset, tokens)).argmax(dim=-1)
    else:
        drawn = _draw_filtered(*_ranked(scaled), top_k, top_p, mult, offset)
    return out.copy_(torch.where(is_greedy, argmax, drawn))


def _greedy(temperature, top_k) -> torch.Tensor:
    return (temperature == 0) | (top_k == 1)


def _scaled(logits, temperature, is_greedy) -> torch.Tensor:
    """logits / T per row; greedy rows divide by 1 instead of 0 (their draw is not used)."""
    return logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(-1)


def _ranked(scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's values, highest first, and their token ids: [R, V] each. Stable, so equal
    values rank by token id and the kept set of top-k / top-p is well defined under ties."""
    return scaled.sort(dim=-1, descending=True, stable=True)


def _draw_filtered(vals, order, top_k, top_p, mult, offset) -> torch.Tensor:
    """Gumbel-max over each row's top-k / top-p set of the ranked values: [R, V] -> [R] int64."""
    V = vals.shape[-1]
    rank = torch.arange(V, device=vals.device)
    keep = rank < torch.where(top_k > 0, top_k, V).unsqueeze(-1)
    vals = vals.masked_fill(~keep, -math.inf)
    probs = vals.softmax(dim=-1)
    # a token is in the nucleus when the mass ranked above it is still short of top_p; the top
    # token always is (mass 0). top_p = 1 skips the test, so fp32 rounding of the cumulative sum
    # cannot cut the tail off an unfiltered row.
    mass_above = probs.cumsum(dim=-1) - probs
    keep &= (mass_above < top_p.unsqueeze(-1)) | (top_p >= 1).unsqueeze(-1)
    # noise is keyed by token id (order), not by rank, so it matches the unsorted modes
    score = torch.where(keep, vals + _gumbel(mult, offset, order), -math.inf)
    return order.gather(-1, score.argmax(dim=-1, keepdim=True)).squeeze(-1)


def sample_ref(logits, temperature, top_k, top_p, seed, position) -> torch.Tensor:
    """Row-by-row reference for ``sample`` (any mode that serves the rows), with the same
    random numbers; the allowed set is built in Python with float64 probabilities.

    Same arguments as ``sample`` without ``mode``/``out``; returns [R] int64 on the CPU.
    """
    logits = logits.detach().float().cpu()
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.int64)
    for r in range(R):
        row, temp = logits[r], temperature[r].cpu().float()
        k, p = int(top_k[r]), float(top_p[r])
        if float(temp) == 0 or k == 1:
            out[r] = row.argmax()
            continue
        scaled = row / temp
        values = scaled.tolist()
        # highest first, ties by lower token id
        allowed = sorted(range(V), key=lambda i: (-values[i], i))
        if 0 < k < V:
            allowed = allowed[:k]
        if p < 1:
            probs = torch.softmax(torch.tensor([values[i] for i in allowed], dtype=torch.float64), 0)
            nucleus, mass = [], 0.0
            for token, prob in zip(allowed, probs.tolist()):
                nucleus.append(token)
                mass += prob
                if mass >= p:
                    break
            allowed = nucleus
        tokens = torch.tensor(allowed, dtype=torch.int64)
        mult, offset = _row_keys(int(seed[r]), int(position[r]))
        key = (torch.tensor([[mult]]), torch.tensor([[offset]]))
        score = scaled[tokens] + _gumbel(*key, tokens)[0]
        out[r] = allowed[int(score.argmax())]
    return out
