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
    for key in [
        "run-name",
        "model-path",
        "data-path",
        "train-max_steps",
        "train-micro_batch_size",
        "train-lr",
        "hardware-gpus",
        "deepspeed-zero_stage",
        "deepspeed-offload_optimizer",
    ]:
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


# ------------------------------------------------------------------ a real trained run for the pages that need weights
TRAINED_CONFIG = {
    "run": {"name": "trained", "seed": 7},
    "model": {
        "config": {
            "model_type": "llama",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        }
    },
    "data": {"synthetic": {"task": "arithmetic", "examples": 400}, "max_seq_len": 32, "eval_fraction": 0.1},
    "train": {"max_steps": 12, "micro_batch_size": 8, "lr": 0.01, "warmup_steps": 2, "save_every": 6},
    "deepspeed": {"zero_stage": 2, "precision": "fp32"},
    "hardware": {"gpus": 2},
}


@pytest.fixture(scope="module")
def trained(ui):
    """A tiny real run (2 CPU ranks, fp32, 12 steps: about 30 s), trained by `zeropipe train` into the UI's runs folder."""
    import os
    import subprocess
    import sys
    import time

    config = json_copy(TRAINED_CONFIG)
    config["run"]["output_dir"] = str(ui.runs)
    path = ui.workdir / "trained.yaml"
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ)
    env.pop("DS_ACCELERATOR", None)
    done = subprocess.run(
        [sys.executable, "-m", "zeropipe", "train", str(path)], cwd=ui.workdir, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    deadline = time.time() + 60
    while time.time() < deadline:
        runs = [r for r in ui.api("/api/runs")["runs"] if r["name"] == "trained" and r["state"] == "completed"]
        if runs:
            return runs[0]
        time.sleep(0.5)
    raise AssertionError("the UI did not index the trained run")


def json_copy(value):
    import json

    return json.loads(json.dumps(value))


# ------------------------------------------------------------------ run management
def test_delete_a_run_with_its_checkpoints_after_confirming(page, ui):
    write_run(ui.runs, "to-delete", steps=12, checkpoints=(6, 12))
    page.goto(ui.url + "/")
    row = page.locator("#runs tbody tr", has_text="to-delete")
    expect(row).to_have_count(1, timeout=30_000)
    row.locator("a").first.click()
    dialogs = []
    page.on("dialog", lambda d: dialogs.append(d.message))
    page.click("#delete")
    expect(page).to_have_url(ui.url + "/", timeout=30_000)
    assert dialogs and "2 checkpoint(s)" in dialogs[0] and "cannot be undone" in dialogs[0]
    expect(page.locator("#deleted-message")).to_contain_text("Run to-delete was deleted")
    expect(page.locator("#runs tbody tr", has_text="to-delete")).to_have_count(0)
    assert not (ui.runs / "to-delete").exists()
    screenshot(page, "23-run-deleted", full_page=False)


def test_rename_a_run(page, ui):
    write_run(ui.runs, "first-try", steps=12, checkpoints=(12,))
    deadline_ok = False
    for _ in range(150):
        if any(r["name"] == "first-try" for r in ui.api("/api/runs")["runs"]):
            deadline_ok = True
            break
        page.wait_for_timeout(200)
    assert deadline_ok
    run = ui.run("first-try")
    page.goto(f"{ui.url}/runs/{run['id']}")
    page.click("#rename")
    page.fill("#rename-name", "lr-sweep-1")
    page.click("#rename-save")
    expect(page.locator("#run-name")).to_contain_text("lr-sweep-1")
    expect(page.locator("#action-message")).to_contain_text("the run is now lr-sweep-1")
    assert (ui.runs / "lr-sweep-1" / "checkpoints").is_dir() and not (ui.runs / "first-try").exists()
    assert yaml.safe_load((ui.runs / "lr-sweep-1" / "config.yaml").read_text())["run"]["name"] == "lr-sweep-1"


def test_export_a_trained_run_and_download_the_archive(page, ui, trained, tmp_path):
    import tarfile

    page.goto(f"{ui.url}/runs/{trained['id']}")
    page.fill("#export-name", "hf")
    page.click("#export")
    row = page.locator("#exports tbody tr", has_text="hf")
    expect(row.locator(".badge")).to_have_text("completed", timeout=300_000)
    # The message follows the export: no stale "Exporting…" once it is done.
    expect(page.locator("#export-message")).to_contain_text("Exported step_00000012")
    expect(page.locator("#export-message")).not_to_contain_text("Exporting")
    with page.expect_download() as download:
        row.locator("a.download").click()
    saved = tmp_path / download.value.suggested_filename
    download.value.save_as(saved)
    assert saved.name == "trained-hf.tar"
    with tarfile.open(saved) as archive:
        names = archive.getnames()
    exported = ui.runs / "trained" / "exports" / "hf"
    assert "trained-hf/config.json" in names and any(n.endswith(".safetensors") for n in names)
    assert len(names) == sum(1 for p in exported.rglob("*") if p.is_file())
    screenshot(page, "24-export-downloaded", full_page=False)


# ------------------------------------------------------------------ dataset preview
def test_preview_a_dataset_with_a_broken_record(page, ui):
    import json

    lines = [json.dumps({"instruction": f"What is {i} + 1?", "input": "", "output": str(i + 1)}) for i in range(30)]
    lines.insert(2, '{"instruction": "half a record", ')
    (ui.data / "broken.jsonl").write_text("\n".join(lines) + "\n")
    page.goto(ui.url + "/new")
    expect(page.locator("#check-status")).to_have_text(re.compile("ready to launch|problem"), timeout=120_000)
    raw = yaml_of(page)
    raw["data"] = {"path": str(ui.data / "broken.jsonl"), "max_seq_len": 32}
    page.locator("#yaml").fill(yaml.safe_dump(raw))
    expect(page.locator("#field-data-path")).to_have_value(str(ui.data / "broken.jsonl"))
    page.click("#preview-data")
    examples = page.locator("#preview .example")
    expect(examples.first).to_be_visible(timeout=120_000)
    expect(page.locator("#preview")).to_contain_text("alpaca (detected)")
    first = examples.first
    expect(first.locator(".prompt")).to_contain_text("What is 0 + 1?")
    expect(first.locator(".learned")).to_contain_text("1")
    expect(page.locator("#skipped")).to_contain_text("line 3")
    expect(page.locator("#skipped")).to_contain_text("not valid JSON")
    expect(page.locator("#preview-verdict")).to_contain_text("the run would refuse to start: 1 of 31 records")
    page.locator("#preview-card").scroll_into_view_if_needed()
    screenshot(page, "25-data-preview", full_page=False)


def test_preview_the_images_of_a_diffusion_example(page, ui):
    page.goto(ui.url + "/new")
    page.wait_for_selector("#preset option[value='example:diffusion-quickstart']", state="attached")
    page.select_option("#preset", "example:diffusion-quickstart")
    expect(page.locator("#yaml")).to_have_value(re.compile("tiny-sdxl"))
    page.click("#preview-data")
    thumbs = page.locator("#preview figure.thumb")
    expect(thumbs.first).to_be_visible(timeout=120_000)
    assert thumbs.count() == 10
    expect(thumbs.first.locator("figcaption")).to_contain_text(re.compile(r"on a .* background"))
    expect(thumbs.first.locator("figcaption")).to_contain_text("bucket")
    assert thumbs.first.locator("img").evaluate("img => img.complete && img.naturalWidth > 0")
    page.locator("#preview-card").scroll_into_view_if_needed()
    screenshot(page, "26-image-preview", full_page=False)


def test_the_dataset_page_names_a_corrupted_image_as_rejected_with_why(page, ui):
    from PIL import Image

    folder = ui.data / "portraits"
    folder.mkdir()
    for name, size, caption in [("wide.png", (96, 48), "a wide red field"), ("tall.png", (48, 96), "a tall blue tower"), ("square.png", (64, 64), None)]:
        Image.new("RGB", size, (200, 40, 40)).save(folder / name)
        if caption:
            (folder / name).with_suffix(".txt").write_text(caption)
    good = (folder / "wide.png").read_bytes()
    (folder / "broken.png").write_bytes(good[: len(good) // 2])  # cut off mid-file: it does not decode
    Image.new("RGB", (64, 64)).save(ui.workdir / "elsewhere.png")
    (folder / "link.png").symlink_to(ui.workdir / "elsewhere.png")  # leads out of the data folders
    # From the New-run page's preview of a diffusion config on that folder, to the whole folder.
    page.goto(ui.url + "/new")
    page.wait_for_selector("#preset option[value='example:diffusion-quickstart']", state="attached")
    page.select_option("#preset", "example:diffusion-quickstart")
    expect(page.locator("#yaml")).to_have_value(re.compile("tiny-sdxl"))
    raw = yaml_of(page)
    raw["data"] = {"path": str(folder), "images": {"resolution": 64, "bucket_step": 16}}
    page.locator("#yaml").fill(yaml.safe_dump(raw))
    expect(page.locator("#field-data-path")).to_have_value(str(folder))
    page.click("#preview-data")
    page.click("#open-dataset", timeout=120_000)
    expect(page).to_have_url(re.compile(r"/dataset\?path="))
    expect(page.locator("#ds-resolution")).to_have_value("64")
    rejected = page.locator("#ds-rejected tbody tr")
    expect(rejected).to_have_count(2, timeout=60_000)
    expect(page.locator("#ds-rejected tr[data-file='broken.png']")).to_contain_text("cannot be decoded")
    # The Dataset view reads as a confined run does (issue 46): the link is refused unread, with the run's wording.
    expect(page.locator("#ds-rejected tr[data-file='link.png']")).to_contain_text(re.compile(r"outside the folders this (UI|run) may read.*not read"))
    files = page.locator("#ds-files figure.thumb")
    expect(files).to_have_count(3)
    expect(page.locator("#ds-files figure[data-file='tall.png']")).to_contain_text("a tall blue tower")
    expect(page.locator("#ds-files figure[data-file='wide.png']")).to_contain_text("96×48 → bucket 80×48")
    expect(page.locator("#ds-files figure[data-file='square.png']")).to_contain_text("(no caption)")
    expect(page.locator("#ds-buckets tbody tr")).to_have_count(3)
    expect(page.locator("#ds-buckets tr[data-bucket='64x64']")).to_contain_text("1")
    assert page.locator("#ds-files img").first.evaluate("img => img.complete && img.naturalWidth > 0")
    screenshot(page, "52-dataset", full_page=True)
    # A folder outside the folders this UI may read is refused, not listed (the same answer as a missing or hidden one).
    page.fill("#ds-path", "/etc")
    page.click("#ds-open")
    expect(page.locator("#ds-message")).to_contain_text("is not a folder inside the folders this UI may read")


# ------------------------------------------------------------------ generate
def test_generate_from_a_trained_run_and_see_the_answer_stream_in(page, ui, trained):
    page.goto(f"{ui.url}/runs/{trained['id']}")
    page.click("#generate-link")
    expect(page).to_have_url(re.compile(rf"/generate\?run={trained['id']}$"))
    expect(page.locator("#gen-run")).to_have_value(str(trained["id"]))
    expect(page.locator("#gen-source")).to_have_value("checkpoint:step_00000012")
    page.fill("#gen-prompt", "What is 4 + 2?")
    page.fill("#gen-max-new-tokens", "8")
    with page.expect_response(lambda r: r.url.endswith("/api/generate")) as answer:
        page.click("#gen-send")
    entry = page.locator("#gen-answers .answer").first
    expect(entry).to_have_attribute("data-state", "done", timeout=180_000)
    expect(entry.locator(".answer-prompt")).to_contain_text("What is 4 + 2?")
    expect(entry).to_contain_text("checkpoint step_00000012 (consolidated) on cpu")
    text = entry.locator(".answer-text").inner_text()
    assert text.strip(), "an answer was written"
    assert "event: done" in answer.value.text()
    # The page's answer is what `zeropipe generate` prints for the same prompt.
    import json as json_module
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("DS_ACCELERATOR", None)
    cli = subprocess.run([sys.executable, "-m", "zeropipe", "generate", str(ui.runs / "trained"), "--prompt", "What is 4 + 2?", "--max-new-tokens", "8", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert json_module.loads(cli.stdout)["generations"][0]["output"] == text.strip()

    # A longer, sampled answer comes in pieces as it is written, not at once at the end.
    page.fill("#gen-temperature", "1.5")
    page.fill("#gen-max-new-tokens", "24")
    with page.expect_response(lambda r: r.url.endswith("/api/generate")) as answer:
        page.click("#gen-send")
    entry = page.locator("#gen-answers .answer").first
    expect(entry).to_have_attribute("data-state", "done", timeout=180_000)
    body = answer.value.text()
    assert body.count("event: token") >= 5, body
    assert int(entry.get_attribute("data-tokens")) == body.count("event: token")
    screenshot(page, "27-generate", full_page=False)


# ------------------------------------------------------------------ chat
def test_chat_with_a_trained_run_remembers_the_earlier_turn(page, ui, trained):
    """Two turns with a system prompt: the second is answered from the whole conversation, rendered with the run's template."""
    import json

    from zeropipe.data.tokenize import render_prompt
    from zeropipe.families import generate, load_model

    page.goto(f"{ui.url}/chat?run={trained['id']}")
    expect(page.locator("#chat-source")).to_have_value("checkpoint:step_00000012")
    # Where the model runs, and why (the Generate test before may have left it loaded: one model is kept).
    expect(page.locator("#chat-device")).to_contain_text(re.compile(r"on (cpu|cuda:\d+) \((no CUDA GPU|a GPU no training rank)"))
    page.fill("#chat-system", "Be brief.")
    page.fill("#chat-max-new-tokens", "4")
    page.fill("#chat-input", "What is 4 + 2?")
    page.click("#chat-send")
    first = page.locator("#chat-log .turn.assistant").nth(0)
    expect(first).to_have_attribute("data-state", "done", timeout=180_000)
    page.fill("#chat-input", "And 5 + 1?")
    with page.expect_request(lambda r: r.url.endswith("/api/chat")) as second_request:
        page.click("#chat-send")
    second = page.locator("#chat-log .turn.assistant").nth(1)
    expect(second).to_have_attribute("data-state", "done", timeout=180_000)
    expect(page.locator("#chat-log .turn.user")).to_have_text(["What is 4 + 2?", "And 5 + 1?"])
    expect(page.locator("#chat-turns")).to_contain_text("2 turns")
    expect(second).to_contain_text("checkpoint step_00000012 (consolidated) on cpu")
    expect(page.locator("#chat-device")).to_contain_text("let go after 5m 0s idle")
    first_answer = first.locator(".turn-text").inner_text()
    # The page sent the earlier turn, its answer and the system prompt with the new question...
    sent = json.loads(second_request.value.post_data)
    assert sent["system"] == "Be brief."
    assert sent["messages"] == [
        {"role": "user", "content": "What is 4 + 2?"},
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "And 5 + 1?"},
    ]
    # ...and the model read all of it: the conversation's length rendered with the run's template, and the same answer.
    conversation = [{"role": "system", "content": sent["system"]}, *sent["messages"]]
    loaded = load_model(ui.runs / "trained", device="cpu")
    assert int(second.get_attribute("data-prompt-tokens")) == len(render_prompt(loaded.tokenizer, conversation))
    assert int(second.get_attribute("data-prompt-tokens")) > int(first.get_attribute("data-prompt-tokens"))
    expected = generate(loaded, [conversation], max_new_tokens=4)[0]
    assert second.locator(".turn-text").inner_text() == expected.output
    screenshot(page, "51-chat", full_page=False)
    # The tiny model reads 64 positions: a turn that would not fit is refused with what to do, and not kept.
    page.fill("#chat-input", "And now what is 7 + 1 and 9 + 3 and 8 + 8?")
    page.click("#chat-send")
    third = page.locator("#chat-log .turn.assistant").nth(2)
    expect(third).to_have_attribute("data-state", "failed", timeout=180_000)
    expect(third).to_contain_text("the model reads at most 64: start a new conversation")
    # New chat forgets: the next turn is sent alone.
    page.click("#chat-new")
    expect(page.locator("#chat-log .turn")).to_have_count(0)
    with page.expect_request(lambda r: r.url.endswith("/api/chat")) as alone:
        page.click("#chat-send")
    assert json.loads(alone.value.post_data)["messages"] == [{"role": "user", "content": "And now what is 7 + 1 and 9 + 3 and 8 + 8?"}]
    expect(page.locator("#chat-log .turn.assistant").first).to_have_attribute("data-state", "done", timeout=180_000)


# ------------------------------------------------------------------ eval
def test_evaluate_a_checkpoint_and_keep_the_result_with_the_run(page, ui, trained):
    import json
    import os
    import subprocess
    import sys

    page.goto(f"{ui.url}/runs/{trained['id']}")
    page.select_option("#eval-checkpoint", "step_00000006")
    page.click("#evaluate")
    row = page.locator("#evaluations tbody tr").first
    expect(row).to_have_attribute("data-state", "done", timeout=300_000)
    expect(row).to_contain_text("step_00000006")
    expect(row).to_contain_text("held-out data")
    shown = float(row.locator(".eval-loss").inner_text())
    kept = json.loads((ui.runs / "trained" / "evals" / "1.json").read_text())
    env = dict(os.environ)
    env.pop("DS_ACCELERATOR", None)
    cli = subprocess.run([sys.executable, "-m", "zeropipe", "eval", str(ui.runs / "trained"), "--checkpoint", "step_00000006", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert json.loads(cli.stdout)["loss"] == pytest.approx(kept["loss"]) and shown == pytest.approx(kept["loss"], rel=1e-3)
    page.reload()  # kept with the run, not only on the page
    expect(page.locator("#evaluations tbody tr").first.locator(".eval-loss")).to_have_text(row.locator(".eval-loss").inner_text())
    page.locator("#evaluations-card").scroll_into_view_if_needed()
    screenshot(page, "28-evaluation", full_page=False)


VLM_CONFIG = {
    "run": {"name": "tiny-vlm", "seed": 42},
    "model": {
        "config": {
            "model_type": "llava",
            "vision_config": {
                "model_type": "clip_vision_model",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "image_size": 32,
                "patch_size": 8,
                "projection_dim": 32,
            },
            "text_config": {
                "model_type": "llama",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 128,
            },
        },
        "tokenizer_vocab_size": 300,
    },
    "data": {"synthetic": {"task": "shapes", "examples": 64}, "max_seq_len": 64},
    "train": {"max_steps": 4, "micro_batch_size": 4, "lr": 0.002},
    "deepspeed": {"zero_stage": 2, "precision": "fp32"},
    "hardware": {"gpus": 2},
    "generate": {"max_new_tokens": 8},
}


def test_ask_a_vision_language_run_about_an_image(page, ui):
    """A tiny LLaVA-style run (4 steps, about 30 s) answers about a picture from its held-out data, as `zeropipe generate --image` does."""
    import json
    import os
    import subprocess
    import sys

    config = json_copy(VLM_CONFIG)
    config["run"]["output_dir"] = str(ui.runs)
    (ui.workdir / "vlm.yaml").write_text(yaml.safe_dump(config))
    env = dict(os.environ)
    env.pop("DS_ACCELERATOR", None)
    done = subprocess.run(
        [sys.executable, "-m", "zeropipe", "train", str(ui.workdir / "vlm.yaml")],
        cwd=ui.workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    image = ui.runs / "tiny-vlm" / "data" / "heldout" / "1_shapes" / "00000.png"
    assert image.is_file()
    page.goto(ui.url + "/generate")
    page.wait_for_selector("#gen-run option:has-text('tiny-vlm')", state="attached", timeout=30_000)
    page.select_option("#gen-run", label=next(o for o in page.locator("#gen-run option").all_inner_texts() if o.startswith("tiny-vlm")))
    expect(page.locator("#gen-source")).to_have_value("checkpoint:step_00000004")
    page.fill("#gen-prompt", "Describe the image.")
    page.fill("#gen-image", str(image))
    page.click("#gen-send")
    entry = page.locator("#gen-answers .answer").first
    expect(entry).to_have_attribute("data-state", "done", timeout=180_000)
    expect(entry.locator(".answer-prompt")).to_contain_text("00000.png")
    shown = entry.locator(".answer-text").inner_text().strip()
    cli = subprocess.run([sys.executable, "-m", "zeropipe", "generate", str(ui.runs / "tiny-vlm"), "--prompt", "Describe the image.", "--image", str(image), "--json"],
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert json.loads(cli.stdout)["generations"][0]["output"] == shown
    # An image outside the runs and data folders is refused with the reason.
    page.fill("#gen-image", "/etc/hostname")
    page.click("#gen-send")
    expect(page.locator("#gen-answers .answer").first).to_contain_text("outside the folders this UI may read")

    # Chat: the picture goes with the first turn; the second turn is answered from both.
    vlm_id = page.locator("#gen-run").input_value()
    page.goto(f"{ui.url}/chat?run={vlm_id}")
    expect(page.locator("#chat-source")).to_have_value("checkpoint:step_00000004")
    page.fill("#chat-image", str(image))
    page.fill("#chat-input", "Describe the image.")
    page.click("#chat-send")
    expect(page.locator("#chat-log .turn.assistant").nth(0)).to_have_attribute("data-state", "done", timeout=180_000)
    assert page.locator("#chat-log .turn.assistant .turn-text").nth(0).inner_text().strip() == shown  # the same first answer as Generate's
    page.fill("#chat-input", "And its colour?")
    page.click("#chat-send")
    second = page.locator("#chat-log .turn.assistant").nth(1)
    expect(second).to_have_attribute("data-state", "done", timeout=180_000)
    assert int(second.get_attribute("data-prompt-tokens")) > int(page.locator("#chat-log .turn.assistant").nth(0).get_attribute("data-prompt-tokens"))


# ------------------------------------------------------- diffusion: sample now, draw
DIFFUSION_CONFIG = {
    "run": {"name": "tiny-diffusion", "seed": 42},
    "model": {"config": {"pipeline": "tiny-sdxl", "vae_fit_steps": 0}},
    "data": {"synthetic": {"task": "shapes", "examples": 16}, "images": {"resolution": 32, "bucket_step": 8}},
    "train": {"max_steps": 400, "micro_batch_size": 4, "lr": 2.0e-3, "warmup_steps": 1, "save_every": 2},
    "deepspeed": {"zero_stage": 2, "precision": "fp32"},
    "hardware": {"gpus": 1},
    "generate": {"prompts": ["a red circle on a blue background"], "sample_steps": 2},
}


def test_sample_a_running_diffusion_run_now_then_draw_from_its_checkpoint(page, ui):
    """One tiny SDXL-layout run (1 CPU rank): samples asked for while it trains, then a picture drawn from its checkpoint."""
    import json

    run = ui.api("/api/runs", {"yaml": yaml.safe_dump(json_copy(DIFFUSION_CONFIG))})["run"]
    run_dir = ui.runs / "tiny-diffusion"
    page.goto(f"{ui.url}/runs/{run['id']}")
    expect(page.locator("#run-name .badge")).to_have_text("running", timeout=300_000)
    expect(page.locator("#checkpoints tbody tr")).not_to_have_count(0, timeout=300_000)
    assert not (run_dir / "samples").exists()  # generate.sample_every is unset: no sample until asked
    page.click("#sample-now")
    expect(page.locator("#action-message")).to_contain_text("every rank draws the samples together at its next step")
    gallery = page.locator("#gallery img")
    expect(gallery.first).to_be_visible(timeout=120_000)
    page.wait_for_function("[...document.querySelectorAll('#gallery img')].every((img) => img.complete && img.naturalWidth === 32)")
    rows = [json.loads(line) for line in (run_dir / "samples" / "index.jsonl").read_text().splitlines()]
    assert [row["prompt"] for row in rows] == ["a red circle on a blue background"]
    assert not (run_dir / "sample_request.json").exists()  # answered: rank 0 removed the request
    page.locator("#gallery-card").scroll_into_view_if_needed()
    screenshot(page, "53-sample-now", full_page=False)
    with page.expect_response(lambda r: r.url.endswith("/stop")):
        page.click("#stop")
    expect(page.locator("#run-name .badge")).to_have_text("stopped", timeout=120_000)

    page.click("#draw-link")
    expect(page).to_have_url(re.compile(rf"/draw\?run={run['id']}$"))
    expect(page.locator("#draw-source")).to_have_value(re.compile(r"^checkpoint:step_\d+$"))
    page.fill("#draw-prompt", "a green square on a white background")
    page.fill("#draw-width", "32")
    page.fill("#draw-height", "48")
    page.fill("#draw-steps", "3")
    page.fill("#draw-seed", "7")
    with page.expect_response(lambda r: r.url.endswith("/api/draw"), timeout=300_000) as answer:
        page.click("#draw-go")
    assert answer.value.status == 200, answer.value.text()
    drawn = page.locator("#draw-results figure.drawing").first
    expect(drawn).to_contain_text("a green square on a white background")
    expect(drawn).to_contain_text("32×48 · 3 steps · guidance 5 · seed 7")
    expect(drawn).to_contain_text(re.compile(r"checkpoint step_\d+ on cpu"))
    page.wait_for_function("(() => { const img = document.querySelector('#draw-results img.drawn'); return img && img.complete && img.naturalWidth === 32 && img.naturalHeight === 48; })()")
    files = list((run_dir / "draws").glob("draw-*/image.png"))
    assert len(files) == 1
    from PIL import Image

    with Image.open(files[0]) as image:
        assert image.size == (32, 48)
    screenshot(page, "54-draw", full_page=False)
    # Kept with the run: the page shows it again after a reload.
    page.reload()
    expect(page.locator("#draw-results figure.drawing")).to_have_count(1)
    # A language-model run does not draw: the page lists diffusion runs only (issue 46; the API refuses it, tests/integration/test_draw.py).
    page.goto(f"{ui.url}/draw?run={ui.run('baseline')['id']}")
    expect(page.locator(f"#draw-run option[value='{run['id']}']")).to_be_attached()
    assert "baseline" not in " ".join(page.locator("#draw-run option").all_inner_texts())
