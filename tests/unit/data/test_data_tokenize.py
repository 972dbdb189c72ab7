"""Loss masks, the token cache on disk and what the ranks read back from it."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from zeropipe.data.token_cache import TokenDataset, build_token_cache, collate, load_cache_info
from zeropipe.data.tokenize import IGNORE_INDEX, render_example, render_prompt
from zeropipe.errors import DataError

EOS = "<|eos|>"

# A simple template in the style of real ones: role markers, eos closing assistant turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def loss_text(tokenizer, labels) -> str:
    """The text of the tokens that carry loss."""
    return tokenizer.decode([label for label in list(labels) if label != IGNORE_INDEX])


def prompt_text(tokenizer, input_ids, labels) -> str:
    return tokenizer.decode([token for token, label in zip(list(input_ids), list(labels)) if label == IGNORE_INDEX])


@pytest.mark.parametrize(
    ("record", "prompt", "response"),
    [
        ({"instruction": "Add", "input": "2 and 3", "output": "It is 5."}, "Add\n\n2 and 3", "It is 5."),
        ({"instruction": "Capital?", "context": "France", "response": "Paris"}, "Capital?\n\nFrance", "Paris"),
        (
            {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"}]},
            "Hello",
            "Hi there",
        ),
        (
            {"conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi there"}]},
            "Hello",
            "Hi there",
        ),
    ],
    ids=["alpaca", "dolly", "chat", "sharegpt"],
)
def test_only_the_response_and_eos_carry_loss(tmp_path, tokenizer, write_jsonl, record, prompt, response):
    path = write_jsonl(tmp_path / "data.jsonl", [record] * 3)
    info = build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=128)
    example = TokenDataset(tmp_path / "cache")[0]

    assert loss_text(tokenizer, example["labels"]) == response + EOS
    assert tokenizer.decode(example["input_ids"]) == f"<|bos|><|user|>\n{prompt}\n<|assistant|>\n{response}{EOS}"
    assert info.examples == 3
    assert info.bad_records == []


def test_every_assistant_turn_of_a_conversation_carries_loss(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
    ]
    input_ids, labels = render_example(tokenizer, messages)
    assert loss_text(tokenizer, labels) == f"Hello{EOS}Paris{EOS}"
    assert prompt_text(tokenizer, input_ids, labels) == (
        "<|bos|><|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n<|user|>\nCapital of France?\n<|assistant|>\n"
    )


def test_generation_prompt_is_the_training_prefix(tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "What is 3 + 5?"},
        {"role": "assistant", "content": "8"},
    ]
    training_ids, labels = render_example(tokenizer, messages)
    prompt = render_prompt(tokenizer, messages[:3])
    # The model must see at generation exactly the tokens it saw before the reply in training.
    assert training_ids[: len(prompt)] == prompt
    assert labels[len(prompt) - 1] == IGNORE_INDEX
    assert labels[len(prompt)] != IGNORE_INDEX
    assert tokenizer.decode(prompt).endswith("What is 3 + 5?\n<|assistant|>\n")


def test_chat_template_decides_the_rendering_and_the_mask(tokenizer):
    tokenizer.chat_template = CHAT_TEMPLATE
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
    ]
    input_ids, labels = render_example(tokenizer, messages)
    assert tokenizer.decode(input_ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert loss_text(tokenizer, labels) == f"Hello{EOS}Paris{EOS}"
    assert prompt_text(tokenizer, input_ids, labels) == (
        "<|bos|><|user|>Hi\n<|assistant|><|user|>Capital of France?\n<|assistant|>"
    )

    prompt = render_prompt(tokenizer, messages[:3])
    assert input_ids[: len(prompt)] == prompt
    assert tokenizer.decode(prompt).endswith("Capital of France?\n<|assistant|>")


def test_chat_template_cache_has_the_same_mask(tmp_path, tokenizer, write_jsonl):
    tokenizer.chat_template = CHAT_TEMPLATE
    record = {"instruction": "Add", "input": "", "output": "5"}
    path = write_jsonl(tmp_path / "data.jsonl", [record])
    build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=64)
    example = TokenDataset(tmp_path / "cache")[0]
    assert tokenizer.decode(example["input_ids"]) == f"<|bos|><|user|>Add\n<|assistant|>5{EOS}"
    assert loss_text(tokenizer, example["labels"]) == f"5{EOS}"


def test_text_is_all_loss_and_long_texts_become_chunks(tmp_path, tokenizer):
    words = " ".join(f"word{number}" for number in range(60))
    (tmp_path / "book.txt").write_text(f"{words}\n\nShort one.\n")
    info = build_token_cache(tmp_path / "book.txt", tokenizer, tmp_path / "cache", max_seq_len=16)
    dataset = TokenDataset(tmp_path / "cache")

    text_ids = tokenizer(words, add_special_tokens=False)["input_ids"]
    expected = [tokenizer.bos_token_id, *text_ids, tokenizer.eos_token_id]
    chunks = [dataset[index] for index in range(len(dataset) - 1)]
    assert len(chunks) > 1
    assert all(len(chunk["input_ids"]) <= 16 for chunk in chunks)
    # Chunks overlap by one token, so the text can be put back together...
    rebuilt = chunks[0]["input_ids"].tolist()
    for chunk in chunks[1:]:
        assert chunk["input_ids"][0] == rebuilt[-1]
        rebuilt += chunk["input_ids"][1:].tolist()
    assert rebuilt == expected
    # ...and every token but the very first is a target exactly once.
    targets = [label for chunk in chunks for label in chunk["labels"].tolist() if label != IGNORE_INDEX]
    assert targets == expected[1:]
    assert tokenizer.decode(dataset[len(dataset) - 1]["input_ids"]) == f"<|bos|>Short one.{EOS}"
    assert info.format == "text"
    assert info.truncated == 0


def test_long_conversations_are_truncated_and_counted(tmp_path, tokenizer, write_jsonl):
    long_answer = "the quick brown fox " * 30
    records = [{"instruction": "Go", "output": long_answer}, {"instruction": "Hi", "output": "Hello"}]
    path = write_jsonl(tmp_path / "data.jsonl", records)
    info = build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=24)
    dataset = TokenDataset(tmp_path / "cache")
    assert info.truncated == 1
    assert dataset.lengths().tolist()[0] == 24
    assert json.loads((tmp_path / "cache" / "cache.json").read_text())["truncated"] == 1


def test_examples_with_nothing_to_learn_are_dropped(tmp_path, tokenizer, write_jsonl):
    long_prompt = "please read all of this " * 20
    records = [{"instruction": long_prompt, "output": "ok"}, {"instruction": "Hi", "output": "Hello"}]
    path = write_jsonl(tmp_path / "data.jsonl", records)
    info = build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=24)
    assert (info.examples, info.dropped_empty) == (1, 1)
    assert loss_text(tokenizer, TokenDataset(tmp_path / "cache")[0]["labels"]) == f"Hello{EOS}"


def test_empty_texts_are_dropped(tmp_path, tokenizer, write_jsonl):
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": ""}, {"text": "Some words."}])
    info = build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=64)
    assert (info.examples, info.dropped_empty) == (1, 1)


def test_a_file_of_only_broken_lines_is_called_malformed(tmp_path, tokenizer, write_jsonl):
    path = write_jsonl(tmp_path / "data.jsonl", ["{oops", "{oops"])
    with pytest.raises(DataError, match=r"2 of 2 records are malformed .*line 1: not valid JSON"):
        build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=64)


def test_no_usable_examples_is_an_error(tmp_path, tokenizer, write_jsonl):
    path = write_jsonl(tmp_path / "data.jsonl", [{"instruction": "please read all of this " * 20, "output": "ok"}])
    with pytest.raises(DataError, match=r"no usable examples.*data\.max_seq_len 24"):
        build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=24)


def test_malformed_records_are_skipped_counted_and_listed(tmp_path, tokenizer, write_jsonl):
    good = {"instruction": "Hi", "output": "Hello"}
    lines = [good] * 200
    lines[2] = "{not json"
    lines[16] = {"instruction": "Hi", "input": ""}  # line 17: no output
    path = write_jsonl(tmp_path / "data.jsonl", lines)
    info = build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=64)

    assert info.examples == 198
    assert [(item.line_number, item.reason) for item in info.bad_records][1] == (
        17,
        "missing key 'output' (alpaca format)",
    )
    assert info.bad_records[0].line_number == 3
    saved = json.loads((tmp_path / "cache" / "cache.json").read_text())
    assert [item["line"] for item in saved["bad_records"]] == [3, 17]
    assert saved["examples"] == 198
    assert saved["format"] == "alpaca"
    assert saved["source"] == str(path.resolve())
    assert saved["vocab_size"] == len(tokenizer)
    assert load_cache_info(tmp_path / "cache").bad_records == info.bad_records


def test_too_many_malformed_records_name_the_file_and_lines(tmp_path, tokenizer, write_jsonl):
    lines = [{"instruction": "Hi", "output": "Hello"}] * 20
    lines[2] = "{not json"
    lines[8] = {"instruction": "Hi"}
    path = write_jsonl(tmp_path / "data.jsonl", lines)
    with pytest.raises(DataError) as error:
        build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=64, max_bad_fraction=0.05)
    message = str(error.value)
    assert message.startswith(f"data.path {path}: 2 of 20 records are malformed (10% > data.max_bad_fraction 5%)")
    assert "line 3: not valid JSON" in message
    assert "line 9: missing key 'output' (alpaca format)" in message
    assert "Fix the file, or skip them with data.max_bad_fraction=0.1 (or data.max_bad_records=2)" in message
    assert not (tmp_path / "cache" / "cache.json").exists()


def test_max_bad_records_replaces_the_fraction(tmp_path, tokenizer, write_jsonl):
    lines = [{"instruction": "Hi", "output": "Hello"}] * 10 + ["oops"] * 2
    path = write_jsonl(tmp_path / "data.jsonl", lines)
    # 2 of 12 is far above 1%, but a count of 2 is allowed.
    info = build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=64, max_bad_records=2)
    assert len(info.bad_records) == 2
    with pytest.raises(DataError, match=r"2 > data\.max_bad_records 1\).*line 11.*skip them with data\.max_bad_records=2;"):
        build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=64, max_bad_records=1)


def test_records_that_do_not_fit_a_forced_format_are_malformed(tmp_path, tokenizer, write_jsonl):
    path = write_jsonl(tmp_path / "data.jsonl", [{"instruction": "Hi", "output": "Hello"}] * 4)
    with pytest.raises(DataError, match="line 1: missing key 'messages' \\(chat format\\)"):
        build_token_cache(path, tokenizer, tmp_path / "cache", fmt="chat", max_seq_len=64)


def test_dataset_reads_back_exactly_what_was_rendered(tmp_path, tokenizer, write_jsonl):
    records = [{"instruction": f"Say {word}", "output": word * (index + 1)} for index, word in enumerate("abcde")]
    path = write_jsonl(tmp_path / "data.jsonl", records)
    info = build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=64)
    dataset = TokenDataset(tmp_path / "cache")

    assert len(dataset) == 5
    expected_lengths = []
    for index, record in enumerate(records):
        messages = [
            {"role": "user", "content": record["instruction"]},
            {"role": "assistant", "content": record["output"]},
        ]
        input_ids, labels = render_example(tokenizer, messages)
        example = dataset[index]
        assert example["input_ids"].dtype == torch.long
        assert example["input_ids"].tolist() == input_ids
        assert example["labels"].tolist() == labels
        expected_lengths.append(len(input_ids))
    assert dataset.lengths().tolist() == expected_lengths
    assert info.tokens == sum(expected_lengths)
    assert dataset[-1]["input_ids"].tolist() == dataset[4]["input_ids"].tolist()
    with pytest.raises(IndexError):
        dataset[5]

    tokens = np.load(tmp_path / "cache" / "tokens.npy", mmap_mode="r")
    # A vocabulary under 65,536 stores tokens in two bytes, and a one-byte loss mask stands in for int32 labels.
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    assert np.load(tmp_path / "cache" / "loss_mask.npy").dtype == np.uint8
    assert not (tmp_path / "cache" / "labels.npy").exists()
    assert np.load(tmp_path / "cache" / "offsets.npy").dtype == np.int64
    # DataLoader workers get the dataset pickled: it must map the files again, not copy them.
    assert len(pickle.dumps(dataset)) < 1000
    assert pickle.loads(pickle.dumps(dataset))[2]["labels"].tolist() == dataset[2]["labels"].tolist()


def test_plain_template_needs_an_eos_token(tokenizer):
    tokenizer.eos_token = None
    with pytest.raises(DataError, match="no eos token and no chat_template"):
        render_example(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])


def test_tokenizer_without_bos_starts_with_the_prompt(tokenizer):
    tokenizer.bos_token = None
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    input_ids, _ = render_example(tokenizer, messages)
    assert tokenizer.decode(input_ids) == f"<|user|>\nHi\n<|assistant|>\nYo{EOS}"


def test_dataset_without_a_finished_cache_says_how_to_rebuild(tmp_path):
    with pytest.raises(DataError, match="missing or incomplete"):
        TokenDataset(tmp_path)


def test_collate_pads_on_the_right(tmp_path):
    batch = [
        {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([-100, 6, 7])},
        {"input_ids": torch.tensor([8]), "labels": torch.tensor([-100])},
    ]
    out = collate(batch, pad_token_id=2)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 2, 2]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100]]


def test_what_max_seq_len_cut_and_the_detected_format_are_said(tmp_path, tokenizer, write_jsonl):
    from zeropipe.data.token_cache import describe_cache

    lines = [{"instruction": "Hi", "output": "Hello"}] * 6 + [{"instruction": "Hi", "output": "word " * 80}] * 2 + [{"instruction": "word " * 80, "output": "late"}]
    path = write_jsonl(tmp_path / "data.jsonl", lines)
    build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=24)
    notes = describe_cache(json.loads((tmp_path / "cache" / "cache.json").read_text()), path, "auto")
    assert notes[0] == f"data: 8 examples from 9 records of {path} (alpaca format, detected)"
    assert any(note.startswith("3 conversation(s) were longer than data.max_seq_len 24 tokens") and "raise data.max_seq_len" in note for note in notes)
    assert any(note.startswith("1 example(s) were dropped with nothing to learn from") for note in notes)


def test_three_bad_lines_in_205_name_the_setting_that_would_skip_them(tmp_path, tokenizer, write_jsonl):
    lines = [{"instruction": "Hi", "output": "Hello"}] * 202 + ["{broken"] * 3
    path = write_jsonl(tmp_path / "data.jsonl", lines)
    with pytest.raises(DataError) as caught:
        build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=64)
    assert "3 of 205 records are malformed (1.46% > data.max_bad_fraction 1%)" in str(caught.value)
    assert "data.max_bad_fraction=0.015 (or data.max_bad_records=3)" in str(caught.value)
    # The value it names is enough.
    assert build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=64, max_bad_fraction=0.015).examples == 202
