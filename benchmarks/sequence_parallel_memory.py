"""Per-rank activation memory of a video DiT under Ulysses sequence parallelism: 1, 2 and 4 CPU ranks (gloo).

A Wan-shaped transformer (WanTransformer3DModel, 4 heads of 32, 2 layers, fp32, ZeRO-Pipe's path:
``families/diffusion/sequence_parallel.enable``) runs one forward and backward on one clip whose
latent tokens make the activations dominate. Each rank samples its own RSS every 5 ms during the
step; the figure is the peak minus the RSS just before the step (the weights and libraries are
already in it). With N ranks each holds 1/N of the tokens between the first block and the output,
so the figure should fall to about 1/N; the planner divides its activation terms by N
(``plan/memory.py``), which this holds to a measurement.

    PYTHONPATH=src python benchmarks/sequence_parallel_memory.py [--frames 9 --side 64]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time

import torch
import torch.multiprocessing as mp

CONFIG = {
    "patch_size": [1, 2, 2], "num_attention_heads": 4, "attention_head_dim": 32, "in_channels": 16, "out_channels": 16,
    "text_dim": 64, "freq_dim": 32, "ffn_dim": 256, "num_layers": 2, "rope_max_seq_len": 64,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_step(frames: int, side: int) -> dict:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**CONFIG).float()
    generator = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(1, 16, frames, side, side, generator=generator),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 16, CONFIG["text_dim"], generator=generator),
    }
    return {"model": model, "inputs": inputs}


def measure(model, inputs) -> tuple[int, float]:
    """(peak RSS above the RSS before the step, seconds) of one forward and backward."""
    import gc

    gc.collect()
    before = rss()
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    started = time.perf_counter()
    out = model(**inputs, return_dict=False)[0]
    out.float().pow(2).mean().backward()
    seconds = time.perf_counter() - started
    done.set()
    thread.join()
    peak[0] = max(peak[0], rss())
    return peak[0] - before, seconds


def worker(rank: int, world: int, port: int, frames: int, side: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from zeropipe.families.diffusion import sequence_parallel

    built = one_step(frames, side)
    sequence_parallel.enable(built["model"], world)
    measure(built["model"], built["inputs"])  # warm-up: the allocator's pools and the hooks' first call
    built["model"].zero_grad(set_to_none=True)
    grown, seconds = measure(built["model"], built["inputs"])
    with open(f"{out}/{world}-{rank}.json", "w") as handle:
        json.dump({"bytes": grown, "seconds": seconds}, handle)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=9, help="latent frames of the clip")
    parser.add_argument("--side", type=int, default=64, help="latent height and width (2x2 patches)")
    parser.add_argument("--degrees", default="1,2,4")
    args = parser.parse_args()
    tokens = args.frames * (args.side // 2) ** 2
    print(f"WanTransformer3DModel {json.dumps(CONFIG)}; one clip of {args.frames} latent frames x {args.side}x{args.side}: {tokens:,} tokens; fp32")
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for degree in (int(d) for d in args.degrees.split(",")):
            if degree == 1:
                torch.set_num_threads(1)
                built = one_step(args.frames, args.side)
                measure(built["model"], built["inputs"])
                built["model"].zero_grad(set_to_none=True)
                grown, seconds = measure(built["model"], built["inputs"])
                figures = [{"bytes": grown, "seconds": seconds}]
                del built
            else:
                mp.spawn(worker, args=(degree, free_port(), args.frames, args.side, out), nprocs=degree, join=True)
                figures = [json.load(open(f"{out}/{degree}-{rank}.json")) for rank in range(degree)]
            rows.append((degree, figures))
    base = max(f["bytes"] for f in rows[0][1])
    print(f"{'ranks (SP degree)':>18}  {'activation RSS per rank (MiB, max over ranks)':>46}  {'vs 1 rank':>9}  {'1/N':>5}  {'step s':>7}")
    for degree, figures in rows:
        most = max(f["bytes"] for f in figures)
        print(f"{degree:>18}  {most / 2**20:>46.1f}  {most / base:>9.2f}  {1 / degree:>5.2f}  {max(f['seconds'] for f in figures):>7.1f}")


if __name__ == "__main__":
    sys.exit(main())
