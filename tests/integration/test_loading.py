"""The streaming loader on 2 CPU ranks under ZeRO-0, 2 and 3: the same model as from_pretrained on one process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.integration.conftest import RUN_TIMEOUT, TINY_LLAMA, assert_ok, tiny_run_config, write_config, zeropipe

pytestmark = pytest.mark.integration

IDS = [[1, 5, 9, 14, 20, 33, 250, 7]]
# (checkpoint, training precision): fp32 as saved, bf16 on disk into fp32 and into bf16, sharded with tied embeddings.
CASES = [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"), ("bf16-sharded-tied", "fp32")]

STAGES = [0, 2, 3]

# One rank: for each ZeRO stage, load every case with zeropipe's loader, let DeepSpeed take the model, and
# save what a user would check: logits of a forward pass and every full weight and buffer. One launch of
# two ranks for the three stages (a launch's start-up costs more CI than its loads); ZeRO-3 last, as its
# engine replaces torch's linear function for the rest of the process.
RANK_SCRIPT = """
import itertools, json, os, sys
import torch
import deepspeed
from transformers import AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig
from zeropipe.models.loading import load_pretrained

root, stages, cases, ids = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
assert stages == sorted(stages), stages
deepspeed.init_distributed(dist_backend="gloo")
rank = int(os.environ["RANK"])
for stage, (checkpoint, precision) in itertools.product(stages, cases):
    ds_config = {
        "train_micro_batch_size_per_gpu": 1, "train_batch_size": int(os.environ["WORLD_SIZE"]),
        "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    if precision == "bf16":
        ds_config["bf16"] = {"enabled": True}
    # As the trainer does: transformers must know about ZeRO-3 while the model is built.
    hf_ds_config = HfDeepSpeedConfig(ds_config) if stage == 3 else None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = load_pretrained(AutoModelForCausalLM, os.path.join(root, checkpoint), dtype=dtype, zero_stage=stage)
    if stage == 3:
        local = sum(p.ds_tensor.numel() for p in model.parameters())
        assert local < sum(p.ds_numel for p in model.parameters()), "ZeRO-3 rank holds the full model"
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=torch.tensor(ids)).logits
        named = list(engine.module.named_parameters())
        gathered = deepspeed.zero.GatheredParameters([p for _, p in named]) if stage == 3 else torch.no_grad()
        with gathered:
            weights = {name: p.detach().clone() for name, p in named}
        buffers = {name: b.detach().clone() for name, b in engine.module.named_buffers()}
    tied = engine.module.lm_head.weight is engine.module.model.embed_tokens.weight
    out = os.path.join(root, f"z{stage}_{checkpoint}_{precision}_rank{rank}.pt")
    torch.save({"logits": logits, "weights": weights, "buffers": buffers, "tied": tied}, out)
    del engine, model, hf_ds_config
# As a zeropipe rank leaves (launch/rank.leave): without the interpreter's teardown, where gloo's threads abort it now and then
# ("terminate called without an active exception").
torch.distributed.barrier()
torch.distributed.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny Llama checkpoints saved by the test: fp32, bf16, and bf16 sharded with tied embeddings."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("checkpoints")
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    saved = [("fp32", torch.float32, False, None), ("bf16", torch.bfloat16, False, None), ("bf16-sharded-tied", torch.bfloat16, True, "20KB")]
    for name, dtype, tied, shard in saved:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**{**fields, "tie_word_embeddings": tied}, vocab_size=300)).to(dtype)
        model.save_pretrained(root / name, **({"max_shard_size": shard} if shard else {}))
    assert len(list((root / "bf16-sharded-tied").glob("*.safetensors"))) > 1
    (root / "rank.py").write_text(RANK_SCRIPT)
    return root


@pytest.fixture(scope="module")
def loaded(checkpoints):
    """The two ranks' files of every stage and case (one launch); the folder they are in."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    # --standalone: torchrun's rendezvous store binds a free port itself and the ranks share it (no port picked, then taken).
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(checkpoints / "rank.py"), str(checkpoints), json.dumps(STAGES), json.dumps(CASES), json.dumps(IDS)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT, env=env)
    assert_ok(result)
    return checkpoints


@pytest.mark.parametrize("stage", STAGES)
def test_every_rank_holds_the_model_from_pretrained_gives(loaded, stage):
    from transformers import AutoModelForCausalLM

    checkpoints = loaded
    for checkpoint, precision in CASES:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        expected = AutoModelForCausalLM.from_pretrained(checkpoints / checkpoint, dtype=dtype).eval()
        with torch.no_grad():
            logits = expected(input_ids=torch.tensor(IDS)).logits
        for rank in range(2):
            got = torch.load(checkpoints / f"z{stage}_{checkpoint}_{precision}_rank{rank}.pt")
            case = f"ZeRO-{stage} {checkpoint} -> {precision}, rank {rank}"
            assert torch.equal(got["logits"], logits), case
            for name, value in expected.named_parameters():
                assert got["weights"][name].dtype == dtype and torch.equal(got["weights"][name], value), f"{case}: {name}"
            for name, value in expected.named_buffers():
                assert torch.equal(got["buffers"][name], value), f"{case}: {name}"
            assert got["tied"] == ("tied" in checkpoint), case


def test_damaged_checkpoint_stops_the_run_before_training_naming_file_and_tensor(tmp_path, checkpoints):
    from safetensors.torch import load_file, save_file

    from zeropipe.data.synthetic import generate_dataset
    from zeropipe.data.tokenizer import train_tokenizer

    directory = tmp_path / "damaged"
    shutil.copytree(checkpoints / "bf16", directory)
    data = generate_dataset("arithmetic", 200, 0, tmp_path / "corpus.jsonl")
    train_tokenizer([v for line in data.read_text().splitlines() for v in json.loads(line).values()], 300, directory)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = tiny_run_config(tmp_path, name="damaged", model={"config": None, "path": str(directory)}, deepspeed={"zero_stage": 3})
    result = zeropipe("train", write_config(tmp_path, config))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "missing tensor model.layers.1.mlp.up_proj.weight: not in model.safetensors" in output, output[-3000:]
    assert not (tmp_path / "runs" / "damaged" / "metrics.jsonl").exists()
