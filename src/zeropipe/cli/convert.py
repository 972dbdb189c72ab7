"""``zeropipe convert FILE [--out OUT.yaml]``: a diffusion-pipe, axolotl or LLaMA-Factory config as a ZeRO-Pipe run config."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(commands) -> None:
    parser = commands.add_parser(
        "convert",
        help="turn a diffusion-pipe TOML, axolotl YAML or LLaMA-Factory YAML into a ZeRO-Pipe run config",
        description=__doc__,
    )
    parser.add_argument("file", help="the config to convert (diffusion-pipe .toml, axolotl or LLaMA-Factory .yaml)")
    parser.add_argument("--out", default=None, metavar="OUT.yaml", help="write the ZeRO-Pipe YAML here (default: print it)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zeropipe.config.load import validate_config
    from zeropipe.convert import convert_file, write_links
    from zeropipe.errors import ConfigError

    conversion = convert_file(args.file)
    out = Path(args.out) if args.out else None
    if out is not None and out.resolve() == conversion.source:
        raise ConfigError([("--out", f"{out} is the file being converted: choose another name, e.g. {out.with_suffix('.zeropipe.yaml')}")])
    for made in write_links(conversion):
        say(f"linked {made}")
    text = conversion.to_yaml(str(out) if out else None)
    if out is None:
        print(text, end="")
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        say(f"wrote {out}: {len(conversion.entries)} key(s) mapped from the {conversion.tool} config {conversion.source}")
        report(conversion)  # printed with the YAML otherwise, at its top
    # Say now what `zeropipe train` would refuse, rather than after the user runs it.
    raw = conversion.raw()
    raw.setdefault("run", {}).setdefault("name", (out or conversion.source).stem)
    try:
        validate_config(raw)
    except ConfigError as err:
        say(f"the converted config does not validate yet: {err}")
        return 0
    if out is not None and not conversion.blocking:
        say(f"train it: zeropipe train {out}")
    return 0


def report(conversion) -> None:
    for reason in conversion.blocking:
        say(f"cannot train yet: {reason}")
    if conversion.unmapped:
        say(f"not mapped ({len(conversion.unmapped)}):")
        for key, why in conversion.unmapped:
            say(f"  - {key}: {why}")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
