"""Objectives, cache keys, pipeline presets and the planner's view of a diffusion config, without starting ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from zeropipe.config.load import validate_config
from zeropipe.config.schema import DiffusionSection
from zeropipe.families.diffusion import cache
from zeropipe.families.diffusion.entries import architecture_of
from zeropipe.families.diffusion.core import DDPM_SCHEDULE
from zeropipe.families.diffusion.objectives import DDPMObjective, FlowObjective, weighted_mse
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, encode_prompts, fingerprint_files, text_pipeline
from zeropipe.errors import ConfigError


def test_epsilon_and_velocity_targets_follow_the_scheduler():
    latents = torch.randn(4, 4, 8, 8)
    eps = DDPMObjective(DDPM_SCHEDULE, DiffusionSection(prediction_type="epsilon")).noise(latents, torch.Generator().manual_seed(0))
    v = DDPMObjective(DDPM_SCHEDULE, DiffusionSection(prediction_type="v_prediction")).noise(latents, torch.Generator().manual_seed(0))
    # Same draws: same noisy input; the v target is sqrt(a) * noise - sqrt(1 - a) * x0, not the noise.
    assert torch.equal(eps.model_input, v.model_input)
    objective = DDPMObjective(DDPM_SCHEDULE, DiffusionSection(prediction_type="v_prediction"))
    alpha = objective.scheduler.alphas_cumprod[v.timesteps].view(-1, 1, 1, 1)
    assert torch.allclose(v.target, alpha.sqrt() * eps.target - (1 - alpha).sqrt() * latents, atol=1e-5)


def test_min_snr_weights_cap_easy_timesteps_and_noise_offset_shifts_channels():
    objective = DDPMObjective(DDPM_SCHEDULE, DiffusionSection(min_snr_gamma=5.0, noise_offset=0.1))
    batch = objective.noise(torch.zeros(64, 4, 8, 8), torch.Generator().manual_seed(1))
    snr = objective.snr[batch.timesteps]
    assert torch.allclose(batch.weights, torch.clamp(snr, max=5.0) / snr)
    assert batch.weights.max() <= 1.0 and batch.weights.min() < 1.0
    assert weighted_mse(torch.zeros(2, 1, 2, 2), torch.ones(2, 1, 2, 2), torch.tensor([1.0, 0.0])) == pytest.approx(0.5)


def test_flow_matching_interpolates_and_the_shift_favours_high_noise():
    latents = torch.randn(512, 4, 4, 4)
    plain = FlowObjective({"shift": 1.0}, DiffusionSection()).sigmas(4096, torch.Generator().manual_seed(0))
    shifted = FlowObjective({"shift": 3.0}, DiffusionSection()).sigmas(4096, torch.Generator().manual_seed(0))
    assert 0 < plain.min() and plain.max() < 1 and shifted.mean() > plain.mean() + 0.1
    batch = FlowObjective({"shift": 3.0}, DiffusionSection()).noise(latents, torch.Generator().manual_seed(2))
    sigma = (batch.timesteps / 1000).view(-1, 1, 1, 1)
    noise = batch.target + latents
    assert torch.allclose(batch.model_input, (1 - sigma) * latents + sigma * noise, atol=1e-5)
    with pytest.raises(ConfigError, match="flow matching"):
        FlowObjective({}, DiffusionSection(prediction_type="epsilon"))


def test_cache_keys_change_only_with_what_they_depend_on(tmp_path):
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    first.write_bytes(b"one")
    second.write_bytes(b"two")
    keys = {p: cache.latent_key(p, (32, 32), "center", "vae1") for p in (first, second)}
    assert cache.latent_key(first, (32, 32), "center", "vae1") == keys[first]
    assert cache.latent_key(first, (40, 24), "center", "vae1") != keys[first]
    assert cache.latent_key(first, (32, 32), "center", "vae2") != keys[first]
    os.utime(second, ns=(1, 1))  # the image changed on disk: its key changes, the other's does not
    assert cache.latent_key(second, (32, 32), "center", "vae1") != keys[second]
    assert cache.latent_key(first, (32, 32), "center", "vae1") == keys[first]
    assert cache.text_key("a cat", "te") != cache.text_key("a dog", "te") != cache.text_key("a dog", "te2")
    cache.save_entry(tmp_path, "text", "ab12", {"x": torch.ones(2)})
    assert cache.has_entry(tmp_path, "text", "ab12") and torch.equal(cache.load_entry(tmp_path, "text", "ab12")["x"], torch.ones(2))
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("elements", [16, 300_000])  # a small entry (read and parsed) and one past SMALL_ENTRY_BYTES (mapped)
def test_cache_entries_come_back_exactly_whatever_their_size(tmp_path, elements):
    saved = {
        "mean": torch.randn(elements),
        "embeds": torch.randn(2, elements // 2).to(torch.bfloat16),
        "target_size": torch.tensor([1024, 768]),
        "crop_top_left": torch.zeros(2, dtype=torch.int64),
    }
    cache.save_entry(tmp_path, "latents", "cd34", saved)
    assert (cache.entry_path(tmp_path, "latents", "cd34").stat().st_size > cache.SMALL_ENTRY_BYTES) == (elements > 1000)
    loaded = cache.load_entry(tmp_path, "latents", "cd34")
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    # What training does with an entry: sample latents from it; the file is not touched.
    sample = loaded["mean"] + torch.ones_like(loaded["mean"])
    assert torch.equal(sample, saved["mean"] + 1) and torch.equal(cache.load_entry(tmp_path, "latents", "cd34")["mean"], saved["mean"])


@pytest.mark.parametrize("preset", ["tiny-sdxl", "tiny-sd15", "tiny-sd3", "tiny-flux"])
def test_tiny_pipelines_are_deterministic_and_encode_prompts(tmp_path, preset):
    arch = build_tiny_pipeline({"pipeline": preset}, tmp_path / "a", seed=5)
    build_tiny_pipeline({"pipeline": preset}, tmp_path / "b", seed=5)
    assert architecture_of(tmp_path / "a") == arch
    # Same config and seed: the same weights, so a second run's caches match the first's.
    assert fingerprint_files(tmp_path / "a" / "vae") == fingerprint_files(tmp_path / "b" / "vae")
    assert fingerprint_files(tmp_path / "a" / arch.record.denoiser) == fingerprint_files(tmp_path / "b" / arch.record.denoiser)
    pipeline = text_pipeline(tmp_path / "a", arch, torch.float32, torch.device("cpu"))
    encoded = encode_prompts(pipeline, arch, ["a red circle", ""], torch.device("cpu"))
    assert len(encoded) == 2 and not torch.equal(encoded[0]["prompt_embeds"], encoded[1]["prompt_embeds"])


def test_unknown_preset_and_component_are_named():
    with pytest.raises(ConfigError, match="tiny-sdxl"):
        build_tiny_pipeline({"pipeline": "tiny-sdxxl"}, Path("/nonexistent"), seed=0)
    with pytest.raises(ConfigError, match="model.config.unet2"):
        build_tiny_pipeline({"pipeline": "tiny-sdxl", "unet2": {}}, Path("/nonexistent"), seed=0)


def test_random_crop_with_cached_latents_is_refused_up_front():
    raw = {"model": {"config": {"pipeline": "tiny-sdxl"}}, "data": {"synthetic": {"task": "shapes"}, "images": {"crop": "random"}}}
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    assert "data.images.crop" in str(err.value) and "cache.latents: false" in str(err.value)
    raw["data"]["cache"] = {"latents": False}
    validate_config(raw)


def test_plan_drops_cached_encoders_from_the_ranks():
    from zeropipe.families import model_spec as spec_from_config

    raw = {"model": {"config": {"pipeline": "tiny-sdxl"}}, "data": {"synthetic": {"task": "shapes"}, "images": {"resolution": 32}}}
    cached = spec_from_config(validate_config(raw))
    assert cached.frozen_models == () and {m.name for m in cached.cached_models} == {"vae", "text_encoder", "text_encoder_2"}
    raw["data"]["cache"] = {"latents": False}
    uncached = spec_from_config(validate_config(raw))
    assert [m.name for m in uncached.frozen_models] == ["vae"]
    assert cached.trainable_params == uncached.trainable_params > 500_000


def test_fitting_the_tiny_vae_teaches_it_to_reconstruct_and_sets_its_scale(tmp_path):
    """vae_fit_steps: a tiny VAE learns to reconstruct shapes, and latents * scaling_factor have unit variance.

    The preset's VAE (32 and 64 channels at 32 px) took 246 s of CI for 80 steps; this one has the
    preset's layout with half the channels and a quarter of the pixels (16 px: fit_tiny_vae draws
    its shapes at the VAE's sample_size), which fit_tiny_vae teaches as well in 40 steps (9 s).
    """
    import diffusers

    from zeropipe.data.images import generate_shapes_dataset, load_image_for_bucket, scan_image_folder
    from zeropipe.families.diffusion.pipelines import fit_tiny_vae, preset_components

    _, components = preset_components({"pipeline": "tiny-sdxl", "vae_fit_steps": 80})
    assert "vae_fit_steps" not in components  # how the VAE is made, not a component
    narrow = {**components["vae"], "block_out_channels": [16, 32], "norm_num_groups": 8, "sample_size": 16}
    generate_shapes_dataset(tmp_path, 16, seed=99, resolution=16)
    images = torch.stack([load_image_for_bucket(item.path, (16, 16), crop="center", flip=False).pixels for item in scan_image_folder(tmp_path).items])

    def reconstruction_error(vae) -> float:
        with torch.no_grad():
            return float(((vae.decode(vae.encode(images).latent_dist.mean).sample - images) ** 2).mean())

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(**narrow)
    before = reconstruction_error(vae)
    from zeropipe.families.diffusion.entries import architecture_named

    # One thread: tensors this small gain nothing from two, and on a loaded 2-core machine the
    # threads' barrier waits made the fit 4-5x slower (41 s against 9 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fit_tiny_vae(vae, 40, seed=0, arch=architecture_named("sd3"))  # an architecture with shifted latents
    finally:
        torch.set_num_threads(threads)
    assert reconstruction_error(vae) < 0.6 * before
    with torch.no_grad():
        latents = vae.encode(images).latent_dist.mean
    scaled = (latents - vae.config.shift_factor) * vae.config.scaling_factor
    assert 0.7 < float(scaled.std()) < 1.4
