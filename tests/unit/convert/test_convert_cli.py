"""Telling the tools apart, `zeropipe convert` and what `zeropipe train` does with another tool's file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from zeropipe.cli.convert import convert_for_train
from zeropipe.cli.main import main
from zeropipe.convert import ConversionError, detect_tool, read_source


@pytest.mark.parametrize(
    "name,text,tool",
    [
        ("a.toml", "dataset = 'd.toml'\n[model]\ntype = 'flux'\n", "diffusion-pipe"),
        ("a.yml", "base_model: x\ndatasets: []\n", "axolotl"),
        ("a.yaml", "model_name_or_path: x\nstage: sft\n", "llama-factory"),
        ("a.yaml", "model:\n  config: {model_type: llama}\ndata:\n  synthetic: {task: mixed}\n", "zeropipe"),
        ("a.yaml", "foo: 1\n", None),
        ("a.toml", "[something]\nx = 1\n", None),
    ],
)
def test_each_tool_is_told_apart(tmp_path, name, text, tool):
    path = tmp_path / name
    path.write_text(text)
    assert detect_tool(path, read_source(path)) == tool


def test_unknown_and_own_files_are_refused_by_convert(tmp_path, capsys):
    unknown = tmp_path / "mystery.yaml"
    unknown.write_text("foo: 1\n")
    assert main(["convert", str(unknown)]) == 2
    assert "cannot tell which tool" in capsys.readouterr().err
    own = tmp_path / "run.yaml"
    own.write_text("model:\n  config: {model_type: llama}\n")
    assert main(["convert", str(own)]) == 2
    assert "already a ZeRO-Pipe run config: train it with `zeropipe train" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "missing.yml")]) == 2
    assert "missing.yml does not exist" in capsys.readouterr().err


def axolotl_file(tmp_path: Path) -> Path:
    model = tmp_path / "base"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "data.jsonl").write_text(json.dumps({"instruction": "q", "input": "", "output": "a"}) + "\n")
    path = tmp_path / "sft.yml"
    path.write_text(f"base_model: {model}\ndatasets:\n  - path: data.jsonl\n    type: alpaca\nadapter: lora\nlora_r: 4\nspecial_tokens:\n  pad_token: x\n")
    return path


def test_convert_writes_the_yaml_and_lists_what_it_left_out(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = axolotl_file(tmp_path)
    out = tmp_path / "converted" / "run.yaml"
    assert main(["convert", str(source), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"wrote {out}" in err and "special_tokens: the tokenizer's own special tokens are used" in err
    assert f"train it: zeropipe train {out}" in err
    raw = yaml.safe_load(out.read_text())
    assert raw["model"]["lora"]["r"] == 4 and raw["data"]["format"] == "alpaca"
    # Without --out the YAML goes to stdout, its header listing what was left out.
    assert main(["convert", str(source)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("# Converted by `zeropipe convert` from the axolotl config")
    assert "#   - special_tokens:" in captured.out
    # Writing over the file being converted is refused.
    assert main(["convert", str(source), "--out", str(source)]) == 2
    assert "is the file being converted" in capsys.readouterr().err


def test_convert_says_when_the_result_does_not_validate_yet(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "hub.yml"
    path.write_text("base_model: NousResearch/Llama-3.2-1B\ndatasets:\n  - path: teknium/GPT4-LLM-Cleaned\n    type: alpaca\n")
    assert main(["convert", str(path), "--out", str(tmp_path / "out.yaml")]) == 0
    err = capsys.readouterr().err
    assert "the converted config does not validate yet" in err and "model.path" in err
    assert "train it:" not in err


def test_train_loads_zeropipe_yaml_as_is_and_converts_the_others(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    own = tmp_path / "run.yaml"
    own.write_text("model:\n  config: {model_type: llama}\n")
    assert convert_for_train(str(own)) == str(own)
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [\n")
    assert convert_for_train(str(broken)) == str(broken)  # load_config reports the YAML error as for any run config

    source = axolotl_file(tmp_path)
    converted = Path(convert_for_train(str(source)))
    assert converted == tmp_path / "sft.zeropipe.yaml"
    err = capsys.readouterr().err
    assert f"{source} is written for axolotl: converted it to {converted}" in err
    raw = yaml.safe_load(converted.read_text())
    assert raw["run"]["name"] == "sft"  # the run is named after the user's file, not NAME.zeropipe

    from zeropipe.config.load import load_config

    config = load_config(converted)
    assert config.model.lora.r == 4 and config.run.name == "sft"


def test_train_refuses_an_architecture_that_is_not_supported_yet(tmp_path, capsys):
    (tmp_path / "clips").mkdir()
    (tmp_path / "dataset.toml").write_text(f"[[directory]]\npath = '{tmp_path / 'clips'}'\n")
    (tmp_path / "cosmos.toml").write_text("dataset = 'dataset.toml'\n[model]\ntype = 'cosmos'\ntransformer_path = '/models/cosmos-1.0-diffusion-7b-text2world.pt'\n")
    with pytest.raises(ConversionError, match=r"cosmos.toml cannot train yet: \[model\] type = 'cosmos' is a video model"):
        convert_for_train(str(tmp_path / "cosmos.toml"))
    assert main(["train", str(tmp_path / "cosmos.toml")]) == 2
    assert "cannot train yet" in capsys.readouterr().err
    # `zeropipe convert` still writes it, for when the architecture lands.
    assert main(["convert", str(tmp_path / "cosmos.toml"), "--out", str(tmp_path / "cosmos.yaml")]) == 0
    assert "# CANNOT TRAIN YET" in (tmp_path / "cosmos.yaml").read_text()


@pytest.mark.parametrize(
    "name,text,key",
    [
        ("a.yml", "base_model: x\nmicro_batch_size: lots\n", "micro_batch_size = 'lots'"),
        ("b.yaml", "model_name_or_path: x\nstage: sft\nfinetuning_type: lora\nlora_rank: eight\n", "lora_rank = 'eight'"),
        ("c.toml", "dataset = 'd.toml'\nepochs = 'many'\n[model]\ntype = 'flux'\n", "epochs = 'many'"),
    ],
)
def test_a_value_of_the_wrong_type_names_its_key(tmp_path, capsys, name, text, key):
    (tmp_path / "d.toml").write_text("[[directory]]\npath = '.'\n")
    path = tmp_path / name
    path.write_text(text)
    assert main(["convert", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{key} is not a" in err and "Traceback" not in err
