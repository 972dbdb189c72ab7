"""diffusers' Ulysses context parallelism on 2 gloo CPU ranks (one process group on this machine):
the tiny Wan's output and gradients with its tokens split over the group equal the unsplit model's."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One entry per denoiser class ZeRO-Pipe trains with sequence parallelism (sequence_parallel.VERIFIED), at its tiny preset.
ENTRIES = ("wan", "flux", "flux2", "qwen-image")


def tiny_denoiser(name: str):
    from zeropipe.families.diffusion.entries import architecture_named

    arch = architecture_named(name)
    torch.manual_seed(0)
    model = arch.model_class()(**arch.record.preset[arch.record.denoiser]).float()
    arch.assembly.tiny_denoiser(model)
    torch.manual_seed(1)
    # 3 latent frames (video) of 4x4: 12 or 4 tokens, 8 text tokens: every split dimension divides by 2
    inputs = arch.call.trace_inputs(model.config, 4, 3 if arch.record.video else 1, 8, torch.float32)
    return model, inputs


def split_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from zeropipe.families.diffusion import sequence_parallel

    results = {}
    for name in ENTRIES:
        whole, inputs = tiny_denoiser(name)
        expected = whole(**inputs, return_dict=False)[0]
        target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
        torch.nn.functional.mse_loss(expected, target).backward()
        split, _ = tiny_denoiser(name)
        sequence_parallel.enable(split, world)
        got = split(**inputs, return_dict=False)[0]
        torch.nn.functional.mse_loss(got, target).backward()
        mine = torch.cat([p.grad.flatten() for p in split.parameters() if p.grad is not None])
        grads = mine.clone()
        dist.all_reduce(grads)  # the group's gradients add up to the one sample's
        want = torch.cat([p.grad.flatten() for p in whole.parameters() if p.grad is not None])
        results[name] = {"expected": expected.detach(), "got": got.detach(), "want_grads": want, "grads": grads, "mine": mine}
    torch.save(results, f"{out}/{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2])
def test_ulysses_split_of_each_planned_tiny_denoiser_gives_the_whole_models_output_and_gradients(tmp_path, world):
    mp.spawn(split_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        results = torch.load(tmp_path / f"{rank}.pt", weights_only=False)
        for name, result in results.items():
            assert torch.allclose(result["got"], result["expected"], rtol=1e-5, atol=1e-6), name
            assert torch.allclose(result["grads"], result["want_grads"], rtol=1e-4, atol=1e-6), name
            # The tokens were split: one rank's own gradients are not the whole sample's.
            assert not torch.allclose(result["mine"], result["want_grads"], rtol=1e-3, atol=1e-6), name
