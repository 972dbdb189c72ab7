"""minimax-h3-i2v (MiniMax-H3's fl2va workflow with its first keyframe), held to MiniMaxH3ModularPipeline's own blocks on tiny components.

The reference is the modular pipeline run block by block as its fl2va workflow runs them: the FL2VA text-encoder step (the first
frame as Qwen3-VL image tokens before the prompt), the keyframe VAE encoder step, then the layout with the keyframe anchored
first, the conditioning noise, the generated rows' noise, the two schedules, and the denoise loop. The entry's prompts, keyframe
latents, call and draw are given the same inputs and must give the same outputs. Without torchvision the FL2VA block reads
Qwen3-VL's image processor in transformers' PIL backend (``ProcessorImagePath``), held here to the processor's documented grid and
to the patch layout of transformers' torchvision processor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from zeropipe.families.diffusion.bases.minimax_h3 import draw, unpatchify_video_rows
from zeropipe.families.diffusion.core import PredictContext
from zeropipe.families.diffusion.entries import architecture_named
from zeropipe.families.diffusion.modular import run_block, run_loop_block

CPU = torch.device("cpu")
LAYOUT = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices", "num_condition_video_rows", "num_condition_audio_rows",
          "num_latent_frames", "latent_height", "latent_width", "num_audio_latents")
FIELDS = ("token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")


def frame(seed: int, size=(64, 64)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The entry's tiny components (its preset's, the VAE with statistics other than (0, 1)) in a MiniMaxH3ModularPipeline, the
    processor loaded from the tiny processor folder the preset writes."""
    import transformers
    from diffusers import AutoencoderKLMiniMaxH3, MiniMaxH3ModularPipeline, MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel

    arch = architecture_named("minimax-h3-i2v")
    preset = arch.record.preset
    torch.manual_seed(0)
    fields = {key: value for key, value in preset["text_encoder"].items() if key != "class"}
    encoder = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(**fields)).eval()
    tokenizer = arch.prompts.tiny_tokenizer("tokenizer")
    folder = tmp_path_factory.mktemp("processor")
    arch.prompts.tiny_prompt_processor("processor", {"tokenizer": tokenizer}, folder)
    processor = arch.prompts.load_prompt_processor(folder.parent, folder.name, {"tokenizer": tokenizer})
    transformer = MiniMaxH3Transformer3DModel(**preset["transformer"]).eval()
    vae = AutoencoderKLMiniMaxH3(**{**preset["vae"], "latents_mean": [0.1 * (c % 5) for c in range(24)], "latents_std": [0.5 + 0.1 * (c % 3) for c in range(24)]}).eval()
    pipeline = MiniMaxH3ModularPipeline()
    pipeline.update_components(text_encoder=encoder, tokenizer=tokenizer, processor=processor, transformer=transformer, vae=vae,
                               scheduler=MiniMaxH3Scheduler(**{k: v for k, v in preset["scheduler"].items() if k != "class"}),
                               audio_scheduler=MiniMaxH3Scheduler(**{k: v for k, v in preset["audio_scheduler"].items() if k != "class"}))
    return arch, pipeline


def fl2va_state(pipeline, prompt: str, keyframe: Image.Image, seed: int, steps: int = 3) -> dict:
    """The fl2va state the pipeline's blocks build for a 5-second request at the keyframe's size, its generator seeded ``seed``."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3FL2VAPrepareLatentsStep, MiniMaxH3PrepareConditionLatentsStep, MiniMaxH3PrepareLatentsStep, MiniMaxH3PrepareLayoutStep, MiniMaxH3SetTimestepsStep,
    )
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3KeyframeVaeEncoderStep

    state = run_block(pipeline, pipeline.blocks.sub_blocks["text_encoder"].sub_blocks["fl2va"], ("prompt_embeds", "text_token_tags"), prompt=prompt, keyframes=[keyframe])
    state.update(run_block(pipeline, MiniMaxH3KeyframeVaeEncoderStep(), ("condition_latents",), keyframes=[keyframe]))
    width, height = keyframe.size
    state.update(run_block(pipeline, MiniMaxH3PrepareLayoutStep(), LAYOUT, text_token_tags=state["text_token_tags"], height=height, width=width, num_frames=121, keyframe_anchors=("first",)))
    generator = torch.Generator().manual_seed(seed)
    state.update(run_block(pipeline, MiniMaxH3PrepareConditionLatentsStep(), ("condition_rows",), generator=generator, **state))
    state.update(run_block(pipeline, MiniMaxH3PrepareLatentsStep(), ("latents", "audio_latents"), generator=generator, **{k: v for k, v in state.items() if k != "latents"}))
    state["generated_rows"] = state["latents"]
    state.update(run_block(pipeline, MiniMaxH3FL2VAPrepareLatentsStep(), ("latents",), **state))
    state.update(run_block(pipeline, MiniMaxH3SetTimestepsStep(), ("timesteps", "audio_timesteps", "row_timestep_plan"), num_inference_steps=steps, **state))
    return state


def video_latents(state) -> torch.Tensor:
    """The generated video rows of a state, as latents (1, C, F, H, W)."""
    return unpatchify_video_rows(state["generated_rows"], 24, state["num_latent_frames"], state["latent_height"], state["latent_width"], (1, 2, 2))


def keyframe_noise(shape, seed: int) -> torch.Tensor:
    """The conditioning noise PrepareConditionLatentsStep draws first from a generator seeded ``seed``."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_the_seeded_first_frame_is_the_pipelines_keyframe_encoding(tiny):
    """Two clips' first frames through the entry's condition part (a chunk of the latent cache), normalised as the batch normalises
    them, are ``MiniMaxH3KeyframeVaeEncoderStep``'s conditioning latents of each frame (seed 42, float16, per-channel statistics)."""
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3KeyframeVaeEncoderStep

    from zeropipe.families.diffusion.parts.base import Encoding

    arch, pipeline = tiny
    codec, part = arch.record.codec, arch.record.conditions[-1]
    frames = [frame(1), frame(2)]
    clips = torch.stack([torch.from_numpy(np.array(image)).permute(2, 0, 1) for image in frames])[:, :, None].repeat(1, 1, 5, 1, 1).float() / 127.5 - 1
    values = part.encode(Encoding(pipeline.vae, clips, [None, None], None, codec, CPU))
    shift, scale = codec.normalization(dict(pipeline.vae.config))
    ours = (torch.stack(values) - shift.view(1, -1, 1, 1, 1)) * scale.view(1, -1, 1, 1, 1)
    expected = torch.cat(run_block(pipeline, MiniMaxH3KeyframeVaeEncoderStep(), ("condition_latents",), keyframes=frames)["condition_latents"])
    assert ours.shape == expected.shape == (2, 24, 1, 4, 4)
    assert torch.allclose(ours, expected, atol=1e-5), (ours - expected).abs().max()


def test_prompts_with_the_first_frame_and_the_call_are_the_fl2va_blocks(tiny):
    """Two prompts (one empty: a dropped caption, the unconditional side) each with its first frame through the entry's prompts, cached
    padded with their modality tags, then the entry's call with each frame's keyframe latents: each prompt's rows are the FL2VA
    block's, and the call's velocities are the denoiser block's on the fl2va layout (the keyframe rows' own output dropped)."""
    from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3LoopDenoiser

    arch, pipeline = tiny
    prompts, frames, seeds = ["a red circle", ""], [frame(3), frame(4)], [5, 6]
    cached = arch.prompts.encode_prompts_with_images(pipeline, prompts, frames, CPU)
    cached = {key: value.float() for key, value in cached.items()}  # as the text cache keeps them (prompt_rows: fp32)
    states = [fl2va_state(pipeline, prompt, image, seed) for prompt, image, seed in zip(prompts, frames, seeds)]
    for index, state in enumerate(states):
        length = state["prompt_embeds"].shape[1]
        assert cached["prompt_embeds_mask"][index].sum() == length and int((state["text_token_tags"] == pipeline.video_tag).sum()) == 1 + 4 + 1  # start, a 64x64 frame's 4 merged patches, end
        assert torch.equal(cached["prompt_embeds"][index, :length], state["prompt_embeds"][0].float())
        assert torch.equal(cached["text_token_tags"][index, :length].long(), state["text_token_tags"])

    step = 1
    condition = {**cached, "first_frame_latents": torch.cat([state["condition_latents"][0] for state in states]),
                 "keyframe_noise": torch.cat([keyframe_noise(state["condition_latents"][0].shape, seed) for state, seed in zip(states, seeds)])}
    sigma = torch.stack([1 - state["timesteps"][step] for state in states])
    level = torch.stack([1 - state["audio_timesteps"][step] for state in states])
    video = torch.cat([video_latents(state) for state in states])
    audio = torch.stack([state["audio_latents"] for state in states])
    video_v, audio_v = arch.call.joint_predict(pipeline.transformer, video, audio, sigma, level, condition, PredictContext(CPU, torch.float32, 16, 1.0))
    for index, state in enumerate(states):
        out = run_loop_block(
            pipeline, MiniMaxH3LoopDenoiser(), step, state["timesteps"][step], latents=state["latents"].clone(), audio_latents=state["audio_latents"].clone(),
            prompt_embeds=state["prompt_embeds"], row_timestep_plan=state["row_timestep_plan"], denoiser_input_fields={name: state[name] for name in FIELDS}, attention_kwargs=None,
        )
        held = state["num_condition_video_rows"]
        assert held == 4  # one latent frame of 2x2 patches
        expected = unpatchify_video_rows(out.noise_pred[0][held:], 24, state["num_latent_frames"], state["latent_height"], state["latent_width"], (1, 2, 2))
        assert torch.allclose(-video_v[index], expected[0], atol=1e-5), (video_v[index] + expected[0]).abs().max()
        assert torch.allclose(-audio_v[index], out.audio_noise_pred[0], atol=1e-5)


def test_samples_draw_the_keyframe_noise_first_and_denoise_as_the_fl2va_denoise_step(tiny):
    """The entry's samples: the keyframe encoded and its noise drawn from the samples' generator before the video's (as the
    pipeline's condition step draws it), then the shared sampler's draw with the entry's call ends where the fl2va denoise step ends."""
    from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3DenoiseStep

    arch, pipeline = tiny
    keyframe, seed, steps = frame(7), 8, 3
    state = fl2va_state(pipeline, "two blue squares", keyframe, seed, steps)
    cached = {key: value.float() for key, value in arch.prompts.encode_prompts_with_images(pipeline, ["two blue squares"], [keyframe], CPU).items()}
    generator = torch.Generator().manual_seed(seed)
    condition = arch.sampling.sample_condition(pipeline, {"image": keyframe, "condition": cached}, 1, generator)
    assert torch.equal(condition["first_frame_latents"], state["condition_latents"][0])
    video = torch.randn(video_latents(state).shape, generator=generator)  # sample_outputs' next draw: the pipeline's video noise
    assert torch.equal(video, video_latents(state))

    expected = run_block(
        pipeline, MiniMaxH3DenoiseStep(), ("latents", "audio_latents"), latents=state["latents"].clone(), audio_latents=state["audio_latents"].clone(),
        prompt_embeds=state["prompt_embeds"], row_timestep_plan=state["row_timestep_plan"], timesteps=state["timesteps"], audio_timesteps=state["audio_timesteps"],
        num_condition_video_rows=state["num_condition_video_rows"], num_condition_audio_rows=0, groups={"denoiser_input_fields": {name: state[name] for name in FIELDS}},
    )
    drawn_video, drawn_audio = draw(arch.call, pipeline.transformer, pipeline.scheduler, pipeline.audio_scheduler, video, state["audio_latents"][None].clone(), steps,
                                    condition, PredictContext(CPU, torch.float32, 16, 1.0))
    generated = expected["latents"][state["num_condition_video_rows"] :]
    frames, height, width = state["num_latent_frames"], state["latent_height"], state["latent_width"]
    assert torch.allclose(drawn_video, unpatchify_video_rows(generated, 24, frames, height, width, (1, 2, 2)), atol=1e-4)
    assert torch.allclose(drawn_audio[0], expected["audio_latents"], atol=1e-4)


def test_the_image_processor_without_torchvision_is_transformers_pil_backend_on_qwen3_vls_grid(tiny):
    """Without torchvision the FL2VA block's processor is ``ProcessorImagePath``: the tokenizer, transformers' PIL backend of Qwen3-VL's
    image processor and ProcessorMixin's own token types. Its grid is smart_resize's (multiples of 32 in the pixel budget: numbers
    worked by the documented rule), its pixel values the torchvision processor's patch layout of the PIL-resized, normalised frame."""
    import importlib.util

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from zeropipe.families.diffusion.bases.qwen3_vl_text import ProcessorImagePath

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("with torchvision the entry loads the real Qwen3VLProcessor")
    _, pipeline = tiny
    processor = pipeline.processor
    assert isinstance(processor, ProcessorImagePath) and type(processor.image_processor) is Qwen2VLImageProcessorPil
    # (height, width) -> grid: 40x100 rounds to 32x96; 200x200 is over 64*64 pixels, scaled by sqrt(200*200/4096) then floored to 64x64;
    # 20x20 is under 32*32, scaled up and ceiled to 32x32.
    for (height, width), grid in {(40, 100): (1, 2, 6), (200, 200): (1, 4, 4), (20, 20): (1, 2, 2)}.items():
        image = frame(9, (height, width))
        out = processor.image_processor(images=[image], return_tensors="pt")
        assert out["image_grid_thw"].tolist() == [list(grid)]
        resized = np.asarray(image.resize((grid[2] * 16, grid[1] * 16), Image.BICUBIC), dtype=np.float32) / 255.0
        pixels = torch.from_numpy((resized - 0.5) / 0.5).permute(2, 0, 1)[None]
        # transformers' Qwen2VLImageProcessor.patchify (the torchvision backend), step for step.
        patches = pixels.reshape(1, 3, grid[1] // 2, 2, 16, grid[2] // 2, 2, 16).permute(0, 2, 5, 3, 6, 1, 4, 7)
        patches = patches.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, 2, -1, -1).reshape(grid[1] * grid[2], 3 * 2 * 16 * 16)
        assert torch.allclose(out["pixel_values"], patches, atol=1e-5)
    tokenizer = processor.tokenizer
    ids = tokenizer("<|vision_start|><|image_pad|><|image_pad|><|vision_end|>a<|video_pad|>", add_special_tokens=False)["input_ids"]
    assert processor.create_mm_token_type_ids([ids]) == [[0, 1, 1, 0, 0, 2]]


def test_the_task_chooses_image_to_video_from_the_releases_one_folder(tmp_path):
    """The release's folder says no task: it is minimax-h3 unless model.diffusion.task: image-to-video; the tiny preset's folder says it."""
    import json

    from zeropipe.families.diffusion.entries import architecture_of

    index = {"_class_name": "MiniMaxH3ModularPipeline", "_diffusers_version": "0.42.1",
             "transformer": ["diffusers", "MiniMaxH3Transformer3DModel", {"pretrained_model_name_or_path": None, "subfolder": "transformer"}]}
    (tmp_path / "transformer").mkdir()
    (tmp_path / "modular_model_index.json").write_text(json.dumps(index))
    assert architecture_of(tmp_path).record.name == "minimax-h3"
    assert architecture_of(tmp_path, "image-to-video").record.name == "minimax-h3-i2v"
    (tmp_path / "modular_model_index.json").write_text(json.dumps({**index, "zeropipe_task": "image-to-video"}))
    assert architecture_of(tmp_path).record.name == "minimax-h3-i2v"


def test_the_first_frame_prompt_part_keeps_the_frame_for_a_dropped_caption_and_the_unconditional_side(tmp_path):
    """A dropped caption trains on the empty caption with the clip's first frame; the guidance-preserving objective's unconditional side
    is that same entry; a flip or a random crop (the text encoder would see another frame than the latents hold) is refused."""
    from types import SimpleNamespace

    from zeropipe.config.schema import RunConfig
    from zeropipe.families.diffusion.parts import part_problems
    from zeropipe.families.diffusion.parts.guidance import SCALE, UNCONDITIONAL

    arch = architecture_named("minimax-h3-i2v")

    def config(**images):
        return RunConfig.model_validate({"model": {"config": {"pipeline": "tiny-minimax-h3-i2v"}, "diffusion": {"guidance_preserving": 4.0}},
                                         "data": {"path": str(tmp_path), "images": images, "video": {"frame_buckets": [22]}}})

    task = SimpleNamespace(config=config(), data=SimpleNamespace(item_text_keys=[["cap0", "empty0"], ["cap1", "empty1"]]),
                           text_entries=lambda keys: {"prompt_embeds": list(keys)})
    batch = arch.record.text.batch(task, ["a", "b"], [1, 0], [False, True])
    assert batch["prompt_embeds"] == ["cap1", "empty0"] and batch[UNCONDITIONAL + "prompt_embeds"] == ["empty1", "empty0"] and float(batch[SCALE]) == 4.0
    assert part_problems(config(), arch) == []
    assert {key for key, _ in part_problems(config(flip=0.5, crop="random"), arch)} == {"data.images.flip", "data.images.crop"}
    # Two clips of one video (clip_mode: multiple) start at other frames: their captions' entries are not the same.
    from zeropipe.families.diffusion.parts.first_frame_prompt import first_frame_text_key

    video = tmp_path / "clip.mp4"
    video.write_bytes(b"0")
    keys = [first_frame_text_key("a", "fp", {"path": str(video), "start": start}, (32, 32, 22)) for start in (0, 22, 0)]
    assert keys[0] != keys[1] and keys[0] == keys[2] != first_frame_text_key("a", "fp", {"path": str(video), "start": 0}, (64, 32, 22))


def test_the_guidance_preserving_loss_uses_the_frames_empty_caption_and_one_keyframe_noise_for_both_passes():
    """With ``model.diffusion.guidance_preserving`` the i2v loss is the t2v one's equation (``(v_g + (w-1) u) / w`` per stream) where the
    unconditional pass is the empty caption's entry with the same first frame (its own rows and tags) and the same keyframe noise."""
    from diffusers import MiniMaxH3Transformer3DModel

    from zeropipe.families.diffusion.bases.minimax_h3 import audio_sigma
    from zeropipe.families.diffusion.objectives import NoisedBatch, weighted_mse
    from zeropipe.families.diffusion.parts.guidance import SCALE, UNCONDITIONAL

    arch = architecture_named("minimax-h3-i2v")
    torch.manual_seed(9)
    model = MiniMaxH3Transformer3DModel(**arch.record.preset["transformer"])
    latents, noise, keyframe = torch.randn(1, 24, 2, 2, 2), torch.randn(1, 24, 2, 2, 2), torch.randn(1, 24, 1, 2, 2)
    sigma, audio = torch.tensor([0.6]), torch.randn(1, 2 * 3, 32)

    def entry(text: int, vision: int) -> dict:  # a cached prompt: a label, a vision block (tagged video, 0), the caption; padded by 2
        tags = torch.tensor([[1.0] * 3 + [0.0] * vision + [1.0] * text + [0.0, 0.0]])
        return {"prompt_embeds": torch.randn(1, tags.shape[1], 16), "prompt_embeds_mask": torch.tensor([[1] * (3 + vision + text) + [0, 0]]), "text_token_tags": tags}

    own = {**entry(5, 3), "audio_latents": audio, "first_frame_latents": keyframe}
    empty = entry(0, 3)
    guided = {**own, **{UNCONDITIONAL + key: value for key, value in empty.items()}, SCALE: torch.tensor(4.0)}
    noised = NoisedBatch(model_input=(1 - sigma) * latents + sigma * noise, timesteps=sigma * 1000, target=noise - latents, weights=None)
    context = PredictContext(CPU, torch.float32, 16, 1.0)
    torch.manual_seed(10)
    loss = arch.call.loss(model, noised, guided, context)
    torch.manual_seed(10)
    keyframe_noise, audio_noise = torch.randn(keyframe.shape), torch.randn(audio.shape)  # the loss's draws, in its order
    level = audio_sigma(sigma)
    noisy = (1 - level.view(-1, 1, 1)) * audio + level.view(-1, 1, 1) * audio_noise
    with torch.no_grad():
        video_g, audio_g = arch.call.joint_predict(model, noised.model_input, noisy, sigma, level, {**own, "keyframe_noise": keyframe_noise}, context)
        video_u, audio_u = arch.call.joint_predict(model, noised.model_input, noisy, sigma, level, {**own, **empty, "keyframe_noise": keyframe_noise}, context)
    share = latents[0].numel() / (latents[0].numel() + audio[0].numel())
    expected = share * weighted_mse((video_g + 3 * video_u) / 4, noised.target, None) + (1 - share) * weighted_mse((audio_g + 3 * audio_u) / 4, audio_noise - audio, None)
    assert torch.allclose(loss, expected, rtol=1e-5), (loss, expected)
    assert not torch.allclose(video_g, video_u)
