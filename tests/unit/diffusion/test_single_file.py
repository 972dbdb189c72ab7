"""Single-file (original / ComfyUI layout) denoiser checkpoints: names converted by diffusers' converter, tensors streamed."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file

from zeropipe.families.diffusion.entries import architecture_named
from zeropipe.families.diffusion.pipelines import single_file_renamer
from zeropipe.errors import ConfigError

WAN = architecture_named("wan")

# diffusers name -> original Wan name, in order (the inverse of diffusers' convert_wan_transformer_to_diffusers).
TO_ORIGINAL = [
    (r"^scale_shift_table$", "head.modulation"), (r"\.scale_shift_table$", ".modulation"),
    (r"condition_embedder\.time_embedder\.linear_1", "time_embedding.0"), (r"condition_embedder\.time_embedder\.linear_2", "time_embedding.2"),
    (r"condition_embedder\.text_embedder\.linear_1", "text_embedding.0"), (r"condition_embedder\.text_embedder\.linear_2", "text_embedding.2"),
    (r"condition_embedder\.time_proj", "time_projection.1"), (r"^proj_out", "head.head"),
    (r"\.attn1\.", ".self_attn."), (r"\.attn2\.", ".cross_attn."), (r"\.to_out\.0\.", ".o."), (r"\.to_q\.", ".q."), (r"\.to_k\.", ".k."), (r"\.to_v\.", ".v."),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."), (r"\.ffn\.net\.2\.", ".ffn.2."), (r"\.norm2\.", ".norm3."),
]


def original_layout(state: dict[str, torch.Tensor], prefix: str = "model.diffusion_model.") -> dict[str, torch.Tensor]:
    """A diffusers Wan state dict as the original checkpoints (and ComfyUI's) name it."""
    out = {}
    for key, tensor in state.items():
        for pattern, replacement in TO_ORIGINAL:
            key = re.sub(pattern, replacement, key)
        out[prefix + key] = tensor.contiguous()
    return out


def write_original_checkpoint(path, seed: int = 5):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**WAN.record.preset["transformer"])
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    save_file(original_layout(state), str(path))
    return state


def test_a_single_file_in_the_original_layout_loads_tensor_by_tensor_with_diffusers_names(tmp_path):
    from diffusers import WanTransformer3DModel

    from zeropipe.models.loading import load_pretrained

    state = write_original_checkpoint(tmp_path / "wan_t2v_tiny.safetensors")
    rename = single_file_renamer("WanTransformer3DModel", tmp_path / "wan_t2v_tiny.safetensors")
    assert rename("model.diffusion_model.blocks.0.self_attn.q.weight") == "blocks.0.attn1.to_q.weight"
    assert rename("model.diffusion_model.blocks.1.norm3.weight") == "blocks.1.norm2.weight"  # the original's norm3 is diffusers' norm2
    config = dict(WAN.record.preset["transformer"])
    model = load_pretrained(lambda: WanTransformer3DModel(**config), tmp_path / "wan_t2v_tiny.safetensors", dtype=torch.float32, zero_stage=0, device="cpu", rename=rename)
    loaded = model.state_dict()
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[key], state[key]) for key in state)
    # Computed buffers (rotary frequencies) are there too: the model runs.
    out = model(hidden_states=torch.randn(1, 16, 2, 4, 4), timestep=torch.tensor([10.0]), encoder_hidden_states=torch.randn(1, 8, 32), return_dict=False)[0]
    assert out.shape == (1, 16, 2, 4, 4)


def test_a_file_that_is_not_safetensors_is_named_with_the_key(tmp_path):
    (tmp_path / "wan.safetensors").write_text("not a checkpoint")
    with pytest.raises(ConfigError, match="model.diffusion.denoiser_file"):
        single_file_renamer("WanTransformer3DModel", tmp_path / "wan.safetensors")
    with pytest.raises(ConfigError, match="no single-file converter"):
        single_file_renamer("NoSuchTransformer", tmp_path / "wan.safetensors")
