"""Checkpoints published already in fp8 by transformers' fine-grained FP8 layout (Qwen3-*-FP8, DeepSeek-V3).

config.json says ``quantization_config: {quant_method: fp8, weight_block_size: [bn, bk]}``; each
quantized linear's weight is float8_e4m3fn with a float32 ``weight_scale_inv`` grid, one value per
block of bn x bk. The test writes such a checkpoint itself (as transformers' FP8 quantizer does:
the scale of a block is its absmax / 448) and loads it with the streaming loader.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.conftest import TINY_LLAMA
from zeropipe.errors import CheckpointError
from zeropipe.models.loading import load_pretrained
from zeropipe.models.quantized import SCALE_KEY, QuantizedLinear, QuantizedStorage, apply_block_scale, dequantize, quantize

E4M3_LARGEST = 448.0
BLOCK = (16, 32)  # rows and columns blocked differently; every tiny dimension a multiple, as transformers needs to dequantize it


def block_quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 block-scale grid) as transformers' fine-grained FP8 writes them."""
    rows, cols = weight.shape
    grid = torch.zeros(math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = weight[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].abs().max() / E4M3_LARGEST
    expanded = grid.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() / expanded).clamp(-E4M3_LARGEST, E4M3_LARGEST).to(torch.float8_e4m3fn), grid


def write_fine_grained_fp8(directory, block=BLOCK, seed=0):
    """A tiny Llama as a fine-grained FP8 checkpoint; returns its weights dequantized (what the file means) and the file's tensors."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=300)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    tensors, meaning = {}, {}
    for name, value in model.state_dict().items():
        if ".layers." in name and name.endswith("proj.weight"):
            fp8, grid = block_quantize(value, block)
            tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = fp8, grid
            meaning[name] = apply_block_scale(fp8.float(), grid, block)
        else:
            tensors[name] = meaning[name] = value.clone()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    fields = config.to_dict()
    fields["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
    (directory / "config.json").write_text(json.dumps(fields))
    return meaning, tensors


def test_a_fine_grained_fp8_checkpoint_loads_as_stored_and_trains_lora(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config

    meaning, stored = write_fine_grained_fp8(tmp_path / "fp8")
    model = load_pretrained(AutoModelForCausalLM, tmp_path / "fp8", dtype=torch.float32, zero_stage=0, device="cpu", quantize=QuantizedStorage("fp8"))
    layers = {name: module for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}
    assert len(layers) == 2 * 7
    q_proj = layers["model.layers.0.self_attn.q_proj"]
    # The file's bytes and block grid, as stored: no second rounding.
    assert torch.equal(q_proj.weight, stored["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8))
    assert q_proj.block_size == BLOCK and torch.equal(getattr(q_proj, SCALE_KEY), stored["model.layers.0.self_attn.q_proj.weight_scale_inv"])
    for name, module in layers.items():
        assert torch.equal(module.dequantized_weight(), meaning[name + ".weight"]), name

    # transformers, reading the same file with its own fine-grained FP8 dequantization, computes the same numbers:
    # the file is in its layout, and this loader reads it as transformers means it.
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True))
    assert torch.equal(reference.state_dict()["model.layers.1.mlp.up_proj.weight"], meaning["model.layers.1.mlp.up_proj.weight"])
    ids = torch.tensor([[1, 5, 9, 14, 20, 33, 41, 7]])
    with torch.no_grad():
        assert torch.allclose(model.eval()(ids).logits, reference.eval()(ids).logits, atol=1e-5)

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.train()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    losses = []
    for _ in range(6):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.97, losses
    assert all(module.weight.grad is None for module in layers.values())

    # fp8 tensors of layers kept in the training precision (a VLM's vision tower) are upcast with their block scales, row chunk by row chunk.
    part = load_pretrained(
        AutoModelForCausalLM, tmp_path / "fp8", dtype=torch.float32, zero_stage=0, device="cpu", quantize=QuantizedStorage("fp8"),
        quantize_select=lambda name: ".layers.0." in name,
    )
    kept = part.get_submodule("model.layers.1.mlp.down_proj")
    assert type(kept) is torch.nn.Linear and torch.equal(kept.weight, meaning["model.layers.1.mlp.down_proj.weight"])

    # The export's base is that checkpoint in full precision (dequantized on any machine), with the run's adapters on it.
    from zeropipe.config.load import validate_config
    from zeropipe.families.causal_lm.model import causal_lm_for_export

    run = validate_config({"model": {"path": str(tmp_path / "fp8"), "lora": {"r": 4}, "quantization": "fp8"}, "data": {"synthetic": {"task": "arithmetic"}}})
    exported = causal_lm_for_export(run)
    assert torch.equal(exported.get_base_model().model.layers[0].mlp.down_proj.weight, meaning["model.layers.0.mlp.down_proj.weight"])

    # Without model.quantization the file is not silently read as bf16 numbers: it names the setting.
    with pytest.raises(CheckpointError, match="fine-grained FP8 checkpoint .*set model.quantization: fp8"):
        load_pretrained(AutoModelForCausalLM, tmp_path / "fp8", dtype=torch.float32, zero_stage=0, device="cpu")
    # A grid that does not match config.json's block is named with the fix.
    fields = AutoConfig.from_pretrained(tmp_path / "fp8")
    fields.quantization_config["weight_block_size"] = [32, 32]
    with pytest.raises(CheckpointError, match=r"weight_scale_inv .* needs \(\d+, \d+\): set quantization_config.weight_block_size"):
        load_pretrained(AutoModelForCausalLM, tmp_path / "fp8", dtype=torch.float32, zero_stage=0, device="cpu", config=fields, quantize=QuantizedStorage("fp8"))


def test_keeping_the_block_scales_is_exact_where_re_quantizing_per_channel_rounds_again():
    """Why the block grid is stored rather than re-quantized to one scale per channel (the module docstring's figures, on 1024x1024)."""
    # A grid whose last row and column blocks are narrower (real widths need not be multiples of 128).
    grid = torch.rand(3, 3) + 0.5
    ones = torch.ones(5, 7)
    assert torch.equal(apply_block_scale(ones.clone(), grid, (2, 3)), grid.repeat_interleave(2, 0)[:5].repeat_interleave(3, 1)[:, :7])
    torch.manual_seed(0)
    weight = torch.randn(1024, 1024)
    fp8, grid = block_quantize(weight, (128, 128))
    stored = apply_block_scale(fp8.float(), grid, (128, 128))
    as_blocks = dequantize(fp8.view(torch.uint8), grid, torch.float8_e4m3fn, torch.float32, (128, 128))
    assert torch.equal(as_blocks, stored)
    per_channel = dequantize(*quantize(stored, QuantizedStorage("fp8", "channel")), torch.float8_e4m3fn, torch.float32)
    again = ((per_channel - stored).norm() / stored.norm()).item()
    assert 0.015 < again < 0.04, again  # a second rounding of about fp8's own error


@pytest.mark.parametrize("finetuning", ["lora", "full"])
def test_llama_factory_on_a_fine_grained_fp8_base_keeps_it_for_lora_and_refuses_a_full_fine_tune(tmp_path, finetuning):
    from zeropipe.convert import convert_file

    base = tmp_path / "Qwen3-8B-FP8"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "qwen3", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.json").write_text('[{"instruction": "hi", "output": "yo"}]')
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "train.json"}}))
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(f"model_name_or_path: {base}\nstage: sft\ndo_train: true\nfinetuning_type: {finetuning}\nquantization_bit: 4\ndataset: mine\ndataset_dir: {tmp_path / 'data'}\n")
    conversion = convert_file(recipe)
    if finetuning == "lora":
        assert conversion.entries["model.quantization.format"].value == "fp8" and "model.quantization.load_in_4bit" not in conversion.entries
        assert not conversion.blocking
    else:
        assert any("full fine-tune cannot update weights stored in fp8" in reason for reason in conversion.blocking)
