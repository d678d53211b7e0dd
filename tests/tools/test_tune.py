"""`mambastep tune` on the CPU: measured costs (eager) cached and reused, traces read, the
bucket file written and used by the engine."""

import json

import pytest
import torch

from mambastep.graphs import BucketSet
from mambastep.graphs.tuning import StepCosts
from mambastep.runtime.engine import Engine
from mambastep.runtime.model import Model
from mambastep.tools import cli, tune_measure
from mambastep.tools.tune import read_trace, workload_steps

SMALL = ["--device", "cpu", "--quiet", "--max-decode", "4", "--max-prefill", "32"]


@pytest.fixture(scope="module")
def model():
    return Model.from_preset("tiny-hybrid", dtype=torch.float32)


@pytest.mark.parametrize("preset", ["tiny-granite", "tiny-falcon-h1"])
def test_candidates_past_the_vocabulary_are_measured(preset):
    """A prefill candidate longer than a tiny preset's vocabulary (2048 tokens of 512) is
    measured with ids inside it, on every family."""
    small = Model.from_preset(preset, dtype=torch.float32)
    measured = tune_measure.measure(small, tune_measure.Candidates((1,), (0, 2), (600,)), rounds=1, progress=False)
    costs = measured["costs"]
    assert costs["decode_eager_ms"][0] > 0 and all(row[0] > 0 for row in costs["mixed_eager_ms"])


def test_measurements_round_trip_and_are_keyed(model, tmp_path):
    candidates = tune_measure.Candidates((1, 2), (0, 2), (16, 32))
    measured = tune_measure.measure(model, candidates, rounds=1, progress=False)
    path = tmp_path / "m.json"
    tune_measure.save(measured, path)
    costs, again = tune_measure.load(path, tune_measure.cache_key(model))
    assert isinstance(costs, StepCosts) and costs.decode == (1, 2) and costs.prefill == (16, 32)
    assert len(costs.mixed_graph_ms) == 2 and all(t > 0 for row in costs.mixed_eager_ms for t in row)
    assert again == json.loads(path.read_text())
    other = dict(tune_measure.cache_key(model), dtype="bfloat16")
    assert tune_measure.load(path, other) is None  # another dtype (or model, device, code): not reused


def test_an_fp8_model_is_measured_under_a_key_of_its_own(model):
    """Quantized at load (`tune --quantization fp8`), a model's costs are cached apart from the
    full-precision model's."""
    fp8 = Model.from_preset("tiny-hybrid", dtype=torch.float32, quantization="fp8")
    assert tune_measure.cache_key(fp8) != tune_measure.cache_key(model)


def test_candidates_hold_the_defaults_sizes():
    base = BucketSet.default(cuda=True)
    c = tune_measure.Candidates.around(base)
    assert set(base.decode) <= set(c.decode) and set(base.mixed_decode) <= set(c.mixed_decode)
    assert set(base.prefill) <= set(c.prefill) and c.decode[:16] == tuple(range(1, 17))


def test_an_engine_trace_is_the_steps_it_ran_and_the_engine_uses_the_tuned_file(model, tmp_path, capsys):
    engine = Engine(model, buckets=BucketSet.default(False), use_graphs=False, progress=False, trace=True)
    from mambastep.runtime.request import SamplingParams

    for n in (5, 9, 40):
        engine.add_request(list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    trace = tmp_path / "t.jsonl"
    engine.write_trace(trace)
    steps = read_trace(trace)
    assert [(s["decode"], s["prefill_tokens"], s["prefill_seqs"]) for s in steps] == [
        (s.decode, s.prefill_tokens, s.prefill_seqs) for s in engine.trace]
    decode, mixed = workload_steps(steps)
    assert sum(decode.values()) + sum(mixed.values()) == len(engine.trace)

    out = tmp_path / "b.json"
    assert cli.main(["tune", *SMALL, "--trace", str(trace), "--measurements", str(tmp_path / "m.json"),
                     "--max-graphs", "4", "--out", str(out)]) == 0
    report = capsys.readouterr().out
    assert "| tuned, at most 4 graphs |" in report and "| default |" in report
    tuned = BucketSet.load(out)
    assert len(tuned.all()) <= 4
    # the engine runs in the tuned buckets: each step in the smallest that holds it
    again = Engine(model, buckets=out, use_graphs=False, progress=False, trace=True)
    again.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while again.has_unfinished():
        again.step()
    for s in again.trace:
        assert s.bucket == (tuned.choose(s.decode, s.prefill_tokens, s.prefill_seqs) or s.bucket)
    assert any(s.bucket.decode in tuned.decode and not s.prefill_seqs for s in again.trace)


def test_tune_reuses_its_cache_and_validates(tmp_path, capsys):
    args = ["tune", *SMALL, "--requests", "4", "--concurrency", "2", "--measurements", str(tmp_path / "m.json"),
            "--out", str(tmp_path / "b.json")]
    assert cli.main(args) == 0
    capsys.readouterr()
    assert cli.main([a for a in args if a != "--quiet"] + ["--validate"]) == 0
    captured = capsys.readouterr()
    assert "measurements of" in captured.err  # the cache, not a second measurement
    assert "| buckets | graphs | graph pool, modelled / measured (MiB) | expected mean step (ms) |" in captured.out
    assert "| default |" in captured.out and "| tuned, at most" in captured.out


def test_the_json_holds_every_set_and_what_it_measured(tmp_path):
    """(Of a model quantized at load: the option reaches the model the tuner measures.)"""
    out = tmp_path / "tune.json"
    assert cli.main(["tune", *SMALL, "--quantization", "fp8", "--requests", "4", "--concurrency", "2", "--measurements",
                     str(tmp_path / "m.json"), "--out", str(tmp_path / "b.json"), "--validate", "--rounds", "2",
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    names = [s["name"] for s in result["sets"]]
    assert names[0] == "default" and names[1].startswith("tuned, at most")
    assert result["concurrency"] == 2 and result["steps"] > 0
    for s in result["sets"]:
        assert BucketSet(**s["buckets"]) and s["graphs"] == len(BucketSet(**s["buckets"]).all())
        m = s["measured"]
        assert m["output_tokens_per_s"] > 0 and m["pool_mib"] is None  # eager on CPU
        assert len(m["output_tokens_per_s_rounds"]) == 2 and min(m["output_tokens_per_s_rounds"]) <= \
            m["output_tokens_per_s"] <= max(m["output_tokens_per_s_rounds"])
    assert result["rounds"] == 2
    assert BucketSet.load(tmp_path / "b.json") == BucketSet(**result["sets"][1]["buckets"])


def test_tune_checks_its_arguments(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"decode": 1, "prefill_tokens": 0, "prefill_seqs": 0}\n{"decode": "x"}\n')
    for argv, match in ((["--requests", "0"], "--requests: must be at least 1"),
                        (["--max-graphs", "1"], "--max-graphs: a bucket set needs at least 2"),
                        (["--rounds", "0"], "--rounds: must be at least 1"),
                        (["--out", "/nonexistent/dir/b.json"], "no directory"),
                        (["--trace", str(tmp_path / "none.jsonl")], "No such file"),
                        (["--trace", str(bad)], "bad.jsonl:2: expected a JSON object")):
        with pytest.raises(SystemExit):
            cli.main(["tune", "--device", "cpu", *argv])
        assert match in capsys.readouterr().err


def test_the_plot_marks_the_buckets_or_names_its_extra(tmp_path, capsys):
    args = ["tune", *SMALL, "--requests", "3", "--concurrency", "2", "--measurements", str(tmp_path / "m.json"),
            "--out", str(tmp_path / "b.json"), "--plot", str(tmp_path / "p.png")]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit):
            cli.main(args)
        assert 'needs matplotlib (pip install -e ".[plot]")' in capsys.readouterr().err
        return
    assert cli.main(args) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.gpu
def test_on_a_gpu_each_candidate_is_captured_alone_and_replayed():
    model = Model.from_preset("tiny-hybrid", dtype=torch.bfloat16, device="cuda")
    measured = tune_measure.measure(model, tune_measure.Candidates((1, 2), (0, 2), (16,)), rounds=2, progress=False)
    c = measured["costs"]
    assert all(p > 0 for p in c["decode_pool_mib"]) and all(p > 0 for row in c["mixed_pool_mib"] for p in row)
    assert all(t > 0 for t in c["decode_graph_ms"]) and all(s > 0 for s in measured["capture_s"]["decode"])
    assert measured["key"]["device"] == torch.cuda.get_device_name()
