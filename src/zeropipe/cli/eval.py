"""``zeropipe eval RUN_DIR``: eval loss and perplexity of a run's checkpoint on held-out data.

Runs in this process on CPU: the checkpoint's ZeRO shards are consolidated (as ``zeropipe
export`` does) and the model evaluated directly, without starting DeepSpeed ranks.
"""

from __future__ import annotations

import argparse
import json


def register(commands) -> None:
    parser = commands.add_parser("eval", help="eval loss and perplexity of a run's checkpoint", description=__doc__)
    parser.add_argument("source", help="run directory, or one of its checkpoints/step_* directories")
    parser.add_argument("--checkpoint", metavar="TAG", help="checkpoint to evaluate, e.g. step_00000120 (default: the latest complete one)")
    parser.add_argument("--data", metavar="FILE", help="evaluate on this file (formats of data.path) instead of the run's held-out data")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="compute dtype (default: the run's precision, as in training)")
    parser.add_argument("--batch-size", type=int, default=None, help="examples per forward pass (default: the run's micro-batch size)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zeropipe.families.causal_lm.evaluation import evaluate_checkpoint
    from zeropipe.families.causal_lm.preference import evaluate_preference_checkpoint, preference_run

    if preference_run(args.source) is not None:
        # A preference run: the share of held-out pairs whose chosen answer gets the higher reward.
        if not args.data:
            print("zeropipe eval: a preference run is evaluated on held-out pairs: give them with --data FILE")
            return 2
        result = evaluate_preference_checkpoint(args.source, args.data, checkpoint=args.checkpoint, batch_size=args.batch_size)
        if args.json:
            print(json.dumps(result))
            return 0
        print(f"preference accuracy {result['preference_accuracy']:.3f}  mean reward margin {result['reward_margin']:.4f}")
        print(f"  {result['pairs']:,} pairs of {result['data']} ({result['method']})")
        print(f"  checkpoint {result['checkpoint']} (step {result['step']}) of {result['run']}, computed in fp32")
        return 0

    found = family_evaluation(args.source, args.checkpoint)
    if found is not None:
        return run_family_eval(args, found)
    result = evaluate_checkpoint(args.source, checkpoint=args.checkpoint, data=args.data, dtype=args.dtype, batch_size=args.batch_size)
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    print(f"eval loss {result.loss:.4f}  perplexity {result.perplexity:.4g}")
    print(f"  {result.tokens:,} loss tokens in {result.examples:,} examples of {result.data}")
    print(f"  checkpoint {result.checkpoint} (step {result.step}) of {result.run}, computed in {result.dtype}")
    return 0



def family_evaluation(source: str, checkpoint: str | None):
    """(run, checkpoint, the family's own evaluation) where SOURCE's family evaluates its held-out data itself (a diffusion run's
    validation loss: ``evaluate_held_out``); None leaves it to the language models' path and its messages."""
    from zeropipe.errors import ZeroPipeError
    from zeropipe.families import family_named
    from zeropipe.families.causal_lm.evaluation import resolve_run_checkpoint

    try:
        run, info = resolve_run_checkpoint(source, checkpoint)
        family = family_named(run.read_config().model.family)
    except ZeroPipeError:
        return None
    evaluate = getattr(family, "evaluate_held_out", None)
    return (run, info, evaluate) if evaluate is not None else None


def run_family_eval(args: argparse.Namespace, found) -> int:
    """A diffusion run's validation loss: its held-out images at the fixed timesteps and noise training used (docs/diffusion.md)."""
    from zeropipe.errors import ZeroPipeError

    run, info, evaluate = found
    if args.data or args.batch_size:
        raise ZeroPipeError(
            f"{'--data' if args.data else '--batch-size'} applies to language models: a diffusion run is evaluated on the held-out images it kept "
            "(data.eval_path or data.eval_fraction), one image and timestep per forward pass, as during training: leave it out"
        )
    result = evaluate(run, info, dtype=args.dtype)
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    print(f"validation loss {result.loss:.4f}  (mean over {len(result.loss_by_quantile)} fixed timestep quantiles)")
    print("  by quantile: " + "  ".join(f"{q} {loss:.4f}" for q, loss in result.loss_by_quantile.items()))
    print(f"  {result.examples:,} held-out item(s); checkpoint {result.checkpoint} (step {result.step}) of {result.run}, computed in {result.dtype}")
    return 0
