"""The synthetic datasets: deterministic, correct and in Alpaca format."""

from __future__ import annotations

import json
import re

import pytest

from zeropipe.data.formats import detect_format, read_records
from zeropipe.data.synthetic import expected_answer, generate_dataset, sample_prompts
from zeropipe.errors import DataError


def load(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_same_seed_same_file_other_seed_other_file(tmp_path):
    first = generate_dataset("mixed", 200, seed=1, path=tmp_path / "a.jsonl")
    again = generate_dataset("mixed", 200, seed=1, path=tmp_path / "b.jsonl")
    other = generate_dataset("mixed", 200, seed=2, path=tmp_path / "c.jsonl")
    assert first.read_bytes() == again.read_bytes()
    assert first.read_bytes() != other.read_bytes()


def test_arithmetic_answers_are_right(tmp_path):
    records = load(generate_dataset("arithmetic", 300, seed=0, path=tmp_path / "data.jsonl"))
    assert len(records) == 300
    operators = set()
    for record in records:
        match = re.fullmatch(r"What is (\d) ([+-]) (\d)\?", record["instruction"])
        assert match, record
        a, operator, b = int(match[1]), match[2], int(match[3])
        operators.add(operator)
        assert int(record["output"]) == (a + b if operator == "+" else a - b)
        assert record["input"] == ""
    outputs = {int(record["output"]) for record in records}
    assert operators == {"+", "-"}
    assert min(outputs) < 0 and max(outputs) >= 10


def test_reverse_words_are_short_lowercase_and_reversed(tmp_path):
    records = load(generate_dataset("reverse", 200, seed=0, path=tmp_path / "data.jsonl"))
    lengths = set()
    for record in records:
        word = record["instruction"].removeprefix("Reverse the word: ")
        assert re.fullmatch(r"[a-z]{3,5}", word)
        assert record["output"] == word[::-1]
        lengths.add(len(word))
    assert lengths == {3, 4, 5}


def test_mixed_is_half_each_and_reads_as_alpaca(tmp_path):
    path = generate_dataset("mixed", 101, seed=0, path=tmp_path / "data.jsonl")
    records, bad = read_records(path)
    assert bad == []
    assert detect_format(records) == "alpaca"
    arithmetic = sum(record["instruction"].startswith("What is") for record in records)
    assert arithmetic == 50


def test_sample_prompts_are_deterministic_and_apart_from_the_training_stream(tmp_path):
    prompts = sample_prompts("reverse", 5, seed=0)
    assert prompts == sample_prompts("reverse", 5, seed=0)
    assert len(prompts) == 5
    training = [record["instruction"] for record in load(generate_dataset("reverse", 5, 0, tmp_path / "d.jsonl"))]
    assert prompts != training
    mixed = sample_prompts("mixed", 4, seed=0)
    assert [expected_answer(prompt) is not None for prompt in mixed] == [True] * 4
    assert mixed[0].startswith("What is") and mixed[1].startswith("Reverse")


def test_expected_answer_knows_our_questions_only():
    assert expected_answer("What is 3 - 5?") == "-2"
    assert expected_answer("Reverse the word: cat") == "tac"
    assert expected_answer("Tell me a joke") is None


def test_unknown_task_is_refused(tmp_path):
    with pytest.raises(DataError, match="unknown synthetic task 'poetry'"):
        generate_dataset("poetry", 10, seed=0, path=tmp_path / "data.jsonl")
