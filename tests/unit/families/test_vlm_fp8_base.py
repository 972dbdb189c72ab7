"""A vision-language model's LoRA on an fp8 base, one real rank under ZeRO-3 in this process (gloo, world size 1).

The language model's block linears are stored as fp8 bytes (what ZeRO-3 partitions), the vision
tower stays in the training precision; the adapter trains, and its export loads with peft onto
the bf16 base the run started from and changes its answers.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_vlm import TINY_LLAVA
from tests.diffusion_contract import one_rank, prepare

CAPTIONS = ["a red circle on a blue background", "a green square on a white background", "a yellow triangle on a black background", "Describe the image."]


@pytest.fixture(autouse=True)
def cpu_deepspeed(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


@pytest.fixture
def llava_base(tmp_path):
    """A tiny pretrained-style LLaVA directory (bf16 safetensors + processor)."""
    from transformers import CONFIG_MAPPING, AutoModelForImageTextToText

    from zeropipe.families.vlm.model import build_processor, resolve_inline_config

    directory = tmp_path / "llava-base"
    processor = build_processor(TINY_LLAVA, CAPTIONS * 4, 300, directory)
    fields = dict(resolve_inline_config(TINY_LLAVA, processor.tokenizer).fields)
    config = CONFIG_MAPPING[fields.pop("model_type")](**fields)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def test_vlm_lora_trains_on_an_fp8_language_model_under_zero3_and_its_adapter_loads_on_the_bf16_base(tmp_path, monkeypatch, llava_base):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from zeropipe.families import export_run
    from zeropipe.models.quantized import QuantizedLinear

    raw = {
        "run": {"name": "vlm-fp8", "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"path": str(llava_base), "trainable": ["language_model"], "lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "quantization": "fp8"},
        "data": {"synthetic": {"task": "shapes", "examples": 16}, "max_seq_len": 48},
        "train": {"max_steps": 4, "micro_batch_size": 4, "lr": 2e-2, "schedule": "constant", "log_every": 1, "save_every": 4},
        "deepspeed": {"zero_stage": 3, "precision": "fp32"},
        "hardware": {"gpus": 1, "accelerator": "cpu"},
        "generate": {"prompts": None},
    }
    run = prepare(raw).run
    trainer = one_rank(run.path, monkeypatch)
    trainer.setup()
    assert trainer.engine.zero_optimization_stage() == 3
    modules = dict(trainer.engine.module.named_modules())
    quantized = {name for name, module in modules.items() if isinstance(module, QuantizedLinear)}
    # Every q/k/v/o and MLP projection of the 2 language-model layers; nothing of the vision tower or projector.
    assert len(quantized) == 2 * 7 and all(".language_model.layers." in name for name in quantized), sorted(quantized)
    assert not any(isinstance(module, QuantizedLinear) for name, module in modules.items() if "vision_tower" in name or "projector" in name)
    weight = modules[sorted(quantized)[0]].weight
    # ZeRO-3 partitions the fp8 bytes themselves: one byte per weight in the rank's partition.
    assert weight.dtype == torch.uint8 and weight.ds_tensor.dtype == torch.uint8 and weight.ds_numel == weight.ds_shape.numel()
    trainer.train()
    losses = [row["loss"] for row in run.read_metrics() if row.get("kind") is None]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    trainer.cleanup()
    unset_hf_deepspeed_config()  # the rank's ZeRO-3 config for transformers; a real rank exits here

    adapter = export_run(run.path, tmp_path / "adapter")
    base = AutoModelForImageTextToText.from_pretrained(llava_base, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 14, 20, 33]])
    with torch.no_grad():
        before = base(input_ids=ids).logits
        after = PeftModel.from_pretrained(base, adapter).eval()(input_ids=ids).logits
    assert (after - before).abs().max() > 1e-4, "the adapter trained on the fp8 base changed nothing on the bf16 base"


def test_the_planner_counts_only_the_language_models_block_linears_in_fp8(tmp_path, llava_base):
    from zeropipe.config.load import validate_config
    from zeropipe.families import family_named

    raw = {"model": {"path": str(llava_base), "lora": {"r": 4}, "quantization": "fp8"}, "data": {"synthetic": {"task": "shapes"}}}
    family = family_named("vlm")
    config = validate_config(raw)
    assert family.config_problems(config) == []
    spec = family.model_spec(config)
    text = TINY_LLAVA["text_config"]
    hidden, kv, inner = text["hidden_size"], text["hidden_size"] // text["num_attention_heads"] * text["num_key_value_heads"], text["intermediate_size"]
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inner
    assert spec.fp8_base.params_fp8 == text["num_hidden_layers"] * per_layer  # the CLIP tower's layers are not counted
