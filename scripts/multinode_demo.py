"""The body of scripts/multinode-demo.sh (see there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.sshd import SSHD, start_sshd  # noqa: E402 - the same loopback sshd the tests start


def train(config: Path, name: str, overrides: list[str], output_dir: Path) -> list[tuple[int, float]]:
    command = [sys.executable, "-m", "zeropipe", "train", str(config), f"run.name={name}", f"run.output_dir={output_dir}", *overrides]
    print(f"$ zeropipe train {config.name} run.name={name} {' '.join(overrides)}", flush=True)
    started = time.time()
    subprocess.run(command, check=True, cwd=ROOT)
    rows = [json.loads(line) for line in (output_dir / name / "metrics.jsonl").read_text().splitlines()]
    print(f"({time.time() - started:.0f} s)\n", flush=True)
    return [(row["step"], row["loss"]) for row in rows if "loss" in row and row.get("kind") is None]


def main(argv: list[str]) -> int:
    if SSHD is None:
        print("multinode-demo: no sshd (apt-get install openssh-server, or run scripts/setup.sh as root)", file=sys.stderr)
        return 1
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # both "nodes" share this machine's cores
    work = Path(tempfile.mkdtemp(prefix="zeropipe-multinode-demo-"))
    server = start_sshd(work / "sshd")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        hardware = ["hardware.nodes=[127.0.0.1,127.0.0.2]", "hardware.gpus=1", f"hardware.ssh_port={server.port}", f"hardware.ssh_options='{server.ssh_options}'"]
        config = ROOT / "examples" / "quickstart.yaml"
        output_dir = ROOT / "runs"
        two_nodes = train(config, f"multinode-demo-{stamp}", [*hardware, "deepspeed.precision=fp32", *argv], output_dir)
        status = json.loads((output_dir / f"multinode-demo-{stamp}" / "status.json").read_text())
        one_node = train(config, f"multinode-demo-{stamp}-one-node", ["hardware.gpus=2", "deepspeed.precision=fp32", *argv], output_dir)
    finally:
        server.stop()
    nodes = status["nodes"]
    described = ", ".join(f"{n['host']} via {n['transport']}: ranks {n['ranks']}" for n in nodes)
    print(f"nodes: {len(nodes)} ({described})")
    print(f"world size: {sum(len(n['ranks']) for n in nodes)}")
    print(f"{'step':>6} {'2 nodes x 1 rank':>18} {'1 node x 2 ranks':>18}")
    same = True
    for (step, loss), (_, reference) in zip(two_nodes, one_node):
        same &= abs(loss - reference) <= 1e-5 * max(1.0, abs(reference))
        print(f"{step:>6} {loss:>18.6f} {reference:>18.6f}")
    print("the losses are the same" if same and len(two_nodes) == len(one_node) else "THE LOSSES DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
