"""The GPU's SM clock and board power over stretches of time, read from ``nvidia-smi`` on a
thread while open: whether a step runs at the card's power cap (its SM clock held below the
maximum while the power sits at the limit), where bytes saved in one kernel need not shorten
the step (docs/experiments.md). Without nvidia-smi (a CPU machine) nothing is sampled and every
window reads None."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time

__all__ = ["ClockSampler", "parse_sample"]

QUERY = "clocks.sm,power.draw"


def parse_sample(line: str) -> tuple[float, float] | None:
    """(SM MHz, W) from a line of ``nvidia-smi --query-gpu=clocks.sm,power.draw
    --format=csv,noheader,nounits``; None for any other line (a header, "[N/A]")."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 2:
        return None
    try:
        return float(parts[0]), float(parts[1])
    except ValueError:
        return None


def _this_gpu() -> str:
    """nvidia-smi's name for torch's current CUDA device (its UUID), or "0"."""
    try:
        import torch

        if torch.cuda.is_available():
            uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
            if uuid is not None:
                return f"GPU-{uuid}"
    except Exception:  # noqa: BLE001 - the sampler is a readout; without the UUID it reads GPU 0
        pass
    return "0"


class ClockSampler:
    """A context manager sampling the SM clock and power every ``interval_ms`` while open;
    ``window(t0, t1)`` is the mean (SM MHz, W) of the samples read between two
    ``time.monotonic()`` readings, or None where there are none. ``gpu``: nvidia-smi's ``-i``
    (default: torch's current device)."""

    def __init__(self, gpu: str | None = None, interval_ms: int = 20, command: str = "nvidia-smi"):
        self.gpu, self.interval_ms, self.command = gpu, interval_ms, command
        self._samples: list[tuple[float, float, float]] = []
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "ClockSampler":
        exe = shutil.which(self.command)
        if exe is not None:
            self._proc = subprocess.Popen(
                [exe, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", f"--loop-ms={self.interval_ms}",
                 "-i", self.gpu or _this_gpu()],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self._samples.append((time.monotonic(), *sample))

    def __exit__(self, *exc) -> bool:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._thread.join(timeout=1.0)
        return False

    def window(self, t0: float, t1: float) -> tuple[float, float] | None:
        inside = [(mhz, watts) for t, mhz, watts in list(self._samples) if t0 <= t <= t1]
        if not inside:
            return None
        return statistics.fmean(m for m, _ in inside), statistics.fmean(w for _, w in inside)
