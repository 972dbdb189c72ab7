"""`check` on parallel.sequence_parallel_size (issue 40): the causal LM with what Ulysses needs passes;
the rest is refused with the reason and the degrees that work."""

import json

import pytest

from zeropipe.check.run import check_config
from zeropipe.config.deepspeed import build_deepspeed_config
from zeropipe.config.load import validate_config

LLAMA = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 64}


def config(tmp_path, gpus=4, sp=2, ds_json=None, **sections):
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')
    raw = {"model": {"config": dict(LLAMA)}, "data": {"path": str(data)}, "hardware": {"gpus": gpus}, "deepspeed": {"zero_stage": 3}}
    if sp is not None:
        raw["parallel"] = {"sequence_parallel_size": sp}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    if ds_json is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(ds_json))
        raw["deepspeed"] = {"config_file": str(path)}
    return validate_config(raw)


def sp_findings(cfg):
    return [f for f in check_config(cfg, accelerator="cpu") if f.rule == "ZP022" and f.severity == "error"]


def test_a_causal_lm_with_divisible_heads_and_ranks_is_accepted(tmp_path):
    cfg = config(tmp_path)
    assert sp_findings(cfg) == []
    assert [f for f in check_config(cfg, accelerator="cpu") if f.severity == "error"] == []
    ds = build_deepspeed_config(cfg, 4, total_steps=10).config
    # DeepSpeed counts data-parallel ranks in train_batch_size: 4 ranks / SP 2.
    assert (ds["sequence_parallel_size"], ds["train_batch_size"]) == (2, cfg.train.micro_batch_size * 2)


@pytest.mark.parametrize(
    ("sp", "gpus", "sections", "key", "words"),
    [
        (4, 4, {"model": {"config": dict(LLAMA, num_attention_heads=6, num_key_value_heads=3, hidden_size=36)}}, "parallel.sequence_parallel_size",
         "6 attention heads (3 key/value heads) do not split into 4"),
        (2, 3, {}, "parallel.sequence_parallel_size", "3 ranks do not divide into groups of 2"),
        (2, 4, {"data": {"packing": True}}, "parallel.sequence_parallel_size", "examples would see each other"),
        (2, 4, {"model": {"attn_implementation": "eager"}}, "model.attn_implementation", "refuses eager attention"),
        (2, 4, {"deepspeed": {"zero_stage": 2}}, "deepspeed.zero_stage", "ZeRO-3 only"),
        (2, 4, {"deepspeed": {"zero_stage": 3, "overrides": {"zero_optimization": {"reduce_scatter": False}}}}, "deepspeed: zero_optimization.reduce_scatter", "divides by every rank"),
    ],
)
def test_what_ulysses_cannot_run_is_refused_with_the_reason(tmp_path, sp, gpus, sections, key, words):
    found = sp_findings(config(tmp_path, gpus=gpus, sp=sp, **sections))
    assert any(f.key == key and words in f.message for f in found), [f.render() for f in found]


def test_heads_refusal_names_the_degrees_that_work(tmp_path):
    found = sp_findings(config(tmp_path, gpus=4, sp=4, model={"config": dict(LLAMA, num_attention_heads=6, num_key_value_heads=3, hidden_size=36)}))
    assert found and "one of 3, 6" in found[0].fix, [f.render() for f in found]


def test_a_deepspeed_json_sequence_parallel_size_is_taken_into_the_config(tmp_path):
    cfg = config(tmp_path, sp=None, ds_json={"sequence_parallel_size": 2, "zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4, "train_batch_size": 16})
    from zeropipe.launch.resolve import resolve_run

    resolved = resolve_run(cfg, 4, "cpu", fill_auto_knobs=False)
    # train_batch_size 16 = micro 4 x accumulation 2 x (4 ranks / SP 2).
    assert (resolved.config.parallel.sequence_parallel_size, resolved.config.train.gradient_accumulation_steps) == (2, 2)
    assert any("parallel.sequence_parallel_size = 2 (from" in note for note in resolved.notes), resolved.notes
    assert sp_findings(resolved) == []


def diffusion_config(pipeline: str, gpus: int = 4, sp: int = 2, **overrides):
    raw = {"model": {"family": "diffusion", "config": {"pipeline": pipeline, **overrides}}, "hardware": {"gpus": gpus},
           "parallel": {"sequence_parallel_size": sp}, "deepspeed": {"zero_stage": 3}, "data": {"synthetic": {"task": "shapes", "examples": 16}}}
    return validate_config(raw)


def test_a_diffusion_transformer_with_a_verified_plan_is_accepted():
    assert sp_findings(diffusion_config("tiny-wan")) == []


@pytest.mark.parametrize(
    ("pipeline", "overrides", "words", "fix"),
    [
        # a UNet: no plan; the refusal lists the entries that have a verified one
        ("tiny-sdxl", {}, "has no context-parallel plan (_cp_plan) in diffusers", "sequence_parallel_size: 1"),
        # a plan diffusers ships that fails here (the text mask), refused with the measured reason
        ("tiny-ltx-video", {}, "repeats the text mask over all the heads", "sequence_parallel_size: 1"),
        # 3 heads do not split into 2: the degrees that work
        ("tiny-wan", {"transformer": {"num_attention_heads": 3}}, "3 heads do not split into 2", "one of 3"),
    ],
)
def test_what_a_diffusion_run_cannot_split_is_refused_with_the_reason(pipeline, overrides, words, fix):
    found = sp_findings(diffusion_config(pipeline, **overrides))
    assert any(words in f.message and fix in f.fix for f in found), [f.render() for f in found]
    if "plan" in words:
        assert "wan, wan-i2v" in found[0].message and "flux" in found[0].message and "ltx-video" not in found[0].message.split("entries")[-1]
