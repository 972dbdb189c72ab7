"""data.mixture: sources of different formats drawn into one chat file by weight, deterministically."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from zeropipe.config.schema import DataSection
from zeropipe.data.formats import detect_format, read_records
from zeropipe.data.mixture import apportion, build_mixture, mixture_note
from zeropipe.errors import DataError


def jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


@pytest.fixture
def sources(tmp_path):
    alpaca = jsonl(tmp_path / "alpaca.jsonl", [{"instruction": f"add {i}", "output": str(i + 1)} for i in range(30)])
    chat = jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yo"}]} for i in range(10)])
    return alpaca, chat


def test_apportion_follows_weights_and_keeps_every_source():
    assert apportion(10, [0.7, 0.3]) == [7, 3]
    assert apportion(100, [1, 1, 1]) == [34, 33, 33]
    assert sum(apportion(7, [5, 2, 1])) == 7
    assert apportion(3, [1000, 1]) == [3, 1], "a source with a weight is never left out"


def test_formats_are_mixed_into_chat_records_by_weight(tmp_path, sources):
    alpaca, chat = sources
    data = DataSection(mixture=[{"path": alpaca, "weight": 0.75}, {"path": chat, "weight": 0.25}], mixture_examples=80)
    path = build_mixture(data, tmp_path / "out", seed=3)
    records, bad = read_records(path)
    assert not bad and len(records) == 80 and detect_format(records) == "chat"
    users = Counter("add" in record["messages"][0]["content"] for record in records)
    assert users == {True: 60, False: 20}
    # chat.jsonl has 10 records: 20 drawn means two full passes, each record exactly twice.
    assert set(Counter(r["messages"][0]["content"] for r in records if "hi" in r["messages"][0]["content"]).values()) == {2}
    assert "80 examples: 60 from" in mixture_note(tmp_path / "out") and "2.0 passes" in mixture_note(tmp_path / "out")


def test_the_same_seed_draws_the_same_mixture_and_another_seed_another(tmp_path, sources):
    alpaca, chat = sources
    data = DataSection(mixture=[{"path": alpaca}, {"path": chat}, {"synthetic": {"task": "arithmetic", "examples": 20}}])
    first = build_mixture(data, tmp_path / "a", seed=1).read_text()
    assert build_mixture(data, tmp_path / "b", seed=1).read_text() == first
    assert build_mixture(data, tmp_path / "c", seed=2).read_text() != first
    assert len(first.splitlines()) == 30 + 10 + 20, "default size: every source's records together"


def test_text_and_conversations_do_not_mix(tmp_path, sources):
    alpaca, _ = sources
    text = jsonl(tmp_path / "text.jsonl", [{"text": "plain words"}] * 5)
    with pytest.raises(DataError, match="mixes plain text .*text.jsonl.* with conversations"):
        build_mixture(DataSection(mixture=[{"path": alpaca}, {"path": text}]), tmp_path / "out", seed=0)


def test_a_source_with_too_many_malformed_records_is_named(tmp_path, sources):
    alpaca, _ = sources
    broken = jsonl(tmp_path / "broken.jsonl", [{"instruction": "a", "output": "b"}] * 5 + ["{not json", {"instruction": "no output"}])
    with pytest.raises(DataError, match=r"data.mixture\[1\] \(.*broken.jsonl\): 2 of 7 records are malformed \(first: line 6"):
        build_mixture(DataSection(mixture=[{"path": alpaca}, {"path": broken}]), tmp_path / "out", seed=0)
    # Within the tolerance, the malformed ones are left out and the rest is used.
    tolerant = DataSection(mixture=[{"path": alpaca}, {"path": broken}], max_bad_records=2)
    assert len(read_records(build_mixture(tolerant, tmp_path / "ok", seed=0))[0]) == 30 + 5


def test_sources_stream_through_the_mixture_a_record_at_a_time(tmp_path, monkeypatch):
    """A mixture of big sources holds offsets, not records: at most a handful are alive at once, and no spool is left."""
    from tests.unit.data.test_data_records import counting_reader
    from zeropipe.data import mixture as mixture_module
    from zeropipe.data.records import iter_records

    big = jsonl(tmp_path / "big.jsonl", [{"instruction": f"add {i}", "output": str(i + 1)} for i in range(3000)])
    parquet = tmp_path / "chat.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"yo {i}"}]} for i in range(2000)]
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=500)
    counted, alive = counting_reader(iter_records)
    monkeypatch.setattr(mixture_module, "iter_records", counted)
    out = tmp_path / "out"
    path = build_mixture(DataSection(mixture=[{"path": big, "weight": 1}, {"path": str(parquet), "weight": 1}], mixture_examples=6000), out, seed=5)
    assert alive["most"] <= 2, alive
    records, bad = read_records(path)
    assert not bad and len(records) == 6000
    firsts = Counter(record["messages"][0]["content"].split()[0] for record in records)
    assert firsts == {"add": 3000, "hi": 3000}
    # The chat source is drawn 1.5 times: every record once, half of them twice.
    assert sorted(Counter(r["messages"][1]["content"] for r in records if r["messages"][0]["content"].startswith("hi")).values())[-1] == 2
    assert sorted(p.name for p in out.iterdir()) == ["mixture.json", "mixture.jsonl"]
