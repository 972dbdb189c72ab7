"""train.optimizer: each choice, as DeepSpeed runs it from ZeRO-Pipe's JSON, takes the same steps as its library alone.

One tiny Llama, one batch, fp32, three steps through ``deepspeed.initialize`` (world size 1, gloo) with
the JSON ``build_deepspeed_config`` writes and the client optimizer ``engine.optimizers`` builds, against
the library's own optimizer stepped by a plain PyTorch loop on a copy of the same model.
"""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import yaml

from zeropipe.config.deepspeed import build_deepspeed_config
from zeropipe.config.load import load_config
from zeropipe.config.optimizers import OPTIMIZERS, optimizer_problems
from zeropipe.engine.optimizers import build_client_optimizer

STEPS = 3
LR = 3e-3


def tiny_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
    return LlamaForCausalLM(config).float()


def run_config(tmp_path, optimizer: str, stage: int):
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')
    raw = {
        "model": {"config": {"model_type": "llama", "hidden_size": 32}},
        "data": {"path": str(data)},
        # No warm-up, a constant rate and no clipping: the reference loop below does neither.
        "train": {"optimizer": optimizer, "lr": LR, "schedule": "constant", "grad_clip": 0.0, "weight_decay": 0.01, "micro_batch_size": 2},
        "deepspeed": {"zero_stage": stage, "precision": "fp32"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path)


@pytest.fixture(scope="module")
def distributed():
    import os

    import deepspeed

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    saved = {key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR")}
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu"})
    deepspeed.init_distributed(dist_backend="gloo")
    # DeepSpeed's Muon decorates its Newton-Schulz steps with torch.compile: minutes of C++ builds on
    # two CPU cores for three steps. Eager runs the same arithmetic.
    disabled = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    yield
    torch._dynamo.config.disable = disabled
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (2, 12), generator=generator)


def engine_for(config, model: torch.nn.Module):
    import deepspeed

    ds = build_deepspeed_config(config, world_size=1, total_steps=STEPS, hidden_size=32).config
    parameters = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameters, optimizer=build_client_optimizer(config.train, parameters), config=ds)
    return engine


def deepspeed_steps(config, model: torch.nn.Module, save_at: int | None = None, save_dir=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    import deepspeed

    engine = engine_for(config, model)
    ids = batch()
    losses = []
    for step in range(STEPS):
        if step == save_at:
            # Every rank calls save_checkpoint: a collective.
            engine.save_checkpoint(str(save_dir), tag="mid")
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    return losses, weights


def resumed_steps(config, model: torch.nn.Module, save_dir, from_step: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A new engine on a fresh model, loaded from the checkpoint, stepped to the end: its losses and final weights."""
    import deepspeed

    engine = engine_for(config, model)
    engine.load_checkpoint(str(save_dir), tag="mid", load_optimizer_states=True, load_lr_scheduler_states=True)
    ids = batch()
    losses = []
    for _ in range(from_step, STEPS):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    return losses, weights


def reference_optimizer(name: str, model: torch.nn.Module, train) -> torch.optim.Optimizer:
    betas = (train.adam_beta1, train.adam_beta2)
    if name == "muon":
        from deepspeed.runtime.zero.muon.original_muon import SingleDeviceMuonWithAuxAdam

        # DeepSpeed's tagging (deepspeed.set_optimizer_flags): matrices, except embeddings and the output head.
        matrices = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n and "lm_head" not in n]
        rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n and "lm_head" not in n)]
        return SingleDeviceMuonWithAuxAdam([
            {"params": matrices, "use_muon": True, "lr": LR, "momentum": train.muon_momentum, "weight_decay": train.weight_decay},
            {"params": rest, "use_muon": False, "lr": LR, "betas": betas, "eps": train.adam_eps, "weight_decay": train.weight_decay},
        ])
    if name == "adafactor":
        return torch.optim.Adafactor(model.parameters(), lr=LR, weight_decay=train.weight_decay)
    if name == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(model.parameters(), lr=LR, betas=betas, eps=train.adam_eps, weight_decay=train.weight_decay)
    if name == "prodigy":
        import prodigyopt

        return prodigyopt.Prodigy(model.parameters(), lr=LR, betas=betas, eps=train.adam_eps, weight_decay=train.weight_decay)
    raise AssertionError(name)


def reference_steps(name: str, model: torch.nn.Module, train, flat: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The library's optimizer stepped alone; ``flat``: on one fp32 vector of all the weights, the layout ZeRO hands it."""
    parameters = list(model.parameters())
    vector = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in parameters])) if flat else None
    optimizer = reference_optimizer(name, torch.nn.ParameterList([vector]) if flat else model, train)
    ids = batch()
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if flat:
            vector.grad = torch.cat([p.grad.reshape(-1) for p in parameters])
        optimizer.step()
        if flat:
            with torch.no_grad():
                offset = 0
                for p in parameters:
                    p.copy_(vector[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


# (optimizer, ZeRO stage). bitsandbytes' AdamW8bit under ZeRO 1-3 steps the rank's flat fp32 partition: one
# tensor, so its moments are quantized in blocks that span weight edges, and the small weights (norms, which
# bitsandbytes keeps in 32 bits when alone: min_8bit_size) are 8-bit too. It is held to the library run on that
# same flat vector, which is what DeepSpeed hands it (docs/config.md#optimizers says so).
CASES = [("muon", 0), ("muon", 2), ("muon", 3), ("adafactor", 0), ("adamw8bit", 0), ("adamw8bit", 2), ("adamw8bit", 3), ("prodigy", 0)]


@pytest.mark.parametrize(("name", "stage"), CASES, ids=[f"{n}-zero{s}" for n, s in CASES])
def test_each_optimizer_steps_as_its_library_alone(tmp_path, distributed, name, stage):
    # ZeRO-3 lays its flat partition out with per-weight alignment padding, so 8-bit blocks' edges shift a little
    # against the plain concatenation: 8-bit rounding differences of a few 1e-6 after three steps.
    tolerance = 1e-5 if (name, stage) == ("adamw8bit", 3) else 1e-6
    config = run_config(tmp_path, name, stage)
    assert not optimizer_problems(name, stage, offload=False)
    model = tiny_model()
    reference = copy.deepcopy(model)
    fresh = copy.deepcopy(model)
    losses, weights = deepspeed_steps(config, model, save_at=2, save_dir=tmp_path / "checkpoints")
    expected_losses, expected = reference_steps(name, reference, config.train, flat=name == "adamw8bit" and stage > 0)
    # Resumed from the checkpoint after step 2 (weights, optimizer state, schedule), step 3 is the same step:
    # the same loss before it and bit-identical weights after it (the update reads the restored state).
    resumed_losses, resumed = resumed_steps(config, fresh, tmp_path / "checkpoints", 2)
    assert resumed_losses == losses[2:]
    assert all(torch.equal(resumed[n], weights[n]) for n in weights), f"{name} under ZeRO-{stage} does not resume exactly"
    assert losses[-1] < losses[0], f"{name} did not lower the loss: {losses}"
    assert losses == pytest.approx(expected_losses, rel=max(tolerance, 1e-6), abs=1e-6)
    worst = max((weights[n] - expected[n]).abs().max().item() for n in expected)
    assert worst <= tolerance, f"{name} under ZeRO-{stage}: weights differ from {name} alone by up to {worst:.2e}"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_json_says_what_the_rank_builds(tmp_path, name):
    """DeepSpeed builds what the JSON names; a client optimizer leaves the JSON without one and allows it under ZeRO."""
    kind = OPTIMIZERS[name]
    stage = max(kind.stages)
    ds = build_deepspeed_config(run_config(tmp_path, name, stage), world_size=2, total_steps=10, hidden_size=32).config
    if kind.deepspeed_type:
        assert ds["optimizer"]["type"] == kind.deepspeed_type and ds["optimizer"]["params"]["lr"] == LR
    else:
        assert "optimizer" not in ds
    assert ds.get("zero_allow_untested_optimizer", False) is (name != "adamw" and stage > 0)
