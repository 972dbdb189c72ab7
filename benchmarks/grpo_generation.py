"""GRPO's sampling round under ZeRO-3: the weights gathered once per round against generating with sharded weights.

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/grpo_generation.py              # 2 CPU ranks, a ~20M-parameter Llama
    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/grpo_generation.py --tokens 16 --rounds 2

Each rank builds the same Llama inside ``deepspeed.zero.Init`` (ZeRO-3, fp32, gloo), wraps it in
a DeepSpeed engine and samples ``--generations`` completions of ``--tokens`` new tokens for each
of ``--prompts`` prompts, twice per round:

- **gathered**: ``engine.generation.gathered_for_generation`` (the whole model gathered once,
  DeepSpeed's hooks off) then ``generate`` with no collective inside: what GRPO runs;
- **sharded**: ``generate`` on the partitioned module with ``synced_gpus`` (every forward pass
  of every new token gathers each layer's weights from the other ranks, and every rank runs
  as many passes as the slowest): what a loop that does not gather gets.

Both sample from the same seeded generator with the same weights, so they must produce the same
tokens (checked: the speed-up is not bought with other samples). Printed: each way's median
seconds per round and new tokens per second (rank 0), and the ratio sharded / gathered.
Exit code 0 whether or not gathering wins.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def ds_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
    }


def rank_main(rank: int, world: int, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from zeropipe.engine.generation import gathered_for_generation, sample_completions

    deepspeed.init_distributed(dist_backend="gloo")
    config = ds_config()
    keep = HfDeepSpeedConfig(config)  # noqa: F841 - alive: from_config builds inside zero.Init
    torch.manual_seed(0)
    model_config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 2, num_hidden_layers=args.layers, num_attention_heads=8,
                               num_key_value_heads=4, vocab_size=4096, max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = LlamaForCausalLM._from_config(model_config, dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config)
    total = sum(p.ds_numel for p in model.parameters())
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 4096, (args.prompts, 12), generator=generator)
    mask = torch.ones_like(prompts)
    options = dict(num_generations=args.generations, max_new_tokens=args.tokens, temperature=1.0, top_p=1.0, top_k=0,
                   eos_token_id=-1, pad_token_id=0)  # no EOS: every completion runs to --tokens, the same work both ways

    def gathered(seed):
        with gathered_for_generation(engine, 3) as module:
            return sample_completions(module, prompts, mask, seed=seed, **options)[0]

    def sharded(seed):
        module = engine.module
        module.eval()
        try:
            return sample_completions(module, prompts, mask, seed=seed, synced_gpus=True, **options)[0]
        finally:
            module.train()

    times = {"gathered": [], "sharded": []}
    for round_number in range(args.rounds + 1):  # the first round warms up
        seed = 1000 * round_number + rank
        outputs = {}
        for name, run in (("gathered", gathered), ("sharded", sharded)):
            torch.distributed.barrier()
            started = time.perf_counter()
            outputs[name] = run(seed)
            torch.distributed.barrier()
            if round_number:
                times[name].append(time.perf_counter() - started)
        assert torch.equal(outputs["gathered"], outputs["sharded"]), "the two ways sampled different tokens"
    if rank == 0:
        new_tokens = args.prompts * args.generations * args.tokens
        print(f"{total / 1e6:.1f}M parameters, {args.layers} layers, ZeRO-3 on {world} CPU ranks; per rank and round: "
              f"{args.prompts} prompts x {args.generations} completions x {args.tokens} new tokens (the same tokens both ways: checked)")
        medians = {name: statistics.median(values) for name, values in times.items()}
        for name, seconds in medians.items():
            print(f"  {name:8s} {seconds:7.2f} s per round   {new_tokens / seconds:8.1f} new tokens/s per rank")
        print(f"  sharded / gathered: {medians['sharded'] / medians['gathered']:.1f}x")
    torch.distributed.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=29631)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.multiprocessing.spawn(rank_main, args=(args.ranks, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
