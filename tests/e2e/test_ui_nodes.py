"""A multi-node run in the UI: its ranks grouped by node, each node's host RAM, the diagnosis naming the node.

The run directory is written as `zeropipe train` leaves a two-node run that lost a rank on its
second node (status.json's ``nodes`` as zeropipe.launch.multinode records them; a real
two-node run is tests/integration/test_multinode.py's).
"""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import expect

from tests.e2e.conftest import screenshot
from tests.e2e.fake_runs import write_run

pytestmark = pytest.mark.e2e

GB = 2**30  # the page shows GiB
TEXT = """rank 3 on node 1 (box2) was killed by SIGKILL
likely cause: most likely the kernel's OOM killer: host RAM peaked at 63.1 of 64.0 GiB - the node ran out of memory
fix: deepspeed.zero_stage: 3 (each rank loads only its share of the weights)
the other ranks were then stopped (rank 0 on node 0 (box1) got SIGTERM; rank 1 on node 0 (box1) got SIGTERM; rank 2 on node 1 (box2) got SIGTERM) - effects, not causes"""


def node(node_rank: int, host: str, ranks: list[int], used: float, peak: float) -> dict:
    return {
        "node_rank": node_rank, "host": host, "hostname": host, "transport": "local" if node_rank == 0 else "ssh", "ranks": ranks,
        "host_ram_total_bytes": 64 * GB, "host_ram_used_bytes": int(used * GB), "host_ram_peak_bytes": int(peak * GB),
        "rank_rss_peak_bytes": [int(12.5 * GB), int(13.25 * GB)], "versions": {"torch": "2.13.0"}, "pids": [4001, 4002],
    }  # fmt: skip


@pytest.fixture
def two_node_run(ui):
    run = write_run(ui.runs, "two-boxes", state="failed", steps=5, total_steps=500, world_size=4, checkpoints=(), diagnosis=TEXT)
    status = json.loads((run / "status.json").read_text())
    status["nodes"] = [node(0, "box1", [0, 1], 40.2, 41.0), node(1, "box2", [2, 3], 20.0, 63.1)]
    status["diagnosis"] |= {"rank": 3, "node": "node 1 (box2)"}
    (run / "status.json").write_text(json.dumps(status))
    return run


def test_ranks_grouped_by_node_with_each_nodes_host_ram(page, ui, two_node_run):
    page.goto(ui.url + "/")
    page.locator("#runs tbody tr", has_text="two-boxes").locator("a").first.click()
    expect(page.locator("#facts")).to_contain_text("ranks 4 × cpu on 2 nodes")
    card = page.locator("#nodes-card")
    expect(card).to_be_visible()
    rows = page.locator("#nodes tbody tr")
    expect(rows).to_have_count(2)
    expect(rows.nth(0)).to_contain_text("box1")
    expect(rows.nth(0).locator(".node-ranks")).to_have_text("rank 0, rank 1")
    expect(rows.nth(1).locator(".node-ranks")).to_have_text("rank 2, rank 3")
    expect(rows.nth(1)).to_contain_text("ssh")
    # Host RAM per node: now, peak and total (the node that ran out shows its peak near its total).
    expect(rows.nth(1)).to_contain_text("63.1 GiB")
    expect(rows.nth(1)).to_contain_text("64 GiB")
    expect(rows.nth(0)).to_contain_text("41 GiB")
    # Each rank's log tab says which node it ran on.
    expect(page.locator("#log-tabs button[data-log='rank3']")).to_have_text("rank3 · node 1")
    expect(page.locator("#diagnosis")).to_contain_text("rank 3 on node 1 (box2) was killed by SIGKILL")
    screenshot(page, "nodes-two-node-run")


def test_a_single_node_run_shows_no_nodes_card(page, ui):
    page.goto(ui.url + "/")
    page.locator("#runs tbody tr", has_text="baseline").locator("a").first.click()
    expect(page.locator("#run-name .badge")).to_have_text("completed")
    expect(page.locator("#nodes-card")).to_be_hidden()
    expect(page.locator("#log-tabs button[data-log='rank1']")).to_have_text("rank1")
