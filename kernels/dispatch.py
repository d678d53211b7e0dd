"""Each op's public entry, written once: its Triton launcher runs CUDA tensors, its plain fp32
torch reference runs CPU tensors.

    def relu2_ref(x, out=None): ...

    @with_reference(relu2_ref)
    def relu2(x, out=None):
        \"\"\"The docstring every caller reads: shapes and dtypes.\"\"\"
        ...  # the launcher: checks, grid, kernel

``relu2.triton`` is the launcher alone (tests run it on CPU tensors in Triton's interpreter) and
``relu2.reference`` the reference. The op dispatches on its first argument's device.
"""

from __future__ import annotations

import functools

__all__ = ["with_reference"]


def with_reference(reference):
    """Make the decorated Triton launcher an op that runs ``reference`` on CPU tensors."""

    def wrap(launcher):
        @functools.wraps(launcher)
        def op(*args, **kwargs):
            return (launcher if args[0].is_cuda else reference)(*args, **kwargs)

        op.triton, op.reference = launcher, reference
        return op

    return wrap
