"""The fp8 frozen base in one process: the layer's arithmetic and memory, the three tiny diffusion
transformers (Wan, Qwen-Image, FLUX.1) loaded quantized from bf16 and trained with LoRA, and a
ComfyUI-layout ``fp8_scaled`` file read as it is stored and trained. Under ZeRO-3 on 2 ranks:
tests/integration/test_quantized_base.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tests.unit.diffusion.test_single_file import original_layout
from zeropipe.families.diffusion.entries import architecture_named
from zeropipe.errors import CheckpointError
from zeropipe.models.loading import load_pretrained
from zeropipe.models.quantized import SCALE_KEY, DequantizedMatmul, QuantizedLinear, QuantizedStorage, dequantize, quantize, quantize_model


@pytest.mark.parametrize("format", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("scale", ["channel", "tensor"])
def test_the_layer_computes_with_the_dequantized_weight_and_saves_no_upcast_copy(format, scale):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40).requires_grad_(False)
    with torch.no_grad():
        linear.weight[3] *= 50  # one loud channel: per-channel scales keep the others fine
    model = torch.nn.Sequential()
    model.add_module("blocks", torch.nn.ModuleList([torch.nn.Sequential(linear)]))
    assert quantize_model(model, QuantizedStorage(format, scale)) == 1
    layer = model.blocks[0][0]
    assert isinstance(layer, QuantizedLinear) and layer.weight.dtype == torch.uint8 and layer.weight.numel() == 48 * 40
    weight = layer.dequantized_weight()
    relative = ((weight - linear.weight).norm(dim=1) / linear.weight.norm(dim=1)).max()
    assert relative < (0.04 if format == "fp8" else 0.08) * (1 if scale == "channel" else 10)
    if scale == "tensor":
        assert torch.unique(getattr(layer, SCALE_KEY)).numel() == 1

    x = torch.randn(2, 7, 48, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    assert torch.allclose(out, torch.nn.functional.linear(x, weight, linear.bias), atol=1e-5)
    assert not any(t.dtype.is_floating_point and t.shape == (40, 48) for t in saved), "a full-precision weight is kept for backward"
    out.square().sum().backward()
    expected = torch.autograd.grad(torch.nn.functional.linear(x, weight, linear.bias).square().sum(), x)[0]
    assert torch.allclose(x.grad, expected, atol=1e-4)


def test_e4m3_rounds_to_nearest_and_zero_rows_stay_zero():
    weight = torch.zeros(3, 4)
    weight[1] = torch.tensor([1.0, -2.0, 0.5, 448.0])
    stored, scale = quantize(weight, QuantizedStorage("fp8"))
    assert scale[0] == 1 and torch.equal(dequantize(stored, scale, torch.float8_e4m3fn, torch.float32)[1], weight[1])
    assert torch.equal(dequantize(stored, scale, torch.float8_e4m3fn, torch.float32)[0], weight[0])
    assert DequantizedMatmul is not None


def denoiser_inputs(arch, model, seed):
    generator = torch.Generator().manual_seed(seed)
    inputs = arch.call.trace_inputs(model.config, 8, 1 if not arch.record.video else 2, 6, torch.float32)
    return {key: (torch.randn(value.shape, generator=generator) if torch.is_tensor(value) and value.is_floating_point() else value) for key, value in inputs.items()}


def output_of(model, inputs):
    out = model(**inputs, return_dict=False)[0]
    return out


@pytest.mark.parametrize("name", ["wan", "qwen-image", "flux"])
def test_a_tiny_diffusion_transformer_loads_quantized_from_bf16_and_trains_lora(tmp_path, name):
    from peft import LoraConfig

    from zeropipe.models.common import resolve_lora_targets

    arch = architecture_named(name)
    cls = arch.model_class()
    torch.manual_seed(0)
    reference = cls.from_config(arch.record.preset[arch.record.denoiser]).to(torch.bfloat16)
    reference.save_pretrained(tmp_path)
    reference = reference.float().eval()
    model = load_pretrained(
        lambda: cls.from_config(cls.load_config(str(tmp_path))), tmp_path, dtype=torch.float32, zero_stage=0, device="cpu",
        stem="diffusion_pytorch_model", quantize=QuantizedStorage("fp8"),
    )
    quantized = [module for module in model.modules() if isinstance(module, QuantizedLinear)]
    stored = sum(module.weight.numel() for module in quantized)
    total = sum(p.numel() for p in model.parameters())
    assert stored > total / 2, f"only {stored} of {total} weights stored in fp8"
    inputs = denoiser_inputs(arch, model, 1)
    with torch.no_grad():
        expected, got = output_of(reference, inputs), output_of(model.eval(), inputs)
    assert (got - expected).norm() / expected.norm() < 0.1

    model.requires_grad_(False)
    lora = type("Lora", (), {"target_modules": "auto"})()
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=resolve_lora_targets(lora, arch.record.lora_targets)))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    optimizer = torch.optim.Adam(trainable, lr=3e-2)
    target = torch.zeros_like(expected)
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.mse_loss(output_of(model, inputs), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.95, losses
    assert all(module.weight.grad is None for module in quantized)


def write_comfy_fp8_scaled(path, seed=5):
    """A tiny Wan transformer as ComfyUI writes an fp8_scaled file: block linears in e4m3 with a per-tensor scale_weight, the rest bf16."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**architecture_named("wan").record.preset["transformer"])
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    stored = {}
    for key, value in state.items():
        if key.startswith("blocks.") and key.endswith(".weight") and value.dim() == 2:
            scale = value.abs().max().float() / torch.finfo(torch.float8_e4m3fn).max
            stored[key] = (value.float() / scale).to(torch.float8_e4m3fn)
            stored[key[: -len("weight")] + "scale_weight"] = scale.reshape(())
        else:
            stored[key] = value.to(torch.bfloat16)
    stored["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(original_layout(stored), str(path))
    return model, stored


def test_a_comfyui_fp8_scaled_file_loads_as_stored_and_trains(tmp_path):
    from diffusers import WanTransformer3DModel

    from zeropipe.families.diffusion.pipelines import single_file_renamer

    file = tmp_path / "wan2.1_t2v_tiny_fp8_scaled.safetensors"
    full, stored = write_comfy_fp8_scaled(file)
    rename = single_file_renamer("WanTransformer3DModel", file)
    config = dict(architecture_named("wan").record.preset["transformer"])

    with pytest.raises(CheckpointError, match="set model.quantization: fp8"):
        load_pretrained(lambda: WanTransformer3DModel(**config), file, dtype=torch.float32, zero_stage=0, device="cpu", rename=rename)
    with pytest.raises(CheckpointError, match="set model.quantization: fp8 to train"):
        load_pretrained(lambda: WanTransformer3DModel(**config), file, dtype=torch.float32, zero_stage=0, device="cpu", rename=rename, quantize=QuantizedStorage("fp8_e5m2"))

    model = load_pretrained(lambda: WanTransformer3DModel(**config), file, dtype=torch.float32, zero_stage=0, device="cpu", rename=rename, quantize=QuantizedStorage("fp8"))
    layer = model.blocks[0].attn1.to_q
    assert isinstance(layer, QuantizedLinear)
    # The bytes and the scale are the file's, as stored (no re-quantization).
    assert torch.equal(layer.weight, stored["blocks.0.attn1.to_q.weight"].view(torch.uint8))
    assert torch.all(getattr(layer, SCALE_KEY) == stored["blocks.0.attn1.to_q.scale_weight"])
    inputs = denoiser_inputs(architecture_named("wan"), model, 2)
    with torch.no_grad():
        expected = output_of(full.eval(), inputs)
        got = output_of(model.eval(), inputs)
    assert (got - expected).norm() / expected.norm() < 0.15

    from peft import LoraConfig

    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    model.train()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(8):
        loss = output_of(model, inputs).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.9, losses



def test_flux1_lora_on_an_fp8_base_trains_under_a_zero2_engine(tmp_path, monkeypatch):
    """ZeRO-2 (one CPU rank, gloo): DeepSpeed's engine around a FLUX.1 denoiser whose whole fp8 base each rank holds, unpartitioned.

    The engine must leave the uint8 bytes alone (it casts only floating-point parameters) and step the
    LoRA alone; the fp8 base under ZeRO-2 through `zeropipe train` on 2 ranks: benchmarks/quantized_base.py --loss.
    """
    import socket

    import deepspeed
    from peft import LoraConfig

    from zeropipe.models.common import resolve_lora_targets

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "DS_ACCELERATOR": "cpu"}.items():
        monkeypatch.setenv(key, value)
    arch = architecture_named("flux")
    cls = arch.model_class()
    torch.manual_seed(0)
    cls.from_config(arch.record.preset[arch.record.denoiser]).to(torch.bfloat16).save_pretrained(tmp_path)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 1, "zero_optimization": {"stage": 2},
                 "optimizer": {"type": "AdamW", "params": {"lr": 3e-2}}}
    deepspeed.init_distributed(dist_backend="gloo")
    model = load_pretrained(
        lambda: cls.from_config(cls.load_config(str(tmp_path))), tmp_path, dtype=torch.float32, zero_stage=2, ds_config=ds_config, device="cpu",
        stem="diffusion_pytorch_model", quantize=QuantizedStorage("fp8", "tensor"),
    )
    model.requires_grad_(False)
    lora = type("Lora", (), {"target_modules": "auto"})()
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=resolve_lora_targets(lora, arch.record.lora_targets)))
    model.train()
    quantized = [module for module in model.modules() if isinstance(module, QuantizedLinear)]
    stored = {id(m): m.weight.detach().clone() for m in quantized}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config)
    assert engine.zero_optimization_stage() == 2
    # Whole on the rank (no ZeRO-3 partition), still the fp8 bytes, one scale per tensor (every channel holds it).
    assert quantized and all(m.weight.dtype == torch.uint8 and m.weight.shape == (m.out_features, m.in_features) and not hasattr(m.weight, "ds_tensor") for m in quantized)
    assert all(torch.all(getattr(m, SCALE_KEY) == getattr(m, SCALE_KEY)[0]) for m in quantized)
    inputs = denoiser_inputs(arch, model, 1)
    target = torch.zeros_like(output_of(model, inputs))
    losses = []
    for _ in range(6):
        loss = torch.nn.functional.mse_loss(output_of(engine, inputs), target)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.95, losses
    assert all(torch.equal(m.weight, stored[id(m)]) for m in quantized), "the frozen fp8 base changed"
