"""Reading data files, detecting their format and turning records into conversations."""

from __future__ import annotations

import json

import pytest

from zeropipe.data.formats import (
    BadRecord,
    RecordError,
    detect_format,
    read_located_records,
    read_records,
    to_conversation,
)
from zeropipe.errors import DataError

ALPACA = {"instruction": "Add", "input": "2 and 3", "output": "5"}


def test_jsonl_skips_broken_lines_and_reports_their_line_numbers(tmp_path, write_jsonl):
    path = write_jsonl(
        tmp_path / "data.jsonl",
        [
            ALPACA,
            "",  # blank lines are ignored, but still counted for line numbers
            '{"instruction": "x", "output": ',  # line 3: truncated JSON
            "[1, 2]",  # line 4: valid JSON but not an object
            "   ",
            ALPACA,
        ],
    )
    records, bad = read_records(path)
    assert records == [ALPACA, ALPACA]
    assert [item.line_number for item in bad] == [3, 4]
    assert "not valid JSON" in bad[0].reason
    assert bad[1].reason == "expected a JSON object, got an array"
    assert str(bad[1]) == "line 4: expected a JSON object, got an array"


def test_jsonl_line_with_broken_utf8_costs_one_record(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(ALPACA).encode() + b"\n" + b'{"text": "\xff\xfe"}\n' + json.dumps(ALPACA).encode())
    records, bad = read_records(path)
    assert len(records) == 2
    assert [(item.line_number, item.reason.split(" (")[0]) for item in bad] == [(2, "not valid UTF-8")]


def test_json_array_keeps_line_numbers_of_elements(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[\n  {"text": "a"},\n  "oops",\n  {"text":\n   "b"}\n]\n')
    located, bad = read_located_records(path)
    assert [(record.value, record.line_number) for record in located] == [({"text": "a"}, 2), ({"text": "b"}, 4)]
    assert bad == [BadRecord(3, "expected a JSON object, got a string")]


def test_broken_json_array_names_the_line(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[\n  {"text": "a"},\n  {"text": "b",,}\n]')
    with pytest.raises(DataError, match=r"data\.json: line 3: not valid JSON"):
        read_records(path)


def test_json_file_must_hold_an_array(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('{"text": "a"}')
    with pytest.raises(DataError, match="JSON array"):
        read_records(path)


def test_txt_documents_are_separated_by_blank_lines(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("First line.\nStill first.\n\n\nSecond document.\n\nThird\n")
    located, bad = read_located_records(path)
    assert [record.value for record in located] == ["First line.\nStill first.", "Second document.", "Third"]
    assert [record.line_number for record in located] == [1, 5, 7]
    assert bad == []


def test_directory_reads_every_data_file_in_name_order(tmp_path, write_jsonl):
    write_jsonl(tmp_path / "b.jsonl", [{"text": "from b"}, "not json"])
    (tmp_path / "a.txt").write_text("from a")
    (tmp_path / ".hidden.jsonl").write_text('{"text": "editor leftover"}')
    (tmp_path / "notes.md").write_text("not data")
    records, bad = read_records(tmp_path)
    assert records == ["from a", {"text": "from b"}]
    assert str(bad[0]).startswith("b.jsonl line 2: not valid JSON")


def test_missing_file_names_the_path_and_the_key_to_fix(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as error:
        read_records(missing)
    assert str(missing) in str(error.value)
    assert "data.path" in str(error.value)


def test_unsupported_suffix_is_refused(tmp_path):
    path = tmp_path / "data.xlsx"
    path.write_text("a,b\n")
    with pytest.raises(DataError, match=r"unsupported file type '\.xlsx'"):
        read_records(path)


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (ALPACA, "alpaca"),
        ({"instruction": "q", "context": "", "response": "a"}, "dolly"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "chat"),
        ({"conversations": [{"from": "human", "value": "hi"}]}, "sharegpt"),
        ({"text": "plain"}, "text"),
        ("a .txt document", "text"),
    ],
)
def test_each_format_is_detected(record, expected):
    assert detect_format([record] * 3) == expected


def test_detection_follows_the_majority():
    records = [{"text": "odd one"}] * 10 + [ALPACA] * 30
    assert detect_format(records) == "alpaca"


def test_detection_looks_only_at_the_first_hundred_records():
    records = [ALPACA] * 100 + [{"text": "t"}] * 500
    assert detect_format(records) == "alpaca"


def test_forced_format_wins_and_unknown_names_are_refused():
    assert detect_format([ALPACA], "text") == "text"
    with pytest.raises(DataError, match="data.format 'jsonl' is not supported"):
        detect_format([ALPACA], "jsonl")


def test_unknown_shape_lists_the_keys_seen_and_the_supported_forms():
    with pytest.raises(DataError) as error:
        detect_format([{"question": "q", "answer": "a"}])
    message = str(error.value)
    assert "keys seen: answer, question" in message
    for name in ("alpaca", "dolly", "chat", "sharegpt", "text"):
        assert name in message


def test_alpaca_input_is_joined_to_the_instruction():
    assert to_conversation(ALPACA, "alpaca") == [
        {"role": "user", "content": "Add\n\n2 and 3"},
        {"role": "assistant", "content": "5"},
    ]
    without_input = {"instruction": "Say hi", "input": "", "output": "hi"}
    assert to_conversation(without_input, "alpaca")[0]["content"] == "Say hi"


def test_dolly_context_is_joined_like_alpaca_input():
    record = {"instruction": "Capital?", "context": "France", "response": "Paris", "category": "qa"}
    assert to_conversation(record, "dolly") == [
        {"role": "user", "content": "Capital?\n\nFrance"},
        {"role": "assistant", "content": "Paris"},
    ]


def test_sharegpt_speakers_become_roles():
    record = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
        ]
    }
    assert [message["role"] for message in to_conversation(record, "sharegpt")] == ["system", "user", "assistant"]


def test_chat_messages_pass_through():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert to_conversation({"messages": messages, "id": 7}, "chat") == messages


def test_text_record_gives_its_text():
    assert to_conversation({"text": "abc"}, "text") == "abc"
    assert to_conversation("from a txt file", "text") == "from a txt file"


@pytest.mark.parametrize(
    ("record", "fmt", "reason"),
    [
        ({"instruction": "q", "input": ""}, "alpaca", "missing key 'output' (alpaca format)"),
        ({"instruction": "q", "output": 5}, "alpaca", "'output' should be a string, got a number (alpaca format)"),
        ({"instruction": "q", "context": "c"}, "dolly", "missing key 'response' (dolly format)"),
        ({"messages": []}, "chat", "'messages' is empty (chat format)"),
        ({"messages": "hi"}, "chat", "'messages' should be a list, got a string (chat format)"),
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            "chat",
            "no assistant turn in 'messages', so nothing to learn from (chat format)",
        ),
        (
            {"messages": [{"role": "robot", "content": "hi"}]},
            "chat",
            'messages[1].role is "robot"; expected one of system, user, assistant (chat format)',
        ),
        (
            {"conversations": [{"from": "human"}]},
            "sharegpt",
            "conversations[1] is missing key 'value' (sharegpt format)",
        ),
        ({"text": None}, "text", "'text' should be a string, got null (text format)"),
    ],
)
def test_records_that_do_not_fit_the_format_say_why(record, fmt, reason):
    with pytest.raises(RecordError) as error:
        to_conversation(record, fmt)
    assert str(error.value) == reason


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"", "no records: the file is empty"),
        (b"\n\n  \n", "no records: the file is empty"),
        (b"\x7fELF\x02\x01\x01\x00\x00\x00" * 50, "this is a binary file, not .jsonl text"),
        (b'{"a":\nnot json\n', "all 2 records are malformed, so there is nothing to tell the format from; first: line 1: not valid JSON"),
    ],
)
def test_nothing_to_detect_from_says_which_file_and_why(tmp_path, content, expected):
    from zeropipe.data.formats import detect_format, read_records

    path = tmp_path / "train.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError) as caught:
        records, bad = read_records(path)
        detect_format(records, "auto", source=path, bad=bad)
    assert str(caught.value).startswith(f"data.path {path}: ")
    assert expected in str(caught.value)
    assert "first 0 records" not in str(caught.value)
