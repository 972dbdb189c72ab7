"""Wan Animate 2 held to diffusers' own ``WanAnimate2Blocks`` on a tiny ``WanAnimate2Transformer3DModel`` and Wan VAE: the entry's call
(reference pass, then the generation pass through its frame-aligned attention) is the blocks' ``WanAnimate2RefExtractStep`` then
``WanAnimate2SegmentDenoiseInner`` (the flex-attention processor), its conditions' latents are the blocks' VAE encoder steps',
its LoRA's official names convert back with diffusers' converter, and a target without its pair of files gets one message."""

from __future__ import annotations

import pytest
import torch

from zeropipe.families.diffusion.bases.wan_animate2 import ARCHITECTURE, DISTILLED, original_module_name
from zeropipe.families.diffusion.parts.animate_reference import AnimateReference, clip_features
from zeropipe.families.diffusion.roles import PredictContext

CPU = torch.device("cpu")
SEGMENT = 5  # pixel frames: 2 latent frames
SIDE = 32  # pixels: 4x4 latents, 2x2 tokens a frame


@pytest.fixture(scope="module")
def tiny():
    from diffusers import AutoencoderKLWan, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, WanAnimate2ModularPipeline, WanAnimate2Transformer3DModel
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    preset = ARCHITECTURE.record.preset
    vae_fields = {key: value for key, value in preset["vae"].items() if key not in ("scale_factor_spatial", "scale_factor_temporal")}
    vae_fields.update(latents_mean=[0.1 * i for i in range(16)], latents_std=[0.5 + 0.1 * i for i in range(16)])  # not the identity
    vae = AutoencoderKLWan(**vae_fields).eval()
    transformer = WanAnimate2Transformer3DModel(**preset["transformer"]).eval()
    encoder = CLIPVisionModel(CLIPVisionConfig(**preset["image_encoder"])).eval()
    pipeline = WanAnimate2ModularPipeline()
    pipeline.update_components(vae=vae, transformer=transformer, image_encoder=encoder, scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
                               guider=ClassifierFreeGuidance(guidance_scale=1.0))
    return pipeline, vae, transformer, encoder


def _block(block, pipeline, k=0, **values):
    from diffusers.modular_pipelines.modular_pipeline import BlockState

    state = BlockState(**values)
    _, state = block(pipeline, state, k=k)
    return state


# The previous segment's carried pixel frames: 0 (a first segment), 1 (the blocks' default: the first latent frame's mask).
@pytest.mark.parametrize("carried", [0, 1])
def test_the_call_is_the_blocks_reference_pass_and_denoiser(tiny, carried):
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache
    from diffusers.modular_pipelines.wan_animate_2.denoise import WanAnimate2RefExtractStep, WanAnimate2SegmentDenoiseInner
    from diffusers.modular_pipelines.wan_animate_2.encoders import get_i2v_mask

    pipeline, _, transformer, _ = tiny
    generator = torch.Generator().manual_seed(1)
    frames, h, w = 2, SIDE // 8, SIDE // 8
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    condition = {
        "driving_latents": randn(1, 16, frames, h, w), "segment_latents": randn(1, 16, frames, h, w), "reference_latents": randn(1, 16, 1, h, w),
        "driving_clip": randn(1, 50, 1280), "reference_clip": randn(1, 50, 1280), "prompt_embeds": randn(1, 64, 32), "prompt_ref_embeds": randn(1, 64, 32),
    }
    latents = randn(16, frames + 1, h, w)
    sigma = 0.6
    pipeline.scheduler.set_timesteps(sigmas=[sigma])
    timesteps = pipeline.scheduler.timesteps
    grid = torch.tensor([[frames, h // 2, w // 2]])
    # The blocks' own conditioning tensors, from their mask helper: the driving clip under ones, the reference frame under ones,
    # then the previous segment under ones over its carried frames (all zeros for a first segment).
    driving_condition = torch.cat([get_i2v_mask(frames, h, w, SEGMENT, device="cpu"), condition["driving_latents"][0]])
    segment_mask = get_i2v_mask(frames, h, w, carried, device="cpu")
    reference = torch.cat([
        torch.cat([get_i2v_mask(1, h, w, 1, device="cpu"), condition["reference_latents"][0]]),
        torch.cat([segment_mask, condition["segment_latents"][0]]),
    ], dim=1)
    if carried:
        condition["segment_mask"] = segment_mask[None]
    state = _block(
        WanAnimate2RefExtractStep(), pipeline, driving_video_latents=condition["driving_latents"], driving_video_condition=driving_condition,
        condition_clip_context=condition["driving_clip"], prompt_ref_embeds=condition["prompt_ref_embeds"], kv_cache=WanAnimate2KVCache(2),
        timesteps=timesteps, max_seq_len_ref=int(grid.prod()), grid_sizes_ref=grid,
    )
    state = _block(
        WanAnimate2SegmentDenoiseInner(), pipeline, k=1 if carried else 0, latents=latents.clone(), reference_latents=reference, kv_cache=state.kv_cache, timesteps=timesteps,
        num_inference_steps=1, num_segments=1, max_seq_len=(frames + 1) * h * w // 4, grid_sizes_ref=grid, segment_frame_length=SEGMENT,
        height=SIDE, width=SIDE, generator=None, prompt_embeds=condition["prompt_embeds"], negative_prompt_embeds=None,
        denoiser_input_fields={"encoder_hidden_states_image": condition["reference_clip"]},
    )
    expected = (latents - state.latents) / sigma  # one Euler step from sigma to 0
    with torch.no_grad():
        got = ARCHITECTURE.call.velocity(transformer, latents[None], timesteps, condition, PredictContext(CPU, torch.float32, 8, 1.0))[0]
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # A micro-batch of two (the pipeline calls one sample at a time): each sample's velocity is its own.
    pair = {name: torch.cat([value, value.flip(-1) if name.endswith("latents") else value]) for name, value in condition.items()}
    if carried:  # the mask is the second sample's too, and it counts: a first segment's zeros give another velocity
        with torch.no_grad():
            first = ARCHITECTURE.call.velocity(transformer, latents[None], timesteps, {**condition, "segment_mask": None}, PredictContext(CPU, torch.float32, 8, 1.0))[0]
        assert not torch.allclose(first, expected, atol=1e-4)
    with torch.no_grad():
        both = ARCHITECTURE.call.velocity(transformer, torch.stack([latents, latents]), timesteps.expand(2), pair, PredictContext(CPU, torch.float32, 8, 1.0))
    torch.testing.assert_close(both[0], expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(both[1], both[0], atol=1e-4)  # the second sample's flipped conditions count
    # Trained through it: the frame-aligned attention has a backward on the CPU, where FlexAttention has none.
    noisy = latents[None].clone().requires_grad_(True)
    ARCHITECTURE.call.velocity(transformer, noisy, timesteps, condition, PredictContext(CPU, torch.float32, 8, 1.0)).square().mean().backward()
    assert noisy.grad.abs().sum() > 0 and transformer.blocks[0].self_attn.to_q.weight.grad.abs().sum() > 0
    transformer.zero_grad()


@pytest.mark.parametrize("carried", [0, 2])
def test_the_conditions_latents_are_the_blocks_vae_encoders(tiny, carried):
    """A first segment (carried 0) and a later one carrying 2 frames (the first latent frame's mask and one channel of the
    next: get_i2v_mask's pixel-frame mask): the clip's first frames are what the blocks carry from the previous
    segment's decoded frames (``out_frames``, k=1), the rest black, under their mask."""
    from types import SimpleNamespace

    from diffusers.modular_pipelines.wan_animate_2.denoise import WanAnimate2SegmentPrevFramesStep, WanAnimate2SegmentVaeEncoderStep
    from diffusers.modular_pipelines.wan_animate_2.encoders import WanAnimate2ImageVaeEncoderStep

    from zeropipe.families.diffusion.modular import run_block
    from zeropipe.families.diffusion.parts.base import Encoding, Inputs
    from zeropipe.families.diffusion.parts.codec import per_channel_normalization

    pipeline, vae, _, encoder = tiny
    generator = torch.Generator().manual_seed(2)
    image = torch.rand(1, 3, SIDE, SIDE, generator=generator) * 2 - 1
    driving = torch.rand(1, 3, SEGMENT, SIDE, SIDE, generator=generator) * 2 - 1
    reference_half = run_block(pipeline, WanAnimate2ImageVaeEncoderStep(), ("reference_image_latents",), image_pixels=image)["reference_image_latents"]
    segment = _block(WanAnimate2SegmentVaeEncoderStep(), pipeline, driving_video_pixels=driving, reference_image_latents=reference_half, effective_segment=SEGMENT - 1,
                     segment_frame_length=SEGMENT)
    clip = torch.rand(1, 3, SEGMENT, SIDE, SIDE, generator=generator) * 2 - 1  # the target clip (the segment)
    # The previous segment's decoded frames: longer than the carried ones, its last ones the clip's first (the segments overlap).
    decoded = torch.cat([torch.rand(1, 3, 3, SIDE, SIDE, generator=generator) * 2 - 1, clip[:, :, :carried]], dim=2)
    previous = _block(WanAnimate2SegmentPrevFramesStep(), pipeline, k=1 if carried else 0, reference_image_latents=reference_half, segment_frame_length=SEGMENT,
                      prev_segment_conditioning_frames=carried or 1, out_frames=decoded if carried else None)

    part = AnimateReference(carried_frames=max(carried, 1))
    codec = ARCHITECTURE.record.codec
    cached = part.encode(Encoding(vae, clip, [(image[0], driving[0], carried)], None, codec, CPU))
    shift, scale = per_channel_normalization(dict(vae.config))
    normalize = lambda latents: (latents - shift.view(1, -1, 1, 1, 1)) * scale.view(1, -1, 1, 1, 1)  # noqa: E731
    got = part.inputs(cached, Inputs(CPU, torch.float32, normalize))
    torch.testing.assert_close(got["reference_latents"][0], reference_half[4:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["driving_latents"][0], segment.driving_video_latents[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["segment_latents"][0], previous.reference_latents[4:, 1:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["segment_mask"][0], previous.reference_latents[:4, 1:], rtol=0, atol=0)
    assert bool(got["segment_mask"].any()) == bool(carried)
    # The CLIP features are the blocks' clip_visual_encode of the same pixels.
    from diffusers.modular_pipelines.wan_animate_2.encoders import clip_visual_encode

    with torch.no_grad():
        torch.testing.assert_close(clip_features(encoder, image), clip_visual_encode(encoder, image[0], CPU, torch.float32), rtol=1e-5, atol=1e-5)
    assert SimpleNamespace  # noqa: B018


def test_the_lora_names_are_the_official_checkpoints():
    from diffusers.loaders.single_file_utils import convert_wan_animate_2_transformer_to_diffusers

    modules = ["blocks.0.self_attn.to_q", "blocks.0.self_attn.to_out.0", "blocks.1.cross_attn.to_k", "blocks.1.cross_attn.add_v_proj", "blocks.1.ffn.0", "blocks.1.ffn.2"]
    originals = [original_module_name(module) for module in modules]
    assert originals[0] == "blocks.0.block.self_attn.q" and originals[4] == "blocks.1.block.ffn.0"
    converted = convert_wan_animate_2_transformer_to_diffusers({f"model.diffusion_model.{name}.weight": torch.empty(0) for name in originals})
    assert sorted(converted) == sorted(f"{module}.weight" for module in modules)
    layers = {f"{module}.lora_A.weight": torch.zeros(2, 4) for module in modules} | {f"{module}.lora_B.weight": torch.zeros(4, 2) for module in modules}
    layout = ARCHITECTURE.layouts.original_lora_layout(layers, 2.0)
    assert "diffusion_model.blocks.0.block.self_attn.q.lora_A.weight" in layout
    assert DISTILLED.layouts.original_lora_layout(layers, 2.0).keys() == layout.keys()


def test_a_target_without_its_reference_image_or_driving_clip_gets_one_message(tmp_path):
    from zeropipe.data.videos import write_video
    from zeropipe.families.diffusion.parts.animate_reference import find_animate_pairs

    import numpy as np
    from PIL import Image

    data, controls = tmp_path / "clips", tmp_path / "controls"
    data.mkdir(), controls.mkdir()
    clip = np.zeros((9, 32, 32, 3), dtype=np.uint8)
    for name in ("a", "b", "c"):
        write_video(data / f"{name}.mp4", clip, 24.0)
    Image.new("RGB", (32, 32)).save(controls / "a.png")
    write_video(controls / "a.mp4", clip, 24.0)
    Image.new("RGB", (32, 32)).save(controls / "b.png")  # no driving clip
    write_video(controls / "c.mp4", clip[:3], 24.0)  # too short, and no reference image
    items = [{"path": str(data / f"{name}.mp4"), "start": 0, "clip_frames": 9} for name in ("a", "b", "c")]
    problems = find_animate_pairs(items, data, controls, 24.0)
    assert items[0]["reference"].endswith("a.png") and items[0]["driving"].endswith("a.mp4")
    assert any("b.mp4: no driving clip" in problem and str(controls / "b") in problem for problem in problems)
    assert any("c.mp4: no reference image" in problem for problem in problems)
    assert len(problems) == 2


def test_a_clip_after_its_videos_first_frame_trains_as_a_later_segment(tmp_path):
    """clip_mode multiple takes a longer video as several clips: the first trains as a first segment, the later ones carry their
    first frame (the previous segment's last) as the pipeline's continuation segments do; the plan says so."""
    from types import SimpleNamespace

    import numpy as np
    from PIL import Image

    from zeropipe.data.videos import write_video
    from zeropipe.families.diffusion.parts.base import Planning

    data, controls = tmp_path / "clips", tmp_path / "controls"
    data.mkdir(), controls.mkdir()
    clip = np.zeros((13, 32, 32, 3), dtype=np.uint8)
    write_video(data / "a.mp4", clip, 24.0), write_video(controls / "a.mp4", clip, 24.0)
    Image.new("RGB", (32, 32)).save(controls / "a.png")
    config = SimpleNamespace(data=SimpleNamespace(control_path=str(controls), synthetic=None, video=SimpleNamespace(fps="auto")))
    items = [{"path": str(data / "a.mp4"), "start": start} for start in (0, 4, 8)]
    planning = Planning(config, ARCHITECTURE, None, data, tmp_path / "cache", items, [(32, 32, 5)] * 3, [], tmp_path / "fingerprints")
    part = ARCHITECTURE.record.conditions[0]
    part.attach(planning)
    assert [item["carried_frames"] for item in planning.items] == [0, 1, 1]
    assert any("2 of 3 clip(s) start after their video's first frame and train as later segments" in note for note in planning.notes), planning.notes
    plan = SimpleNamespace(items=planning.items, fps=24.0)
    assert part.load(plan, 1, (32, 32, 5), False)[2] == 1 and part.load(plan, 0, (32, 32, 5), False)[2] == 0
    # Samples longer than the clips are drawn segment by segment along the first target's driving clip: it must be as long.
    from zeropipe.errors import DataError

    config.data.video.sample_frames = 13
    part.attach(Planning(config, ARCHITECTURE, None, data, tmp_path / "cache", [dict(item) for item in items], [(32, 32, 5)] * 3, [], tmp_path / "fingerprints"))
    config.data.video.sample_frames = 17
    with pytest.raises(DataError, match=r"data.video.sample_frames is 17: the samples follow the first target's driving clip .*a.mp4, which has 13 frame\(s\) .*at most 13"):
        part.attach(Planning(config, ARCHITECTURE, None, data, tmp_path / "cache", [dict(item) for item in items], [(32, 32, 5)] * 3, [], tmp_path / "fingerprints"))


def test_a_reference_image_linked_out_of_a_ui_runs_folders_is_named_and_not_read(tmp_path):
    """A UI-submitted run's control folder may hold a symlink to a file elsewhere (a key, a photo): it is skipped and named, never read."""
    import numpy as np
    from PIL import Image

    from zeropipe.confine import OUTSIDE_REASON, Confinement, confining
    from zeropipe.data.videos import write_video
    from zeropipe.families.diffusion.parts.animate_reference import find_animate_pairs

    root, elsewhere = tmp_path / "ui-data", tmp_path / "elsewhere"
    data, controls = root / "clips", root / "controls"
    for folder in (data, controls, elsewhere):
        folder.mkdir(parents=True)
    clip = np.zeros((9, 32, 32, 3), dtype=np.uint8)
    write_video(data / "a.mp4", clip, 24.0)
    write_video(controls / "a.mp4", clip, 24.0)
    Image.new("RGB", (32, 32)).save(elsewhere / "secret.png")
    (controls / "a.png").symlink_to(elsewhere / "secret.png")
    items = [{"path": str(data / "a.mp4"), "start": 0, "clip_frames": 9}]
    with confining(Confinement((root,), base=root)):
        problems = find_animate_pairs(items, data, controls, 24.0)
    assert problems == [f"{data / 'a.mp4'}: its reference image {controls / 'a.png'} {OUTSIDE_REASON}"] and "reference" not in items[0]
    # Without confinement (a command-line run), the same folder is the user's own: the link is followed.
    assert find_animate_pairs(items, data, controls, 24.0) == [] and items[0]["reference"].endswith("a.png")


def test_the_catalog_counts_the_release_and_traces_both_passes():
    from zeropipe.plan.model_spec import catalog_names, spec_from_catalog

    assert "wan2.2-animate-2-14b" in catalog_names()
    spec = spec_from_catalog("wan2.2-animate-2-14b", None)
    # Wan 2.1 14B's 14.29B plus the image cross-attention's key/value projections (2 x 5120^2 x 40) and the CLIP projection.
    assert spec.total_params == pytest.approx(16.39e9, rel=0.005)
    frozen = {model.name.split(" ")[0]: model.params for model in spec.frozen_models}
    assert frozen["text_encoder"] == pytest.approx(5.68e9, rel=0.01) and frozen["image_encoder"] == pytest.approx(632e6, rel=0.01)
    trace = spec.activation_trace
    assert trace is not None and trace.frames == 81 and trace.resolution == 640 and 0 < trace.checkpointed_bytes < trace.saved_bytes


def test_a_sample_longer_than_a_segment_is_the_pipelines_segment_loop(tiny):
    """An 8-frame sample in 5-frame segments carrying 1 frame (2 segments, the driving clip zigzag-padded by 1): the entry's
    sampling (draw, then decoded) is the blocks' video preprocessing, segment geometry and segment loop
    (``WanAnimate2DenoiseStep``: per segment the driving slice, the previous segment's decoded last frame, fresh noise,
    the denoiser, the decode), the segments joined and trimmed as ``WanAnimate2DecodeStep`` does."""
    from types import SimpleNamespace

    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.modular_pipelines.wan_animate_2.before_denoise import WanAnimate2PrepareSegmentsStep
    from diffusers.modular_pipelines.wan_animate_2.denoise import WanAnimate2DenoiseStep
    from diffusers.modular_pipelines.wan_animate_2.encoders import WanAnimate2ImageVaeEncoderStep, WanAnimate2ProcessVideosInputStep
    from PIL import Image

    from zeropipe.families.diffusion.modular import run_block
    from zeropipe.families.diffusion.parts.animate_reference import vae_latents, vae_pixels

    pipeline, vae, transformer, _ = tiny
    frames, steps = 8, 1
    rng = np.random.default_rng(5)
    driving_frames = [Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)) for _ in range(frames)]
    generator = torch.Generator().manual_seed(6)
    image = torch.rand(1, 3, SIDE, SIDE, generator=generator) * 2 - 1
    embeds = {name: torch.randn(1, 64, 32, generator=generator) for name in ("prompt_embeds", "prompt_ref_embeds")}
    clips = {name: torch.randn(1, 50, 1280, generator=generator) for name in ("reference_clip", "driving_clip")}

    geometry = dict(segment_frame_length=SEGMENT, prev_segment_conditioning_frames=1, height=SIDE, width=SIDE)
    video = run_block(pipeline, WanAnimate2ProcessVideosInputStep(), ("driving_video_pixels", "real_frame_len", "num_segments", "effective_segment"),
                      driving_video=driving_frames, **geometry)
    assert video["num_segments"] == 2 and video["driving_video_pixels"].shape[2] == 9
    reference_half = run_block(pipeline, WanAnimate2ImageVaeEncoderStep(), ("reference_image_latents",), image_pixels=image)["reference_image_latents"]
    sizes = run_block(pipeline, WanAnimate2PrepareSegmentsStep(), ("grid_sizes_ref", "max_seq_len", "max_seq_len_ref"), reference_image_latents=reference_half,
                      driving_video_pixels=video["driving_video_pixels"], segment_frame_length=SEGMENT)
    pipeline.update_components(scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0))
    expected = run_block(
        pipeline, WanAnimate2DenoiseStep(), ("segment_frames",), groups={"denoiser_input_fields": {"encoder_hidden_states_image": clips["reference_clip"]}},
        **geometry, **video, **sizes, reference_image_latents=reference_half, condition_clip_context=clips["driving_clip"], num_inference_steps=steps,
        generator=torch.Generator().manual_seed(7), negative_prompt_embeds=None, **embeds,
    )["segment_frames"]
    expected = torch.cat(expected, dim=2)[:, :, :frames]

    # The entry's sampling, given what the part's sample_inputs gives it: the driving clip's pixels (as the blocks preprocess them) and the reference latents.
    drawing = SimpleNamespace(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0), zeropipe_vae_factor=8)
    kwargs = {
        "condition": embeds, "negative": {"prompt_embeds": torch.zeros(1, 64, 32)}, "guidance_scale": 1.0, "generator": torch.Generator().manual_seed(7),
        "num_inference_steps": steps, "height": SIDE, "width": SIDE, "num_frames": frames,
        "animate": {"reference_latents": vae_latents(vae, image[:, :, None]), "driving_pixels": video["driving_video_pixels"][:, :, :frames], "segment_frames": SEGMENT,
                    "carried_frames": 1, **clips},
    }
    sampling = ARCHITECTURE.sampling
    with torch.no_grad():
        latents = sampling.draw(drawing, kwargs)
        got = sampling.decoded(drawing, latents, kwargs, lambda part: vae_pixels(vae, part))
    assert latents.shape[2] == 2 * 2 and got.shape == expected.shape == (1, 3, frames, SIDE, SIDE)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
