import itertools
import json

import pytest
from hypothesis import given, settings, strategies as st

from mambastep.graphs import BucketSet
from mambastep.tools import cli
from mambastep.tools.tune import optimal_sizes, padding


@settings(max_examples=60, deadline=None)
@given(counts=st.dictionaries(st.integers(1, 40), st.integers(1, 20), min_size=1, max_size=7), k=st.integers(1, 4))
def test_optimal_sizes_is_optimal(counts, k):
    chosen = optimal_sizes(counts, k)
    top = max(counts)
    assert len(chosen) <= k and top in chosen
    below = sorted(s for s in counts if s < top)
    brute = min(padding(counts, tuple(sorted(set(c) | {top})))[0]
                for r in range(k) for c in itertools.combinations(below, r))
    assert padding(counts, chosen) == (brute, 0)


def test_tune_writes_a_bucket_file_run_accepts(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert cli.main(["tune", "--requests", "12", "--concurrency", "4", "--decode-graphs", "3", "--out", str(out)]) == 0
    tuned = BucketSet.load(out)
    assert len(tuned.decode) <= 3 and tuned.decode[-1] >= 4
    assert "tuned" in capsys.readouterr().out
    assert cli.main(["run", "--device", "cpu", "--quiet", "--requests", "4", "--concurrency", "4",
                     "--buckets", str(out)]) == 0
    assert json.loads(out.read_text())["max_prefill_seqs"] >= 1


def test_tune_shows_progress_and_checks_its_arguments(tmp_path, capsys):
    assert cli.main(["tune", "--requests", "4", "--concurrency", "2", "--out", str(tmp_path / "b.json")]) == 0
    err = capsys.readouterr().err
    assert "recording 4 requests" in err and "recording steps" in err  # the message, then the bar
    for argv, match in ((["--requests", "0"], "--requests: must be at least 1"),
                        (["--out", "/nonexistent/dir/b.json"], "no directory")):
        with pytest.raises(SystemExit):
            cli.main(["tune", *argv])
        assert match in capsys.readouterr().err
