"""Kandinsky 5 Video (T2V and I2V) against their own diffusers pipelines.

The pipeline draws from a prompt (its own prompt encoding, latent preparation, visual condition
and RoPE scale, captured by a hook on its transformer); the entry's ``encode_prompts`` and
``predict`` on the same latents and timestep give the same denoiser output.
"""

from __future__ import annotations

import random

import torch

from zeropipe.families.diffusion.entries import PredictContext, architecture_named, architecture_of
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline

CPU = torch.device("cpu")
PROMPT = "a red circle moving left"


def first_call(pipeline, **call):
    seen: dict = {}

    def hook(module, args, kwargs, output):
        if not seen:  # copies: the pipeline steps its latents in place, and they are the call's hidden_states
            seen["kwargs"] = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
            seen["output"] = output.sample.clone()
        return output

    handle = pipeline.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            pipeline(**call)
    finally:
        handle.remove()
    return seen["kwargs"], seen["output"]


def pipeline_of(name, tmp_path, seed):
    arch = architecture_named(name)
    folder = tmp_path / name
    build_tiny_pipeline({"pipeline": arch.record.preset_name}, folder, seed=seed)
    assert architecture_of(folder) is arch
    pipeline = arch.pipeline().from_pretrained(str(folder))
    pipeline.set_progress_bar_config(disable=True)
    return arch, pipeline


def test_text_to_video_predict_is_the_pipelines_own_call(tmp_path):
    from zeropipe.families.diffusion.bases.kandinsky5_t2v import channels_first

    arch, pipeline = pipeline_of("kandinsky5-t2v", tmp_path, seed=1)
    kwargs, output = first_call(pipeline, prompt=PROMPT, num_frames=9, height=32, width=32, num_inference_steps=2, guidance_scale=1.0,
                                output_type="latent", generator=torch.Generator().manual_seed(0))
    hidden = kwargs["hidden_states"]
    assert hidden.shape[-1] == 33 and not hidden[..., 16:].any()  # visual_cond: zero condition and mask in text-to-video
    latents = channels_first(hidden[..., :16])
    with torch.no_grad():
        condition = arch.prompts.encode_prompts(pipeline, [PROMPT], CPU)
        got = arch.call.predict(pipeline.transformer, latents, kwargs["timestep"], condition, PredictContext(CPU, torch.float32, 8, 1.0))
    assert kwargs["scale_factor"] == (1, 3.16, 3.16)
    # The template's system prompt is cut off whole (128 tokens, as with Qwen2.5's tokenizer): the transformer reads the user turn.
    user_turn = pipeline.tokenizer(f"<|im_start|>user\n{PROMPT}<|im_end|>")["input_ids"]
    assert kwargs["encoder_hidden_states"].shape[1] == len(user_turn)
    torch.testing.assert_close(got, channels_first(output), rtol=1e-4, atol=1e-5)


def test_image_to_video_predict_is_the_pipelines_own_call_and_leaves_the_given_frame_out_of_the_loss(tmp_path):
    from zeropipe.families.diffusion.bases.kandinsky5_t2v import channels_first
    from zeropipe.data.images import first_frame_image
    from zeropipe.data.videos import moving_shape_frames

    arch, pipeline = pipeline_of("kandinsky5-i2v", tmp_path, seed=2)
    frames = moving_shape_frames("circle", "red", "blue", "left", (32, 32), 9, random.Random(0))
    clip = torch.from_numpy(frames).float().div(127.5).sub(1.0).permute(3, 0, 1, 2)[None]
    kwargs, output = first_call(pipeline, image=first_frame_image(clip[0]), prompt=PROMPT, num_frames=9, height=32, width=32, num_inference_steps=2,
                                guidance_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0))
    hidden = kwargs["hidden_states"]
    mask = hidden[..., 32]
    assert mask[:, 0].eq(1).all() and not mask[:, 1:].any() and not hidden[..., 16:32].any()
    given = channels_first(hidden[:, :1, ..., :16])
    noisy = torch.randn(channels_first(hidden[..., :16]).shape, generator=torch.Generator().manual_seed(3))
    noisy[:, :, 1:] = channels_first(hidden[:, 1:, ..., :16])  # the first frame is replaced by the given one, whatever it was
    with torch.no_grad():
        condition = {**arch.prompts.encode_prompts(pipeline, [PROMPT], CPU), "first_frame_latents": given}
        got = arch.call.predict(pipeline.transformer, noisy, kwargs["timestep"], condition, PredictContext(CPU, torch.float32, 8, 1.0))
    torch.testing.assert_close(got, channels_first(output), rtol=1e-4, atol=1e-5)
    prediction, target = arch.call.loss_region(got, torch.zeros_like(got))
    assert prediction.shape[2] == got.shape[2] - 1

