"""``zeropipe generate RUN_DIR_OR_EXPORT --prompt TEXT [--prompt TEXT ...]``: answer prompts with a trained model.

The source is a run directory (its latest complete checkpoint, consolidated in memory, or
--checkpoint), a directory written by ``zeropipe export``, or a LoRA adapter directory.
Prompts are rendered with the training template; decoding is greedy unless --temperature.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(commands) -> None:
    parser = commands.add_parser("generate", help="answer prompts with a trained model (run directory, export or adapter)", description=__doc__)
    parser.add_argument("source", help="run directory (or one of its checkpoints/step_*), exported model directory, or LoRA adapter directory")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt, rendered as a user turn with the training template (repeat for several)")
    parser.add_argument("--image", action="append", default=None, metavar="PATH", help="vision-language models: an image for every prompt, or one per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate per prompt (default: the run's generate.max_new_tokens, else 64)")
    parser.add_argument("--checkpoint", default=None, metavar="TAG", help="run directories: the checkpoint to use (step_00000120 or 120; default: the latest complete one)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sample with this temperature (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens with this probability mass")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (with --temperature)")
    parser.add_argument("--raw", action="store_true", help="continue the prompt text as it is (models trained on plain text) instead of a user turn")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to run (default: CUDA when available)")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto", help="weights dtype (default: fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--json", action="store_true", help="print the generations as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zeropipe.families import generate, load_model

    loaded = load_model(args.source, checkpoint=args.checkpoint, device=args.device, dtype=args.dtype)
    print(f"generating with {loaded.source.describe()} on {loaded.device.type}", file=sys.stderr)
    results = generate(
        loaded,
        args.prompt,
        images=args.image,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        raw=args.raw,
    )
    if args.json:
        checkpoint = loaded.source.checkpoint
        print(
            json.dumps(
                {
                    "source": str(loaded.source.path),
                    "kind": loaded.source.kind,
                    "checkpoint": checkpoint.tag if checkpoint else None,
                    "generations": [result.to_dict() for result in results],
                },
                indent=2,
            )
        )
        return 0
    for result in results:
        print(f">>> {result.prompt}" + (f"  [{result.image}]" if result.image else ""))
        print(result.output)
    return 0
