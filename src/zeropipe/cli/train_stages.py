"""``zeropipe train`` for a curriculum (a config with ``stages:``): the stages one after the other.

Part of the train command (cli/train.py hands over once the config is checked): it prints,
and zeropipe.launch.curriculum runs the stages (:meth:`Curriculum.run`). Each stage is a sub-run watched by the same
supervisor as a single run; a failure or Ctrl-C in a stage ends the curriculum there, and
``zeropipe train CONFIG --resume`` continues that stage.
"""

from __future__ import annotations

import argparse

from zeropipe.cli.output import Progress, resume_command, say
from zeropipe.config.schema import RunConfig
from zeropipe.launch.curriculum import Curriculum


def train_curriculum(args: argparse.Namespace, config: RunConfig, resume: str | bool | None, resolved_stages: list) -> int:
    curriculum = Curriculum.open(config, resume=resume, resolved_stages=resolved_stages)
    say(f"run directory: {curriculum.top.path} (a curriculum of {len(curriculum.stages)} stages)")
    for stage in curriculum.stages:
        done = "  (done)" if stage.state == "completed" and stage.export.is_dir() else ""
        say(f"  {stage.describe()}{done}")
    for note in curriculum.notes:
        say(f"  {note}")
    hint = resume_command(args)
    state, summary = curriculum.run(config.hardware.master_port, say, Progress, hint)
    if state == "failed":
        return 1
    if state == "stopped":
        return 130
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
