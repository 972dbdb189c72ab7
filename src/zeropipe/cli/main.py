"""The ``zeropipe`` command: registers one sub-command per module and turns errors into messages."""

from __future__ import annotations

import argparse
import sys

from zeropipe import __version__
from zeropipe.cli import calibrate, check, convert, doctor, export, generate, plan, runs, train, ui
from zeropipe.cli import eval as evaluate  # `eval` would shadow the builtin here
from zeropipe.errors import ZeroPipeError

COMMANDS = [train, convert, check, plan, export, evaluate, generate, doctor, calibrate, ui, runs]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeropipe", description="Plan, launch, watch and export DeepSpeed ZeRO training runs.")
    parser.add_argument("--version", action="version", version=f"zeropipe {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.register(commands)
    return parser


def quiet_deepspeed_autodetect() -> None:
    """Name the CPU accelerator when there is no GPU, so DeepSpeed does not warn that it guessed."""
    import os

    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # `train run.yaml --resume PATH key=value`: argparse has taken the positionals before the
        # optional PATH, so overrides written after it come back unparsed; they are overrides still.
        if getattr(args, "command", None) == "train" and all("=" in arg and not arg.startswith("-") for arg in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    quiet_deepspeed_autodetect()
    try:
        return int(args.run(args) or 0)
    except ZeroPipeError as err:
        print(f"zeropipe {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"zeropipe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
