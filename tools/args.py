"""Command-line argument checks shared by the tools: one line of error, exit code 2, before any
engine starts."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

__all__ = ["Parser", "bucket_file", "device", "writable_path"]


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``prog: error: message`` on stderr, exit code 2."""

    def __init__(self, **kw):
        kw.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(**kw)

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def device(parser: Parser, value: str | None) -> str:
    """The --device to run on: cpu or cuda[:N], by default cuda where there is one."""
    import torch

    name = value or ("cuda" if torch.cuda.is_available() else "cpu")
    if name != "cpu" and not name.startswith("cuda"):
        parser.error(f"--device: expected cpu or cuda, got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {name}: no CUDA device is available")
    return name


def writable_path(parser: Parser, flag: str, path: str | None) -> None:
    """Fail now, not after the run, when ``path`` could not be written."""
    if path is None:
        return
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        parser.error(f"{flag} {path}: is a directory")
    if not parent.is_dir():
        parser.error(f"{flag} {path}: no directory {parent}")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        parser.error(f"{flag} {path}: not writable")


def bucket_file(parser: Parser, flag: str, path: str | None):
    """The BucketSet a ``--buckets`` file holds, or a one-line error naming what is wrong."""
    if path is None:
        return None
    from ..graphs import BucketSet

    try:
        return BucketSet.load(path)
    except FileNotFoundError:
        parser.error(f"{flag} {path}: no such file")
    except json.JSONDecodeError as e:
        parser.error(f"{flag} {path}: not valid JSON ({e.msg} at line {e.lineno})")
    except (OSError, TypeError, ValueError) as e:
        parser.error(f"{flag} {path}: not a bucket file ({e})")
