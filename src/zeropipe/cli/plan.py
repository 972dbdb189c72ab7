"""``zeropipe plan [CONFIG] [--model NAME|PATH | --params N] [--gpus 5x24GB --ram 64GB]``.

Memory per GPU and per node, and the fastest ZeRO settings that fit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path


def register(commands) -> None:
    parser = commands.add_parser(
        "plan",
        help="show what a run needs per GPU and in host RAM, and the fastest ZeRO settings that fit",
        description=__doc__,
        epilog="Sizes like 24GB are read as GiB, as GPU and RAM sizes are sold. Without --gpus the hardware is this machine's.",
    )
    parser.add_argument("config", nargs="?", help="run config (YAML); its model, sequence length, batch and settings are planned")
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--model", metavar="NAME|PATH", help="a catalog name (e.g. llama-3.1-8b, qwen2.5-14b, sdxl), a local model directory or a config.json"
    )
    what.add_argument("--params", type=float, metavar="N", help="a bare parameter count, e.g. 7.5e9 (model states only)")
    parser.add_argument("--gpus", metavar="COUNTxSIZE", help="GPUs per node and the memory of one, e.g. 5x24GB")
    parser.add_argument(
        "--cpu-ranks",
        type=int,
        metavar="N",
        help="plan N CPU ranks (gloo) instead of GPUs: every 'GPU' term is then host RAM too, and the node's figure counts it there",
    )
    parser.add_argument("--ram", metavar="SIZE", help="host RAM per node, e.g. 64GB (default: this machine's)")
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--seq-len", type=int, metavar="N", help="tokens per example (default: the config's data.max_seq_len, else 2048)")
    parser.add_argument(
        "--global-batch", type=int, metavar="N", help="examples per optimizer step over all GPUs (default: the config's, else compared per example)"
    )
    parser.add_argument("--lora-r", type=int, metavar="N", help="plan LoRA adapters of rank N on q/k/v/o projections instead of a full fine-tune")
    parser.add_argument(
        "--quantization", choices=["fp8", "fp8_e5m2"],
        help="plan the frozen base of a LoRA run stored in fp8 (model.quantization): the blocks' linear layers one byte per weight (with --lora-r, or a config's LoRA)",
    )
    parser.add_argument("--margin", type=float, default=0.1, help="fraction of GPU memory and host RAM kept free (default 0.1)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--list-models", action="store_true", help="list the catalog and exit")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zeropipe.errors import ZeroPipeError
    from zeropipe.plan import detect_hardware, fp8_base_offer, parse_hardware, recommend
    from zeropipe.plan.hardware import Hardware
    from zeropipe.plan.model_spec import catalog_names
    from zeropipe.plan.search import complete, search
    from zeropipe.plan.variants import with_caches

    if args.list_models:
        print("\n".join(catalog_names()))
        return 0
    if not (0 <= args.margin < 1):
        raise ZeroPipeError(f"--margin {args.margin}: give a fraction between 0 and 1, e.g. 0.1")
    hardware: Hardware
    if args.cpu_ranks is not None and args.gpus:
        raise ZeroPipeError("--cpu-ranks and --gpus describe different machines: give one of them")
    if args.cpu_ranks is not None:
        if args.cpu_ranks < 1 or args.nodes != 1:
            raise ZeroPipeError(f"--cpu-ranks {args.cpu_ranks}: give at least one rank, on one node")
        hardware = cpu_hardware(args.cpu_ranks, args.ram)
    elif args.gpus:
        if args.ram is None:
            import dataclasses

            import psutil

            ram = int(psutil.virtual_memory().total)
            hardware = parse_hardware(args.gpus, f"{ram}B", nodes=args.nodes)
            hardware = dataclasses.replace(hardware, notes=(f"as given: {args.gpus} per node; host RAM of this machine ({ram / 1024**3:.1f} GiB)",))
        else:
            hardware = parse_hardware(args.gpus, args.ram, nodes=args.nodes)
    else:
        if args.ram or args.nodes != 1:
            raise ZeroPipeError("--ram and --nodes describe hardware given with --gpus: add --gpus COUNTxSIZE (e.g. 5x24GB)")
        hardware = detect_hardware()

    lora = None
    if args.lora_r is not None:
        from zeropipe.config.schema import LoraSection

        lora = LoraSection(r=args.lora_r)

    if args.config:
        from zeropipe.config.load import load_config
        from zeropipe.errors import ConfigError
        from zeropipe.launch.resolve import resolve_run

        overrides = []
        if args.seq_len:
            overrides.append(f"data.max_seq_len={args.seq_len}")
        if args.lora_r is not None:
            overrides.append(f"model.lora.r={args.lora_r}")
        if args.quantization:
            overrides.append(f"model.quantization.format={args.quantization}")
        gpus_note = None
        if args.gpus and hardware.accelerator == "cuda":
            # --gpus is the box planned for: its count per node replaces the config's hardware.gpus (else the
            # plan would deal shares and the batch over the config's count), and the note says so.
            from zeropipe.config.load import read_yaml

            with contextlib.suppress(Exception):  # an unreadable file is load_config's to report
                written = (read_yaml(Path(args.config)).get("hardware") or {}).get("gpus")
                if isinstance(written, int) and written != hardware.gpus_per_node:
                    gpus_note = f"hardware.gpus: {written} in the config; planned for the {hardware.gpus_per_node} GPUs per node given (--gpus {args.gpus})"
            overrides.append(f"hardware.gpus={hardware.gpus_per_node}")
        try:
            loaded = load_config(args.config, overrides)
        except ConfigError as err:
            # Plan before the download: a model.path not on disk yet that names a catalog model.
            from zeropipe.plan.before_download import plan_from_catalog

            from zeropipe.families import families, model_spec

            families()  # the diffusion family registers its planner builders (a diffusion catalog model)
            result = plan_from_catalog(args.config, overrides, err, hardware, args.margin, args.global_batch, model_spec)
            result.notes[:0] = [gpus_note] if gpus_note else []
            return _finish(args, result)
        # Resolved for the machine planned for: its accelerator and CPU decide precision "auto".
        resolved = resolve_run(loaded, accelerator=hardware.accelerator, fill_auto_knobs=False, hardware=hardware)
        config = resolved.config
        spec = _spec(args, lora) if (args.model or args.params) else None
        if args.gpus is None and args.cpu_ranks is None and isinstance(config.hardware.gpus, int) and hardware.accelerator == "cuda":
            hardware = hardware.with_gpus(config.hardware.gpus)
        if args.gpus is None and resolved.nodes is not None:
            import dataclasses

            # Several nodes (hardware.nodes, a hostfile, SLURM): each planned like this machine, with the first node's rank count.
            layout = resolved.nodes
            hardware = dataclasses.replace(
                hardware.with_gpus(layout.nodes[0].ranks), nodes=len(layout.nodes),
                notes=hardware.notes + (f"{len(layout.nodes)} nodes from {layout.source}, each planned like this machine",),
            )
        import dataclasses

        resolved = dataclasses.replace(resolved, hardware=hardware)
        result = resolved.plan(spec, args.margin)
        if args.global_batch:
            result = recommend(
                result.spec, result.hardware, args.global_batch, config.data.max_seq_len, args.margin, attention=config.model.attn_implementation
            )
        result = complete(result, _search_args(result, args.global_batch, config.data.max_seq_len, config.model.attn_implementation))
        result.notes[:0] = [gpus_note] if gpus_note else []
    else:
        if not (args.model or args.params):
            raise ZeroPipeError("nothing to plan: give a run config, --model NAME|PATH, or --params N (see zeropipe plan --list-models)")
        spec = _spec(args, lora)
        if args.quantization:
            if spec.lora is None:
                raise ZeroPipeError("--quantization stores a frozen base for LoRA: add --lora-r N")
            spec = spec.with_fp8_base(args.quantization)
        notes = []
        if spec.frozen_models:
            # As a config with the defaults trains it: data.cache.latents and data.cache.text are on.
            names = ", ".join(m.name for m in spec.frozen_models)
            spec = with_caches(spec)
            notes.append(
                f"planned as a run config with the defaults makes it: data.cache.latents and data.cache.text on, so {names} are loaded "
                "once per node to fill the caches before the ranks start, never by a training rank (the node-setup terms)"
            )

        def replan(other):
            return recommend(other, hardware, global_batch=args.global_batch, seq_len=args.seq_len or 2048, margin=args.margin)

        result = search(spec, hardware, global_batch=args.global_batch, seq_len=args.seq_len or 2048, margin=args.margin)
        result.notes[:0] = notes
        if result.best is not None:
            result.notes += fp8_base_offer(spec, hardware, result, replan)
    return _finish(args, result)


def _finish(args: argparse.Namespace, result) -> int:
    """Print the plan; exit 0 when a plan fits (as recommended or with an offered change), 1 when no change the planner knows does."""
    from zeropipe.plan.render import render_plan

    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        sys.stdout.write(render_plan(result))
    return 0 if result.runnable else 1


def _search_args(result, global_batch, seq_len, attention) -> dict:
    """The arguments ``plan.search.complete`` searches the changes with: the config's batch, sequence and ZeRO-3 limits."""
    some = result.configured or result.best or (result.candidates[0] if result.candidates else None)
    limits = {}
    if some is not None:
        limits = {"zero3_max_live_parameters": some.choice.zero3_max_live_parameters, "zero3_reuse_distance": some.choice.zero3_reuse_distance}
    return dict(global_batch=global_batch or result.global_batch, seq_len=seq_len, margin=result.margin, fixed=None, attention=attention, zero3_limits=limits)


def cpu_hardware(ranks: int, ram: str | None):
    """CPU ranks on this machine (or one with ``ram`` of host RAM): each rank's "GPU memory" is its share of that RAM."""
    import dataclasses

    import psutil

    from zeropipe.plan import detect_hardware
    from zeropipe.plan.hardware import format_gib, parse_size

    hardware = detect_hardware(cpu_ranks=ranks)
    if hardware.accelerator != "cpu" or ram is not None:
        total = parse_size(ram, "--ram") if ram is not None else int(psutil.virtual_memory().total)
        note = (
            f"as given: {ranks} CPU ranks and {format_gib(total)} of host RAM; the 'GPU memory' of each rank is its share "
            f"({format_gib(total // ranks)}), and both budgets are the same RAM"
        )
        hardware = dataclasses.replace(
            hardware, gpus_per_node=ranks, gpu_memory_bytes=total // ranks, host_ram_bytes=total, gpu_name=None, accelerator="cpu", notes=(note,),
        )
    return hardware


def _spec(args: argparse.Namespace, lora):
    from pathlib import Path

    from zeropipe.errors import ZeroPipeError
    from zeropipe.families import families
    from zeropipe.plan.model_spec import spec_from_catalog, spec_from_params, spec_from_path

    families()  # the families register their planner builders (diffusion: families/diffusion/spec.py)
    if args.params:
        if lora is not None:
            raise ZeroPipeError("--lora-r needs the model's layer shapes: use --model instead of --params")
        return spec_from_params(args.params)
    if Path(args.model).expanduser().exists():
        return spec_from_path(args.model, lora)
    return spec_from_catalog(args.model, lora)
