import json
from pathlib import Path

import pytest
import yaml

from zeropipe.config.deepspeed import build_deepspeed_config
from zeropipe.config.load import load_config
from zeropipe.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def write(tmp_path, data, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def minimal(tmp_path, **sections):
    data_file = tmp_path / "train.jsonl"
    data_file.write_text('{"instruction": "hi", "output": "yo"}\n')
    config = {"model": {"config": {"model_type": "llama", "hidden_size": 32}}, "data": {"path": str(data_file)}}
    for key, value in sections.items():
        config.setdefault(key, {}).update(value)
    return config


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_example_loads_and_starts_with_its_command(path):
    assert path.read_text().startswith("# Run it:")
    load_config(path)


def test_all_problems_reported_at_once_with_keys_and_fixes(tmp_path):
    config = minimal(tmp_path, train={"micro_batchsize": 4, "lr": -1}, deepspeed={"zero_stage": 2, "offload_param": "cpu", "precision": "fp8"})
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, config))
    keys = [key for key, _ in info.value.problems]
    text = str(info.value)
    assert "train.micro_batchsize" in keys and "did you mean 'micro_batch_size'" in text
    assert "train.lr" in keys
    assert "deepspeed.precision" in keys
    assert "deepspeed.offload_param" in keys and "set deepspeed.zero_stage: 3" in text
    assert len(keys) == 4


def test_missing_model_and_data_name_the_section(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, {"data": {"path": str(tmp_path / "nope.jsonl")}}))
    text = str(info.value)
    assert "model: no model" in text
    assert "nope.jsonl does not exist" in text


def test_overrides_parse_numbers_and_nested_keys(tmp_path):
    config = load_config(write(tmp_path, minimal(tmp_path)), ["train.lr=2e-5", "deepspeed.zero_stage=3", "train.max_steps=7"])
    assert config.train.lr == 2e-5
    assert config.deepspeed.zero_stage == 3
    assert config.train.max_steps == 7
    assert config.run.name == "run"


def test_bad_override_names_the_key(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, minimal(tmp_path)), ["train.learning_rate=1", "oops"])
    text = str(info.value)
    assert "train.learning_rate: unknown key; did you mean 'lr'" in text
    assert "section.key=value" in text


def test_yaml_syntax_error_gives_line(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "model:\n  path: [unclosed\n"))
    assert "not valid YAML at line" in str(info.value)


def test_generated_deepspeed_config_is_consistent(tmp_path):
    config = load_config(
        write(tmp_path, minimal(tmp_path)),
        ["train.micro_batch_size=3", "train.gradient_accumulation_steps=2", "deepspeed.zero_stage=3", "deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu", "deepspeed.precision=bf16"],
    )
    ds = build_deepspeed_config(config, world_size=5, total_steps=100, hidden_size=64).config
    assert ds["train_batch_size"] == 3 * 2 * 5
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["optimizer"]["type"] == "AdamW" and ds["scheduler"]["params"]["total_num_steps"] == 100
    assert ds["bf16"] == {"enabled": True}


def test_user_deepspeed_json_auto_values_resolved_and_listed(tmp_path):
    hf_trainer_style = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
    }
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps(hf_trainer_style))
    config = load_config(write(tmp_path, minimal(tmp_path, deepspeed={"config_file": str(ds_file)}, train={"micro_batch_size": 2, "lr": 1e-4})))
    resolved = build_deepspeed_config(config, world_size=2, total_steps=50, hidden_size=32, user_json=hf_trainer_style)
    ds = resolved.config
    assert "auto" not in json.dumps(ds)
    assert ds["train_batch_size"] == 4 and ds["optimizer"]["params"]["lr"] == 1e-4
    assert ds["scheduler"]["params"]["total_num_steps"] == 50
    assert ds["zero_optimization"]["reduce_bucket_size"] == 32 * 32
    assert any(line.startswith("optimizer.params.lr = 0.0001") for line in resolved.filled)


def test_user_deepspeed_json_inconsistent_batch_is_refused(tmp_path):
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}))
    config = load_config(write(tmp_path, minimal(tmp_path, deepspeed={"config_file": str(ds_file)})))
    with pytest.raises(ConfigError, match="train_batch_size.*10 != micro-batch 2 x accumulation 1 x 2 ranks = 4"):
        build_deepspeed_config(config, world_size=2, total_steps=10, user_json=json.loads(ds_file.read_text()))


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_no_warmup_means_full_rate_from_the_first_step(tmp_path, schedule):
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR

    config = load_config(write(tmp_path, minimal(tmp_path)), [f"train.schedule={schedule}", "train.warmup_steps=0", "train.lr=0.5"])
    block = build_deepspeed_config(config, world_size=1, total_steps=10).config["scheduler"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    cls = {"WarmupCosineLR": WarmupCosineLR, "WarmupDecayLR": WarmupDecayLR, "WarmupLR": WarmupLR}[block["type"]]
    scheduler = cls(optimizer, **block["params"])
    rates = []
    for _ in range(3):
        rates.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    assert rates[0] == pytest.approx(0.5) and rates[1] == pytest.approx(0.5, rel=0.05), rates


def test_docs_config_reference_is_generated_from_the_schema():
    from zeropipe.config.reference import reference

    docs = Path(__file__).resolve().parents[3] / "docs" / "config.md"
    assert docs.read_text() == reference(), "run: python -m zeropipe.config.reference > docs/config.md"


def test_packing_and_evaluation_settings_that_cannot_work_together(tmp_path):
    config = minimal(tmp_path, data={"packing": True, "group_by_length": True, "eval_path": str(tmp_path / "missing.jsonl"), "eval_fraction": 0.05})
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, config))
    keys = [key for key, _ in info.value.problems]
    assert keys == ["data.group_by_length", "data.eval_fraction", "data.eval_path"]
    assert "does not exist" in str(info.value)
    with pytest.raises(ConfigError, match="set data.eval_path or data.eval_fraction"):
        load_config(write(tmp_path, minimal(tmp_path, train={"eval_every": 10})))
    loaded = load_config(write(tmp_path, minimal(tmp_path, data={"packing": True, "eval_fraction": 0.05}, train={"eval_every": 10})))
    assert loaded.data.packing and loaded.data.eval_fraction == 0.05 and loaded.train.eval_every == 10


def test_deepspeed_json_choices_become_the_runs_and_conflicts_are_named(tmp_path):
    """A stage-2, micro-batch-2 JSON on a stage-3, micro-16 YAML: the JSON is what DeepSpeed runs, so it is the run's, said twice."""
    from zeropipe.check import check_config
    from zeropipe.launch.resolve import resolve_run

    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}))
    config = load_config(write(tmp_path, minimal(tmp_path)), ["train.micro_batch_size=16", "deepspeed.zero_stage=3", f"deepspeed.config_file={ds_json}", "deepspeed.precision=fp32"])
    resolved = resolve_run(config, world_size=2, accelerator="cpu", fill_auto_knobs=False)
    assert (resolved.config.train.micro_batch_size, resolved.config.deepspeed.zero_stage) == (2, 2)
    assert {key for key, _ in resolved.conflicts} == {"train.micro_batch_size", "deepspeed.zero_stage"}
    ds = build_deepspeed_config(resolved.config, world_size=2, total_steps=10, user_json=resolved.user_ds_config).config
    assert ds["zero_optimization"]["stage"] == 2 and ds["train_batch_size"] == 2 * 1 * 2 and ds["bf16"]["enabled"] is False
    warnings = [f for f in check_config(resolved) if f.rule == "ZP014"]
    assert len(warnings) == 2 and "zero_optimization.stage = 2" in " ".join(f.message for f in warnings)


def test_a_json_batch_without_micro_batch_is_derived_or_refused(tmp_path):
    """DeepSpeed-CTO style: train_batch_size and accumulation only; the micro-batch follows from the world size."""
    from zeropipe.check import check_config
    from zeropipe.launch.resolve import resolve_run

    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"train_batch_size": 32, "gradient_accumulation_steps": 8, "fp16": {"enabled": True}}))
    config = load_config(write(tmp_path, minimal(tmp_path)), [f"deepspeed.config_file={ds_json}", "deepspeed.precision=bf16"])
    resolved = resolve_run(config, world_size=2, accelerator="cpu", fill_auto_knobs=False)
    assert (resolved.config.train.micro_batch_size, resolved.config.train.gradient_accumulation_steps) == (2, 8)
    fp16 = [f for f in check_config(resolved) if f.rule == "ZP010"]
    assert fp16 and "fp16.enabled" in fp16[0].message and "\"fp16\": {\"enabled\": false}" in fp16[0].fix and str(ds_json) in fp16[0].fix, fp16
    findings = check_config(config, world_size=3, accelerator="cpu")  # 32 / (8 x 3) is no whole micro-batch
    assert any(f.rule == "ZP008" and "does not divide" in f.message for f in findings), [f.render() for f in findings]


@pytest.mark.parametrize(("flags", "precision"), [("avx2 avx512f", "fp32"), ("avx2,avx512_bf16", "bf16"), ("avx2 amx_bf16", "bf16")])
def test_precision_auto_follows_the_cpu_described_once(tmp_path, monkeypatch, flags, precision):
    """The CPU is asked in one place (ZEROPIPE_CPU_FLAGS describes another); the resolved run, run.json and the checks read that."""
    from zeropipe.launch.resolve import resolve_run

    monkeypatch.setenv("ZEROPIPE_CPU_FLAGS", flags)
    resolved = resolve_run(load_config(write(tmp_path, minimal(tmp_path))), world_size=2, accelerator="cpu", fill_auto_knobs=False)
    assert resolved.config.deepspeed.precision == precision and resolved.native_precision[0] == precision
    assert resolved.hardware.cpu_bf16_native == (precision == "bf16")
    assert any(note.startswith(f"deepspeed.precision = {precision} (") for note in resolved.notes), resolved.notes


def test_a_resolved_run_decides_with_the_hardware_it_is_given(tmp_path, monkeypatch):
    """An injected hardware object wins over the machine: the UI and tests decide for other CPUs."""
    import dataclasses

    from zeropipe.launch.resolve import resolve_run
    from zeropipe.plan.hardware import detect_hardware

    monkeypatch.setenv("ZEROPIPE_CPU_FLAGS", "avx2")
    hardware = dataclasses.replace(detect_hardware(cpu_ranks=2), cpu_bf16_native=True)
    resolved = resolve_run(load_config(write(tmp_path, minimal(tmp_path))), world_size=2, accelerator="cpu", fill_auto_knobs=False, hardware=hardware)
    assert resolved.config.deepspeed.precision == "bf16" and resolved.hardware is hardware
    from zeropipe.doctor.facts import cpu_runs_bf16_natively

    assert cpu_runs_bf16_natively({"avx2", "avx512_bf16"}) and not cpu_runs_bf16_natively({"avx2", "avx512f"})


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.micro_batch_size=sixteen", "train.micro_batch_size: must be a whole number or 'auto' (you gave 'sixteen')"),
        ("hardware.gpus=two", "hardware.gpus: must be a whole number or 'auto' (you gave 'two')"),
        ("train.lr=fast", "train.lr: must be a number (you gave 'fast')"),
        ("train.max_steps=1.5", "train.max_steps: must be a whole number (you gave 1.5)"),
    ],
)
def test_a_wrong_type_is_one_problem_in_the_users_words(tmp_path, override, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, minimal(tmp_path)), [override])
    assert caught.value.problems == [(expected.split(": ", 1)[0], expected.split(": ", 1)[1])]
    assert "constrained-" not in str(caught.value) and "Input should" not in str(caught.value)


@pytest.mark.parametrize("section,key,value", [("train", "lr", float("inf")), ("train", "lr", float("nan")), ("train", "weight_decay", -float("inf")), ("data", "max_bad_fraction", float("nan"))])
def test_non_finite_numbers_are_refused(tmp_path, section, key, value):
    """`lr: .inf` was accepted: a float field takes only finite numbers."""
    config = yaml.safe_dump(minimal(tmp_path, **{section: {key: value}}))
    assert ".inf" in config or ".nan" in config
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, config))
    assert [k for k, _ in info.value.problems] == [f"{section}.{key}"] and "finite" in str(info.value)


def test_a_number_too_long_to_read_is_a_config_error_not_a_crash(tmp_path):
    """A 5000-digit integer raised ValueError out of the YAML reader (HTTP 500 in the UI, a traceback in the CLI)."""
    config = yaml.safe_dump(minimal(tmp_path)) + "train:\n  max_steps: " + "9" * 5000 + "\n"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, config))
    assert "more digits than Python reads" in str(info.value) and len(str(info.value)) < 500
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, minimal(tmp_path)), overrides=["train.max_steps=" + "9" * 5000])
    assert "train.max_steps" in str(info.value) and len(str(info.value)) < 500
