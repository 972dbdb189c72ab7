"""The recommendation: the cheapest combination that fits, and a reason when none does."""

from __future__ import annotations

import json

import pytest
import yaml

from zeropipe.config.schema import DataSection, DeepSpeedSection, ModelSection, RunConfig, SyntheticSection, TrainSection
from zeropipe.errors import ZeroPipeError
from zeropipe.families import model_spec
from zeropipe.plan import Choice, evaluate, knobs_from_config, parse_hardware, plan_run, recommend
from zeropipe.plan.model_spec import spec_from_params
from zeropipe.plan.search import batch_shapes, candidate_choices


def assert_fits(result):
    best = result.require_best()
    assert best.fits
    assert best.per_gpu_bytes <= result.usable_gpu_bytes
    assert best.per_node_bytes <= result.usable_host_bytes
    for candidate in result.candidates:
        assert candidate.fits == (candidate.per_gpu_bytes <= result.usable_gpu_bytes and candidate.per_node_bytes <= result.usable_host_bytes)
        assert candidate.fits or candidate.why_not
    return best


def test_small_model_on_big_gpus_needs_no_zero3(spec_of):
    best = assert_fits(recommend(spec_of("gemma-2-2b"), parse_hardware("4x80GB", "512GB"), seq_len=2048))
    assert best.choice.zero_stage <= 2
    assert not best.choice.offload_optimizer and not best.choice.offload_param


def test_big_model_on_small_gpus_needs_zero3_or_offload(spec_of):
    best = assert_fits(recommend(spec_of("qwen2.5-7b"), parse_hardware("4x24GB", "256GB"), seq_len=2048))
    assert best.choice.zero_stage == 3 or best.choice.offload_optimizer


def test_lora_on_five_consumer_gpus_is_partitioned_because_of_loading(spec_of):
    # 5 ranks each loading 16 GB of Llama-3.1-8B weights exceed 64 GB of RAM below ZeRO-3.
    result = recommend(spec_of("llama-3.1-8b", 16), parse_hardware("5x24GB", "64GB"), seq_len=2048)
    best = assert_fits(result)
    assert best.choice.zero_stage == 3
    zero2 = [c for c in result.candidates if c.choice.zero_stage == 2]
    assert zero2 and not any(c.fits for c in zero2)
    assert all("host RAM" in c.why_not and "model loading peak" in c.why_not for c in zero2 if c.per_gpu_bytes <= result.usable_gpu_bytes)


@pytest.mark.parametrize("name", ["mistral-7b", "sdxl"])
@pytest.mark.parametrize("hardware", [("5x24GB", "64GB"), ("4x48GB", "128GB"), ("8x80GB", "1TB")])
def test_every_answer_fits(spec_of, name, hardware):
    result = recommend(spec_of(name), parse_hardware(*hardware), global_batch=None, seq_len=1024)
    if result.best is not None:
        assert_fits(result)
    else:
        assert result.reason


def test_nothing_fits_gets_a_clear_reason(spec_of):
    result = recommend(spec_of("llama-3.1-70b"), parse_hardware("2x24GB", "64GB"), seq_len=2048)
    assert result.best is None
    assert result.reason.startswith("nothing fits")
    assert "GiB" in result.reason and "Options:" in result.reason
    with pytest.raises(ZeroPipeError, match="nothing fits"):
        result.require_best()


def test_global_batch_must_divide_over_the_ranks():
    with pytest.raises(ZeroPipeError, match="use 10 or 15"):
        batch_shapes(parse_hardware("5x24GB", "64GB"), 12)
    assert batch_shapes(parse_hardware("2x24GB", "64GB"), 8) == [(1, 4), (2, 2), (4, 1)]


def test_fixed_knobs_are_held():
    hardware = parse_hardware("2x24GB", "64GB")
    choices = candidate_choices(hardware, fixed={"zero_stage": 3, "micro_batch_size": 2, "precision": "bf16"})
    assert choices and all(c.zero_stage == 3 and c.micro_batch_size == 2 and c.precision == "bf16" for c in choices)


def test_yaml_fragment_and_json_carry_the_chosen_settings():
    result = recommend(spec_from_params(1e9), parse_hardware("4x24GB", "128GB"), global_batch=16, seq_len=512)
    best = result.require_best()
    fragment = yaml.safe_load(result.yaml_fragment())
    assert fragment["deepspeed"]["zero_stage"] == best.choice.zero_stage
    assert fragment["deepspeed"]["offload_optimizer"] in ("none", "cpu")
    assert fragment["deepspeed"]["precision"] == best.choice.precision
    assert fragment["model"]["gradient_checkpointing"] == best.choice.gradient_checkpointing
    train = fragment["train"]
    assert train["micro_batch_size"] * train["gradient_accumulation_steps"] * 4 == 16
    data = json.loads(json.dumps(result.to_dict()))
    assert data["best"]["choice"]["zero_stage"] == best.choice.zero_stage
    assert {t["name"] for t in data["best"]["per_gpu_terms"]} >= {"parameters (16-bit)", "gradients (16-bit)", "optimizer states"}
    assert len(data["candidates"]) == len(result.candidates)


def test_zero3_costs_more_than_zero2_when_both_fit():
    spec, hardware = spec_from_params(1e9), parse_hardware("4x80GB", "512GB")
    zero2 = evaluate(spec, hardware, Choice(zero_stage=2, seq_len=512))
    zero3 = evaluate(spec, hardware, Choice(zero_stage=3, seq_len=512))
    offload = evaluate(spec, hardware, Choice(zero_stage=3, offload_optimizer=True, seq_len=512))
    assert zero2.relative_cost < zero3.relative_cost < offload.relative_cost


def tiny_run_config(**deepspeed) -> RunConfig:
    return RunConfig(
        model=ModelSection(
            config={"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
        ),
        data=DataSection(synthetic=SyntheticSection(), max_seq_len=128),
        train=TrainSection(micro_batch_size=4, gradient_accumulation_steps=2),
        deepspeed=DeepSpeedSection(**{"precision": "bf16", **deepspeed}),
    )


def test_plan_run_evaluates_the_configs_own_choice():
    config = tiny_run_config(zero_stage=3)
    result = plan_run(config, parse_hardware("2x24GB", "64GB"), model_spec(config))
    assert result.configured is not None and result.configured.fits
    assert result.configured.choice.zero_stage == 3
    assert result.configured.choice.micro_batch_size == 4 and result.configured.choice.seq_len == 128
    assert result.global_batch == 4 * 2 * 2
    assert result.best is not None


def test_plan_run_fills_auto_knobs_and_holds_the_others():
    config = tiny_run_config(zero_stage="auto", offload_optimizer="auto")
    config.model.gradient_checkpointing = "auto"
    assert knobs_from_config(config)["zero_stage"] == "auto"
    result = plan_run(config, parse_hardware("2x24GB", "64GB"), model_spec(config))
    assert result.configured is None
    best = result.require_best()
    assert best.choice.micro_batch_size == 4 and best.choice.gradient_accumulation_steps == 2
    assert best.choice.offload_param is False and best.choice.precision == "bf16"
    assert result.fragment()["deepspeed"]["zero_stage"] == best.choice.zero_stage
    assert any("auto" in note for note in result.notes)


def test_plan_run_with_auto_batch_shape_uses_the_default_examples_per_gpu():
    config = tiny_run_config(zero_stage=2)
    config.train.micro_batch_size = "auto"
    config.train.gradient_accumulation_steps = "auto"
    best = plan_run(config, parse_hardware("2x24GB", "64GB"), model_spec(config)).require_best()
    assert best.choice.micro_batch_size * best.choice.gradient_accumulation_steps == 16
