"""What a run decides from the GPUs, with the CUDA facts injected through the hardware object (issue 31, defects 4 and 9)."""

from __future__ import annotations

import pytest

from zeropipe.check.run import check_config
from zeropipe.config.load import validate_config
from zeropipe.launch.resolve import resolve_run
from zeropipe.plan.hardware import GIB, Hardware

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def gpus(count: int, name: str = "NVIDIA GeForce RTX 4090", bf16: bool | None = True) -> Hardware:
    return Hardware(gpus_per_node=count, gpu_memory_bytes=24 * GIB, nodes=1, host_ram_bytes=64 * GIB, gpu_name=name, accelerator="cuda", gpu_bf16_native=bf16)


def config(tmp_path, gpus="auto", **deepspeed):
    return validate_config(
        {
            "run": {"name": "gpus", "output_dir": str(tmp_path / "runs")},
            "model": {"config": TINY},
            "data": {"synthetic": {"task": "arithmetic", "examples": 64}, "max_seq_len": 32},
            "train": {"max_steps": 4, "micro_batch_size": 2},
            "deepspeed": {"zero_stage": 2, **deepspeed},
            "hardware": {"gpus": gpus},
        }
    )


@pytest.mark.parametrize("ranks", [2, 8])
def test_the_plan_counts_the_ranks_not_the_visible_gpus(tmp_path, ranks):
    resolved = resolve_run(config(tmp_path), world_size=ranks, accelerator="cuda", fill_auto_knobs=False, hardware=gpus(4))
    assert resolved.hardware.gpus_per_node == ranks and resolved.hardware.gpu_memory_bytes == 24 * GIB
    assert any(f"run's {ranks} rank(s) per node" in note for note in resolved.hardware.notes)
    plan = resolved.plan()
    assert plan.hardware.world_size == ranks
    # The global batch of micro-batch 2 x 1 is counted over the ranks that run.
    assert plan.configured.choice.micro_batch_size * resolved.plan().hardware.world_size == 2 * ranks


def test_gpus_auto_is_one_rank_per_gpu_of_the_machine_decided_for(tmp_path):
    resolved = resolve_run(config(tmp_path), accelerator="cuda", fill_auto_knobs=False, hardware=gpus(5))
    assert resolved.world_size == 5 and resolved.hardware.gpus_per_node == 5


def test_precision_auto_is_fp16_on_gpus_without_bf16_in_hardware(tmp_path):
    # A V100 (compute capability 7.0): torch.cuda.is_bf16_supported() says yes there (emulation); its capability says no.
    resolved = resolve_run(config(tmp_path, precision="auto"), accelerator="cuda", fill_auto_knobs=False, hardware=gpus(4, "Tesla V100-SXM2-32GB", bf16=False))
    assert resolved.config.deepspeed.precision == "fp16"
    assert "has no bf16 (compute capability below 8.0)" in resolved.native_precision[1]
    ampere = resolve_run(config(tmp_path, precision="auto"), accelerator="cuda", fill_auto_knobs=False, hardware=gpus(4, "NVIDIA A100", bf16=True))
    assert ampere.config.deepspeed.precision == "bf16"
    # The fact, not the name: an unknown card whose capability says no.
    unknown = resolve_run(config(tmp_path, precision="auto"), accelerator="cuda", fill_auto_knobs=False, hardware=gpus(2, "Some Future GPU", bf16=False))
    assert unknown.config.deepspeed.precision == "fp16"


def test_zp010_refuses_bf16_on_gpus_without_it(tmp_path):
    findings = [f for f in check_config(config(tmp_path, precision="bf16"), accelerator="cuda", hardware=gpus(4, "Tesla T4", bf16=False)) if f.rule == "ZP010"]
    assert [f.key for f in findings] == ["deepspeed.precision"] and "Tesla T4 is older" in findings[0].message
    assert not [f for f in check_config(config(tmp_path, precision="bf16"), accelerator="cuda", hardware=gpus(4)) if f.rule == "ZP010"]


def test_more_ranks_than_this_machines_gpus_is_refused_before_launch(tmp_path, monkeypatch):
    # A SLURM allocation or a config asking for more ranks than GPUs: each extra rank would fail in set_device.
    import zeropipe.launch.resolve as resolve

    monkeypatch.setattr(resolve, "detect_hardware", lambda cpu_ranks: gpus(2))  # this machine, as detect_hardware would report it
    with pytest.raises(resolve.ConfigError) as err:
        resolve_run(config(tmp_path, gpus=4), accelerator="cuda", fill_auto_knobs=False)
    assert "4 ranks would start on this machine, which has 2 GPUs" in str(err.value) and "hardware.gpus: 2" in str(err.value)
