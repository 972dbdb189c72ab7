"""axolotl's rl: grpo recipes become the grpo: section (its trl: keys, reward_funcs as module:function rewards)."""

from __future__ import annotations

import json

from tests.unit.convert.test_convert_axolotl import write
from zeropipe.config.schema import GRPOSection
from zeropipe.convert import convert_file


def test_axolotl_grpo_recipe_becomes_the_grpo_section(tmp_path):
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "What is 2 + 3?", "answer": "5"}) + "\n")
    path = write(tmp_path, f"""
base_model: x
rl: grpo
trl:
  beta: 0.001
  num_generations: 4
  max_completion_length: 256
  use_vllm: true
  reward_funcs: [rewards.accuracy_reward, rewards.format_reward]
  reward_weights: [1.0, 0.5]
  scale_rewards: false
  epsilon_high: 0.28
datasets:
  - path: {tmp_path / 'prompts.jsonl'}
    type: rewards.gsm8k_transform
""")
    conversion = convert_file(path)
    entries = {key: entry.value for key, entry in conversion.entries.items()}
    grpo = {key.split(".", 1)[1]: value for key, value in entries.items() if key.startswith("grpo.")}
    assert grpo == {"loss_type": "dapo", "beta": 0.001, "num_generations": 4, "max_completion_length": 256, "scale_rewards": "none", "epsilon_high": 0.28,
                    "rewards": [{"kind": "function", "function": "rewards:accuracy_reward", "weight": 1.0},
                                {"kind": "function", "function": "rewards:format_reward", "weight": 0.5}]}
    GRPOSection(**grpo)  # what the schema accepts
    assert entries["data.path"] == str(tmp_path / "prompts.jsonl") and not any(key.startswith("preference.") for key in entries)
    skipped = dict(conversion.unmapped)
    assert "weights gathered once per round" in skipped["trl.use_vllm"] and "Python transform" in skipped["datasets.type"]
