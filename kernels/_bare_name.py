"""What this folder does when it is imported by the bare name ``kernels``.

The checkout's root is the ``mambastep`` package, so this folder is ``mambastep.kernels``. Where
the root itself is on ``sys.path`` (``python3 -m pytest`` or ``python3 -m mambastep...`` run from
the checkout, or a script kept in it), a bare ``import kernels`` finds this folder before HF's
``kernels`` package, which transformers 5.25 imports; transformers then fails on names this
folder does not have. The import is handed to the package that the name means instead.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def hand_over() -> None:
    """Put the installed ``kernels`` package in ``sys.modules`` in place of this folder, found on
    ``sys.path`` without the checkout's root; with none installed, fail as if there were none."""
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    for name in [n for n in sys.modules if n == "kernels" or n.startswith("kernels.")]:
        del sys.modules[name]
    if spec is None:
        raise ModuleNotFoundError(
            f"No module named 'kernels' ({root}/kernels is mambastep.kernels, found by the bare name only "
            "because the checkout's root is on sys.path)", name="kernels")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("kernels", None)
        raise
