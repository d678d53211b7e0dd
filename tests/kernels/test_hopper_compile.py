"""Without a GPU, the interpreter runs the kernels' logic but never compiles them: here the MoE
kernels, the streamed skinny projections and a Mamba2 prefill chunk's kernels are compiled for
Hopper (sm_90) as the JIT would on an H200, in a process of its own with the interpreter off
(``hopper_compile.py``), none of them spilling registers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests compile them for real")
def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = Path(__file__).with_name("hopper_compile.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "0 failed to compile" in done.stdout
