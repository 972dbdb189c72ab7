"""FLUX.2 ([dev] and [klein]): the latents, prompts, LoRA layout and single files as Flux2Pipeline and diffusers' converters have them."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from tests.unit.diffusion.test_image_architectures import deltas, random_lora
from zeropipe.errors import ConfigError
from zeropipe.families.diffusion.bases.flux2 import text_encoder_layers
from zeropipe.families.diffusion.entries import architecture_named

FLUX2 = architecture_named("flux2")
FLUX2_KLEIN = architecture_named("flux2-klein")


@pytest.fixture(scope="module")
def tiny_flux2(tmp_path_factory):
    """A tiny FLUX.2 [dev] pipeline whose VAE has non-trivial batch-norm statistics (a fresh one's are 0 and 1, which would hide a wrong direction)."""
    from diffusers import AutoencoderKLFlux2

    from zeropipe.families.diffusion.pipelines import build_tiny_pipeline

    folder = tmp_path_factory.mktemp("flux2") / "pipeline"
    build_tiny_pipeline({"pipeline": "tiny-flux2"}, folder, seed=1)
    vae = AutoencoderKLFlux2.from_pretrained(str(folder / "vae"))
    generator = torch.Generator().manual_seed(5)
    vae.bn.running_mean.copy_(torch.randn(16, generator=generator))
    vae.bn.running_var.copy_(torch.rand(16, generator=generator) * 3 + 0.2)
    vae.save_pretrained(str(folder / "vae"))
    return folder


def test_latents_are_patched_then_normalised_by_the_vaes_batch_norm_and_decoded_as_the_pipeline_does(tiny_flux2):
    """What training normalises (cache -> the codec's from_vae -> latent_scaling read from the VAE's files) is Flux2Pipeline's image latents; samples decode as it decodes."""
    from diffusers import Flux2Pipeline

    from zeropipe.families.diffusion import cache
    from zeropipe.families.diffusion.pipelines import denormalize_latents, latent_scaling, load_component, normalize_latents

    vae = load_component(tiny_flux2, "vae", torch.float32, torch.device("cpu"))
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    shift, scale = latent_scaling(tiny_flux2, FLUX2)
    assert shift.shape == (16,) and not torch.allclose(shift, torch.zeros(16))
    mean, _ = cache.encode_latent_distribution(vae, pixels)
    ours = normalize_latents(FLUX2.record.codec.from_vae(mean), shift, scale)
    pipeline = Flux2Pipeline(scheduler=None, vae=vae, text_encoder=None, tokenizer=None, transformer=None)
    with torch.no_grad():
        reference = pipeline._encode_vae_image(pixels, generator=None)  # the mode of the distribution, patched and normalised
    assert ours.shape == (2, 16, 8, 8)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)

    # The pipeline's decode (output_type="pil"): unpack, undo the batch norm, unpatch, decode.
    with torch.no_grad():
        bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        expected = vae.decode(pipeline._unpatchify_latents(reference * bn_std + vae.bn.running_mean.view(1, -1, 1, 1))).sample
        decoded = FLUX2.record.codec.decode(vae, denormalize_latents(ours, shift, scale))
    torch.testing.assert_close(decoded, expected, rtol=1e-4, atol=1e-4)


def test_a_fitted_tiny_vae_stores_unit_variance_statistics_in_its_batch_norm():
    from diffusers import AutoencoderKLFlux2

    from zeropipe.families.diffusion.tiny.components import tiny_flux2_vae

    vae = AutoencoderKLFlux2(**tiny_flux2_vae())
    latents = torch.randn(64, 4, 8, 8, generator=torch.Generator().manual_seed(0)) * 3 + 1
    patched = FLUX2.record.codec.from_vae(latents)
    FLUX2.record.codec.store_statistics(vae, patched)
    normalized = (patched - vae.bn.running_mean.view(1, -1, 1, 1)) / torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    assert abs(float(normalized.mean())) < 0.05 and abs(float(normalized.std()) - 1) < 0.05


def test_the_stacked_text_layers_are_the_pipelines_defaults_for_the_real_encoders():
    """Mistral Small 3.1 (40 layers, from the catalog) -> Flux2Pipeline's (10, 20, 30); Qwen3-4B/8B (36) -> Flux2KleinPipeline's (9, 18, 27)."""
    from types import SimpleNamespace

    import transformers
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    from zeropipe.plan.model_spec import CATALOG_DIR

    entry = json.loads((CATALOG_DIR / "flux.2-dev.json").read_text())
    mistral = transformers.Mistral3Config(**{k: v for k, v in entry["frozen"][0]["config"].items() if k not in ("architectures", "model_type")})
    dev_default = inspect.signature(Flux2Pipeline.encode_prompt).parameters["text_encoder_out_layers"].default
    klein_default = inspect.signature(Flux2KleinPipeline.encode_prompt).parameters["text_encoder_out_layers"].default
    assert text_encoder_layers(SimpleNamespace(config=mistral)) == tuple(dev_default) == (10, 20, 30)
    assert text_encoder_layers(SimpleNamespace(config=transformers.Qwen3Config(num_hidden_layers=36))) == tuple(klein_default) == (9, 18, 27)


def test_flux2_lora_in_bfl_names_converts_back_with_diffusers_at_flux2_dev_sizes():
    """q/k/v of each stream fused (rank 3r, block diagonal), alpha / r folded into lora_B: diffusers' converter recovers every module's change at scale 1."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_flux2_lora_to_diffusers

    inner, mlp = 6144, 18432  # FLUX.2 [dev]: 48 heads x 128, MLP ratio 3 (SwiGLU: linear_in is twice as wide)
    shapes = {}
    for block in (0, 7):
        for name in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"):
            shapes[f"transformer_blocks.{block}.{name}"] = (inner, inner)
        shapes[f"transformer_blocks.{block}.ff.linear_in"] = (2 * mlp, inner)
        shapes[f"transformer_blocks.{block}.ff_context.linear_out"] = (inner, mlp)
    for block in (0, 47):
        shapes[f"single_transformer_blocks.{block}.attn.to_qkv_mlp_proj"] = (3 * inner + 2 * mlp, inner)
        shapes[f"single_transformer_blocks.{block}.attn.to_out"] = (inner, inner + mlp)
    # A stream with only k and v trained: q's rows stay zero.
    del shapes["transformer_blocks.7.attn.add_q_proj"]
    rank, alpha = 2, 8.0
    layers = random_lora(shapes, rank)
    original = FLUX2.layouts.original_lora_layout(layers, alpha)
    assert original["diffusion_model.double_blocks.7.img_attn.qkv.lora_A.weight"].shape == (3 * rank, inner)
    assert original["diffusion_model.double_blocks.0.txt_attn.qkv.lora_B.weight"].shape == (3 * inner, 3 * rank)
    assert "diffusion_model.single_blocks.47.linear1.lora_B.weight" in original and not any(key.endswith(".alpha") for key in original)

    converted = _convert_non_diffusers_flux2_lora_to_diffusers(dict(original))
    recovered = {key.removeprefix("transformer."): value for key, value in deltas(converted, 1.0).items()}
    expected = deltas(layers, alpha / rank)
    assert set(recovered) == set(expected) | {"transformer_blocks.7.attn.add_q_proj"}
    assert recovered["transformer_blocks.7.attn.add_q_proj"].abs().max() == 0
    for module, delta in expected.items():
        torch.testing.assert_close(recovered[module], delta, rtol=1e-4, atol=1e-3)


def test_a_bfl_single_file_is_refused_with_the_conversion_that_works(tmp_path):
    """BFL's file fuses q/k/v, which diffusers' converter splits by computing tensors: not streamable into ZeRO partitions, so the fix is named."""
    from safetensors.torch import save_file

    from zeropipe.families.diffusion.pipelines import single_file_renamer

    checkpoint = tmp_path / "flux2-dev.safetensors"
    save_file({
        "double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2), "double_blocks.0.img_attn.proj.weight": torch.zeros(2, 2),
        "single_blocks.0.linear1.weight": torch.zeros(4, 2), "single_stream_modulation.lin.weight": torch.zeros(6, 2), "img_in.weight": torch.zeros(2, 4),
    }, str(checkpoint))
    with pytest.raises(ConfigError, match=r"Flux2Transformer2DModel.from_single_file\(\.\.\.\)\.save_pretrained"):
        single_file_renamer("Flux2Transformer2DModel", checkpoint)


def test_klein_samples_as_its_model_index_says_distilled_or_not(tmp_path):
    """Flux2KleinPipeline's is_distilled (model_index.json) reaches the sampling pipeline, which decides real CFG by it."""
    from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, denoising_pipeline

    folder = tmp_path / "klein"
    build_tiny_pipeline({"pipeline": "tiny-flux2-klein"}, folder, seed=1)
    index_file = folder / "model_index.json"
    for distilled in (True, False):
        index = json.loads(index_file.read_text())
        index["is_distilled"] = distilled
        index_file.write_text(json.dumps(index))
        pipeline = denoising_pipeline(folder, FLUX2_KLEIN, denoiser=None)
        pipeline._guidance_scale = 4.0
        assert pipeline.do_classifier_free_guidance is (not distilled)


def test_a_pixtral_processor_tokenizer_without_torchvision_says_what_to_install(tmp_path):
    """FLUX.2 [dev]'s tokenizer folder is a PixtralProcessor (model_index.json), loaded as diffusers loads it; transformers needs torchvision for it."""
    import importlib.util

    from zeropipe.families.diffusion.tiny.tokenizers import character_mistral_tokenizer
    from zeropipe.families.diffusion.pipelines import load_tokenizer

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the processor loads")
    character_mistral_tokenizer().save_pretrained(str(tmp_path / "tokenizer"))
    # What PixtralProcessor.save_pretrained writes beside the tokenizer (the real folder also has its chat template).
    (tmp_path / "tokenizer" / "processor_config.json").write_text(json.dumps({"processor_class": "PixtralProcessor", "patch_size": 14, "spatial_merge_size": 2}))
    (tmp_path / "tokenizer" / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor"}))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "Flux2Pipeline", "tokenizer": ["transformers", "PixtralProcessor"]}))
    with pytest.raises(ConfigError, match="PixtralProcessor.*pip install torchvision"):
        load_tokenizer(tmp_path, "tokenizer")
    # A folder named as a tokenizer loads as before.
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "Flux2Pipeline", "tokenizer": ["transformers", "PreTrainedTokenizerFast"]}))
    assert load_tokenizer(tmp_path, "tokenizer").chat_template
