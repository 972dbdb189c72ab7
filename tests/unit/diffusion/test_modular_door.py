"""The door for diffusers' modular pipelines (families/diffusion/modular.py), on the tiny Z-Image preset saved as a ZImageModularPipeline.

A modular folder (``modular_model_index.json``) is read by the folder reader, written by the tiny-preset builder
through the modular pipeline's own ``save_pretrained`` and loaded back by diffusers' ``ModularPipeline.from_pretrained``;
prompts are encoded by the modular pipeline's text-encoder block and must equal the DiffusionPipeline's ``encode_prompt``
on the same components; the entry's denoiser call must equal the modular pipeline's own denoiser block.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from zeropipe.config.pipeline_index import is_pipeline_folder, read_pipeline_index
from zeropipe.errors import ConfigError
from zeropipe.families.diffusion.core import Architecture, PredictContext
from zeropipe.families.diffusion.entries import architecture_of, register, unregister
from zeropipe.families.diffusion.entries.z_image import ARCHITECTURE as Z_IMAGE, ZImagePrompts
from zeropipe.families.diffusion.modular import DenoiserSampling, TextEncoderBlock, run_loop_block  # noqa: F401  (DenoiserSampling: MODULAR's samples)
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, encode_prompts, load_component, stack_padded, text_pipeline

CPU = torch.device("cpu")


class ZImageBlockPrompts(TextEncoderBlock, ZImagePrompts):
    """Z-Image's prompts through ZImageModularPipeline's text-encoder block: one caption per prompt, padded with a mask as the entry caches them."""

    def cached(self, out):
        rows = out["prompt_embeds"]
        length = max(row.shape[0] for row in rows)
        padded = torch.stack([torch.nn.functional.pad(row, [0, 0, 0, length - row.shape[0]]) for row in rows])
        return {"prompt_embeds": padded, "prompt_embeds_mask": torch.stack([torch.arange(length) < row.shape[0] for row in rows]).long()}


MODULAR = Architecture(
    record=dataclasses.replace(Z_IMAGE.record, name="z-image-modular", pipeline_class="ZImageModularPipeline", related_pipelines=(), preset_name="tiny-z-image-modular"),
    call=Z_IMAGE.call, prompts=ZImageBlockPrompts(arguments={"max_sequence_length": 128}), sampling=DenoiserSampling(), layouts=Z_IMAGE.layouts,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    register(MODULAR)
    try:
        out = tmp_path_factory.mktemp("modular") / "pipeline"
        build_tiny_pipeline({"pipeline": "tiny-z-image-modular"}, out, seed=3)
        yield out
    finally:
        unregister("z-image-modular")


def test_a_modular_folder_is_read_written_and_loaded_back(folder):
    from diffusers import ModularPipeline

    assert is_pipeline_folder(folder) and not (folder / "model_index.json").exists()
    index = read_pipeline_index(folder)
    assert index.modular and index.class_name == "ZImageModularPipeline" and index.blocks_class_name == "ZImageAutoBlocks"
    assert set(index.components()) == {"transformer", "vae", "text_encoder", "tokenizer", "scheduler"}
    assert index.component("transformer") == ("diffusers", "ZImageTransformer2DModel")
    assert index.component_config("transformer")["dim"] == 32
    assert architecture_of(folder).record.name == "z-image-modular"
    # diffusers' own loader reads the folder the builder wrote, component for component.
    reference = ModularPipeline.from_pretrained(str(folder))
    reference.load_components(torch_dtype=torch.float32)
    ours = load_component(folder, "transformer", torch.float32, CPU)
    theirs = reference.transformer.state_dict()
    assert all(torch.equal(value, theirs[name]) for name, value in ours.state_dict().items())


def test_a_modular_index_pointing_outside_the_folder_is_refused_by_name(folder, tmp_path):
    import json
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("transformer"))
    with pytest.raises(ConfigError, match="transformer.*download the whole repository"):
        read_pipeline_index(copy).component_config("transformer")
    assert json.loads((copy / "modular_model_index.json").read_text())["transformer"][2]["subfolder"] == "transformer"


def test_prompts_through_the_text_encoder_block_and_predict_through_the_denoiser_block(folder):
    from diffusers import ZImagePipeline
    from diffusers.modular_pipelines.z_image.denoise import ZImageLoopBeforeDenoiser, ZImageLoopDenoiser

    arch = architecture_of(folder)
    prompts = ["a red circle", "two blue squares on grey"]
    modular = text_pipeline(folder, arch, torch.float32, CPU)
    rows = encode_prompts(modular, arch, prompts, CPU)
    # The block's captions are the DiffusionPipeline's encode_prompt's on the same components.
    classic = ZImagePipeline(scheduler=modular.scheduler, vae=None, text_encoder=modular.text_encoder, tokenizer=modular.tokenizer, transformer=None)
    expected = Z_IMAGE.prompts.encode_prompts(classic, prompts, CPU)
    condition = {name: stack_padded([row[name] for row in rows]) for name in rows[0]}
    assert torch.equal(condition["prompt_embeds_mask"], expected["prompt_embeds_mask"])
    assert torch.allclose(condition["prompt_embeds"], expected["prompt_embeds"], atol=1e-6)

    # Run once per prompt (the blocks that take one prompt string per call), the captions padded with a mask: the same cache.
    per_prompt = TextEncoderBlock(returns={"prompt_embeds": "prompt_embeds"}, arguments={"max_sequence_length": 128}, per_prompt=True)
    per_prompt.entry = arch
    one_by_one = per_prompt.encode_prompts(modular, prompts, CPU)
    assert torch.equal(one_by_one["prompt_embeds_mask"], expected["prompt_embeds_mask"])
    assert torch.allclose(one_by_one["prompt_embeds"], expected["prompt_embeds"], atol=1e-6)

    transformer = load_component(folder, "transformer", torch.float32, CPU)
    pipeline = text_pipeline(folder, arch, torch.float32, CPU)
    pipeline.update_components(transformer=transformer)
    torch.manual_seed(0)
    latents, t = torch.randn(2, 4, 8, 8), torch.tensor(640.0)
    state = run_loop_block(
        pipeline, [ZImageLoopBeforeDenoiser(), ZImageLoopDenoiser()], 0, t, latents=latents, dtype=torch.float32, num_inference_steps=1,
        prompt_embeds=[row["prompt_embeds"][row["prompt_embeds_mask"].bool()] for row in rows],
    )
    ours = arch.call.predict(transformer, latents, t.expand(2), condition, PredictContext(CPU, torch.float32, 8, 1.0))
    assert ours.shape == state.noise_pred.shape
    assert torch.allclose(ours, state.noise_pred, atol=1e-5), (ours - state.noise_pred).abs().max()


def test_a_modular_pipeline_is_not_drawn_through_its_call(folder):
    from zeropipe.families.diffusion.sampler import pipeline_call

    pipeline = text_pipeline(folder, architecture_of(folder), torch.float32, CPU)
    with pytest.raises(TypeError, match="ZImageModularPipeline is a modular pipeline.*sampler.denoise"):
        pipeline_call(pipeline, {"prompt": "a red circle"})

