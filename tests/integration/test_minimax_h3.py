"""MiniMax-H3 with its guidance-preserving objective (diffusion-pipe's CFG-augmented training) through the run's own path:
the launcher's data step and the node's caches (the empty prompt cached as no text rows), one ZeRO-3 rank training two
LoRA steps on micro-batches that carry the empty prompt's conditioning and the scale."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_minimax_h3_trains_its_lora_under_zero3_with_the_guidance_preserving_objective(tmp_path, monkeypatch):
    from tests.diffusion_contract import data_section, prepare, run_config, train_one_rank
    from zeropipe.families.diffusion.entries import architecture_named
    from zeropipe.families.diffusion.parts.guidance import SCALE, UNCONDITIONAL
    from zeropipe.families.diffusion.prepare import fill_caches

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    arch = architecture_named("minimax-h3")
    raw = run_config(arch, tmp_path, "guided", data_section(arch, tmp_path))
    raw["model"]["diffusion"] = {"guidance_preserving": 4.0}
    run = prepare(raw).run
    fill_caches(run, torch.device("cpu"), torch.float32)
    _, _, condition, _ = train_one_rank("minimax-h3", arch, run, monkeypatch)
    assert float(condition[SCALE]) == 4.0
    assert condition["prompt_embeds_mask"].sum() > 0 and condition[UNCONDITIONAL + "prompt_embeds_mask"].sum() == 0, "the empty prompt is no text rows"
    assert condition["audio_latents"].shape[1:] == (2 * 37, 32), "22 frames at 24 fps: 37 audio latents per stereo channel"
    assert [row["step"] for row in run.read_metrics()] == [1, 2]
