"""The `mambastep` command: one entry point over the tools."""

from __future__ import annotations

import sys

COMMANDS = {
    "run": ("mambastep.tools.run", "serve a synthetic chat workload and report latencies (the main job)"),
    "generate": ("mambastep.tools.generate", "text from a checkpoint, streamed as it is drawn"),
    "serve": ("mambastep.tools.serve", "an OpenAI-compatible HTTP server over the engine"),
    "tune": ("mambastep.tools.tune", "choose graph buckets from a workload's step shapes"),
    "bench": ("mambastep.tools.bench", "kernel and step benchmarks on a CUDA device"),
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        print(f"mambastep: error: unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mambastep {" + ",".join(COMMANDS) + "} [options]\n")
        print("Decode runtime for Mamba2 and hybrid Mamba2/attention models.\n")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:8s} {text}")
        print("\n`mambastep COMMAND --help` explains each command's options.")
        return 0 if argv else 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
