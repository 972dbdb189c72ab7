"""Checkpoints are read without unpickling code (issue 46): real DeepSpeed checkpoints load with the allow-list, a pickle that runs code is refused."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

from zeropipe.checkpoint import manager, safeload
from zeropipe.checkpoint.consolidate import consolidated_state_dict
from zeropipe.engine.trainer import rng_state


class Payload:
    """What an attacker leaves in a checkpoint: rebuilding it runs a command."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def malicious(path, marker) -> None:
    torch.save({"module": {"w": torch.zeros(2)}, "buffer_names": [], "param_shapes": [], "shared_params": {}, "x": Payload(marker)}, path)


@pytest.fixture(scope="module")
def engine_env():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR")}
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu"})
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    yield deepspeed
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_real_deepspeed_checkpoints_load_with_the_allow_list_alone(engine_env, tmp_path, stage):
    """Every file DeepSpeed and ZeRO-Pipe save (model states, optimizer shards, RNG) loads with weights_only=True, and resumes."""
    deepspeed = engine_env
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ds_config = {
        "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1, "total_num_steps": 4}},
        "gradient_clipping": 1.0,
    }  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds_config)
    for _ in range(2):
        loss = engine(torch.ones(2, 4)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    folder = tmp_path / "checkpoints"
    engine.save_checkpoint(str(folder), tag="step_00000002", client_state={"step": 2, "data_position": {"epoch": 0, "index": 4}}, save_latest=False)
    torch.save(rng_state(), folder / "step_00000002" / "rng_rank0.pt")
    manager.mark_complete(tmp_path, 2, {"world_size": 1, "zero_stage": stage})
    files = sorted((folder / "step_00000002").glob("*.pt"))
    assert len(files) >= 2
    for file in files:
        safeload.load(file, map_location="cpu")  # raises UnsafeCheckpoint naming any global the allow-list lacks
    info = manager.resolve_checkpoint(tmp_path / "checkpoints" / "step_00000002")[1]
    state = consolidated_state_dict(info)
    assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    safeload.install()
    load_path, client_state = engine.load_checkpoint(str(folder), tag="step_00000002", load_optimizer_states=True, load_lr_scheduler_states=True)
    assert load_path is not None and client_state["step"] == 2


@pytest.mark.parametrize("zero_stage, file", [(0, "mp_rank_00_model_states.pt"), (2, "zero_pp_rank_0_mp_rank_00_model_states.pt")])
def test_a_pickle_that_runs_code_is_refused_naming_its_global(tmp_path, zero_stage, file):
    marker = tmp_path / "pwned"
    tag = tmp_path / "checkpoints" / "step_00000002"
    tag.mkdir(parents=True)
    malicious(tag / file, marker)
    if zero_stage:
        malicious(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", marker)
    manager.mark_complete(tmp_path, 2, {"world_size": 1, "zero_stage": zero_stage})
    with pytest.raises(safeload.UnsafeCheckpoint) as raised:
        consolidated_state_dict(manager.resolve_checkpoint(tmp_path / "checkpoints" / "step_00000002")[1])
    assert "posix.system" in str(raised.value) and "not unpickled" in str(raised.value)
    # DeepSpeed's own reader, asked for weights_only=False, loads safely all the same once installed.
    safeload.install()
    from deepspeed.utils import zero_to_fp32

    with pytest.raises(safeload.UnsafeCheckpoint):
        zero_to_fp32.torch.load(tag / file, map_location="cpu", weights_only=False)
    assert not marker.exists()


def test_a_checkpoint_file_linked_out_of_its_folder_is_not_read(tmp_path):
    outside = tmp_path / "elsewhere.pt"
    torch.save({"module": {"w": torch.zeros(2)}}, outside)
    tag = tmp_path / "run" / "checkpoints" / "step_00000002"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").symlink_to(outside)
    manager.mark_complete(tmp_path / "run", 2, {"world_size": 1, "zero_stage": 0})
    with pytest.raises(Exception, match="symlink that leads out"):
        consolidated_state_dict(manager.resolve_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000002")[1])
