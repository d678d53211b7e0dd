"""mambastep generate: text from a checkpoint, streamed to standard output as it is drawn.

    mambastep generate --model PATH "The capital of France is"
    mambastep generate --model PATH --chat --system "Be brief." "What is a state space model?"

The checkpoint's tokenizer.json encodes the prompt (with --chat, the messages go through its
chat template: chat_template.jinja, tokenizer_config.json's, or --chat-template PATH) and decodes
the tokens as complete UTF-8 text. Sampling options left unset take the checkpoint's
generation_config.json values, else greedy. A preset (random weights, no tokenizer) reads and
writes text as bytes, to try the path.
"""

from __future__ import annotations

import sys
import time

import torch

from ..graphs import BucketSet
from ..runtime.presets import PRESETS
from ..runtime.request import SamplingParams
from ..runtime.serving.tokenizer import TokenizerError
from .args import Parser, add_quantization, add_sampling, device as device_arg, sampling, template_file, text_engine

# one request: a decode graph of one row and prompt chunks of up to 512 tokens
BUCKETS = BucketSet(decode=(1,), mixed_decode=(0,), prefill=(512,), max_prefill_seqs=1)


def main(argv=None) -> int:
    parser = Parser(prog="mambastep generate", description=__doc__)
    parser.add_argument("prompt", help="the prompt text (with --chat, the user's message)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="PATH", help="HF checkpoint directory with tokenizer.json")
    source.add_argument("--preset", choices=sorted(PRESETS), help="built-in shape with random weights (text as bytes)")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the chat template")
    parser.add_argument("--system", help="with --chat: a system message before it")
    parser.add_argument("--chat-template", metavar="PATH", help="with --chat: a chat template file (the template, "
                        "or JSON with a \"chat_template\" field) in place of the checkpoint's")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    add_sampling(parser, checkpoint_defaults=True)
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    parser.add_argument("--stop", action="append", default=[], help="a string that ends the text (repeatable)")
    parser.add_argument("--max-context", type=int, default=4096, help="prompt + output tokens")
    add_quantization(parser)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    args = parser.parse_args(argv)

    device = device_arg(parser, args.device)
    for flag, value in (("--system", args.system), ("--chat-template", args.chat_template)):
        if value is not None and not args.chat:
            parser.error(f"{flag}: goes with --chat")
    template_file(parser, args.chat_template)
    if any(not s for s in args.stop):
        parser.error("--stop: expected a non-empty string")
    sampling(parser, args, seed=args.seed, max_tokens=args.max_tokens)  # the options alone, checked now
    gpu = device.startswith("cuda")
    common = dict(dtype=torch.bfloat16 if gpu else torch.float32, device=device, num_slots=1,
                  max_context=args.max_context, buckets=BUCKETS, use_graphs=gpu and not args.eager, progress=False,
                  quantization=args.quantization)
    text = text_engine(parser, args.model, args.preset, chat_template=args.chat_template, **common)
    params = SamplingParams(**sampling(parser, args, text.tokenizer.sampling_defaults, seed=args.seed,
                                       max_tokens=args.max_tokens))
    messages = [{"role": "user", "content": args.prompt}]
    if args.system is not None:
        messages.insert(0, {"role": "system", "content": args.system})
    try:
        text.add(messages if args.chat else args.prompt, params, stop=args.stop)
    except (ValueError, TokenizerError) as e:
        parser.error(str(e))

    start, tokens, reason = time.perf_counter(), 0, None
    while text.has_unfinished():
        for out in text.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
            tokens += len(out.token_ids)
            reason = out.finish_reason or reason
    seconds = time.perf_counter() - start
    sys.stdout.write("\n")
    print(f"{tokens} tokens in {seconds:.2f} s ({tokens / max(seconds, 1e-9):.1f} tokens/s), finished: {reason}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
