"""model.lora.init_from: every adapter layout ZeRO-Pipe writes, and the peers' layouts, read back onto the run's peft modules.

Each round trip: a model with a trained-looking LoRA (A and B random, so every module matters) writes its
adapter in a layout; a fresh model of the same base with its own LoRA initialisation (and another alpha
in the config) reads it back with ``load_initial_adapter``; the first forward equals the original's (fp32).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from zeropipe.errors import ConfigError
from zeropipe.models.adapter_init import load_initial_adapter
from zeropipe.models.adapters import peft_adapter_config


def randomise_lora(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


def lora_section(r: int = 4, alpha: float = 8, kind: str = "lora"):
    return SimpleNamespace(kind=kind, r=r, alpha=alpha, dropout=0.0, factor=-1)


# ----------------------------------------------------------------------------- causal LM: peft's layout


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
    return LlamaForCausalLM(config)


def llama_with_lora(seed: int, alpha: float, r: int = 4, targets=("q_proj", "k_proj", "v_proj", "o_proj")):
    from peft import get_peft_model

    return get_peft_model(tiny_llama(0), peft_adapter_config(lora_section(r, alpha), list(targets), task_type="CAUSAL_LM"))


def llama_loss(model) -> float:
    ids = torch.arange(12).reshape(1, 12) % 64
    model.eval()
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def test_a_causal_lm_continues_from_its_peft_export_at_the_same_loss(tmp_path):
    original = llama_with_lora(seed=0, alpha=16)
    randomise_lora(original, seed=1)
    # What zeropipe export writes for a LoRA run (export.hf.write_transformers_export): peft's save_pretrained.
    original.save_pretrained(str(tmp_path / "export"), safe_serialization=True)
    assert (tmp_path / "export" / "adapter_model.safetensors").is_file()

    continued = llama_with_lora(seed=0, alpha=4)  # another alpha in the run's config: the strength is folded into lora_B
    assert abs(llama_loss(continued) - llama_loss(original)) > 1e-3
    noted = load_initial_adapter(continued, tmp_path / "export")
    assert noted["layout"] == "peft" and noted["modules"] == 8 and noted["strength_folded_into_lora_B"] == [4.0]
    assert llama_loss(continued) == pytest.approx(llama_loss(original), abs=1e-6)


def test_rank_targets_and_foreign_keys_are_refused_by_name(tmp_path):
    original = llama_with_lora(seed=0, alpha=16, r=8)
    original.save_pretrained(str(tmp_path / "r8"), safe_serialization=True)
    with pytest.raises(ConfigError) as err:
        load_initial_adapter(llama_with_lora(seed=0, alpha=16, r=4), tmp_path / "r8")
    assert "model.lora.r" in str(err.value) and "rank is 8" in str(err.value) and "set model.lora.r: 8" in str(err.value)

    with pytest.raises(ConfigError) as err:
        load_initial_adapter(llama_with_lora(seed=0, alpha=16, r=8, targets=("q_proj", "v_proj")), tmp_path / "r8")
    assert "model.lora.target_modules" in str(err.value) and "k_proj" in str(err.value)

    with pytest.raises(ConfigError) as err:
        load_initial_adapter(llama_with_lora(seed=0, alpha=16, r=8, targets=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj")), tmp_path / "r8")
    assert "model.lora.target_modules" in str(err.value) and "up_proj" in str(err.value) and "no weights for" in str(err.value)

    foreign = {f"lora_te_text_model_encoder_layers_{i}_mlp_fc1.lora_down.weight": torch.zeros(8, 4) for i in range(7)}
    save_file(foreign, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(ConfigError) as err:
        load_initial_adapter(llama_with_lora(seed=0, alpha=16, r=8), tmp_path / "foreign.safetensors")
    message = str(err.value)
    assert "model.lora.init_from" in message and "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight" in message and "[7 in all]" in message


def test_a_pickled_adapter_goes_through_the_safe_loader_or_is_refused(tmp_path):
    original = llama_with_lora(seed=0, alpha=16)
    randomise_lora(original, seed=2)
    from peft.utils import get_peft_model_state_dict

    state = {k: v.clone() for k, v in get_peft_model_state_dict(original).items()}  # base_model.model.<module>.lora_A.weight
    torch.save(state, tmp_path / "adapter.bin")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 16}))
    (tmp_path / "adapter.bin").rename(tmp_path / "adapter_model.bin")
    continued = llama_with_lora(seed=0, alpha=16)
    load_initial_adapter(continued, tmp_path / "adapter_model.bin")
    assert llama_loss(continued) == pytest.approx(llama_loss(original), abs=1e-6)

    class Payload:
        def __reduce__(self):
            return (print, ("unpickled",))

    torch.save({"x": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(ConfigError) as err:
        load_initial_adapter(continued, tmp_path / "evil.pt")
    assert "model.lora.init_from" in str(err.value) and "it is refused and was not unpickled" in str(err.value)


# ----------------------------------------------------------------------------- diffusion: Wan, whose original layout renames modules


def wan_with_lora(seed_lora: int | None, alpha: float):
    from zeropipe.families.diffusion.entries import architecture_named
    from zeropipe.models.common import resolve_lora_targets

    arch = architecture_named("wan")
    cls = arch.model_class()
    torch.manual_seed(0)
    model = cls.from_config(arch.record.preset["transformer"])
    lora = lora_section(4, alpha)
    model.add_adapter(peft_adapter_config(lora, resolve_lora_targets(SimpleNamespace(target_modules="auto"), arch.record.lora_targets), gaussian_init=True))
    if seed_lora is not None:
        randomise_lora(model, seed_lora)
    return arch, model, lora


def wan_output(model) -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    latents = torch.randn(1, 16, 1, 8, 8, generator=generator)
    text = torch.randn(1, 6, 32, generator=generator)
    model.eval()
    with torch.no_grad():
        return model(hidden_states=latents, timestep=torch.tensor([500.0]), encoder_hidden_states=text, return_dict=False)[0]


def peft_layers(model) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return {key: value.detach().clone() for key, value in get_peft_model_state_dict(model).items()}


def musubi_layout(comfy: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """musubi-tuner's own file (networks/lora_wan.py): lora_unet_<original module, dots as underscores>.lora_down/lora_up/alpha."""
    out = {}
    for key, value in comfy.items():
        stem, _, part = key[len("diffusion_model.") :].partition(".lora_")
        if key.endswith(".alpha"):
            out[f"lora_unet_{key[len('diffusion_model.') : -len('.alpha')].replace('.', '_')}.alpha"] = value
        else:
            out[f"lora_unet_{stem.replace('.', '_')}.lora_{'down' if part.startswith('A') else 'up'}.weight"] = value
    return out


def ai_toolkit_peft_layout(layers: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """ai-toolkit's transformer LoRAs (toolkit/network_mixins.py, peft_format): transformer.<module>.lora_A/lora_B, no alpha (read as scale 1)."""
    return {f"transformer.{key}": (value * scaling if ".lora_B." in key else value) for key, value in layers.items()}


def kohya_transformer_layout(layers: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """kohya-style keys for a transformer (ai-toolkit's non-peft lora_transformer_ prefix): dots as underscores, lora_down/lora_up/alpha."""
    out = {}
    for key, value in layers.items():
        module, _, part = key.partition(".lora_")
        name = f"lora_transformer_{module.replace('.', '_')}"
        out[f"{name}.lora_{'down' if part.startswith('A') else 'up'}.weight"] = value
        out[f"{name}.alpha"] = torch.tensor(alpha)
    return out


@pytest.mark.timeout(120)
def test_a_diffusion_lora_continues_from_every_layout_at_the_same_output(tmp_path):
    from zeropipe.families.diffusion.export import ORIGINAL_LORA_FILE, write_diffusers_lora, write_original_lora

    arch, original, lora = wan_with_lora(seed_lora=3, alpha=8)
    expected = wan_output(original)
    # ZeRO-Pipe's own export: the diffusers file and the original (ComfyUI) file, by the export's writers.
    export = tmp_path / "export"
    export.mkdir()
    write_diffusers_lora(arch, original, lora, torch.float32, export)
    write_original_lora(arch, original, lora.alpha, torch.float32, export)
    layers = peft_layers(original)
    comfy = dict(__import__("safetensors.torch", fromlist=["load_file"]).load_file(str(export / ORIGINAL_LORA_FILE)))
    assert any(".self_attn.q." in key for key in comfy), "Wan's original names (self_attn.q) differ from diffusers' (attn1.to_q)"
    peers = {
        "musubi.safetensors": musubi_layout(comfy),
        "ai_toolkit.safetensors": ai_toolkit_peft_layout(layers, lora.alpha / lora.r),
        "kohya.safetensors": kohya_transformer_layout(layers, lora.alpha),
    }
    for name, tensors in peers.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / name))

    sources = {"diffusers": export, "comfyui": export / ORIGINAL_LORA_FILE, **{name: tmp_path / name for name in peers}}
    for what, source in sources.items():
        _, continued, _ = wan_with_lora(seed_lora=None, alpha=2)  # the run's own alpha differs from the adapter's
        noted = load_initial_adapter(continued, source, original_layout=arch.layouts.original_lora_layout)
        torch.testing.assert_close(wan_output(continued), expected, rtol=0, atol=1e-5, msg=f"{what}: first forward differs")
        assert noted["modules"] == len(layers) // 2, what


def test_an_entry_whose_original_layout_fuses_layers_names_the_fused_keys(tmp_path):
    from zeropipe.models.adapter_init import original_names

    def fusing(layers, alpha):  # FLUX.2-like: q, k, v of a block become one qkv
        out = {}
        for key, value in layers.items():
            module, _, part = key.partition(".lora_")
            out.setdefault(f"diffusion_model.{module.rsplit('.', 1)[0]}.qkv.lora_{part}", []).append(value)
        return {key: torch.cat(values) for key, values in out.items()}

    originals, fused = original_names(fusing, {"blocks.0.attn.q": (4, 4), "blocks.0.attn.k": (4, 4)}, 2)
    assert originals == {} and fused == {"diffusion_model.blocks.0.attn.qkv"}


# ----------------------------------------------------------------------------- VLM: peft's layout over the projector and the language model


def test_a_vlm_continues_from_its_peft_export_at_the_same_loss(tmp_path):
    from tests.unit.models.test_models_vlm import TINY_LLAVA, section
    from zeropipe.families.vlm.model import build_vlm, vlm_config

    def llava(alpha: float):
        torch.manual_seed(0)
        chosen = section(TINY_LLAVA, lora={"r": 4, "alpha": alpha, "dropout": 0.0})
        return build_vlm(chosen, vlm_config(chosen), "fp32")

    def loss(model) -> float:
        ids = torch.arange(1, 13).reshape(1, 12)
        model.eval()
        with torch.no_grad():
            return float(model(input_ids=ids, labels=ids).loss)

    original = llava(alpha=8)
    randomise_lora(original, seed=4)
    original.save_pretrained(str(tmp_path / "export"), safe_serialization=True)  # what zeropipe export writes for a VLM LoRA run
    continued = llava(alpha=32)
    noted = load_initial_adapter(continued, tmp_path / "export")
    assert noted["layout"] == "peft" and noted["strength_folded_into_lora_B"] == [0.25]
    assert loss(continued) == pytest.approx(loss(original), abs=1e-6)
