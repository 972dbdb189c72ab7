"""Training-loop overhead: ZeRO-Pipe against a minimal hand-written DeepSpeed loop.

    .venv/bin/python benchmarks/overhead.py            # full run, a few minutes on 2 CPU cores
    .venv/bin/python benchmarks/overhead.py --quick    # smoke run

The same model, data and DeepSpeed config are trained twice per repeat, on the same number
of ranks with the same per-rank environment:

* ZeRO-Pipe: ``zeropipe train BENCH.yaml`` as a user runs it (launcher, supervisor, trainer).
  Its per-step figures come from the run's ``metrics.jsonl``.
* bare: this file started once per rank (``--bare-rank``), with the environment ZeRO-Pipe's
  supervisor gives a rank. It reads the first ZeRO-Pipe run's directory (ds_config.json,
  config.yaml's model config, tokenizer/, the memory-mapped token cache), builds the model
  the same way (seeded, HfDeepSpeedConfig alive under ZeRO-3, AutoModelForCausalLM.from_config),
  calls deepspeed.initialize with the same JSON and runs the same optimizer steps over the
  same micro-batches (ResumableDistributedSampler with the run seed, zeropipe's collate).
  No metrics collective, no file written until the loop is over.

Two figures are compared, both on rank 0, medians over the steps after the warm-up:

* step time: perf_counter around the micro-batches of one step (fetch, forward, backward,
  engine.step, loss.item()); ZeRO-Pipe's is its ``step_time_s``, which also holds the
  previous step's metrics gathering and logging (so it sits between the two figures);
* step period: time from the end of one step to the end of the next, so it also holds the
  work a loop does between steps (ZeRO-Pipe's metrics all_gather, metrics.jsonl write, ...).
  This is what sets throughput, and the figure the 2% target is judged on.

Repeats run in ABBA order (zeropipe, bare, bare, zeropipe, ...) so slow drift of the machine
cancels. The losses of the first steps of every run are compared with the first ZeRO-Pipe run:
identical model and data must give the same losses. Exit code 0 whether or not the target is
met; non-zero only when a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = 1.02  # ZeRO-Pipe step period / bare step period
LOSS_STEPS = 10  # steps whose losses must agree
LOSS_TOLERANCE = 1e-4  # relative
QUIET_CORES = 0.1  # a run during which other processes used less CPU than this counts as quiet

BENCH_CONFIG = """\
# Written by benchmarks/overhead.py
run:
  output_dir: {output_dir}
  seed: 42
model:
  config:
    model_type: llama
    hidden_size: {hidden}
    intermediate_size: {intermediate}
    num_hidden_layers: {layers}
    num_attention_heads: 4
    num_key_value_heads: 2
    max_position_embeddings: 128
    tie_word_embeddings: false
  tokenizer_vocab_size: 300{lora}
data:
  synthetic:
    task: mixed
    examples: {examples}
  max_seq_len: 64
train:
  max_steps: {steps}
  micro_batch_size: {micro}
  gradient_accumulation_steps: 1
  lr: 3.0e-3
  warmup_steps: 10
  schedule: cosine
  log_every: 1000000
deepspeed:
  zero_stage: {stage}
  precision: {precision}
hardware:
  gpus: 2
  accelerator: cpu
generate:
  max_new_tokens: 1
"""


# --------------------------------------------------------------------------- bare loop (one rank)
def bare_rank(run_dir: Path, out: Path) -> None:
    """The baseline: a minimal DeepSpeed loop over the run directory ZeRO-Pipe prepared."""
    import random

    import deepspeed
    import numpy as np
    import torch
    import yaml
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from zeropipe.data.sampler import ResumableDistributedSampler
    from zeropipe.data.token_cache import TokenDataset, collate

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    total_steps = json.loads((run_dir / "run.json").read_text())["total_steps"]
    micro = ds_config["train_micro_batch_size_per_gpu"]
    accumulation = ds_config["gradient_accumulation_steps"]
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[config["deepspeed"]["precision"]]

    deepspeed.init_distributed(dist_backend="gloo")
    seed = config["run"]["seed"]
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)

    tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "tokenizer"))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    dataset = TokenDataset(run_dir / "cache")
    sampler = ResumableDistributedSampler(len(dataset), rank, world_size, seed=seed, shuffle=True)

    fields = dict(config["model"]["config"])
    # What the data preparation learned (the tokenizer's vocabulary size) is kept beside config.yaml.
    learned_path = run_dir / "learned.json"
    learned = json.loads(learned_path.read_text()).get("values", {}) if learned_path.is_file() else {}
    fields.update({key.removeprefix("model.config."): value for key, value in learned.items() if key.startswith("model.config.")})
    model_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model_config._attn_implementation = config["model"]["attn_implementation"]
    if stage == 3:
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(ds_config)  # noqa: F841 - must stay alive while the model is built
    if config["model"].get("lora"):
        # LoRA: the adapters are built by ZeRO-Pipe's own model builder (peft, the same targets
        # and init in the same seeded order), so both loops train the same model; the loop is
        # still this file's.
        from zeropipe.families.causal_lm.model import build_model
        from zeropipe.models.common import model_config as zeropipe_model_config
        from zeropipe.rundir import RunDir

        saved = RunDir(run_dir).read_config()
        model = build_model(saved.model, zeropipe_model_config(saved.model), saved.deepspeed.precision, stage)
    else:
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    model.config.use_cache = False
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config)

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            indices = list(sampler)
            for start in range(0, len(indices) - micro + 1, micro):
                yield collate([dataset[i] for i in indices[start : start + micro]], pad_token_id=pad_id)
            epoch += 1

    stream = batches()
    step_times, step_ends, losses = [], [], []
    engine.train()
    for _ in range(total_steps):
        started = time.perf_counter()
        loss_sum = 0.0
        for _ in range(accumulation):
            loss = engine(**next(stream)).loss
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().float().item()
        ended = time.perf_counter()
        step_times.append(ended - started)
        step_ends.append(ended)
        losses.append(loss_sum / accumulation)

    out.write_text(json.dumps({"rank": rank, "step_time_s": step_times, "step_end_s": step_ends, "loss": losses}))
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()


# --------------------------------------------------------------------------- drivers
def run_zeropipe(config_path: Path, name: str, work: Path) -> dict:
    """`zeropipe train` as a user runs it; figures from rank 0's metrics.jsonl."""
    zeropipe = Path(sys.executable).with_name("zeropipe")
    log = work / f"{name}.log"
    with open(log, "w") as handle:
        code = subprocess.call([str(zeropipe), "train", str(config_path), f"run.name={name}"], stdout=handle, stderr=subprocess.STDOUT)
    if code != 0:
        sys.exit(f"zeropipe train failed (exit {code}); its output:\n{log.read_text()[-4000:]}")
    run_dir = work / "runs" / name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ends = [row["time"] for row in rows]
    return {
        "system": "zeropipe",
        "name": name,
        "run_dir": run_dir,
        "step_time": [row["step_time_s"] for row in rows],
        "period": [b - a for a, b in zip(ends, ends[1:])],  # period[i] ends at step i + 2
        "loss": [row["loss"] for row in rows],
    }


def run_bare(run_dir: Path, name: str, work: Path) -> dict:
    """One process per rank with the environment ZeRO-Pipe's supervisor gives its ranks."""
    from zeropipe.launch.supervisor import free_port, rank_environment

    plan = json.loads((run_dir / "run.json").read_text())
    world_size, port = plan["world_size"], free_port()
    procs, outs = [], []
    for rank in range(world_size):
        out = work / f"{name}.rank{rank}.json"
        outs.append(out)
        log = open(work / f"{name}.rank{rank}.log", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--bare-rank", str(run_dir), "--bare-out", str(out)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=rank_environment(rank, world_size, port, plan["accelerator"]),
                start_new_session=True,
            )
        )
        log.close()
    codes = [proc.wait() for proc in procs]
    if any(codes):
        logs = "\n".join((work / f"{name}.rank{r}.log").read_text()[-3000:] for r in range(world_size))
        sys.exit(f"bare loop failed (exit codes {codes}); rank logs:\n{logs}")
    ranks = [json.loads(out.read_text()) for out in outs]
    ends = ranks[0]["step_end_s"]
    return {
        "system": "bare",
        "name": name,
        "step_time": ranks[0]["step_time_s"],
        "period": [b - a for a, b in zip(ends, ends[1:])],
        # ZeRO-Pipe logs the mean over ranks of each rank's loss; so does this.
        "loss": [sum(values) / len(values) for values in zip(*(r["loss"] for r in ranks))],
    }


class ForeignLoad:
    """CPU used on this machine by processes other than this benchmark's, over a run.

    Other work on the machine (a test suite, a build) slows whichever run it overlaps;
    a run with a high figure here says its time is not the loop's alone.
    """

    def __enter__(self):
        self.start = self.sample()
        return self

    def __exit__(self, *exc):
        end = self.sample()
        wall, busy, ours = (b - a for a, b in zip(self.start, end))
        self.cores = max(0.0, busy - ours) / wall if wall > 0 else 0.0

    @staticmethod
    def sample() -> tuple[float, float, float]:
        import resource

        import psutil

        cpu = psutil.cpu_times()
        busy = cpu.user + cpu.nice + cpu.system + getattr(cpu, "irq", 0.0) + getattr(cpu, "softirq", 0.0)
        ours = sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for field in ("ru_utime", "ru_stime"))
        return time.monotonic(), busy, ours


def wait_for_quiet(limit_s: float, threshold: float = QUIET_CORES, window_s: float = 3.0) -> float:
    """Wait (at most limit_s) until other processes use less than `threshold` cores; returns the last load seen."""
    deadline = time.monotonic() + limit_s
    while True:
        with ForeignLoad() as load:
            time.sleep(window_s)
        if load.cores < threshold or time.monotonic() >= deadline:
            return load.cores


def after_warmup(result: dict, key: str, warmup: int) -> list[float]:
    # period[i] is the time from the end of step i + 1 to the end of step i + 2 (1-based).
    return result[key][warmup:] if key == "step_time" else result[key][max(0, warmup - 1) :]


def paired_ratios(zp: dict, bare: dict, warmup: int) -> list[float]:
    """Step-by-step period ratios: step k trains the same batch in both runs, so sequence-length
    differences between batches cancel."""
    return [a / b for a, b in zip(after_warmup(zp, "period", warmup), after_warmup(bare, "period", warmup))]


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 24 steps, one repeat")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 120, 24 with --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="first steps left out of the medians (default 10, 6 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="zeropipe/bare pairs, in ABBA order (default 2, 1 with --quick)")
    parser.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--lora-r", type=int, default=0, help="train LoRA adapters of this rank instead of the whole model (0: full fine-tune)")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"], help="bf16 (default; judge it only on a CPU with bf16 in hardware) or fp32")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument(
        "--quiet-wait", type=float, default=0, metavar="SECONDS", help="before each run, wait up to this long for other processes to leave the CPU idle (shared machines)"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="where runs are written (default: a temporary directory, removed at the end)")
    parser.add_argument("--bare-rank", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--bare-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.bare_rank:
        bare_rank(args.bare_rank, args.bare_out)
        return 0

    steps = args.steps or (24 if args.quick else 120)
    warmup = args.warmup if args.warmup is not None else (6 if args.quick else 10)
    repeats = args.repeats or (1 if args.quick else 2)
    if steps - warmup < 5:
        parser.error("--steps must exceed --warmup by at least 5")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="zeropipe-overhead-"))
    work.mkdir(parents=True, exist_ok=True)
    if (work / "runs").exists():
        parser.error(f"{work}/runs already exists: pass an empty --workdir")
    config_path = work / "bench.yaml"
    examples = max(600, steps * args.micro_batch * 2 + 200)  # one epoch covers the run
    config_path.write_text(
        BENCH_CONFIG.format(
            output_dir=work / "runs",
            hidden=args.hidden,
            intermediate=2 * args.hidden,
            layers=args.layers,
            examples=examples,
            steps=steps,
            micro=args.micro_batch,
            stage=args.zero_stage,
            precision=args.precision,
            lora=f"\n  lora:\n    r: {args.lora_r}" if args.lora_r else "",
        )
    )

    from zeropipe.launch.supervisor import rank_environment

    threads = rank_environment(0, 2, 0, "cpu")["OMP_NUM_THREADS"]
    print(
        f"overhead benchmark: llama hidden {args.hidden} x {args.layers} layers, ZeRO-{args.zero_stage} {args.precision}{f' LoRA r={args.lora_r}' if args.lora_r else ''}, 2 CPU ranks "
        f"(OMP_NUM_THREADS={threads} each, {os.cpu_count()} cores), micro-batch {args.micro_batch} x seq <= 64, "
        f"{steps} steps per run (first {warmup} left out), {repeats} repeat(s)",
        flush=True,
    )
    print(f"work directory: {work}", flush=True)
    order = []
    for repeat in range(repeats):
        pair = ["zeropipe", "bare"] if repeat % 2 == 0 else ["bare", "zeropipe"]
        order += [(system, repeat + 1) for system in pair]
    results = []
    reference_dir = None
    started = time.time()
    for system, repeat in order:
        if args.quiet_wait:
            before = wait_for_quiet(args.quiet_wait)
            if before >= QUIET_CORES:
                print(f"  (machine still busy after waiting {args.quiet_wait:.0f} s: {before:.2f} cores used by others)", flush=True)
        t0 = time.time()
        with ForeignLoad() as load:
            if system == "zeropipe":
                result = run_zeropipe(config_path, f"zeropipe-{repeat}", work)
                reference_dir = reference_dir or result["run_dir"]
            else:
                result = run_bare(reference_dir, f"bare-{repeat}", work)
        result["repeat"] = repeat
        result["foreign"] = load.cores
        results.append(result)
        print(
            f"  {result['name']:<11} step time median {median(after_warmup(result, 'step_time', warmup)) * 1e3:7.2f} ms   "
            f"step period median {median(after_warmup(result, 'period', warmup)) * 1e3:7.2f} ms   ({time.time() - t0:.0f} s wall, other processes {load.cores:.2f} cores)",
            flush=True,
        )

    # Sanity: the same model and data give the same losses.
    reference = next(r for r in results if r["system"] == "zeropipe")["loss"][:LOSS_STEPS]
    worst = 0.0
    for result in results:
        losses = result["loss"][:LOSS_STEPS]
        worst = max([worst] + [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference)])
    bare_losses = next(r for r in results if r["system"] == "bare")["loss"][:LOSS_STEPS]
    print(f"\nlosses of the first {LOSS_STEPS} steps (zeropipe-1): {' '.join(f'{v:.4f}' for v in reference)}")
    print(f"losses of the first {LOSS_STEPS} steps (bare-1):     {' '.join(f'{v:.4f}' for v in bare_losses)}")
    same = worst <= LOSS_TOLERANCE
    print(f"losses agree across all runs: {'yes' if same else 'NO'} (largest relative difference {worst:.2e}, tolerance {LOSS_TOLERANCE:g})")

    print("\nper repeat (zeropipe / bare):")
    for repeat in range(1, repeats + 1):
        zp = next(r for r in results if r["system"] == "zeropipe" and r["repeat"] == repeat)
        bare = next(r for r in results if r["system"] == "bare" and r["repeat"] == repeat)
        line = []
        for key, label in (("step_time", "step time"), ("period", "step period")):
            ratio = median(after_warmup(zp, key, warmup)) / median(after_warmup(bare, key, warmup))
            line.append(f"{label} {ratio:.3f}")
        paired = median(paired_ratios(zp, bare, warmup))
        line.append(f"paired period {paired:.3f}")
        print(f"  repeat {repeat}: " + "   ".join(line) + f"   (other processes: {zp['foreign']:.2f} / {bare['foreign']:.2f} cores)")
    if max(r["foreign"] for r in results) >= QUIET_CORES:
        print("  note: other processes used CPU during some runs; their figures hold that noise")

    print(f"\npooled over {repeats} repeat(s), {steps - warmup} steps each (rank 0):")
    print(f"  {'':<20}{'bare':>10}{'zeropipe':>11}{'ratio':>8}")
    verdict = {}
    for stat_name, stat in (("median", median), ("mean", statistics.mean)):
        for key, label in (("step_time", "step time"), ("period", "step period")):
            zp = [v for r in results if r["system"] == "zeropipe" for v in after_warmup(r, key, warmup)]
            bare = [v for r in results if r["system"] == "bare" for v in after_warmup(r, key, warmup)]
            ratio = stat(zp) / stat(bare)
            if stat_name == "median":
                verdict[key] = ratio
            print(f"  {stat_name + ' ' + label:<20}{stat(bare) * 1e3:8.2f}ms{stat(zp) * 1e3:9.2f}ms{ratio:8.3f}")
    pairs = [
        v
        for repeat in range(1, repeats + 1)
        for v in paired_ratios(
            next(r for r in results if r["system"] == "zeropipe" and r["repeat"] == repeat),
            next(r for r in results if r["system"] == "bare" and r["repeat"] == repeat),
            warmup,
        )
    ]
    print(f"  {'median paired ratio':<20}{'':>21}{median(pairs):8.3f}   (same step, same batch: zeropipe period / bare period)")
    quiet = [r for r in results if r["foreign"] < QUIET_CORES]
    quiet_zp = [v for r in quiet if r["system"] == "zeropipe" for v in after_warmup(r, "period", warmup)]
    quiet_bare = [v for r in quiet if r["system"] == "bare" for v in after_warmup(r, "period", warmup)]
    if quiet_zp and quiet_bare:
        runs = ", ".join(r["name"] for r in quiet)
        print(
            f"  {'median step period':<20}{median(quiet_bare) * 1e3:8.2f}ms{median(quiet_zp) * 1e3:9.2f}ms{median(quiet_zp) / median(quiet_bare):8.3f}"
            f"   quiet runs only (other processes < {QUIET_CORES} cores: {runs})"
        )
    ratio = verdict["period"]
    print(
        f"\nZeRO-Pipe / bare (median step period): {ratio:.3f} -> target <= {TARGET:.2f} "
        f"{'MET' if ratio <= TARGET else 'MISSED'} ({(ratio - 1) * 100:+.1f}%)"
    )
    print(f"(median step time alone, as in metrics.jsonl: {verdict['step_time']:.3f}, {(verdict['step_time'] - 1) * 100:+.1f}%)")
    busy = [r["name"] for r in results if r["foreign"] >= QUIET_CORES]
    if busy:
        print(f"not conclusive: other processes used >= {QUIET_CORES} cores during {len(busy)} of {len(results)} runs ({', '.join(busy)})")
    print(f"total wall time {time.time() - started:.0f} s")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
