"""A checkpoint saved with sequence parallelism resumes only with the same degree on the same ranks (issue 40)."""

import pytest

from zeropipe.checkpoint.manager import mark_complete
from zeropipe.config.load import validate_config
from zeropipe.errors import ConfigError
from zeropipe.launch.prepare import prepare_run, run_dir_for
from zeropipe.launch.resolve import resolve_run

LLAMA = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 64}


def test_resuming_an_sp_checkpoint_with_another_degree_is_refused_with_the_settings_that_work(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n' * 20)
    config = validate_config({"run": {"name": "sp", "output_dir": str(tmp_path / "runs")}, "model": {"config": LLAMA}, "data": {"path": str(data)},
                              "hardware": {"gpus": 2, "accelerator": "cpu"}, "deepspeed": {"zero_stage": 3}, "train": {"micro_batch_size": 1}})
    run_dir = run_dir_for(config)
    (run_dir / "checkpoints" / "step_00000003").mkdir(parents=True)
    mark_complete(run_dir, 3, {"world_size": 4, "zero_stage": 3, "micro_batch_size": 1, "gradient_accumulation_steps": 1, "sequence_parallel_size": 2})
    with pytest.raises(ConfigError) as err:
        prepare_run(resolve_run(config, world_size=2, accelerator="cpu", fill_auto_knobs=False), resume=True)
    assert err.value.problems[0][0] == "parallel.sequence_parallel_size"
    assert "saved by 4 ranks with sequence_parallel_size 2" in str(err.value) and "hardware.gpus=4 and parallel.sequence_parallel_size=2" in str(err.value)
