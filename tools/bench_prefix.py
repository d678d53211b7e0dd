"""The prefix cache beside no cache, on the same model in one process: a multi-turn chat (each
turn resends the whole conversation, whose first prompt is ``prompt_tokens`` long) and an agentic
workload (prompts of ``prompt_tokens``, 90% of them one of four shared prefixes), each run on an
engine without a cache and on one with ``cache_gib`` of snapshots (``runtime.prefix_cache``).

Reported per run: TTFT p50 and p99 (all requests, and a conversation's later turns apart),
output tokens/s, the cache's hit rate and the prompt tokens it restored, and whether every turn's
tokens equal the uncached run's (greedy: they must). Presets have random weights. Snapshots
are taken where a prompt chunk ends on a block boundary (the budget's multiples, and a prompt's
last boundary), so an agentic prompt restores its shared part up to the last such end inside it.
"""

from __future__ import annotations

import datetime

import torch

from ..runtime.engine import Engine
from ..runtime.model import Model
from ..runtime.state_pool import StatePool
from .run import conversations, serve, summarize

PRESETS = ("nemotron-h-8b", "nemotron-3-nano-30b-a3b")
WORKLOADS = ("multi-turn", "agentic")


def bench_preset(name: str, *, prompt_tokens: int = 16384, requests: int = 32, concurrency: int = 8,
                 cache_gib: float = 8.0, turns: int = 4, device: str = "cuda", progress: bool = True) -> dict:
    gpu = device.startswith("cuda")
    model = Model.from_preset(name, dtype=torch.bfloat16 if gpu else torch.float32, device=device)
    # the longest conversation: its first prompt, three more turns' messages and every answer
    max_context = prompt_tokens + turns * (200 + 256) + 64
    rows = []
    for workload in WORKLOADS:
        convs = conversations(workload, requests, model.cfg.vocab_size, 0, max_context, turns, prompt_tokens)
        outputs = None
        for gib in (0.0, cache_gib):
            engine = Engine(model, max_context=max_context, use_graphs=gpu, prefix_cache_gib=gib, progress=False)
            t = serve(engine, convs, concurrency, {"temperature": 0.0}, progress)
            stats = summarize(t, t["requests"])
            row = {"workload": workload, "cache_gib": gib, "requests": t["requests"],
                   "ttft_ms": stats["ttft_ms"], "ttft_later_turns_ms": stats.get("ttft_later_turns_ms"),
                   "output_tokens_per_s": stats["output_tokens_per_s"]}
            if engine.prefix_cache is not None:
                c = engine.prefix_cache.stats
                row.update(snapshots=len(engine.prefix_cache.slots), hit_rate=c["hits"] / max(1, c["lookups"]),
                           tokens_restored=c["tokens_restored"], evictions=c["evictions"],
                           snapshot_gib=StatePool.bytes_per_slot(model.cfg, max_context, model.dtype) / 2**30,
                           outputs_equal=t["outputs"] == outputs)
            outputs = t["outputs"]
            rows.append(row)
            del engine
            if gpu:
                torch.cuda.empty_cache()
    return {"preset": name, "prompt_tokens": prompt_tokens, "concurrency": concurrency, "rows": rows}


def run(presets=PRESETS, progress: bool = True, **kw) -> dict:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return {"date": datetime.date.today().isoformat(), "device": device, "torch": torch.__version__,
            "presets": [bench_preset(p, progress=progress, **kw) for p in presets]}


def tables(result: dict) -> str:
    out = [f"{result['device']}, {result['date']}, torch {result['torch']}; greedy"]
    for p in result["presets"]:
        out += ["", f"{p['preset']}: first prompts of {p['prompt_tokens']} tokens, concurrency {p['concurrency']}", "",
                "| workload | prefix cache | TTFT p50 (ms) | TTFT p99 (ms) | later turns' TTFT p50 (ms) | output tokens/s "
                "| hit rate | tokens restored | tokens as without |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in p["rows"]:
            later = r["ttft_later_turns_ms"]
            cached = r["cache_gib"] > 0
            cache = f"{r['cache_gib']:g} GiB ({r['snapshots']} snapshots)" if cached else "none"
            hits = (f"{r['hit_rate']:.0%} | {r['tokens_restored']} | {'yes' if r['outputs_equal'] else 'NO'}"
                    if cached else "- | - | -")
            later = f"{later['p50']:.1f}" if later else "-"
            out.append(f"| {r['workload']} | {cache} | {r['ttft_ms']['p50']:.1f} | {r['ttft_ms']['p99']:.1f} | "
                       f"{later} | {r['output_tokens_per_s']:.0f} | {hits} |")
    return "\n".join(out)


def print_table(result: dict) -> None:
    print(tables(result))
