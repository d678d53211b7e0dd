"""The clock sampler against a stand-in nvidia-smi that prints what the real one would."""

import os
import time

from mambastep.tools.gpu_clocks import ClockSampler, parse_sample


def test_a_line_is_read_as_mhz_and_watts_and_anything_else_is_not():
    assert parse_sample("1755, 698.41\n") == (1755.0, 698.41)
    assert parse_sample("[N/A], 120.5") is None
    assert parse_sample("clocks.current.sm [MHz], power.draw [W]") is None
    assert parse_sample("") is None


def test_a_window_averages_the_samples_read_inside_it(tmp_path):
    fake = tmp_path / "nvidia-smi"
    # the arguments the sampler passes, then a sample every 10 ms, as --loop-ms would
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\n'
                    'while true; do echo "1500, 700.00"; echo "[N/A], [N/A]"; sleep 0.01; done\n')
    os.chmod(fake, 0o755)
    with ClockSampler(gpu="GPU-x", interval_ms=10, command=str(fake)) as clocks:
        t0 = time.monotonic()
        deadline = t0 + 30.0  # a bound on waiting for the first sample, not a timing
        while clocks.window(t0, time.monotonic()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        t1 = time.monotonic()
    assert clocks.window(t0, t1) == (1500.0, 700.0)
    assert clocks.window(t0 - 100.0, t0 - 99.0) is None  # before any sample
    args = (tmp_path / "args").read_text().split()
    assert "--query-gpu=clocks.sm,power.draw" in args and "--loop-ms=10" in args and args[-2:] == ["-i", "GPU-x"]


def test_without_nvidia_smi_nothing_is_sampled():
    with ClockSampler(command="no-such-nvidia-smi") as clocks:
        t0 = time.monotonic()
    assert clocks.window(t0 - 1.0, time.monotonic()) is None
