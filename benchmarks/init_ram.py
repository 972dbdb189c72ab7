"""Host RAM while ranks load a pretrained checkpoint: ZeRO-Pipe against transformers' two ways.

    .venv/bin/python benchmarks/init_ram.py                    # 361M parameters, 1/2/4 ranks, ZeRO-3 and ZeRO-2 (~25 min on 2 cores)
    .venv/bin/python benchmarks/init_ram.py --precision fp32   # the same, training in fp32 from the bf16 checkpoint
    .venv/bin/python benchmarks/init_ram.py --quick            # small model, 1/2 ranks: a smoke run (loads too fast to sample well)

A Llama-shaped model is saved once as bf16 safetensors (in a temporary directory, or
--workdir to keep it). Then, for every ZeRO stage, rank count and method, ranks are started
with ``torch.distributed.run`` (CPU ranks, gloo: here the "GPU" is host RAM) and each:

1. imports torch, transformers, DeepSpeed and the model's modeling code, joins the process
   group and waits at a barrier;
2. loads the model by one of three methods:
   (a) ``naive``: ``AutoModelForCausalLM.from_pretrained`` on every rank, no ZeRO integration;
       under ZeRO-3 followed by ``deepspeed.zero.Init(module=model)``, the partitioning that
       ``deepspeed.initialize`` would do first, so that its cost counts as loading;
   (b) ``hf-zero3``: ``from_pretrained`` with ``HfDeepSpeedConfig`` alive, transformers' ZeRO-3
       integration (under ZeRO-2 the integration does nothing: (b) is (a) again);
   (c) ``zeropipe``: ``zeropipe.families.causal_lm.model.build_model`` as ``zeropipe train`` calls it
       (with ``HfDeepSpeedConfig`` alive under ZeRO-3, like the trainer);
3. calls ``deepspeed.initialize`` with the DeepSpeed JSON ``zeropipe train`` generates
   (AdamW, bf16 unless --precision fp32) and runs one training step.

Meanwhile this process samples the PSS of every rank every 50 ms (psutil's
``memory_full_info().pss``: pages several ranks share, such as a file they all map, count once
across them) and sums it over the ranks. The ranks timestamp the phases. Figures, each a
multiple of the checkpoint's size on disk:

* fixed: the summed PSS at the barrier before loading (Python, torch, DeepSpeed, gloo);
* model: the bytes the loaded model legitimately occupies on the node, from the parameter
  count: one partitioned copy in the training dtype under ZeRO-3 (with DeepSpeed's padding),
  one full copy per rank under ZeRO-2;
* TRANSIENT: the peak of the summed PSS while loading (from the barrier until every rank has
  its model) above fixed + what the loaded model occupies. That is the model figure, or the
  PSS once loading is over when it is lower: on CPU, weights in the checkpoint's dtype can
  stay copy-on-write mappings of the file that all ranks share (from_pretrained's do, and
  ZeRO-Pipe's), counted once. The targets are about this figure;
* after load: the settled PSS once every rank has its model, above fixed (more than model:
  memory a method did not give back);
* peak to step 1 / after step 1: above fixed, through ``deepspeed.initialize`` and the first
  step. They hold DeepSpeed's fp32 master weights, optimizer state and gradients, the same
  for every method, and vary by about 0.5x from run to run with the allocator's state.

Peaks shorter than the 50 ms period can be missed. Other work on the machine changes the
timings, not these figures: PSS is memory. A run is not repeated. Exit code 0 whether or not
the targets are met; non-zero only when a run fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SAMPLE_PERIOD_S = 0.05
SETTLE_S = 0.5  # ranks pause this long at each phase boundary so the samples see the settled state
TARGETS = {3: 0.25, 2: 1.0}  # ZeRO-Pipe's transient with 4 ranks, as a multiple of the checkpoint size
EQUAL_X = 0.05  # transients closer than this are reported as equal (sampling and allocator noise)
METHODS = ("naive", "hf-zero3", "zeropipe")

# 361M parameters with the proportions of Llama-3-8B scaled down: MLP 3.5x wide, 4 query heads
# per KV head, the embedding (the largest tensor) 4.7% of the weights (Llama-3-8B 6.5%,
# Qwen2.5-14B 5.3%). The largest tensor sets a floor under ZeRO-3 here: zero.Init broadcasts
# each new parameter in full to every rank before partitioning it, so N-1 ranks briefly hold
# it. On GPUs that copy is in GPU memory; here the "GPU" is host RAM. --vocab-size 32000 gives
# small-model proportions (embedding 8.3%).
FULL_MODEL = {
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 16384,
}
QUICK_MODEL = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 16000,
}


# ---------------------------------------------------------------------------- rank side
class _ConstructedMark(logging.Handler):
    """Records when zeropipe's loader has constructed the model (its debug record), to split loading in two."""

    def __init__(self, events: dict[str, float]):
        super().__init__(logging.DEBUG)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("constructed"):
            self.events["constructed"] = record.created


def rank_main(args: argparse.Namespace) -> None:
    """One rank: load by ``args.method``, initialize DeepSpeed, one training step, timestamps in events.rank{r}.json."""
    import torch

    events: dict[str, float] = {}
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    out = Path(args.out)

    def mark(name: str) -> None:
        events[name] = time.time()

    logging.basicConfig(level=logging.WARNING)
    zeropipe_log = logging.getLogger("zeropipe")
    zeropipe_log.setLevel(logging.DEBUG)
    zeropipe_log.addHandler(_ConstructedMark(events))
    import deepspeed
    import deepspeed.comm as dist
    import safetensors  # noqa: F401
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM

    import zeropipe.models.loading  # noqa: F401
    from zeropipe.config.deepspeed import build_deepspeed_config
    from zeropipe.config.schema import RunConfig
    from zeropipe.families.causal_lm.model import build_model

    deepspeed.init_distributed(dist_backend="gloo")
    config = AutoConfig.from_pretrained(args.model)
    # Import the modeling code (about 80 MB per rank) before the baseline: it is a fixed cost of
    # every method, not part of any loading transient.
    with torch.device("meta"):
        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    run_config = RunConfig.model_validate(
        {
            "model": {"path": args.model},
            "train": {"max_steps": 1, "micro_batch_size": 1, "lr": 1e-4},
            "deepspeed": {"zero_stage": args.stage, "precision": args.precision},
        }
    )
    ds_config = build_deepspeed_config(run_config, world_size, total_steps=1, hidden_size=config.hidden_size).config
    torch.manual_seed(0)
    dist.barrier()
    mark("ready")
    time.sleep(SETTLE_S)
    mark("load_start")
    keep_alive = None
    if args.method == "hf-zero3" or (args.method == "zeropipe" and args.stage == 3):
        from transformers.integrations import HfDeepSpeedConfig

        keep_alive = HfDeepSpeedConfig(ds_config)  # noqa: F841 - transformers holds a weak reference
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.precision]
    if args.method == "zeropipe":
        model = build_model(run_config.model, config, args.precision, args.stage)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        if args.method == "naive" and args.stage == 3:
            # What deepspeed.initialize does first with a model built outside zero.Init; done
            # here so that its cost is counted with the loading it belongs to.
            deepspeed.zero.Init(module=model, config_dict_or_path=ds_config)
    model.config.use_cache = False
    mark("load_done")
    dist.barrier()
    mark("loaded")
    time.sleep(SETTLE_S)
    mark("init_start")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config)
    del model
    mark("init_done")
    dist.barrier()
    mark("initialized")
    time.sleep(SETTLE_S)
    engine.train()
    ids = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(rank))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    mark("step_done")
    dist.barrier()
    mark("stepped")
    time.sleep(SETTLE_S)
    mark("end")
    (out / f"events.rank{rank}.json").write_text(json.dumps(events))
    dist.barrier()


# ---------------------------------------------------------------------------- driver side
def save_model(directory: Path, shape: dict) -> int:
    """Save a randomly initialised Llama as bf16 safetensors; returns its bytes on disk."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if not any(directory.glob("*.safetensors")):
        torch.manual_seed(0)
        config = LlamaConfig(**shape, max_position_embeddings=512, tie_word_embeddings=False)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(directory, safe_serialization=True)
        del model
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    return size


def parameter_numels(directory: Path) -> list[int]:
    from zeropipe.models.checkpoint_index import CheckpointIndex

    index = CheckpointIndex(directory)
    return [index[name].numel for name in index]


def legitimate_bytes(numels: list[int], stage: int, ranks: int, itemsize: int = 2) -> int:
    """Bytes the loaded model occupies on the node: one partitioned copy (ZeRO-3, padded) or one copy per rank."""
    if stage == 3:
        return sum(-(-n // ranks) * ranks for n in numels) * itemsize
    return ranks * sum(numels) * itemsize


class Sampler(threading.Thread):
    """Samples the summed PSS of the rank processes (children of torchrun running this file with --rank)."""

    def __init__(self, launcher_pid: int):
        super().__init__(daemon=True)
        import psutil

        self.launcher = psutil.Process(launcher_pid)
        self.samples: list[tuple[float, int, int]] = []  # (time, summed PSS, ranks seen)
        self.stop = threading.Event()

    def run(self) -> None:
        import psutil

        while not self.stop.is_set():
            started = time.time()
            total = seen = 0
            try:
                children = self.launcher.children(recursive=True)
            except psutil.Error:
                break
            for child in children:
                try:
                    if "--rank" in child.cmdline():
                        total += child.memory_full_info().pss
                        seen += 1
                except psutil.Error:
                    continue
            self.samples.append((started, total, seen))
            self.stop.wait(max(0.0, SAMPLE_PERIOD_S - (time.time() - started)))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_case(model_dir: Path, stage: int, ranks: int, method: str, precision: str, work: Path, port: int) -> dict:
    out = work / f"{model_dir.name}_{precision}_z{stage}_n{ranks}_{method}"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(port),
        __file__, "--rank", "--model", str(model_dir), "--stage", str(stage), "--method", method, "--precision", precision, "--out", str(out),
    ]
    log = open(out / "log.txt", "w")
    started = time.time()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    sampler = Sampler(process.pid)
    sampler.start()
    code = process.wait()
    sampler.stop.set()
    sampler.join()
    log.close()
    if code != 0:
        raise RuntimeError(f"{out.name} failed with exit code {code}; see {out / 'log.txt'}:\n" + (out / "log.txt").read_text()[-3000:])
    events = [json.loads((out / f"events.rank{r}.json").read_text()) for r in range(ranks)]
    (out / "samples.json").write_text(json.dumps({"samples": sampler.samples, "events": events}))
    at = {name: max(e[name] for e in events) for name in events[0]}
    samples = [(t, pss) for t, pss, seen in sampler.samples if seen == ranks]

    def window(start: float, stop: float) -> list[int]:
        return [pss for t, pss in samples if start <= t <= stop] or [0]

    def mean(values: list[int]) -> float:
        return sum(values) / len(values)

    figures = {
        "fixed": mean(window(at["ready"], at["load_start"])),
        "peak_load": max(window(at["load_start"], at["loaded"])),
        "after_load": mean(window(at["loaded"], at["init_start"])),
        "peak_step": max(window(at["load_start"], at["stepped"])),
        "after_step": mean(window(at["stepped"], at["end"])),
        "load_s": at["load_done"] - at["load_start"],
        "wall_s": time.time() - started,
        "samples": len(samples),
    }
    if "constructed" in at:
        figures["peak_construct"] = max(window(at["load_start"], at["constructed"]))
        figures["construct_s"] = at["constructed"] - at["load_start"]
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, 1 and 2 ranks")
    parser.add_argument("--workdir", type=Path, help="keep the saved model and the logs here (default: a temporary directory)")
    parser.add_argument("--ranks", type=int, nargs="*", help="rank counts to run (default 1 2 4; --quick: 1 2)")
    parser.add_argument("--stages", type=int, nargs="*", default=[3, 2])
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"], help="training precision (the checkpoint is bf16 either way)")
    parser.add_argument("--vocab-size", type=int, help="vocabulary of the saved model (default 16384; --quick 16000)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        rank_main(args)
        return 0

    ranks_list = args.ranks or ([1, 2] if args.quick else [1, 2, 4])
    with tempfile.TemporaryDirectory(prefix="init_ram_") as tmp:
        work = args.workdir or Path(tmp)
        shape = dict(QUICK_MODEL if args.quick else FULL_MODEL)
        if args.vocab_size:
            shape["vocab_size"] = args.vocab_size
        model_dir = work / f"{'quick' if args.quick else 'model'}_v{shape['vocab_size']}"
        disk = save_model(model_dir, shape)
        numels = parameter_numels(model_dir)
        params = sum(numels)
        largest = max(numels) * 2 / disk
        print(
            f"model: {params / 1e6:.0f}M parameters, checkpoint {disk / 2**20:.0f} MiB (bf16 safetensors), "
            f"largest tensor {largest:.3f}x of it; training precision {args.precision}"
        )
        print("figures: summed PSS of the ranks, as multiples of the checkpoint size\n")
        header = (
            f"{'stage':>5} {'ranks':>5} {'method':>9} | {'fixed':>6} {'model':>6} {'TRANSIENT':>9} | {'after load':>10} "
            f"{'peak to step 1':>14} {'after step 1':>12} | {'load s':>6}"
        )
        print(header)
        print("-" * len(header))
        results = []
        for stage in args.stages:
            for ranks in ranks_list:
                for method in args.methods:
                    figures = run_case(model_dir, stage, ranks, method, args.precision, work, free_port())
                    model_bytes = legitimate_bytes(numels, stage, ranks, itemsize=2 if args.precision == "bf16" else 4)
                    fixed = figures["fixed"]
                    row = {
                        "stage": stage,
                        "ranks": ranks,
                        "method": method,
                        "fixed_x": fixed / disk,
                        "model_x": model_bytes / disk,
                        # What the loaded model occupies: its bytes, or less when a method leaves the
                        # weights as shared mappings of the file (counted once on the node by PSS).
                        "transient_x": (figures["peak_load"] - fixed - min(model_bytes, figures["after_load"] - fixed)) / disk,
                        "after_load_x": (figures["after_load"] - fixed) / disk,
                        "peak_step_x": (figures["peak_step"] - fixed) / disk,
                        "after_step_x": (figures["after_step"] - fixed) / disk,
                        "load_s": figures["load_s"],
                        "wall_s": figures["wall_s"],
                        "samples": figures["samples"],
                    }
                    if "peak_construct" in figures and stage == 3:
                        row["construct_transient_x"] = (figures["peak_construct"] - fixed - model_bytes) / disk
                        row["construct_s"] = figures["construct_s"]
                    results.append(row)
                    print(
                        f"{stage:>5} {ranks:>5} {method:>9} | {row['fixed_x']:>6.2f} {row['model_x']:>6.2f} {row['transient_x']:>9.2f} | "
                        f"{row['after_load_x']:>10.2f} {row['peak_step_x']:>14.2f} {row['after_step_x']:>12.2f} | "
                        f"{row['load_s']:>6.1f}",
                        flush=True,
                    )
        print()
        print("fixed: summed PSS before loading; model: the loaded model's own bytes (ZeRO-3: one partitioned copy, ZeRO-2: one per rank);")
        print("TRANSIENT: peak while loading - fixed - min(model, after load); after load: settled PSS once loaded, above fixed;")
        print("peak to step 1 / after step 1: above fixed, with DeepSpeed's fp32 master weights, optimizer state, gradients and")
        print("activations: the same for every method, give or take the allocator (they vary by about 0.5x from run to run).")
        for row in results:
            if "construct_transient_x" in row:
                print(
                    f"zeropipe ZeRO-3 {row['ranks']} rank(s): construction under zero.Init alone peaks {row['construct_transient_x']:.2f}x "
                    f"above fixed + model ({row['construct_s']:.1f}s of the {row['load_s']:.1f}s of loading)"
                )
        print()
        top = max(ranks_list)
        for stage, target in TARGETS.items():
            rows = {r["method"]: r for r in results if r["stage"] == stage and r["ranks"] == top}
            if "zeropipe" not in rows:
                continue
            ours = rows["zeropipe"]["transient_x"]
            others = {m: rows[m]["transient_x"] for m in ("naive", "hf-zero3") if m in rows}
            versus = ", ".join(
                f"{m} {o:.2f}x ({'below' if ours < o - EQUAL_X else 'equal' if ours <= o + EQUAL_X else 'ABOVE'})" for m, o in others.items()
            )
            verdict = "met" if ours <= target and all(ours < o - EQUAL_X for o in others.values()) else "NOT met"
            print(f"ZeRO-{stage}, {top} ranks: zeropipe TRANSIENT {ours:.2f}x, target <= {target}x; against {versus}: {verdict}")
        if args.json:
            summary = {"parameters": params, "checkpoint_bytes": disk, "shape": shape, "precision": args.precision, "results": results}
            args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
