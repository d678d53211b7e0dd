"""The benchmark tables print every measured row (the measurements themselves need a GPU)."""

import json

import pytest

from mambastep.tools import bench_kernels


def test_kernel_table_prints_every_row(capsys):
    rows = [
        {"op": "state_update", "batch": 64, "state_dtype": "float32", "ms": 0.15, "GB/s": 3600.0, "of_copy_bw": 0.84},
        {"op": "ssd_scan", "shape": "8x2048", "ms": 2.1, "TFLOP/s": 81.0, "torch_ms": 25.7, "speedup": 12.1},
        {"op": "skinny", "name": "130M in_proj", "N": 3352, "K": 768, "rows": 1, "unfused_us": 5.6,
         "fused_us": 4.9, "fused_pdl_us": 3.1},
        {"op": "sampling", "rows": 1, "mode": "sample", "torch_us": 194.0, "us": 7.6},
    ]
    bench_kernels.print_table({"device": "GPU", "date": "2026-11-30", "torch": "2", "copy_GB/s": 4274.0, "rows": rows})
    out = capsys.readouterr().out
    for cells in ("| state update | B=64 float32 state | 0.1500 |", "| SSD scan | 8x2048 tokens | 2.100 |",
                  "| 130M in_proj 3352x768 | 1 | 5.60 | 4.90 | 3.10 | 1.81x |", "| 1 | sample | 194.0 | 7.6 | 25.5x |"):
        assert cells in out
    assert sum(line.startswith("| --- |") for line in out.splitlines()) == 3  # three tables


def test_step_tables_print_every_row(capsys):
    from mambastep.tools import bench_steps

    decode = {"kind": "decode", "batch": 1, "eager_ms": 5.0, "graph_ms": 0.25, "floor_ms": 0.07,
              "back_to_back_ms": 0.21, "replay_ms": 0.2, "layered_ms": 0.5, "no_pdl_ms": 0.3}
    mixed = {"kind": "mixed", "decode": 64, "prefill": 512, "forked_ms": 1.8, "unforked_ms": 2.0, "separate_ms": 2.2}
    bench_steps.print_table({"device": "GPU", "date": "2026-11-30", "torch": "2", "copy_GB/s": 4274.0,
                             "presets": [{"preset": "mamba2-130m", "capture": ["captured 3 graphs"],
                                          "rows": [decode, mixed]}]})
    out = capsys.readouterr().out
    for cells in ("| 1 | 5.000 | 0.250 | 20.0x | 0.210 | 0.200 | 0.070 | 3.57x |",
                  "| 1 | 0.250 | 0.300 | 0.500 | 2.00x |", "| 64 + 512 | 1.800 | 2.000 | 10% | 2.200 |"):
        assert cells in out
    assert sum(line.startswith("| --- |") for line in out.splitlines()) == 3  # three tables


def test_prefill_floors_take_each_product_at_its_slower_bound():
    """The roofline floor is the FLOP floor where the matrix rate is the bound and the weights'
    bytes where bandwidth is, counting of the routed experts only those the routing reads."""
    import torch

    from mambastep.runtime.model import Model
    from mambastep.tools.bench_steps import prefill_flops, prefill_roofline_ms

    model = Model.from_preset("tiny-hybrid", dtype=torch.float32)
    tokens, moe = 64, model.blocks[4].mixer
    flops = prefill_flops(model, tokens)
    assert prefill_roofline_ms(model, tokens, None, rate=1.0, bandwidth=1e30) == pytest.approx(flops * 1e3)
    # with the FLOPs free: every matrix's bytes once, the experts' only as many as are read
    # the LM head, the projections (among them the shared expert's pair) and the conv filters
    tensors = [t for b in model.blocks for v in vars(b.mixer).values()
               for t in (v if isinstance(v, tuple) else (v,)) if isinstance(t, torch.Tensor)]
    matrices = [model.lm_head] + [t for t in tensors if t.dim() == 2 or (t.dim() == 3 and t.shape[1] == 1)]
    others = sum(t.numel() * 4 for t in matrices)
    per_expert = (moe.up[0].numel() + moe.down[0].numel()) * 4
    E = moe.up.shape[0]
    assert prefill_roofline_ms(model, tokens, None, rate=1e30, bandwidth=1.0) == pytest.approx(
        (others + E * per_expert) * 1e3)
    assert prefill_roofline_ms(model, tokens, {moe.layer: 1}, rate=1e30, bandwidth=1.0) == pytest.approx(
        (others + per_expert) * 1e3)


def test_prefill_table_prints_the_roofline_where_measured(capsys):
    from mambastep.tools import bench_steps

    prefill = {"kind": "prefill", "tokens": 2048, "graph_ms": 38.85, "floor_ms": 16.87}
    for row, cells in ((prefill, "| 2048 | 38.85 | 16.87 | 2.30x |"),
                       ({**prefill, "roofline_ms": 25.9}, "| 2048 | 38.85 | 16.87 | 2.30x | 25.90 | 1.50x |")):
        bench_steps.print_table({"device": "GPU", "date": "2026-12-01", "torch": "2", "copy_GB/s": 4274.0,
                                 "presets": [{"preset": "p", "capture": [], "rows": [row]}]})
        out = capsys.readouterr().out
        assert cells in out and ("weight bytes, the slower" in out) == ("roofline_ms" in row)


def test_step_header_names_how_the_matrix_rate_was_measured(capsys):
    """The FLOP floors' rate is the sustained one where a result has both; older results, timed
    from idle only, say so."""
    from mambastep.tools import bench_steps

    base = {"device": "GPU", "date": "2026-12-02", "torch": "2", "copy_GB/s": 4274.0, "presets": []}
    for extra, note in (({"matmul_TFLOP/s": 656.2, "matmul_idle_TFLOP/s": 694.4},
                         ", bf16 matmul 656 TFLOP/s sustained (694 from idle);"),
                        ({"matmul_TFLOP/s": 772.0}, ", bf16 matmul 772 TFLOP/s from idle;"),
                        ({}, "copy bandwidth 4274 GB/s; bf16 weights")):
        bench_steps.print_table({**base, **extra})
        assert note in capsys.readouterr().out


def test_markdown_writes_every_table_under_its_command(tmp_path):
    """docs/BENCHMARKS.md and the README's table come from the benchmarks' JSON alone."""
    import json

    from mambastep.tools import bench_markdown

    rows = [{"kind": "decode", "batch": b, "eager_ms": 5.0, "graph_ms": 0.25, "floor_ms": 0.07,
             "back_to_back_ms": 0.21, "replay_ms": 0.2} for b in (1, 256)]
    rows.append({"kind": "mixed", "decode": 64, "prefill": 512, "forked_ms": 1.8, "unforked_ms": 2.0,
                 "separate_ms": 2.2})
    steps = {"device": "GPU", "date": "2026-12-01", "torch": "2", "copy_GB/s": 4274.0,
             "presets": [{"preset": "mamba2-130m", "capture": ["captured 3 graphs"], "rows": rows}]}
    run = {"model": "mamba2-130m", "device_name": "GPU", "date": "2026-12-01", "mode": "CUDA graphs",
           "pipelined": True, "requests": 16, "concurrency": 1, "ttft_ms": {"p50": 1.5},
           "itl_ms": {"p50": 0.23, "p99": 0.25}, "output_tokens_per_s": 4000.0}
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    default = {**run, "pipelined": False, "itl_ms": {"p50": 0.3, "p99": 0.31}}
    (tmp_path / "runs.json").write_text(json.dumps({"a": run, "b": default}))
    page = bench_markdown.render(tmp_path / "steps.json", runs=[tmp_path / "runs.json"])
    assert "mambastep bench steps [--preset P ...] --json steps.json" in page and "| 64 + 512 | 1.800 | 2.000 | 10% | 2.200 |" in page
    assert "`mambastep run --preset mamba2-130m --concurrency 1 --requests 16 --pipelined --json PATH` | 2026-12-01 |" in page
    assert "through the Engine, on GPU. 2 runs:" in page
    table = bench_markdown.readme_table(tmp_path / "steps.json", [tmp_path / "runs.json"])
    assert "Measured 2026-12-01 on" in table and "| 1.50 ms / 0.300 ms (0.230 ms pipelined) |" in table
    # a steps file measured on a later day names its presets' date
    later = {**steps, "date": "2026-12-02", "presets": [{**steps["presets"][0], "preset": "nemotron-h-8b"}]}
    (tmp_path / "steps-8b.json").write_text(json.dumps(later))
    table = bench_markdown.readme_table([tmp_path / "steps.json", tmp_path / "steps-8b.json"], [tmp_path / "runs.json"])
    assert "Measured 2026-12-01 (nemotron-h-8b steps: 2026-12-02) on" in table
    # and runs of the main job from another day than the first steps file theirs
    table = bench_markdown.readme_table([tmp_path / "steps-8b.json", tmp_path / "steps.json"], [tmp_path / "runs.json"])
    assert "Measured 2026-12-02 (mamba2-130m steps: 2026-12-01; `mambastep run` of mamba2-130m: 2026-12-01) on" in table



def test_the_run_table_names_each_runs_device_where_they_differ():
    from mambastep.tools import bench_markdown

    run = {"model": "mamba2-130m", "device_name": "H200", "date": "2026-12-01", "requests": 16, "concurrency": 1,
           "ttft_ms": {"p50": 1.5}, "itl_ms": {"p50": 0.23, "p99": 0.25}, "output_tokens_per_s": 4000.0}
    one = bench_markdown.run_table([run, run])
    assert "device" not in one and one.splitlines()[2].endswith("| 2026-12-01 | 1.50 | 0.230 | 0.250 | 4000 |")
    two = bench_markdown.run_table([run, {**run, "device_name": "H100"}]).splitlines()
    assert two[0].startswith("| command | date | device |") and two[1].count("---") == 7
    assert two[2].endswith("| 2026-12-01 | H200 | 1.50 | 0.230 | 0.250 | 4000 |") and "| H100 |" in two[3]
    # an engine that held fewer requests than were in flight: its TTFT includes the wait for a slot
    queued = bench_markdown.run_table([{**run, "concurrency": 64, "slots": 7}, {**run, "slots": 7}]).splitlines()
    assert "| 1.50 (7 at a time) | 0.230 |" in queued[2] and "| 1.50 | 0.230 |" in queued[3]

def test_the_http_table_sets_each_server_run_beside_its_in_process_run(tmp_path):
    import json

    from mambastep.tools import bench_markdown

    run = {"model": "mamba2-130m", "mode": "CUDA graphs", "pipelined": False, "requests": 16, "concurrency": 1,
           "ttft_ms": {"p50": 1.5}, "itl_ms": {"mean": 0.25, "p50": 0.23, "p99": 0.25}, "output_tokens_per_s": 4000.0}
    pipelined = {**run, "pipelined": True, "itl_ms": {"mean": 0.2, "p50": 0.2, "p99": 0.2}}
    served = {"model": "mamba2-130m", "url": "http://127.0.0.1:8000", "requests": 16, "concurrency": 1,
              "ttft_ms": {"p50": 2.5}, "itl_ms": {"mean": 0.4}, "output_tokens_per_s": 3800.0}
    other = {**served, "concurrency": 64}  # no in-process run at 64: left out
    longer = {**served, "requests": 64}  # no in-process run of 64 requests: left out
    (tmp_path / "serve.json").write_text(json.dumps({"a": pipelined, "b": run, "c1": served, "c64": other,
                                                     "n64": longer}))
    # a second run of the same workload, in a file of its own: paired with its own in-process run
    again = {"in-process": {**run, "output_tokens_per_s": 5000.0}, "http": served,
             "http4": {**served, "engine": "process", "api_processes": 4}}
    (tmp_path / "again.json").write_text(json.dumps(again))
    page = bench_markdown.render(serve=[tmp_path / "serve.json", tmp_path / "again.json"])
    assert "| mamba2-130m | 1 | 16 | 0.250 / 0.400 / +0.150 | 1.50 / 2.50 | 4000 / 3800 / 95% |" in page
    assert "| mamba2-130m | 1 | 16 | 0.250 / 0.400 / +0.150 | 1.50 / 2.50 | 5000 / 3800 / 76% |" in page
    assert "| mamba2-130m (engine process, 4 API processes) | 1 | 16 |" in page
    assert "| mamba2-130m | 64 |" not in page and "| 64 | 0.250" not in page


def test_tune_tables_put_each_set_beside_the_defaults(tmp_path):
    import json

    from mambastep.tools import bench_markdown

    def s(name, graphs, tok_s, pool):
        return {"name": name, "buckets": None, "graphs": graphs, "pool_mib": pool, "expected_ms": 1.0, "eager_steps": 0,
                "measured": {"pool_mib": pool + 10, "capture_s": 1.0, "step_ms": 1.1, "itl_p50_ms": 1.2,
                             "output_tokens_per_s": tok_s}}
    result = {"model": "m", "device": "GPU", "date": "2026-12-01", "requests": 64, "concurrency": 16, "steps": 600,
              "max_graphs": 50, "sets": [s("default", 50, 1000.0, 800), s("tuned, at most 50 graphs", 20, 1050.0, 100)]}
    path = tmp_path / "tune.json"
    path.write_text(json.dumps(result))
    page = bench_markdown.render(tune=[path])
    assert "m, 64 requests at concurrency 16 (600 steps), a budget of 50 graphs" in page
    assert "| default | 50 | 800 / 810 | 1.000 | 1.100 | 1.200 | 1000 | +0.0% |" in page
    assert "| tuned, at most 50 graphs | 20 | 100 / 110 | 1.000 | 1.100 | 1.200 | 1050 | +5.0% |" in page


def test_fp8_floors_count_the_bytes_read_and_each_products_rate():
    """Quantized at load, a model's HBM floor counts FP8 values and their scales (one byte a
    weight, the excluded modules at their own width), the experts' by the ones read; the prefill
    floor takes FP8 products at the FP8 rate and the rest at bf16's."""
    import torch

    from mambastep.kernels.fp8 import Fp8Weight
    from mambastep.runtime.model import Model
    from mambastep.runtime.state_pool import StatePool
    from mambastep.tools.bench_steps import hbm_floor_bytes, prefill_flops, prefill_floor_ms, prefill_roofline_ms

    bf16 = Model.from_preset("tiny-hybrid", dtype=torch.bfloat16)
    fp8 = Model.from_preset("tiny-hybrid", dtype=torch.bfloat16, quantization="fp8")
    pool = StatePool(bf16.cfg, 2, max_context=64, dtype=torch.bfloat16)
    quantized = [w for b in fp8.blocks for v in vars(b.mixer).values()
                 for w in (v if isinstance(v, tuple) and not isinstance(v, Fp8Weight) else (v,))
                 if isinstance(w, Fp8Weight)]
    assert quantized  # the MLP's, the later Mamba layers', the experts'
    saved = sum(w.values.numel() - w.scale.numel() * 4 for w in quantized)  # 2 bytes a weight become 1, plus scales
    assert hbm_floor_bytes(bf16, pool, 1) - hbm_floor_bytes(fp8, pool, 1) == saved
    # FP8 products free: what is left is the bf16 ones'; equal rates: the FLOP floor
    rest = prefill_floor_ms(fp8, 64, rate=1.0, fp8_rate=1e30)
    assert 0 < rest < prefill_floor_ms(bf16, 64, rate=1.0, fp8_rate=1e30)
    assert prefill_floor_ms(fp8, 64, rate=1.0, fp8_rate=1.0) == pytest.approx(prefill_flops(fp8, 64) * 1e3)
    # the roofline: at no bandwidth limit, the FLOP floor at each product's rate; at no FLOP
    # limit, the bytes of every weight read (the experts' FP8 values and scales)
    assert prefill_roofline_ms(fp8, 64, None, 1.0, 1e30, fp8_rate=1e30) == pytest.approx(rest)
    assert prefill_roofline_ms(fp8, 64, None, 1e30, 1.0, fp8_rate=1e30) < prefill_roofline_ms(bf16, 64, None, 1e30, 1.0)


def test_fp8_tables_set_bf16_beside_fp8(capsys):
    from mambastep.tools import bench_fp8

    def rows(ms):
        decode = [{"kind": "decode", "batch": b, "graph_ms": ms * b, "floor_ms": 0.5 * b, "replay_ms": ms}
                  for b in bench_fp8.DECODE_BATCHES]
        return decode + [{"kind": "prefill", "tokens": 2048, "graph_ms": 30.0, "floor_ms": 20.0, "roofline_ms": 25.0},
                         {"kind": "mixed", "decode": 64, "tokens": 223, "graph_ms": 40 * ms}]

    w8a16 = [{"kind": "decode-w8a16", "batch": 64, "graph_ms": 40.0, "floor_ms": 32.0},
            {"kind": "prefill-w8a16", "tokens": 2048, "graph_ms": 24.0, "floor_ms": 20.0},
            {"kind": "mixed-w8a16", "decode": 64, "tokens": 223, "graph_ms": 25.0}]

    bench_fp8.print_table({"device": "GPU", "date": "2026-12-04", "torch": "2", "copy_GB/s": 4274.0,
                           "matmul_TFLOP/s": 676.0, "fp8_matmul_TFLOP/s": 1240.0,
                           "presets": [{"preset": "nemotron-h-8b", "bf16": {"rows": rows(1.0)},
                                        "fp8": {"rows": rows(0.8) + w8a16}, "top1_agreement": 0.9, "mean_kl": 0.01,
                                        "positions": 2048, "w8a16": {"top1_agreement": 0.85, "mean_kl": 0.02},
                                        "note": "a note"}]})
    out = capsys.readouterr().out
    assert "| decode x1 | 1.000 | 0.500 | 2.00x | 0.800 | 0.500 | 1.60x | 1.25x |" in out
    # the W8A16 experts' steps: rows of their own beside bf16's, not in place of the FP8 ones
    assert "| prefill 2048 (FLOP floor) | 30.000 | 20.000 | 1.50x | 30.000 | 20.000 | 1.50x | 1.00x |" in out
    assert ("| prefill 2048 (each product's FLOPs or bytes, the slower) | 30.000 | 25.000 | 1.20x | 30.000 | 25.000 | "
            "1.20x | 1.00x |") in out
    assert "| decode x64 | 64.000 | 32.000 | 2.00x | 51.200 | 32.000 | 1.60x | 1.25x |" in out
    assert "| decode x64, experts W8A16 | 64.000 | 32.000 | 2.00x | 40.000 | 32.000 | 1.25x | 1.60x |" in out
    assert "| prefill 2048, experts W8A16 | 30.000 | 20.000 | 1.50x | 24.000 | 20.000 | 1.20x | 1.25x |" in out
    # the mixed step has no floor of its own
    assert "| mixed 64 + 223 | 40.000 | | | 32.000 | | | 1.25x |" in out
    assert "| mixed 64 + 223, experts W8A16 | 40.000 | | | 25.000 | | | 1.60x |" in out
    assert "top-1 agreement 0.900" in out and "Note: a note" in out and "FP8 1240 TFLOP/s" in out
    assert "(experts W8A16: top-1 agreement 0.850, mean KL 0.0200 nats)" in out
    assert "left out" not in out

    # a card that held only the batches to 128: the tables follow them and say what was left out
    small = {"device": "GPU", "date": "2026-12-05", "torch": "2", "copy_GB/s": 3000.0, "matmul_TFLOP/s": 600.0,
             "fp8_matmul_TFLOP/s": 1200.0,
             "presets": [{"preset": "nemotron-3-nano-30b-a3b", "bf16": {"rows": rows(1.0)[:-3] + rows(1.0)[-2:]},
                          "fp8": {"rows": rows(0.8)[:-3] + rows(0.8)[-2:]}, "top1_agreement": 0.9, "mean_kl": 0.01,
                          "positions": 2048}]}
    out = bench_fp8.tables(small)
    assert "| decode x128 |" in out and "| decode x256 |" not in out and "| prefill 2048 (FLOP floor) |" in out
    assert "(decode x256 left out: their slots do not fit beside the bf16 model on this card)" in out
    # JSON from before the mixed step was timed: no such row
    old = {**small, "presets": [{**small["presets"][0], **{k: {"rows": [r for r in small["presets"][0][k]["rows"]
                                                                        if r["kind"] != "mixed"]}
                                                           for k in ("bf16", "fp8")}}]}
    assert "| mixed" not in bench_fp8.tables(old)


def test_fp8_bench_captures_the_steps_it_times():
    """The decode batches, the prefill chunk and the mixed step of 64 rows beside a 223-token chunk
    (in its 256-token bucket), not the mixed buckets it never runs."""
    from mambastep.graphs import Bucket
    from mambastep.tools import bench_fp8
    from mambastep.tools.bench_steps import CONTEXT, mixed_plan, prefill_plan

    buckets = bench_fp8._buckets((1, 64), mixed=True)
    assert sorted(bench_fp8._captured(buckets)) == [Bucket(0, 2048), Bucket(1), Bucket(64), Bucket(64, 256)]
    step = mixed_plan(64, prefill_plan(223, 70))
    assert buckets.choose(step.num_decode, step.num_prefill_tokens, step.num_prefill) == Bucket(64, 256)
    assert step.decode_slots.tolist() == list(range(64)) and (step.decode_context == CONTEXT).all()
    assert step.prefill_slots.tolist() == [70] and step.num_prefill_tokens == 223
    assert bench_fp8._captured(bench_fp8._buckets((1, 8), mixed=False)) == [Bucket(0, 2048), Bucket(8), Bucket(1)]


def test_the_prefix_bench_sets_the_cache_beside_none_on_the_cpu(tmp_path):
    """`bench prefix` at test size on the CPU: the workloads with and without the cache, the
    cached multi-turn run restoring with the uncached run's tokens (fp32 on the CPU: to the bit,
    whatever the batching), the probe restoring with its logprobs; its markdown section."""
    from mambastep.tools import bench_markdown, bench_prefix

    result = bench_prefix.run(("tiny-hybrid",), progress=False, prompt_tokens=100, requests=8, concurrency=2,
                              cache_gib=0.01, device="cpu")
    rows = result["presets"][0]["rows"]
    assert [(r["workload"], r["cache_gib"] > 0) for r in rows] == [("multi-turn", False), ("multi-turn", True),
                                                                   ("agentic", False), ("agentic", True),
                                                                   ("chat", False), ("chat", True)]
    assert rows[1]["hit_rate"] > 0 and rows[1]["tokens_restored"] > 0
    assert all(r["same_tokens"] == r["requests"] for r in rows[1::2])
    assert rows[5]["hit_rate"] == 0  # unique prompts
    probe = result["presets"][0]["probe"]
    assert probe["restored"] > 0 and probe["tokens_equal"] == 32 and probe["max_logprob_diff"] == 0
    path = tmp_path / "prefix.json"
    path.write_text(json.dumps(result))
    page = bench_markdown.render(prefix=str(path))
    assert "mambastep bench prefix" in page and "| multi-turn | 0.01 GiB" in page


def test_the_spec_bench_sets_speculation_beside_plain_on_the_cpu(tmp_path):
    """`bench spec` at test size on the CPU: verify steps for every k beside a decode step; alone,
    the acceptance length from 1 (no draft kept) to 1 + k (every one), set and with the preset's
    MTP layers drafting; prompt lookup's tokens and those at concurrency equal to plain
    decoding's (fp32); its markdown section."""
    from mambastep.tools import bench_markdown, bench_spec

    result = bench_spec.run(("tiny-hybrid",), progress=False, prompt_tokens=40, max_tokens=12, wide=4, device="cpu")
    p = result["presets"][0]
    assert [s["batch"] for s in p["steps"]] == [1] and list(p["steps"][0]["verify_ms"]) == list(bench_spec.DRAFTS)
    runs = p["alone"]
    assert [r["drafter"] for r in runs] == (["none"] + ["set"] * len(bench_spec.KEEP)
                                            + ["gate"] * len(bench_spec.GATE_KEEP)
                                            + ["mtp"] * len(bench_spec.MTP_KEEP) + ["ngram"])
    assert all(1 <= r["drafts"] <= max(bench_spec.DRAFTS) for r in runs if r["drafter"] == "gate")
    for drafter in ("set", "mtp"):
        lengths = [r["acceptance_length"] for r in runs if r["drafter"] == drafter]
        assert lengths[0] == 1.0 and lengths[-1] == 1 + p["num_drafts"] and all(1 <= n <= 5 for n in lengths)
    assert runs[-1]["leading_equal"] == 12 and p["wide"]["requests_equal"] == p["wide"]["mtp_requests_equal"] == 4
    # each step's HBM floor: a verify sequence's tokens route to more experts than one token, so
    # its floor grows with k, and bounds what an acceptance length can give
    step = p["steps"][0]
    floors = [step["verify_floor_bytes"][k] for k in bench_spec.DRAFTS]
    assert step["decode_floor_bytes"] < floors[0] and floors == sorted(floors)
    assert 1 < bench_spec.floor_bound(step, 2, 3.0) < 3
    assert "At the HBM floors, one sequence: an acceptance length of 3 gives at most" in bench_spec.tables(result)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(result))
    page = bench_markdown.render(spec=str(path))
    assert "mambastep bench spec" in page and "| set acceptance | 75% each |" in page
    assert "| set acceptance, the gate choosing up to 8 (" in page
    # each run's step: a verify cycle's time (its tokens over its rate), beside the exact graph's step
    plain = runs[0]
    assert f"| none (plain decoding) | - | 1.00 | {plain['tokens_per_s']:.0f} | 1.00x | " \
           f"{1e3 / plain['tokens_per_s']:.3f} |" in page
    assert "A step alone beyond the same step in an exact graph" in page
    assert "a verify step of 1 + 4 with no draft kept" in page
    # what the table says of k, read back from the JSON as from the run (whose keys are numbers)
    assert "At the HBM floors, one sequence" in page
    assert "| the MTP layers, set acceptance | 75% each |" in page and "with the MTP layers drafting" in page


def test_the_tile_bench_lists_each_projection_shape_once():
    """`bench tiles` sweeps each distinct shape the fused decode projects through, once, the LM
    head last: Granite's Mamba2, attention and shared-expert projections (not the conv weights
    or the fp32 router), normed where they read the hidden state, a SwiGLU up projection apart
    from a plain one of its shape; FP8 shapes apart from bf16's; a parallel block's mixers
    through it (Falcon-H1's)."""
    import torch

    from mambastep.runtime.model import Model
    from mambastep.tools import bench_tiles

    model = Model.from_preset("tiny-granite", dtype=torch.bfloat16)
    shapes = [s for s, _ in bench_tiles.projections(model)]
    assert [(s["name"], s["N"], s["K"], s["normed"], s["swiglu"]) for s in shapes] == [
        ("Mamba2.in_proj", 296, 64, True, False), ("Mamba2.out_proj", 64, 128, False, False),
        ("MoE.shared[0]", 128, 64, True, True), ("MoE.shared[1]", 64, 64, True, False),
        ("Attention.qkv", 128, 64, True, False), ("lm_head", 512, 64, True, False)]  # (o_proj's is shared[1]'s)
    assert not any(s["fp8"] for s in shapes)
    fp8 = Model.from_preset("tiny-granite", dtype=torch.bfloat16, quantization="fp8")
    assert any(s["fp8"] for s, _ in bench_tiles.projections(fp8))
    # a parallel block's (Falcon-H1's) projections are its own: the joint ones
    falcon = Model.from_preset("tiny-falcon-h1", dtype=torch.bfloat16)
    assert [(s["name"], s["swiglu"]) for s, _ in bench_tiles.projections(falcon)][:3] == [
        ("Parallel.in_w", False), ("Parallel.out_w", False), ("MLP.up", True)]
    assert any(not t.loop for t in bench_tiles.candidates(2048))
    assert all(t.loop for t in bench_tiles.candidates(4096))
    # more rows, narrower tiles: the partial sums a program holds stay within the one row's
    for rows in (2, 3, 8):
        tiles = bench_tiles.candidates(4096, rows)
        assert tiles and all(t.block_n * t.block_k * (4 if rows == 3 else rows) <= 16384 for t in tiles)
        assert len(tiles) < len(bench_tiles.candidates(4096))
    with pytest.raises(ValueError, match="rows must be 1 to 8"):
        bench_tiles.run(("tiny-granite",), rows=9)


@pytest.mark.gpu
def test_the_tile_bench_times_each_shape_on_the_gpu(monkeypatch):
    """Each shape timed in the table's tile and in each swept one, a SwiGLU up projection with its
    SwiGLU (in a streamed tile's epilogue, or launched after a one-tile product), and its product
    alone through ``linear``, cuBLAS and the weight-rows product (W8A8 for the FP8 preset's FP8
    shapes): every time finite, the best tile no slower than the table's. Few copies and tiles:
    it runs, not what wins."""
    import triton

    from mambastep.kernels import decode_linear
    from mambastep.tools import bench_tiles

    monkeypatch.setattr(bench_tiles, "CYCLE_BYTES", 2e6)
    monkeypatch.setattr(bench_tiles, "REPLAYS", 3)
    monkeypatch.setattr(bench_tiles, "candidates", lambda K, rows=1: [
        decode_linear._Config(True, 8, 64, 4, 2), decode_linear._Config(False, 4, triton.next_power_of_2(K), 1, 1)])
    monkeypatch.setattr(bench_tiles, "WEIGHT_ROWS_SWEEP", ((64, 64, 4, 2),))
    for quantization in (None, "fp8"):
        rows = bench_tiles.bench_preset("tiny-granite", 3e12, quantization, progress=False)["rows"]
        assert [r["name"] for r in rows if r["swiglu"]] == ["MoE.shared[0]"]
        for r in rows:
            assert len(r["swept"]) == 2, r["name"]  # both tiles launched
            assert 0 < r["best_us"] <= r["table_us"] < float("inf"), r["name"]
            assert 0 < r["linear_us"] < float("inf") and 0 < r["cublas_us"] < float("inf"), r["name"]
            assert 0 < r["weight_rows_best_us"] <= r["weight_rows_us"] < float("inf"), r["name"]
        assert any(r["fp8"] for r in rows) == (quantization == "fp8")


def test_the_tile_bench_table(capsys):
    from mambastep.tools import bench_tiles

    row = {"name": "MLP.up", "N": 16384, "K": 2048, "fp8": False, "normed": True, "swiglu": True, "floor_us": 15.8,
           "table": [True, 16, 256, 4, 3], "table_us": 21.0, "best": [False, 8, 2048, 4, 1], "best_us": 18.8,
           "linear_us": 24.8, "cublas_us": 25.3}
    bench_tiles.print_table({"device": "GPU", "date": "2026-12-04", "torch": "2", "copy_GB/s": 4250.0,
                             "presets": [{"preset": "granite-4.0-h-micro", "quantization": None, "rows": [row]}]})
    out = capsys.readouterr().out
    assert ("| MLP.up (SwiGLU) | 16384 x 2048 | 15.80 | 16 x 256, 3 stages | 21.00 | 8 x 2048 one tile, 4 warps | 18.80 | "
            "1.12x | 24.80 | 25.30 |\n") in out  # a run from before the weight-rows columns
    assert "weight rows" not in out
    assert "; one row, PDL" in out
    timed = {**row, "name": "MLP.down", "weight_rows_us": 19.5, "weight_rows_best": [128, 512, 4, 6],
             "weight_rows_best_us": 17.25}
    bench_tiles.print_table({"device": "GPU", "date": "2026-12-07", "torch": "2", "copy_GB/s": 4250.0,
                             "presets": [{"preset": "granite-4.0-h-micro", "quantization": None,
                                          "rows": [timed, row]}]})
    out = capsys.readouterr().out
    assert "| layered: cuBLAS (us) | weight rows (us) | weight rows, best | best (us) |" in out
    assert "| 24.80 | 25.30 | 19.50 | 128 x 512, 6 stages | 17.25 |" in out
    assert "| 24.80 | 25.30 | | | |" in out  # a shape the product does not take (block-scaled FP8)
    bench_tiles.print_table({"device": "GPU", "date": "2026-12-05", "torch": "2", "copy_GB/s": 4250.0,
                             "decode_rows": 4, "presets": []})
    assert "; 4 rows, PDL" in capsys.readouterr().out
