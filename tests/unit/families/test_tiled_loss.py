"""The sequence-tiled LM loss (parallel.tiled_loss, issue 40): the model's own loss and gradients, without the whole logits."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zeropipe.families.causal_lm import tiled_loss

VOCAB = 1000


def tiny_llama(tied: bool = False, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=tied, attn_implementation="sdpa", **extra,
    )
    return LlamaForCausalLM(config).float().train()


def batch(packed: bool):
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 40))
    labels = ids.clone()
    if packed:
        # Two rows of packed examples: positions restart at each example, the boundary token carries no label (collate_packed).
        positions = torch.cat([torch.arange(15), torch.arange(25)]).repeat(2, 1)
        labels[:, 0] = labels[:, 15] = -100
        labels[1, 30:] = -100  # right padding of the second row
        return {"input_ids": ids, "position_ids": positions}, labels
    mask = torch.ones_like(ids)
    mask[1, 31:] = 0
    labels[1, 31:] = -100
    labels[0, :9] = -100  # a prompt
    return {"input_ids": ids, "attention_mask": mask}, labels


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tiled_loss_and_gradients_equal_the_models_own(packed, tied):
    plain = tiny_llama(tied)
    tiled = copy.deepcopy(plain)
    inputs, labels = batch(packed)
    # A factor after the loss (1/accumulation, fp16's scale...) must reach the LM head's weight too.
    scale = 0.37
    expected = plain(**inputs, labels=labels, use_cache=False).loss
    (expected * scale).backward()
    head = tiled.get_output_embeddings()
    tiled_loss.mark_tied(tiled)
    total, labelled = tiled_loss.token_loss_sum(tiled, head, 7, labels=labels, **inputs)  # 80 tokens: 12 tiles, the last one short
    loss = total / labelled
    (loss * scale).backward()
    assert torch.allclose(loss, expected, rtol=1e-6, atol=0)
    for (name, a), (_, b) in zip(plain.named_parameters(), tiled.named_parameters()):
        # fp32, summed in another order: each gradient within 1e-6 of its own norm.
        assert (a.grad - b.grad).norm() <= 1e-6 * a.grad.norm(), f"{name}: {(a.grad - b.grad).norm() / a.grad.norm():.2e}"
    assert all(getattr(p, "ds_grad_is_ready", True) for p in head.parameters())


class LogitsRows(TorchDispatchMode):
    """The most rows of any tensor with the vocabulary as its last dimension that an operation creates."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[-1] == VOCAB:
                self.rows = max(self.rows, tensor.numel() // VOCAB)
        return out


def test_the_whole_logits_never_exist():
    model = tiny_llama()
    tokens, tile = 2048, 256
    ids = torch.randint(0, VOCAB, (1, tokens))
    untiled = LogitsRows()
    with untiled:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    tiled = LogitsRows()
    with tiled:
        total, labelled = tiled_loss.token_loss_sum(model, model.get_output_embeddings(), tile, labels=ids, input_ids=ids)
        (total / labelled).backward()
    assert untiled.rows >= tokens
    assert tiled.rows == tile, f"the tiled loss created logits of {tiled.rows} tokens"


def test_choice_auto_on_above_a_gib_and_refused_where_the_model_changes_its_logits():
    model = tiny_llama()
    tile, sentence = tiled_loss.choose("auto", 4096, 2048, VOCAB, model)
    assert tile == 0 and "tiled loss: off" in sentence and "auto" in sentence
    tile, sentence = tiled_loss.choose("auto", 4096, 131_072, 128_256, model)
    assert tile == 4096 and "tiled loss: on, 4,096 tokens per tile" in sentence and "62.62 GiB" in sentence
    assert tiled_loss.choose(True, 512, 100, VOCAB, model)[0] == 100  # never a tile longer than the micro-batch
    assert tiled_loss.choose(False, 512, 131_072, 128_256, model)[0] == 0

    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma = Gemma2ForCausalLM(Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=VOCAB))
    tile, sentence = tiled_loss.choose("auto", 4096, 131_072, 128_256, gemma)
    assert tile == 0 and "final_logit_softcapping" in sentence
    with pytest.raises(ValueError, match="parallel.tiled_loss: true cannot be used with this model.*final_logit_softcapping"):
        tiled_loss.choose(True, 4096, 131_072, 128_256, gemma)


@pytest.fixture(scope="module")
def distributed():
    import os
    import socket

    import deepspeed

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR")
    saved = {key: os.environ.get(key) for key in keys}
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu"})
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def deepspeed_run(model, stage: int, tile: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two optimizer steps of two accumulated micro-batches (lengths 40 and 23) through DeepSpeed; the losses and final weights."""
    import deepspeed

    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage},
          "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.5), config=ds)
    head = engine.module.get_output_embeddings()
    tiled_loss.mark_tied(engine.module)
    inputs, labels = batch(packed=False)
    micro_batches = [(inputs, labels), ({key: value[:, :23] for key, value in inputs.items()}, labels[:, :23])]
    losses = []
    for _step in range(2):
        for inputs, labels in micro_batches:
            if tile:
                total, labelled = tiled_loss.token_loss_sum(engine, head, tile, stage == 3, labels=labels, **inputs)
                loss = total / labelled
            else:
                loss = engine(**inputs, labels=labels, use_cache=False).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    return losses, weights


@pytest.mark.parametrize("stage,tied", [(2, False), (2, True), (3, True)], ids=["zero2", "zero2-tied", "zero3-tied"])
def test_deepspeed_steps_the_same_weights(distributed, stage, tied):
    """ZeRO's gradient hooks see each head parameter once (ds_grad_is_ready), scaled by 1/accumulation like every other gradient."""
    model = tiny_llama(tied)
    expected_losses, expected = deepspeed_run(copy.deepcopy(model), stage, 0)
    losses, weights = deepspeed_run(model, stage, 7)
    assert losses == pytest.approx(expected_losses, rel=1e-6)
    assert losses[2] < losses[0]  # the steps moved the weights
    for name, value in expected.items():
        assert (weights[name] - value).norm() <= 1e-6 * value.norm(), name


def test_a_sequence_parallel_shard_takes_the_same_loss_and_gradients_tiled(distributed):
    """group_loss on the second of two shards (its labels shifted across the boundary before the split), tiled and untiled."""
    from zeropipe.families.causal_lm.sequence_parallel import group_loss, shard_batch

    plain = tiny_llama()
    tiled = copy.deepcopy(plain)
    inputs, labels = batch(packed=False)
    shard = shard_batch({"input_ids": inputs["input_ids"], "labels": labels}, 2, 1, pad_token_id=0)
    expected, expected_mean = group_loss(plain, shard, None, torch.device("cpu"), 2)
    expected.backward()
    loss, mean = group_loss(tiled, shard, None, torch.device("cpu"), 2, (tiled.get_output_embeddings(), 6, False))
    loss.backward()
    assert torch.allclose(loss, expected, rtol=1e-6, atol=0) and torch.allclose(mean, expected_mean, rtol=1e-6, atol=0)
    for (name, a), (_, b) in zip(plain.named_parameters(), tiled.named_parameters()):
        assert (a.grad - b.grad).norm() <= 1e-6 * a.grad.norm(), name


def test_check_refuses_a_tiled_loss_nothing_would_use(tmp_path):
    from zeropipe.check.run import check_config
    from zeropipe.config.load import validate_config

    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')

    def findings(**sections):
        raw = {"model": {"config": {"model_type": "llama", "hidden_size": 32}}, "data": {"path": str(data)}, **sections}
        return [f for f in check_config(validate_config(raw)) if f.rule == "ZP048"]

    assert findings(parallel={"tiled_loss": True}) == []
    refused = findings(parallel={"tiled_loss": True}, preference={"method": "dpo"})
    assert len(refused) == 1 and refused[0].key == "parallel.tiled_loss" and "preference tuning" in refused[0].message
    assert "parallel.tiled_loss: auto" in refused[0].fix
    assert findings(parallel={"tiled_loss": "auto"}, preference={"method": "dpo"}) == []


def test_two_zero3_ranks_with_other_tile_counts_step_as_untiled():
    """Under ZeRO-3 every head call gathers its weight over all ranks: ranks with 12 and 7 tiles must agree, or they hang."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("tiled_loss_ranks.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("worst relative weight difference") == 2
