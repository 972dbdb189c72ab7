"""The UI as a person uses it, in headless Chromium against a real `zeropipe ui`.

Two real (tiny) training runs in the whole file: one created from the form and watched to
completion, one stopped, resumed from its checkpoint, watched across a UI restart and
stopped again from the CLI. The failed run and the diffusion run are written as files.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import psutil
import pytest
import yaml
from playwright.sync_api import expect

from tests.e2e.conftest import screenshot
from tests.e2e.fake_runs import TINY_CONFIG

pytestmark = pytest.mark.e2e


def badge(page):
    return page.locator("#run-name .badge")


def points(page, chart="loss") -> int:
    return int(page.locator(f"#chart-{chart}").get_attribute("data-points") or 0)


def last_seen(page) -> int:
    """The last step the loss chart holds."""
    return int(page.evaluate("(() => { const s = window.zpCharts.loss.data[0]; return s.length ? s[s.length - 1] : 0; })()"))


def test_a_failed_run_shows_its_diagnosis(page, ui):
    page.goto(ui.url + "/")
    page.select_option("#state-filter", "failed,lost")
    rows = page.locator("#runs tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("sdxl-oom")
    screenshot(page, "01-runs-filtered-failed")
    rows.first.locator("a").click()
    expect(badge(page)).to_have_text("failed")
    diagnosis = page.locator("#diagnosis")
    expect(diagnosis).to_be_visible()
    expect(diagnosis).to_contain_text("rank 0 was killed by SIGKILL")
    expect(diagnosis).to_contain_text("fix: use deepspeed.zero_stage: 3")
    expect(page.locator("#log")).to_contain_text("step 3/500")
    screenshot(page, "02-failed-run-diagnosis")


def test_the_sample_gallery_of_a_diffusion_run(page, ui):
    run = ui.run("sdxl-lora")
    page.goto(f"{ui.url}/runs/{run['id']}")
    gallery = page.locator("#gallery-card")
    expect(gallery).to_be_visible()
    expect(gallery.locator("th.prompt")).to_have_text(["a red fox in the snow", "a lighthouse at dusk"])
    expect(gallery.locator("tbody tr")).to_have_count(2)
    assert gallery.locator("tbody tr").first.get_attribute("data-step") == "100"  # newest first
    images = gallery.locator("img")
    expect(images).to_have_count(4)
    page.wait_for_function("[...document.querySelectorAll('#gallery img')].every((img) => img.complete && img.naturalWidth === 64)")
    # A diffusion run has no tokens: its throughput chart shows images/s instead of staying empty.
    expect(page.locator('[data-chart="throughput"] .u-title')).to_have_text("throughput (images/s)")
    gallery.scroll_into_view_if_needed()
    screenshot(page, "03-diffusion-gallery")


def test_create_a_run_from_the_form_and_watch_it_complete(page, ui):
    page.goto(ui.url + "/new")
    status = page.locator("#check-status")
    expect(status).to_have_text("ready to launch", timeout=120_000)
    yaml_box = page.locator("#yaml")

    # The form writes the YAML...
    page.fill("#field-run-name", "from-the-form")
    page.fill("#field-train-max_steps", "30")
    expect(yaml_box).to_have_value(re.compile(r"name: from-the-form[\s\S]*max_steps: 30"))
    # ...the YAML fills the form...
    yaml_box.fill(yaml_box.input_value().replace("micro_batch_size: 8", "micro_batch_size: 4"))
    expect(page.locator("#field-train-micro_batch_size")).to_have_value("4")
    # ...and every edit is checked, with the fix beside the problem.
    yaml_box.fill(yaml_box.input_value().replace("micro_batch_size: 4", "micro_batchsize: 4"))
    expect(page.locator("#check")).to_contain_text("did you mean 'micro_batch_size'", timeout=60_000)
    expect(page.locator("#launch")).to_be_disabled()
    yaml_box.fill(yaml_box.input_value().replace("micro_batchsize: 4", "micro_batch_size: 4"))
    expect(status).to_have_text("ready to launch", timeout=60_000)
    plan = page.locator("#plan")
    expect(plan).to_contain_text(re.compile(r"Your config|planner unavailable"), timeout=60_000)
    screenshot(page, "04-new-run-form", full_page=False)

    # The command preview is what Launch writes and runs: the same file, byte for byte, and its command.
    config_file = ui.runs / "configs" / "from-the-form.yaml"
    # A run launched from the UI is confined to the UI's folders (docs/ui.md): the command says so.
    expect(page.locator("#command-line")).to_contain_text(f"zeropipe train {config_file} --confine-to ")
    command_line = page.locator("#command-line").text_content()
    expect(page.locator("#command-yaml")).to_contain_text("micro_batch_size: 4")
    previewed = page.locator("#command-yaml").text_content()
    assert yaml.safe_load(previewed)["run"]["output_dir"] == str(ui.runs)  # the server's absolute path, as it writes it
    page.click("#command-details > summary")
    page.locator("#command-card").scroll_into_view_if_needed()
    screenshot(page, "50-command-preview", full_page=False)
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=ui.url)
    page.click("#copy-line")
    expect(page.locator("#copy-line")).to_have_text("copied")
    assert page.evaluate("navigator.clipboard.readText()") == command_line
    page.click("#copy-yaml")
    assert page.evaluate("navigator.clipboard.readText()") == previewed

    page.click("#launch")
    page.wait_for_url(re.compile(r"/runs/\d+$"), timeout=60_000)
    assert config_file.read_text() == previewed
    seen = []
    deadline = time.time() + 600
    while time.time() < deadline:
        seen.append(points(page))
        if badge(page).inner_text() in ("completed", "failed", "stopped", "lost"):
            break
        if seen[-1] and len(set(seen)) == 3:
            screenshot(page, "05-form-run-training", full_page=False)
        time.sleep(0.5)
    expect(badge(page)).to_have_text("completed")
    page.wait_for_function("document.querySelector('#chart-loss').dataset.points === '30'", timeout=30_000)
    # Points arrived while it trained, not all at the end.
    growing = sorted({p for p in seen if 0 < p < 30})
    assert growing, f"the chart went from nothing to the end without points in between: {seen}"
    expect(page.locator("#generations-card")).to_be_visible()
    expect(page.locator("#checkpoints tbody tr")).not_to_have_count(0)
    screenshot(page, "06-form-run-completed")

    # Export the final checkpoint to a Hugging Face directory.
    page.fill("#export-name", "hf")
    with page.expect_response(lambda r: r.url.endswith("/export")) as export:
        page.click("#export")
    assert export.value.status == 202, export.value.text()
    row = page.locator("#exports tbody tr", has_text="hf")
    expect(row.locator(".badge")).to_have_text("completed", timeout=300_000)
    exported = ui.runs / "from-the-form" / "exports" / "hf"
    assert (exported / "config.json").is_file() and list(exported.glob("*.safetensors"))

    page.goto(ui.url + "/")
    row = page.locator("#runs tbody tr", has_text="from-the-form")
    expect(row.locator(".badge")).to_have_text("completed")
    expect(row).to_contain_text("30 / 30")
    screenshot(page, "07-runs-list")


def test_stop_resume_across_a_ui_restart(page, ui):
    raw = json.loads(json.dumps(TINY_CONFIG))
    raw["run"] = {"name": "long-one"}
    raw["train"].update(max_steps=5000, save_every=5, keep_last=2, eval_every=5)
    raw["data"]["eval_fraction"] = 0.1  # 40 held-out examples, evaluated every 5 steps
    run = ui.api("/api/runs", {"yaml": yaml.safe_dump(raw)})["run"]
    page.goto(f"{ui.url}/runs/{run['id']}")
    expect(badge(page)).to_have_text("running", timeout=300_000)
    page.wait_for_function("Number(document.querySelector('#chart-loss').dataset.points) > 5", timeout=300_000)
    expect(page.locator("#checkpoints tbody tr")).not_to_have_count(0, timeout=60_000)

    # The UI goes away; the run does not. A new UI process reattaches to it.
    status_file = ui.runs / "long-one" / "status.json"
    before = json.loads(status_file.read_text())
    ui.stop()
    time.sleep(3)
    assert psutil.pid_exists(before["supervisor_pid"]) and json.loads(status_file.read_text())["state"] == "running"
    ui.start()
    page.goto(f"{ui.url}/runs/{run['id']}")
    expect(badge(page)).to_have_text("running", timeout=60_000)  # the restarted UI's first page takes seconds under load
    first = points(page)
    page.wait_for_function(f"Number(document.querySelector('#chart-loss').dataset.points) > {first}", timeout=120_000)
    # Evaluations that arrive while the page watches are drawn on the loss chart at their steps.
    evaluated = "(() => { const c = window.zpCharts.loss; if (!c || c.labels[1] !== 'eval_loss') return 0;" \
        " return c.data[2].filter((v, i) => v !== null && c.data[0][i] > %d).length; })()"
    page.wait_for_function(f"{evaluated % last_seen(page)} >= 2", timeout=120_000)
    screenshot(page, "08-running-after-ui-restart", full_page=False)

    # Sample now: asked from the page, the two ranks answer the run's prompts together at their next step.
    run_dir = ui.runs / "long-one"
    assert not (run_dir / "generations.jsonl").exists()  # a language-model run answers only at its end otherwise
    asked_at = last_seen(page)
    page.click("#sample-now")
    expect(page.locator("#action-message")).to_contain_text("every rank draws the samples together at its next step")
    expect(page.locator("#generations tbody tr").first).to_be_visible(timeout=120_000)
    answers = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert answers and all(row["step"] > asked_at for row in answers), answers
    assert not (run_dir / "sample_request.json").exists()  # answered: rank 0 removed the request
    assert "samples asked for from the UI" in (run_dir / "logs" / "rank0.log").read_text()
    page.locator("#generations-card").scroll_into_view_if_needed()
    screenshot(page, "55-sample-now-answers", full_page=False)

    with page.expect_response(lambda r: r.url.endswith("/stop")) as stop:
        page.click("#stop")  # the confirm dialog is accepted by the fixture
    assert stop.value.status == 200, stop.value.text()
    expect(badge(page)).to_have_text("stopped", timeout=120_000)
    stopped = json.loads(status_file.read_text())
    assert stopped["state"] == "stopped"
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in stopped["pids"])
    screenshot(page, "09-stopped")

    checkpoint = page.locator("#resume-checkpoint").input_value()
    step = int(checkpoint.split("_")[1])
    with page.expect_response(lambda r: r.url.endswith("/resume")) as resume:
        page.click("#resume")
    assert resume.value.status == 200, resume.value.text()
    expect(badge(page)).to_have_text(re.compile("starting|running"))
    expect(badge(page)).to_have_text("running", timeout=300_000)
    last_step = lambda: ui.run("long-one")["step"]  # noqa: E731
    deadline = time.time() + 300
    while last_step() <= step + 2 and time.time() < deadline:
        time.sleep(1)
    assert last_step() > step + 2
    launcher_log = (ui.runs / "long-one" / "logs" / "launcher.log").read_text()
    assert f"resuming {ui.runs / 'long-one'} from {checkpoint}" in launcher_log

    # The CLI companion stops it too.
    result = subprocess.run(
        [sys.executable, "-m", "zeropipe", "runs", "stop", str(run["id"]), "--runs-dir", str(ui.runs), "--wait", "120"],
        capture_output=True, text=True, timeout=300, cwd=ui.workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "long-one: stopped" in result.stderr
    expect(badge(page)).to_have_text("stopped", timeout=60_000)
    screenshot(page, "10-resumed-then-stopped-from-cli")


def test_compare_overlays_loss_curves(page, ui):
    ids = [ui.run(name)["id"] for name in ("baseline", "sdxl-lora")]
    page.goto(f"{ui.url}/compare?ids={ids[0]},{ids[1]}")
    rows = page.locator("#compare-table tbody tr")
    expect(rows).to_have_count(2)
    expect(rows.nth(0)).to_contain_text("baseline")
    page.wait_for_function("window.zpCharts.compare && window.zpCharts.compare.data.length === 3")
    assert int(page.locator("#compare-chart").get_attribute("data-points")) == 100  # steps 1..100 joined
    screenshot(page, "11-compare")


def test_environment_shows_the_doctor_report(page, ui):
    page.goto(ui.url + "/environment")
    expect(page.locator("#doctor .card").first).not_to_contain_text("checking", timeout=120_000)
    report = page.locator("#doctor")
    expect(report).to_contain_text(re.compile(r"GPUs|doctor unavailable"))
    screenshot(page, "12-environment")
