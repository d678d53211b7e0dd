"""The main job, `mambastep run`, on its CPU default."""

import json

import pytest

from hf_models import save_tiny
from mambastep.tools import bench_markdown, cli, run


def test_run_default_prints_the_table(capsys, tmp_path):
    assert cli.main(["run", "--device", "cpu", "--quiet", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    for row in ("time to first token (ms)", "inter-token latency (ms)", "request latency (ms)", "output tokens/s"):
        assert row in out
    stats = json.loads((tmp_path / "r.json").read_text())
    assert stats["requests"] == 16 and stats["output_tokens_per_s"] > 0
    assert stats["ttft_ms"]["p50"] <= stats["ttft_ms"]["p99"]


def test_run_on_a_checkpoint(capsys, tmp_path):
    save_tiny("nemotron_h", tmp_path)
    assert run.main(["--model", str(tmp_path), "--device", "cpu", "--requests", "3", "--concurrency", "2",
                     "--quiet"]) == 0
    assert "request latency" in capsys.readouterr().out


def test_run_samples_with_top_k_and_top_p(capsys, tmp_path):
    assert run.main(["--device", "cpu", "--preset", "tiny-mamba2", "--requests", "3", "--concurrency", "2",
                     "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--quiet",
                     "--json", str(tmp_path / "r.json")]) == 0
    stats = json.loads((tmp_path / "r.json").read_text())
    assert stats["sampling"] == {"temperature": 0.8, "top_k": 20, "top_p": 0.9}


def test_run_rejects_bad_sampling_options(capsys):
    with pytest.raises(SystemExit):
        run.main(["--device", "cpu", "--top-p", "0", "--quiet"])
    assert "top_p" in capsys.readouterr().err


def test_run_reports_a_bad_checkpoint(capsys, tmp_path):
    with pytest.raises(SystemExit):
        run.main(["--model", str(tmp_path / "missing"), "--quiet"])
    assert "config.json: not found" in capsys.readouterr().err


def test_cli_help_lists_commands(capsys):
    assert cli.main(["--help"]) == 0
    assert "run" in capsys.readouterr().out


def _fails_in_one_line(capsys, argv, match):
    """The command exits 2 with one line of error naming what is wrong, before any engine starts."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


@pytest.mark.parametrize("argv, match", [
    (["--requests", "0"], "--requests: must be at least 1, got 0"),
    (["--concurrency", "-1"], "--concurrency: must be at least 1"),
    (["--max-context", "3"], "--max-context: must be at least"),
    (["--buckets", "/nonexistent/b.json"], "no such file"),
    (["--json", "/nonexistent/dir/r.json"], "no directory"),
    (["--device", "tpu"], "expected cpu or cuda"),
    (["--requests", "x"], "invalid int value"),
    (["--turns", "0"], "--turns must be at least 1"),
    (["--rate", "0"], "--rate: must be above 0 requests a second, got 0"),
    (["--prompt-tokens", "5"], "--prompt-tokens: expected 10 to --max-context - 8"),
    (["--prefix-cache-gib", "1e-9"], "--prefix-cache-gib: 1e-09 GiB holds no snapshot"),
    (["--speculative", "-1"], "--speculative: expected drafts >= 0"),
    (["--speculative", "3", "--pipelined"], "--speculative reads each step's tokens"),
    (["--draft-model", "tiny-hybrid"], "--draft-model drafts for --speculative K"),
    (["--speculative", "2", "--draft-model", "tiny-nope"], "--draft-model tiny-nope: neither a checkpoint"),
    (["--mtp"], "--mtp drafts for --speculative K"),
    (["--speculative", "2", "--mtp", "--draft-model", "tiny-hybrid"], "--draft-model and --mtp: give one drafter"),
    (["--speculative", "2", "--mtp", "--preset", "tiny-nemotron-h"], "tiny-nemotron-h: no multi-token prediction"),
])
def test_run_checks_its_arguments_first(capsys, argv, match):
    _fails_in_one_line(capsys, ["run", "--device", "cpu", "--quiet", *argv], match)


def test_run_at_a_rate_sends_each_request_when_it_arrives(capsys, tmp_path):
    """--rate: Poisson arrivals (seeded, rising), no limit in flight unless asked; the result says
    so, and its command line too."""
    assert run.arrival_times(5, 10.0, 0) == run.arrival_times(5, 10.0, 0)
    times = run.arrival_times(5, 10.0, 0)
    assert all(0 < a < b for a, b in zip(times, times[1:]))
    assert run.main(["--device", "cpu", "--quiet", "--requests", "4", "--rate", "20", "--json",
                     str(tmp_path / "r.json")]) == 0
    assert "4 requests, 20 a second" in capsys.readouterr().out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["rate"] == 20 and r["concurrency"] is None and r["requests"] == 4
    assert r["wall_s"] >= run.arrival_times(4, 20.0, 0)[-1]
    command = bench_markdown.run_command(r)
    assert "--rate 20 --requests 4" in command and "--concurrency" not in command


def test_a_request_arriving_while_the_run_is_full_counts_its_wait():
    """At a rate, a request's TTFT counts from its arrival: one that arrives while the one place in
    flight is taken waits, and its TTFT holds the whole of the first's run; sent as another
    finishes (the closed loop), it counts from then, within what is left of the run after the
    first's (both bounds follow from the order of events, whatever the steps take)."""
    from mambastep.runtime.engine import Engine

    engine = Engine.from_preset("tiny-hybrid", device="cpu", progress=False)
    convs = [[(list(range(1, 9)), 6)], [(list(range(1, 9)), 6)]]
    greedy = {"temperature": 0.0}
    at_once = run.serve(engine, convs, 1, greedy, progress=False, arrivals=[0.0, 0.0])
    assert at_once["ttft"][1] >= at_once["latency"][0]
    closed = run.serve(engine, convs, 1, greedy, progress=False)
    assert closed["ttft"][1] <= closed["wall"] - closed["latency"][0]


def test_run_says_when_the_engine_holds_fewer_requests_than_are_in_flight(capsys, tmp_path):
    """More in flight than the engine's slots (on the CPU, its largest decode bucket, 16): the rest
    queue, in their TTFT; the run names the slots, and its JSON holds them."""
    assert run.main(["--device", "cpu", "--quiet", "--requests", "20", "--concurrency", "18",
                     "--json", str(tmp_path / "r.json")]) == 0
    captured = capsys.readouterr()
    assert "holds 16 requests at a time" in captured.err and "2 of the 18 in flight wait" in captured.err
    assert "concurrency 18 (16 at a time)" in captured.out
    assert json.loads((tmp_path / "r.json").read_text())["slots"] == 16
    assert run.main(["--device", "cpu", "--quiet", "--requests", "3", "--concurrency", "2"]) == 0
    assert "at a time" not in capsys.readouterr().err


def test_run_refuses_a_bad_bucket_file(capsys, tmp_path):
    (tmp_path / "b.json").write_text("{ not json")
    _fails_in_one_line(capsys, ["run", "--device", "cpu", "--buckets", str(tmp_path / "b.json")], "not valid JSON")
    (tmp_path / "b.json").write_text('{"decode": [0]}')
    _fails_in_one_line(capsys, ["run", "--device", "cpu", "--buckets", str(tmp_path / "b.json")], "not a bucket file")


def test_unknown_command_is_named(capsys):
    assert cli.main(["foo"]) == 2
    assert "unknown command 'foo'" in capsys.readouterr().err


def test_run_at_a_short_max_context(capsys, tmp_path):
    """The shortest context the workload fits: every request stops at it, latencies still reported."""
    assert run.main(["--device", "cpu", "--quiet", "--requests", "3", "--concurrency", "2", "--max-context", "8",
                     "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["itl_ms"]["p50"] > 0


def test_run_writes_the_step_trace(tmp_path):
    """Every step the engine ran, one JSON line each, each in the smallest bucket that holds it,
    with its time; a pipelined engine's steps without one (their tokens read during the next)."""
    from mambastep.graphs import BucketSet

    trace = tmp_path / "trace.jsonl"
    assert run.main(["--device", "cpu", "--quiet", "--requests", "4", "--concurrency", "2", "--trace", str(trace)]) == 0
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert steps and sum(s["prefill_seqs"] for s in steps) >= 4
    buckets = BucketSet.default(cuda=False)
    for s in steps:
        b = buckets.choose(s["decode"], s["prefill_tokens"], s["prefill_seqs"])
        assert s["bucket"] == [b.decode, b.prefill]
        assert s["ms"] > 0
    assert run.main(["--device", "cpu", "--quiet", "--requests", "4", "--concurrency", "2", "--pipelined",
                     "--trace", str(trace)]) == 0
    assert not any("ms" in json.loads(line) for line in trace.read_text().splitlines())


@pytest.mark.parametrize("workload", ["multi-turn", "agentic"])
def test_run_workloads_that_repeat_prefixes_hit_the_prefix_cache(capsys, tmp_path, workload):
    """Conversations resent whole each turn, and long prompts sharing 90% of their tokens: with
    a prefix cache their repeats restore, and the report says how much; later turns' TTFT apart.
    (Agentic: four prefixes, each snapshotted at its branch by its second prompt, restored from
    its third.)"""
    path = tmp_path / "r.json"
    assert run.main(["--device", "cpu", "--quiet", "--workload", workload, "--requests", "12", "--concurrency", "2",
                     "--max-context", "1024", "--prefix-cache-gib", "0.01", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    stats = json.loads(path.read_text())
    assert stats["workload"] == workload and stats["prefix_cache"]["hits"] > 0
    assert stats["prefix_cache"]["tokens_restored"] > 0 and "prefix cache:" in out
    assert ("ttft_later_turns_ms" in stats) == (workload == "multi-turn")


def test_run_speculating_prints_the_table(capsys, tmp_path):
    """--speculative K on a multi-turn workload (its turns repeat what came before: prompt lookup
    finds drafts)."""
    assert run.main(["--device", "cpu", "--quiet", "--requests", "4", "--concurrency", "2", "--workload", "multi-turn",
                     "--speculative", "3", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "output tokens/s" in out and "speculative: " in out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["num_drafts"] == 3 and r["speculative"]["verified"] > 0
    assert "--speculative 3" in bench_markdown.run_command(r)


def test_run_with_the_mtp_layers_drafting(tmp_path):
    """--mtp: the default preset's MTP layers (random) draft, and the result names them."""
    assert run.main(["--device", "cpu", "--quiet", "--requests", "2", "--concurrency", "2", "--speculative", "2",
                     "--mtp", "--json", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["mtp"] and r["speculative"]["drafts"] > 0
    assert "--speculative 2 --mtp" in bench_markdown.run_command(r)


def test_run_with_a_draft_model(capsys, tmp_path):
    """--draft-model: the default preset drafting for itself (the same preset and seed: the same
    weights), so every draft is kept, and the result names it; a draft model of fewer tokens than
    the target's vocabulary is a one-line error."""
    assert run.main(["--device", "cpu", "--quiet", "--requests", "3", "--concurrency", "2", "--speculative", "2",
                     "--draft-model", "tiny-hybrid", "--json", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["draft_model"] == "tiny-hybrid" and r["speculative"]["drafts"] > 0
    assert r["speculative"]["accepted"] == r["speculative"]["drafts"]
    assert "--speculative 2 --draft-model tiny-hybrid" in bench_markdown.run_command(r)
    save_tiny("nemotron_h", tmp_path / "small")  # a vocabulary of 96 tokens, tiny-hybrid's 512
    capsys.readouterr()
    _fails_in_one_line(capsys, ["run", "--device", "cpu", "--quiet", "--speculative", "2", "--draft-model",
                                str(tmp_path / "small")], "--draft-model: its vocabulary of 96 tokens does not cover")
