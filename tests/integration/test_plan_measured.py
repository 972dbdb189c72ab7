"""The planner's model-state terms against what real 2-rank DeepSpeed runs hold per rank.

One ``torch.distributed.run`` launch (2 CPU ranks, gloo) runs this file as a script: for each
ZeRO setting it builds a tiny Llama from a config (bf16), lets DeepSpeed build AdamW from its
config, runs one micro-batch's backward and one optimizer step, and reads the bytes held by
the engine's and optimizer's own tensors (each storage counted once):

- parameters: the 16-bit weights each rank keeps (ZeRO-3: its partitions plus the small
  parameters DeepSpeed keeps whole);
- gradients: after backward, before the step: param.grad, the contiguous partition buffer
  (ZeRO-1/2) or the flat gradient partition (ZeRO-3);
- optimizer states: after the step: fp32 master partition plus Adam's exp_avg/exp_avg_sq.

The test compares the busiest rank with the plan's terms, within 2%.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TINY = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}

# (name, zero_stage, offload_optimizer, gradient_accumulation_steps)
SETTINGS = [
    ("stage1-accumulating", 1, False, 2),
    ("stage2", 2, False, 1),
    ("stage2-offload", 2, True, 1),
    ("stage3", 3, False, 1),  # ZeRO-3 last: it builds the model inside zero.Init
    ("stage3-offload", 3, True, 1),
]
TOLERANCE = 0.02
# The first run on a machine JIT-builds DeepSpeed's CPU Adam (about a minute).
LAUNCH_TIMEOUT = 900


def ds_config(stage: int, offload: bool, accumulation: int) -> dict:
    """As zeropipe.config.deepspeed writes it for a model of hidden size 128."""
    hidden = TINY["hidden_size"]
    zero: dict = {"stage": stage}
    if stage:
        zero.update({"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": hidden * hidden})
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": int(0.9 * hidden * hidden), "stage3_param_persistence_threshold": 10 * hidden})
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": 2 * accumulation * 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors (nested lists and dicts are walked)."""
    seen: dict[int, int] = {}

    def walk(item) -> None:
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, (list, tuple)):
            for inner in item:
                walk(inner)
        elif item is not None and item.device.type != "meta":
            storage = item.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()

    walk(list(tensors))
    return sum(seen.values())


def measure(stage: int, offload: bool, accumulation: int) -> dict:
    """Run one setting on this rank; return the bytes its engine and optimizer hold."""
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = ds_config(stage, offload, accumulation)
    keep_alive = None
    if stage == 3:
        from transformers.integrations import HfDeepSpeedConfig

        keep_alive = HfDeepSpeedConfig(config)  # transformers builds the model inside zero.Init while it lives
    model_config = LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    model_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config).to(torch.bfloat16) if stage < 3 else LlamaForCausalLM._from_config(model_config, dtype=torch.bfloat16)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    params = list(engine.module.parameters())
    batch = torch.randint(0, TINY["vocab_size"], (2, 64))

    if stage == 3:
        parameters = storage_bytes([p.ds_tensor for p in params] + [p.data for p in params if getattr(p, "ds_persist", False)])
    else:
        parameters = storage_bytes([p.data for p in params])

    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    grads = [p.grad for p in params]
    if stage == 3:
        grads.append(optimizer.grad_partitions_flat_buffer)
    elif stage in (1, 2):
        grads += [getattr(optimizer, "grads_in_partition", None), optimizer.averaged_gradients]
    gradients = storage_bytes(grads)
    engine.step()
    for _ in range(accumulation - 1):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()

    masters = optimizer.fp32_partitioned_groups_flat if stage == 3 else optimizer.single_partition_of_fp32_groups
    moments = [t for state in optimizer.optimizer.state.values() for name, t in state.items() if name in ("exp_avg", "exp_avg_sq")]
    optimizer_states = storage_bytes(list(masters) + moments)
    host_gradients = storage_bytes([m.grad for m in masters]) if offload else 0
    del keep_alive
    return {"parameters": parameters, "gradients": gradients, "optimizer_states": optimizer_states, "host_fp32_gradients": host_gradients}


def worker(out_dir: str) -> None:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    rows = []
    for name, stage, offload, accumulation in SETTINGS:
        rows.append({"name": name, "rank": rank, **measure(stage, offload, accumulation)})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))
    # As a zeropipe rank leaves (launch/rank.leave): without the interpreter's teardown, where gloo's threads abort it now and
    # then ("terminate called without an active exception": seen here once in three launches).
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, dict[str, int]]:
    out = tmp_path_factory.mktemp("measured")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    # --standalone: torchrun's rendezvous store binds a free port itself and the ranks share it, so a parallel
    # test can never collide on a port.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, str(out)]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env=env)
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}"
    busiest: dict[str, dict[str, int]] = {}
    for rank_file in sorted(out.glob("rank*.json")):
        for row in json.loads(rank_file.read_text()):
            entry = busiest.setdefault(row["name"], {})
            for key, value in row.items():
                if key not in ("name", "rank"):
                    entry[key] = max(entry.get(key, 0), value)
    assert set(busiest) == {name for name, *_ in SETTINGS}
    return busiest


def planned(stage: int, offload: bool, accumulation: int) -> dict[str, int]:
    from zeropipe.config.schema import ModelSection, RunConfig
    from zeropipe.families import model_spec as spec_from_config
    from zeropipe.plan import Choice, parse_hardware
    from zeropipe.plan.memory import model_state_terms
    from zeropipe.plan.totals import per_node_terms

    config = RunConfig(model=ModelSection(config=dict(TINY)))
    spec = spec_from_config(config)
    choice = Choice(zero_stage=stage, offload_optimizer=offload, gradient_accumulation_steps=accumulation, micro_batch_size=2, seq_len=64)
    terms = {t.name: t.bytes for t in model_state_terms(spec, 2, choice)}
    hardware = parse_hardware("2x8GB", "16GB")
    host = {t.name: t.bytes for t in per_node_terms(spec, hardware, choice)}
    optimizer_states = terms["optimizer states"] + host.get("offloaded optimizer states", 0) // hardware.gpus_per_node
    # Offloaded, the gradient partition lives in host RAM; the measurement cannot tell CPU from "GPU" here.
    gradients = terms["gradients (16-bit)"] + host.get("offloaded gradient partition", 0) // hardware.gpus_per_node
    return {
        "parameters": terms["parameters (16-bit)"],
        "gradients": gradients,
        "optimizer_states": optimizer_states,
        "host_fp32_gradients": host.get("offloaded fp32 gradients", 0) // hardware.gpus_per_node,
    }


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("name,stage,offload,accumulation", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_model_states_match_deepspeed(measured, name, stage, offload, accumulation):
    real = measured[name]
    plan = planned(stage, offload, accumulation)
    for key, expected in plan.items():
        got = real[key]
        if expected == 0:
            assert got == 0, f"{name} {key}: plan says none, DeepSpeed holds {got:,} bytes"
            continue
        assert abs(got - expected) <= TOLERANCE * expected, (
            f"{name} {key}: plan {expected:,} bytes, DeepSpeed holds {got:,} ({got / expected - 1:+.1%})"
        )


if __name__ == "__main__":
    worker(sys.argv[1])
