"""Useful tokens/s: ZeRO-Pipe padded, grouped and packed against the Hugging Face Trainer padded, grouped and padding-free.

    .venv/bin/python benchmarks/packing.py                    # the full comparison: 6 systems x 2 runs (an earlier 3 x 2 took 8 min on 2 idle cores)
    .venv/bin/python benchmarks/packing.py --quiet-wait 120   # on a shared machine: wait for quiet before each run
    .venv/bin/python benchmarks/packing.py --quick            # smoke run: the small model, 6 runs
    .venv/bin/python benchmarks/packing.py --systems zeropipe-packed,hf-flatten   # a subset (a padded ZeRO-Pipe run is added first)

One instruction set with a realistic spread of lengths (alpaca records, lengths drawn
log-normally between 16 and max_seq_len tokens, generated deterministically), one model
(a random-init Llama, hidden 256 x 4 layers, the same seed for all) and one DeepSpeed
config (ZeRO-2, ``deepspeed.precision: auto``: fp32 on CPUs without native bf16), trained
for one epoch by six systems on 2 CPU ranks (gloo):

* ``zeropipe``: ``zeropipe train``, micro-batches of 8 examples in random order, padded;
* ``zeropipe-grouped``: the same with ``data.group_by_length: true``;
* ``zeropipe-packed``: ``data.packing: true``, with as many packed sequences of 512 tokens
  per micro-batch as hold about 8 examples (2 on this data), so all take about the same
  number of optimizer steps per epoch;
* ``hf-padded``: ``transformers.Trainer`` started with ``torchrun --nproc_per_node 2``
  (``--hf-rank``, this file), with the ``ds_config.json`` the first padded ZeRO-Pipe run
  wrote, the same model config and seed, and the same tokenized examples (that run's token
  cache: the same token ids and labels), batched by HF's padding collator for inputs with
  labels (``DataCollatorForSeq2Seq``) in HF's default shuffled order. On CPU,
  ``TrainingArguments`` needs ``use_cpu=True`` for bf16; DeepSpeed is still the engine
  (``trainer.is_deepspeed_enabled``). A subclass only counts each step's non-padding tokens
  (``training_step``) and a callback notes when each step ends;
* ``hf-grouped``: the same with ``train_sampling_strategy="group_by_length"`` (HF's
  length-grouped sampler);
* ``hf-flatten``: the same with ``DataCollatorWithFlattening``, HF's padding-free collator:
  each micro-batch of 8 examples end to end in one row, position ids restarting at 0 per
  example, no attention mask.

Attention masking is the same on both sides: ZeRO-Pipe's packed rows and HF's flattened
rows both carry position ids that restart per example and no attention mask, and
transformers (``masking_utils.find_packed_sequence_indices``, with ``use_cache=False``, the
Trainer's default and what ZeRO-Pipe passes) turns them into a block-diagonal causal mask
for sdpa: no token attends to another example. On CPU sdpa has no variable-length kernel,
so both compute attention over the whole row under that mask. Each example's first token
is no target on both sides (HF's ``separator_id``, ZeRO-Pipe's pack builder).

*Useful* tokens are the examples' own tokens, padding excluded. Throughput is measured on
rank 0's clock from the end of step 3 to the end of the last step (start-up and the first
steps left out; ZeRO-Pipe's from the ``time`` of its metrics rows, HF's from a callback),
with the useful tokens of every rank in those steps. Each system runs ``--repeats`` times
(default 2) in ABC..CBA order so that slow drift of a shared machine cancels; the figures
are pooled, the spread of each system's runs and the ratio within each repeat are printed
as the noise band. The second run of each system uses seed 43 (model init and data order)
instead of 42, which measures how far the eval loss moves with the seed alone: the noise
the systems' losses are compared against. Each run trains every training example once;
afterwards each computes the eval loss on the same held-out examples with the same code
(``zeropipe.families.causal_lm.evaluation``: mean over loss tokens, on the trained DeepSpeed engine),
so the losses differ only by what the runs learned.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TARGET = 1.0  # ZeRO-Pipe's best useful tokens/s over the HF Trainer's best (issue 20)
WARMUP_STEPS = 3  # steps left out of the throughput (start-up, first allocations)
PADDED_MICRO = 8  # examples per micro-batch of the padded runs
SEED = 42

BENCH_CONFIG = """\
# Written by benchmarks/packing.py; run it: zeropipe train {path}
run:
  output_dir: {output_dir}
  seed: {seed}
model:
  config:
    model_type: llama
    hidden_size: {hidden}
    intermediate_size: {intermediate}
    num_hidden_layers: {layers}
    num_attention_heads: 4
    num_key_value_heads: 2
    max_position_embeddings: {max_seq_len}
    tie_word_embeddings: false
  tokenizer_vocab_size: 1000
{tokenizer}data:
  path: {train}
  eval_path: {heldout}
  format: alpaca
  max_seq_len: {max_seq_len}
  packing: {packing}
  group_by_length: {group_by_length}
train:
  epochs: 1
  micro_batch_size: {micro}
  gradient_accumulation_steps: 1
  lr: 1.0e-3
  warmup_steps: 10
  schedule: cosine
  log_every: 20
deepspeed:
  zero_stage: 2
  precision: {precision}
hardware:
  gpus: 2
  accelerator: cpu
generate:
  max_new_tokens: 1
"""


# --------------------------------------------------------------------------- the data
def pseudo_words(count: int, rng: np.random.Generator) -> list[str]:
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "po", "da", "fi", "gu", "he", "ja", "ble", "tro", "sha"]
    words = set()
    while len(words) < count:
        words.add("".join(rng.choice(syllables, size=rng.integers(1, 4))))
    return sorted(words)


def make_instruction_set(path: Path, examples: int, max_seq_len: int, seed: int) -> None:
    """Alpaca records whose lengths follow a log-normal spread (median ~90 tokens, long tail to max_seq_len).

    Tasks the model can learn from the text itself: copy, reverse or sort a list of words, so
    eval loss falls below the word-frequency level as training goes on.
    """
    # One vocabulary for every file (training and held-out), whatever the seed of the examples.
    vocabulary = pseudo_words(400, np.random.default_rng(SEED))
    rng = np.random.default_rng(seed)
    frequency = 1.0 / np.arange(1, len(vocabulary) + 1)  # Zipf, like words in text
    frequency /= frequency.sum()
    tasks = {
        "Repeat these words exactly.": lambda words: words,
        "Write these words in reverse order.": lambda words: words[::-1],
        "Sort these words alphabetically.": sorted,
    }
    # About 1.25 tokens per pseudo-word with the 1000-token BPE trained on this data; prompt
    # and answer each hold the list once, so a record of n words has ~2.5 n tokens.
    tokens_per_word = 2.5
    with open(path, "w") as handle:
        for _ in range(examples):
            length = float(np.clip(rng.lognormal(mean=math.log(90), sigma=0.85), 16, max_seq_len * 1.1))
            count = max(2, int(length / tokens_per_word))
            words = list(rng.choice(vocabulary, size=count, p=frequency))
            instruction = list(tasks)[int(rng.integers(len(tasks)))]
            record = {"instruction": instruction, "input": " ".join(words), "output": " ".join(tasks[instruction](words))}
            handle.write(json.dumps(record) + "\n")


# --------------------------------------------------------------------------- HF Trainer (one rank)
def hf_rank(run_dir: Path, out: Path, seed: int, mode: str) -> None:
    """transformers.Trainer on the padded ZeRO-Pipe run's ds_config.json, model config and token cache.

    ``mode``: ``padded`` (DataCollatorForSeq2Seq, random order: HF's default), ``grouped`` (the
    same collator with ``train_sampling_strategy="group_by_length"``) or ``flatten``
    (``DataCollatorWithFlattening``: each micro-batch's examples end to end in one row, no
    padding, position ids restarting at 0 per example and no attention mask, so transformers
    builds the same block-diagonal causal mask as for ZeRO-Pipe's packed rows).
    """
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

    from zeropipe.data.token_cache import TokenDataset, collate
    from zeropipe.engine.trainer import seed_everything
    from zeropipe.families.causal_lm.evaluation import eval_batch_indices, eval_record, eval_sums
    from zeropipe.families.causal_lm.model import build_model
    from zeropipe.models.common import model_config
    from zeropipe.rundir import RunDir

    rank = int(os.environ["RANK"])
    config = RunDir(run_dir).read_config()  # config.yaml with learned.json (the vocabulary size) applied
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    plan = json.loads((run_dir / "run.json").read_text())
    scheduler = ds_config["scheduler"]["params"]
    optimizer = ds_config["optimizer"]["params"]
    tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "tokenizer"))

    class Examples(torch.utils.data.Dataset):
        """The padded run's token cache, as the lists HF collators take."""

        def __init__(self, cache: Path):
            self.cache = TokenDataset(cache)

        def __len__(self):
            return len(self.cache)

        def __getitem__(self, index):
            example = self.cache[index]
            return {"input_ids": example["input_ids"].tolist(), "labels": example["labels"].tolist()}

    # The model as ZeRO-Pipe builds it: same config, same seed, same dtype, same attention.
    seed_everything(seed)
    model = build_model(config.model, model_config(config.model), config.deepspeed.precision, zero_stage=2)
    bf16 = bool(ds_config.get("bf16", {}).get("enabled"))

    args = TrainingArguments(
        output_dir=str(out.parent / "hf-output"),
        per_device_train_batch_size=ds_config["train_micro_batch_size_per_gpu"],
        gradient_accumulation_steps=ds_config["gradient_accumulation_steps"],
        learning_rate=optimizer["lr"],
        adam_beta1=optimizer["betas"][0],
        adam_beta2=optimizer["betas"][1],
        adam_epsilon=optimizer["eps"],
        weight_decay=optimizer["weight_decay"],
        max_grad_norm=ds_config["gradient_clipping"],
        warmup_steps=scheduler["warmup_num_steps"],
        max_steps=plan["total_steps"],
        bf16=bf16,
        use_cpu=True,  # TrainingArguments refuses bf16 without a GPU otherwise; DeepSpeed still runs the model
        train_sampling_strategy="group_by_length" if mode == "grouped" else "random",
        use_cache=False,  # the default; said here because packed rows need it (a KV cache turns off the block-diagonal mask)
        deepspeed=ds_config,
        seed=seed,
        save_strategy="no",
        report_to=[],
        logging_steps=20,
        disable_tqdm=True,
    )

    step_ends: list[float] = []
    step_tokens: list[int] = []
    tokens_this_step = [0]

    class Counting(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            # Flattened rows have no padding and no attention mask: every token is useful.
            mask = inputs.get("attention_mask")
            tokens_this_step[0] += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
            return super().training_step(model, inputs, num_items_in_batch)

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())
            step_tokens.append(tokens_this_step[0])
            tokens_this_step[0] = 0

    trainer = Counting(
        model=model,
        args=args,
        train_dataset=Examples(run_dir / "cache"),
        data_collator=(
            DataCollatorWithFlattening()  # separator_id -100: each example's first token is no target, as in ZeRO-Pipe's packs
            if mode == "flatten"
            else DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
        ),
        callbacks=[StepClock()],
    )
    assert trainer.is_deepspeed_enabled, "the HF Trainer must run on DeepSpeed for this comparison"
    started = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - started

    # The same evaluation as ZeRO-Pipe's, on the same held-out cache.
    engine = trainer.model_wrapped
    eval_set = TokenDataset(run_dir / "cache" / "eval")
    pad_id = tokenizer.pad_token_id
    batches = eval_batch_indices(eval_set.lengths(), rank, dist.get_world_size(), ds_config["train_micro_batch_size_per_gpu"])
    engine.eval()
    sums = torch.tensor(
        eval_sums(lambda batch: engine(**batch, use_cache=False).loss, eval_set, batches, lambda items: collate(items, pad_id), torch.device("cpu")),
        dtype=torch.float64,
    )
    dist.all_reduce(sums)
    record = eval_record(len(step_ends), *sums.tolist(), 0.0)
    out.write_text(
        json.dumps(
            {
                "rank": rank,
                "step_end_s": step_ends,
                "step_tokens": step_tokens,
                "train_seconds": train_seconds,
                "examples": len(trainer.train_dataset),
                "eval_loss": record["eval_loss"],
            }
        )
    )


# --------------------------------------------------------------------------- drivers
def run_zeropipe(config_path: Path, name: str, work: Path) -> dict:
    """`zeropipe train` as a user runs it; figures from metrics.jsonl."""
    zeropipe = Path(sys.executable).with_name("zeropipe")
    log = work / f"{name}.log"
    started = time.perf_counter()
    with open(log, "w") as handle:
        code = subprocess.call([str(zeropipe), "train", str(config_path)], stdout=handle, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - started
    if code != 0:
        sys.exit(f"zeropipe train failed (exit {code}); its output:\n{log.read_text()[-4000:]}")
    run_dir = work / "runs" / name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row.get("kind") is None]
    evals = [row for row in rows if row.get("kind") == "eval"]
    timed = steps[WARMUP_STEPS:]
    return {
        "name": name,
        "run_dir": run_dir,
        "steps": len(steps),
        "examples": round(sum(row["samples_per_s"] * row["step_time_s"] for row in steps)),
        "useful_tokens": round(sum(row["tokens_per_s"] * row["step_time_s"] for row in steps)),
        "timed_tokens": sum(row["tokens_per_s"] * row["step_time_s"] for row in timed),
        # Rank 0's clock from the end of step WARMUP_STEPS to the end of the last, as for the HF Trainer.
        "timed_s": steps[-1]["time"] - steps[WARMUP_STEPS - 1]["time"],
        "eval_loss": evals[-1]["eval_loss"],
        "wall_s": wall,
    }


def run_hf_trainer(run_dir: Path, name: str, work: Path, seed: int, mode: str) -> dict:
    from zeropipe.launch.supervisor import free_port

    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = work / name
    out.mkdir(exist_ok=True)
    log = work / f"{name}.log"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
        __file__, "--hf-rank", str(run_dir), "--hf-out", str(out), "--hf-seed", str(seed), "--hf-mode", mode,
    ]  # fmt: skip
    started = time.perf_counter()
    with open(log, "w") as handle:
        code = subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - started
    results = [out / f"rank{rank}.json" for rank in range(2)]
    if code != 0 and not all(path.is_file() for path in results):
        sys.exit(f"the HF Trainer run failed (exit {code}); its output:\n{log.read_text()[-6000:]}")
    if code != 0:
        # Seen with DataCollatorWithFlattening runs: "terminate called without an active exception"
        # as a rank's interpreter exits, after it wrote its results (the last thing it does).
        print(f"  ({name}: torchrun exited {code} after both ranks wrote their results; see {log})", flush=True)
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    ends = ranks[0]["step_end_s"]
    tokens = [sum(values) for values in zip(*(r["step_tokens"] for r in ranks))]
    return {
        "name": name,
        "steps": len(ends),
        "examples": ranks[0]["examples"],
        "useful_tokens": sum(tokens),
        "timed_tokens": sum(tokens[WARMUP_STEPS:]),
        "timed_s": ends[-1] - ends[WARMUP_STEPS - 1],
        "eval_loss": ranks[0]["eval_loss"],
        "wall_s": wall,
    }


def eval_before_training(run_dir: Path) -> float:
    """The eval loss of the untrained model (same seed and build): where all three start."""
    import torch
    from transformers import AutoTokenizer

    from zeropipe.data.token_cache import TokenDataset, collate
    from zeropipe.engine.trainer import seed_everything
    from zeropipe.families.causal_lm.evaluation import eval_batch_indices, eval_record, eval_sums
    from zeropipe.families.causal_lm.model import build_model
    from zeropipe.models.common import model_config
    from zeropipe.rundir import RunDir

    config = RunDir(run_dir).read_config()  # config.yaml with learned.json (the vocabulary size) applied
    seed_everything(config.run.seed)
    model = build_model(config.model, model_config(config.model), config.deepspeed.precision).eval()
    pad_id = AutoTokenizer.from_pretrained(str(run_dir / "tokenizer")).pad_token_id
    dataset = TokenDataset(run_dir / "cache" / "eval")
    batches = eval_batch_indices(dataset.lengths(), 0, 1, 8)
    sums = eval_sums(lambda batch: model(**batch, use_cache=False).loss, dataset, batches, lambda items: collate(items, pad_id), torch.device("cpu"))
    return eval_record(0, *sums, 0.0)["eval_loss"]


def packed_micro(padded_run: Path, max_seq_len: int) -> int:
    """Packed sequences per micro-batch holding about as many examples as a padded micro-batch,
    so both take about the same number of optimizer steps per epoch and learn comparably."""
    lengths = np.diff(np.load(padded_run / "cache" / "offsets.npy"))
    return max(1, round(PADDED_MICRO * float(lengths.mean()) / max_seq_len))


def same_token_cache(first: Path, second: Path) -> bool:
    return all(np.array_equal(np.load(first / name), np.load(second / name)) for name in ("tokens.npy", "labels.npy", "offsets.npy"))


SYSTEMS = ("zeropipe", "hf-padded", "zeropipe-grouped", "hf-grouped", "zeropipe-packed", "hf-flatten")
# Each ZeRO-Pipe way of batching against the HF Trainer's way of doing the same thing.
PAIRS = (("zeropipe", "hf-padded"), ("zeropipe-grouped", "hf-grouped"), ("zeropipe-packed", "hf-flatten"))
HF_MODES = {"hf-padded": "padded", "hf-grouped": "grouped", "hf-flatten": "flatten"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 400 examples, hidden 128 x 2 layers, seq 256, one repeat")
    parser.add_argument("--examples", type=int, default=None, help="training examples (default 1600; rounded down to a multiple of 16)")
    parser.add_argument(
        "--no-warmup", action="store_true", help="count the first run (by default an extra, untimed run of the first ZeRO-Pipe system goes first)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="runs of each system, in ABC..CBA order (default 2, 1 with --quick)")
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {', '.join(SYSTEMS)} (default all; a padded or grouped ZeRO-Pipe run is always first)"
    )
    parser.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"), help="deepspeed.precision of every run (default auto: what `zeropipe train` picks here)")
    parser.add_argument("--workdir", type=Path, default=None, help="where runs are written (default: a temporary directory, removed at the end)")
    parser.add_argument(
        "--quiet-wait", type=float, default=0, metavar="SECONDS", help="before each run, wait up to this long for other processes to leave the CPU idle (shared machines)"
    )
    parser.add_argument("--hf-rank", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--hf-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--hf-seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hf-mode", choices=("padded", "grouped", "flatten"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.hf_rank:
        hf_rank(args.hf_rank, args.hf_out / f"rank{os.environ['RANK']}.json", args.hf_seed, args.hf_mode)
        return 0

    chosen = [name.strip() for name in args.systems.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SYSTEMS]
    if unknown:
        parser.error(f"unknown system(s) {', '.join(unknown)}: choose from {', '.join(SYSTEMS)}")
    systems = [name for name in SYSTEMS if name in chosen]
    # The HF Trainer reads the token cache, tokenizer and ds_config.json of a padded-batch ZeRO-Pipe run.
    if not any(name in systems for name in ("zeropipe", "zeropipe-grouped")):
        systems.insert(0, "zeropipe")
    first = next(name for name in systems if name in ("zeropipe", "zeropipe-grouped"))
    systems = [first] + [name for name in systems if name != first]

    examples = args.examples or (400 if args.quick else 1600)
    examples -= examples % 16  # whole global batches for the padded runs: every system trains the same examples
    repeats = args.repeats or (1 if args.quick else 2)
    hidden, layers, max_seq_len = (128, 2, 256) if args.quick else (256, 4, 512)
    heldout = max(40, examples // 10)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="zeropipe-packing-"))
    work.mkdir(parents=True, exist_ok=True)
    if (work / "runs").exists():
        parser.error(f"{work}/runs already exists: pass an empty --workdir")

    from overhead import QUIET_CORES, ForeignLoad, wait_for_quiet  # benchmarks/ is on sys.path when this file runs

    started = time.time()
    make_instruction_set(work / "train.jsonl", examples, max_seq_len, SEED)
    make_instruction_set(work / "heldout.jsonl", heldout, max_seq_len, SEED + 1)

    def write(name: str, packing: bool, grouped: bool, micro: int, tokenizer: Path | None, seed: int) -> Path:
        path = work / f"{name}.yaml"
        path.write_text(
            BENCH_CONFIG.format(
                path=path,
                output_dir=work / "runs",
                seed=seed,
                hidden=hidden,
                intermediate=int(hidden * 2.6875),
                layers=layers,
                max_seq_len=max_seq_len,
                tokenizer=f"  tokenizer: {tokenizer}\n" if tokenizer else "",
                train=work / "train.jsonl",
                heldout=work / "heldout.jsonl",
                packing="true" if packing else "false",
                group_by_length="true" if grouped else "false",
                micro=micro,
                precision=args.precision,
            ).replace("run:\n", f"run:\n  name: {name}\n", 1)
        )
        return path

    print(
        f"packing benchmark: llama hidden {hidden} x {layers} layers (random init, seed {SEED} then {SEED + 1}, ...), ZeRO-2 precision {args.precision}, "
        f"2 CPU ranks (OMP_NUM_THREADS=1 each), {examples} training + {heldout} held-out alpaca examples, max_seq_len {max_seq_len}, "
        f"one epoch per run, {repeats} run(s) per system",
        flush=True,
    )
    print(f"work directory: {work}", flush=True)

    # The first padded ZeRO-Pipe run writes the tokenizer, token cache and ds_config.json the others use.
    reference: Path | None = None

    def run(system: str, repeat: int) -> dict:
        nonlocal reference
        if args.quiet_wait:
            load = wait_for_quiet(args.quiet_wait)
            if load >= QUIET_CORES:
                print(f"  (machine still busy after waiting {args.quiet_wait:.0f} s: {load:.2f} cores used by others)", flush=True)
        name = f"{system}-{repeat}"
        seed = SEED + max(repeat, 1) - 1  # each repeat its own model init and data order (the warm-up: the first's)
        tokenizer = reference / "tokenizer" if reference else None
        with ForeignLoad() as load:
            if system in HF_MODES:
                mode = HF_MODES[system]
                result = run_hf_trainer(reference, name, work, seed, mode)
                result["micro"] = f"{PADDED_MICRO} flattened" if mode == "flatten" else f"{PADDED_MICRO} {mode}"
            else:
                packing, grouped = system == "zeropipe-packed", system == "zeropipe-grouped"
                micro = packed_micro(reference, max_seq_len) if packing else PADDED_MICRO
                result = run_zeropipe(write(name, packing, grouped, micro, tokenizer, seed), name, work)
                result["micro"] = f"{micro} x {max_seq_len} packed" if packing else f"{micro} {'grouped' if grouped else 'padded'}"
                reference = reference or result["run_dir"]
        result.update(system=system, repeat=repeat, seed=seed, foreign=load.cores, tokens_per_s=result["timed_tokens"] / result["timed_s"])
        print(
            f"  {name:<20} {result['tokens_per_s']:7.0f} useful tokens/s   ({result['wall_s']:.0f} s wall, other processes {load.cores:.2f} cores)"
            + ("   warm-up, not counted" if repeat == 0 else ""),
            flush=True,
        )
        return result

    # An untimed first run (repeat 0) writes the tokenizer, token cache and ds_config.json the others read,
    # and pays what only a machine's first run pays (libraries and data not yet in the page cache): measured,
    # the first run of the quick benchmark on an idle machine was 11-16% below the same system's later runs,
    # a penalty that would land on one system's figures only.
    warmup = None if args.no_warmup else run(first, 0)
    # ABC..CBA: every other repeat runs the systems in reverse, so slow drift of a shared machine cancels.
    order = [(system, repeat + 1) for repeat in range(repeats) for system in (systems if repeat % 2 == 0 else systems[::-1])]
    results = [run(system, repeat) for system, repeat in order]
    padded = warmup or next(r for r in results if r["system"] == first)
    before = eval_before_training(padded["run_dir"])

    lengths = np.diff(np.load(padded["run_dir"] / "cache" / "offsets.npy"))
    cache_info = json.loads((padded["run_dir"] / "cache" / "cache.json").read_text())
    same = all(same_token_cache(padded["run_dir"] / "cache", r["run_dir"] / "cache") for r in results if "run_dir" in r)
    print(
        f"\ndata: {len(lengths)} examples, {int(lengths.sum())} tokens; tokens per example: median {int(np.median(lengths))}, "
        f"p10 {int(np.percentile(lengths, 10))}, p90 {int(np.percentile(lengths, 90))}, max {int(lengths.max())} "
        f"({cache_info['truncated']} truncated at {max_seq_len})"
    )
    packed = next((r for r in results if r["system"] == "zeropipe-packed"), None)
    if packed:
        packs = json.loads((packed["run_dir"] / "cache" / "packs.json").read_text())
        print(f"packing: {packs['packs']} sequences of up to {max_seq_len} tokens, {100 * packs['fill']:.1f}% real tokens")
    ds_config = json.loads((padded["run_dir"] / "ds_config.json").read_text())
    print(f"precision of every run (ds_config.json of {padded['name']}): {'bf16' if ds_config.get('bf16', {}).get('enabled') else 'fp32'}")
    print(f"same token ids and labels in every ZeRO-Pipe run (the HF Trainer reads {padded['name']}'s cache): {'yes' if same else 'NO'}")

    print(f"\nevery run: useful (non-padding) tokens/s on rank 0's clock from the end of step {WARMUP_STEPS} to the last step (tokens of both ranks)")
    print(f"  {'run':<20}{'micro-batch':>16}{'steps':>7}{'examples':>10}{'useful tokens':>15}{'tokens/s':>10}{'eval loss':>11}{'wall s':>8}{'other load':>12}")
    for r in results:
        print(
            f"  {r['name']:<20}{r['micro']:>16}{r['steps']:>7}{r['examples']:>10}{r['useful_tokens']:>15,}{r['tokens_per_s']:>10.0f}"
            f"{r['eval_loss']:>11.4f}{r['wall_s']:>8.0f}{r['foreign']:>9.2f} cores"
        )

    def runs_of(system: str, quiet_only: bool = False) -> list[dict]:
        return [r for r in results if r["system"] == system and (r["foreign"] < QUIET_CORES or not quiet_only)]

    def pooled(system: str, quiet_only: bool = False) -> float | None:
        runs = runs_of(system, quiet_only)
        return sum(r["timed_tokens"] for r in runs) / sum(r["timed_s"] for r in runs) if runs else None

    print(f"\npooled over {repeats} run(s) per system (all timed tokens / all timed seconds), and the spread of the runs:")
    for system in systems:
        rates = [r["tokens_per_s"] for r in runs_of(system)]
        spread = f"runs {min(rates):.0f}-{max(rates):.0f} ({100 * (max(rates) - min(rates)) / pooled(system):.0f}% of the pooled figure)" if len(rates) > 1 else ""
        print(f"  {system:<19}{pooled(system):8.0f} useful tokens/s   {spread}")

    def compare(ours: str, theirs: str) -> tuple[float, list[float]]:
        """Pooled ratio and the ratio within each repeat (runs of one repeat are close in time)."""
        per_repeat = [
            next(r["tokens_per_s"] for r in results if r["system"] == ours and r["repeat"] == repeat)
            / next(r["tokens_per_s"] for r in results if r["system"] == theirs and r["repeat"] == repeat)
            for repeat in range(1, repeats + 1)
        ]
        return pooled(ours) / pooled(theirs), per_repeat

    print("\nZeRO-Pipe / HF Trainer, each way of batching (useful tokens/s):")
    for ours, theirs in PAIRS:
        if ours in systems and theirs in systems:
            ratio, per_repeat = compare(ours, theirs)
            print(f"  {ours:<17} / {theirs:<11} {ratio:5.2f}x pooled   per repeat {', '.join(f'{value:.2f}' for value in per_repeat)}")

    print(f"\neval loss on the {heldout} held-out examples after one epoch (before training: {before:.3f}):")
    seeds = sorted({r["seed"] for r in results})
    print(f"  {'system':<19}" + "".join(f"{'seed ' + str(seed):>12}" for seed in seeds) + f"{'mean':>10}")
    means = {}
    for system in systems:
        losses = [next(r["eval_loss"] for r in results if r["system"] == system and r["seed"] == seed) for seed in seeds]
        means[system] = sum(losses) / len(losses)
        print(f"  {system:<19}" + "".join(f"{loss:>12.4f}" for loss in losses) + f"{means[system]:>10.4f}")
    spread = max(means.values()) - min(means.values())
    if len(seeds) > 1:
        # Another seed is another model init and data order: how far apart the same system lands.
        seed_noise = max(abs(a["eval_loss"] - b["eval_loss"]) for a in results for b in results if a["system"] == b["system"])
        verdict = "the same within noise" if spread <= seed_noise else "NOT within the seed-to-seed noise"
        print(f"  spread of the means {spread:.4f}; largest seed-to-seed difference within a system {seed_noise:.4f}: {verdict}")
    else:
        print(f"  spread {spread:.4f} (run with --repeats 2 or more for the seed-to-seed noise)")

    ours = [system for system in systems if system.startswith("zeropipe")]
    theirs = [system for system in systems if system.startswith("hf-")]
    if ours and theirs:
        our_best, their_best = max(ours, key=pooled), max(theirs, key=pooled)
        ratio, per_repeat = compare(our_best, their_best)
        band = f" (per repeat {min(per_repeat):.2f}-{max(per_repeat):.2f})" if len(per_repeat) > 1 else ""
        print(
            f"\nZeRO-Pipe's best ({our_best}) / the HF Trainer's best ({their_best}), useful tokens/s pooled: {ratio:.2f}x{band} "
            f"-> target >= {TARGET}x {'MET' if ratio >= TARGET else 'MISSED'}"
        )
        if pooled(our_best, True) and pooled(their_best, True):
            print(f"  quiet runs only (other processes < {QUIET_CORES} cores): {pooled(our_best, True) / pooled(their_best, True):.2f}x")
    busy = [r["name"] for r in results if r["foreign"] >= QUIET_CORES]
    if busy:
        print(f"note: other processes used >= {QUIET_CORES} cores during {len(busy)} of {len(results)} runs ({', '.join(busy)}): their figures hold that noise")
    print(f"total wall time {time.time() - started:.0f} s")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
