"""What every rank's environment carries, set by the launcher."""

from __future__ import annotations

import os

import pytest

from zeropipe.launch.supervisor import CPU_RANK_MMAP_THRESHOLD, rank_environment


def test_zero3_cpu_ranks_get_a_fixed_mmap_threshold_so_freed_gathered_layers_return_to_the_system(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    env = rank_environment(0, 4, 29500, "cpu", zero_stage=3)
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(CPU_RANK_MMAP_THRESHOLD)
    # GPU ranks' gathered layers live in GPU memory: their host allocator is left alone.
    assert "MALLOC_MMAP_THRESHOLD_" not in rank_environment(0, 4, 29500, "cuda", zero_stage=3)


def test_cpu_ranks_below_zero3_keep_glibcs_dynamic_threshold(monkeypatch):
    """They gather no layers; a fixed threshold only made every large activation buffer a fresh mapping (7% slower)."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    for stage in (0, 1, 2, None):
        assert "MALLOC_MMAP_THRESHOLD_" not in rank_environment(0, 2, 29500, "cpu", zero_stage=stage)


def test_a_threshold_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    for stage in (2, 3):
        assert rank_environment(1, 2, 29500, "cpu", zero_stage=stage)["MALLOC_MMAP_THRESHOLD_"] == "65536"


def test_gpu_and_cpu_ranks_share_the_cores(monkeypatch):
    """GPU ranks too: with optimizer offload each runs DeepSpeed's CPU Adam on OpenMP threads (issue 31)."""
    import zeropipe.launch.supervisor as supervisor

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(supervisor, "usable_cores", lambda: 20)  # this machine's CPU set, as the one function reads it
    for accelerator in ("cuda", "cpu"):
        assert rank_environment(0, 5, 29500, accelerator)["OMP_NUM_THREADS"] == "4"
    assert rank_environment(0, 8, 29500, "cuda", local_world_size=4)["OMP_NUM_THREADS"] == "5"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert rank_environment(0, 5, 29500, "cuda")["OMP_NUM_THREADS"] == "2", "the user's own setting is kept"


def test_an_arch_list_deepspeed_cannot_read_reaches_gpu_ranks_readable_and_said(monkeypatch):
    """NVIDIA's Hopper images set TORCH_CUDA_ARCH_LIST=9.0a, on which DeepSpeed's JIT build of FusedAdam
    fails (seen on an H200); the ranks get what DeepSpeed's own parser reads, and the given value to say so."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a;10.0f+PTX")
    env = rank_environment(0, 2, 29500, "cuda")
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;10.0+PTX" and env["ZEROPIPE_TORCH_CUDA_ARCH_LIST_GIVEN"] == "8.0;9.0a;10.0f+PTX"
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    with pytest.raises(ValueError, match="invalid literal"):
        builder.compute_capability_args()  # the given value, as DeepSpeed reads it
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", env["TORCH_CUDA_ARCH_LIST"])
    builder.compute_capability_args()  # JIT mode: no flags returned, the list it read put back canonical
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;10.0+PTX"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6;9.0+PTX")
    assert "ZEROPIPE_TORCH_CUDA_ARCH_LIST_GIVEN" not in rank_environment(0, 2, 29500, "cuda")  # a readable one is left alone
    assert rank_environment(0, 2, 29500, "cuda")["TORCH_CUDA_ARCH_LIST"] == "8.6;9.0+PTX"
