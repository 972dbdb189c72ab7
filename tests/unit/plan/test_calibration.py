"""The planner's speeds: measured by ``zeropipe calibrate`` on this machine, or assumed and said so.

``calibrate --quick`` really measures here (CPU ranks, gloo between two processes); the
planner then ranks with those figures and names them, and never ranks parameter offload
ahead of a fitting setting without it until a GPU's host link has been measured.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from zeropipe.cli.main import main
from zeropipe.doctor.calibrate import Calibration, read_calibration
from zeropipe.plan import parse_hardware, recommend
from zeropipe.plan.cost import offload_param_measured, speeds_for


def gpu_calibration(**changes) -> Calibration:
    """A profile as calibrate writes it on a 4090 box (figures of the order such a box measures)."""
    figures = dict(
        accelerator="cuda",
        device_name="NVIDIA GeForce RTX 4090",
        ranks=5,
        matmul_flops={"fp32": 40e12, "bf16": 150e12, "fp16": 150e12},
        all_gather_bytes_per_second=8e9,
        reduce_scatter_bytes_per_second=7e9,
        host_to_device_bytes_per_second=None,
        device_to_host_bytes_per_second=None,
        optimizer_params_per_second=0.8e9,
        optimizer="DeepSpeed CPU Adam",
        measured_at="2026-11-25T12:00:00",
    )
    figures.update(changes)
    return Calibration(**figures)


def test_calibrate_measures_this_machine_and_the_plan_uses_and_names_it(tmp_path, monkeypatch, capsys):
    profile = tmp_path / "calibration.json"
    monkeypatch.setenv("ZEROPIPE_CALIBRATION", str(profile))
    assert main(["calibrate", "--quick", "--ranks", "2"]) == 0
    assert "saved to" in capsys.readouterr().out
    measured = read_calibration()
    assert measured is not None and measured.accelerator == "cpu" and measured.ranks == 2
    assert all(flops > 0 for flops in measured.matmul_flops.values()) and set(measured.matmul_flops) == {"fp32", "bf16"}
    assert measured.all_gather_bytes_per_second > 0 and measured.reduce_scatter_bytes_per_second > 0
    assert measured.optimizer_params_per_second > 0 and measured.host_link_bytes_per_second is None  # CPU ranks have no host link

    from zeropipe.plan.hardware import detect_hardware

    hardware = detect_hardware(cpu_ranks=2)
    assert hardware.calibration == measured
    speeds = speeds_for(hardware)
    assert speeds.gpu_flops == measured.matmul_flops["bf16"] and speeds.intra_node_bytes_per_second == measured.collective_bytes_per_second
    assert "measured by zeropipe calibrate" in speeds.source
    assert main(["plan", "--params", "2e8", "--cpu-ranks", "2", "--ram", "16GB"]) == 0
    assert "speeds: measured by zeropipe calibrate" in capsys.readouterr().out


def test_without_a_profile_the_plan_says_its_speeds_are_assumed(spec_of):
    result = recommend(spec_of("qwen2.5-7b"), parse_hardware("4x24GB", "256GB"), seq_len=2048)
    assert any("speeds: assumed round figures" in note and "zeropipe calibrate" in note for note in result.notes)


def test_a_profile_of_another_gpu_is_not_used(spec_of):
    hardware = replace(parse_hardware("5x24GB", "64GB", gpu_name="NVIDIA RTX A5000"), calibration=gpu_calibration())
    assert not speeds_for(hardware).measured


def test_measured_speeds_change_the_costs(spec_of):
    assumed = parse_hardware("5x24GB", "256GB", gpu_name="NVIDIA GeForce RTX 4090")
    measured = replace(assumed, calibration=gpu_calibration(all_gather_bytes_per_second=1e9, reduce_scatter_bytes_per_second=1e9))
    spec = spec_of("qwen2.5-7b")
    plain = recommend(spec, assumed, seq_len=2048, global_batch=20)
    slow_links = recommend(spec, measured, seq_len=2048, global_batch=20)
    assert slow_links.best.seconds["communication"] > plain.best.seconds["communication"]
    assert any("measured by zeropipe calibrate" in note for note in slow_links.notes)


def test_parameter_offload_is_not_ranked_first_until_a_gpu_host_link_is_measured(spec_of):
    """The issue's case: Llama-3.1-8B LoRA on 5x24 GB; the cost model alone picked offload_param."""
    spec = spec_of("llama-3.1-8b", 16)
    hardware = parse_hardware("5x24GB", "64GB", gpu_name="NVIDIA GeForce RTX 4090")
    # Parameter offload alone: activation offload (another host-link knob) is held off, so the premise is the issue's.
    no_activation_offload = {"activation_offload": False}
    result = recommend(spec, hardware, seq_len=2048, fixed=no_activation_offload)
    cheapest = min((c for c in result.candidates if c.fits), key=lambda c: c.relative_cost)
    assert cheapest.choice.offload_param, "the premise: the cost model rates parameter offload cheapest"
    assert not result.best.choice.offload_param
    assert any("host link has not been measured" in note for note in result.notes)
    assert not offload_param_measured(hardware)

    # Measured, offload is ranked by its measured cost like any setting: a fast link wins, a slow one loses.
    for link, offload_wins in ((12e9, True), (0.5e9, False)):
        measured_link = replace(hardware, calibration=gpu_calibration(host_to_device_bytes_per_second=link, device_to_host_bytes_per_second=link))
        assert offload_param_measured(measured_link)
        measured = recommend(spec, measured_link, seq_len=2048, fixed=no_activation_offload)
        assert measured.best.relative_cost == min(c.relative_cost for c in measured.candidates if c.fits)
        assert measured.best.choice.offload_param is offload_wins
        assert not any("host link has not been measured" in note for note in measured.notes)


def test_a_damaged_or_old_profile_is_ignored(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text("{not json")
    assert read_calibration(path) is None
    path.write_text(json.dumps({"version": 0}))
    assert read_calibration(path) is None


@pytest.mark.parametrize("ranks", ["0", "99"])
def test_calibrate_refuses_an_impossible_rank_count_on_gpus(ranks, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main(["calibrate", "--ranks", ranks]) == 2
    assert "--ranks" in capsys.readouterr().err
