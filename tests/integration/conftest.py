"""Real 2-rank DeepSpeed runs on CPU through the `zeropipe` command, in a temporary directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

# The first multi-rank run on a fresh machine JIT-builds DeepSpeed's CPU ops (about a minute).
RUN_TIMEOUT = 900

# Ranks are forked from their launcher, which has torch, DeepSpeed, transformers and peft imported
# (zeropipe.launch.fork_start): each rank's start then costs a fraction of a second instead of about
# 5 s of CPU, which on 2 cores was the larger part of most runs in this lane. The rank's code from
# main() on is the same. Forked only where it is safe (one-thread CPU ranks), so a 1-rank run and
# the ranks of a multi-node agent still start as new interpreters, and so does every rank of the
# e2e lane (the UI's launches); ZEROPIPE_RANK_START=exec starts every rank that way here too.
# A forked rank inherits what the launcher's process holds: a test that patches code in this
# process while its ranks run, and means the ranks not to see it, sets ZEROPIPE_RANK_START=exec.
os.environ.setdefault("ZEROPIPE_RANK_START", "fork")

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def tiny_run_config(tmp_path: Path, name: str = "tiny", **sections) -> dict:
    config = {
        "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 7},
        "model": {"config": dict(TINY_LLAMA), "tokenizer_vocab_size": 300},
        "data": {"synthetic": {"task": "arithmetic", "examples": 400}, "max_seq_len": 32},
        "train": {"max_steps": 12, "micro_batch_size": 8, "lr": 1e-2, "warmup_steps": 2, "log_every": 4},
        "deepspeed": {"zero_stage": 2, "precision": "auto"},
        "hardware": {"gpus": 2},
        "generate": {"prompts": ["What is 1 + 2?"], "max_new_tokens": 4},
    }
    for section, values in sections.items():
        if values is None:
            config.pop(section, None)
            continue
        config.setdefault(section, {})
        for key, value in values.items():
            if value is None:
                config[section].pop(key, None)
            else:
                config[section][key] = value
    return config


def write_config(tmp_path: Path, config: dict, filename: str = "run.yaml") -> Path:
    path = tmp_path / filename
    path.write_text("# Run it: zeropipe train run.yaml\n" + yaml.safe_dump(config, sort_keys=False))
    return path


# What `python -m zeropipe train` would find on its sys.path and in its environment when the session began:
# a `train` run by this interpreter (see zeropipe()) must not see a test's changes to them.
_PYTHONPATH_AT_START = os.environ.get("PYTHONPATH")


def zeropipe(*args: str, cwd: Path | None = None, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    """`zeropipe ARGS`; a `train` is launched by this interpreter (zeropipe_train_here), any other command in a new one.

    The launcher of a `train` imports torch, transformers and DeepSpeed before it starts a rank,
    paid by every 2-rank run of the lane (measured on 2 shared cores under load: 12-14 s from the
    command to its first rank in a new process, 0.3-8.6 s here). This process holds them already. The ranks are new processes either way; the launcher's
    own process start-up is what ``zeropipe_process`` and the tests that start it (start_zeropipe:
    signals, kills, a second launcher) still cover. ZEROPIPE_TEST_TRAIN_PROCESS=1 starts every
    `train` in a new process, as before.
    """
    if args and args[0] == "train" and train_here_fits():
        return zeropipe_train_here(*args, cwd=cwd)
    return zeropipe_process(*args, cwd=cwd, timeout=timeout)


def zeropipe_process(*args: str, cwd: Path | None = None, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    """`python -m zeropipe ARGS` in a new interpreter: what a user's shell runs."""
    env = dict(os.environ)
    env.pop("DS_ACCELERATOR", None)
    return subprocess.run([sys.executable, "-m", "zeropipe", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def train_here_fits() -> bool:
    """Whether a `train` launched by this interpreter sees what a new `python -m zeropipe` would.

    Not when a test names plug-ins (ZEROPIPE_PLUGINS is read once per process) or changes PYTHONPATH
    (a new process's sys.path): those start a new process.
    """
    if os.environ.get("ZEROPIPE_TEST_TRAIN_PROCESS") == "1":
        return False
    return "ZEROPIPE_PLUGINS" not in os.environ and os.environ.get("PYTHONPATH") == _PYTHONPATH_AT_START


def zeropipe_train_here(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`zeropipe train ...` with this interpreter as its launcher; afterwards, what the launcher's exit would undo.

    A launcher owns its run directory until it exits (an flock the kernel drops then): here the
    ownership is given up when the command returns, so that a later command on the run finds it
    ended, as it would after a real launcher. Plug-ins a resumed run imported (from its run.json)
    are forgotten again, and `python -m`'s first sys.path entry (the folder it runs in) is there
    for the command only.
    """
    import zeropipe.families as families
    import zeropipe.rundir as rundir

    families.families()  # the built-in families (and the environment's plug-ins) load once per process, as in a new one
    held, plugins, registered, path = set(rundir._held), dict(rundir._PLUGINS), set(families._REGISTRY), list(sys.path)
    modules = set(sys.modules)
    sys.path.insert(0, str(Path(cwd).resolve()) if cwd is not None else os.getcwd())
    try:
        return zeropipe_here(*args, cwd=cwd)
    finally:
        for key in set(rundir._held) - held:
            rundir.RunDir(key).release()
        sys.path[:] = path
        for name in set(rundir._PLUGINS) - set(plugins):
            sys.modules.pop(name, None)
        rundir._PLUGINS.clear()
        rundir._PLUGINS.update(plugins)
        for name in set(families._REGISTRY) - registered:
            families.unregister(name)
        # Modules imported from the run's folder (a recipe's rewards.py) are that run's, not the session's.
        for name in set(sys.modules) - modules:
            file = getattr(sys.modules[name], "__file__", None) or ""
            if cwd is not None and file.startswith(str(Path(cwd).resolve())):
                sys.modules.pop(name, None)


def zeropipe_here(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`zeropipe ARGS` run by this interpreter's ``main()``: the same parsing and code as the shell's command.

    For commands that start no rank (export, eval, generate): a second interpreter's start-up
    and imports cost 6-20 s of CI per call, where this process has torch, transformers and
    DeepSpeed loaded already. `python -m zeropipe` itself is what zeropipe() runs.
    """
    import contextlib
    import io

    from zeropipe.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    accelerator, here = os.environ.get("DS_ACCELERATOR"), os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(arg) for arg in args])
            except SystemExit as exit:  # argparse's errors, as the shell's command exits with them
                code = exit.code if isinstance(exit.code, int) else 1
            except Exception:  # noqa: BLE001 - what the shell's command would print and exit 1 with
                import traceback

                traceback.print_exc()
                code = 1
    finally:
        os.chdir(here)
        # main() names the CPU accelerator for DeepSpeed in the environment; the runs started later must not inherit it.
        if accelerator is None:
            os.environ.pop("DS_ACCELERATOR", None)
        else:
            os.environ["DS_ACCELERATOR"] = accelerator
    return subprocess.CompletedProcess(["zeropipe", *map(str, args)], code, out.getvalue(), err.getvalue())


def start_zeropipe(*args: str, cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "zeropipe", *map(str, args)], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}"


@pytest.fixture
def tmp_run(tmp_path):
    """(tmp_path, make_config): write a tiny run config with section overrides, return its path."""

    def make(name: str = "tiny", **sections) -> Path:
        return write_config(tmp_path, tiny_run_config(tmp_path, name=name, **sections), f"{name}.yaml")

    return tmp_path, make


# The uninterrupted reference runs of the exact-resume tests (test_faults.py, test_resume_and_failures.py):
# checkpoints at steps 10, 20 and 30. DeepSpeed's CPU Adam drifted after a resume from 20 and 30
# (from 10 it happened to match: see zeropipe.launch.resume).
RESUME_STEPS, SAVE_EVERY = 32, 10


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """One uninterrupted run per ZeRO stage, every checkpoint kept; made on first use, shared by the session.

    Returns ``get(stage) -> (config path, run directory)``. Tests continue copies of the run
    directory, or new runs of the config under another run.name; none writes into it.
    """
    made: dict[int, tuple[Path, Path]] = {}

    def get(stage: int) -> tuple[Path, Path]:
        if stage not in made:
            tmp_path = tmp_path_factory.mktemp(f"reference{stage}")
            config = tiny_run_config(
                tmp_path,
                name="reference",
                train={"max_steps": RESUME_STEPS, "save_every": SAVE_EVERY, "keep_last": 10},
                deepspeed={"zero_stage": stage, "precision": "fp32"},
                generate={"prompts": []},
            )
            path = write_config(tmp_path, config)
            assert_ok(zeropipe("train", path))
            made[stage] = path, tmp_path / "runs" / "reference"
        return made[stage]

    return get


def assert_a_second_run_would_encode_nothing(run_dir: Path, workdir: Path) -> None:
    """What the launcher of a second run on the same data and model finds: every latent and caption cached.

    Checked in-process with the launcher's own data step (a second run's start-up costs 15-20 s of CI
    per model). That ranks then load no VAE or text encoder is checked by real second runs in
    test_diffusion.py and test_video.py.
    """
    from zeropipe.config.schema import RunConfig
    from zeropipe.families.diffusion.prepare import prepare_diffusion_data
    from zeropipe.rundir import RunDir

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["model"] = {**{key: value for key, value in config["model"].items() if key != "config"}, "path": str(run_dir / "pipeline")}
    workdir.mkdir(parents=True)
    prepared = prepare_diffusion_data(RunConfig.model_validate(config), RunDir(workdir), reuse=False)
    assert "caches complete: the training ranks will not load the VAE or the text encoders" in prepared.notes, prepared.notes
    assert prepared.node_setup is None

