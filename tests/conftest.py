import os

import pytest
import torch

# Without CUDA, Triton kernels run in Triton's interpreter on CPU tensors. The flag must be set
# before any kernel module is imported, which is why it lives here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker's CPU work (the references, HF models) gets its share of the
# cores. With torch's default of one thread per core in every worker, 8 workers on the H200
# host's 16 cores stalled CPU tests that take seconds alone for minutes.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _workers))


def _fix_interpreter_bf16_dot():
    """Triton 3.9's interpreter multiplies bf16 ``tl.dot`` operands as their raw uint16 bits;
    widen them to fp32 first. Only the interpreter is patched: compiled kernels are untouched."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widen(t):
        if t.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle((t.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return t

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _narrow_with(convert):
    """Route the interpreter's float casts through ``convert(src, dst_type)``: its handle where
    it returns one, else the interpreter's own conversion."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    for name in ("cast_impl", "create_fp_to_fp", "create_fp_trunc"):
        def cast(self, src, dst_type, *args, _original=getattr(builder, name)):
            converted = convert(src, dst_type)
            return converted if converted is not None else _original(self, src, dst_type, *args)
        setattr(builder, name, cast)


def _fix_interpreter_bf16_rounding():
    """The interpreter narrows fp32 to bf16 by truncation; GPUs round to nearest even. Round
    here too, so kernels that round intermediates (as the unfused ops they replace do) agree
    with their references to the last bit there as well."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def to_bf16(src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return None
        bits = src.data.astype(np.float32).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
        return interpreter.TensorHandle(rounded, tl.bfloat16)

    _narrow_with(to_bf16)


def _fix_interpreter_fp8_rounding():
    """The interpreter narrows to float8 (e4m3) bit by bit, and a value that rounds up past its
    binade's largest mantissa (127.3 -> 128) loses the carry: it lands a binade low (64). GPUs
    round to nearest even as torch does (``test_attention``'s rounding test checks there too);
    convert with torch here, so kernels that store FP8 values agree with their references on CPU."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def to_e4m3(src, dst_type):
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar not in (tl.float32, tl.float16, tl.bfloat16):
            return None
        data = src.data
        if src.dtype.scalar == tl.bfloat16:
            data = (data.astype(np.uint32) << 16).view(np.float32)
        values = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
        return interpreter.TensorHandle(values.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), tl.float8e4nv)

    _narrow_with(to_e4m3)


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_bf16_dot()
    _fix_interpreter_bf16_rounding()
    _fix_interpreter_fp8_rounding()


# MAMBASTEP_SWITCHES="MODULE.ATTR=VALUE[,...]" (modules under mambastep, as `mambastep bench ab`'s
# variants name them): those module constants set for the whole run, in every worker, so that a
# switch built off can pass the suite on before it is turned on
if os.environ.get("MAMBASTEP_SWITCHES"):
    from mambastep.tools.bench_ab import parse_variant

    parse_variant("switches:" + os.environ["MAMBASTEP_SWITCHES"])[1]().__enter__()


def pytest_report_header(config):
    switches = os.environ.get("MAMBASTEP_SWITCHES")
    return f"MAMBASTEP_SWITCHES: {switches}" if switches else None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """Where kernel tests run: CUDA when present, else CPU tensors through the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
