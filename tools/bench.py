"""Benchmarks on a CUDA device; each comparison runs side by side in one process.

    mambastep bench kernels [--json PATH]   state update bandwidth, SSD scan vs torch, fused
                                            skinny projections vs norm + cuBLAS
    mambastep bench steps [--json PATH]     decode steps eager vs graph vs HBM floor (and fused
                                            vs layer by layer); mixed steps with and without
                                            the forked stream
    mambastep bench fp8 [--preset P ...] [--json PATH]
                                            FP8 beside bf16 on the same weights: decode and
                                            prefill steps beside each one's floor, and how
                                            closely FP8 follows bf16
    mambastep bench sampling [--preset P ...] [--json PATH]
                                            what logprobs and the penalties add to a decode step,
                                            beside the same step greedy
    mambastep bench prefix [--preset P ...] [--json PATH]
                                            the prefix cache beside none on the same model: a
                                            multi-turn chat and an agentic workload of long
                                            prompts, TTFT and throughput, hit rate, equal tokens
    mambastep bench spec [--preset P ...] [--json PATH]
                                            speculative decoding beside plain: verify steps
                                            against k, tokens/s alone against the acceptance
                                            length, and at concurrency 64
    mambastep bench tiles [--preset P ...] [--batch B] [--quantization fp8] [--json PATH]
                                            B decode rows (default 1) through each of a preset's
                                            projection shapes: the skinny tile table's choice
                                            beside a sweep of others, and the product alone
                                            through linear (layer by layer), cuBLAS and the
                                            weight-rows product (W8A8 for FP8; its own sweep)
    mambastep bench profile --preset P --batch B [--prefill T | --verify K] [--quantization fp8]
                            [--mtp] [--timeline [--window LO:HI]]
                                            per-kernel time of one eager step: B decode rows
                                            (and a prefill chunk of T tokens); --verify: B verify
                                            sequences of 1 + K tokens instead; --mtp: a step of
                                            the preset's MTP layers; --timeline: what each
                                            kernel adds to the captured step's span, beside the
                                            whole step's time; --window: kernels LO..HI-1 with
                                            start and end
    mambastep bench serve --url URL [--concurrency C] [--requests N]
                                            load generator over HTTP against `mambastep serve`
                                            (`mambastep bench serve --help`)
    mambastep bench api [--concurrency C] [--requests N] [--step-ms MS]
                                            the server's own cost over a stand-in engine: the
                                            API process's CPU a streamed token (no GPU, no model)
    mambastep bench ab --preset P --variant NAME[:MODULE.ATTR=VALUE,...] ... --plan decode:B ...
                                            variants of a preset's steps side by side (module
                                            constants set per variant), logits compared
                                            (`mambastep bench ab --help`)
    mambastep bench markdown [--steps S.json ...] [--kernels K.json] [--run R.json ...]
                             [--serve H.json ...] [--out PATH]
                                            docs/BENCHMARKS.md from those commands' --json
                                            (no GPU needed); --readme: the README's table
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import torch

from ..runtime.presets import PRESETS
from . import (bench_fp8, bench_kernels, bench_markdown, bench_prefix, bench_profile, bench_sampling, bench_spec,
               bench_steps, bench_tiles)
from .args import Parser, add_quantization, writable_path

# the benchmarks that parse their own options, dispatched before the shared parser: serve (no
# GPU, only a server), api (no GPU, no model), ab; by module, imported when asked for
OWN_OPTIONS = {"serve": "bench_serve", "api": "bench_api", "ab": "bench_ab"}

SUITES = {"kernels": bench_kernels, "steps": bench_steps, "fp8": bench_fp8, "sampling": bench_sampling,
          "prefix": bench_prefix, "spec": bench_spec, "tiles": bench_tiles}


def _window(text: str) -> tuple[int, int]:
    """``LO:HI``, 0 <= LO < HI: a slice of kernels."""
    lo, sep, hi = text.partition(":")
    if not (sep and lo.isdigit() and hi.isdigit() and int(lo) < int(hi)):
        raise argparse.ArgumentTypeError(f"expected LO:HI with 0 <= LO < HI, got {text!r}")
    return int(lo), int(hi)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in OWN_OPTIONS:
        return importlib.import_module(f"{__package__}.{OWN_OPTIONS[argv[0]]}").main(argv[1:])
    parser = Parser(prog="mambastep bench", description=__doc__)
    parser.add_argument("what", choices=sorted(SUITES) + ["profile", "markdown", *OWN_OPTIONS],
                        help="which benchmark to run")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--preset", action="append",
                        help="steps, fp8, sampling, prefix, spec, tiles: preset(s) to run (default: the suite's)")
    parser.add_argument("--batch", type=int, help="profile: decode batch; tiles: the decode rows (1-8); default 1")
    parser.add_argument("--prefill", type=int, help="profile: tokens of one prefill chunk (default 0: none)")
    parser.add_argument("--verify", type=int, metavar="K",
                        help="profile: a verify step of B sequences of 1 + K tokens (speculative decoding's)")
    parser.add_argument("--timeline", action="store_true",
                        help="profile: the captured graph's replays, each kernel charged what it adds to the step")
    parser.add_argument("--window", metavar="LO:HI", type=_window,
                        help="profile --timeline: also kernels LO to HI-1 of one replay, each with its start and end "
                             "(what ran beside what)")
    parser.add_argument("--mtp", action="store_true",
                        help="profile: a step of the preset's MTP layers as the drafter runs them (decode rows: "
                             "chained drafts; --prefill: a catch-up of that many positions)")
    add_quantization(parser)  # profile's and tiles'
    parser.add_argument("--steps", metavar="JSON", nargs="*", default=[], help="markdown: JSONs of `bench steps`")
    parser.add_argument("--kernels", metavar="JSON", help="markdown: the JSON of `bench kernels`")
    parser.add_argument("--fp8", metavar="JSON", nargs="*", default=[], help="markdown: JSONs of `bench fp8`")
    parser.add_argument("--sampling", metavar="JSON", help="markdown: the JSON of `bench sampling`")
    parser.add_argument("--prefix", metavar="JSON", help="markdown: the JSON of `bench prefix`")
    parser.add_argument("--spec", metavar="JSON", nargs="*", default=[], help="markdown: JSONs of `bench spec`")
    parser.add_argument("--run", metavar="JSON", nargs="*", default=[], help="markdown: JSONs of `mambastep run`")
    parser.add_argument("--serve", metavar="JSON", nargs="*", default=[],
                        help="markdown: JSONs of `bench serve` and of the in-process runs beside them (.ci/gpu-serve)")
    parser.add_argument("--tune", metavar="JSON", nargs="*", default=[],
                        help="markdown: JSONs of `mambastep tune --validate --json` (.ci/gpu-tune)")
    parser.add_argument("--out", metavar="PATH", help="markdown: write here instead of standard output")
    parser.add_argument("--readme", action="store_true", help="markdown: the README's summary table instead")
    args = parser.parse_args(argv)
    if args.what in OWN_OPTIONS:  # reached only with options before it, which are not its own
        parser.error(f"{args.what} takes its own options, after it: mambastep bench {args.what} --help")
    writable_path(parser, "--json", args.json)
    writable_path(parser, "--out", args.out)
    if args.quantization and args.what not in ("profile", "tiles"):
        parser.error("--quantization is profile's and tiles' (bench fp8 runs both precisions)")
    if args.batch is not None and args.what not in ("profile", "tiles"):
        parser.error("--batch is profile's and tiles'")
    if args.prefill is not None and args.what != "profile":
        parser.error("--prefill is profile's")
    args.batch = 1 if args.batch is None else args.batch
    args.prefill = args.prefill or 0
    if args.what == "tiles" and not 1 <= args.batch <= bench_tiles.MAX_ROWS:
        parser.error(f"--batch: bench tiles takes 1 to {bench_tiles.MAX_ROWS} decode rows, got {args.batch}")
    if args.verify is not None and (args.what != "profile" or args.verify < 1 or args.prefill or args.mtp):
        parser.error("--verify K (K >= 1) is profile's, without --prefill or --mtp")
    args.verify = args.verify or 0
    if args.mtp and args.what != "profile":
        parser.error("--mtp is profile's")
    preset = (args.preset or ["mamba2-130m"])[0]  # profile's
    if args.mtp and preset in PRESETS and not PRESETS[preset].get("mtp_layer_types"):
        parser.error(f"--mtp: preset {preset!r} has no MTP layers")
    if args.window and not (args.what == "profile" and args.timeline):
        parser.error("--window needs profile --timeline")
    if args.what == "markdown":
        if args.readme and not args.steps:
            parser.error("--readme needs --steps")
        text = (bench_markdown.readme_table(args.steps, args.run, args.kernels) if args.readme
                else bench_markdown.render(args.steps, args.kernels, args.run, args.serve, args.tune, args.fp8,
                                           args.sampling, args.prefix, args.spec))
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        else:
            print(text)
        return 0
    if not torch.cuda.is_available():
        parser.error("benchmarks need a CUDA device")
    if args.what == "profile":
        if args.timeline:
            print(bench_profile.timeline(preset, args.batch, args.prefill, window=args.window,
                                         quantization=args.quantization, mtp=args.mtp, verify=args.verify))
        else:
            print(bench_profile.profile(preset, args.batch, args.prefill, quantization=args.quantization,
                                        mtp=args.mtp, verify=args.verify))
        return 0
    suite = SUITES[args.what]
    takes_presets = args.what in ("steps", "fp8", "sampling", "prefix", "spec", "tiles")
    kw = {"quantization": args.quantization, "rows": args.batch} if args.what == "tiles" else {}
    result = suite.run(tuple(args.preset), **kw) if (takes_presets and args.preset) else suite.run(**kw)
    suite.print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
