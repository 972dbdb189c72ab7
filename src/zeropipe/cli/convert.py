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


def convert_for_train(path: str) -> str:
    """The config ``zeropipe train`` should load: ``path`` itself, or its conversion written beside it.

    A ZeRO-Pipe YAML (or one whose tool cannot be told, which load_config then reports on) is
    returned as it is. A diffusion-pipe, axolotl or LLaMA-Factory file is converted, written to
    NAME.zeropipe.yaml beside it, and that path returned, so that the run records the config it ran.

    Raises:
        ConversionError: the file asks for what ZeRO-Pipe cannot train, or cannot be converted.
    """
    from zeropipe.convert import ConversionError, convert_file, detect_tool, read_source, write_links

    source = Path(path)
    if not source.is_file():
        return path  # load_config says the file does not exist
    if source.suffix != ".toml":
        try:
            tool = detect_tool(source, read_source(source))
        except ConversionError:
            return path  # broken YAML: load_config reports it as for any run config
        if tool in ("zeropipe", None):
            return path
    conversion = convert_file(source)
    if conversion.blocking:
        raise ConversionError(f"{source} cannot train yet: " + "; ".join(conversion.blocking))
    if "run.name" not in conversion.entries:
        conversion.set("run.name", source.stem, f"named after {source.name}")
    out = source.with_name(source.stem + ".zeropipe.yaml")
    for made in write_links(conversion):
        say(f"linked {made}")
    try:
        out.write_text(conversion.to_yaml(str(out)))
    except OSError as err:
        raise ConversionError(f"cannot write the converted config {out} ({err}): run `zeropipe convert {source} --out SOMEWHERE.yaml` and train that") from None
    say(f"{source} is written for {conversion.tool}: converted it to {out} ({len(conversion.entries)} key(s) mapped, each with a comment there)")
    report(conversion)
    return str(out)
