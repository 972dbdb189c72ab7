"""GRPO's built-in rewards, a user's module:function reward, and the prompts read from every layout."""

from __future__ import annotations

import sys

import pytest

from zeropipe.config.schema import GRPOSection, RewardSection, RunConfig
from zeropipe.data.formats import RecordError
from zeropipe.data.rl import prompt_record
from zeropipe.engine.rewards import build_rewards, reward_problems


def test_built_in_rewards_score_as_documented():
    sections = [RewardSection(kind="answer"), RewardSection(kind="numeric", tolerance=0.01), RewardSection(kind="format", pattern=r"^-?\d+$"),
                RewardSection(kind="length", target_length=4)]
    answer, numeric, fmt, length = (r.function for r in build_rewards(sections))
    completions = ["12", " the answer is -3.001", "twelve", "1234567890"]
    answers = ["12", "-3", "12", None]
    assert answer([""] * 4, completions, answer=answers) == [1.0, 0.0, 0.0, None]
    assert numeric([""] * 4, completions, answer=answers) == [1.0, 1.0, 0.0, None]  # None: no answer to compare with
    assert fmt([""] * 4, completions) == [1.0, 0.0, 0.0, 1.0]
    assert length([""] * 4, completions) == [0.5, -1.0, 0.5, -0.5]


def test_a_user_function_is_imported_by_module_and_name(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def short(prompts, completions, answer=None, **fields):\n    return [float(len(c) < 3) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    [reward] = build_rewards([RewardSection(kind="function", function="my_rewards:short", weight=0.5)])
    assert (reward.name, reward.weight, reward.function([], ["ok", "long"])) == ("short", 0.5, [1.0, 0.0])
    with pytest.raises(ValueError, match="my_rewards has no callable missing"):
        build_rewards([RewardSection(kind="function", function="my_rewards:missing")])
    sys.modules.pop("my_rewards", None)


def test_reward_problems_name_the_key_and_the_fix():
    config = RunConfig(grpo=GRPOSection(rewards=[RewardSection(kind="format"), RewardSection(kind="function", function="no_colon"),
                                                 RewardSection(kind="format", pattern="(")]))
    problems = dict(reward_problems(config))
    assert "needs pattern" in problems["grpo.rewards[0].pattern"]
    assert "'package.module:function'" in problems["grpo.rewards[1].function"]
    assert "not a regular expression" in problems["grpo.rewards[2].pattern"]


def test_prompts_from_trl_and_supervised_layouts():
    trl = prompt_record({"prompt": "What is 2 + 3?", "answer": 5, "level": "easy"}, "prompt")
    assert trl == {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5", "fields": {"answer": 5, "level": "easy"}}
    alpaca = prompt_record({"instruction": "What is 2 + 3?", "input": "", "output": "5"}, "alpaca")
    assert alpaca["prompt"] == [{"role": "user", "content": "What is 2 + 3?"}] and alpaca["answer"] == "5"
    chat = prompt_record({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}, "chat")
    assert [t["role"] for t in chat["prompt"]] == ["system", "user"] and chat["answer"] == "Hello"
    with pytest.raises(RecordError, match="no prompt"):
        prompt_record("just text", "text")
