"""Wan VACE's pieces held to diffusers' own Wan 2.2 VACE blocks (``Wan22VaceBlocks``) on a tiny transformer and VAE:
the control branch's input built from a control video, its mask and a reference image is ``WanVaceEncoderStep``'s, and the
entry's call is ``Wan22LoopDenoiser``'s (``transformer_cls=WanVACETransformer3DModel``) denoiser output."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from zeropipe.families.diffusion.bases.wan import ARCHITECTURE as WAN
from zeropipe.families.diffusion.bases.wan_vace import WanVaceCall
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.modular import run_block, run_loop_block
from zeropipe.families.diffusion.parts.vace_context import control_hidden_states
from zeropipe.families.diffusion.roles import PredictContext

CPU = torch.device("cpu")
TINY = {**WAN.record.preset["transformer"], "vace_layers": [0, 1], "vace_in_channels": 96}


@pytest.fixture(scope="module")
def tiny():
    from diffusers import AutoencoderKLWan, ClassifierFreeGuidance, Wan22VaceModularPipeline, WanVACETransformer3DModel

    torch.manual_seed(0)
    vae_fields = dict(WAN.record.preset["vae"])
    vae_fields.update(latents_mean=[0.1 * i for i in range(16)], latents_std=[0.5 + 0.1 * i for i in range(16)])  # not the identity
    vae = AutoencoderKLWan(**{key: value for key, value in vae_fields.items() if key not in ("scale_factor_spatial", "scale_factor_temporal")}).eval()
    transformer = WanVACETransformer3DModel(**TINY).eval()
    pipeline = Wan22VaceModularPipeline()
    pipeline.update_components(
        vae=vae, transformer=transformer, transformer_2=transformer,
        guider=ClassifierFreeGuidance(guidance_scale=4.0, enabled=False), guider_2=ClassifierFreeGuidance(guidance_scale=3.0, enabled=False),
    )
    return pipeline, vae, transformer


def _inputs():
    """A 5-frame 32x32 control video (frames as PIL images), a mask keeping its left half, a 24x16 reference image."""
    from PIL import Image

    rng = np.random.default_rng(0)
    video = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(5)]
    mask_pixels = np.zeros((32, 32, 3), dtype=np.uint8)
    mask_pixels[:, 16:] = 255  # white: generate; black: keep
    mask = [Image.fromarray(mask_pixels) for _ in range(5)]
    reference = Image.fromarray(rng.integers(0, 256, (24, 16, 3), dtype=np.uint8))
    return video, mask, reference


def test_the_control_input_is_the_vace_encoder_blocks(tiny):
    from diffusers.modular_pipelines.wan.encoders import WanVaceEncoderStep

    pipeline, vae, _ = tiny
    video, mask, reference = _inputs()
    expected = run_block(
        pipeline, WanVaceEncoderStep(), ("control_hidden_states", "num_reference_images"),
        video=video, mask=mask, reference_images=[reference], height=32, width=32, num_frames=5,
    )
    # The same pixels as the block preprocesses them: the clip in [-1, 1], the mask in [0, 1], the reference letterboxed on white.
    pixels, masks, references = WanVaceEncoderStep.preprocess_conditions(pipeline, video, mask, [reference], 32, 32, 5, torch.float32, CPU)
    ours = control_hidden_states(vae, pixels, masks, references[0])
    assert expected["num_reference_images"] == 1
    assert ours.shape == expected["control_hidden_states"].shape == (1, 96, 1 + 2, 4, 4)
    assert torch.allclose(ours, expected["control_hidden_states"], atol=1e-5), (ours - expected["control_hidden_states"]).abs().max()
    # What is kept and what is reworked differ: the mask reached the VAE's two inputs.
    assert not torch.allclose(ours[:, :16, 1:], ours[:, 16:32, 1:])


@pytest.mark.parametrize("t", [900.0, 300.0])
def test_predict_is_the_wan22_vace_denoiser_blocks_output(tiny, t):
    from diffusers import WanVACETransformer3DModel
    from diffusers.modular_pipelines.wan.denoise import Wan22LoopDenoiser
    from diffusers.modular_pipelines.wan.encoders import WanVaceEncoderStep

    pipeline, _, transformer = tiny
    video, mask, reference = _inputs()
    control = run_block(pipeline, WanVaceEncoderStep(), ("control_hidden_states", "control_hidden_states_scale"), video=video, mask=mask, reference_images=[reference], height=32, width=32, num_frames=5)
    torch.manual_seed(1)
    latents, embeds = torch.randn(1, 16, 3, 4, 4), torch.randn(1, 8, TINY["text_dim"])
    timestep = torch.tensor(t)
    block = Wan22LoopDenoiser(transformer_cls=WanVACETransformer3DModel)
    state = run_loop_block(
        pipeline, block, 0, timestep, latent_model_input=latents, dtype=torch.float32, num_inference_steps=1, attention_kwargs=None,
        prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds), denoiser_input_fields=dict(control),
    )
    entry = Architecture(record=WAN.record, call=WanVaceCall())
    condition = {"prompt_embeds": embeds, "vace_context": control["control_hidden_states"], "vace_scale": control["control_hidden_states_scale"]}
    ours = entry.call.predict(transformer, latents, timestep.expand(1), condition, PredictContext(CPU, torch.float32, 8, 1.0))
    assert torch.allclose(ours, state.noise_pred, atol=1e-6), (ours - state.noise_pred).abs().max()
    # Without the scale the transformer takes 1 per control layer, as conditioning_scale=1.0 does; the control input matters.
    unscaled = entry.call.predict(transformer, latents, timestep.expand(1), {**condition, "vace_scale": None}, PredictContext(CPU, torch.float32, 8, 1.0))
    assert torch.equal(unscaled, ours)
    blank = entry.call.predict(transformer, latents, timestep.expand(1), {**condition, "vace_context": torch.zeros_like(condition["vace_context"])}, PredictContext(CPU, torch.float32, 8, 1.0))
    assert not torch.allclose(blank, ours)


def test_the_catalog_counts_wan22_vace_fun_from_its_published_configs():
    """17.34B per expert: the 34.7 GB of bf16 weights in linoyts/Wan2.2-VACE-Fun-14B-diffusers' transformer/ (Wan 2.2 A14B's 14.29B
    expert and 8 control blocks); UMT5-XXL and the Wan VAE frozen; the trace (stored) at 81 frames of 640 px through the control branch."""
    import zeropipe.families.diffusion  # noqa: F401 - registers the diffusion family's spec builders with the planner
    from zeropipe.plan.model_spec import catalog_names, spec_from_catalog

    assert "wan2.2-vace-fun-a14b" in catalog_names()
    spec = spec_from_catalog("wan2.2-vace-fun-a14b", None)
    assert spec.total_params == pytest.approx(17.34e9, rel=0.005) and spec.family == "diffusion_transformer"
    frozen = {model.name.split(" ")[0]: model.params for model in spec.frozen_models}
    assert frozen["text_encoder"] == pytest.approx(5.68e9, rel=0.01) and frozen["vae"] == pytest.approx(126.9e6, rel=0.01)
    trace = spec.activation_trace
    assert trace is not None and trace.frames == 81 and trace.resolution == 640


# ---------------------------------------------------------------------------------------------
# The user's control files (parts/vace_control.py): the control input is WanVACEPipeline's own.

FPS = 16.0


@pytest.fixture(scope="module")
def vace_pipeline(tiny):
    from diffusers import WanVACEPipeline

    _, vae, transformer = tiny
    return WanVACEPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=None, transformer=transformer)


def _write_case(root, files):
    """A target clip a.mp4 (5 frames, 32x32) in root/clips, and the named control files in root/controls."""
    from PIL import Image

    from zeropipe.data.videos import write_video

    rng = np.random.default_rng(3)
    data, controls = root / "clips", root / "controls"
    data.mkdir(), controls.mkdir()
    write_video(data / "a.mp4", rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8), FPS)
    if "control" in files:
        write_video(controls / "a.mp4", rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8), FPS)
    if "mask" in files or "mask clip" in files:
        mask = np.zeros((32, 32, 3), dtype=np.uint8)
        mask[:, 16:] = 255  # white: generate; black: keep
        mask[:, 12:16] = 100  # a soft edge: the pipeline binarises what the VAE sees, not the mask it folds
        Image.fromarray(mask).save(controls / "a_mask.png")
    if "mask clip" in files:  # a mask per frame: the kept part grows
        (controls / "a_mask.png").unlink()
        masks = np.zeros((5, 32, 32, 3), dtype=np.uint8)
        for frame in range(5):
            masks[frame, :, 8 + 4 * frame :] = 255
        write_video(controls / "a_mask.mp4", masks, FPS)
    if "reference" in files:
        Image.fromarray(rng.integers(0, 256, (24, 16, 3), dtype=np.uint8)).save(controls / "a.png")
    if "two references" in files:  # numbered: the pipeline's reference_images in this order, of different shapes
        Image.fromarray(rng.integers(0, 256, (24, 16, 3), dtype=np.uint8)).save(controls / "a.ref0.png")
        Image.fromarray(rng.integers(0, 256, (16, 40, 3), dtype=np.uint8)).save(controls / "a.ref1.jpg")
    return data, controls


def _reference_files(controls, files):
    return [controls / "a.png"] if "reference" in files else [controls / "a.ref0.png", controls / "a.ref1.jpg"] if "two references" in files else []


@pytest.mark.parametrize("files", [("control", "mask", "reference"), ("mask clip",), ("reference",), ("control",), ("control", "mask", "two references"), ("two references",)])
def test_the_control_input_from_the_users_files_is_the_pipelines(tmp_path, tiny, vace_pipeline, files):
    """Per case of the module's table, the cached control input equals WanVACEPipeline's ``preprocess_conditions``,
    ``prepare_video_latents`` and ``prepare_masks`` (concatenated, as its call does) given the files as a user passes them, which
    are what the part's samples pass."""
    from zeropipe.data.videos import load_clip_for_bucket
    from zeropipe.families.diffusion.bases.wan_vace import ARCHITECTURE
    from zeropipe.families.diffusion.parts.base import Encoding, Sampling
    from zeropipe.families.diffusion.parts.vace_control import VaceControl, find_vace_controls, load_controls

    _, vae, _ = tiny
    data, controls = _write_case(tmp_path, files)
    items = [{"path": str(data / "a.mp4"), "start": 0, "clip_frames": 5}]
    assert find_vace_controls(items, data, controls, FPS) == []
    loaded = load_controls(items[0], (32, 32, 5), FPS, False)
    clip = load_clip_for_bucket(data / "a.mp4", (32, 32, 5), 0, FPS, FPS).pixels
    part = ARCHITECTURE.record.conditions[0]
    assert isinstance(part, VaceControl)
    ours = part.encode(Encoding(vae, clip[None], [loaded], None, ARCHITECTURE.record.codec, CPU))[0][None]

    # The pipeline's arguments as a user gives them: the files themselves (diffusers' load_image; its load_video needs imageio,
    # which is not installed: the frames as PyAV decodes them).
    from diffusers.utils import load_image

    def load_video(path):
        import av

        with av.open(path) as container:
            return [frame.to_image().convert("RGB") for frame in container.decode(video=0)]

    masked = "mask" in files or "mask clip" in files
    video = load_video(str(controls / "a.mp4")) if "control" in files else load_video(str(data / "a.mp4")) if masked else None
    mask = load_video(str(controls / "a_mask.mp4")) if "mask clip" in files else [load_image(str(controls / "a_mask.png"))] * 5 if masked else None
    references = [load_image(str(path)) for path in _reference_files(controls, files)] or None
    # The part's samples give the pipeline the same.
    plan = SimpleNamespace(items=items, sample_frames=5, fps=FPS)
    load_pixels = lambda index, bucket, crop, flip: load_clip_for_bucket(Path(items[index]["path"]), bucket, 0, FPS, FPS, crop=crop, flip=flip)  # noqa: E731
    sample = part.sample_inputs(Sampling(["a prompt"], 32, (32, 32, 1), plan, None, CPU, load_pixels, lambda: vae), {})
    given = {"video": video, "mask": mask, "reference_images": references}
    assert sorted(sample.kwargs) == sorted(key for key, value in given.items() if value is not None), sample.kwargs
    for key, images in sample.kwargs.items():
        assert [np.asarray(image).tolist() for image in images] == [np.asarray(image.convert("RGB")).tolist() for image in given[key]], key
    assert sample.rows[0]["target"] == items[0]["path"]
    pixels, masks, prepared = vace_pipeline.preprocess_conditions(video, mask, references, 1, 32, 32, 5, torch.float32, CPU)
    with torch.no_grad():
        expected = torch.cat([vace_pipeline.prepare_video_latents(pixels, masks, prepared, None, CPU), vace_pipeline.prepare_masks(masks, prepared, None)], dim=1)
    assert ours.shape == expected.shape == (1, 96, 2 + len(_reference_files(controls, files)), 4, 4)
    assert torch.allclose(ours, expected, atol=1e-5), (ours - expected).abs().max()


def test_a_clip_without_control_files_keeps_the_first_frame_task(tmp_path, tiny):
    from zeropipe.data.videos import load_clip_for_bucket
    from zeropipe.families.diffusion.bases.wan_vace import ARCHITECTURE
    from zeropipe.families.diffusion.parts.base import Encoding
    from zeropipe.families.diffusion.parts.vace_context import VaceFirstFrame
    from zeropipe.families.diffusion.parts.vace_control import find_vace_controls, load_controls

    _, vae, _ = tiny
    data, controls = _write_case(tmp_path, ())
    items = [{"path": str(data / "a.mp4"), "start": 0, "clip_frames": 5}]
    assert find_vace_controls(items, data, controls, FPS) == [] and load_controls(items[0], (32, 32, 5), FPS, False) is None
    clip = load_clip_for_bucket(data / "a.mp4", (32, 32, 5), 0, FPS, FPS).pixels[None]
    encoding = Encoding(vae, clip, [None], None, ARCHITECTURE.record.codec, CPU)
    assert torch.equal(ARCHITECTURE.record.conditions[0].encode(encoding)[0], VaceFirstFrame().encode(encoding)[0])
    assert ARCHITECTURE.record.conditions[0].key_suffix == VaceFirstFrame.key_suffix  # the same cache entries as before


def test_a_mask_linked_out_of_a_ui_runs_folders_is_named_and_not_read(tmp_path):
    """A UI-submitted run's control folder may hold a symlink to a file elsewhere: it is skipped and named, never read."""
    from PIL import Image

    from zeropipe.confine import OUTSIDE_REASON, Confinement, confining
    from zeropipe.data.videos import write_video
    from zeropipe.families.diffusion.parts.vace_control import find_vace_controls

    root, elsewhere = tmp_path / "ui-data", tmp_path / "elsewhere"
    data, controls = root / "clips", root / "controls"
    for folder in (data, controls, elsewhere):
        folder.mkdir(parents=True)
    write_video(data / "a.mp4", np.zeros((9, 32, 32, 3), dtype=np.uint8), FPS)
    Image.new("RGB", (32, 32)).save(elsewhere / "secret.png")
    (controls / "a_mask.png").symlink_to(elsewhere / "secret.png")
    items = [{"path": str(data / "a.mp4"), "start": 0, "clip_frames": 9}]
    with confining(Confinement((root,), base=root)):
        problems = find_vace_controls(items, data, controls, FPS)
    assert len(problems) == 1 and problems[0].endswith(f"{controls / 'a_mask.png'} {OUTSIDE_REASON}"), problems
    # So is a numbered reference image: the clip's other reference images are not taken without it.
    (controls / "a_mask.png").unlink()
    Image.new("RGB", (32, 32)).save(controls / "a.ref0.png")
    (controls / "a.ref1.png").symlink_to(elsewhere / "secret.png")
    with confining(Confinement((root,), base=root)):
        problems = find_vace_controls(items, data, controls, FPS)
    assert problems == [f"{data / 'a.mp4'}: its reference image {controls / 'a.ref1.png'} {OUTSIDE_REASON}"] and "vace_reference" not in items[0]


def test_bad_or_missing_control_files_get_one_message_naming_every_target(tmp_path):
    from PIL import Image

    from zeropipe.data.videos import write_video
    from zeropipe.errors import DataError
    from zeropipe.families.diffusion.bases.wan_vace import ARCHITECTURE
    from zeropipe.families.diffusion.parts.base import Planning

    data, controls = tmp_path / "clips", tmp_path / "controls"
    data.mkdir(), controls.mkdir()
    clip = np.zeros((9, 32, 32, 3), dtype=np.uint8)
    for name in ("a", "b", "c", "d", "e"):
        write_video(data / f"{name}.mp4", clip, FPS)
    write_video(controls / "a.mp4", clip[:3], FPS)  # too short
    (controls / "b.png").write_bytes(b"")  # an empty reference image
    write_video(controls / "c.mp4", clip, FPS), write_video(controls / "c.webm", clip, FPS)  # two control clips
    Image.new("RGB", (32, 32)).save(controls / "d_mask.png")  # fine: inpainting; e: no files, the first-frame task

    def planning(micro_batch_size=1):
        config = SimpleNamespace(data=SimpleNamespace(control_path=str(controls), synthetic=None, video=SimpleNamespace(fps="auto")), train=SimpleNamespace(micro_batch_size=micro_batch_size))
        items = [{"path": str(data / f"{name}.mp4"), "start": 0} for name in "abcde"]
        return Planning(config, ARCHITECTURE, None, data, tmp_path / "cache", items, [(32, 32, 9)] * 5, [], tmp_path / "fingerprints")

    with pytest.raises(DataError) as error:
        ARCHITECTURE.record.conditions[0].attach(planning())
    message = str(error.value)
    assert message.startswith("3 problem(s) with the VACE control files of 5 target clip(s)"), message
    assert "a.mp4: its control clip" in message and "has 3 frame(s) at 16 fps, the target's clip needs 9" in message
    assert "b.mp4: its reference image" in message and "empty file" in message
    assert "c.mp4: several control clips have its name (c.mp4, c.webm): keep one" in message
    assert "NAME_mask.mp4 or NAME_mask.png" in message  # the fix names the layout
    # Fixed, the files attach; clips with and without a reference image cannot share a batch.
    (controls / "a.mp4").unlink(), (controls / "c.webm").unlink()
    Image.new("RGB", (32, 32)).save(controls / "b.png")
    fixed = planning()
    ARCHITECTURE.record.conditions[0].attach(fixed)
    assert [sorted(key for key in item if key.startswith("vace_") and not key.endswith("_fps")) for item in fixed.items] == [
        [], ["vace_reference"], ["vace_control"], ["vace_mask"], []]
    assert any("2 with no control file (the first-frame task)" in note for note in fixed.notes), fixed.notes
    with pytest.raises(DataError, match="1 of 5 target clip.s. have a reference image .* set train.micro_batch_size: 1"):
        ARCHITECTURE.record.conditions[0].attach(planning(micro_batch_size=2))
    # Several reference images per clip (numbered): one clip with two, one with one, the rest none.
    Image.new("RGB", (32, 32)).save(controls / "c.ref0.png"), Image.new("RGB", (32, 32)).save(controls / "c.ref1.png")
    numbered = planning()
    ARCHITECTURE.record.conditions[0].attach(numbered)
    assert numbered.items[2]["vace_reference"] == [str(controls / "c.ref0.png"), str(controls / "c.ref1.png")]
    assert ARCHITECTURE.record.conditions[0].key_files(numbered.items[2])[-2:] == (("reference", controls / "c.ref0.png"), ("reference1", controls / "c.ref1.png"))
    assert any("1 with several reference images" in note for note in numbered.notes), numbered.notes
    with pytest.raises(DataError, match=r"different numbers of reference images \(3 with 0 .*1 with 1 .*1 with 2 \(e.g. .*c.mp4\)\).*give every clip the same number of reference images, or set train.micro_batch_size: 1"):
        ARCHITECTURE.record.conditions[0].attach(planning(micro_batch_size=2))
    # NAME.png and numbered ones for one clip: which is meant is not guessed.
    Image.new("RGB", (32, 32)).save(controls / "c.png")
    with pytest.raises(DataError, match="c.mp4: both c.png and numbered reference images .c.ref0.png, c.ref1.png. have its name"):
        ARCHITECTURE.record.conditions[0].attach(planning())


def test_the_reference_slot_is_noised_with_the_clip_and_left_out_of_the_prediction(tiny):
    _, _, transformer = tiny
    from zeropipe.families.diffusion.bases.wan_vace import ARCHITECTURE

    torch.manual_seed(4)
    latents, embeds = torch.randn(2, 16, 2, 4, 4), torch.randn(2, 8, TINY["text_dim"])
    control = torch.randn(2, 96, 3, 4, 4)  # one reference frame before the clip's two
    condition = {"prompt_embeds": embeds, "vace_context": control}
    timesteps = torch.tensor([700.0, 200.0])
    context = PredictContext(CPU, torch.float32, 8, 1.0)
    with torch.no_grad():
        ours = ARCHITECTURE.call.predict(transformer, latents, timesteps, condition, context)
        again = ARCHITECTURE.call.predict(transformer, latents, timesteps, condition, context)
        other = control.clone()
        other[:, :16, :1] += 1  # another reference image's latents
        moved = ARCHITECTURE.call.predict(transformer, latents, timesteps, {**condition, "vace_context": other}, context)
    assert ours.shape == latents.shape and torch.equal(ours, again)
    assert not torch.allclose(ours, moved)
    # Two reference images: two slots before the clip, both left out, the second one read too.
    two = torch.randn(2, 96, 4, 4, 4)
    with torch.no_grad():
        both = ARCHITECTURE.call.predict(transformer, latents, timesteps, {**condition, "vace_context": two}, context)
        other = two.clone()
        other[:, :16, 1:2] += 1
        second = ARCHITECTURE.call.predict(transformer, latents, timesteps, {**condition, "vace_context": other}, context)
    assert both.shape == latents.shape and not torch.allclose(both, second)
