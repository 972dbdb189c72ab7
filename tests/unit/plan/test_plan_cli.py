"""``zeropipe plan`` as a user runs it (in-process, through its own parser)."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from zeropipe.cli import plan
from zeropipe.errors import ZeroPipeError


def run_plan(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="zeropipe")
    plan.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    return args.run(args)


def test_human_output_names_every_term_and_ends_with_yaml(capsys):
    assert run_plan("--model", "llama-3.1-8b", "--gpus", "5x24GB", "--ram", "64GB", "--lora-r", "16") == 0
    out = capsys.readouterr().out
    assert "Recommended: ZeRO-3" in out
    for name in (
        "frozen base weights (16-bit)",
        "LoRA adapters (16-bit)",
        "optimizer states",
        "logits and loss",
        "CUDA context",
        "model loading peak",
    ):
        assert name in out
    assert "model loading peak 74.9 GiB" in out  # why ZeRO-2 does not fit: five full copies in 64 GB
    fragment = yaml.safe_load(out.split("Run-config settings (YAML):\n", 1)[1])
    assert fragment["deepspeed"]["zero_stage"] == 3


def test_json_is_the_same_plan_as_data(capsys):
    run_plan("--params", "7.5e9", "--gpus", "64x80GB", "--ram", "2TB", "--json")
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["gpus_per_node"] == 64
    assert data["best"]["fits"] and data["fragment"]["deepspeed"]["zero_stage"] in (0, 1, 2, 3)


def test_nothing_fits_exits_1_with_the_reason(capsys):
    assert run_plan("--model", "llama-3.1-70b", "--gpus", "2x24GB", "--ram", "64GB") == 1
    assert "nothing fits" in capsys.readouterr().out


def test_plan_a_run_config(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
                },
                "data": {"synthetic": {"task": "arithmetic"}, "max_seq_len": 64},
                "deepspeed": {"zero_stage": 2},
            }
        )
    )
    assert run_plan(str(config), "--gpus", "2x24GB", "--ram", "64GB") == 0
    out = capsys.readouterr().out
    assert "Your config: ZeRO-2" in out and "fits" in out


@pytest.mark.parametrize(
    "argv,match",
    [
        ((), "nothing to plan"),
        (("--model", "no-such-model"), "not in the catalog"),
        (("--params", "1e9", "--lora-r", "8"), "--lora-r needs"),
        (("--params", "1e9", "--ram", "64GB"), "add --gpus"),
    ],
)
def test_mistakes_are_explained(argv, match):
    with pytest.raises(ZeroPipeError, match=match):
        run_plan(*argv)


def test_cpu_ranks_count_every_rank_term_in_host_ram(capsys):
    # 32 GB: on a CPU without bf16 in hardware the plan is fp32 (4.6 GiB of frozen weights per ZeRO-0 rank).
    assert run_plan("--model", "llama-3.2-1b", "--cpu-ranks", "4", "--ram", "32GB", "--lora-r", "16", "--seq-len", "128", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["accelerator"] == "cpu" and data["hardware"]["gpus_per_node"] == 4
    assert data["hardware"]["host_ram_bytes"] == 32 * 1024**3
    best = data["best"]
    [working] = [t for t in best["per_node_terms"] if t["name"] == "CPU ranks' working memory"]
    assert working["bytes"] == 4 * best["per_gpu_bytes"]


def test_cpu_ranks_and_gpus_are_two_different_machines():
    with pytest.raises(ZeroPipeError, match="--cpu-ranks and --gpus"):
        run_plan("--model", "llama-3.2-1b", "--cpu-ranks", "4", "--gpus", "4x24GB")


@pytest.mark.parametrize("source", ["inline model", "catalog model (not on disk)"])
def test_the_gpus_given_replace_the_configs_count_and_the_note_says_so(tmp_path, capsys, source):
    """`--gpus 1x24GB` on a config written for 5 GPUs plans one GPU: whole shares, the batch over one rank (it planned 1/5 shares)."""
    model = (
        {"config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}}
        if source == "inline model"
        else {"family": "diffusion", "path": str(tmp_path / "AuraFlow-v0.3"), "lora": {"r": 32}}
    )
    data = {"synthetic": {"task": "arithmetic"}, "max_seq_len": 64} if source == "inline model" else {"path": str(tmp_path / "images")}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": model, "data": data, "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 4},
                                      "hardware": {"gpus": 5}, "deepspeed": {"zero_stage": 3}}))
    run_plan(str(config), "--gpus", "1x24GB", "--ram", "64GB", "--json")
    result = json.loads(capsys.readouterr().out)
    assert result["hardware"]["gpus_per_node"] == 1 and result["global_batch"] == 4
    assert "hardware.gpus: 5 in the config; planned for the 1 GPUs per node given (--gpus 1x24GB)" in result["notes"]
    assert "1/5 share" not in json.dumps(result)  # the config's 5 dealt nothing
