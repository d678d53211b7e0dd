"""Drafts from a small model of the same vocabulary, on an engine of its own (``runtime.speculative``).

Each draft is the draft model's greedy continuation of the request's context, generated on the
draft engine as a request of its own. With a prefix cache on the draft engine (``draft_engine``
sets one up), a context's earlier blocks are restored rather than prefilled again, so a draft
costs the new tokens' prefill and k decode steps of the small model. Greedy drafts are single
tokens for the target's acceptance, so sampling with them stays exact.

An engine given ``Speculative(draft_model=...)`` builds its draft engine through
``load_draft_model`` and ``draft_engine`` and hands each speculating request a ``ModelDrafter``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .model import Model
from .presets import PRESETS
from .request import SamplingParams

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["ModelDrafter", "draft_engine", "load_draft_model"]


class ModelDrafter:
    """One request's drafter over a shared draft ``engine`` (``Speculative.drafter`` makes one per
    request: ``lambda: ModelDrafter(engine, vocab)``); ``vocab``: the target's vocabulary size,
    which drafts stay below (a draft model's padded vocabulary may be larger)."""

    def __init__(self, engine: Engine, vocab: int):
        self.engine, self.vocab = engine, vocab

    def draft(self, context, k: int) -> list[int]:
        room = self.engine.max_context - len(context)
        if room <= 0 or k <= 0:
            return []  # the context outgrew the draft engine: no drafts, plain decoding
        params = SamplingParams(temperature=0.0, max_tokens=min(k, room), ignore_eos=True, speculative=False)
        drafts = self.engine.generate([list(map(int, context))], params)[0]
        n = next((i for i, t in enumerate(drafts) if t >= self.vocab), len(drafts))
        return drafts[:n]


def load_draft_model(source: str, *, dtype, device, seed: int | None = None) -> Model:
    """The draft model ``source`` names: an HF checkpoint directory, or a preset (random weights
    from ``seed``, default 0: what drafting costs, not what it gains; the target's own preset and
    seed give a draft model equal to the target, whose drafts are all kept). A seed beside a
    checkpoint, whose weights are its own, is refused."""
    if Path(source).is_dir():
        if seed is not None:
            raise ValueError(f"draft model: {source} is a checkpoint, its weights its own: no seed (got {seed})")
        try:
            return Model.from_pretrained(source, dtype=dtype, device=device)
        except ValueError as e:  # a bad config or weights, said as the draft model's (not the target's)
            raise ValueError(f"draft model: {source}: {e}") from e
    if source in PRESETS:
        return Model.from_preset(source, dtype=dtype, device=device, seed=seed or 0)
    raise ValueError(f"draft model: {source!r} is neither a checkpoint directory nor a preset "
                     f"({', '.join(sorted(PRESETS))})")


def draft_engine(model: Model, target_vocab: int, max_context: int, snapshots: int = 8, **kw) -> Engine:
    """An engine for ``model`` as a draft model: a few slots (drafts are generated one request at
    a time), a prefix cache of ``snapshots`` snapshots, room for ``max_context`` tokens (the
    target's, plus the drafts). Refuses a model whose vocabulary does not cover the target's."""
    from .engine import Engine  # (the engine module builds its draft engine through this one)

    if model.cfg.vocab_size < target_vocab:
        raise ValueError(f"draft model: its vocabulary of {model.cfg.vocab_size} tokens does not cover the "
                         f"target's {target_vocab}")
    kw.setdefault("num_slots", 2)
    return Engine(model, max_context=max_context, prefix_cache_slots=snapshots, progress=False, **kw)
