"""Records streamed from every input format, column mapping, errors that name the file and row, and bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import zeropipe.data.token_cache as token_cache_module
from zeropipe.data.formats import read_located_records
from zeropipe.data.records import BadRecord, Record, iter_records
from zeropipe.data.token_cache import TOKENIZE_BATCH, TokenCacheWriter, TokenDataset, build_token_cache, load_cache_info, token_dtype
from zeropipe.errors import DataError

ROWS = [{"instruction": f"Say {word}", "input": "", "output": f"{word} {word}"} for word in ("cat", "dog", "fox", "owl", "bee")]
REPO = Path(__file__).resolve().parents[3]


def write_format(folder: Path, suffix: str, rows: list[dict] = ROWS) -> Path:
    """``rows`` written as a file of ``suffix`` (or, for save_to_disk, as a datasets folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    if suffix == "save_to_disk":
        datasets = pytest.importorskip("datasets")
        path = folder / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
        return path
    path = folder / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif suffix == ".json":
        path.write_text("[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]\n")
    elif suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)
    elif suffix == ".arrow":
        table = pa.Table.from_pylist(rows)
        with pa.ipc.new_stream(path, table.schema) as writer:
            writer.write_table(table)
    elif suffix in (".csv", ".tsv"):
        delimiter = "\t" if suffix == ".tsv" else ","
        import csv

        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]), delimiter=delimiter)
            writer.writeheader()
            writer.writerows(rows)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".arrow", ".csv", ".tsv", "save_to_disk"])
def test_every_format_streams_the_same_records(tmp_path, suffix):
    path = write_format(tmp_path, suffix)
    items = list(iter_records(path))
    assert [item.value for item in items] == ROWS
    assert all(isinstance(item, Record) for item in items)
    # Each record knows where it came from: rows count from 1, CSV lines from 2 (the header is line 1).
    first = {".csv": 2, ".tsv": 2, ".json": 2}.get(suffix, 1)
    assert items[0].line_number == first and items[-1].line_number == first + len(ROWS) - 1


def test_text_documents_are_streamed_by_blank_lines(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("first document\nstill first\n\nsecond\n\n\nthird\n")
    assert [(item.value, item.line_number) for item in iter_records(path)] == [("first document\nstill first", 1), ("second", 4), ("third", 7)]


def test_a_folder_of_parquet_shards_in_the_hub_layout_is_read_in_order(tmp_path):
    shards = tmp_path / "dataset" / "data"
    shards.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(ROWS[:3]), shards / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[3:]), shards / "train-00001-of-00002.parquet")
    (tmp_path / "dataset" / "README.md").write_text("# a dataset card, not data\n")
    items = list(iter_records(tmp_path / "dataset"))
    assert [item.value for item in items] == ROWS
    assert items[3].file == "train-00001-of-00002.parquet" and items[3].line_number == 1
    assert str(items[3].bad("x")) == "train-00001-of-00002.parquet row 1: x"


def test_a_dataset_dict_folder_reads_its_train_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])})
    splits.save_to_disk(str(tmp_path / "splits"))
    assert [item.value for item in iter_records(tmp_path / "splits")] == ROWS


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".jsonl"])
def test_columns_map_a_datasets_own_names(tmp_path, tokenizer, suffix):
    rows = [{"question": row["instruction"], "answer": row["output"], "id": index} for index, row in enumerate(ROWS)]
    path = write_format(tmp_path, suffix, rows)
    with pytest.raises(DataError, match=r"could not tell the data format.*keys seen: answer, id, question"):
        build_token_cache(path, tokenizer, tmp_path / "unmapped", max_seq_len=64)
    info = build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=64, columns={"instruction": "question", "output": "answer"})
    assert info.format == "alpaca" and info.examples == len(ROWS)


def test_parquet_and_jsonl_give_the_same_token_cache(tmp_path, tokenizer):
    caches = {}
    for suffix in (".jsonl", ".parquet", ".csv", "save_to_disk"):
        path = write_format(tmp_path / suffix.strip("."), suffix)
        build_token_cache(path, tokenizer, tmp_path / f"cache{suffix}", max_seq_len=64)
        caches[suffix] = TokenDataset(tmp_path / f"cache{suffix}")
    reference = caches.pop(".jsonl")
    for dataset in caches.values():
        assert len(dataset) == len(reference)
        for index in range(len(reference)):
            assert dataset[index]["input_ids"].tolist() == reference[index]["input_ids"].tolist()
            assert dataset[index]["labels"].tolist() == reference[index]["labels"].tolist()


def test_the_compact_cache_reads_back_as_the_old_int32_cache(tmp_path, tokenizer, write_jsonl):
    """uint16 tokens and a byte mask give the ranks the very tensors int32 tokens and labels gave: the same losses."""
    rows = ROWS + [{"text": "a plain document " * 30}] * 0
    path = write_jsonl(tmp_path / "data.jsonl", rows * 30)
    build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=16)
    new = TokenDataset(tmp_path / "cache")
    # The cache as it was written before: int32 tokens and int32 labels (IGNORE_INDEX where no loss).
    legacy_dir = tmp_path / "legacy"
    legacy_dir.mkdir()
    tokens = np.load(tmp_path / "cache" / "tokens.npy").astype(np.int32)
    mask = np.load(tmp_path / "cache" / "loss_mask.npy").astype(bool)
    np.save(legacy_dir / "tokens.npy", tokens)
    np.save(legacy_dir / "labels.npy", np.where(mask, tokens, -100).astype(np.int32))
    np.save(legacy_dir / "offsets.npy", np.load(tmp_path / "cache" / "offsets.npy"))
    (legacy_dir / "cache.json").write_text((tmp_path / "cache" / "cache.json").read_text())
    old = TokenDataset(legacy_dir)
    assert len(old) == len(new) == 150
    for index in range(len(new)):
        for key in ("input_ids", "labels"):
            assert old[index][key].dtype == new[index][key].dtype
            assert old[index][key].tolist() == new[index][key].tolist()
    # A third of the bytes per token: 2 for the token and 1 for the mask, where there were 4 + 4.
    assert (tmp_path / "cache" / "tokens.npy").stat().st_size < (legacy_dir / "tokens.npy").stat().st_size / 1.9


def test_a_vocabulary_over_65536_tokens_is_stored_in_uint32(tmp_path):
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32
    writer = TokenCacheWriter(tmp_path, vocab_size=151_000)
    writer.add([5, 150_999, 70_000], [-100, 150_999, 70_000])
    writer.flush()
    writer.close()
    assert writer.examples == 1 and writer.tokens == 3 and writer.loss_tokens == 2


def test_a_broken_csv_line_is_skipped_and_named(tmp_path, tokenizer):
    path = tmp_path / "data.csv"
    lines = ["instruction,output"] + [f"Say {i},{i}" for i in range(200)]
    lines[51] = "Say 50,50,an extra column"
    path.write_text("\n".join(lines) + "\n")
    items = list(iter_records(path))
    bad = [item for item in items if isinstance(item, BadRecord)]
    assert [str(item) for item in bad] == ["line 52: expected 2 CSV columns, found 3"]
    assert sum(isinstance(item, Record) for item in items) == 199
    with pytest.raises(DataError, match=r"data\.csv: 1 of 200 records are malformed.*line 52: expected 2 CSV columns, found 3"):
        build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=64, max_bad_fraction=0)


def test_a_damaged_parquet_row_group_is_named_with_its_rows(tmp_path):
    path = tmp_path / "data.parquet"
    rows = [{"text": f"document number {i} " * 20} for i in range(300)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=100, compression="snappy")
    metadata = pq.ParquetFile(path).metadata
    column = metadata.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    # Overwrite row group 2's page headers: the footer still reads, that group does not.
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    data[start : start + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    records = []
    with pytest.raises(DataError, match=r"data\.parquet: row group 2 of 3 \(rows 101-200\) cannot be read.*download or export it again"):
        for item in iter_records(path):
            records.append(item)
    assert len(records) >= 100  # the first row group was read before the damaged one


def test_a_file_that_is_not_parquet_says_so(tmp_path):
    path = tmp_path / "data.parquet"
    path.write_text('{"text": "JSON with the wrong suffix"}\n')
    with pytest.raises(DataError, match=r"data\.parquet: not a readable Parquet file"):
        list(iter_records(path))


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet", ".txt"])
def test_an_empty_file_is_one_clear_message(tmp_path, tokenizer, suffix):
    path = tmp_path / f"empty{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    else:
        path.write_text("")
    with pytest.raises(DataError, match=r"empty.*: no records found: the file is empty"):
        build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=64)


def test_a_broken_json_array_names_the_line_even_in_a_later_chunk(tmp_path, monkeypatch):
    import zeropipe.data.records as records_module

    monkeypatch.setattr(records_module, "JSON_CHUNK_CHARS", 64)  # many windows over a small file
    path = tmp_path / "data.json"
    body = ",\n".join(json.dumps(row) for row in ROWS * 10)
    path.write_text("[\n" + body + ",\n{\"text\": \"broken\",,}\n]\n")
    items = []
    with pytest.raises(DataError, match=r"data\.json: line 52: not valid JSON"):
        for item in iter_records(path):
            items.append(item)
    assert [item.line_number for item in items[:3]] == [2, 3, 4] and len(items) == 50


def counting_reader(reader):
    """``reader`` wrapped to count the records it yielded that are still alive, and the most at once."""
    alive = {"now": 0, "most": 0}

    def freed():
        alive["now"] -= 1

    def counted(path, columns=None):
        for item in reader(path, columns):
            alive["now"] += 1
            alive["most"] = max(alive["most"], alive["now"])
            weakref.finalize(item, freed)
            yield item
            del item

    return counted, alive


def test_the_cache_never_holds_more_than_a_few_batches_of_records(tmp_path, tokenizer, write_jsonl, monkeypatch):
    """Reading, checking, tokenizing and writing stream: records are freed a batch at a time."""
    path = write_jsonl(tmp_path / "data.jsonl", ROWS * 1000)
    counted, alive = counting_reader(iter_records)
    monkeypatch.setattr(token_cache_module, "iter_records", counted)
    info = build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=64)
    assert info.examples == 5000
    assert alive["most"] <= 2 * TOKENIZE_BATCH + 1, alive


PEAK_SCRIPT = """
import json, resource, sys
from pathlib import Path
from transformers import AutoTokenizer
from zeropipe.data.token_cache import build_token_cache
count, tokenizer_dir, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
row = {"instruction": "Summarize the text below.", "input": "The quick brown fox jumps over the lazy dog. " * 8, "output": "A fox jumps over a dog. " * 8}
with open(out / "data.jsonl", "w") as handle:
    for _ in range(count):
        handle.write(json.dumps(row) + "\\n")
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
build_token_cache(out / "data.jsonl", tokenizer, out / "cache", max_seq_len=256)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_peak_memory_of_preparing_records_does_not_grow_with_their_number(tmp_path, tokenizer_dir):
    """6,000 and 36,000 records (12 MB of JSONL) peak at the same memory: a batch, not the dataset.

    Holding every record as before cost ~8x the file (90 MB more for the larger one).
    """
    grown = {}
    for count in (6_000, 36_000):
        result = subprocess.run(
            [sys.executable, "-c", PEAK_SCRIPT, str(count), str(tokenizer_dir), str(tmp_path / str(count))],
            check=False, capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        grown[count] = int(result.stdout.strip().splitlines()[-1])
    assert load_cache_info(tmp_path / "36000" / "cache").examples == 36_000
    assert grown[36_000] - grown[6_000] < 15 * 1024**2, grown


def test_read_located_records_still_lists_small_files(tmp_path):
    path = write_format(tmp_path, ".parquet")
    records, bad = read_located_records(path, {"instruction": "instruction"})
    assert [record.value for record in records] == ROWS and bad == []


def test_the_prepared_tokenizer_gives_the_tokenizers_own_ids(tokenizer):
    from zeropipe.data.token_cache import PreparedTokenizer

    texts = ["What is 3 + 5? 8.", "  double  spaces ", "<|user|>\nHello<|eos|>", "Ünïcode ✓ 漢字", ""]
    prepared = PreparedTokenizer(tokenizer)
    assert prepared._backend is not None
    assert prepared(texts, add_special_tokens=False)["input_ids"] == tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert (prepared.bos_token_id, prepared.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)


def test_worker_processes_write_the_same_cache(tmp_path, tokenizer, write_jsonl):
    rows = [{"instruction": f"Say {i}", "output": "word " * (i % 13)} for i in range(2500)] + ["not json"]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    one = build_token_cache(path, tokenizer, tmp_path / "one", max_seq_len=16)
    two = build_token_cache(path, tokenizer, tmp_path / "two", max_seq_len=16, num_workers=2)
    assert (one.examples, one.tokens, one.loss_tokens, one.dropped_empty, one.bad_record_count) == (
        two.examples, two.tokens, two.loss_tokens, two.dropped_empty, two.bad_record_count
    )
    assert [str(b) for b in two.bad_records] == ["line 2501: not valid JSON (Expecting value at column 1)"]
    for name in ("tokens.npy", "loss_mask.npy", "offsets.npy"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_a_batch_of_nothing_but_malformed_records_is_counted(tmp_path, tokenizer, write_jsonl):
    # The second batch holds no good record at all.
    rows = [{"instruction": "Hi", "output": "Hello"}] * 2 + [{"instruction": "Hi", "output": ""}] + ["broken"] * (2 * TOKENIZE_BATCH - 3)
    info = build_token_cache(write_jsonl(tmp_path / "data.jsonl", rows), tokenizer, tmp_path / "cache", max_seq_len=64, max_bad_fraction=1.0)
    assert (info.examples, info.bad_record_count, info.dropped_empty, info.records) == (3, 2 * TOKENIZE_BATCH - 3, 0, 2 * TOKENIZE_BATCH)  # an empty reply still learns its eos


def test_a_mixture_source_maps_its_own_columns(tmp_path):
    from zeropipe.config.schema import DataSection
    from zeropipe.data.mixture import build_mixture

    questions = write_format(tmp_path / "a", ".parquet", [{"question": f"Q{i}", "answer": f"A{i}"} for i in range(4)])
    plain = write_format(tmp_path / "b", ".jsonl")
    data = DataSection(mixture=[{"path": str(questions), "columns": {"instruction": "question", "output": "answer"}}, {"path": str(plain)}])
    path = build_mixture(data, tmp_path / "mixed", seed=0)
    users = {json.loads(line)["messages"][0]["content"] for line in path.read_text().splitlines()}
    assert {f"Q{i}" for i in range(4)} <= users <= {f"Q{i}" for i in range(4)} | {row["instruction"] for row in ROWS}


def test_the_streamed_split_holds_out_the_records_the_list_split_did(tmp_path, tokenizer, write_jsonl):
    """data.eval_fraction draws among the good records, as when they were all held: the same split for the same data and seed."""
    from zeropipe.data.split import RecordSplit

    rows = [{"instruction": f"Say {n}", "output": f"number {n}"} if n % 7 else "broken" for n in range(60)]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    split = RecordSplit(0.2, 5, held_out=True)
    build_token_cache(path, tokenizer, tmp_path / "eval", max_seq_len=64, split=split, max_bad_fraction=0.2)
    good = [row for row in rows if isinstance(row, dict)]
    expected = [f"number {row['instruction'].split()[1]}" for row in split.select(good)]
    dataset = TokenDataset(tmp_path / "eval")
    answers = [tokenizer.decode(dataset[i]["input_ids"]).rsplit("\n", 1)[-1].replace("<|eos|>", "").strip() for i in range(len(dataset))]
    assert answers == expected


def test_tokenizing_progress_reaches_the_ui_once_a_second(monkeypatch):
    import time

    from zeropipe.families.causal_lm.prepare import progress_bar

    written = []

    class Run:
        def write_progress(self, phase, done=None, total=None):
            written.append((phase, done))

    clock = iter([100.0, 100.5, 101.2, 101.4, 102.5])
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    show = progress_bar("tokenizing", Path("data.parquet"), Run())
    for records in (1000, 2000, 3000, 4000):
        show(records)
    show.done()
    assert written == [("tokenizing data.parquet: 2,000 records, 1,667/s, 1 s", 2000), ("tokenizing data.parquet: 4,000 records, 1,600/s, 2 s", 4000)]


def test_a_token_cache_is_reused_by_a_run_with_the_same_inputs_and_rebuilt_when_one_changes(tmp_path, tokenizer):
    from zeropipe.config.load import validate_config
    from zeropipe.families.causal_lm.prepare import prepare_cache
    from zeropipe.rundir import RunDir

    data = write_format(tmp_path, ".parquet")

    def prepare(name: str, **data_keys):
        raw = {
            "run": {"name": name, "output_dir": str(tmp_path / "runs")},
            "model": {"config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}},
            "data": {"path": str(data), "max_seq_len": 64, **data_keys},
            "hardware": {"gpus": 1, "accelerator": "cpu"},
        }
        run = RunDir(tmp_path / "runs" / name)
        run.path.mkdir(parents=True)
        return prepare_cache(validate_config(raw), run, data, tokenizer, reuse=False), run

    first, first_run = prepare("first")
    second, second_run = prepare("second")
    third, _ = prepare("third", max_seq_len=32)
    assert "reused_from" not in first and "reused_from" not in third
    assert second["reused_from"].startswith(str(tmp_path / "runs" / ".zeropipe-cache" / "tokens"))
    assert second["examples"] == first["examples"] == 5
    for name in ("tokens.npy", "loss_mask.npy", "offsets.npy"):
        assert (second_run.cache / name).read_bytes() == (first_run.cache / name).read_bytes()
    # Linked, not copied: one copy on disk for every run that reads it.
    assert (second_run.cache / "tokens.npy").stat().st_ino == (first_run.cache / "tokens.npy").stat().st_ino
    assert len(TokenDataset(second_run.cache)) == 5
