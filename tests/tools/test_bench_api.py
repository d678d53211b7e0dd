"""bench api: the server's own cost over a stand-in engine, in both placements."""

import json

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")


@pytest.mark.parametrize("engine", ["process", "thread"])
def test_bench_api_streams_every_token_and_counts_the_api_cpu(engine, tmp_path):
    from mambastep.tools import cli
    from mambastep.tools.run import workload

    out = tmp_path / "api.json"
    assert cli.main(["bench", "api", "--engine", engine, "--requests", "6", "--concurrency", "3", "--step-ms", "1",
                     "--processes", "1", "--quiet", "--json", str(out)]) == 0
    stats = json.loads(out.read_text())
    assert stats["output_tokens"] == sum(n for _, n in workload(6, 256, 0))  # every request, whole
    assert stats["engine"] == engine and stats["api_cpu_s"] > 0 and stats["api_cpu_us_per_token"] > 0


def test_the_stand_in_engine_is_what_the_loops_expect():
    from mambastep.runtime.request import SamplingParams
    from mambastep.tools.bench_api import StandInEngine

    engine = StandInEngine(step_s=0, slots=2)
    a = engine.add_request([1, 2], SamplingParams(max_tokens=3))
    b = engine.add_request([3], SamplingParams(max_tokens=1))
    assert len(engine.scheduler.free_slots) == 0
    first = engine.step()
    assert [(o.id, o.finished) for o in first] == [(a, False), (b, True)] and first[1].finish_reason == "length"
    engine.abort(a)
    assert not engine.has_unfinished() and len(engine.scheduler.free_slots) == 2
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([], SamplingParams(max_tokens=1))
