"""A checkpoint's generator states: resumed, a step draws what the uninterrupted run drew (issue 31, defect 8)."""

from __future__ import annotations

import random

import numpy as np
import torch

from zeropipe.engine.trainer import restore_rng_state, rng_state


class FakeCuda:
    """Two GPUs' generators, as torch.cuda presents them (this machine may have none)."""

    def __init__(self, devices: int = 2):
        self.generators = [torch.Generator().manual_seed(100 + device) for device in range(devices)]

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return len(self.generators)

    def get_rng_state_all(self):
        return [generator.get_state() for generator in self.generators]

    def set_rng_state(self, state, device):
        self.generators[device].set_state(state)

    def draw(self, device: int) -> torch.Tensor:
        return torch.rand(4, generator=self.generators[device])


def test_the_cuda_generators_are_saved_and_restored_with_the_cpu_ones():
    cuda = FakeCuda()
    saved = rng_state(cuda)
    assert len(saved["cuda"]) == 2
    expected = (random.random(), np.random.rand(), torch.rand(2), cuda.draw(0), cuda.draw(1))
    # The rank goes on drawing (more steps), then resumes from the checkpoint.
    cuda.draw(0), cuda.draw(1), torch.rand(8)
    restore_rng_state(saved, cuda)
    again = (random.random(), np.random.rand(), torch.rand(2), cuda.draw(0), cuda.draw(1))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])
    assert torch.equal(expected[3], again[3]) and torch.equal(expected[4], again[4]), "a resumed GPU run must draw the same dropout masks"


def test_cpu_checkpoints_and_resumes_on_fewer_gpus_still_load():
    saved = rng_state(_NoCuda())
    assert "cuda" not in saved
    restore_rng_state(saved, FakeCuda())  # a CPU checkpoint resumed where CUDA exists: the CPU generators only
    restore_rng_state(rng_state(FakeCuda(devices=4)), FakeCuda(devices=2))  # 4 GPUs saved, 2 visible now


class _NoCuda:
    def is_available(self) -> bool:
        return False
