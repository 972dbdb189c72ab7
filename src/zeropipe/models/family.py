"""Which family a configured model belongs to, and the defaults that differ by family."""

from __future__ import annotations

import json
from pathlib import Path

from zeropipe.config.schema import LoraSection, ModelSection

FAMILIES = ("causal_lm", "vlm", "diffusion")

# LoRA's usual targets: the attention projections, named as each library names them.
LORA_DEFAULT_TARGETS = {
    "causal_lm": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "vlm": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "diffusion": ["to_q", "to_k", "to_v", "to_out.0"],
}


def model_family(section: ModelSection) -> str:
    """causal_lm, vlm or diffusion: model.family, or what model.path / model.config show."""
    if section.family != "auto":
        return section.family
    if section.path:
        path = Path(section.path).expanduser()
        if (path / "model_index.json").is_file():
            return "diffusion"
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            return "causal_lm"
        return "vlm" if "vision_config" in config else "causal_lm"
    config = section.config or {}
    if "pipeline" in config:
        return "diffusion"
    return "vlm" if "vision_config" in config else "causal_lm"


def lora_targets(lora: LoraSection, family: str) -> list[str] | str:
    """The target_modules argument of peft's LoraConfig."""
    if lora.target_modules == "auto":
        return list(LORA_DEFAULT_TARGETS[family])
    if lora.target_modules == "all-linear":
        return "all-linear"
    return list(lora.target_modules)
