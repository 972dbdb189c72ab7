"""A diffusion architecture is one registered entry: preset, pipeline detection, conditioning and the denoiser call come from it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from zeropipe.families.diffusion import entries as architectures
from zeropipe.families.diffusion.bases.unet import UNetCall
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.entries import PredictContext, architecture_of, register, unregister
from zeropipe.families.diffusion.entries.sd15 import ARCHITECTURE as SD15
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, encode_prompts, preset_components, text_pipeline
from zeropipe.errors import ConfigError


class CountedUNetCall(UNetCall):
    """SD 1.x's denoiser call, counting the batches it is given: a role a plug-in might add."""

    def predict(self, model, model_input, timesteps, condition, context):
        self.calls.append(tuple(model_input.shape))
        return super().predict(model, model_input, timesteps, condition, context)


@pytest.fixture
def toy():
    preset = {name: dict(fields) for name, fields in SD15.record.preset.items()}
    preset["unet"]["attention_head_dim"] = 8
    # SD 1.x's layout with wider attention and LoRA on the feed-forward too: a variant a plug-in might add.
    record = dataclasses.replace(SD15.record, name="toy-unet", preset_name="tiny-toy-unet", preset=preset, lora_targets=("to_q", "to_v", "ff.net.2"))
    arch = Architecture(record=record, call=CountedUNetCall(), prompts=SD15.prompts)
    arch.call.calls = []
    register(arch)
    yield arch
    unregister("toy-unet")


def test_a_registered_architecture_is_found_built_and_called(tmp_path, toy):
    assert architectures.presets()["tiny-toy-unet"] is toy
    built = build_tiny_pipeline({"pipeline": "tiny-toy-unet"}, tmp_path / "pipeline", seed=1)
    assert built is toy and architecture_of(tmp_path / "pipeline") is toy  # the latest entry for its pipeline class wins
    encoders = text_pipeline(tmp_path / "pipeline", toy, torch.float32, torch.device("cpu"))
    condition = encode_prompts(encoders, toy, ["a red circle", "a blue square"], torch.device("cpu"))
    assert condition[0]["prompt_embeds"].shape == (77, 32)
    unet = toy.model_class().from_pretrained(str(tmp_path / "pipeline" / "unet"))
    assert unet.config.attention_head_dim == 8
    batch = {"prompt_embeds": torch.stack([row["prompt_embeds"] for row in condition])}
    out = toy.call.predict(unet, torch.randn(2, 4, 16, 16), torch.tensor([10, 500]), batch, PredictContext(torch.device("cpu"), torch.float32, 2, 1.0))
    assert out.shape == (2, 4, 16, 16) and toy.call.calls == [(2, 4, 16, 16)]


def test_an_unknown_preset_names_the_registered_ones(toy):
    with pytest.raises(ConfigError, match="tiny-toy-unet"):
        preset_components({"pipeline": "tiny-nothing"})


def test_unregistered_the_builtin_is_found_again(tmp_path, toy):
    build_tiny_pipeline({"pipeline": "tiny-sd15"}, tmp_path / "pipeline", seed=1)
    unregister("toy-unet")
    assert architecture_of(tmp_path / "pipeline") is SD15


def test_every_entry_takes_what_the_shared_code_passes_to_each_method():
    """An entry that overrides a method keeps the base's parameters: the shared code calls every
    entry the same way (Qwen-Image's latent_normalization once lost the VAE folder argument, and
    its runs failed in every rank)."""
    import inspect

    from zeropipe.families.diffusion.core import Architecture

    for arch in architectures.architectures().values():
        for name, base in vars(Architecture).items():
            if not inspect.isfunction(base) or name.startswith("_"):
                continue
            own = getattr(type(arch), name)
            if own is base:
                continue
            wanted = [p for p in inspect.signature(base).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
            args = [object()] * len(wanted)
            try:
                inspect.signature(own).bind(*args)
            except TypeError as err:
                raise AssertionError(f"{arch.record.name}: {name}{inspect.signature(own)} does not take the base's {inspect.signature(base)}: {err}") from None


def test_every_part_takes_what_the_shared_code_passes_to_each_hook():
    """A part that overrides a hook keeps its generic part's parameters: the shared code calls every codec, prompt part and condition the same way."""
    import inspect

    from zeropipe.families.diffusion.parts import Condition, ImageLatents, PromptText

    for arch in architectures.architectures().values():
        for part in arch.record.parts:
            for generic in (ImageLatents, PromptText, Condition):
                if not isinstance(part, generic):
                    continue
                for name, base in vars(generic).items():
                    if not inspect.isfunction(base) or name.startswith("_") or getattr(type(part), name) is base:
                        continue
                    wanted = [p for p in inspect.signature(base).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
                    try:
                        inspect.signature(getattr(type(part), name)).bind(*[object()] * len(wanted))
                    except TypeError as err:
                        raise AssertionError(f"{arch.record.name}'s {type(part).__name__}.{name} does not take {generic.__name__}'s {inspect.signature(base)}: {err}") from None
