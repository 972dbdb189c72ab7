"""``zeropipe train RUN.yaml [key=value ...] [--resume [PATH]]``: validate, launch, watch, report."""

from __future__ import annotations

import argparse

from zeropipe.cli.output import Progress, resume_command, say
from zeropipe.rundir import RunDir


def register(commands) -> None:
    parser = commands.add_parser("train", help="train a model from a run config", description=__doc__)
    parser.add_argument("config", help="run config (YAML); a diffusion-pipe TOML, axolotl or LLaMA-Factory YAML is converted first (as zeropipe convert)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys, e.g. train.lr=2e-5 deepspeed.zero_stage=3")
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="PATH",
        help="continue from the latest complete checkpoint of the run (or of PATH: a run directory or checkpoint); "
        "with hardware.gpus=N on another number of ranks: converted to a universal checkpoint, "
        "the global batch kept (docs/resume.md)",
    )
    parser.add_argument(
        "--new-schedule",
        action="store_true",
        help="with --resume and another run length (train.max_steps or epochs): recompute the learning-rate schedule for the new length",
    )
    parser.add_argument("--nproc", type=int, default=None, help="ranks to start (default: hardware.gpus)")
    parser.add_argument(
        "--confine-to", action="append", default=None, metavar="DIR",
        help="confine the run to these folders (repeatable), as zeropipe ui does for the runs it launches: every path of the config and "
        "of its DeepSpeed JSON must lie inside them, other machines (hardware.nodes, hostfile, ssh) are refused, and data files that "
        "resolve outside them (symlinks) are skipped",
    )  # fmt: skip
    parser.add_argument("--confine-multinode", action="store_true", help="with --confine-to: allow hardware.nodes/hostfile/ssh (zeropipe ui --trust-multinode)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zeropipe.check import CheckFailed, check_config
    from zeropipe.config.load import load_config
    from zeropipe.launch.prepare import prepare_run
    from zeropipe.launch.resolve import resolve_run
    from zeropipe.launch.supervisor import Supervisor

    overrides = list(args.overrides)
    resume = args.resume
    if isinstance(resume, str) and "=" in resume:
        # `--resume train.lr=1e-4`: argparse took an override for the optional PATH.
        overrides.insert(0, resume)
        resume = True
    if args.nproc is not None:
        overrides.append(f"hardware.gpus={args.nproc}")
    args.effective_overrides = overrides  # what a resume must repeat
    from zeropipe.cli.convert import convert_for_train

    config = load_config(convert_for_train(args.config), overrides)
    if resume and not args.confine_to:
        # The plug-ins the run was prepared with (its run.json), before its family is looked up: no ZEROPIPE_PLUGINS needed.
        from zeropipe.launch.prepare import run_dir_for
        from zeropipe.rundir import RunDir, import_plugins

        from pathlib import Path

        given = run_dir_for(config) if resume is True else Path(resume)
        # A run directory, or one of its checkpoints (checkpoints/<tag>).
        run_path = next((folder for folder in (given, given.parent, given.parent.parent) if RunDir(folder).plan_file.is_file()), given)
        import_plugins(RunDir(run_path).read_plan_fields().get("plugins") or [])
    confinement = None
    if args.confine_to:
        from zeropipe.confine import Confinement

        confinement = Confinement(tuple(args.confine_to), multinode=args.confine_multinode)
    resolved = None
    if config.stages:
        from zeropipe.launch.nodes import resolve_layout
        from zeropipe.launch.resolve import confine

        confine(config, confinement)  # before the hostfile is read

        layout = resolve_layout(config.hardware, 1)
        if layout is not None and len(layout.nodes) > 1:
            from zeropipe.errors import ConfigError

            # The curriculum runner starts each stage's ranks on this machine: several nodes would be started here, all of them.
            raise ConfigError([("stages", f"a curriculum runs on one node; this config names {len(layout.nodes)} ({layout.source}): run each stage as its own multi-node run, or train the curriculum on one node")])
        from zeropipe.launch.resolve import resolve_stages

        # Each stage resolved once, as the run it will be: checked, then run, as that.
        stages = resolve_stages(config, confinement=confinement)
        findings = check_config(config, resolved_stages=stages)
    else:
        # Decided once for this command: what the checks judge is what prepare_run writes.
        resolved = resolve_run(config, confinement=confinement)
        for note in resolved.notes:
            say(note)
        findings = check_config(resolved)
    # Refuse what cannot work before the run directory or any process exists.
    if any(f.severity == "error" for f in findings):
        raise CheckFailed(findings)
    for finding in findings:
        say(f"warning {finding.rule} {finding.key}: {finding.message} (fix: {finding.fix})")
    if config.stages:
        from zeropipe.cli.train_stages import train_curriculum

        return train_curriculum(args, config, resume, stages)
    try:
        prepared = prepare_run(resolved, resume=resume, new_schedule=args.new_schedule)
    except OSError as err:
        # A full, read-only or vanished disk under the run directory: a message, not a traceback.
        from zeropipe.launch.prepare import run_dir_for
        from zeropipe.rundir import disk_problem

        raise disk_problem(err, run_dir_for(config)) from None
    plan, run_dir = prepared.plan, prepared.run
    say(f"run directory: {run_dir.path}")
    sp = config.parallel.sequence_parallel_size
    data_ranks = plan.world_size // sp if sp > 1 else plan.world_size
    say(
        f"{plan.world_size} {plan.accelerator.upper()} ranks, ZeRO stage {plan.zero_stage}, {plan.examples} examples, "
        f"{plan.total_steps} steps of {plan.micro_batch_size} x {plan.gradient_accumulation_steps} x {data_ranks} "
        f"{'packed sequences' if config.data.packing else 'examples'}"
        + (f" (sequence parallel: groups of {sp} ranks share each example's tokens)" if sp > 1 else "")
    )
    for note in prepared.notes:
        say(f"  {note}")
    # train.log_every as the config set it (rank 0's log follows it too); unset, a line every tenth of the run.
    progress = Progress(run_dir, plan.total_steps, config.train.log_every if "log_every" in config.train.model_fields_set else None)
    if resolved is not None and resolved.nodes is not None:
        from zeropipe.launch.multinode import MultiNodeSupervisor

        layout = resolved.nodes
        say(f"{len(layout.nodes)} nodes, world size {layout.world_size}: " + ", ".join(f"{n.host} ranks {layout.ranks_of(k)}" for k, n in enumerate(layout.nodes)))
        supervisor = MultiNodeSupervisor(run_dir, layout, plan.accelerator, config.hardware.master_port, on_tick=progress.update)
    else:
        supervisor = Supervisor(run_dir, plan.world_size, plan.accelerator, config.hardware.master_port, on_tick=progress.update)
    try:
        supervisor.start()
        if plan.node_setup:
            say(f"filling the caches first (log: {run_dir.node_setup_log}); the ranks start when it is done")
        say(f"logs: {run_dir.logs}/rank*.log (the first start on a machine builds DeepSpeed's CPU ops: about a minute)")
        outcome = supervisor.wait()
    except OSError as err:
        # The ranks were stopped and the run marked failed; the disk is the likely reason.
        from zeropipe.rundir import disk_problem

        raise disk_problem(err, run_dir.path) from None
    progress.update()
    progress.close()
    if outcome.status_error:
        say(f"warning: {outcome.status_error}")
    if outcome.state == "failed":
        assert outcome.diagnosis is not None
        say("")
        say("training failed: " + outcome.diagnosis.render())
        if outcome.diagnosis.process:  # the node's setup process: no rank ran, no checkpoint to resume from
            say(f"run it again after fixing it (what was cached so far is kept): {resume_command(args).removesuffix(' --resume')}")
        else:
            say(f"resume after fixing it: {resume_command(args)}")
        return 1
    if outcome.state == "stopped":
        from zeropipe.checkpoint.manager import latest_checkpoint

        latest = latest_checkpoint(run_dir.path)
        where = f"latest checkpoint: {latest.tag}; continue with: {resume_command(args)}" if latest else "no checkpoint was saved"
        say(f"stopped; all ranks ended. {where}")
        return 130
    report(run_dir)
    return 0


def report(run_dir: RunDir) -> None:
    summary = run_dir.read_summary()
    first, final = summary.get("first_loss"), summary.get("final_loss")
    if first is not None and final is not None:
        say(f"done: {summary['steps']} steps, loss {first:.3f} -> {final:.3f}")
    generations = run_dir.read_generations()
    if generations:
        from zeropipe.data.synthetic import expected_answer

        say("generations of the trained model:")
        for row in generations:
            # Vision-language runs answer about an image, and know the held-out synthetic captions.
            expected = row["expected"] if "expected" in row else expected_answer(row["prompt"])
            verdict = "" if expected is None else ("  (right)" if row["output"] == expected else f"  (expected {expected!r})")
            about = f"[{row['image'].rsplit('/', 1)[-1]}] " if "image" in row else ""
            say(f"  {about}{row['prompt']!r} -> {row['output']!r}{verdict}")
    say(f"export it: zeropipe export {run_dir.path} --out {run_dir.path}/export")
