"""Diffusion caches: the cached step against the denoiser alone, host RAM with and without the caches, real models' FLOPs.

    .venv/bin/python benchmarks/diffusion_cache.py                          # 5 runs of 40 steps + 40 trainer/denoiser pairs: 6-10 min on 2 idle CPU cores
    .venv/bin/python benchmarks/diffusion_cache.py --steps 10 --warmup 3 --repeats 1 --pairs 10    # smoke run

The model, data and settings are examples/diffusion-quickstart.yaml's (tiny SDXL-layout
pipeline built from config, generated shape images with captions, 2 CPU ranks, ZeRO-2,
its precision), read from that file so the benchmark follows it. Every run trains the same steps
with the same seed and batch shape, through ``zeropipe train`` as a user runs it:

* fill: caches on, empty cache folder. The ranks encode the images (VAE) and captions (text
  encoders), free the encoders, then train. Its caching time is reported on its own.
* on-N: caches on, reusing the filled folder. The training ranks load no VAE and no text
  encoder: every metrics row must say ``frozen_components_loaded == []``, and the run's
  cache plan must list nothing missing, or the script stops.
* off-N: ``data.cache.latents: false`` and ``data.cache.text: false``, with a cache folder
  of their own (a shared one would hand them the caption embeddings the cached runs wrote:
  ``text_condition`` reads an existing text entry whatever ``data.cache.text`` says). The
  ranks hold the VAE and the text encoders and encode every micro-batch; every metrics row
  must say so.

The measured runs go in ABBA order (off, on, on, off, ...) so that slow drift of a shared
machine cancels. Figures, per run:

* steps/s: 1 / the median of rank 0's ``step_time_s`` over the steps after the warm-up;
* host RAM of the training ranks: the largest per-rank ``host_rss_bytes`` in metrics.jsonl
  (RSS at the end of each step), and this script's own sampling of the rank processes every
  SAMPLE_SECONDS (RSS of the largest rank and PSS summed over the ranks, from
  /proc/PID/smaps_rollup) from the ranks' start to the end of the last training step, which
  also catches peaks between steps and during setup (where the encoders are loaded).

No sample images are drawn (``generate.prompts: []``) and the demo's VAE fitting
(``model.config.vae_fit_steps``) is left out: neither is training. The RAM window ends at the
last training step, so the final checkpoint is not in the figures. The supervisor's own per-rank
peak (``status.json``, sampled once a second over the whole run)
is printed for comparison.

After the runs, the script times in its own process (one thread, as a rank) what an uncached
rank adds to a micro-batch: reading and VAE-encoding its images and encoding its captions,
one call each for the micro-batch as ``DiffusionTask`` does, against reading the cache entries. Added to the
cached step time this gives the ratio to expect.

Then, in one 2-rank job on a copy of a cached run (``denoiser_rank``), it times the trainer's
cached step against the denoiser alone on the same inputs, interleaved (target: <= 1.05).
Last, for real hardware, it counts the FLOPs of the encoders and denoisers of real SDXL and
Wan 2.1 (built on the meta device from the catalog's configs) and predicts the speed-up of
caching from them (``real_model_flops``).

Losses of the first steps are compared across all runs: caches change where latents and
embeddings come from, not their values, so every run must train identically. Exit code 0
whether or not the target is met; non-zero when a run fails or a check above does not hold.
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
import threading
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import ForeignLoad, wait_for_quiet  # noqa: E402 - the same "other processes" figure as the overhead benchmark

OVERHEAD_TARGET = 1.05  # cached trainer step / denoiser-only step, measured in one run (issue 20)
QUIET_CORES = 0.1
SAMPLE_SECONDS = 0.1
LOSS_STEPS = 10
LOSS_TOLERANCE = 1e-4  # relative
QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "diffusion-quickstart.yaml"
MIB = 2**20
# --sdxl-vae: SDXL's own VAE layout (4 levels of 2 blocks, 8x downsampling; widths 128-512 in
# SDXL) at a quarter of its widths, in place of the preset's 2-level VAE. Fitting it to
# reconstruct shapes takes far longer than the quickstart can spend, so the demo keeps the small one.
SDXL_VAE = {
    "block_out_channels": [32, 64, 128, 128], "layers_per_block": 2,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
}
SDXL_VAE_RESOLUTION, SDXL_VAE_BUCKET_STEP = 64, 16  # 8x8 latents; bucket sides a multiple of 8 (VAE) x 2 (UNet)


def bench_config(work: Path, caches: bool, steps: int, resolution: int, micro_batch: int, sdxl_vae: bool = False) -> dict:
    """The quickstart's config for one mode; run.name is given on the command line."""
    config = yaml.safe_load(QUICKSTART.read_text())
    config["run"]["output_dir"] = str(work / "runs")
    data = config["data"]
    data["images"]["resolution"] = resolution
    if sdxl_vae:
        config["model"]["config"]["vae"] = dict(SDXL_VAE)
        data["images"]["bucket_step"] = SDXL_VAE_BUCKET_STEP
    data["cache"] = {"latents": caches, "text": caches, "dir": str(work / ("cache-on" if caches else "cache-off"))}
    train = config["train"]
    train.update(max_steps=steps, micro_batch_size=micro_batch, gradient_accumulation_steps=1, log_every=steps)
    train.pop("save_every", None)  # a mid-run checkpoint would land in the next step's step_time_s
    config["generate"] = {"prompts": []}  # no sample images
    config["model"]["config"].pop("vae_fit_steps", None)  # makes the demo's samples readable; not training
    return config


class RankMemory:
    """Samples RSS and PSS of a launcher's rank processes (``zeropipe.launch.rank``) in a thread."""

    def __init__(self, launcher_pid: int):
        self.launcher_pid = launcher_pid
        self.samples: list[tuple[float, list[int], list[int]]] = []  # (time, rss per rank, pss per rank)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.thread.join()

    def loop(self) -> None:
        import psutil

        ranks: list[int] = []
        while not self.stopped.is_set():
            if len(ranks) < 2:  # the ranks appear a few seconds after the launcher starts
                try:
                    children = psutil.Process(self.launcher_pid).children(recursive=True)
                    ranks = sorted(p.pid for p in children if "zeropipe.launch.rank" in " ".join(p.cmdline()))
                except psutil.Error:
                    ranks = []
            rss, pss = [], []
            for pid in ranks:
                fields = smaps_rollup(pid)
                if fields:
                    rss.append(fields["Rss"])
                    pss.append(fields["Pss"])
            if rss:
                self.samples.append((time.time(), rss, pss))
            self.stopped.wait(SAMPLE_SECONDS)

    def peaks(self, until: float) -> dict:
        window = [s for s in self.samples if s[0] <= until]
        return {
            "rank_rss_peak": max((max(rss) for _, rss, _ in window), default=0),
            "pss_sum_peak": max((sum(pss) for _, _, pss in window), default=0),
            "samples": len(window),
        }


def smaps_rollup(pid: int) -> dict[str, int] | None:
    """Rss and Pss of a process in bytes (Linux); None once it has exited."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    fields = {}
    for line in text.splitlines()[1:]:
        name, _, value = line.partition(":")
        if name in ("Rss", "Pss"):
            fields[name] = int(value.split()[0]) * 1024
    return fields if len(fields) == 2 else None


def run_train(config: dict, name: str, work: Path) -> dict:
    """``zeropipe train`` on one config, its rank processes sampled; the run's figures."""
    config_path = work / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    zeropipe = Path(sys.executable).with_name("zeropipe")
    log = work / f"{name}.log"
    started = time.time()
    with open(log, "w") as handle, ForeignLoad() as load:
        command = [str(zeropipe), "train", str(config_path), f"run.name={name}"]
        proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        with RankMemory(proc.pid) as memory:
            code = proc.wait()
    wall = time.time() - started
    if code != 0:
        sys.exit(f"zeropipe train failed for {name} (exit {code}); its output:\n{log.read_text()[-4000:]}")
    run_dir = Path(config["run"]["output_dir"]) / name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if row.get("kind") is None]  # training steps only
    status = json.loads((run_dir / "status.json").read_text())
    plan = json.loads((run_dir / "data" / "diffusion.json").read_text())
    first_step_start = rows[0]["time"] - rows[0]["step_time_s"]
    return {
        "name": name,
        "caches": config["data"]["cache"]["latents"],
        "run_dir": run_dir,
        "wall": wall,
        "foreign": load.cores,
        "step_time": [row["step_time_s"] for row in rows],
        "samples_per_s": [row["samples_per_s"] for row in rows],
        "loss": [row["loss"] for row in rows],
        "frozen": [row.get("frozen_components_loaded") for row in rows],
        "metrics_rss_peak": max(max(row["host_rss_bytes"]) for row in rows),
        "supervisor_rss_peak": max(status.get("rank_rss_peak_bytes") or [0]),
        # From the ranks' start to the end of the last training step: no end-of-run sample or checkpoint.
        "sampled": memory.peaks(until=rows[-1]["time"]),
        "setup_s": first_step_start - status["started_at"],
        "missing": (len(plan["missing_latents"]), len(plan["missing_texts"])),
    }


def check_run(result: dict, expect_loaded: list[str]) -> list[str]:
    problems = []
    wrong = [step for step, frozen in enumerate(result["frozen"], 1) if frozen != expect_loaded]
    if wrong:
        problems.append(
            f"{result['name']}: frozen_components_loaded is not {expect_loaded} at {len(wrong)} step(s), "
            f"first step {wrong[0]}: {result['frozen'][wrong[0] - 1]}"
        )
    if result["name"].startswith("on-") and result["missing"] != (0, 0):
        latents, captions = result["missing"]
        problems.append(f"{result['name']}: the cache plan lists {latents} latent(s) and {captions} caption(s) missing; the reuse run encoded again")
    return problems


def cache_entries(cache_dir: Path) -> tuple[int, float]:
    """Number of cache entries and the seconds from the first written to the last."""
    times = [p.stat().st_mtime for kind in ("latents", "text") for p in (cache_dir / kind).rglob("*.safetensors")]
    return len(times), (max(times) - min(times)) if times else 0.0


def encoder_breakdown(off_run: Path, on_run: Path, micro_batch: int, repeats: int = 7) -> dict[str, float]:
    """Seconds per micro-batch of what an uncached rank adds, timed in this process on one thread as a rank runs.

    The inputs of one micro-batch (one bucket) are prepared the way DiffusionTask does it:
    uncached, the images read and VAE-encoded in one call and the captions encoded in one
    call; cached, one latent and one text entry read per image. The same work as one call
    per image or caption is timed too, for comparison.
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # the ranks' logs take these warnings; this output should not
    import torch
    import transformers

    from zeropipe.families.diffusion import cache
    from zeropipe.data.images import load_image_for_bucket
    from zeropipe.families.diffusion.entries import architecture_named
    from zeropipe.families.diffusion.pipelines import encode_prompts, load_component, text_pipeline

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    off_plan = json.loads((off_run / "data" / "diffusion.json").read_text())
    on_plan = json.loads((on_run / "data" / "diffusion.json").read_text())
    arch = architecture_named(off_plan["architecture"])
    pipeline_dir, device = Path(off_plan["pipeline_dir"]), torch.device("cpu")
    bucket = off_plan["buckets"][0]
    batch = [i for i, b in enumerate(off_plan["buckets"]) if b == bucket][:micro_batch]
    paths = [Path(off_plan["items"][i]["path"]) for i in batch]
    captions = [off_plan["items"][i]["caption"] for i in batch]
    vae = load_component(pipeline_dir, "vae", torch.float32, device)
    encoders = text_pipeline(pipeline_dir, arch, torch.float32, device)
    cache_dir = Path(on_plan["cache_dir"])

    def images():
        return [load_image_for_bucket(path, tuple(bucket), crop="center").pixels for path in paths]

    def timed(work) -> float:
        work()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def read_entries():
        for i in batch:
            cache.load_entry(cache_dir, "latents", on_plan["latent_keys"][i][0])
            cache.load_entry(cache_dir, "text", on_plan["text_keys"][on_plan["items"][i]["caption"]])

    return {
        "images": timed(images),
        "vae_each": timed(lambda: [cache.encode_latent_distribution(vae, pixels[None]) for pixels in images()]),
        "vae_batch": timed(lambda: cache.encode_latent_distribution(vae, torch.stack(images()))),
        "text_each": timed(lambda: [encode_prompts(encoders, arch, [caption], device) for caption in captions]),
        "text_batch": timed(lambda: encode_prompts(encoders, arch, captions, device)),
        "entries": timed(read_entries),
    }


def median_step(result: dict, warmup: int) -> float:
    return statistics.median(result["step_time"][warmup:])


def mib(value: float) -> str:
    return f"{value / MIB:7.1f}"


CATALOG = Path(__file__).resolve().parent.parent / "src" / "zeropipe" / "plan" / "catalog"


def real_model_flops() -> list[dict]:
    """FLOPs per training sample of real SDXL and Wan 2.1: encoders against the denoiser.

    Each model is built from its published component configs (``zeropipe/plan/catalog``) on
    the meta device (no weights, no download, nothing allocated) and counted with torch's
    FlopCounterMode: SDXL at 1024 px with 77-token captions, Wan 2.1 (1.3B and 14B) at 81
    frames of 832x480 with 512-token captions. The denoiser is counted twice: a full
    fine-tune (forward and backward, weight gradients included) and with its weights frozen
    (forward and the backward to the inputs only: what a LoRA step costs, its small adapters
    aside).
    """
    import diffusers
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    def counted(work) -> float:
        with FlopCounterMode(display=False) as counter:
            work()
        return counter.get_total_flops()

    def empty(*shape, dtype=torch.float32, grad=False):
        return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)

    def denoiser(call, model) -> tuple[float, float]:
        full = counted(lambda: call().sum().backward())
        model.requires_grad_(False)
        frozen = counted(lambda: call().sum().backward())
        return full, frozen

    def component(entry: dict, library) -> Any:
        config = {key: value for key, value in entry["config"].items() if key != "architectures"}
        if library is diffusers:
            return getattr(diffusers, entry["class"]).from_config(config)
        model_config = transformers.AutoConfig.for_model(**config)
        return getattr(transformers, entry["class"])(model_config)

    rows = []
    sdxl = json.loads((CATALOG / "sdxl.json").read_text())
    with torch.device("meta"):
        unet = component(sdxl["trained"], diffusers)
        frozen = {entry["name"].split(" ")[0]: component(entry, diffusers if entry["library"] == "diffusers" else transformers) for entry in sdxl["frozen"]}
    side = sdxl["resolution"]
    frozen_bytes = 4 * sum(p.numel() for part in frozen.values() for p in part.parameters())
    vae = counted(lambda: frozen["vae"].encode(empty(1, 3, side, side)))
    captions = torch.zeros(1, 77, dtype=torch.long, device="meta")
    text = counted(lambda: [frozen[name](input_ids=captions) for name in ("text_encoder", "text_encoder_2")])
    full, lora = denoiser(
        lambda: unet(
            empty(1, 4, side // 8, side // 8, grad=True), empty(1), encoder_hidden_states=empty(1, 77, 2048),
            added_cond_kwargs={"text_embeds": empty(1, 1280), "time_ids": empty(1, 6)},
        ).sample,
        unet,
    )
    rows.append({"model": "SDXL 1024 px", "vae": vae, "text": text, "full": full, "lora": lora, "frozen_bytes": frozen_bytes})
    frames, height, width = 81, 480, 832

    def wan(name: str) -> dict:
        entry = json.loads((CATALOG / f"{name}.json").read_text())
        with torch.device("meta"):
            transformer = component(entry["trained"], diffusers)
            frozen = {item["name"].split(" ")[0]: component(item, diffusers if item["library"] == "diffusers" else transformers) for item in entry["frozen"]}
        frozen_bytes = 4 * sum(p.numel() for part in frozen.values() for p in part.parameters())
        vae = counted(lambda: frozen["vae"].encode(empty(1, 3, frames, height, width)))
        text = counted(lambda: frozen["text_encoder"](input_ids=torch.zeros(1, 512, dtype=torch.long, device="meta")))
        latent = (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
        full, lora = denoiser(lambda: transformer(empty(*latent, grad=True), empty(1), empty(1, 512, 4096)).sample, transformer)
        return {"model": f"{entry['name']} 81x832x480", "vae": vae, "text": text, "full": full, "lora": lora, "frozen_bytes": frozen_bytes}

    rows += [wan(name) for name in ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b")]
    return rows


def denoiser_rank(run_dir: Path, out: Path, pairs: int, warmup: int) -> None:
    """One rank of a torchrun job on a copy of a cached run: the trainer's step against the denoiser alone.

    The rank builds the run's ``Trainer`` as ``zeropipe.launch.rank`` does (same DeepSpeed
    engine, caches, seed), then alternates, in ABBA order within each pair:

    * trainer step: ``Trainer.train_step`` (next micro-batch from the task's own iterator:
      cache entries read, latents drawn, noise and timesteps drawn, denoiser forward,
      backward, optimizer step) and ``record_metrics`` (the per-step gather of every rank's
      figures and rank 0's metrics row), everything the training loop does per step;
    * denoiser alone: the same micro-batch's denoiser inputs, prepared beforehand and held in
      memory, through the same engine: forward (the architecture's ``predict``), loss,
      backward, optimizer step.
    """
    from zeropipe.families.diffusion.objectives import weighted_mse
    from zeropipe.engine.trainer import Trainer
    from zeropipe.families import family_of
    from zeropipe.rundir import RunDir

    trainer = Trainer(run_dir, family_of(RunDir(run_dir).read_config().model).rank_task)
    trainer.setup()
    task, engine = trainer.task, trainer.engine
    engine.train()
    drawn: list[list[int]] = []

    def recorded(batches):
        for epoch, indices in batches:
            drawn.append(indices)
            yield epoch, indices

    batches = recorded(task.batches(0))

    def trainer_step() -> float:
        started = time.perf_counter()
        epoch, loss, lr, tokens, samples = trainer.train_step(batches)
        trainer.record_metrics(epoch, loss, lr, tokens, samples, max(time.perf_counter() - started, 1e-9))
        return time.perf_counter() - started

    def denoiser_step(inputs) -> float:
        model_input, timesteps, condition, target, weights = inputs
        started = time.perf_counter()
        loss = weighted_mse(task.predict(model_input, timesteps, condition), target, weights)
        engine.backward(loss)
        engine.step()
        loss.detach().float().item()  # the trainer's step reads its loss too
        return time.perf_counter() - started

    def prepared(indices):
        latents, condition = task.assemble(indices)
        noised = task.objective.noise(latents)
        return noised.model_input, noised.timesteps, condition, noised.target, noised.weights

    times = {"trainer": [], "denoiser": []}
    for pair in range(warmup + pairs):
        # The denoiser-only step trains on the micro-batch the trainer step before it drew
        # (same bucket shape); in odd pairs it goes first, on the inputs of the last pair.
        if pair % 2 == 0 or not drawn:
            a = trainer_step()
            b = denoiser_step(prepared(drawn[-1]))
        else:
            b = denoiser_step(prepared(drawn[-1]))
            a = trainer_step()
        if pair >= warmup:
            times["trainer"].append(a)
            times["denoiser"].append(b)
    out.write_text(json.dumps({"rank": trainer.rank, **times}))
    import deepspeed.comm as dist

    dist.barrier()
    dist.destroy_process_group()


def denoiser_only(cached_run: Path, work: Path, pairs: int, warmup: int) -> dict:
    """Run :func:`denoiser_rank` on 2 ranks (torchrun) on a copy of a cached run directory."""
    from zeropipe.launch.supervisor import free_port

    run_dir = work / "denoiser-only"
    shutil.copytree(cached_run, run_dir, ignore=shutil.ignore_patterns("checkpoints", ".owner.lock", "samples"))
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    world = 2
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)), PYTHONUNBUFFERED="1")
    log = work / "denoiser-only.log"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", str(free_port()),
        __file__, "--denoiser-rank", str(run_dir), "--pairs", str(pairs), "--warmup", str(warmup),
    ]  # fmt: skip
    with open(log, "w") as handle, ForeignLoad() as load:
        code = subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        sys.exit(f"the denoiser-only measurement failed (exit {code}); its output:\n{log.read_text()[-6000:]}")
    ranks = [json.loads((run_dir / f"denoiser-rank{rank}.json").read_text()) for rank in range(world)]
    return {"trainer": ranks[0]["trainer"], "denoiser": ranks[0]["denoiser"], "foreign": load.cores}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the medians (default 5)")
    parser.add_argument("--repeats", type=int, default=2, help="uncached/cached pairs after the fill run, in ABBA order (default 2)")
    parser.add_argument("--resolution", type=int, default=None, help="image side in pixels (default: the quickstart's, 32; 64 with --sdxl-vae)")
    parser.add_argument("--micro-batch", type=int, default=None, help="images per rank per step (default: the quickstart's, 8)")
    parser.add_argument(
        "--sdxl-vae", action="store_true", help="SDXL's VAE layout (8x downsampling) at a quarter of its widths instead of the preset's small VAE"
    )
    parser.add_argument(
        "--quiet-wait", type=float, default=0, metavar="SECONDS", help="before each run, wait up to this long for other cores to go idle"
    )
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="where configs, caches and run directories go (default: a temporary directory, removed at the end)"
    )
    parser.add_argument("--pairs", type=int, default=40, help="trainer-step / denoiser-only pairs timed in one run (default 40)")
    parser.add_argument("--denoiser-rank", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.denoiser_rank:
        denoiser_rank(args.denoiser_rank, args.denoiser_rank / f"denoiser-rank{os.environ['RANK']}.json", args.pairs, args.warmup)
        return 0
    if args.steps - args.warmup < 5:
        parser.error("--steps must exceed --warmup by at least 5")

    quickstart = yaml.safe_load(QUICKSTART.read_text())
    resolution = args.resolution or (SDXL_VAE_RESOLUTION if args.sdxl_vae else quickstart["data"]["images"]["resolution"])
    micro_batch = args.micro_batch or quickstart["train"]["micro_batch_size"]
    work = (args.out_dir or Path(tempfile.mkdtemp(prefix="zeropipe-diffusion-cache-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if (work / "runs").exists():
        parser.error(f"{work}/runs already exists: pass an empty --out-dir")
    on, off = (bench_config(work, caches, args.steps, resolution, micro_batch, args.sdxl_vae) for caches in (True, False))

    print(
        f"diffusion cache benchmark: {quickstart['model']['config']['pipeline']}{' with an SDXL-layout VAE' if args.sdxl_vae else ''} from {QUICKSTART.name}, ZeRO-{on['deepspeed']['zero_stage']} "
        f"{on['deepspeed']['precision']}, {on['hardware']['gpus']} CPU ranks ({os.cpu_count()} cores), "
        f"{on['data']['synthetic']['examples']} images at {resolution}px, micro-batch {micro_batch} per rank, "
        f"{args.steps} steps per run (first {args.warmup} left out), {args.repeats} repeat(s)",
        flush=True,
    )
    print(f"work directory: {work}", flush=True)
    order = [("on", "fill")]
    for repeat in range(1, args.repeats + 1):
        pair = [("off", f"off-{repeat}"), ("on", f"on-{repeat}")]
        order += pair if repeat % 2 else pair[::-1]
    results = []
    problems = []
    started = time.time()
    for mode, name in order:
        if args.quiet_wait:
            before = wait_for_quiet(args.quiet_wait)
            if before >= QUIET_CORES:
                print(f"  (machine still busy after waiting {args.quiet_wait:.0f} s: {before:.2f} cores used by others)", flush=True)
        result = run_train(on if mode == "on" else off, name, work)
        results.append(result)
        problems += check_run(result, [] if mode == "on" else ["vae", "text_encoders"])
        step = median_step(result, args.warmup)
        print(
            f"  {name:<6} {1 / step:6.2f} steps/s  (median step {step * 1e3:6.1f} ms)  rank RSS peak {mib(result['sampled']['rank_rss_peak'])} MiB  "
            f"setup {result['setup_s']:5.1f} s  wall {result['wall']:4.0f} s  other processes {result['foreign']:.2f} cores",
            flush=True,
        )
        if name == "fill":
            entries, span = cache_entries(Path(on["data"]["cache"]["dir"]))
            fill = {"entries": entries, "span": span, "missing": result["missing"]}

    # ------------------------------------------------------------------ checks
    reference = results[0]["loss"][:LOSS_STEPS]
    worst = max(abs(a - b) / max(abs(b), 1e-12) for r in results for a, b in zip(r["loss"][:LOSS_STEPS], reference))
    print(f"\nlosses of the first {LOSS_STEPS} steps (fill): {' '.join(f'{v:.4f}' for v in reference)}")
    agree = "yes" if worst <= LOSS_TOLERANCE else "NO"
    print(f"losses agree across all runs, cached and uncached: {agree} (largest relative difference {worst:.2e})")
    for problem in problems:
        print(f"CHECK FAILED: {problem}")
    if not problems:
        print("frozen_components_loaded: [] at every step of every cached run; ['vae', 'text_encoders'] at every step of every uncached run")

    # ------------------------------------------------------------------ caching time
    setup_on = statistics.median(r["setup_s"] for r in results if r["name"].startswith("on-"))
    first = results[0]
    print(
        f"\ncaching (fill run): {fill['missing'][0]} images and {fill['missing'][1]} captions encoded by {on['hardware']['gpus']} ranks into "
        f"{fill['entries']} entries; entries written over {fill['span']:.1f} s; rank setup {first['setup_s']:.1f} s against {setup_on:.1f} s "
        f"when reusing -> caching cost {first['setup_s'] - setup_on:.1f} s (wall {first['wall']:.0f} s against "
        f"{statistics.median(r['wall'] for r in results if r['name'].startswith('on-')):.0f} s)"
    )

    # ------------------------------------------------------------------ table
    print(f"\nper run (rank 0 step times; RAM of the training ranks, MiB; sampled = every {SAMPLE_SECONDS:g} s from rank start to the last step):")
    header = f"  {'run':<7}{'caches':<8}{'steps/s':>8}{'samples/s':>10}{'RSS/rank':>10}{'RSS/rank':>10}{'PSS':>9}{'RSS/rank':>11}{'others':>8}"
    print(header)
    print(f"  {'':<7}{'':<8}{'median':>8}{'median':>10}{'metrics':>10}{'sampled':>10}{'sum':>9}{'superv.*':>11}{'cores':>8}")
    for r in results:
        caches = "fill" if r["name"] == "fill" else ("on" if r["caches"] else "off")
        print(
            f"  {r['name']:<7}{caches:<8}{1 / median_step(r, args.warmup):8.2f}{statistics.median(r['samples_per_s'][args.warmup:]):10.1f}"
            f"{mib(r['metrics_rss_peak']):>10}{mib(r['sampled']['rank_rss_peak']):>10}{mib(r['sampled']['pss_sum_peak']):>9}"
            f"{mib(r['supervisor_rss_peak']):>11}{r['foreign']:8.2f}"
        )
    print("  * status.json rank_rss_peak_bytes: whole run, end-of-run sample included (not used below)")

    # ------------------------------------------------------------------ ratios
    print("\ncached / uncached, per repeat:")
    ratios = []
    for repeat in range(1, args.repeats + 1):
        cached = next(r for r in results if r["name"] == f"on-{repeat}")
        uncached = next(r for r in results if r["name"] == f"off-{repeat}")
        ratio = median_step(uncached, args.warmup) / median_step(cached, args.warmup)
        paired = statistics.median(b / a for a, b in zip(cached["step_time"][args.warmup :], uncached["step_time"][args.warmup :]))
        ratios.append(ratio)
        print(
            f"  repeat {repeat}: steps/s ratio {ratio:.2f}   paired per-step ratio {paired:.2f}   "
            f"(other processes: {cached['foreign']:.2f} / {uncached['foreign']:.2f} cores)"
        )
    measured_on = [r for r in results if r["name"].startswith("on-")]
    measured_off = [r for r in results if r["name"].startswith("off-")]
    pooled_on = statistics.median(v for r in measured_on for v in r["step_time"][args.warmup :])
    pooled_off = statistics.median(v for r in measured_off for v in r["step_time"][args.warmup :])

    def highest(runs: list[dict], key: str) -> float:
        return max(r[key] if key in r else r["sampled"][key] for r in runs)

    print(f"\n  {'':<36}{'uncached':>10}{'cached':>10}{'ratio / saved':>16}")
    print(f"  {'steps/s (median of all steps)':<36}{1 / pooled_off:10.2f}{1 / pooled_on:10.2f}{pooled_off / pooled_on:13.2f}x")
    quiet_on = [v for r in measured_on if r["foreign"] < QUIET_CORES for v in r["step_time"][args.warmup :]]
    quiet_off = [v for r in measured_off if r["foreign"] < QUIET_CORES for v in r["step_time"][args.warmup :]]
    if quiet_on and quiet_off:
        quiet_runs = ", ".join(r["name"] for r in measured_on + measured_off if r["foreign"] < QUIET_CORES)
        on_s, off_s = statistics.median(quiet_on), statistics.median(quiet_off)
        label = "steps/s, quiet runs only"
        print(f"  {label:<36}{1 / off_s:10.2f}{1 / on_s:10.2f}{off_s / on_s:13.2f}x   ({quiet_runs}: other processes < {QUIET_CORES} cores)")
    memory_figures = (
        ("peak RSS per rank, metrics (MiB)", "metrics_rss_peak"),
        ("peak RSS per rank, sampled (MiB)", "rank_rss_peak"),
        ("peak PSS, both ranks (MiB)", "pss_sum_peak"),
    )
    for label, key in memory_figures:
        high_off, high_on = highest(measured_off, key), highest(measured_on, key)
        print(f"  {label:<36}{mib(high_off):>10}{mib(high_on):>10}{mib(high_off - high_on):>10} MiB ({(high_off - high_on) / high_off * 100:4.1f}%)")
    # ------------------------------------------------------------------ where the time goes
    parts = encoder_breakdown(measured_off[0]["run_dir"], measured_on[0]["run_dir"], micro_batch)
    added = parts["vae_batch"] + parts["text_batch"] - parts["entries"]
    each = parts["vae_each"] + parts["text_each"] - parts["entries"]
    print(f"\nwhere an uncached step's extra time goes (a micro-batch of {micro_batch} images, timed after the runs here, on 1 thread as a rank):")
    rows = (
        ("read + VAE-encode the images in one call, as the trainer does", parts["vae_batch"],
         f"(images read alone {parts['images'] * 1e3:.1f} ms; one VAE call per image {parts['vae_each'] * 1e3:.1f} ms)"),
        ("text encoders, all captions in one call, as the trainer does", parts["text_batch"], f"(one call per caption {parts['text_each'] * 1e3:.1f} ms)"),
        (f"cached instead: read {micro_batch} latent and {micro_batch} text entries", parts["entries"], ""),
    )
    for label, seconds, note in rows:
        print(f"  {label:<58}{seconds * 1e3:7.1f} ms   {note}")
    print(
        f"  -> added per step {added * 1e3:.1f} ms on a cached step of {pooled_on * 1e3:.1f} ms: expected ratio {1 + added / pooled_on:.2f}x "
        f"({1 + each / pooled_on:.2f}x if the uncached path encoded one image and one caption per call)"
    )

    # ------------------------------------------------------------------ (a) the trainer's step against the denoiser alone
    alone = denoiser_only(measured_on[0]["run_dir"], work, args.pairs, args.warmup)
    trainer_s, denoiser_s = statistics.median(alone["trainer"]), statistics.median(alone["denoiser"])
    paired = sorted(a / b for a, b in zip(alone["trainer"], alone["denoiser"]))
    quartiles = statistics.quantiles(paired, n=4)
    overhead = trainer_s / denoiser_s
    print(
        f"\ncached trainer step against the denoiser alone, in one run ({args.pairs} interleaved pairs on 2 ranks after {args.warmup} warm-up pairs, "
        f"a copy of {measured_on[0]['name']}; other processes {alone['foreign']:.2f} cores):"
    )
    print(f"  trainer step (data from the caches, noise, denoiser forward + backward + optimizer step, metrics row)  median {trainer_s * 1e3:7.1f} ms")
    print(f"  denoiser alone (the same micro-batches' inputs held in memory: forward + backward + optimizer step)     median {denoiser_s * 1e3:7.1f} ms")
    print(
        f"  -> ratio of the medians {overhead:.3f}; per-pair ratios median {statistics.median(paired):.3f}, "
        f"middle half {quartiles[0]:.3f}-{quartiles[2]:.3f} -> target <= {OVERHEAD_TARGET} {'MET' if overhead <= OVERHEAD_TARGET else 'MISSED'}"
    )

    # ------------------------------------------------------------------ (c) real models
    print(
        "\nreal models, FLOPs per training sample (counted on the meta device from the catalog's configs: nothing downloaded or allocated); "
        "predicted cached / uncached speed-up = (encoders + denoiser) / denoiser:"
    )
    print(f"  {'model':<28}{'VAE encode':>11}{'text enc.':>10}{'denoiser full':>15}{'denoiser LoRA':>15}{'full':>7}{'LoRA':>7}{'full*':>7}{'LoRA*':>7}{'encoders':>11}")
    for row in real_model_flops():
        encoders = row["vae"] + row["text"]
        print(
            f"  {row['model']:<28}{row['vae'] / 1e12:9.1f} T{row['text'] / 1e12:8.2f} T{row['full'] / 1e12:13.1f} T{row['lora'] / 1e12:13.1f} T"
            f"{1 + encoders / row['full']:6.2f}x{1 + encoders / row['lora']:6.2f}x{1 + 2 * encoders / row['full']:6.2f}x{1 + 2 * encoders / row['lora']:6.2f}x"
            f"{row['frozen_bytes'] / 2**30:8.1f} GiB"
        )
    print(
        "  full / LoRA: encoders at the denoiser's FLOP rate; full* / LoRA*: at half of it (ZeRO-Pipe's uncached ranks run the encoders in fp32, "
        "the denoiser in bf16 on GPUs). encoders: their fp32 weights, what each rank does not hold with caches on"
    )

    ratio = statistics.median(ratios)
    print(f"\ncached / uncached steps/s here (median of the {len(ratios)} repeat ratio(s)): {ratio:.2f}x (depends on the tiny model's proportions; see the real models above)")
    busy = [r["name"] for r in results if r["foreign"] >= QUIET_CORES]
    if busy:
        print(f"note: other processes used >= {QUIET_CORES} cores during {len(busy)} of {len(results)} runs ({', '.join(busy)})")
    print(f"total wall time {time.time() - started:.0f} s")
    if args.out_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
