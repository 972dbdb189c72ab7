"""Diffusion training (SDXL, SD3, Flux): image data, latents and the training step."""
