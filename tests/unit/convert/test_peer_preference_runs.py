"""The peers' own DPO, KTO, ORPO and reward-model example configs convert and train on tiny stand-ins.

Issue 29: "LLaMA-Factory's and axolotl's DPO/KTO/ORPO/reward example configs convert and train
on tiny stand-ins". Each config is the peer's file as stored for the tally test
(tests/fixtures/peers, SOURCES.md), converted by the real converter. What a machine without the
peers' models and Hub datasets cannot have is swapped, and only that:

- the model (a Hub id) -> a random-weight tiny model of the same architecture, built from a
  config, with a tokenizer trained here: the source's ``model_name_or_path`` / ``base_model``
  is pointed at it before converting;
- the dataset -> a tiny local file in the layout the config's dataset reads: LLaMA-Factory's own
  ``dataset_info.json`` (the stored copy, ``ranking: true`` / ``kto_tag`` entries) beside a small
  ``dpo_en_demo.json`` / ``kto_en_demo.json``; axolotl's ``datasets[0].path`` pointed at a local
  JSONL of its ``type:``'s records, every other dataset option as the peer wrote it;
- what a test must choose: the run's place and length (``run.output_dir``, ``train.max_steps`` 2,
  ``train.gradient_accumulation_steps`` 1: each step one micro-batch of the converted size, as
  bitsandbytes' 4-bit CPU kernels cost about 20 ms a call) and one CPU rank (``hardware``);
- ``deepspeed.precision`` fp32 for the peers' bf16, which check's ZP019 warns is 18-56x slower on a
  CPU without bf16 (the suite's, tests/conftest.py), and says to change.

Everything else (the objective, its beta and weights, LoRA, QLoRA and the 8-bit base, micro-batch
size, sequence length, schedule, learning rate, ZeRO stage: auto) is what the conversion wrote, and
``check`` accepts the converted config before the last two changes. One rank trains in this process;
the run's objective is what the peer asked for, its loss finite, and its export loads with
transformers / peft.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
from pathlib import Path

import pytest
import torch
import yaml

from zeropipe.convert import convert_file

PEERS = Path(__file__).resolve().parents[2] / "fixtures" / "peers"
STEPS = 2

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "tie_word_embeddings": False}


def sum_rows(count: int) -> list[tuple[str, str, str]]:
    return [(f"What is {a} + {a % 7}?", str(a + a % 7), str(a + a % 7 + 1)) for a in range(count)]


# ---- the datasets, each in the layout its config names
def llama_factory_ranking(folder: Path) -> None:
    """dpo_en_demo.json as LLaMA-Factory ships it: sharegpt conversations, chosen and rejected one turn each."""
    rows = [{"conversations": [{"from": "human", "value": q}], "chosen": {"from": "gpt", "value": good}, "rejected": {"from": "gpt", "value": bad}}
            for q, good, bad in sum_rows(8)]
    (folder / "dpo_en_demo.json").write_text(json.dumps(rows))


def llama_factory_kto(folder: Path) -> None:
    """kto_en_demo.json: messages (role/content) ending with the answer, and its kto_tag (label)."""
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": good if n % 2 else bad}], "label": bool(n % 2)}
            for n, (q, good, bad) in enumerate(sum_rows(8))]
    (folder / "kto_en_demo.json").write_text(json.dumps(rows))


def axolotl_conversation(path: Path) -> None:
    """fozziethebeat/alpaca_messages_2k_dpo_test's layout (type chat_template.default, field_messages: conversation)."""
    rows = [{"conversation": [{"role": "user", "content": q}], "chosen": {"role": "assistant", "content": good},
             "rejected": {"role": "assistant", "content": bad}} for q, good, bad in sum_rows(8)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def axolotl_argilla(path: Path) -> None:
    """argilla/ultrafeedback-binarized-preferences-cleaned's layout (type chat_template.argilla): prompt, chosen/rejected conversations."""
    rows = [{"prompt": q, "chosen": [{"role": "user", "content": q}, {"role": "assistant", "content": good}],
             "rejected": [{"role": "user", "content": q}, {"role": "assistant", "content": bad}]} for q, good, bad in sum_rows(8)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def axolotl_intel(path: Path) -> None:
    """argilla/distilabel-intel-orca-dpo-pairs' layout (type bradley_terry.chat_template): system, input, chosen, rejected."""
    rows = [{"system": "", "input": q, "chosen": good, "rejected": bad} for q, good, bad in sum_rows(8)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def axolotl_kto(path: Path) -> None:
    """argilla/ultrafeedback-binarized-preferences-cleaned-kto's layout (type llama3.ultra): prompt, completion, label."""
    rows = [{"prompt": q, "completion": good if n % 2 else bad, "label": bool(n % 2)} for n, (q, good, bad) in enumerate(sum_rows(8))]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


# (tool, the stored file, model_type of its stand-in, dataset writer, the preference section the conversion must write)
CASES = [
    ("llama-factory", "examples/train_lora/qwen3_lora_dpo.yaml", "qwen3", llama_factory_ranking, {"method": "dpo", "loss_type": ["sigmoid"], "beta": 0.1}),
    ("llama-factory", "examples/train_lora/qwen3_lora_kto.yaml", "qwen3", llama_factory_kto, {"method": "kto", "beta": 0.1}),
    ("llama-factory", "examples/train_lora/qwen3_lora_reward.yaml", "qwen3", llama_factory_ranking, {"method": "reward"}),
    ("axolotl", "examples/llama-3/instruct-dpo-lora-8b.yml", "llama", axolotl_conversation, {"method": "dpo"}),
    ("axolotl", "examples/mistral/orpo/mistral-qlora-orpo.yml", "mistral", axolotl_argilla, {"method": "orpo", "beta": 0.1}),
    ("axolotl", "examples/qwen2/dpo.yaml", "qwen2", axolotl_conversation, {"method": "dpo"}),
    ("axolotl", "examples/qwen2/reward-model.yaml", "qwen2", axolotl_intel, {"method": "reward"}),
    ("axolotl", "examples/llama-3/qlora-1b-kto.yaml", "llama", axolotl_kto, {"method": "kto", "beta": 0.5, "desirable_weight": 0.2}),
]
# Each method's own figures in metrics.jsonl, besides loss (docs/preference.md, "Metrics").
FIGURES = {"dpo": {"rewards_accuracy", "rewards_margin"}, "kto": {"kl", "rewards_chosen"}, "orpo": {"log_odds_ratio", "nll_loss"},
           "reward": {"mean_reward", "rewards_accuracy"}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from zeropipe.data.tokenizer import train_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer([text for row in sum_rows(64) for text in row], 300, folder)
    return folder


def stand_in(model_type: str, tokenizer_dir: Path, folder: Path) -> Path:
    """A random-weight tiny causal LM of the peer's architecture, saved as a pretrained folder with the trained tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    extra = {"head_dim": 8} if model_type == "qwen3" else {}
    config = AutoConfig.for_model(model_type, **TINY, **extra)
    # Read beside a config.json, the tokenizer is the architecture's class (Qwen2Tokenizer adds <|endoftext|>): sized as read so.
    config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    config.vocab_size = len(AutoTokenizer.from_pretrained(folder))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def peer_config_on_stand_ins(tool: str, file: str, model: Path, write_data, workdir: Path) -> tuple[Path, dict[str, tuple]]:
    """The peer's file with its model (and axolotl's dataset path) pointed at the stand-ins; returns it and what was swapped."""
    source = yaml.safe_load((PEERS / tool / file).read_text())
    model_key = "model_name_or_path" if tool == "llama-factory" else "base_model"
    swapped = {model_key: (source[model_key], str(model))}
    source[model_key] = str(model)
    if tool == "llama-factory":
        # The dataset name stays (dpo_en_demo / kto_en_demo); LLaMA-Factory's own dataset_info.json describes the file.
        (workdir / "data").mkdir()
        shutil.copy(PEERS / "llama-factory" / "data" / "dataset_info.json", workdir / "data")
        write_data(workdir / "data")
        swapped[f"dataset {source['dataset']}"] = ("LLaMA-Factory's demo file", "a tiny file of the same layout")
    else:
        data = workdir / "records.jsonl"
        write_data(data)
        swapped["datasets[0].path"] = (source["datasets"][0]["path"], str(data))
        source["datasets"][0]["path"] = str(data)
    peer_file = workdir / Path(file).name
    peer_file.write_text(yaml.safe_dump(source, sort_keys=False))
    return peer_file, swapped


def load_export(out: Path, model: Path, reward: bool):
    """The export as a user loads it: a peft adapter on the stand-in base, or a transformers directory."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    auto = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    if not (out / "adapter_config.json").is_file():
        return auto.from_pretrained(out, dtype=torch.float32)
    # A reward adapter (peft's SEQ_CLS, its score head saved with it) goes on the base as a one-label classifier.
    head = {"num_labels": 1, "pad_token_id": AutoTokenizer.from_pretrained(out).pad_token_id} if reward else {}
    return PeftModel.from_pretrained(auto.from_pretrained(model, dtype=torch.float32, **head), out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("tool", "file", "model_type", "write_data", "expected"), CASES, ids=[f"{case[0]}/{Path(case[1]).stem}" for case in CASES])
def test_a_peers_preference_example_converts_and_trains_on_a_tiny_stand_in(tool, file, model_type, write_data, expected, tokenizer_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from zeropipe.check import check_config
    from zeropipe.config.load import validate_config
    from zeropipe.engine.trainer import Trainer
    from zeropipe.families import export_run, family_of
    from zeropipe.launch.prepare import prepare_run
    from zeropipe.launch.resolve import resolve_run
    from zeropipe.rundir import RunDir

    model = stand_in(model_type, tokenizer_dir, tmp_path / "model")
    peer_file, swapped = peer_config_on_stand_ins(tool, file, model, write_data, tmp_path)
    monkeypatch.chdir(tmp_path)  # where LLaMA-Factory's users run it: dataset_dir (data/) is relative to it
    conversion = convert_file(peer_file)
    assert not conversion.blocking, conversion.blocking
    raw = conversion.raw()
    # The objective the peer asked for, and the stand-ins in the places the peer's keys named.
    assert {key: raw["preference"].get(key) for key in expected} == expected
    assert raw["model"]["path"] == str(model) and Path(raw["data"]["path"]).parent in (tmp_path, tmp_path / "data")
    print(f"\n{tool}/{file}: swapped {swapped}; the rest as converted")

    # Where the run goes, how long it is, one CPU rank. `check` accepts the rest as converted.
    raw["run"]["output_dir"] = str(tmp_path / "runs")
    raw["train"]["max_steps"] = STEPS
    raw["hardware"] = {"gpus": 1, "accelerator": "cpu"}
    errors = [f for f in check_config(resolve_run(validate_config(raw))) if f.severity == "error"]
    assert not errors, errors
    # The peers' bf16 on a CPU without bf16 (the suite's, tests/conftest.py) is check's warning ZP019, 18-56x
    # slower than fp32: this test runs fp32, as the warning says to.
    assert raw["deepspeed"]["precision"] == "bf16"
    raw["deepspeed"]["precision"] = "fp32"
    raw["train"]["gradient_accumulation_steps"] = 1  # CI time: one micro-batch (of the converted size) a step
    prepared = prepare_run(resolve_run(validate_config(raw)))

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port()), "DS_ACCELERATOR": "cpu"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("ZEROPIPE_LAUNCHER_PID", raising=False)
    run = RunDir(prepared.run.path)
    trainer = Trainer(run.path, family_of(run.read_config().model).rank_task)
    trainer.setup()
    stage = trainer.engine.zero_optimization_stage()
    trainer.train()
    trainer.cleanup()

    method = expected["method"]
    assert run.read_config().preference.method == method
    rows = run.read_metrics()
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) for row in rows), rows
    assert FIGURES[method] <= set(rows[-1]), f"{method}: {sorted(rows[-1])}"
    if method in ("dpo", "kto") and "lora" not in raw["model"]:
        assert (run.cache / "reference_logps.npy").is_file(), "a full DPO/KTO run's reference is precomputed"

    out = export_run(run.path, tmp_path / "export", dtype="fp32")
    loaded = load_export(out, model, reward=method == "reward").eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        output = loaded(**tokenizer(["What is 3 + 3?"], return_tensors="pt")).logits
    assert torch.isfinite(output).all() and output.shape[-1] == (1 if method == "reward" else len(tokenizer))
    print(f"{tool}/{file}: ZeRO-{stage}, losses {[round(row['loss'], 4) for row in rows]}, export {sorted(p.name for p in out.iterdir())}")
