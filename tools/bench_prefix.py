"""The prefix cache beside no cache, on the same model in one process: a multi-turn chat (each
turn resends the whole conversation, whose first prompt is ``prompt_tokens`` long), an agentic
workload (prompts of ``prompt_tokens``, 90% of them one of four shared prefixes) and a chat of
unique prompts (about 223 tokens: no hits, what the cache costs), each run on an engine without
a cache and on one with ``cache_gib`` of snapshots (``runtime.prefix_cache``).

Reported per run: TTFT p50 and p99 (all requests, and a conversation's later turns apart),
output tokens/s, the cache's hit rate and the prompt tokens it restored, and how many requests'
tokens equal the uncached run's. That count is not a check: a restore changes which requests
share each step, so the steps' GEMMs have other shapes, and on random weights (near-tied logits)
a last bf16 bit flips greedy tokens, as any change of batching does. The check is the probe: a
fresh conversation alone on each engine, its second turn restored on the cached one, whose
greedy tokens and logprobs are compared. Presets have random weights.
"""

from __future__ import annotations


import numpy as np
import torch

from ..runtime.engine import Engine
from ..runtime.model import Model
from ..runtime.request import SamplingParams
from .bench_kernels import stamp
from .run import conversations, serve, summarize

PRESETS = ("nemotron-h-8b", "nemotron-3-nano-30b-a3b")
WORKLOADS = ("multi-turn", "agentic", "chat")


def bench_preset(name: str, *, prompt_tokens: int = 16384, requests: int = 32, concurrency: int = 8,
                 cache_gib: float = 8.0, turns: int = 4, device: str = "cuda", progress: bool = True) -> dict:
    gpu = device.startswith("cuda")
    model = Model.from_preset(name, dtype=torch.bfloat16 if gpu else torch.float32, device=device)
    # the longest conversation: its first prompt, three more turns' messages and every answer
    max_context = prompt_tokens + turns * (200 + 256) + 64
    work = {w: conversations(w, requests, model.cfg.vocab_size, 0, max_context, turns, prompt_tokens)
            for w in WORKLOADS}
    rows, outputs, probe = [], {}, {}
    for gib in (0.0, cache_gib):  # one engine each, the workloads in turn (the cache keeps what it holds)
        engine = Engine(model, max_context=max_context, use_graphs=gpu, prefix_cache_gib=gib, progress=False)
        cache = engine.prefix_cache
        for workload, convs in work.items():
            before = dict(cache.stats) if cache is not None else None
            t = serve(engine, convs, concurrency, {"temperature": 0.0}, progress)
            stats = summarize(t, t["requests"])
            row = {"workload": workload, "cache_gib": gib, "requests": t["requests"],
                   "ttft_ms": stats["ttft_ms"], "ttft_later_turns_ms": stats.get("ttft_later_turns_ms"),
                   "output_tokens_per_s": stats["output_tokens_per_s"]}
            if cache is not None:
                c = {k: v - before[k] for k, v in cache.stats.items()}
                row.update(snapshots=len(cache.slots), hit_rate=c["hits"] / max(1, c["lookups"]),
                           tokens_restored=c["tokens_restored"], evictions=c["evictions"],
                           snapshot_gib=cache.slot_bytes / 2**30,
                           same_tokens=sum(v == outputs[workload].get(k) for k, v in t["outputs"].items()))
            outputs[workload] = t["outputs"]
            rows.append(row)
        probe[gib] = _probe(engine, model.cfg.vocab_size, prompt_tokens, probe.get(0.0))
        del engine, cache
        if gpu:
            torch.cuda.empty_cache()
    rows.sort(key=lambda r: WORKLOADS.index(r["workload"]))  # each workload's uncached run, then its cached one
    return {"preset": name, "prompt_tokens": prompt_tokens, "concurrency": concurrency, "rows": rows,
            "probe": probe[cache_gib]}


def _probe(engine: Engine, vocab: int, prompt_tokens: int, plain: dict | None, n: int = 32) -> dict:
    """A fresh conversation alone, its second turn resending the first (``plain``'s answer, so
    both engines see one prompt): that turn's first ``n`` greedy tokens and their logprobs, and
    beside the engine without a cache, how many lead equal and how far their logprobs differ."""
    rng = np.random.default_rng(1)
    first = rng.integers(1, vocab, prompt_tokens).tolist()
    own = _alone(engine, first, 16)[0]  # on the cached engine, also its snapshot at the last boundary
    answer = plain["answer"] if plain else own
    before = dict(engine.prefix_cache.stats) if engine.prefix_cache else None
    tokens, logprobs = _alone(engine, first + answer + rng.integers(1, vocab, 60).tolist(), n)
    out = {"answer": answer, "tokens": tokens, "logprobs": logprobs}
    if plain is not None:
        equal = next((i for i, (a, b) in enumerate(zip(tokens, plain["tokens"])) if a != b), n)
        restored = engine.prefix_cache.stats["tokens_restored"] - before["tokens_restored"]
        out.update(restored=restored, tokens_equal=equal,
                   max_logprob_diff=max((abs(a - b) for a, b in zip(logprobs[:equal], plain["logprobs"])), default=0.0))
    return out


def _alone(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n, logprobs=1, ignore_eos=True))
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for o in engine.step():
            if o.id == rid:
                tokens += o.new_tokens
                logprobs += [lp.logprob for lp in o.logprobs]
    return tokens, logprobs


def run(presets=PRESETS, progress: bool = True, **kw) -> dict:
    return {**stamp(), "presets": [bench_preset(p, progress=progress, **kw) for p in presets]}


def tables(result: dict) -> str:
    out = [f"{result['device']}, {result['date']}, torch {result['torch']}; greedy"]
    for p in result["presets"]:
        out += ["", f"{p['preset']}: first prompts of {p['prompt_tokens']} tokens, concurrency {p['concurrency']}", "",
                "| workload | prefix cache | TTFT p50 (ms) | TTFT p99 (ms) | later turns' TTFT p50 (ms) | output tokens/s "
                "| hit rate | tokens restored | requests with the same tokens |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in p["rows"]:
            later = r["ttft_later_turns_ms"]
            cached = r["cache_gib"] > 0
            cache = f"{r['cache_gib']:g} GiB ({r['snapshots']} snapshots)" if cached else "none"
            hits = (f"{r['hit_rate']:.0%} | {r['tokens_restored']} | {r['same_tokens']}/{r['requests']}"
                    if cached else "- | - | -")
            later = f"{later['p50']:.1f}" if later else "-"
            out.append(f"| {r['workload']} | {cache} | {r['ttft_ms']['p50']:.1f} | {r['ttft_ms']['p99']:.1f} | "
                       f"{later} | {r['output_tokens_per_s']:.0f} | {hits} |")
        by = {(r["workload"], r["cache_gib"] > 0): r for r in p["rows"]}
        gains = []
        for w, key in (("multi-turn", "ttft_later_turns_ms"), ("agentic", "ttft_ms")):
            if (w, True) in by and by[w, True][key]:
                gains.append(f"{w} {by[w, False][key]['p50'] / by[w, True][key]['p50']:.1f}x lower TTFT p50"
                             + (" on later turns" if w == "multi-turn" else ""))
        if ("chat", True) in by:
            off, on = by["chat", False], by["chat", True]
            gains.append(f"chat without hits: TTFT p50 {on['ttft_ms']['p50'] / off['ttft_ms']['p50'] - 1:+.1%}, "
                         f"output tokens/s {on['output_tokens_per_s'] / off['output_tokens_per_s'] - 1:+.1%}")
        out += ["", "With the cache: " + "; ".join(gains) + "."]
        q = p["probe"]
        out += ["", f"Probe, a conversation alone: its second turn restored {q['restored']} tokens; of its first "
                    f"{len(q['tokens'])} greedy tokens {q['tokens_equal']} lead equal to the uncached engine's, "
                    f"their logprobs at most {q['max_logprob_diff']:.2g} apart."]
    return "\n".join(out)


def print_table(result: dict) -> None:
    print(tables(result))
