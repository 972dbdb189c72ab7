"""A grpo: section that cannot work is refused before any rank starts, each problem naming its key and the fix."""

from __future__ import annotations

from tests.unit.config.test_config import minimal, write
from zeropipe.config.load import load_config
from zeropipe.families import family_of


def test_grpo_problems_are_reported_together(tmp_path):
    config = minimal(tmp_path, grpo={"beta": 0.04, "loss_type": "dapo", "importance_sampling_level": "sequence",
                                     "rewards": [{"kind": "format"}, {"kind": "function", "function": "nocolon"}]},
                     data={"packing": True})
    loaded = load_config(write(tmp_path, config))
    problems = dict(family_of(loaded.model).config_problems(loaded))  # what zeropipe check and train say before any rank starts
    assert "add model.lora, or set beta 0" in problems["grpo.beta"]
    assert "use token, or loss_type grpo" in problems["grpo.importance_sampling_level"]
    assert "needs pattern" in problems["grpo.rewards[0].pattern"] and "package.module:function" in problems["grpo.rewards[1].function"]
    assert "data.packing" in problems


def test_a_plain_grpo_section_loads_with_trls_defaults(tmp_path):
    config = load_config(write(tmp_path, minimal(tmp_path, grpo={"num_generations": 4})))
    assert (config.grpo.loss_type, config.grpo.beta, config.grpo.scale_rewards, config.grpo.rewards[0].kind) == ("dapo", 0.0, "group", "numeric")


def test_a_full_fine_tunes_reference_and_num_iterations_are_checked(tmp_path):
    config = minimal(tmp_path, grpo={"beta": 0.04, "reference": "adapters_off", "num_iterations": 3}, train={"max_steps": 12, "save_every": 4})
    loaded = load_config(write(tmp_path, config))
    problems = dict(family_of(loaded.model).config_problems(loaded))
    assert "adapters_off needs LoRA adapters" in problems["grpo.reference"] and "start from a saved model (model.path)" in problems["grpo.beta"]
    assert "make save_every a multiple of grpo.num_iterations (3)" in problems["train.save_every"]
