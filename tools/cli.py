"""The `mambastep` command: one entry point over the tools."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="mambastep",
        description="Decode runtime for Mamba2 and hybrid Mamba2/attention models.",
    )
    parser.add_argument("command", choices=["bench"], help="bench: kernel benchmarks on a CUDA device")
    args, rest = parser.parse_known_args(argv[:1])
    if args.command == "bench":
        from .bench import main as bench_main

        return bench_main(argv[1:])
    return 2


if __name__ == "__main__":
    sys.exit(main())
