"""What the train commands print: plain lines on stderr, and the live progress of a run."""

from __future__ import annotations

import argparse
import shlex
import sys

from zeropipe.rundir import RunDir


def resume_command(args: argparse.Namespace) -> str:
    """The command that continues this run: the same config and overrides (the run's name may be one)."""
    parts = ["zeropipe", "train", args.config, *getattr(args, "effective_overrides", args.overrides)]
    if args.new_schedule:
        parts.append("--new-schedule")
    return shlex.join(parts + ["--resume"])


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Progress:
    """Follows rank 0's metrics.jsonl: a live bar on a terminal; otherwise (a log file, the UI's
    launcher log) a line every ``log_every`` steps when the config sets train.log_every, else
    every tenth of the run."""

    def __init__(self, run_dir: RunDir, total_steps: int, log_every: int | None = None):
        self.run = run_dir
        self.path = run_dir.metrics
        self.total = total_steps
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self.bar = None
        self.every = log_every or max(1, total_steps // 10)
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)

    def update(self) -> None:
        rows, self.offset = self.run.read_metrics_from(self.offset)
        for row in rows:
            if row.get("kind") == "eval":
                message = f"step {row['step']} eval loss {row['eval_loss']:.4f}" + (f" perplexity {row['eval_perplexity']:.4g}" if "eval_perplexity" in row else "")
                if self.bar is not None:
                    self.bar.write(message, file=sys.stderr)  # above the bar, which stays on the last line
                else:
                    say(message)
                continue
            if self.bar is not None:
                self.bar.n = row["step"]
                self.bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{row['lr']:.2g}", refresh=False)
                self.bar.refresh()
            elif row["step"] % self.every == 0 or row["step"] == self.total:
                say(f"step {row['step']}/{self.total} loss {row['loss']:.4f} lr {row['lr']:.3g} {row['samples_per_s']:.1f} samples/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
