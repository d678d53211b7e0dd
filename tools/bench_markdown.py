"""docs/BENCHMARKS.md from the JSON the benchmarks wrote: each table under the command that
printed it, with the date and device the JSON records.

    mambastep bench markdown --steps s1.json s2.json --kernels kernels.json --run r1.json r2.json > docs/BENCHMARKS.md
"""

from __future__ import annotations

import json
from pathlib import Path

from . import bench_fp8, bench_kernels, bench_prefix, bench_sampling, bench_spec, bench_steps
from .tune import validated_table

__all__ = ["readme_table", "render", "run_command", "run_table", "serve_table", "tune_tables"]


def run_command(r: dict) -> str:
    """The `mambastep run` command line that wrote the result ``r``."""
    flags = [f"--preset {r['model']}"]
    if r.get("rate"):  # arrivals at a rate, in flight without a limit unless one was set
        flags.append(f"--rate {r['rate']:g}")
    if r["concurrency"] is not None:
        flags.append(f"--concurrency {r['concurrency']}")
    flags.append(f"--requests {r['requests']}")
    if r.get("quantization"):
        flags.append(f"--quantization {r['quantization']}")
    if r.get("workload", "chat") != "chat":
        flags.append(f"--workload {r['workload']}")
    if r.get("prefix_cache_gib"):
        flags.append(f"--prefix-cache-gib {r['prefix_cache_gib']:g}")
    if r.get("num_drafts"):
        flags.append(f"--speculative {r['num_drafts']}")
    if r.get("draft_model"):
        flags.append(f"--draft-model {r['draft_model']}")
    if r.get("mtp"):
        flags.append("--mtp")
    if r.get("pipelined"):
        flags.append("--pipelined")
    if r.get("mode") == "eager":
        flags.append("--eager")
    return "mambastep run " + " ".join(flags) + " --json PATH"


def run_table(runs: list[dict]) -> str:
    """One row a run; with a device column where the runs come from more than one device, and the engine's slots
    beside the TTFT where they held fewer requests than were in flight."""
    devices = len({r["device_name"] for r in runs}) > 1
    lines = [f"| command | date |{' device |' if devices else ''} TTFT p50 (ms) | inter-token p50 (ms) | "
             "inter-token p99 (ms) | output tokens/s |", "| --- | --- |" + (" --- |" if devices else "")
             + " --- | --- | --- | --- |"]
    for r in runs:
        device = f" {r['device_name']} |" if devices else ""
        slots = r.get("slots")  # fewer state slots than requests in flight: the rest wait, in their TTFT
        queued = f" ({slots} at a time)" if slots is not None and slots < (r["concurrency"] or 0) else ""
        lines.append(f"| `{run_command(r)}` | {r['date']} |{device} {r['ttft_ms']['p50']:.2f}{queued} | "
                     f"{r['itl_ms']['p50']:.3f} | {r['itl_ms']['p99']:.3f} | {r['output_tokens_per_s']:.0f} |")
    return "\n".join(lines)


def serve_table(paths) -> str:
    """Each `bench serve` result (it has a "url") beside the in-process `mambastep run` of its
    model, concurrency and request count measured with it (in the same file), one row each."""
    lines = ["| model | concurrency | requests | inter-token mean (ms): in-process / HTTP / added | TTFT p50 (ms): in-process / "
             "HTTP | output tokens/s: in-process / HTTP / kept |", "| --- | --- | --- | --- | --- | --- |"]
    for path in paths:
        lines += _serve_rows(_load_results([path]))
    return "\n".join(lines)


def _serve_rows(results: list[dict]) -> list[str]:
    served = [r for r in results if "url" in r]
    runs = [r for r in results if "url" not in r]
    lines = []
    for h in served:
        r = next((r for r in runs if r["model"] == h["model"] and r["concurrency"] == h["concurrency"]
                  and r["requests"] == h["requests"] and not r.get("pipelined") and r.get("mode") != "eager"), None)
        if r is None:
            continue
        a, b = r["itl_ms"]["mean"], h["itl_ms"]["mean"]
        x, y = r["output_tokens_per_s"], h["output_tokens_per_s"]
        n = h.get("api_processes", 1)
        api = f", {n} API process{'es' if n > 1 else ''}" if h.get("engine") == "process" else ""
        where = f" (engine {h['engine']}{api})" if h.get("engine") else ""
        lines.append(f"| {h['model']}{where} | {h['concurrency']} | {h['requests']} | {a:.3f} / {b:.3f} / {b - a:+.3f} | "
                     f"{r['ttft_ms']['p50']:.2f} / {h['ttft_ms']['p50']:.2f} | {x:.0f} / {y:.0f} / {100 * y / x:.0f}% |")
    return lines


def tune_tables(paths) -> str:
    """Each `mambastep tune --validate --json` result (files of one, or of a mapping of them, as
    .ci/gpu-tune merges them): its sets, expected and measured."""
    out = []
    for t in _load_results(paths):
        if "measured" not in t["sets"][0]:
            raise ValueError(f"{t['model']} at concurrency {t['concurrency']}: a tune result without --validate")
        rounds = (f"; each set run {t['rounds']} times, the order reversed every other time (tokens/s: the mean, "
                  "and the range)") if t.get("rounds", 1) > 1 else ""
        out += [f"{t['model']}, {t['requests']} requests at concurrency {t['concurrency']} ({t['steps']} steps), "
                f"a budget of {t['max_graphs']} graphs{rounds}; {t['date']}, {t['device']}:", "",
                validated_table(t["sets"]), ""]
        if t.get("note"):
            out[-1:-1] = ["", f"({t['note']}.)"]
    return "\n".join(out).rstrip()


def _load_results(paths) -> list[dict]:
    """Results from files each holding one, or a mapping of them."""
    runs = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        runs += list(data.values()) if "model" not in data else [data]
    return runs


def _paths(given) -> list:
    """One JSON path or several (None: none) as a list."""
    return [given] if isinstance(given, (str, Path)) else list(given or ())


def render(steps=(), kernels: str | None = None, runs=(), serve=(), tune=(), fp8=(), sampling: str | None = None,
           prefix: str | None = None, spec=()) -> str:
    """The page: ``steps`` one or more JSONs of `bench steps`, ``fp8`` of `bench fp8`, ``runs`` and ``serve`` JSONs of
    `mambastep run` and of .ci/gpu-serve, ``tune`` JSONs of `mambastep tune --validate`,
    ``kernels`` the JSON of `bench kernels`, ``sampling`` the JSON of `bench sampling`, ``prefix`` that of
    `bench prefix`, ``spec`` one or more JSONs of `bench spec`."""
    out = ["# Benchmarks", "",
           "Current numbers only, each table under the command that printed it; the whole page is written by",
           "`mambastep bench markdown` from those commands' `--json` output (`.ci/gpu-bench` runs them all).",
           "What was tried and dropped is in docs/experiments.md. Presets have random bf16 weights.", ""]
    steps = _paths(steps)
    if steps:
        out += ["## Decode and mixed steps", "", "```", "mambastep bench steps [--preset P ...] --json steps.json",
                "```", "", bench_steps.__doc__.strip(), ""]
        for path in steps:  # one run of the command each, with its own date and device
            out += [bench_steps.tables(json.loads(Path(path).read_text())), ""]
    if fp8:
        out += ["## FP8 beside bf16", "", "```", "mambastep bench fp8 [--preset P ...] --json fp8.json", "```", "",
                bench_fp8.__doc__.strip(), ""]
        for path in fp8:  # one run of the command each, with its own date, device and rates
            out += [bench_fp8.tables(json.loads(Path(path).read_text())), ""]
    if sampling:
        out += ["## Logprobs, penalties and n choices", "", "```",
                "mambastep bench sampling [--preset P ...] --json sampling.json", "```", "",
                bench_sampling.__doc__.strip(), "", bench_sampling.tables(json.loads(Path(sampling).read_text())), ""]
    if prefix:
        out += ["## Prefix cache", "", "```", "mambastep bench prefix [--preset P ...] --json prefix.json", "```", "",
                bench_prefix.__doc__.strip(), "", bench_prefix.tables(json.loads(Path(prefix).read_text())), ""]
    spec = _paths(spec)
    if spec:
        out += ["## Speculative decoding", "", "```", "mambastep bench spec [--preset P ...] --json spec.json",
                "```", "", bench_spec.__doc__.strip(), ""]
        for path in spec:  # one run of the command each, with its own date and device
            out += [bench_spec.tables(json.loads(Path(path).read_text())), ""]
    if runs:
        results = _load_results(runs)
        out += ["## The main job", "", "```", "mambastep run --preset P --concurrency C --requests N [--pipelined]",
                "```", "",
                "A synthetic chat workload (prompts ~223, outputs ~140 tokens, greedy) through the Engine, on "
                f"{' and '.join(sorted({r['device_name'] for r in results}))}. {len(results)} runs:", "",
                run_table(results), ""]
    if serve:
        out += ["## Over HTTP", "", "```", "mambastep serve --preset P --port 8000 &",
                "mambastep bench serve --url http://127.0.0.1:8000 --vocab V --concurrency C --requests N --json PATH",
                "```", "",
                "The same workload as the main job (same seed, lengths and prompt ids), streamed through the "
                "OpenAI-compatible server by client processes on the same machine, beside `mambastep run` "
                "in-process on it, measured one after the other (`.ci/gpu-serve`). The engine runs in a process of "
                "its own behind one or more HTTP server processes (`mambastep serve`'s default: two, "
                "`--api-processes N`) or in a thread of the server (`--engine thread`), as marked. "
                "Each run of the script is a group of rows, in the order of its result files "
                f"({', '.join(f'`{Path(p).name}`' for p in serve)}):",
                "", serve_table(serve), ""]
    if tune:
        out += ["## Bucket tuning", "", "```",
                "mambastep tune --preset P --requests N --concurrency C --validate --json PATH", "```", "",
                "`mambastep tune` measures every candidate bucket's step (each graph captured alone: its replay, "
                "pool and capture time, and the eager step), records the workload's step shapes, and chooses the "
                "set of least expected step time; then runs the workload with each set of its report "
                "(`.ci/gpu-tune`). Expected times are the measured replays summed over the trace; measured ones "
                "include the engine's host work.", "", tune_tables(tune), ""]
    if kernels:
        out += ["## Kernels", "", "```", "mambastep bench kernels --json kernels.json", "```", "",
                bench_kernels.tables(json.loads(Path(kernels).read_text())), ""]
    return "\n".join(out)


def _row(table, **match):
    return next(r for r in table if all(r.get(k) == v for k, v in match.items()))


def readme_table(steps, runs=(), kernels: str | None = None) -> str:
    """The README's summary: Mamba2-130M, Nemotron-H-8B and Nemotron-3-Nano side by side, every cell
    from the benchmarks' JSON."""
    steps = [steps] if isinstance(steps, (str, Path)) else list(steps)
    measured = [json.loads(Path(path).read_text()) for path in steps]
    s = measured[0]  # the date and device of the first
    presets = {p["preset"]: p["rows"] for d in measured for p in d["presets"]}
    names = [n for n in ("mamba2-130m", "nemotron-h-8b", "nemotron-3-nano-30b-a3b") if n in presets]
    results = _load_results(runs)

    def run(name, concurrency, pipelined=False):
        return next((r for r in results if r["model"] == name and r["concurrency"] == concurrency
                     and bool(r.get("pipelined")) == pipelined and not r.get("quantization")), None)

    def cell(name, what):
        rows = presets[name]
        if what == "b1":
            r = _row(rows, kind="decode", batch=1)
            return (f"{r['graph_ms']:.3f} ms ({r['eager_ms']:.1f} ms), {r['back_to_back_ms']:.3f} back to back; "
                    f"{r['graph_ms'] / r['floor_ms']:.2f}x the HBM floor")
        if what == "b256":
            return f"{_row(rows, kind='decode', batch=256)['graph_ms']:.2f} ms"
        if what == "mixed":
            r = _row(rows, kind="mixed", decode=64, prefill=512)
            gain = 100 * (1 - r["forked_ms"] / r["unforked_ms"])
            return f"{r['forked_ms']:.2f} ms ({r['unforked_ms']:.2f} ms), {gain:.0f}%"
        if what == "c1":
            a, b = run(name, 1), run(name, 1, True)
            if a is None:
                return ""
            text = f"{a['ttft_ms']['p50']:.2f} ms / {a['itl_ms']['p50']:.3f} ms"
            return text + (f" ({b['itl_ms']['p50']:.3f} ms pipelined)" if b else "")
        if what == "c64":
            r = run(name, 64)
            return f"{r['output_tokens_per_s']:,.0f}".replace(",", " ") if r else ""

    # a file measured on another day than the first names its presets' date, and runs of the
    # main job theirs
    later = [f"{', '.join(p['preset'] for p in d['presets'])} steps: {d['date']}"
             for d in measured[1:] if d["date"] != s["date"]]
    run_days: dict[str, dict[str, None]] = {}  # day -> the models run that day, in order
    for r in results:
        if r["model"] in names and r.get("date", s["date"]) != s["date"]:
            run_days.setdefault(r["date"], {})[r["model"]] = None
    later += [f"`mambastep run` of {', '.join(models)}: {day}" for day, models in sorted(run_days.items())]
    when = s["date"] + (f" ({'; '.join(later)})" if later else "")
    lines = [f"Measured {when} on an {s['device']} (bf16, random weights) by `mambastep bench steps`, "
             "`bench kernels` and `mambastep run` (`.ci/gpu-bench` runs them); the tables in docs/BENCHMARKS.md.", "",
             "| | " + " | ".join(names) + " |",
             "|" + " --- |" * (len(names) + 1)]
    labels = (("decode step, batch 1, CUDA graph (eager)", "b1"), ("decode step, batch 256, CUDA graph", "b256"),
              ("mixed step, 64 decode rows + a 512-token chunk: forked (unforked), gain", "mixed"),
              ("`mambastep run`, concurrency 1: TTFT p50 / inter-token p50", "c1"),
              ("`mambastep run`, concurrency 64: output tokens/s", "c64"))
    for label, what in labels:
        lines.append(f"| {label} | " + " | ".join(cell(n, what) for n in names) + " |")
    if kernels:
        rows = json.loads(Path(kernels).read_text())["rows"]
        su = _row(rows, op="state_update", batch=256, state_dtype="float32")
        scan = _row(rows, op="ssd_scan", shape="8x2048")
        draw = _row(rows, op="sampling", rows=1, mode="sample")
        lines.append(f"| kernels | state update {100 * su['of_copy_bw']:.0f}% of copy bandwidth at B = 256; SSD scan "
                     f"{scan['speedup']:.1f}x torch at 8 x 2048; a sampled draw over 50k logits {draw['us']:.1f} µs "
                     f"(torch ops: {draw['torch_us']:.0f} µs) |" + " |" * (len(names) - 1))
    return "\n".join(lines)
