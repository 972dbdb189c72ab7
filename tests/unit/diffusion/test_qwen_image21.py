"""Qwen-Image 2.1: the text-only processor gives what Qwen3VLProcessor gives for text, and ``predict`` is its pipeline's own denoiser step.

Without torchvision transformers cannot build a Qwen3VLProcessor; the entry gives the pipeline a
stand-in (``TextPromptProcessor``). For text alone the real processor returns its tokenizer's output plus
``mm_token_type_ids`` of zeros, and tokenizes its chat template's rendering (see the class's docstring for
the lines of transformers 5.24 that say so): the stand-in is held to the tokenizer's own results on the
same texts and messages, and, where torchvision is installed, to the real processor's. That premise was checked
once against the real Qwen3VLProcessor (transformers 5.17.0 with torchvision 0.26.0, on a machine that has them; the
same tiny tokenizer, texts and system message): input_ids and attention_mask equal the tokenizer's, mm_token_type_ids
all zero, and its apply_chat_template the tokenizer's ids in a batch of one.
"""

from __future__ import annotations

import pytest
import torch

from zeropipe.families.diffusion.entries import PredictContext, architecture_of
from zeropipe.families.diffusion.entries.qwen_image21 import CHAT_TEMPLATE, TextPromptProcessor, text_prompt_processor, torchvision_installed
from zeropipe.families.diffusion.tiny.tokenizers import tiny_edit_tokenizer
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, encode_prompts, prompt_processors, stack_padded, text_pipeline, vae_scale_factor

CPU = torch.device("cpu")
SYSTEM = [{"role": "system", "content": [{"type": "text", "text": "Comprehend and analyze the provided prompt."}]}]
TEMPLATE = "<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
TEXTS = [TEMPLATE.format("a red circle"), TEMPLATE.format("A big blue square, on grey.")]


@pytest.fixture(scope="module")
def tokenizer():
    made = tiny_edit_tokenizer(1024)
    made.chat_template = CHAT_TEMPLATE
    return made


def test_the_stand_in_gives_the_tokenizers_output_for_text_as_qwen3vlprocessor_does(tokenizer):
    processor = text_prompt_processor(tokenizer, CHAT_TEMPLATE)
    # The pipeline's call (QwenImage21Pipeline._get_qwen_prompt_embeds, text-to-image).
    ours = processor(text=TEXTS, padding=True, padding_side="left", return_tensors="pt")
    theirs = tokenizer(TEXTS, padding=True, padding_side="left", return_tensors="pt")
    assert set(ours) == {"input_ids", "attention_mask", "mm_token_type_ids"}
    assert torch.equal(ours["input_ids"], theirs["input_ids"]) and torch.equal(ours["attention_mask"], theirs["attention_mask"])
    assert (ours["attention_mask"] == 0).any()  # the shorter text was padded on the left
    assert torch.equal(ours["mm_token_type_ids"], torch.zeros_like(theirs["input_ids"]))
    # The pipeline's constructor counts the system turn's tokens with the processor's apply_chat_template (a batch of one).
    assert processor.apply_chat_template(SYSTEM, tokenize=True, return_dict=False) == [tokenizer.apply_chat_template(SYSTEM, tokenize=True, return_dict=False)]
    assert processor.apply_chat_template(SYSTEM) == tokenizer.apply_chat_template(SYSTEM, tokenize=False)
    # A placeholder without its image is refused, as the processor's validate_inputs refuses it; images need the real processor.
    with pytest.raises(ValueError, match="image_pad"):
        processor(text=["<|image_pad|> a red circle"])
    with pytest.raises(ValueError, match="pip install torchvision"):
        processor(text=TEXTS[:1], images=[object()])


@pytest.mark.skipif(not torchvision_installed(), reason="transformers builds a Qwen3VLProcessor only with torchvision")
def test_the_stand_in_equals_the_real_qwen3vlprocessor_on_text(tokenizer):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    real = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer, video_processor=Qwen3VLVideoProcessor(), chat_template=CHAT_TEMPLATE)
    ours = TextPromptProcessor(tokenizer, CHAT_TEMPLATE)
    expected, got = real(text=TEXTS, padding=True, padding_side="left", return_tensors="pt"), ours(text=TEXTS, padding=True, padding_side="left", return_tensors="pt")
    assert set(got) == set(expected) and all(torch.equal(got[key], expected[key]) for key in expected)
    assert ours.apply_chat_template(SYSTEM, tokenize=True, return_dict=False) == real.apply_chat_template(SYSTEM, tokenize=True, return_dict=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen-image-2.1") / "pipeline"
    arch = build_tiny_pipeline({"pipeline": "tiny-qwen-image-2.1"}, folder, seed=1)
    return arch, folder


def first_step(arch, pipeline, **kwargs):
    """(velocity, latents, timestep) the pipeline hands its scheduler at its first step."""
    seen, step = [], pipeline.scheduler.step

    def record(model_output, timestep, sample, *args, **more):
        if not seen:
            seen.append((model_output.clone(), sample.clone(), torch.as_tensor(timestep).clone()))
        return step(model_output, timestep, sample, *args, **more)

    pipeline.scheduler.step = record
    try:
        arch.sampling.draw(pipeline, kwargs)
    finally:
        del pipeline.scheduler.step
    return seen[0]


def test_predict_is_the_pipelines_denoiser_step_and_does_not_depend_on_its_batchs_padding(tiny):
    arch, folder = tiny
    assert architecture_of(folder) is arch
    pipeline = arch.pipeline().from_pretrained(str(folder), **prompt_processors(folder, arch))
    pipeline.set_progress_bar_config(disable=True)
    size, prompt = 64, "a red circle on a grey sign"
    velocity, latents, timestep = first_step(
        arch, pipeline, prompt=prompt, height=size, width=size, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="latent", return_dict=False,
    )
    factor = vae_scale_factor(folder)
    ours_latents = arch.sampling.unpack_latents(pipeline, latents, size, factor)
    expected = arch.sampling.unpack_latents(pipeline, velocity, size, factor)

    encoders = text_pipeline(folder, arch, torch.float32, CPU)
    rows = encode_prompts(encoders, arch, [prompt, "a blue square"], CPU)  # what the text cache holds for each caption
    context = PredictContext(CPU, torch.float32, factor, 1.0)
    alone = {key: stack_padded([rows[0][key]]) for key in rows[0]}
    batched = {key: stack_padded([rows[1][key], rows[0][key]]) for key in rows[0]}
    with torch.no_grad():
        out = arch.call.predict(pipeline.transformer, ours_latents, timestep.reshape(1).float(), alone, context)
        in_batch = arch.call.predict(pipeline.transformer, ours_latents.repeat(2, 1, 1, 1, 1), timestep.reshape(1).float().repeat(2), batched, context)
    assert out.shape == ours_latents.shape and expected.abs().mean() > 1e-3  # a zero output would match any call
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert batched["prompt_embeds_mask"][0].sum() < batched["prompt_embeds_mask"][1].sum()  # the first caption is padded in the batch
    torch.testing.assert_close(in_batch[1:], out, rtol=1e-4, atol=1e-5)


def test_training_images_reach_the_vae_as_the_pipelines_opaque_rgba(tiny):
    """The pipeline converts an image to RGBA before its VAE (4 channels); the codec adds the same opaque alpha, and drops it from decoded samples."""
    import numpy as np
    from PIL import Image

    arch, folder = tiny
    pipeline = arch.pipeline().from_pretrained(str(folder), **prompt_processors(folder, arch))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    expected = pipeline.image_processor.preprocess(image.convert("RGBA"), width=64, height=64).unsqueeze(2)
    rgb = pipeline.image_processor.preprocess(image, width=64, height=64)
    torch.testing.assert_close(arch.record.codec.vae_pixels(rgb), expected)
    decoded = pipeline.vae.decode(pipeline.vae.encode(expected).latent_dist.mode()).sample
    assert decoded.shape[1] == 4 and arch.record.codec.vae_images(decoded).shape == (1, 3, 64, 64)


def test_diffusion_pipes_qwen_image21_type_converts_to_the_entry():
    """diffusion-pipe's [model] type = 'qwen_image21' (models/qwen_image21.py there) used to convert as CANNOT TRAIN YET."""
    from zeropipe.convert.diffusion_pipe import trainable_architecture

    assert trainable_architecture("qwen_image21") == "qwen-image-2.1"
