"""Data preparation at scale: ZeRO-Pipe's streamed token cache against Hugging Face ``datasets``, in one run.

    nice .venv/bin/python benchmarks/data_scale.py --workdir /tmp/data_scale --records 200000
    nice .venv/bin/python benchmarks/data_scale.py --workdir /tmp/data_scale --records 1000000 --cases zeropipe-jsonl datasets-jsonl

N alpaca records (instruction, input, output of varied lengths, drawn with a seed) are written
as JSONL and as Parquet, and a byte-level BPE tokenizer (ZeRO-Pipe's own trainer, 8,000
tokens: nothing is downloaded) is trained once on a sample of them. Each case then runs in a
fresh subprocess while this process samples the summed PSS of that process and its children
every 100 ms (file-backed pages, memory-mapped files among them, reported beside it):

  zeropipe-jsonl     ``zeropipe.data.token_cache.build_token_cache`` on the JSONL (what ``zeropipe
                     train`` does before the ranks start): read, detect, check, render with the
                     chat template, tokenize, write the uint16 token cache and loss mask, with
                     ``num_workers`` = --processes (``data.num_workers``)
  zeropipe-parquet   the same from the Parquet file
  before-jsonl       zeropipe-jsonl with the ``src/`` of another checkout (--before-src), e.g. the
                     main branch before streaming: every record held, int32 tokens and labels
  train-parquet      ``zeropipe train`` on the Parquet file: the launcher prepares the data as above,
                     then one CPU rank trains a small Llama for 2 steps from the token cache (the
                     whole run's tree is measured: launcher, data workers and the rank)
  train-saved        the same on a folder written by ``datasets``' ``save_to_disk`` from the Parquet
  datasets-jsonl     the field's standard: ``load_dataset("json")`` from a cold cache, then a
                     batched ``map`` that renders the same template and tokenizes prompt and answer
                     with the same tokenizer, ``num_proc`` = --processes

Times and peaks are for the machine as it was: on a shared machine, compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
SAMPLE_PERIOD_S = 0.1
MIB = 1024**2
WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they you were her "
    "she there been one all we their has would when if so no will more can about what out up into some could them other than "
    "model data train answer question explain write list give describe summary reason number value city river history science"
).split()

ZEROPIPE_CASE = """
import inspect, sys, time
from pathlib import Path
from transformers import AutoTokenizer
from zeropipe.data.token_cache import build_token_cache
data, tokenizer_dir, out, processes = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
# An older checkout (--before-src) has no workers: it runs in one process.
workers = {"num_workers": processes} if "num_workers" in inspect.signature(build_token_cache).parameters else {}
info = build_token_cache(data, tokenizer, out, max_seq_len=512, max_bad_fraction=0.01, **workers)
print({"examples": info.examples, "tokens": info.tokens})
"""

# The same template as ZeRO-Pipe's built-in one (bos, <|user|> prompt, <|assistant|> answer eos),
# prompt and answer tokenized separately and masked, as an SFT map function does.
DATASETS_CASE = """
import sys
from pathlib import Path
from datasets import load_dataset
from transformers import AutoTokenizer
data, tokenizer_dir, out, processes = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id

def encode(batch):
    prompts = [
        "<|user|>\\n" + (f"{i}\\n\\n{x}" if x.strip() else i) + "\\n<|assistant|>\\n"
        for i, x in zip(batch["instruction"], batch["input"])
    ]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(batch["output"], add_special_tokens=False)["input_ids"]
    input_ids, labels = [], []
    for p, a in zip(prompt_ids, answer_ids):
        ids = ([bos] + p + a + [eos])[:512]
        lab = ([-100] * (1 + len(p)) + a + [eos])[:512]
        lab[0] = -100
        input_ids.append(ids)
        labels.append(lab)
    return {"input_ids": input_ids, "labels": labels}

dataset = load_dataset("json", data_files=data, split="train", cache_dir=str(out / "hf-cache"))
dataset = dataset.map(encode, batched=True, batch_size=1000, num_proc=processes, remove_columns=dataset.column_names)
print({"examples": len(dataset)})
"""


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def write_records(workdir: Path, count: int, seed: int) -> tuple[Path, Path]:
    jsonl, parquet = workdir / f"alpaca-{count}.jsonl", workdir / f"alpaca-{count}.parquet"
    if jsonl.is_file() and parquet.is_file():
        return jsonl, parquet
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    writer = None
    with open(jsonl, "w") as handle:
        for start in range(0, count, 10_000):
            rows = [
                {"instruction": sentence(rng, 5, 30), "input": sentence(rng, 0, 40) if rng.random() < 0.4 else "", "output": sentence(rng, 10, 200)}
                for _ in range(min(10_000, count - start))
            ]
            handle.write("".join(json.dumps(row) + "\n" for row in rows))
            table = pa.Table.from_pylist(rows)
            writer = writer or pq.ParquetWriter(parquet, table.schema)
            writer.write_table(table, row_group_size=10_000)
    writer.close()
    return jsonl, parquet


TRAIN_CONFIG = """
run: {{output_dir: {out}, name: run, seed: 0}}
model:
  tokenizer: {tokenizer}
  config: {{model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4,
           num_key_value_heads: 2, max_position_embeddings: 512, tie_word_embeddings: false}}
data: {{path: {data}, max_seq_len: 512, num_workers: {processes}, max_bad_fraction: 0.01}}
train: {{max_steps: 2, micro_batch_size: 2, gradient_accumulation_steps: 1, lr: 1.0e-3, log_every: 1}}
deepspeed: {{zero_stage: 2, precision: fp32}}
hardware: {{gpus: 1}}
"""


def save_to_disk(workdir: Path, parquet: Path) -> Path:
    """The Parquet records as a folder written by ``datasets``' ``save_to_disk`` (Arrow files and its JSON)."""
    out = workdir / f"{parquet.stem}-saved"
    if (out / "dataset_info.json").is_file():
        return out
    from datasets import Dataset

    Dataset.from_parquet(str(parquet), cache_dir=str(workdir / "hf-cache")).save_to_disk(str(out))
    shutil.rmtree(workdir / "hf-cache", ignore_errors=True)
    return out


def train_tokenizer(workdir: Path, jsonl: Path) -> Path:
    out = workdir / "tokenizer"
    if (out / "tokenizer.json").is_file():
        return out
    sys.path.insert(0, str(REPO / "src"))
    from zeropipe.data.tokenizer import train_tokenizer as train

    texts = []
    with open(jsonl) as handle:
        for _, line in zip(range(20_000), handle):
            row = json.loads(line)
            texts += [row["instruction"], row["input"], row["output"]]
    train(texts, 8000, out)
    return out


def tree_memory(process: psutil.Process) -> tuple[int, int]:
    """Summed PSS of a process and its children, and their file-backed resident pages."""
    pss = file_backed = 0
    try:
        members = [process] + process.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0, 0
    for member in members:
        try:
            pss += member.memory_full_info().pss
            with open(f"/proc/{member.pid}/status") as status:
                for line in status:
                    if line.startswith("RssFile:"):
                        file_backed += int(line.split()[1]) * 1024
        except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, ProcessLookupError):
            pass
    return pss, file_backed


def run_case(name: str, argv: list[str], env: dict) -> dict:
    started = time.monotonic()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watched = psutil.Process(process.pid)
    peak = [0, 0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            pss, file_backed = tree_memory(watched)
            if pss > peak[0]:
                peak[0], peak[1] = pss, file_backed
            stop.wait(SAMPLE_PERIOD_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = process.communicate()
    stop.set()
    sampler.join()
    seconds = time.monotonic() - started
    if process.returncode != 0:
        raise SystemExit(f"{name} failed:\n{err[-3000:]}")
    return {"case": name, "seconds": round(seconds, 1), "peak_pss_mib": round(peak[0] / MIB), "file_backed_mib_at_peak": round(peak[1] / MIB), "output": out.strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--processes", type=int, default=2, help="datasets' num_proc and ZeRO-Pipe's num_workers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", nargs="+", default=["zeropipe-jsonl", "zeropipe-parquet", "datasets-jsonl"])
    parser.add_argument("--before-src", type=Path, help="another checkout's src/ for the before-jsonl case")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    jsonl, parquet = write_records(args.workdir, args.records, args.seed)
    tokenizer = train_tokenizer(args.workdir, jsonl)
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    results = []
    for case in args.cases:
        out = args.workdir / f"out-{case}"
        shutil.rmtree(out, ignore_errors=True)  # a cold cache every time
        out.mkdir()
        case_env = env
        if case == "before-jsonl":
            case_env = dict(env, PYTHONPATH=str(args.before_src))
            argv = [sys.executable, "-c", ZEROPIPE_CASE, str(jsonl), str(tokenizer), str(out / "cache"), str(args.processes)]
        elif case.startswith("train-"):
            source = parquet if case == "train-parquet" else save_to_disk(args.workdir, parquet)
            config = out / "train.yaml"
            config.write_text(TRAIN_CONFIG.format(out=out, tokenizer=tokenizer, data=source, processes=args.processes))
            argv = [sys.executable, "-m", "zeropipe", "train", str(config)]
        elif case.startswith("zeropipe"):
            source = jsonl if case.endswith("jsonl") else parquet
            argv = [sys.executable, "-c", ZEROPIPE_CASE, str(source), str(tokenizer), str(out / "cache"), str(args.processes)]
        else:
            argv = [sys.executable, "-c", DATASETS_CASE, str(jsonl), str(tokenizer), str(out), str(args.processes)]
        result = run_case(case, argv, case_env)
        if case.startswith("train-"):
            summary = json.loads((out / "run" / "summary.json").read_text())
            cache = json.loads((out / "run" / "cache" / "cache.json").read_text())
            result["output"] = {key: cache.get(key) for key in ("records", "examples", "tokens", "bad_record_count")} | {
                "steps": summary["steps"], "first_loss": round(summary["first_loss"], 3), "final_loss": round(summary["final_loss"], 3),
            }  # fmt: skip
        results.append(result)
        print(json.dumps(result), flush=True)
    baseline = next((r for r in results if r["case"] == "datasets-jsonl"), None)
    size = jsonl.stat().st_size / MIB
    print(f"\n{args.records:,} records ({size:.0f} MiB of JSONL), datasets num_proc={args.processes}, {os.cpu_count()} cores")
    print(f"{'case':18} {'time s':>8} {'x datasets':>11} {'peak PSS MiB':>13} {'file-backed MiB':>16}")
    for r in results:
        ratio = f"{r['seconds'] / baseline['seconds']:.2f}" if baseline else "-"
        print(f"{r['case']:18} {r['seconds']:8.1f} {ratio:>11} {r['peak_pss_mib']:13} {r['file_backed_mib_at_peak']:16}")
    cache = args.workdir / "out-zeropipe-jsonl" / "cache"
    if cache.is_dir():
        total = sum(f.stat().st_size for f in cache.iterdir())
        print(f"token cache: {total / MIB:.0f} MiB ({', '.join(f'{f.name} {f.stat().st_size / MIB:.0f}' for f in sorted(cache.iterdir()))})")


if __name__ == "__main__":
    main()
