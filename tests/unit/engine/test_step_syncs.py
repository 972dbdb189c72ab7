"""A step that does not log waits for nothing: no value read back from the device, no collective.

One real rank (DeepSpeed on the CPU, gloo, world size 1) runs the trainer under a
``TorchFunctionMode`` that counts the calls which, on a GPU, copy a value to the host and so
make the host wait for the device (``.item()``, ``float(tensor)``, ``.cpu()``, ``.tolist()``...),
made from ZeRO-Pipe's own code. The metrics of every step must still reach metrics.jsonl,
with the same figures as a run that writes each step at once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}

RANK = textwrap.dedent(
    """
    import json, sys, weakref, torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves
    from zeropipe.engine.trainer import Trainer
    from zeropipe.families import family_of
    from zeropipe.rundir import RunDir

    # On CPU ranks every tensor is on the host, so the device is simulated: the model's
    # parameters, whatever was moved with .to()/.cuda(), and everything computed from those
    # count as device tensors; reading one of them on the host is what would wait for a GPU.
    HOST_READS = {"item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy"}
    marked = {}  # id -> weak reference: tensors compare by value, so no set of tensors

    def mark(tensor):
        marked[id(tensor)] = weakref.ref(tensor)

    def is_marked(tensor):
        ref = marked.get(id(tensor))
        return ref is not None and ref() is tensor
    calls = {}

    def zeropipe_caller():
        caller = sys._getframe(2)
        while caller and "torch/" in caller.f_code.co_filename:
            caller = caller.f_back
        if caller and "zeropipe" in caller.f_code.co_filename:
            return caller.f_code.co_name
        return None

    class CountHostReads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            inputs = [leaf for leaf in tree_leaves((args, kwargs or {})) if isinstance(leaf, torch.Tensor)]
            from_device = any(is_marked(tensor) for tensor in inputs)
            if name in HOST_READS and from_device:
                where = zeropipe_caller()
                if where:
                    calls.setdefault(trainer.step, []).append(f"{name} in {where}")
            out = func(*args, **(kwargs or {}))
            if from_device or name in {"to", "cuda"}:
                for leaf in tree_leaves(out):
                    if isinstance(leaf, torch.Tensor) and name not in HOST_READS:
                        mark(leaf)
            return out

    # One rank process trains the runs one after another (a process's start-up, its imports, costs more
    # than a run's 8 steps): each its own Trainer, process group (a new port) and counts.
    import os, socket
    counted = {}
    for run_dir in sys.argv[1:]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
        marked.clear()
        calls = {}
        trainer = Trainer(run_dir, family_of(RunDir(run_dir).read_config().model).rank_task)
        trainer.setup()
        for parameter in trainer.engine.module.parameters():
            mark(parameter)
        with CountHostReads():
            trainer.train()
        trainer.cleanup()
        counted[run_dir] = calls
    print(json.dumps(counted))
    """
)


PAIRS = [{"prompt": f"What is {a} + 2?", "chosen": str(a + 2), "rejected": str(a + 3)} for a in range(16)]


def prepare(tmp_path, name: str, log_every: int, **sections):
    from zeropipe.config.load import validate_config
    from zeropipe.launch.prepare import prepare_run
    from zeropipe.launch.resolve import resolve_run

    raw = {
        "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"config": TINY, "tokenizer_vocab_size": 300},
        "data": {"synthetic": {"task": "arithmetic", "examples": 64}, "max_seq_len": 32},
        "train": {"max_steps": 8, "micro_batch_size": 4, "gradient_accumulation_steps": 2, "log_every": log_every, "save_every": 6},
        "deepspeed": {"zero_stage": 2, "precision": "fp32"},
        "hardware": {"gpus": 1, "accelerator": "cpu"},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return prepare_run(resolve_run(validate_config(yaml.safe_load(yaml.safe_dump(raw)))))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict[int, list[str]], list[dict], Path]]:
    """The file's four runs, trained by one rank process: name -> (host reads by step, metrics rows, run directory).

    One process for all four (each run its own Trainer and process group): a rank process's start-up
    cost more CI than its 8 steps, four times.
    """
    tmp_path = tmp_path_factory.mktemp("step-syncs")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(pair) + "\n" for pair in PAIRS))
    preference = {"model": {"lora": {"r": 4, "alpha": 8, "dropout": 0.0}}, "data": {"synthetic": None, "path": str(pairs)}}
    prepared = {
        "deferred": prepare(tmp_path, "deferred", log_every=4),
        "at-once": prepare(tmp_path, "at-once", log_every=1),
        # KTO with LoRA (its reference the adapters off, its KL rows, its per-group rewards).
        "kto": prepare(tmp_path, "kto", log_every=4, preference={"method": "kto"}, **preference),
        "reward": prepare(tmp_path, "reward", log_every=4, data=preference["data"], preference={"method": "reward"}, train={"lr": 1e-2}),
    }
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", DS_ACCELERATOR="cpu")
    env.pop("ZEROPIPE_LAUNCHER_PID", None)
    paths = [str(run.run.path) for run in prepared.values()]
    done = subprocess.run([sys.executable, "-c", RANK, *paths], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    counted = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        name: (
            {int(step): where for step, where in counted[str(run.run.path)].items()},
            [json.loads(line) for line in run.run.metrics.read_text().splitlines()],
            run.run.path,
        )
        for name, run in prepared.items()
    }


def test_steps_between_logs_read_nothing_back_and_every_step_still_reaches_metrics(runs):
    calls, rows, _ = runs["deferred"]
    # calls[n] holds what ran while trainer.step was n: the end of step n and the start of step n+1.
    # The flushes are at steps 4 and 8 (log_every) and 6 (the checkpoint); every other step reads nothing.
    quiet = [step for step in range(1, 8) if step not in (4, 6)]
    assert {step: calls[step] for step in quiet if step in calls} == {}
    assert calls.get(4), "the flush at a logging step reads the figures back once"
    assert [row["step"] for row in rows] == list(range(1, 9))

    _, at_once, _ = runs["at-once"]
    keys = ("step", "epoch", "loss", "lr", "grad_norm")
    assert [{k: row[k] for k in keys} for row in rows] == [{k: row[k] for k in keys} for row in at_once]
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_a_preference_step_between_logs_reads_nothing_back(runs):
    """KTO with LoRA (its reference the adapters off, its KL rows, its per-group rewards): the figures wait for the flush too.

    (DPO's figures are the same kind, from the same task; the 2-rank DPO runs are tests/integration/test_preference.py.)
    """
    calls, rows, _ = runs["kto"]
    quiet = [step for step in range(1, 8) if step not in (4, 6)]
    assert {step: calls[step] for step in quiet if step in calls} == {}
    assert calls.get(4), "the flush at a logging step reads the figures back once"
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert all("rewards_margin" in row and "logps_chosen" in row for row in rows)


def test_a_reward_model_trains_in_a_rank_and_exports_for_sequence_classification(runs, tmp_path):
    """The reward model's rank (a scalar head on the transformer, pairwise loss) and its export, which transformers loads as such."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from zeropipe.families import export_run

    _, rows, run_dir = runs["reward"]
    assert [row["step"] for row in rows] == list(range(1, 9)) and all("rewards_accuracy" in row and "mean_reward" in row for row in rows)
    out = export_run(run_dir, tmp_path / "export")
    model = AutoModelForSequenceClassification.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    batch = tokenizer(["What is 1 + 2?3", "What is 1 + 2? 4 and more"], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert model(**batch).logits.shape == (2, 1)
