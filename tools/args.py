"""Command-line argument checks shared by the tools: one line of error, exit code 2, before any
engine starts."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

__all__ = ["Parser", "add_quantization", "add_sampling", "bucket_file", "device", "sampling", "template_file",
           "text_engine", "writable_path"]


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``prog: error: message`` on stderr, exit code 2."""

    def __init__(self, **kw):
        kw.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(**kw)

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def add_quantization(parser: Parser) -> None:
    """--quantization: how to store a full-precision model's block linears."""
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="fp8: quantize the block linears to FP8 at load time, per output channel, keeping "
                             "attention and the Mamba layer before it in full precision (NVIDIA's recipe); the "
                             "speed FP8 checkpoints get. An FP8 checkpoint is read as stored either way")


def add_speculative(parser: Parser) -> None:
    """--speculative K: prompt-lookup drafts verified in one step (``runtime.speculative``)."""
    parser.add_argument("--speculative", type=int, default=0, metavar="K",
                        help="draft up to K tokens a step by prompt lookup (the output repeating its context: "
                             "code edits, retrieval, summaries) and verify them in one step while at most 4 "
                             "requests decode, where and with as many drafts (1, 2, 4, ... K) as measured steps "
                             "find it pays; the tokens are the same (default 0: off; not with --pipelined)")
    parser.add_argument("--draft-model", metavar="PATH|PRESET",
                        help="with --speculative K: draft with this small model of the same vocabulary (its greedy "
                             "continuation, on an engine of its own) instead of prompt lookup: an HF checkpoint "
                             "directory, or a preset (random weights: what drafting costs)")
    parser.add_argument("--mtp", action="store_true",
                        help="with --speculative K: draft with the checkpoint's own multi-token prediction layers "
                             "(Nemotron 3's num_nextn_predict_layers, read from the checkpoint; a preset's are "
                             "random) instead of prompt lookup")


def speculative_arg(parser: Parser, args):
    """The engine's ``Speculative`` from --speculative, or None; a bad value is a usage error."""
    from ..runtime.presets import PRESETS
    from ..runtime.speculative import Speculative

    if args.speculative < 0:
        parser.error(f"--speculative: expected drafts >= 0 (0: off), got {args.speculative}")
    if args.speculative and args.pipelined:
        parser.error("--speculative reads each step's tokens before it schedules the next: not with --pipelined")
    for flag, given in (("--draft-model", args.draft_model), ("--mtp", args.mtp)):
        if given and not args.speculative:
            parser.error(f"{flag} drafts for --speculative K: give K, the drafts a step")
    if args.draft_model and args.mtp:
        parser.error("--draft-model and --mtp: give one drafter")
    if args.draft_model and not (os.path.isdir(args.draft_model) or args.draft_model in PRESETS):
        parser.error(f"--draft-model {args.draft_model}: neither a checkpoint directory nor a preset")
    if not args.speculative:
        return None
    preset = args.draft_model in PRESETS  # its weights from --seed, as the target preset's
    return Speculative(num_drafts=args.speculative, draft_model=args.draft_model,
                       draft_seed=getattr(args, "seed", 0) if preset else None, mtp=args.mtp)


# add_sampling's options, greedy where neither the command line nor the checkpoint names one
_GREEDY = dict(temperature=0.0, top_k=0, top_p=1.0)


def add_sampling(parser: Parser, checkpoint_defaults: bool = False) -> None:
    """--temperature, --top-k and --top-p; unset, greedy, or with ``checkpoint_defaults`` those
    of the checkpoint's generation_config.json first."""
    unset = " (default: the checkpoint's generation_config.json, else %s)" if checkpoint_defaults else " (default: %s)"
    parser.add_argument("--temperature", type=float, help="sampling temperature, 0 greedy" + unset % 0)
    parser.add_argument("--top-k", type=int, help="sample from the k most likely tokens, 0 off" + unset % 0)
    parser.add_argument("--top-p", type=float, help="sample from the smallest set of tokens whose "
                        "probability reaches p, 1 off" + unset % 1)


def sampling(parser: Parser, args, defaults: dict | None = None, **fields) -> dict:
    """The SamplingParams fields of ``add_sampling``'s options (and ``fields``), over
    ``defaults`` (generation_config.json's) where an option is unset, checked: a bad value is a
    one-line error naming where it came from."""
    from ..runtime.request import SamplingParams

    given = {k: v for k, v in dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p).items()
             if v is not None}
    kw = {**_GREEDY, **(defaults or {}), **given, **fields}
    try:
        SamplingParams(**{**_GREEDY, **given, **fields})
    except ValueError as e:
        parser.error(str(e))
    try:
        SamplingParams(**kw)
    except ValueError as e:
        parser.error(f"generation_config.json: {e}")
    return kw


def template_file(parser: Parser, path: str | None) -> None:
    """--chat-template PATH: a readable file, checked before the engine's minutes of start."""
    if path is not None and not os.path.isfile(path):
        parser.error(f"--chat-template: {path} is not a file")


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


def text_engine(parser: Parser, model: str | None, preset: str | None, **engine_kw):
    """A TextEngine over ``--model PATH`` (its tokenizer) or ``--preset NAME`` (text as bytes),
    ``engine_kw`` as ``TextEngine.load`` takes them; a bad checkpoint (or draft model, or engine
    setting) is a one-line error naming what is wrong."""
    from ..runtime.config import ConfigError
    from ..runtime.serving.text import TextEngine
    from ..runtime.serving.tokenizer import TokenizerError
    from ..runtime.weights import WeightError

    try:
        return TextEngine.load(model, preset, **engine_kw)
    except (ConfigError, WeightError, TokenizerError, ValueError) as e:
        parser.error(str(e))
