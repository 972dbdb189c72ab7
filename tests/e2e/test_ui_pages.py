"""The pages added for issue 16 and the page-side fixes, in headless Chromium against a real `zeropipe ui`.

Runs are written as files (tests/e2e/fake_runs.py) except where a page needs real weights.
"""

from __future__ import annotations

import re

import pytest
import yaml
from playwright.sync_api import expect

from tests.e2e.conftest import screenshot
from tests.e2e.fake_runs import live_pid, write_run

pytestmark = pytest.mark.e2e


# ------------------------------------------------------------------ fixes seen from a browser
def test_the_api_docs_render_with_no_internet(page, ui):
    """/docs was blank offline: Swagger UI came from a CDN. Every request off this server is cut here."""
    outside = []

    def only_local(route):
        if route.request.url.startswith(ui.url):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_local)
    page.goto(ui.url + "/docs")
    expect(page.locator(".swagger-ui .opblock").first).to_be_visible(timeout=30_000)
    assert page.locator(".swagger-ui .opblock").count() > 20
    expect(page.locator(".swagger-ui")).to_contain_text("/api/presets")
    assert outside == []
    screenshot(page, "20-api-docs-offline", full_page=False)


def test_an_unknown_run_is_a_page_with_a_way_back(page, ui):
    page.on("response", lambda r: None)
    response = page.goto(ui.url + "/runs/999")
    assert response.status == 404
    page.errors.clear()  # the 404 is the point here
    expect(page.locator("#not-found")).to_contain_text("no run 999")
    page.click("#not-found a")
    expect(page).to_have_url(ui.url + "/")


def test_a_language_model_run_before_its_first_step_has_no_images_per_second(page, ui):
    write_run(ui.runs, "llm-starting", state="running", steps=0, total_steps=100, checkpoints=(), supervisor_pid=live_pid())
    deadline_run = None
    for _ in range(100):
        try:
            deadline_run = ui.run("llm-starting")
            break
        except StopIteration:
            page.wait_for_timeout(200)
    assert deadline_run
    page.goto(f"{ui.url}/runs/{deadline_run['id']}")
    expect(page.locator("#chart-throughput")).to_contain_text("throughput: no data yet")
    expect(page.locator("#chart-throughput")).not_to_contain_text("images/s")


# ------------------------------------------------------------------ start from an example or a past run
def yaml_of(page) -> dict:
    return yaml.safe_load(page.locator("#yaml").input_value())


def test_start_from_an_example_a_past_run_and_a_saved_preset(page, ui):
    page.goto(ui.url + "/new")
    expect(page.locator("#check-status")).to_have_text(re.compile("ready to launch|problem"), timeout=120_000)
    options = page.locator("#preset option")
    labels = [options.nth(i).inner_text() for i in range(options.count())]
    assert {"quickstart", "diffusion-quickstart", "vlm-quickstart", "curriculum"} <= set(labels)
    assert any(label.startswith("baseline (completed") for label in labels)

    page.select_option("#preset", "example:quickstart")
    expect(page.locator("#yaml")).to_have_value(re.compile(r"hidden_size: 128"))
    raw = yaml_of(page)
    assert raw["run"]["name"] == "quickstart" and "output_dir" not in raw["run"] and raw["train"]["max_steps"] == 600
    expect(page.locator("#field-run-name")).to_have_value("quickstart")
    expect(page.locator("#field-train-max_steps")).to_have_value("600")
    expect(page.locator("#check-status")).to_have_text("ready to launch", timeout=120_000)
    screenshot(page, "21-start-from-example", full_page=False)

    # Change it and keep it as a preset...
    page.fill("#field-train-max_steps", "50")
    page.fill("#preset-name", "short-quickstart")
    page.click("#save-preset")
    expect(page.locator("#preset-message")).to_contain_text("Saved as preset short-quickstart")
    assert (ui.runs / ".zeropipe" / "presets" / "short-quickstart.yaml").is_file()
    # ...which the next visit offers.
    page.goto(ui.url + "/new")
    page.wait_for_selector("#preset option[value='saved:short-quickstart']", state="attached")
    page.select_option("#preset", "saved:short-quickstart")
    expect(page.locator("#field-train-max_steps")).to_have_value("50")

    # A past run, from its own page.
    baseline = ui.run("baseline")
    page.goto(f"{ui.url}/runs/{baseline['id']}")
    page.click("#new-from-run")
    expect(page).to_have_url(re.compile(rf"/new\?from=run:{baseline['id']}$"))
    expect(page.locator("#field-run-name")).to_have_value("baseline-2")
    raw = yaml_of(page)
    assert raw["train"]["max_steps"] == 60 and "adam_beta1" not in raw["train"]
    expect(page.locator("#preset-message")).to_contain_text("the run is named baseline-2")


# ------------------------------------------------------------------ the New-run form fits a screen
def test_the_new_run_form_fits_a_screen(browser, ui):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.goto(ui.url + "/new")
    expect(page.locator("#check-status")).to_have_text(re.compile("ready to launch|problem"), timeout=120_000)
    essentials = page.locator("#essentials")
    for key in ["run-name", "model-path", "data-path", "train-max_steps", "train-micro_batch_size", "train-lr", "hardware-gpus", "deepspeed-zero_stage", "deepspeed-offload_optimizer"]:
        expect(essentials.locator(f"#field-{key}")).to_be_visible()
    box = essentials.bounding_box()
    assert box["y"] + box["height"] <= 900 + 100, f"the essentials end at {box['y'] + box['height']:.0f} px"
    plan = page.locator(".card.plan").bounding_box()
    assert plan["x"] > box["x"] + box["width"] - 5 and plan["y"] < 300, "the plan is beside the essentials"
    height = page.evaluate("document.documentElement.scrollHeight")
    assert height < 1500, f"the page is {height} px tall (it was a 6,500-px wall)"
    # Number-or-auto fields are one-line inputs.
    assert page.locator("#field-train-micro_batch_size").evaluate("e => e.tagName + ':' + e.type") == "INPUT:text"
    assert page.locator("#field-hardware-gpus").evaluate("e => e.tagName") == "INPUT"
    # Everything else is one click away, and still edits the YAML.
    expect(page.locator("#field-train-weight_decay")).to_be_hidden()
    screenshot(page, "22-new-run-essentials", full_page=False)
    page.click("#advanced > summary")
    page.click("#advanced details[data-section='train'] > summary")
    page.fill("#field-train-weight_decay", "0.01")
    expect(page.locator("#yaml")).to_have_value(re.compile(r"weight_decay: 0\.01"))
    context.close()
