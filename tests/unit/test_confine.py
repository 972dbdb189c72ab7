"""A run submitted through the UI is confined to the UI's folders, applied to the resolved run and by every reader (issue 26, defects 2-4).

The resolved run (``launch.resolve.resolve_run(..., confinement=...)``) refuses every path of the
config and of the user's DeepSpeed JSON outside the roots, before the hostfile or the JSON is
read; the readers of data files skip a file that is a symlink out of the roots, counted, and
never read; run.json carries the roots to the ranks, the node's setup process, export, eval
and generate. A command-line run (no confinement) reads what it names.
"""

from __future__ import annotations

import json

import pytest
from PIL import Image

from zeropipe.config.load import validate_config
from zeropipe.confine import Confinement, ConfinementError, OutsideRoots, confining
from zeropipe.launch.resolve import resolve_run

SECRET = "root:$6$SECRET-HASH-THAT-MUST-NOT-LEAK:19000:0:99999:7:::"
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture
def folders(tmp_path):
    """(roots, outside): a runs and a data folder, and a folder outside them holding a secret."""
    runs, data, outside = tmp_path / "runs", tmp_path / "data", tmp_path / "outside"
    for folder in (runs, data, outside):
        folder.mkdir()
    (outside / "shadow").write_text(SECRET + "\n")
    return Confinement((runs, data), base=tmp_path), outside


def config(tmp_path, **sections) -> dict:
    raw = {
        "run": {"name": "confined", "output_dir": str(tmp_path / "runs")},
        "model": {"config": TINY},
        "data": {"synthetic": {"task": "arithmetic", "examples": 64}, "max_seq_len": 32},
        "train": {"max_steps": 4, "micro_batch_size": 4},
        "hardware": {"gpus": 2, "accelerator": "cpu"},
    }
    for name, values in sections.items():
        raw[name] = raw.get(name, {}) | values
    return raw


@pytest.mark.parametrize(
    ("json_config", "key"),
    [
        ({"csv_monitor": {"enabled": True, "output_path": "OUTSIDE/csv", "job_name": "x"}}, "deepspeed.config_file:csv_monitor.output_path"),
        ({"tensorboard": {"enabled": True, "output_path": "OUTSIDE/tb"}}, "deepspeed.config_file:tensorboard.output_path"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "OUTSIDE/nvme"}}}, "deepspeed.config_file:zero_optimization.offload_param.nvme_path"),
        ({"flops_profiler": {"enabled": True, "output_file": "OUTSIDE/flops.txt"}}, "deepspeed.config_file:flops_profiler.output_file"),
    ],
)
def test_the_deepspeed_jsons_paths_are_confined_when_the_run_is_resolved(tmp_path, folders, json_config, key):
    roots, outside = folders
    ds = tmp_path / "data" / "ds.json"  # the JSON itself lies inside the roots: only what it holds leads out
    ds.write_text(json.dumps(json_config).replace("OUTSIDE", str(outside)))
    run = validate_config(config(tmp_path, deepspeed={"config_file": str(ds)}))
    with pytest.raises(ConfinementError) as err:
        resolve_run(run, fill_auto_knobs=False, confinement=roots)
    assert [k for k, _ in err.value.problems] == [key] and str(outside) in str(err.value)
    assert resolve_run(run, fill_auto_knobs=False).user_ds_config  # on the command line: the user's own JSON, as it is


def test_overrides_control_path_and_denoiser_file_are_confined(tmp_path, folders):
    roots, outside = folders
    raw = config(tmp_path, deepspeed={"overrides": {"csv_monitor": {"enabled": True, "output_path": str(outside)}}})
    raw["data"] |= {"control_path": str(outside)}
    raw["model"]["diffusion"] = {"denoiser_file": str(outside / "shadow")}
    with pytest.raises(ConfinementError) as err:
        resolve_run(validate_config(raw), fill_auto_knobs=False, confinement=roots)
    assert {k for k, _ in err.value.problems} == {"deepspeed.overrides.csv_monitor.output_path", "data.control_path", "model.diffusion.denoiser_file"}


def test_other_machines_are_refused_unless_trusted_and_a_hostfile_outside_is_never_read(tmp_path, folders):
    roots, outside = folders
    with pytest.raises(ConfinementError) as err:
        resolve_run(validate_config(config(tmp_path, hardware={"nodes": ["localhost", "127.0.0.2"], "ssh_options": "-l trainer"})), confinement=roots)
    assert {k for k, _ in err.value.problems} == {"hardware.nodes", "hardware.ssh_options"}
    trusted = Confinement(roots.roots, multinode=True, base=tmp_path)
    with pytest.raises(ConfinementError) as err:
        resolve_run(validate_config(config(tmp_path, hardware={"hostfile": str(outside / "shadow")})), confinement=trusted)
    assert err.value.problems[0][0] == "hardware.hostfile" and SECRET not in str(err.value) and "SECRET" not in str(err.value)


def test_a_hostfile_that_is_not_one_is_named_by_line_never_quoted(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# a comment\n{SECRET}\n")
    with pytest.raises(Exception) as err:
        resolve_run(validate_config(config(tmp_path, hardware={"hostfile": str(hostfile)})), fill_auto_knobs=False)
    assert "line 2" in str(err.value) and str(hostfile) in str(err.value) and "SECRET" not in str(err.value)


def test_text_records_behind_a_symlink_out_of_the_roots_are_skipped_by_the_data_preparation(tmp_path, folders):
    from zeropipe.launch.prepare import prepare_run
    from zeropipe.rundir import RunDir

    roots, outside = folders
    texts = tmp_path / "data" / "texts"
    texts.mkdir()
    (texts / "a.jsonl").write_text("".join(json.dumps({"text": f"two plus {i} is {i + 2}"}) + "\n" for i in range(64)))
    (outside / "secret.jsonl").write_text(json.dumps({"text": SECRET}) + "\n")
    (texts / "b.jsonl").symlink_to(outside / "secret.jsonl")
    raw = config(tmp_path, data={"path": str(texts), "synthetic": None, "max_bad_fraction": 0.5})
    prepared = prepare_run(resolve_run(validate_config(raw), confinement=roots))
    run = RunDir(prepared.run.path)
    written = b"".join(p.read_bytes() for p in run.path.rglob("*") if p.is_file())
    assert b"SECRET" not in written  # not in the token cache, the tokenizer, nor any note
    assert prepared.plan.examples == 64
    skipped = json.loads((run.cache / "cache.json").read_text())["bad_records"]  # reported with the run's skipped records
    assert [(row["file"], "outside" in row["reason"]) for row in skipped] == [("b.jsonl", True)]
    # The roots travel in run.json, for the ranks, the node's setup process, export, eval and generate.
    assert Confinement.from_json(run.read_plan().confined_to).roots == roots.roots
    assert RunDir(run.path).data_confinement.roots == roots.roots
    # On the command line (no confinement) the same folder is read as it is.
    with confining(None):
        from zeropipe.data.formats import read_records

        assert any(SECRET in str(record) for record in read_records(texts)[0])


def test_images_and_captions_behind_symlinks_are_skipped_and_counted(tmp_path, folders):
    from zeropipe.data.images import load_image_for_bucket, scan_image_folder

    roots, outside = folders
    images = tmp_path / "data" / "images"
    images.mkdir()
    for name in ("a", "b", "c"):
        Image.new("RGB", (32, 32), "red").save((outside if name == "c" else images) / f"{name}.png")
    (images / "a.txt").write_text("a red square")
    (images / "b.txt").symlink_to(outside / "shadow")  # a caption that is /etc/shadow
    (images / "c.png").symlink_to(outside / "c.png")  # an image out of the roots
    (images / "more").symlink_to(outside)  # a folder out of the roots: not walked
    with confining(roots):
        scan = scan_image_folder(images)
        assert [item.path.name for item in scan.items] == ["a.png"]
        assert {bad.path.name for bad in scan.bad} == {"b.png", "c.png"} and all("outside" in bad.reason for bad in scan.bad)
        assert SECRET not in json.dumps([str(bad) for bad in scan.bad])
        with pytest.raises(Exception, match="outside"):
            load_image_for_bucket(images / "c.png", (32, 32))
    with confining(None):
        assert SECRET in [item.caption for item in scan_image_folder(images).items][1]


def test_a_checkpoint_folder_symlinked_out_of_a_ui_run_is_refused(tmp_path, folders):
    from zeropipe.rundir import RunDir, RunPlan

    roots, outside = folders
    run = RunDir(tmp_path / "runs" / "r")
    (run.path / "checkpoints").mkdir(parents=True)
    (outside / "step_00000002").mkdir()
    (run.path / "checkpoints" / "step_00000002").symlink_to(outside / "step_00000002")
    (run.path / "checkpoints" / "step_00000001").mkdir()
    plan = RunPlan(1, "cpu", 2, 2, 2, 8, 4, 1, 2, confined_to=roots.to_json())
    run.write_plan(plan)
    with confining(None):
        assert RunDir(run.path).use_checkpoint(run.path / "checkpoints" / "step_00000001")
        with pytest.raises(OutsideRoots, match="step_00000002"):
            RunDir(run.path).use_checkpoint(run.path / "checkpoints" / "step_00000002")
        plan.confined_to = None  # a command-line run: the user's own symlink is theirs to use
        run.write_plan(plan)
        assert RunDir(run.path).use_checkpoint(run.path / "checkpoints" / "step_00000002")


def test_every_reference_folder_is_confined(tmp_path, folders):
    """data.control_paths (several references per target): a folder outside the roots is named by its index."""
    roots, outside = folders
    raw = config(tmp_path)
    raw["data"] |= {"control_paths": [str(tmp_path / "data"), str(outside)]}
    with pytest.raises(ConfinementError) as err:
        resolve_run(validate_config(raw), fill_auto_knobs=False, confinement=roots)
    assert [k for k, _ in err.value.problems] == ["data.control_paths[1]"] and str(outside) in str(err.value)


def test_a_preference_pairs_image_out_of_the_roots_is_counted_never_decoded(tmp_path, folders):
    """VLM preference data (issue 29) reads its images through the supervised VLM checks: an absolute
    path or a symlink out of a UI run's folders drops the pair, named, and the image is never opened."""
    from zeropipe.errors import DataError
    from zeropipe.families.vlm.data import check_images, load_rgb
    from zeropipe.families.vlm.preference import read_vlm_pairs

    roots, outside = folders
    data = tmp_path / "data"
    Image.new("RGB", (16, 16), "red").save(data / "red.png")
    Image.new("RGB", (16, 16), "blue").save(outside / "blue.png")
    (data / "linked.png").symlink_to(outside / "blue.png")
    rows = [
        {"images": ["red.png"], "prompt": "What colour is this?", "chosen": "red", "rejected": "blue"},
        {"images": [str(outside / "blue.png")], "prompt": "What colour is this?", "chosen": "blue", "rejected": "red"},
        {"images": ["linked.png"], "prompt": "What colour is this?", "chosen": "blue", "rejected": "red"},
    ]
    (data / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with confining(roots):
        found = check_images(read_vlm_pairs(data / "pairs.jsonl", None, None, None))
        assert [pair.images for pair in found.examples] == [[str((data / "red.png").resolve())]]
        assert found.skipped == 2 and all("outside" in bad.reason for bad in found.bad_images)
        with pytest.raises(DataError, match="outside"):
            load_rgb(outside / "blue.png")  # what a rank would open, had the file been swapped since
    with confining(None):
        assert len(check_images(read_vlm_pairs(data / "pairs.jsonl", None, None, None)).examples) == 3


def test_an_adapter_to_continue_from_is_confined(tmp_path, folders):
    """model.lora.init_from: outside the roots the resolved run refuses it; a symlink in the roots leading out is never read."""
    from zeropipe.models.adapter_init import read_adapter

    roots, outside = folders
    with pytest.raises(ConfinementError) as err:
        resolve_run(validate_config(config(tmp_path, model={"config": TINY, "lora": {"init_from": str(outside / "shadow")}})), fill_auto_knobs=False, confinement=roots)
    assert [k for k, _ in err.value.problems] == ["model.lora.init_from"]
    link = tmp_path / "data" / "adapter.safetensors"
    link.symlink_to(outside / "shadow")
    with confining(roots), pytest.raises(OutsideRoots) as refused:
        read_adapter(link)
    assert SECRET not in str(refused.value)
