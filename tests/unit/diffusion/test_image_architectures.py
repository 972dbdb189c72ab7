"""The image DiT architectures (Chroma, Qwen-Image, Z-Image): their LoRA in the layouts other tools load, checked against diffusers' converters."""

from __future__ import annotations

import pytest
import torch

from zeropipe.families.diffusion.entries import architecture_named

CHROMA = architecture_named("chroma")


def random_lora(shapes: dict[str, tuple[int, int]], rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A diffusers-layout LoRA: module -> (out, in) gives lora_A (rank, in) and lora_B (out, rank)."""
    generator = torch.Generator().manual_seed(seed)
    layers = {}
    for module, (rows, columns) in shapes.items():
        layers[f"{module}.lora_A.weight"] = torch.randn(rank, columns, generator=generator)
        layers[f"{module}.lora_B.weight"] = torch.randn(rows, rank, generator=generator)
    return layers


def deltas(layers: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Each module's weight change B @ A x scale, applied to fixed random inputs (the full matrices would take GBs at real sizes)."""
    modules = {key.partition(".lora_")[0] for key in layers}
    out = {}
    for module in modules:
        down, up = layers[f"{module}.lora_A.weight"], layers[f"{module}.lora_B.weight"]
        probe = torch.randn(down.shape[1], 3, generator=torch.Generator().manual_seed(down.shape[1]))
        out[module] = scale * up @ (down @ probe)
    return out


def test_chroma_lora_in_the_kohya_layout_converts_back_with_diffusers_at_chroma_sizes():
    """Fused q/k/v (and single blocks' q/k/v/mlp) adapters: diffusers' Flux/Chroma kohya converter recovers every module's change."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    inner, mlp = 3072, 12288  # Chroma1-HD: 24 heads x 128, MLP ratio 4 (what diffusers' converter assumes)
    shapes = {}
    for block in (0, 18):
        for name in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"):
            shapes[f"transformer_blocks.{block}.{name}"] = (inner, inner)
        shapes[f"transformer_blocks.{block}.ff.net.2"] = (inner, mlp)
    for block in (0, 37):
        for name in ("attn.to_q", "attn.to_k", "attn.to_v"):
            shapes[f"single_transformer_blocks.{block}.{name}"] = (inner, inner)
        shapes[f"single_transformer_blocks.{block}.proj_mlp"] = (mlp, inner)
        shapes[f"single_transformer_blocks.{block}.proj_out"] = (inner, inner + mlp)
    rank, alpha = 2, 8.0
    layers = random_lora(shapes, rank)
    original = CHROMA.layouts.original_lora_layout(layers, alpha)
    assert "lora_unet_double_blocks_18_img_attn_qkv.lora_down.weight" in original
    assert original["lora_unet_single_blocks_37_linear1.lora_up.weight"].shape == (3 * inner + mlp, 4 * rank)
    assert float(original["lora_unet_double_blocks_0_txt_attn_qkv.alpha"]) == 3 * alpha  # rank 3 x 2: the strength alpha / rank is kept

    converted = _convert_kohya_flux_lora_to_diffusers(dict(original))
    recovered = {key.removeprefix("transformer."): value for key, value in deltas(converted, 1.0).items()}
    expected = deltas(layers, alpha / rank)
    assert set(recovered) == set(expected)
    for module, delta in expected.items():
        torch.testing.assert_close(recovered[module], delta, rtol=1e-4, atol=1e-3)



@pytest.mark.parametrize("preset,latent_shape", [("tiny-qwen-image", (1, 16, 1, 8, 8)), ("tiny-z-image", (1, 4, 8, 8)), ("tiny-chroma", (1, 4, 8, 8))])
def test_a_captions_prediction_does_not_depend_on_the_padding_its_batch_adds(tmp_path, preset, latent_shape):
    """Captions are cached at their encoding batch's length and padded again per training batch: the masks must make that invisible."""
    from zeropipe.families.diffusion.entries import PredictContext
    from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, encode_prompts, stack_padded, text_pipeline, vae_scale_factor

    arch = build_tiny_pipeline({"pipeline": preset}, tmp_path / "pipeline", seed=1)
    cpu = torch.device("cpu")
    encoders = text_pipeline(tmp_path / "pipeline", arch, torch.float32, cpu)
    alone = encode_prompts(encoders, arch, ["a red circle"], cpu)[0]
    with_long = encode_prompts(encoders, arch, ["a red circle", "a small green square on a white background, seen from above"], cpu)
    padded = {key: stack_padded([row[key] for row in with_long]) for key in alone}
    assert padded["prompt_embeds"].shape[1] > alone["prompt_embeds"].shape[0] or preset == "tiny-chroma"  # Chroma pads every prompt to a fixed length
    model = arch.model_class().from_pretrained(str(tmp_path / "pipeline" / arch.record.denoiser)).eval()
    context = PredictContext(cpu, torch.float32, vae_scale_factor(tmp_path / "pipeline"), 1.0)
    latents = torch.randn(latent_shape, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([700.0])
    with torch.no_grad():
        reference = arch.call.predict(model, latents, timesteps, {key: value[None] for key, value in alone.items()}, context)
        in_batch = arch.call.predict(model, latents.repeat(2, *[1] * (latents.dim() - 1)), timesteps.repeat(2), padded, context)[:1]
    assert reference.shape == latents.shape
    torch.testing.assert_close(in_batch, reference, rtol=1e-4, atol=1e-5)
