"""Fingerprint of diffusion entries' tiny runs: fp32 per-step losses and sample bytes, to hold a refactor to bit-identical behaviour.

Each entry's tiny preset goes through the declared-wiring contract's own path (tests/diffusion_contract.py,
tests/unit/diffusion/test_architecture_contract.py): the launcher's data step, the node's cache filling, the
rank's task assembling micro-batches from the caches, its LoRA denoiser in plain torch (fp32) trained three
steps with AdamW through the entry's own ``predict`` and ``loss``, then the entry's samples. Printed per entry:
each step's loss (``float.hex``, exact), the denoiser's output at each step (sha256 of its bytes) and each
written sample file (sha256).

    DS_ACCELERATOR=cpu PYTHONPATH=src python scripts/entry_fingerprint.py flux wan qwen-image-edit > before.json
    ... change the code ...
    DS_ACCELERATOR=cpu PYTHONPATH=src python scripts/entry_fingerprint.py flux wan qwen-image-edit > after.json
    python scripts/entry_fingerprint.py --compare before.json after.json
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

STEPS = 3

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def fingerprint(name: str) -> dict:
    import pytest
    import torch

    from tests.diffusion_contract import cached_run
    from tests.unit.diffusion.test_architecture_contract import lora_denoiser, rank_task
    from zeropipe.families.diffusion import entries as architectures

    arch = architectures.architecture_named(name)
    call = getattr(arch, "call", arch)  # today's denoiser role, or an entry of the old shape itself
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as monkeypatch:
        torch.manual_seed(0)
        run = cached_run(name, arch, Path(tmp), round_trip=False)
        trainer = rank_task(run, monkeypatch)
        task = trainer.task
        torch.manual_seed(0)
        model = lora_denoiser(task)
        task.after_initialize()
        optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], lr=5e-2)
        losses, outputs = [], []
        model.train()
        for step in range(STEPS):
            torch.manual_seed(step)
            latents, condition = task.assemble([step % 2], augment=False)
            noised = task.objective.noise(latents, generator=torch.Generator().manual_seed(step + 1))
            prediction = call.predict(model, noised.model_input, noised.timesteps, condition, task.predict_context)
            outputs.append(hashlib.sha256(prediction.detach().float().numpy().tobytes()).hexdigest())
            loss = call.loss(model, noised, condition, task.predict_context)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss).hex())
        trainer.engine = SimpleNamespace(module=model)
        torch.manual_seed(0)
        task.generate_samples()
        samples = {
            str(path.relative_to(run.path / "samples")): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted((run.path / "samples").rglob("*")) if path.is_file() and path.name != "index.jsonl"
        }
        return {"losses": losses, "outputs": outputs, "samples": samples}


def compare(before_path: str, after_path: str) -> int:
    before, after = json.loads(Path(before_path).read_text()), json.loads(Path(after_path).read_text())
    bad = 0
    for name in sorted(set(before) | set(after)):
        same = before.get(name) == after.get(name)
        bad += not same
        row = before.get(name) or {}
        print(f"{name}: {'identical' if same else 'DIFFERENT'}; losses {[float.fromhex(value) for value in row.get('losses', [])]}; {len(row.get('samples', {}))} sample file(s)")
        if not same:
            print(json.dumps({"before": before.get(name), "after": after.get(name)}, indent=1))
    return 1 if bad else 0


def main() -> int:
    if sys.argv[1:2] == ["--compare"]:
        return compare(*sys.argv[2:4])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # As the test suite runs (tests/conftest.py): a CPU without bf16, the planner's assumed speeds.
    os.environ.setdefault("ZEROPIPE_CPU_FLAGS", "avx avx2 fma avx512f")
    os.environ.setdefault("ZEROPIPE_CALIBRATION", str(Path(__file__).resolve().parents[1] / "tests" / "no-calibration-profile.json"))
    import faulthandler

    out = {}
    for name in sys.argv[1:]:
        faulthandler.dump_traceback_later(900, exit=True)  # an entry's run that hangs says where
        out[name] = fingerprint(name)
        print(f"{name}: {out[name]}", file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
