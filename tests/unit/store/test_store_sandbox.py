"""Nothing the UI reads or hands to a launcher may lie outside the runs and data folders."""

from __future__ import annotations

import os

import pytest

from zeropipe.store.sandbox import OutsideRoots, Roots, absolutize, check_name, config_path_problems, resolve_inside


def test_paths_inside_the_root_resolve(tmp_path):
    (tmp_path / "samples" / "step_1").mkdir(parents=True)
    assert resolve_inside(tmp_path, "samples/step_1") == (tmp_path / "samples" / "step_1").resolve()
    assert resolve_inside(tmp_path, "samples/../samples/step_1") == (tmp_path / "samples" / "step_1").resolve()


@pytest.mark.parametrize("path", ["../outside", "a/../../outside", "/etc/passwd", "", "x\x00y"])
def test_traversal_absolute_and_malformed_paths_are_refused(tmp_path, path):
    with pytest.raises(OutsideRoots):
        resolve_inside(tmp_path / "root", path)


def test_a_symlink_leading_out_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret.png").write_bytes(b"x")
    os.symlink(tmp_path / "secret.png", root / "link.png")
    with pytest.raises(OutsideRoots):
        resolve_inside(root, "link.png")


@pytest.mark.parametrize("name", ["my-run", "run_2.b", "A1"])
def test_good_run_names(name):
    assert check_name(name) == []


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "-flag", "", None, 3, "x" * 101, "configs", "a b"])
def test_bad_run_names(name):
    assert check_name(name)[0][0] == "run.name"


def test_config_paths_must_be_inside_the_data_or_runs_folders(tmp_path):
    roots = Roots(runs=[tmp_path / "runs"], data=[tmp_path / "data"], base=tmp_path)
    raw = {
        "run": {"name": "ok", "output_dir": "/somewhere/else"},
        "model": {"path": "/etc", "tokenizer": "data/tok"},
        "data": {"path": "data/../../outside.jsonl"},
        "deepspeed": {"config_file": str(tmp_path / "runs" / "x" / "ds.json")},
    }
    keys = {key for key, _ in config_path_problems(raw, roots)}
    assert keys == {"run.output_dir", "model.path", "data.path"}
    good = {"run": {"name": "ok", "output_dir": "runs"}, "data": {"path": "data/train.jsonl"}}
    assert config_path_problems(good, roots) == []


def test_absolutize_pins_the_output_dir_and_paths(tmp_path):
    roots = Roots(runs=[tmp_path / "runs"], data=[tmp_path / "data"], base=tmp_path)
    out = absolutize({"run": {"name": "x"}, "data": {"path": "data/t.jsonl"}}, roots)
    assert out["run"]["output_dir"] == str(tmp_path / "runs")
    assert out["data"]["path"] == str(tmp_path / "data" / "t.jsonl")


def test_text_that_only_looks_like_a_path_is_not_refused(tmp_path):
    """Prompts, model types and revisions are not paths, even with a slash in them."""
    roots = Roots(runs=[tmp_path / "runs"], data=[tmp_path / "data"], base=tmp_path)
    raw = {
        "run": {"name": "ok"},
        "generate": {"prompts": ["What is 1/2?", "/etc/passwd is a file name"]},
        "model": {"config": {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "load_kwargs": {"revision": "refs/pr/1"}},
    }
    assert config_path_problems(raw, roots) == []


def test_a_deeply_nested_config_is_one_problem_not_a_crash(tmp_path):
    roots = Roots(runs=[tmp_path / "runs"], base=tmp_path)
    deep: list = []
    node = deep
    for _ in range(5000):
        node.append([])
        node = node[0]
    problems = config_path_problems({"run": {"name": "ok"}, "deepspeed": {"overrides": {"x": deep}}}, roots)
    assert len(problems) == 1 and "nests more than" in problems[0][1]
