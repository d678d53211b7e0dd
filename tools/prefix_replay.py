"""Prompts replayed through the prefix cache's own bookkeeping, no model: each prompt admitted
(``PrefixCache.admit``) and its wanted snapshots claimed, in arrival order, as one request at a
time would; the share of prompt tokens restored, for eviction policies side by side. It measures
the policy (what is kept and found), not time; the CPU is enough.

    python -m mambastep.tools.prefix_replay [--slots 21 53] [--block 128]

Workloads (random tokens): multi-turn chats, each turn resending the conversation with an answer
of about 140 tokens and a message of 60; agentic prompts of 16k tokens, 90% one of a few shared
prefixes, alone or each followed by short unique chats (about 1500 tokens).
"""

from __future__ import annotations

import argparse

import numpy as np

from ..runtime.prefix_cache import PrefixCache

# (flop_weight, share_weight, supersede), each column adding one to the one before
POLICIES = {"LRU": (0.0, 0.0, False, False), "+ superseded first": (0.0, 0.0, True, False),
            "+ length": (1.0, 0.0, True, False), "+ shared": (1.0, 1.0, True, False),
            "+ thrash guard (default)": (1.0, 1.0, True, True)}


def workloads(seed: int = 0) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(seed)

    def tokens(n):
        return rng.integers(1, 100_000, int(n))

    def multi_turn(convs, first, turns=4):
        history, out = [tokens(first) for _ in range(convs)], []
        for turn in range(turns):
            for c in range(convs):
                if turn:
                    history[c] = np.concatenate([history[c], tokens(rng.lognormal(np.log(140), 0.5)), tokens(60)])
                out.append(history[c])
        return out

    def agentic(n, total, prefixes, chats=0):
        shared = [tokens(total * 9 // 10) for _ in range(prefixes)]
        out = []
        for i in range(n):
            out.append(np.concatenate([shared[i % prefixes], tokens(total - total * 9 // 10)]))
            out += [tokens(rng.lognormal(np.log(1500), 0.8)) for _ in range(chats)]
        return out

    return {"multi-turn, 8 conversations, 16k first prompts": multi_turn(8, 16384),
            "multi-turn, 40 conversations, 4k first prompts": multi_turn(40, 4096),
            "agentic, 32 prompts, 4 prefixes": agentic(32, 16384, 4),
            "agentic, 32 prompts, 4 prefixes, 4 chats after each": agentic(32, 16384, 4, 4),
            "agentic, 64 prompts, 12 prefixes": agentic(64, 16384, 12),
            "agentic, 64 prompts, 8 prefixes, 8 chats after each": agentic(64, 16384, 8, 8)}


def replay(prompts: list[np.ndarray], slots: int, block: int, flop_weight: float, share_weight: float,
           supersede: bool, thrash_guard: bool) -> float:
    """The share of the prompts' tokens restored."""
    cache = PrefixCache(list(range(slots)), block, flop_weight=flop_weight, share_weight=share_weight,
                        supersede=supersede, thrash_guard=thrash_guard)
    for p in prompts:
        for at in cache.admit(p).snapshot_at:
            cache.claim(p, at)
        cache.settle()  # the prompt's step launched
    return cache.stats["tokens_restored"] / sum(len(p) for p in prompts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, nargs="+", default=[21, 53],
                        help="snapshots the cache holds (8 GiB at 16k context: 21 for Nemotron-H-8B, 53 for Nano)")
    parser.add_argument("--block", type=int, default=128, help="tokens a block (the SSD chunk size)")
    args = parser.parse_args(argv)
    work = workloads()
    print("| snapshots | workload | " + " | ".join(POLICIES) + " |")
    print("| --- | --- |" + " --- |" * len(POLICIES))
    for slots in args.slots:
        for name, prompts in work.items():
            cells = [f"{replay(prompts, slots, args.block, *policy):.1%}" for policy in POLICIES.values()]
            print(f"| {slots} | {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
