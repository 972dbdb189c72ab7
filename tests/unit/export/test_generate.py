"""`zeropipe generate` without a training run: what kind of source a path is, and the errors for bad ones."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from zeropipe.cli.main import main
from zeropipe.errors import CheckpointError, ZeroPipeError
from zeropipe.families import generate, load_model, resolve_source

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Llama saved with from_pretrained's layout and a trained tokenizer beside it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from zeropipe.data.tokenizer import train_tokenizer

    directory = tmp_path_factory.mktemp("export")
    tokenizer = train_tokenizer(["What is 1 + 2? 3. Reverse the word: cat tac"] * 20, 300, directory)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY, vocab_size=len(tokenizer))).save_pretrained(directory)
    return directory


def test_missing_path_file_and_empty_directory_say_what_to_give(tmp_path):
    with pytest.raises(ZeroPipeError, match="does not exist: give a run directory"):
        resolve_source(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ZeroPipeError, match="is a file"):
        resolve_source(tmp_path / "notes.txt")
    with pytest.raises(ZeroPipeError, match=r"holds no model: it is neither a run directory \(config.yaml\), an exported model"):
        resolve_source(tmp_path)


def test_run_without_checkpoint_and_unknown_tag(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {config: {model_type: llama}}\n")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_source(run)
    tag = run / "checkpoints" / "step_00000003"
    tag.mkdir(parents=True)
    (tag / "zeropipe_complete.json").write_text(json.dumps({"step": 3}))
    assert resolve_source(run).checkpoint.tag == "step_00000003"
    assert resolve_source(run, checkpoint="3").checkpoint.tag == "step_00000003"
    assert resolve_source(tag).checkpoint.tag == "step_00000003"
    with pytest.raises(CheckpointError, match=r"no complete checkpoint 'step_00000009' \(complete ones: step_00000003\)"):
        resolve_source(run, checkpoint="step_00000009")


def test_export_directory_generates_greedy_and_refuses_checkpoint_and_image(hf_dir):
    source = resolve_source(hf_dir)
    assert (source.kind, source.family) == ("hf", "causal_lm")
    with pytest.raises(ZeroPipeError, match="drop --checkpoint"):
        resolve_source(hf_dir, checkpoint="step_00000001")
    loaded = load_model(hf_dir, device="cpu")
    first = generate(loaded, ["What is 1 + 2?", "Reverse the word: cat"], max_new_tokens=5)
    again = generate(loaded, ["What is 1 + 2?"], max_new_tokens=5)
    assert [g.prompt for g in first] == ["What is 1 + 2?", "Reverse the word: cat"]
    assert first[0].output == again[0].output, "greedy decoding must not depend on the batch of prompts"
    sampled = [generate(loaded, ["What is 1 + 2?"], max_new_tokens=5, temperature=1.5, seed=4)[0].output for _ in range(2)]
    assert sampled[0] == sampled[1], "the same seed must give the same sample"
    with pytest.raises(ZeroPipeError, match="--image needs a vision-language model"):
        generate(loaded, ["What is in the picture?"], images=["cat.png"])


def test_adapter_with_missing_base_and_diffusion_directory(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "gone")}))
    with pytest.raises(ZeroPipeError, match="not a local model directory.*export the run with --merge"):
        resolve_source(adapter)
    pipeline = tmp_path / "pipeline"
    pipeline.mkdir()
    (pipeline / "model_index.json").write_text("{}")
    with pytest.raises(ZeroPipeError, match="diffusion model: zeropipe generate writes text"):
        load_model(pipeline)


def test_cli_turns_a_bad_path_into_exit_code_2(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    assert "zeropipe generate: error:" in capsys.readouterr().err


def test_cli_prints_json(hf_dir, capsys):
    assert main(["generate", str(hf_dir), "--prompt", "What is 1 + 2?", "--max-new-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "hf" and out["checkpoint"] is None and out["generations"][0]["prompt"] == "What is 1 + 2?"
