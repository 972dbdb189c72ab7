"""Preference records in the layouts users bring (TRL, LLaMA-Factory ranking, axolotl DPO types), their cut to max_seq_len, and the refusals."""

from __future__ import annotations

import json

import pytest

from zeropipe.config.schema import RunConfig
from zeropipe.data.formats import RecordError
from zeropipe.data.preference import PAIRED, UNPAIRED, PairDataset, build_pair_cache, collate_unpaired, normalize_record, tokenize_record
from zeropipe.data.records import iter_records
from zeropipe.data.tokenizer import train_tokenizer
from zeropipe.families.causal_lm.preference import preference_problems, reference_mode

USER = {"role": "user", "content": "What is 2 + 3?"}
GOOD, BAD = {"role": "assistant", "content": "5"}, {"role": "assistant", "content": "7"}


@pytest.mark.parametrize(
    "record",
    [
        {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]},  # TRL conversational
        {"chosen": [USER, GOOD], "rejected": [USER, BAD]},  # TRL implicit prompt
        {"instruction": "What is 2 + 3?", "chosen": "5", "rejected": "7"},  # LLaMA-Factory alpaca ranking
        {"conversations": [{"from": "human", "value": "What is 2 + 3?"}], "chosen": {"from": "gpt", "value": "5"}, "rejected": {"from": "gpt", "value": "7"}},  # sharegpt ranking
        {"question": "What is 2 + 3?", "chosen": "5", "rejected": "7"},  # axolotl chatml.intel
        {"instruction": "What is 2 + 3?", "chosen_response": "5", "rejected_response": "7"},  # axolotl chatml.argilla
        {"system": "", "input": "What is 2 + 3?", "chosen": "5", "rejected": "7"},  # axolotl bradley_terry.chat_template (reward models)
    ],
    ids=["trl", "trl-implicit", "llamafactory-alpaca", "llamafactory-sharegpt", "axolotl-intel", "axolotl-argilla", "axolotl-bradley-terry"],
)
def test_every_layout_becomes_the_same_conversation(record):
    assert normalize_record(record) == {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}


def test_alpaca_input_and_system_join_the_prompt_as_llamafactory_does():
    record = normalize_record({"system": "Be brief.", "instruction": "Add", "input": "2 and 3", "chosen": "5", "rejected": "7"})
    assert record["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add\n2 and 3"}]


def test_a_record_of_no_layout_names_its_keys_and_the_layouts():
    with pytest.raises(RecordError, match=r"no preference layout fits keys \['answer', 'question'\].*data.columns"):
        normalize_record({"question": "q", "answer": "a"})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(["What is 2 + 3? 5 7 a long prompt with many words"] * 4, 300, tmp_path_factory.mktemp("tok"))


def test_an_over_long_pair_loses_its_prompt_start_first_then_its_answers_end(tokenizer):
    long_prompt = {"prompt": [{"role": "user", "content": "many words " * 20}], "chosen": [GOOD], "rejected": [BAD]}
    full = tokenize_record(tokenizer, normalize_record(long_prompt), 512)
    cut = tokenize_record(tokenizer, normalize_record(long_prompt), 24)
    assert cut.prompt_truncated and not cut.completion_truncated
    assert cut.prompt == full.prompt[-len(cut.prompt) :] and cut.completions == full.completions  # the end of the prompt, the whole answers
    assert len(cut.prompt) + max(map(len, cut.completions)) <= 24
    long_answer = {"prompt": [USER], "chosen": [{"role": "assistant", "content": "many words " * 20}], "rejected": [BAD]}
    cut = tokenize_record(tokenizer, normalize_record(long_answer), 24)
    assert cut.completion_truncated and len(cut.prompt) + len(cut.completions[0]) == 24


def test_the_cache_counts_cuts_and_bad_records_and_kto_pairs_each_prompt_with_another_completion(tokenizer, tmp_path):
    rows = [{"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "7"}, {"prompt": "long " * 40, "chosen": "5", "rejected": "7"}, {"oops": 1}]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    info = build_pair_cache(iter_records(data), tokenizer, tmp_path / "paired", PAIRED, max_seq_len=32, max_bad_fraction=0.5)
    assert (info.examples, info.prompts_truncated, info.bad_record_count) == (2, 1, 1)
    assert "no preference layout" in info.bad_records[0]["reason"]
    unpaired = build_pair_cache(iter_records(data), tokenizer, tmp_path / "kto", UNPAIRED, max_seq_len=32, max_bad_fraction=0.5)
    assert (unpaired.examples, unpaired.desirable, unpaired.undesirable) == (4, 2, 2)
    dataset = PairDataset(tmp_path / "kto")
    items = [dataset[i] for i in range(len(dataset))]
    assert [item["kl"] for item in items] == [items[i - 1]["chosen"] for i in range(len(items))]
    batch = collate_unpaired(items[:2], tokenizer.pad_token_id)
    assert batch["label"].tolist() == [True, False] and batch["KL_input_ids"].shape[0] == 2


def config(**preference) -> RunConfig:
    return RunConfig.model_validate({"model": {"config": {"model_type": "llama"}}, "data": {"path": "pairs.jsonl"}, "preference": preference})


def test_the_reference_follows_lora_and_impossible_settings_are_refused():
    assert reference_mode(config(method="dpo")) == "precomputed"
    lora = RunConfig.model_validate({**config().model_dump(), "model": {"config": {"model_type": "llama"}, "lora": {}}})
    assert reference_mode(lora) == "adapters_off"
    assert reference_mode(config(method="orpo")) is None
    problems = dict(preference_problems(config(method="dpo", reference="adapters_off", loss_type=["ipo", "sft"], loss_weights=[1.0])))
    assert "needs model.lora" in problems["preference.reference"]
    assert "2 losses" in problems["preference.loss_weights"]
    assert "method orpo has its own" in dict(preference_problems(config(method="orpo", loss_type=["ipo"])))["preference.loss_type"]
