"""Variants of a step side by side on one model in one process: the A/B method of
docs/experiments.md as code; ``mambastep bench ab`` from the command line (``--help``).

A variant is a factory of context managers whose patches (a module constant, a kernel wrapper, a
mixer's method) are in force while its runner captures its graphs, and around each of its steps
(so that an eager step, a CPU's or one past the captured buckets, runs them too), and while the
model's decode options are resolved for its runner (``runtime.decode_options``' constants). One
model's weights and one state pool serve every variant; or, for switches read when the model is
built (``model_per_variant``), each variant builds its own from the same seed, under its patches,
and they share the pool. Before a variant's first step of a plan
the states are put back as they were, so its logits are compared with the first variant's from
the same start.
Timings alternate variant by variant, round after round, so drift over the run (a GPU at its
power cap heating up) falls on every variant alike.

    import contextlib
    from mambastep.tools.bench_ab import compare, table
    from mambastep.tools.bench_steps import decode_plan
    rows = compare("nemotron-3-nano-30b-a3b", {"main": contextlib.nullcontext, "new": my_patch},
                   {"decode 1": decode_plan(1)})
    print(table(rows))

Most variants set module constants (a threshold, a switch): ``patched((moe, {"H_BLOCK": 64}))``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import statistics
import sys
import time
from types import ModuleType
from typing import Any, Callable, ContextManager, Mapping

import torch

from ..graphs import BucketSet
from ..runtime.decode_options import DecodeOptions
from ..runtime.model import Model
from ..runtime.plan import StepPlan
from ..runtime.presets import preset_config
from ..runtime.state_pool import StatePool
from ..runtime.step_runner import StepRunner
from .args import Parser, add_quantization, writable_path
from .bench_spec import verify_plan
from .bench_steps import CONTEXT, decode_plan, mixed_plan, prefill_plan, step_ms
from .gpu_clocks import ClockSampler

__all__ = ["compare", "main", "parse_plan", "parse_variant", "patched", "table"]

Variant = Callable[[], ContextManager]


def patched(*targets: tuple[ModuleType, Mapping[str, Any]]) -> Variant:
    """A variant that sets each (module, {name: value}) target's module attributes while in force,
    and puts them back after; a name the module does not have is refused (a typo would time the
    baseline twice)."""
    for module, values in targets:
        missing = [name for name in values if not hasattr(module, name)]
        if missing:
            raise AttributeError(f"patched: {module.__name__} has no {', '.join(missing)}")

    @contextlib.contextmanager
    def variant():
        old = [(module, {name: getattr(module, name) for name in values}) for module, values in targets]
        try:
            for module, values in targets:
                for name, value in values.items():
                    setattr(module, name, value)
            yield
        finally:
            for module, values in old:
                for name, value in values.items():
                    setattr(module, name, value)

    return variant


def _buckets(plans: Mapping[str, StepPlan]) -> BucketSet:
    """The graph buckets of exactly these plans' shapes (verify plans': verify buckets of the
    most drafts any carries)."""
    decode = {p.num_decode for p in plans.values() if not p.num_prefill}
    mixed = [p for p in plans.values() if p.num_prefill]
    verify = {p.num_prefill_tokens for p in mixed if p.num_drafts}
    return BucketSet(decode=tuple(sorted(decode or {1})),
                     mixed_decode=tuple(sorted({0} | {p.num_decode for p in mixed})),
                     prefill=tuple(sorted({p.num_prefill_tokens for p in mixed} or {16})),
                     max_prefill_seqs=max([p.num_prefill for p in mixed] or [1]),
                     drafts=max([p.num_drafts for p in mixed] or [0]), verify=tuple(sorted(verify or {16})))


def _pool(model: Model, plans: Mapping[str, StepPlan], max_context: int | None, drafts: int) -> StatePool:
    """A pool holding every slot the plans name, ``max_context`` long (default: as long as their
    contexts need), recording ``drafts`` a slot; random states."""
    slots, context = 1, 1
    for p in plans.values():
        slots = max(slots, 1 + int(max(p.decode_slots.max(initial=0), p.prefill_slots.max(initial=0))))
        context = max(context, int((p.decode_context + 1).max(initial=0)),
                      int((p.prefill_context + p.prefill_lens).max(initial=0)))
    if max_context is not None and max_context < context:
        raise ValueError(f"max_context {max_context}: the plans need {context} positions")
    pool = StatePool(model.cfg, slots, max_context=max_context or context + 1, dtype=model.dtype,
                     device=model.device, drafts=drafts)
    for t in pool.tensors():
        t.normal_(0, 0.1)
    return pool


def compare(preset: str, variants: Mapping[str, Variant], plans: Mapping[str, StepPlan], *, rounds: int = 3,
            back_to_back: int = 50, max_context: int | None = None, dtype: torch.dtype = torch.bfloat16,
            device: str | None = None, seed: int = 0, quantization: str | None = None,
            on_plan: Callable[[list[dict]], None] | None = None, model_per_variant: bool = False) -> list[dict]:
    """One row a (plan, variant): its synchronised step times (ms, one median a round), steps
    launched back to back (ms a step, the median over the first two rounds; CUDA only), the mean
    SM clock and board power while its synchronised steps ran (``sm_mhz``, ``power_w``; where
    nvidia-smi reads them), and whether its logits equal the first variant's (else the largest
    difference, the first's standard deviation, and the share of rows whose top token agrees). ``preset``:
    random weights of that shape; ``variants``: name -> context manager factory, the first the
    baseline; ``max_context``: the pool's length (what a decode attention's split sizes follow;
    ``bench steps`` pools ``CONTEXT + 2 * 2048``); ``quantization``: as ``Model.from_preset``'s
    (``"fp8"``: the weights quantized at load); ``model_per_variant``: each variant's model built
    under its patches (the same random weights), where one model serves them all otherwise."""
    if not variants or not plans:
        raise ValueError("compare needs at least one variant and one plan")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    def build():
        torch.manual_seed(seed)
        return Model.from_preset(preset, dtype=dtype, device=device, seed=seed, quantization=quantization)

    model = None if model_per_variant else build()
    buckets, pool = _buckets(plans), None
    runners = {}
    for name, variant in variants.items():
        with variant():  # the decode options resolved under the variant's patches too
            own = build() if model_per_variant else model
            pool = pool or _pool(own, plans, max_context, buckets.drafts)
            runner = StepRunner(own.with_options(DecodeOptions()), pool, buckets, overlap=True)
            if runner.cuda:
                runner.capture(sorted({runner.bucket_for(p) for p in plans.values()}, reverse=True), progress=False)
        runners[name] = runner
    start = [t.clone() for t in pool.tensors()]
    rows = []
    clocks = ClockSampler() if str(device).startswith("cuda") else None
    with clocks or contextlib.nullcontext():
        for plan_name, plan in plans.items():
            rows += _plan_rows(plan_name, plan, variants, runners, pool, start, rounds, back_to_back, clocks)
            if on_plan is not None:
                on_plan(rows[-len(runners):])
    return rows


def _plan_rows(plan_name, plan, variants, runners, pool, start, rounds, back_to_back, clocks) -> list[dict]:
    """``compare``'s rows of one plan."""
    logits = {}
    for name, runner in runners.items():
        for t, s in zip(pool.tensors(), start):
            t.copy_(s)
        with variants[name]():
            logits[name] = runner.logits(plan).float().clone()
    times = {name: [] for name in runners}
    streamed = {name: [] for name in runners}
    read = {name: [] for name in runners}  # (SM MHz, W) while its synchronised steps ran
    for i in range(rounds):
        for name, runner in runners.items():
            with variants[name]():
                t0 = time.monotonic()
                times[name].append(step_ms(runner, plan))
                if clocks is not None and (window := clocks.window(t0, time.monotonic())) is not None:
                    read[name].append(window)
                if runner.cuda and i < 2:
                    streamed[name].append(step_ms(runner, plan, steps=back_to_back, rounds=5))
    base = logits[next(iter(variants))]
    rows = []
    for name in runners:
        row = {"plan": plan_name, "variant": name, "sync_ms": times[name],
               "median_ms": statistics.median(times[name]), "equal": torch.equal(logits[name], base),
               "max_abs_diff": (logits[name] - base).abs().max().item(), "base_std": base.std().item(),
               "top1": (logits[name].argmax(-1) == base.argmax(-1)).float().mean().item()}
        if streamed[name]:
            row["back_to_back_ms"] = statistics.median(streamed[name])
        if read[name]:
            row["sm_mhz"] = statistics.fmean(m for m, _ in read[name])
            row["power_w"] = statistics.fmean(w for _, w in read[name])
        rows.append(row)
    return rows


TABLE_HEADER = ("| plan | variant | synchronised (ms) | median | vs first | back to back (ms) | SM MHz, W | logits |\n"
                "| --- | --- | --- | --- | --- | --- | --- | --- |")


def table(rows: list[dict], header: bool = True) -> str:
    """The rows in markdown, each plan's variants beside its first (``header``: with the table's
    header; without, the lines of one plan to print under it)."""
    out = [TABLE_HEADER] if header else []
    first: dict[str, float] = {}
    for r in rows:
        base = first.setdefault(r["plan"], r["median_ms"])
        b2b = f"{r['back_to_back_ms']:.3f}" if "back_to_back_ms" in r else "n/a"
        same = "equal" if r["equal"] else (f"max diff {r['max_abs_diff']:.3g} (std {r['base_std']:.3g}), "
                                           f"top-1 {r['top1']:.0%}")
        clocks = f"{r['sm_mhz']:.0f}, {r['power_w']:.0f}" if "sm_mhz" in r else "n/a"
        out.append(f"| {r['plan']} | {r['variant']} | {' '.join(f'{t:.3f}' for t in r['sync_ms'])} | "
                   f"{r['median_ms']:.3f} | {r['median_ms'] / base - 1:+.1%} | {b2b} | {clocks} | {same} |")
    return "\n".join(out)


def _patches(text: str) -> list[str]:
    """``text`` split at its commas outside brackets and quotes (a value may be a tuple)."""
    parts, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [p for p in parts + [text[start:]] if p]


def parse_variant(text: str) -> tuple[str, Variant]:
    """``NAME`` (as the code stands) or ``NAME:MODULE.ATTR=VALUE[,MODULE.ATTR=VALUE...]``: the
    module under ``mambastep`` (``kernels.linear``), the value a Python literal (a tuple too)."""
    name, _, patches = text.partition(":")
    if not name:
        raise ValueError(f"a variant needs a name: {text!r}")
    targets: dict[str, dict[str, Any]] = {}
    for patch in _patches(patches):
        where, eq, value = patch.partition("=")
        module, dot, attr = where.strip().rpartition(".")
        if not (eq and dot and module and attr):
            raise ValueError(f"variant {name!r}: expected MODULE.ATTR=VALUE, got {patch!r}")
        try:
            literal = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"variant {name!r}: {value.strip()!r} is not a Python literal") from None
        targets.setdefault(module, {})[attr] = literal
    try:
        modules = {m: importlib.import_module(f"mambastep.{m}") for m in targets}
    except ModuleNotFoundError as e:
        raise ValueError(f"variant {name!r}: no module {e.name}") from None
    return name, patched(*((modules[m], values) for m, values in targets.items()))


def parse_plan(text: str, vocab: int = 1000) -> tuple[str, StepPlan]:
    """``decode:B`` (B decode rows), ``prefill:T`` (one T-token prompt chunk, ids below
    ``vocab``), ``mixed:B+T`` (both in one step), as ``bench steps`` builds them, or
    ``verify:B+K`` (B sequences of a token and K drafts, as ``bench spec`` times them)."""
    kind, _, size = text.partition(":")
    try:
        if kind == "decode":
            return f"decode {int(size)}", decode_plan(int(size))
        if kind == "prefill":
            return f"prefill {int(size)}", prefill_plan(int(size), 0, vocab)
        if kind == "mixed":
            rows, _, tokens = size.partition("+")
            chunk = prefill_plan(int(tokens), int(rows), vocab)
            return f"decode {int(rows)} + {int(tokens)}", mixed_plan(int(rows), chunk)
        if kind == "verify":
            rows, _, drafts = size.partition("+")
            if int(rows) > 0 and int(drafts) > 0:
                return f"verify {int(rows)} x (1 + {int(drafts)})", verify_plan(int(rows), int(drafts), vocab, CONTEXT)
    except ValueError:
        pass
    raise ValueError(f"a plan is decode:B, prefill:T, mixed:B+T or verify:B+K (B, K > 0), got {text!r}")


def main(argv=None) -> int:
    parser = Parser(prog="mambastep bench ab", description="""\
Variants of a preset's steps side by side in one process, each plan's states the same before
every variant's step, timings alternating variant by variant; a variant sets module constants
(the switches and thresholds kernels and mixers read) while its graphs are captured and its
steps run. Prints each plan's variants beside the first, the SM clock and board power while
each ran (from nvidia-smi: a step held at the power cap runs below the top clock), and whether
their logits equal its.

  mambastep bench ab --preset nemotron-3-nano-30b-a3b --quantization fp8 --variant main \\
      --variant "align in one program:kernels.moe.ALIGN_COUNTED_ONE_PROGRAM=1024" \\
      --plan decode:64 --plan mixed:64+223""")
    parser.add_argument("--preset", required=True, help="the model shape (random weights)")
    parser.add_argument("--variant", action="append", required=True, metavar="NAME[:MODULE.ATTR=VALUE,...]",
                        help="a variant (the first is the baseline): its name, and the module constants it sets "
                             "(modules under mambastep, values Python literals, tuples too); repeat for each")
    parser.add_argument("--plan", action="append", required=True, metavar="decode:B|prefill:T|mixed:B+T|verify:B+K",
                        help="a step to time: B decode rows, a T-token prompt chunk, or both; or a verify step of "
                             "B sequences of a token and K drafts each; repeat for each")
    parser.add_argument("--model-per-variant", action="store_true",
                        help="build each variant's own model under its constants (the same random weights), for "
                             "switches read when the model is built; it takes a model's memory a variant")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds (default 3)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="the state pool's length (default: what the plans need)")
    add_quantization(parser)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = parser.parse_args(argv)
    writable_path(parser, "--json", args.json)
    try:
        vocab = preset_config(args.preset).vocab_size
        variants = dict(parse_variant(v) for v in args.variant)
        plans = dict(parse_plan(p, vocab) for p in args.plan)
    except KeyError as e:  # an unknown preset
        parser.error(str(e).strip("'\""))
    except (ValueError, AttributeError) as e:
        parser.error(str(e))
    if len(variants) != len(args.variant) or len(plans) != len(args.plan):
        parser.error("variants and plans must be named apart")
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, got {args.rounds}")
    print(f"{args.preset}{' (' + args.quantization + ')' if args.quantization else ''} on "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}")
    print(TABLE_HEADER, flush=True)
    try:  # each plan's lines as it is measured: a run cut short keeps what it finished
        rows = compare(args.preset, variants, plans, rounds=args.rounds, max_context=args.max_context,
                       quantization=args.quantization, on_plan=lambda r: print(table(r, header=False), flush=True),
                       model_per_variant=args.model_per_variant)
    except ValueError as e:  # a pool too short for the plans
        parser.error(str(e))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "quantization": args.quantization, "variants": args.variant,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
