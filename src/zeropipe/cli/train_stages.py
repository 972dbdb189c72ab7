"""``zeropipe train`` for a curriculum (a config with ``stages:``): the stages one after the other.

Part of the train command (cli/train.py hands over once the config is checked): it prints,
and zeropipe.launch.curriculum does the work. Each stage is a sub-run watched by the same
supervisor as a single run; a failure or Ctrl-C in a stage ends the curriculum there, and
``zeropipe train CONFIG --resume`` continues that stage.
"""

from __future__ import annotations

import argparse
import signal

from zeropipe.cli.train import Progress, resume_command, say
from zeropipe.config.schema import RunConfig


def train_curriculum(args: argparse.Namespace, config: RunConfig, resume: str | bool | None) -> int:
    from zeropipe.launch.curriculum import Curriculum
    from zeropipe.launch.supervisor import Supervisor, raise_keyboard_interrupt

    curriculum = Curriculum.open(config, resume=resume)
    say(f"run directory: {curriculum.top.path} (a curriculum of {len(curriculum.stages)} stages)")
    for stage in curriculum.stages:
        done = "  (done)" if stage.state == "completed" and stage.export.is_dir() else ""
        say(f"  {stage.describe()}{done}")
    for note in curriculum.notes:
        say(f"  {note}")
    # Between stages no supervisor is watching: a SIGTERM (the UI's stop button) must still end the run cleanly.
    previous = signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    current = None
    try:
        for stage in curriculum.remaining():
            current = stage
            if stage.state == "completed":
                say(f"{stage.label} finished training before; exporting its weights again")
                curriculum.export_again(stage)
                continue
            prepared = curriculum.start(stage)
            plan = prepared.plan
            resumed = f", resuming from {plan.resume_from}" if plan.resume_from else ""
            say(f"{stage.label}: {plan.world_size} {plan.accelerator.upper()} ranks, ZeRO stage {plan.zero_stage}, {plan.total_steps} steps{resumed}")
            for note in curriculum.stage_notes:
                say(f"  {note}")
            progress = Progress(stage.run, plan.total_steps)

            def tick(stage=stage, progress=progress) -> None:
                progress.update()
                curriculum.mirror(stage)

            supervisor = Supervisor(stage.run, plan.world_size, plan.accelerator, config.hardware.master_port, on_tick=tick)
            supervisor.start()
            curriculum.running([proc.pid for proc in supervisor.procs])
            say(f"logs: {stage.run.logs}/rank*.log")
            outcome = supervisor.wait()
            tick()
            progress.close()
            if outcome.state == "failed":
                assert outcome.diagnosis is not None
                curriculum.ended(stage, "failed", outcome.diagnosis.to_dict())
                say("")
                say(f"{stage.label} failed: " + outcome.diagnosis.render())
                say(f"resume after fixing it: {resume_command(args)}  (finished stages are not run again)")
                return 1
            if outcome.state == "stopped":
                curriculum.ended(stage, "stopped")
                say(f"stopped in {stage.label}; all ranks ended. continue with: {resume_command(args)}")
                return 130
            say(f"{stage.label} done; exporting its weights{' for the next stage' if stage is not curriculum.stages[-1] else ''}")
            curriculum.ended(stage, "completed")
        summary = curriculum.finish()
    except KeyboardInterrupt:
        curriculum.stopped(current)
        say(f"stopped{f' in {current.label}' if current else ''}. continue with: {resume_command(args)}")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    report(curriculum, summary)
    return 0


def report(curriculum, summary: dict) -> None:
    for stage in summary["stages"]:
        if stage["first_loss"] is not None:
            say(f"  {stage['name']}: {stage['steps']} steps, {stage['trains']}, ZeRO-{stage['zero_stage']}, loss {stage['first_loss']:.3f} -> {stage['final_loss']:.3f}")
    if summary["first_loss"] is not None:
        say(f"done: {summary['steps']} steps over {len(summary['stages'])} stages, loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}")
    say(f"final weights (Hugging Face directory): {summary['final_weights']}")
    say(f"try them: zeropipe generate {summary['final_weights']} --prompt '...'")
