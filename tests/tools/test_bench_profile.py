"""The timeline profile's accounting (the profiling itself needs a GPU): replays split apart by
the idle between them, and each kernel charged what it adds to its replay's span."""

import re

import pytest

from mambastep.tools import bench
from mambastep.tools.bench_profile import (busy_us, kernel_shares, kernel_window, profile, short_name,
                                           split_replays, timeline)


def test_each_kernel_is_charged_what_it_adds_and_the_charges_sum_to_the_span():
    # in end order: a, then b (started inside a: a programmatic dependent), then c (beside b on
    # another stream); a second replay of the same step 1 ms later; a stray copy on its own
    step = [(0.0, 10.0, "a_kernel(float*)"), (8.0, 20.0, "b"), (15.0, 25.0, "void c<128>(int)")]
    kernels = step + [(s + 1000, e + 1000, n) for s, e, n in step] + [(3000.0, 3000.8, "Memcpy HtoD")]
    replays = split_replays(kernels)
    assert len(replays) == 2
    span, rows = kernel_shares(replays)
    assert span == 25.0
    got = {(r["prev"], r["kernel"], r["next"]): (r["share_us"], r["per_call_us"], r["duration_us"], r["calls"])
           for r in rows}
    assert got == {("-", "a_kernel", "b"): (10.0, 10.0, 10.0, 1.0), ("a_kernel", "b", "void c"): (10.0, 10.0, 12.0, 1.0),
                   ("b", "void c", "-"): (5.0, 5.0, 10.0, 1.0)}
    assert [r["kernel"] for r in rows] == ["a_kernel", "b", "void c"]  # largest charge first (ties in end order)


def test_a_kernel_run_twice_a_step_counts_both_calls():
    step = [(0.0, 4.0, "k"), (4.5, 9.0, "k"), (9.0, 10.0, "m")]
    span, rows = kernel_shares(split_replays(step + [(s + 500, e + 500, n) for s, e, n in step]))
    assert span == 10.0
    by_key = {(r["prev"], r["kernel"], r["next"]): r for r in rows}
    assert by_key[("-", "k", "k")]["share_us"] == 4.0 and by_key[("k", "k", "m")]["share_us"] == 5.0
    assert by_key[("k", "m", "-")]["calls"] == 1.0


def test_the_device_idle_between_kernels_is_the_span_less_the_union_of_their_runs():
    """Kernels overlapping (a dependent started early, a second stream) count once; a gap counts as
    idle; the means are per replay."""
    overlapping = [(0.0, 10.0, "a"), (8.0, 20.0, "b"), (15.0, 25.0, "c")]
    gapped = [(0.0, 4.0, "k"), (4.5, 9.0, "k"), (9.0, 10.0, "m"), (2.0, 3.0, "inside k")]
    assert busy_us([overlapping]) == (3.0, 25.0)
    assert busy_us([gapped]) == (4.0, 9.5)
    assert busy_us([overlapping, gapped]) == (3.5, 17.25)
    assert busy_us([]) == (0.0, 0.0)


def test_kernel_names_lose_their_template_arguments_and_signature():
    assert short_name("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int)") == \
        "void at::native::vectorized_elementwise_kernel"
    assert short_name("_grouped_kernel") == "_grouped_kernel"
    assert len(short_name("x" * 100)) == 48


def test_a_window_lists_kernels_in_start_order_from_the_replays_start():
    """Kernels that overlap keep their own start and end: b starts inside a (a programmatic
    dependent), c beside b (another stream)."""
    replay = [(108.0, 120.0, "b"), (100.0, 110.0, "void a<4>(int)"), (115.0, 125.5, "c")]
    assert kernel_window(replay, 1, 3) == ["| 1 | 8.00 | 20.00 | 12.00 | b |", "| 2 | 15.00 | 25.50 | 10.50 | c |"]
    assert kernel_window(replay, 0, 1) == ["| 0 | 0.00 | 10.00 | 10.00 | void a |"]
    assert kernel_window(replay, 5, 9) == []


@pytest.mark.parametrize("argv,message", [
    (["profile", "--window", "3:2", "--timeline"], "expected LO:HI"),
    (["profile", "--window", "a:b", "--timeline"], "expected LO:HI"),
    (["profile", "--window", "1:4"], "--window needs profile --timeline"),
    (["steps", "--quantization", "fp8"], "--quantization is profile's"),
    (["profile", "--quantization", "int4"], "invalid choice: 'int4'"),
    (["tiles", "--batch", "9"], "bench tiles takes 1 to 8 decode rows, got 9"),
    (["steps", "--batch", "4"], "--batch is profile's and tiles'"),
    (["tiles", "--prefill", "64"], "--prefill is profile's"),
    (["steps", "--mtp"], "--mtp is profile's"),
    (["profile", "--mtp", "--preset", "nemotron-h-8b"], "--mtp: preset 'nemotron-h-8b' has no MTP layers"),
    (["steps", "--verify", "2"], "--verify K (K >= 1) is profile's"),
    (["profile", "--verify", "0"], "--verify K (K >= 1) is profile's"),
    (["profile", "--verify", "2", "--prefill", "8"], "without --prefill or --mtp"),
])
def test_a_bad_option_is_a_one_line_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("mtp", [False, True])
def test_a_step_is_profiled_and_its_replays_charged_on_the_gpu(mtp):
    """Both views of a real step run: a tiny hybrid's, or its MTP layers' (two chained drafts
    beside a catch-up of five positions); the timeline's header gives the replay's span beside
    the whole step's time, and its table charges named kernels."""
    table = profile("tiny-hybrid", 2, 5, mtp=mtp)
    assert "Self CUDA" in table
    text = timeline("tiny-hybrid", 2, 5, mtp=mtp)
    header = text.splitlines()[0]
    assert header.startswith("tiny-hybrid" + (" MTP layers" if mtp else "") + ", 2 decode rows + a 5-token chunk")
    span, whole = (float(x) for x in re.findall(r"([0-9.]+) us \(me", header))
    assert 0 < span and 0 < whole
    count, busy, idle = (float(x) for x in re.findall(r"([0-9.]+) (?:kernels|us)", text.splitlines()[1]))
    assert count >= 3 and 0 < busy <= span and abs(busy + idle - span) < 0.2
    assert text.count("| **") == 0 and text.count("> **") >= 3


@pytest.mark.gpu
def test_a_verify_step_is_profiled_on_the_gpu():
    """``--verify``: two sequences of 1 + 3 tokens in the verify bucket's graph, its replays charged."""
    assert "Self CUDA" in profile("tiny-hybrid", 2, verify=3)
    text = timeline("tiny-hybrid", 2, verify=3)
    assert text.splitlines()[0].startswith("tiny-hybrid, 2 verify sequences of 4 tokens:")
    assert text.count("> **") >= 3
