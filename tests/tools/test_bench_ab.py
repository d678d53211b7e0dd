"""The A/B harness on the CPU (eager steps; the timings mean nothing there, the bookkeeping does):
every variant starts each plan from the same states, its patches are in force around its
steps, and its logits are compared with the first variant's."""

import contextlib

import pytest
import torch

from mambastep.runtime.mixers.base import Norm
from mambastep.runtime.plan import StepPlan
from mambastep.tools.bench_ab import compare, parse_variant, patched, table
from mambastep.tools.bench_steps import decode_plan


@contextlib.contextmanager
def scaled_norms():
    """Every block norm's output times 1.5: a variant whose logits must differ."""
    plain = Norm.__call__

    def scaled(self, x, **kwargs):
        return plain(self, x, **kwargs).mul_(1.5)

    Norm.__call__ = scaled
    try:
        yield
    finally:
        Norm.__call__ = plain


def test_variants_start_from_the_same_states_and_are_told_apart():
    plans = {"decode 2": decode_plan(2), "prefill 24": StepPlan.make([(list(range(3, 27)), 2, 0)])}
    variants = {"main": contextlib.nullcontext, "again": contextlib.nullcontext, "scaled": scaled_norms}
    reported = []
    rows = compare("tiny-hybrid", variants, plans, rounds=2, max_context=300, on_plan=reported.append)
    assert [(r["plan"], r["variant"]) for r in rows] == [(p, v) for p in plans for v in variants]
    assert reported == [rows[:3], rows[3:]]  # each plan's rows as soon as measured
    by = {(r["plan"], r["variant"]): r for r in rows}
    for p in plans:
        # the same code from the same states: equal, though "main" ran first and moved the states
        assert by[p, "again"]["equal"] and by[p, "again"]["max_abs_diff"] == 0.0
        assert len(by[p, "main"]["sync_ms"]) == 2
        assert ("back_to_back_ms" in by[p, "main"]) == torch.cuda.is_available()  # timed on a GPU only
    assert not by["prefill 24", "scaled"]["equal"] and by["prefill 24", "scaled"]["max_abs_diff"] > 0
    assert Norm.__call__.__name__ == "__call__"  # the patch is undone
    text = table(rows)
    assert text.count("\n") == 1 + len(rows) and "| prefill 24 | scaled |" in text and "max diff" in text
    assert table(rows[3:], header=False) == "\n".join(text.splitlines()[5:])


def test_a_switch_read_when_the_model_is_built_takes_a_model_per_variant():
    """Falcon-H1's parallel blocks join their projections when built (``parallel.JOINT``): with a
    model per variant, each variant's is built under its patch, from the same weights, so the
    logits differ by rounding alone; with one model the switch would change nothing."""
    from mambastep.runtime.mixers import parallel

    seen = []
    built = parallel.ParallelMixer.__init__

    def init(self, *args):
        built(self, *args)
        seen.append(self.joint)

    plans = {"decode 2": decode_plan(2)}
    variants = {"joint": contextlib.nullcontext, "apart": patched((parallel, {"JOINT": False}))}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(parallel.ParallelMixer, "__init__", init)
        rows = compare("tiny-falcon-h1", variants, plans, rounds=1, model_per_variant=True)
    layers = len(seen) // 2
    assert seen == [True] * layers + [False] * layers and layers > 0
    joint, apart = rows
    assert apart["top1"] == 1.0 and apart["max_abs_diff"] < 0.05 * apart["base_std"] + 1e-3


def test_a_pool_too_short_for_the_plans_is_refused():
    with pytest.raises(ValueError, match="max_context 8: the plans need 24 positions"):
        compare("tiny-hybrid", {"main": contextlib.nullcontext}, {"p": StepPlan.make([(list(range(3, 27)), 0, 0)])},
                max_context=8)


def test_a_patched_variant_sets_module_constants_while_in_force_and_refuses_unknown_names():
    from mambastep.kernels import linear, moe

    variant = patched((moe, {"PAIR_TILES_MAX": 0, "ALIGN_COUNTED_ONE_PROGRAM": 1}), (linear, {"FEW_ROWS_FP8_MAX": 2}))
    before = (moe.PAIR_TILES_MAX, moe.ALIGN_COUNTED_ONE_PROGRAM, linear.FEW_ROWS_FP8_MAX)
    with pytest.raises(RuntimeError, match="inside"):
        with variant():
            assert (moe.PAIR_TILES_MAX, moe.ALIGN_COUNTED_ONE_PROGRAM, linear.FEW_ROWS_FP8_MAX) == (0, 1, 2)
            raise RuntimeError("inside")
    assert (moe.PAIR_TILES_MAX, moe.ALIGN_COUNTED_ONE_PROGRAM, linear.FEW_ROWS_FP8_MAX) == before
    with pytest.raises(AttributeError, match="mambastep.kernels.moe has no PAIR_TILES"):
        patched((moe, {"PAIR_TILES": 64}))


def test_a_variant_sets_a_tuple_among_its_constants():
    """A variant's constants split at commas outside brackets and quotes, so a tile table's tuple
    (``kernels.moe.PAIR_DOWN_ONE_TOKEN``) can be set beside others."""
    from mambastep.kernels import moe

    name, variant = parse_variant("down 16x512:kernels.moe.PAIR_DOWN_ONE_TOKEN=(16, 512, 4),"
                                  "kernels.moe.PAIR_UP_BLOCK_K=512")
    assert name == "down 16x512"
    before = (moe.PAIR_DOWN_ONE_TOKEN, moe.PAIR_UP_BLOCK_K)
    with variant():
        assert (moe.PAIR_DOWN_ONE_TOKEN, moe.PAIR_UP_BLOCK_K) == ((16, 512, 4), 512)
    assert (moe.PAIR_DOWN_ONE_TOKEN, moe.PAIR_UP_BLOCK_K) == before
    with pytest.raises(ValueError, match="is not a Python literal"):
        parse_variant("x:kernels.moe.PAIR_DOWN_ONE_TOKEN=(16, 512")


def test_the_command_line_times_named_variants_and_refuses_what_it_cannot_set(capsys, tmp_path):
    """``mambastep bench ab``: variants by name and the module constants they set, plans by kind
    and size; a table of each plan's variants, written as JSON too. A module, a constant or a
    value it cannot take is one line naming it, before any model is built."""
    from mambastep.tools.bench_ab import main

    out = tmp_path / "ab.json"
    assert main(["--preset", "tiny-hybrid", "--variant", "main", "--variant",
                 "in turn:runtime.mixers.moe.SHARED_BESIDE_MAX_TOKENS=0,kernels.moe.ALIGN_COUNTED_ONE_PROGRAM=0",
                 "--plan", "decode:2", "--plan", "mixed:2+20", "--rounds", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("| plan | variant |") == 1 and text.index("| decode 2 | main |") < text.index("| decode 2 + 20 |")
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    assert f"tiny-hybrid on {card}" in text and "| decode 2 | in turn |" in text and "| decode 2 + 20 | main |" in text
    rows = __import__("json").loads(out.read_text())["rows"]
    # (the CPU runs its MoE layers' shared expert in turn either way: equal logits)
    assert len(rows) == 4 and all(r["equal"] for r in rows)
    for argv, match in (
            (["--variant", "x:kernels.nowhere.A=1"], "variant 'x': no module mambastep.kernels.nowhere"),
            (["--variant", "x:kernels.linear.NOPE=1"], "mambastep.kernels.linear has no NOPE"),
            (["--variant", "x:kernels.linear.FEW_ROWS_FP8_MAX=maybe"], "'maybe' is not a Python literal"),
            (["--variant", "x:FEW_ROWS_FP8_MAX=1"], "expected MODULE.ATTR=VALUE"),
            (["--variant", "main", "--plan", "decode:two"],
             "a plan is decode:B, prefill:T, mixed:B\\+T or verify:B\\+K"),
            (["--variant", "main", "--plan", "verify:2+0"], "verify:B\\+K \\(B, K > 0\\), got 'verify:2\\+0'"),
            (["--variant", "main", "--plan", "verify:0+2"], "got 'verify:0\\+2'"),
            (["--variant", "a", "--variant", "a"], "variants and plans must be named apart"),
            (["--variant", "a", "--max-context", "4"], "max_context 4: the plans need"),
            (["--variant", "a", "--preset", "nano-9000"], "unknown preset 'nano-9000'")):
        argv = ["--preset", "tiny-hybrid", *argv]
        if "--plan" not in argv:
            argv += ["--plan", "decode:1"]
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err
        assert err.startswith("mambastep bench ab: error:") and __import__("re").search(match, err), err


def test_a_verify_plan_times_a_verify_step_and_both_tails_give_its_logits(capsys):
    """``verify:B+K``: B sequences of a token and K drafts in a verify bucket; the Mamba2 tail
    fused (``replay_conv``) or in its separate launches gives the same logits."""
    from mambastep.tools.bench_ab import main

    assert main(["--preset", "tiny-hybrid", "--variant", "fused", "--variant",
                 "apart:runtime.mixers.mamba2.FUSED_VERIFY=False", "--plan", "verify:2+3", "--rounds", "1"]) == 0
    text = capsys.readouterr().out
    assert "| verify 2 x (1 + 3) | fused |" in text and "| verify 2 x (1 + 3) | apart |" in text
    assert "differ" not in text and "max diff" not in text


def test_a_benchmark_with_its_own_options_is_dispatched_by_name_and_named_when_misplaced(capsys):
    """``mambastep bench ab`` parses its own options; put after the shared ones, it is one line
    naming where its options go (not another benchmark's run)."""
    from mambastep.tools import bench

    with pytest.raises(SystemExit):
        bench.main(["ab", "--help"])
    assert "mambastep bench ab" in capsys.readouterr().out
    for what in bench.OWN_OPTIONS:
        with pytest.raises(SystemExit):
            bench.main(["--json", "x.json", what])
        assert f"error: {what} takes its own options, after it" in capsys.readouterr().err


def test_the_table_shows_the_clock_and_power_where_they_were_read():
    row = {"plan": "prefill 2048", "variant": "main", "sync_ms": [45.1], "median_ms": 45.1, "equal": True,
           "back_to_back_ms": 45.0}
    assert "| 45.000 | n/a | equal |" in table([row])
    assert "| 45.000 | 1512, 699 | equal |" in table([dict(row, sm_mhz=1511.6, power_w=698.7)])
