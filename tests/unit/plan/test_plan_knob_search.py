"""The planner searches every knob that makes a run fit: caches picked (exact), an fp8/nf4 base and smaller shapes offered
with their price, exit 0 when a change fits, the nearest box when none does, plans before the download.

The flagship diffusion models' traces come from the stored traces (plan/catalog/traces.json): each plan is arithmetic.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeropipe.cli.main import main

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted(p.relative_to(ROOT) for p in (ROOT / "examples").rglob("*.yaml") if "data" not in p.relative_to(ROOT / "examples").parts)


def plan(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["plan", *argv])
    return rc, capsys.readouterr().out


@pytest.mark.parametrize(
    "model,gpus",
    [
        ("flux.2-dev", "5x24GB"),
        ("wan2.2-t2v-a14b", "5x24GB"),
        ("qwen-image", "5x24GB"),
        ("hunyuan-video-1.5", "5x24GB"),
        ("ltx-2", "5x24GB"),
        ("z-image-turbo", "5x24GB"),
        ("qwen-image", "1x24GB"),
        ("wan2.1-t2v-14b", "1x24GB"),
    ],
)
def test_flagship_models_fit_the_box_they_are_trained_on(capsys, model, gpus):
    rc, out = plan(capsys, "--model", model, "--gpus", gpus, "--ram", "64GB", "--lora-r", "32", "--json")
    result = json.loads(out)
    assert rc == 0 and result["runnable"]
    # The default config's caches: no training rank holds a text encoder.
    chosen = result["best"] or result["offers"][0]["candidate"]
    frozen = next(t for t in chosen["per_gpu_terms"] if t["name"] == "frozen models (text encoders, VAE)")
    assert frozen["bytes"] == 0
    assert chosen["per_gpu_bytes"] <= result["usable_gpu_bytes"] and chosen["per_node_bytes"] <= result["usable_host_bytes"]
    assert "data.cache.latents" in result["exact_knobs"] and "model.quantization (fp8, nf4)" in result["offered_knobs"]
    if result["best"] is None:
        # Only offered knobs made it fit: the change is named with its price, and never applied as the recommendation.
        assert result["fragment"] is None
        offer = result["offers"][0]
        assert any(not s["exact"] and s["price"] for s in offer["settings"])
        ranks = [o["rank"] for o in result["offers"]]
        assert ranks == sorted(ranks)
    # An image or video plan states the largest shape that fits (where its denoiser is traced: HunyuanVideo 1.5's is not).
    assert bool(result["largest_shape"]) == (result["model"]["activation_trace"] is not None)


def test_an_offered_change_comes_first_with_its_price_and_is_not_picked(capsys):
    # Wan 2.2 A14B (two 14B experts) on 3 x 24 GB: no exact knob (activation offload included; 3 ranks do not split its
    # 40 heads, so no sequence-parallel degree) makes it fit; an fp8 base does. On 5 x 24 GB sequence parallelism does:
    # test_plan_sequence_parallel.py.
    rc, out = plan(capsys, "--model", "wan2.2-t2v-a14b", "--gpus", "3x24GB", "--ram", "64GB", "--lora-r", "32")
    assert rc == 0
    verdict = next(line for line in out.splitlines() if line.startswith(("Recommended", "Fits if you set")))
    assert verdict.startswith("Fits if you set model.quantization: fp8")
    assert "price: the frozen base's block linears rounded to fp8" in out
    assert "Recommended:" not in out  # nothing quality-changing is recommended silently
    assert "  # and model.quantization: fp8" in out  # the YAML names the change beside the settings
    others = out.split("Other changes that fit, cheapest in quality first:")[1]
    assert "data.images.resolution" in others  # a smaller image, priced too


def test_nothing_fits_names_the_nearest_box(capsys):
    """A full fine-tune of Llama-3.1-8B on 5 x 24 GB with 64 GB: 16 bytes per weight fit neither side; 256 GB of RAM (optimizer offload) would."""
    rc, out = plan(capsys, "--model", "llama-3.1-8b", "--gpus", "5x24GB", "--ram", "64GB")
    assert rc == 1
    assert "No change the planner knows" in out
    assert "Nearest box that fits: --gpus 5x24GB --ram 256GB --nodes 1: " in out and "offload optimizer" in out.split("Nearest box that fits:")[1].splitlines()[0]


# Examples whose model the catalog cannot count yet, each with why: planned from its folder once downloaded, refused before.
NO_CATALOG: dict[str, str] = {}


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_every_example_plans_without_weights(capsys, monkeypatch, example):
    monkeypatch.chdir(ROOT)
    if str(example) in NO_CATALOG:
        rc = main(["plan", str(example), "--gpus", "5x24GB", "--ram", "64GB", "--json"])
        assert rc == 2 and "names no catalog model either" in capsys.readouterr().err, NO_CATALOG[str(example)]
        return
    rc, out = plan(capsys, str(example), "--gpus", "5x24GB", "--ram", "64GB", "--json")
    result = json.loads(out)
    assert rc == (0 if result["runnable"] else 1)
    assert result["model"]["total_params"] > 0


def test_check_still_refuses_the_missing_model_path(capsys):
    monkeypatch_root = ROOT
    rc = main(["check", str(monkeypatch_root / "examples/models/flux2.yaml")])
    captured = capsys.readouterr()
    assert rc != 0
    assert "model.path" in captured.out + captured.err


def test_a_config_with_caches_off_is_planned_as_set_and_caching_is_picked_when_only_it_fits(capsys, tmp_path):
    """Qwen-Image with both caches off on 5 x 24 GB: five ranks each holding Qwen2.5-VL do not fit 64 GB; the caches (exact) do."""
    import yaml

    config = yaml.safe_load((ROOT / "examples/models/qwen-image.yaml").read_text())
    config["data"]["cache"] = {"latents": False, "text": False}
    path = tmp_path / "qwen-image-nocache.yaml"
    path.write_text(yaml.safe_dump(config))
    rc, out = plan(capsys, str(path), "--gpus", "5x24GB", "--ram", "64GB")
    assert rc == 0
    assert "note: picked data.cache: {latents: true, text: true} (changes no result" in out
    assert "Recommended:" in out and "  with data.cache: {latents: true, text: true}: changes no result" in out
