"""The run page's Resume offers a rank count: a count that cannot keep the global batch is refused
with the counts that can, another count that can starts the launcher with it."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.e2e.conftest import screenshot
from tests.e2e.fake_runs import write_run

pytestmark = pytest.mark.e2e


def test_resume_on_another_rank_count_from_the_run_page(page, ui):
    path = write_run(ui.runs, "halfway", state="stopped", steps=6, total_steps=12, checkpoints=(6,))  # 8 x 1 x 2 ranks
    # A ZeRO shard that is no checkpoint: the launcher started here must stop at converting it.
    (path / "checkpoints" / "step_00000006" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"not a tensor file")
    run = None
    for _ in range(150):
        run = next((r for r in ui.api("/api/runs")["runs"] if r["name"] == "halfway"), None)
        if run:
            break
        page.wait_for_timeout(200)
    assert run
    page.goto(f"{ui.url}/runs/{run['id']}")
    ranks = page.locator("#resume-ranks")
    expect(ranks).to_have_value("2")  # the count that saved the checkpoint

    ranks.fill("3")
    with page.expect_response(lambda r: r.url.endswith("/resume")) as refused:
        page.click("#resume")
    assert refused.value.status == 409
    expect(page.locator("#action-message")).to_contain_text("global batch of 16 (micro-batch 8 x accumulation 1 x 2 ranks)")
    expect(page.locator("#action-message")).to_contain_text("resume on one of these rank counts: 1, 2")
    screenshot(page, "30-resume-rank-count-refused", full_page=False)

    ranks.fill("1")
    with page.expect_response(lambda r: r.url.endswith("/resume")) as started:
        page.click("#resume")
    assert started.value.status == 200, started.value.text()
    assert started.value.json()["run"]["state"] == "starting"
    assert started.value.request.post_data_json == {"checkpoint": "step_00000006", "gpus": 1, "confirm": True}
    # What the launcher started with this count does is tested through the API (tests/unit/server/test_server_resume_ranks.py).
