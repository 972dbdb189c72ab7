"""Configs of diffusion-pipe, axolotl and LLaMA-Factory, written as their users write them, converted and trained.

Each test writes the other tool's files pointing at a tiny local model and small generated data,
then trains through `zeropipe train` on 2 CPU ranks in fp32: the run must finish and learn.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.integration.conftest import TINY_LLAMA, assert_ok, metrics, zeropipe, zeropipe_here

pytestmark = pytest.mark.integration


@pytest.fixture
def tiny_llama(tmp_path) -> Path:
    """A pretrained-style HF folder (safetensors, config.json, tokenizer), as a downloaded base model is."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from zeropipe.data.synthetic import generate_dataset
    from zeropipe.data.tokenizer import train_tokenizer

    data = generate_dataset("arithmetic", 200, 0, tmp_path / "corpus.jsonl")
    texts = [v for line in data.read_text().splitlines() for v in json.loads(line).values()]
    directory = tmp_path / "Llama-tiny"
    tokenizer = train_tokenizer(texts, 300, directory)
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**fields, vocab_size=len(tokenizer))).save_pretrained(directory, safe_serialization=True)
    return directory


def alpaca_records(count: int, offset: int = 0) -> list[dict]:
    return [{"instruction": f"What is {(i + offset) % 9} + 3?", "input": "", "output": str((i + offset) % 9 + 3)} for i in range(count)]


def chat_records(count: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"Reverse the word: {w}"}, {"role": "assistant", "content": w[::-1]}]}
        for w in (["cat", "dog", "sun", "map", "pen", "cup"] * count)[:count]
    ]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def fell(run_dir: Path) -> tuple[float, float]:
    rows = [row for row in metrics(run_dir) if row.get("kind") != "eval"]
    first = sum(row["loss"] for row in rows[:2]) / 2
    last = sum(row["loss"] for row in rows[-2:]) / 2
    return first, last


def test_axolotl_lora_yaml_trains_directly(tmp_path, tiny_llama):
    """`zeropipe train axolotl.yml`: two datasets (alpaca, chat_template) become a mixture, LoRA on every linear layer, the user's DeepSpeed JSON."""
    write_jsonl(tmp_path / "math.jsonl", alpaca_records(160))
    write_jsonl(tmp_path / "words.jsonl", chat_records(80))
    (tmp_path / "zero2.json").write_text(json.dumps({
        "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True},
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }))
    config = tmp_path / "lora.yml"
    config.write_text(f"""\
base_model: {tiny_llama}
model_type: LlamaForCausalLM
tokenizer_type: AutoTokenizer

load_in_8bit: false
load_in_4bit: false
strict: false

datasets:
  - path: math.jsonl
    type: alpaca
  - path: words.jsonl
    ds_type: json
    type: chat_template
    field_messages: messages
    message_property_mappings:
      role: role
      content: content
dataset_prepared_path: last_run_prepared
val_set_size: 0.0
output_dir: {tmp_path / 'outputs' / 'lora-out'}

adapter: lora
lora_model_dir:
lora_r: 8
lora_alpha: 16
lora_dropout: 0.0
lora_target_linear: true

sequence_len: 32
sample_packing: false
pad_to_sequence_len: true

wandb_project:
gradient_accumulation_steps: 1
micro_batch_size: 8
max_steps: 12
optimizer: adamw_torch
lr_scheduler: cosine
learning_rate: 0.02
train_on_inputs: false
bf16: false
fp16: false
gradient_checkpointing: false
logging_steps: 4
warmup_steps: 2
deepspeed: zero2.json
weight_decay: 0.0
special_tokens:
  pad_token: "<pad>"
""")
    result = zeropipe("train", config, "generate.max_new_tokens=4", cwd=tmp_path)
    assert_ok(result)
    converted = tmp_path / "lora.zeropipe.yaml"
    assert f"{config} is written for axolotl: converted it to {converted}" in result.stderr
    assert "special_tokens: the tokenizer's own special tokens are used" in result.stderr
    written = yaml.safe_load(converted.read_text())
    assert written["data"]["mixture"] == [
        {"path": str(tmp_path / "math.jsonl"), "format": "alpaca", "weight": 160.0},
        {"path": str(tmp_path / "words.jsonl"), "format": "chat", "weight": 80.0},
    ]
    run_dir = tmp_path / "outputs" / "lora-out"
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == 2 and ds_config["train_micro_batch_size_per_gpu"] == 8 and ds_config["bf16"]["enabled"] is False
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12
    # LoRA on every linear layer of the 2 blocks (q, k, v, o, gate, up, down), nothing else trains.
    assert 0 < summary["parameters"]["trainable"] < summary["parameters"]["total"] / 5
    first, last = fell(run_dir)
    assert all(map(torch.isfinite, torch.tensor([first, last]))) and last < first


def test_llama_factory_yaml_with_dataset_info_converts_then_trains(tmp_path, tiny_llama):
    """`zeropipe convert` then `zeropipe train`: dataset_info.json's sharegpt and alpaca entries, a full fine-tune under ZeRO-3 from the user's JSON."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "identity.json").write_text(json.dumps([
        {"conversations": [{"from": "human", "value": f"What is {i % 9} + 3?"}, {"from": "gpt", "value": str(i % 9 + 3)}]} for i in range(120)
    ]))
    (data / "math_demo.json").write_text(json.dumps(alpaca_records(120, offset=4)))
    (data / "dataset_info.json").write_text(json.dumps({
        "identity": {"file_name": "identity.json", "formatting": "sharegpt", "columns": {"messages": "conversations"}},
        "math_demo": {"file_name": "math_demo.json"},
        "remote_only": {"hf_hub_url": "someone/some-dataset"},
    }, indent=2))
    (tmp_path / "ds_z3_config.json").write_text(json.dumps({
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True,
                              "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto", "stage3_gather_16bit_weights_on_model_save": True},
    }))
    config = tmp_path / "llama_full_sft.yaml"
    config.write_text(f"""\
### model
model_name_or_path: {tiny_llama}
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: full
deepspeed: ds_z3_config.json

### dataset
dataset: identity,math_demo
template: llama3
cutoff_len: 32
overwrite_cache: true
preprocessing_num_workers: 2

### output
output_dir: {tmp_path / 'saves' / 'tiny' / 'full' / 'sft'}
logging_steps: 4
save_steps: 100
plot_loss: true
overwrite_output_dir: true

### train
per_device_train_batch_size: 8
gradient_accumulation_steps: 1
learning_rate: 5.0e-3
max_steps: 12
lr_scheduler_type: cosine
warmup_ratio: 0.25
bf16: false
ddp_timeout: 180000000
disable_gradient_checkpointing: true
""")
    out = tmp_path / "converted.yaml"
    converted = zeropipe_here("convert", config, "--out", out, cwd=tmp_path)  # the CLI's code, without a new interpreter's start-up
    assert_ok(converted)
    assert f"train it: zeropipe train {out}" in converted.stderr
    text = out.read_text()
    assert "zero_stage: 3  # read from ds_z3_config.json" in text
    assert "warmup_steps: 3  # from warmup_ratio = 0.25 x max_steps 12" in text
    assert "dataset remote_only" not in text  # not asked for by dataset:, so not mentioned
    assert "template: ZeRO-Pipe renders conversations with the tokenizer's own chat template" in text
    written = yaml.safe_load(text)
    assert "lora" not in written["model"]  # finetuning_type: full
    assert [source["format"] for source in written["data"]["mixture"]] == ["sharegpt", "alpaca"]

    result = zeropipe("train", out, "generate.max_new_tokens=4", cwd=tmp_path)
    assert_ok(result)
    run_dir = tmp_path / "saves" / "tiny" / "full" / "sft"
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == 3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["parameters"]["trainable"] == summary["parameters"]["total"]
    first, last = fell(run_dir)
    assert last < first


def test_diffusion_pipe_toml_with_two_directories_trains_lora(tmp_path):
    """`zeropipe train main.toml`: a tiny SDXL pipeline, two [[directory]] entries (one repeated 3x) as kohya links, LoRA."""
    from zeropipe.data.images import generate_shapes_dataset
    from zeropipe.families.diffusion.pipelines import build_tiny_pipeline

    pipeline = tmp_path / "sdxl-tiny"
    build_tiny_pipeline({"pipeline": "tiny-sdxl"}, pipeline, seed=0)
    shapes = generate_shapes_dataset(tmp_path / "generated", 24, seed=1, resolution=32) / "1_shapes"
    # Two flat folders of images with .txt captions, as diffusion-pipe users keep them.
    folders = [tmp_path / "images" / "style", tmp_path / "images" / "subject"]
    for number, folder in enumerate(folders):
        folder.mkdir(parents=True)
        for image in sorted(shapes.glob("*.png"))[number * 12:(number + 1) * 12]:
            (folder / image.name).write_bytes(image.read_bytes())
            (folder / image.with_suffix(".txt").name).write_text(image.with_suffix(".txt").read_text())
    (tmp_path / "dataset.toml").write_text(f"""\
resolutions = [32]
enable_ar_bucket = true
min_ar = 0.5
max_ar = 2.0
num_ar_buckets = 7
frame_buckets = [1]

[[directory]]
path = '{folders[0]}'
num_repeats = 1

[[directory]]
path = '{folders[1]}'
num_repeats = 3
""")
    config = tmp_path / "sdxl_lora.toml"
    config.write_text(f"""\
output_dir = '{tmp_path / "training_runs"}'
dataset = 'dataset.toml'

epochs = 1000
max_steps = 10
micro_batch_size_per_gpu = 4
pipeline_stages = 1
gradient_accumulation_steps = 1
gradient_clipping = 1.0
warmup_steps = 1
save_every_n_epochs = 2
activation_checkpointing = false
save_dtype = 'bfloat16'
caching_batch_size = 1
steps_per_print = 1

[model]
type = 'sdxl'
checkpoint_path = '{pipeline}'
dtype = 'float32'

[adapter]
type = 'lora'
rank = 8
dtype = 'bfloat16'

[optimizer]
type = 'adamw_optimi'
lr = 2e-2
betas = [0.9, 0.99]
weight_decay = 0.01
eps = 1e-8
""")
    result = zeropipe("train", config, "generate.prompts=[]", cwd=tmp_path)
    assert_ok(result)
    links = tmp_path / "dataset.zeropipe-images"
    assert {link.name: link.resolve() for link in links.iterdir()} == {"1_style": folders[0], "3_subject": folders[1]}
    converted = (tmp_path / "sdxl_lora.zeropipe.yaml").read_text()
    assert "zero_stage: 2  # pipeline_stages = 1 is data parallel" in converted
    assert "save_every_n_epochs: ZeRO-Pipe saves every N optimizer steps" in result.stderr
    run_dir = tmp_path / "training_runs" / "sdxl_lora"
    plan = json.loads((run_dir / "run.json").read_text())
    # 12 images once and 12 images three times: 48 examples per epoch.
    assert plan["examples"] == 48, plan
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 10
    assert 0 < summary["parameters"]["trainable"] < 0.2 * summary["parameters"]["total"]
    assert summary["fixed_batch_loss_end"] < summary["fixed_batch_loss_start"], summary


def test_llama_factorys_own_lora_ds3_example_trains_as_written(tmp_path, tiny_llama):
    """LLaMA-Factory's examples/train_lora/qwen3_lora_sft_ds3.yaml with its ds_z3_config.json and dataset_info.json (tests/fixtures/peers),
    only the Hub model and the demo data replaced by tiny local stand-ins: `zeropipe train FILE` from the LLaMA-Factory root, as its users run it."""
    import shutil

    peers = Path(__file__).resolve().parents[1] / "fixtures" / "peers" / "llama-factory"
    root = tmp_path / "LLaMA-Factory"
    (root / "examples" / "train_lora").mkdir(parents=True)
    shutil.copytree(peers / "examples" / "deepspeed", root / "examples" / "deepspeed")
    (root / "data").mkdir()
    shutil.copy(peers / "data" / "dataset_info.json", root / "data")
    (root / "data" / "identity.json").write_text(json.dumps(alpaca_records(64)))
    (root / "data" / "alpaca_en_demo.json").write_text(json.dumps(alpaca_records(64, offset=3)))
    example = (peers / "examples" / "train_lora" / "qwen3_lora_sft_ds3.yaml").read_text()
    config = root / "examples" / "train_lora" / "qwen3_lora_sft_ds3.yaml"
    config.write_text(example.replace("Qwen/Qwen3-4B-Instruct-2507", str(tiny_llama)).replace("output_dir: saves", f"output_dir: {tmp_path / 'saves'}"))

    # Six steps in fp32 (bf16 on this CPU gains nothing): the two overrides are the only change to what the file asks.
    result = zeropipe("train", config, "train.max_steps=6", "deepspeed.precision=fp32", "generate.max_new_tokens=2", cwd=root)
    assert_ok(result)
    run_dir = tmp_path / "saves" / "qwen3-4b" / "lora" / "sft"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    # What ran is what config.yaml says: the JSON's ZeRO-3, the file's lr and cosine schedule, LLaMA-Factory's LoRA.
    assert ds_config["zero_optimization"]["stage"] == saved["deepspeed"]["zero_stage"] == 3
    assert ds_config["optimizer"]["params"]["lr"] == saved["train"]["lr"] == 1e-4
    assert ds_config["scheduler"]["type"] == "WarmupCosineLR" and saved["train"]["schedule"] == "cosine"
    assert ds_config["bf16"]["enabled"] is False and ds_config["fp16"]["enabled"] is False and saved["deepspeed"]["precision"] == "fp32"
    assert saved["model"]["lora"]["r"] == 8 and saved["model"]["lora"]["target_modules"] == "all-linear"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6
