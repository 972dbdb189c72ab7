"""Resuming a 2-rank run on 1 and on 3 ranks: converted through DeepSpeed's universal checkpoint,
the global batch kept, the data continuing where it stopped, the loss curve continuing.

Each reference is one uninterrupted 2-rank run of 6 steps that saves at step 3; the resumed
runs continue a copy of it from step 3 on another number of ranks. The causal LM family is
loaded through a test plug-in that records the examples every step reads in the ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.integration.conftest import assert_ok, metrics, tiny_run_config, write_config, zeropipe

pytestmark = pytest.mark.integration

PLUGINS = Path(__file__).parent / "plugins"
LORA = {"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}
# Global batch 24 = micro-batch 4 x accumulation 3 x 2 ranks = 4 x 6 x 1 = 4 x 2 x 3.
TRAIN = {"max_steps": 6, "save_every": 3, "keep_last": 5, "micro_batch_size": 4, "gradient_accumulation_steps": 3, "warmup_steps": 1}


@contextlib.contextmanager
def recording_plugin():
    """The recording plug-in imported by this process, as ZEROPIPE_PLUGINS would import it in a new launcher; undone after.

    The launcher runs in the pytest process (conftest.zeropipe: a new launcher process costs 6-14 s of
    CI per command, eight commands here). The plug-in is recorded in the run it prepares (run.json's
    ``plugins``, with its folder), which the ranks and a resume import it from, as they do for any plug-in
    run. Loading plug-ins named in ZEROPIPE_PLUGINS by a new process is test_toy_family.py's and
    test_condition_door.py's.
    """
    import zeropipe.families as families
    import zeropipe.rundir as rundir

    families.families()  # the built-ins first, so that restoring the registry below restores them
    registry, plugins, path = dict(families._REGISTRY), dict(rundir._PLUGINS), list(sys.path)
    sys.path.insert(0, str(PLUGINS))
    try:
        importlib.import_module("recording_causal_lm")  # registers itself under the built-in's name, first
        rundir.note_plugin("recording_causal_lm")
        yield
    finally:
        families._REGISTRY.clear()
        families._REGISTRY.update(registry)
        rundir._PLUGINS.clear()
        rundir._PLUGINS.update(plugins)
        sys.path[:] = path
        sys.modules.pop("recording_causal_lm", None)


def train(config: Path, *args: str, record: Path):
    with pytest.MonkeyPatch.context() as patch, recording_plugin():
        patch.setenv("RECORD_EXAMPLES_TO", str(record))
        return zeropipe("train", config, *args)


def examples_by_step(record: Path) -> dict[int, list[int]]:
    steps = defaultdict(list)
    for path in record.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            steps[row["step"]].append(row["example"])
    return {step: sorted(examples) for step, examples in steps.items()}


def fingerprint(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


class Reference:
    def __init__(self, root: Path, stage: int, lora: bool):
        self.root, self.stage, self.lora = root, stage, lora
        self.name = f"ref{stage}{'lora' if lora else ''}"
        self.config = self.make_config(self.name)
        result = train(self.config, record=root / f"{self.name}-examples")
        assert_ok(result)
        self.run_dir = root / "runs" / self.name
        self.losses = {row["step"]: row["loss"] for row in metrics(self.run_dir)}
        self.examples = examples_by_step(root / f"{self.name}-examples")

    def make_config(self, name: str) -> Path:
        model = {"lora": LORA} if self.lora else {}
        config = tiny_run_config(self.root, name=name, train=TRAIN, deepspeed={"zero_stage": self.stage, "precision": "fp32"}, model=model, generate=None)
        return write_config(self.root, config, f"{name}.yaml")

    def resume_on(self, ranks: int):
        """Continue a copy of the reference from step 3 on ``ranks`` ranks: (result, run dir, examples by step)."""
        name = f"{self.name}-on{ranks}"
        run_dir = self.root / "runs" / name
        shutil.copytree(self.run_dir, run_dir)
        checkpoint = run_dir / "checkpoints" / "step_00000003"
        before = fingerprint(checkpoint)
        record = self.root / f"{name}-examples"
        result = train(self.make_config(name), f"hardware.gpus={ranks}", "--resume", str(checkpoint), record=record)
        assert_ok(result)
        assert fingerprint(checkpoint) == before, "the original checkpoint must be left as it was"
        return result, run_dir, examples_by_step(record)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    made = {}

    def reference(stage: int, lora: bool = False) -> Reference:
        if (stage, lora) not in made:
            made[stage, lora] = Reference(tmp_path_factory.mktemp(f"stage{stage}"), stage, lora)
        return made[stage, lora]

    return reference


def assert_continues(reference: Reference, result, run_dir: Path, ranks: int, examples: dict[int, list[int]] | None = None):
    output = result.stderr + result.stdout
    assert f"saved by 2 ranks, on {ranks}" in output
    assert f"train.gradient_accumulation_steps = {24 // (4 * ranks)} (keeps checkpoint step_00000003's global batch of 24" in output
    assert "as a universal checkpoint" in output
    rows = metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, 7)), "each step once"
    for row in rows[3:]:
        # Another partition of the same examples into micro-batches: close, not bit-equal.
        assert row["loss"] == pytest.approx(reference.losses[row["step"]], rel=0.03), (row["step"], row["loss"], reference.losses[row["step"]])
    final = json.loads((run_dir / "checkpoints" / "step_00000006" / "zeropipe_complete.json").read_text())
    assert final["world_size"] == ranks and final["gradient_accumulation_steps"] * final["micro_batch_size"] * ranks == 24
    assert final["data_position"]["consumed"] == 6 * 24, "the whole run's position: 6 steps of 24 examples"
    if examples is not None:
        assert sorted(examples) == [4, 5, 6], "the resumed run starts at step 4"
        for step in (4, 5, 6):
            assert examples[step] == reference.examples[step], f"step {step} must train on the uninterrupted run's examples"
        seen = [index for step in (1, 2, 3) for index in reference.examples[step]] + [index for step in (4, 5, 6) for index in examples[step]]
        assert len(seen) == len(set(seen)) == 6 * 24, "no example twice within the epoch"


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_two_rank_zero2_run_resumes_on_another_rank_count(references, ranks):
    reference = references(2)
    result, run_dir, examples = reference.resume_on(ranks)
    assert_continues(reference, result, run_dir, ranks, examples)
    assert f"ranks, ZeRO stage 2, 400 examples, 6 steps of 4 x {24 // (4 * ranks)} x {ranks}" in result.stderr + result.stdout


def test_a_zero3_lora_run_resumes_on_three_ranks(references):
    reference = references(3, lora=True)
    result, run_dir, _ = reference.resume_on(3)
    assert_continues(reference, result, run_dir, 3)


def test_a_zero1_lora_run_resumes_on_one_rank(references):
    reference = references(1, lora=True)
    result, run_dir, _ = reference.resume_on(1)
    assert_continues(reference, result, run_dir, 1)


def test_a_global_batch_that_cannot_be_kept_is_refused_before_anything_starts(references):
    reference = references(2)
    name = f"{reference.name}-on5"
    run_dir = reference.root / "runs" / name
    shutil.copytree(reference.run_dir, run_dir)
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    result = train(reference.make_config(name), "hardware.gpus=5", "--resume", str(checkpoint), record=reference.root / "unused")
    assert result.returncode == 2, result.stderr
    message = result.stderr
    assert "global batch of 24 (micro-batch 4 x accumulation 3 x 2 ranks)" in message
    assert "hardware.gpus set to one of 1, 2, 3, 6" in message and "Traceback" not in message
    checkpoints = sorted(path.name for path in (run_dir / "checkpoints").iterdir())
    assert checkpoints == sorted(path.name for path in (reference.run_dir / "checkpoints").iterdir()), "nothing converted, moved or removed"
