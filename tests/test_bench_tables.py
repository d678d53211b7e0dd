"""The benchmark tables print every measured row (the measurements themselves need a GPU)."""

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
