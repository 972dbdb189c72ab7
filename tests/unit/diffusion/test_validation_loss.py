"""The pieces of a diffusion run's validation loss: fixed timesteps at quantiles, per-item seeds, the held-out split, the ranks' shares."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zeropipe.config.load import validate_config
from zeropipe.config.schema import DiffusionSection
from zeropipe.data.images import generate_shapes_dataset
from zeropipe.families.diffusion.core import DDPM_SCHEDULE
from zeropipe.families.diffusion.entries import architecture_named
from zeropipe.families.diffusion.family import FAMILY
from zeropipe.families.diffusion.objectives import DDPMObjective, FlowObjective
from zeropipe.families.diffusion.prepare import held_out_items
from zeropipe.families.diffusion.validation import EVAL_QUANTILES, eval_record, item_seed, rank_positions


def test_flow_quantiles_are_the_training_distributions_and_the_drawn_stream_is_unchanged():
    objective = FlowObjective({"shift": 3.0}, DiffusionSection(min_t=0.2, max_t=0.9))
    sigmas = objective.sigmas_at(torch.tensor(EVAL_QUANTILES, dtype=torch.float64))
    assert torch.all(sigmas[1:] > sigmas[:-1]) and sigmas.min() >= 0.2 and sigmas.max() <= 0.9
    # The drawn noise levels are the same quantile map of uniform draws: the training stream did not change.
    drawn = objective.sigmas(64, torch.Generator().manual_seed(5))
    again = objective.sigmas_at(torch.rand((64,), generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    assert torch.equal(drawn, again)
    # Logit-normal (mean 0) without a shift: the median is the middle noise level, as the fraction of draws below each sigma says.
    plain = FlowObjective({"shift": 1.0}, DiffusionSection())
    assert float(plain.sigmas_at(torch.tensor([0.5]))) == pytest.approx(0.5, abs=1e-6)
    many = plain.sigmas(200_000, torch.Generator().manual_seed(0))
    for quantile, sigma in zip(EVAL_QUANTILES, plain.sigmas_at(torch.tensor(EVAL_QUANTILES))):
        assert float((many <= sigma).double().mean()) == pytest.approx(quantile, abs=0.01)
    latents = torch.randn(1, 4, 8, 8)
    batch = plain.noise(latents, torch.Generator().manual_seed(1), quantiles=torch.tensor([0.3]))
    assert float(batch.timesteps) == pytest.approx(1000 * float(plain.sigmas_at(torch.tensor([0.3]))), rel=1e-6)


def test_ddpm_quantiles_are_timesteps_of_its_schedule():
    objective = DDPMObjective(DDPM_SCHEDULE, DiffusionSection(prediction_type="epsilon"))
    latents = torch.randn(1, 4, 8, 8)
    steps = [int(objective.noise(latents, torch.Generator().manual_seed(0), quantiles=torch.tensor([q], dtype=torch.float64)).timesteps) for q in EVAL_QUANTILES]
    assert steps == [round(1000 * q) for q in EVAL_QUANTILES]
    first = objective.noise(latents, torch.Generator().manual_seed(3), quantiles=torch.tensor([0.5]))
    second = objective.noise(latents, torch.Generator().manual_seed(3), quantiles=torch.tensor([0.5]))
    assert torch.equal(first.model_input, second.model_input)


def test_every_item_is_evaluated_once_whatever_the_rank_count_with_its_own_seed():
    for count in (1, 5, 8):
        for world in (1, 2, 3):
            shares = [rank_positions(count, rank, world) for rank in range(world)]
            assert sorted(p for mine, _ in shares for p in mine) == list(range(count))
            assert len({passes for _, passes in shares}) == 1 and all(len(mine) <= shares[0][1] for mine, _ in shares)
    assert len({item_seed(3, position) for position in range(100)}) == 100 and item_seed(3, 0) != item_seed(4, 0)
    table = torch.tensor([[1.0] * 9, [3.0] * 9], dtype=torch.float64)
    row = eval_record(7, table, 0.5)
    assert row["kind"] == "eval" and row["eval_loss"] == 2.0 and row["eval_examples"] == 2 and row["eval_loss_by_quantile"]["0.9"] == 2.0


def diffusion_raw(tmp_path: Path, **data) -> dict:
    return {"model": {"config": {"pipeline": "tiny-sd3"}}, "data": {"path": str(tmp_path / "images"), **data}, "run": {"seed": 3}}


def test_the_held_out_images_are_a_fraction_drawn_with_the_seed_or_the_eval_folder(tmp_path):
    codec = architecture_named("sd3").record.codec
    images = generate_shapes_dataset(tmp_path / "images", 20, seed=1, resolution=32)
    held = generate_shapes_dataset(tmp_path / "held", 3, seed=2, resolution=32)
    scan = codec.scan(images, ".txt")
    from dataclasses import asdict

    items = [{**asdict(item), "path": str(item.path)} for item in scan.items]
    config = validate_config(diffusion_raw(tmp_path, eval_fraction=0.2))
    notes: list[str] = []
    kept, chosen = held_out_items(config, codec, items, notes)
    assert kept == items and len(chosen) == 4 and chosen <= {item["path"] for item in items}
    assert held_out_items(config, codec, items, [])[1] == chosen  # the same seed: the same images
    other = validate_config({**diffusion_raw(tmp_path, eval_fraction=0.2), "run": {"seed": 4}})
    assert held_out_items(other, codec, items, [])[1] != chosen
    assert "held out 4 of 20 images" in notes[0]

    config = validate_config(diffusion_raw(tmp_path, eval_path=str(held)))
    kept, chosen = held_out_items(config, codec, items, [])
    assert len(kept) == 23 and chosen == {item["path"] for item in kept[20:]}


def test_a_diffusion_run_may_hold_images_out_and_evaluate_them():
    raw = {"model": {"config": {"pipeline": "tiny-sd3"}}, "data": {"synthetic": {"task": "shapes", "examples": 12}, "eval_fraction": 0.25}, "train": {"eval_every": 2}}
    assert not [key for key, _ in FAMILY.config_problems(validate_config(raw)) if key.startswith("data.eval")]
    assert FAMILY.evaluates_loss
