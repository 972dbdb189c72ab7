from __future__ import annotations

import pytest

from zeropipe.errors import ZeroPipeError
from zeropipe.plan.hardware import GIB, detect_hardware, parse_hardware, parse_size, supports_bf16


def test_parse_hardware_reads_sizes_as_sold():
    hardware = parse_hardware("5x24GB", "64GB", nodes=2)
    assert (hardware.gpus_per_node, hardware.gpu_memory_bytes, hardware.nodes, hardware.host_ram_bytes) == (5, 24 * GIB, 2, 64 * GIB)
    assert hardware.world_size == 10 and hardware.accelerator == "cuda"


@pytest.mark.parametrize(
    "text,expected",
    [("24GB", 24 * GIB), ("24 GiB", 24 * GIB), ("512MB", 512 * 1024**2), ("1TB", 1024 * GIB), ("1.5g", int(1.5 * GIB)), ("1000", 1000)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("gpus,ram,match", [("5 GPUs", "64GB", "5x24GB"), ("0x24GB", "64GB", "at least one"), ("5x24GB", "lots", "not a size")])
def test_bad_hardware_says_how_to_write_it(gpus, ram, match):
    with pytest.raises(ZeroPipeError, match=match):
        parse_hardware(gpus, ram)


def test_this_machine_without_cuda_splits_host_ram_across_cpu_ranks():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    hardware = detect_hardware(cpu_ranks=2)
    assert hardware.accelerator == "cpu" and hardware.gpus_per_node == 2
    assert hardware.gpu_memory_bytes == hardware.host_ram_bytes // 2
    assert "share of" in hardware.notes[0]
    assert hardware.with_gpus(4).gpu_memory_bytes == hardware.host_ram_bytes // 4


def test_bf16_needs_ampere():
    assert not supports_bf16(parse_hardware("4x16GB", "64GB", gpu_name="Tesla V100-SXM2-16GB"))
    assert supports_bf16(parse_hardware("4x24GB", "64GB", gpu_name="NVIDIA GeForce RTX 4090"))
