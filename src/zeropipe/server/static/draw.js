// Draw page: pictures (clips for video models) from a diffusion run's checkpoint or export, kept with the run.
"use strict";
(function () {
  const { el, api } = ZP;
  const runSelect = document.getElementById("draw-run");
  const sourceSelect = document.getElementById("draw-source");
  const results = document.getElementById("draw-results");
  const go = document.getElementById("draw-go");
  const status = document.getElementById("draw-status");
  const message = document.getElementById("draw-message");
  const deviceBox = document.getElementById("draw-device");
  const wanted = new URLSearchParams(location.search).get("run");
  const cancel = document.getElementById("draw-cancel");
  const progress = document.getElementById("draw-progress");
  const number = (id) => Number(document.getElementById(id).value);
  let drawingNow = null; // the AbortController of the drawing in flight: Cancel (or leaving the page) ends the request, and the server stops at its next step

  async function loadRuns() {
    const { runs } = await api("/api/draw/runs"); // diffusion runs only: a language model does not draw
    ZP.fillRuns(runSelect, runs, "no diffusion run yet", wanted);
    await loadSources();
  }

  async function loadSources() {
    results.replaceChildren();
    if (!runSelect.value) return;
    // The run's own resolution, sample steps and guidance (what its samples were drawn with), set before the weights are offered.
    const { draws, defaults } = await api(`/api/runs/${runSelect.value}/draws`);
    for (const key of ["width", "height", "steps", "guidance"]) document.getElementById(`draw-${key}`).value = defaults[key];
    if (!(await ZP.fillSources(sourceSelect, runSelect.value))) return;
    go.disabled = !sourceSelect.value;
    results.replaceChildren(...draws.map(drawing));
  }

  async function showDevice() {
    const state = await api("/api/model");
    const idle = ZP.fmtDuration(state.idle_seconds);
    deviceBox.textContent = state.loaded
      ? `loaded: ${state.loaded} on ${state.device} (${state.device_reason}); let go after ${idle} idle`
      : `a model loads on ${state.device} (${state.device_reason}) and is let go after ${idle} idle`;
  }

  function drawing(d) {
    const base = `/api/runs/${runSelect.value}/draws/${d.name}`;
    const media = d.files.map((f) =>
      f.kind === "video"
        ? el("a", { href: `${base}/${f.file}`, target: "_blank", title: "audio_dbfs" in f ? "the mp4 clip with its sound, full size" : "the mp4 clip, full size" }, el("img", { src: `${base}/${f.preview}`, alt: d.prompt, class: "drawn" }))
        : el("a", { href: `${base}/${f.file}`, target: "_blank", title: "full size" }, el("img", { src: `${base}/${f.file}`, alt: d.prompt, class: "drawn" }))
    );
    const settings = `${d.width}×${d.height}${d.frames ? ` · ${d.frames} frames` : ""} · ${d.steps} steps · guidance ${d.guidance} · seed ${d.seed}`;
    return el(
      "figure",
      { class: "drawing", dataset: { name: d.name } },
      media,
      el("figcaption", {}, el("div", { class: "drawing-prompt" }, d.prompt), el("div", { class: "small muted" }, settings), el("div", { class: "small muted" }, `${d.weights} on ${d.device} · ${d.seconds} s`))
    );
  }

  async function drawNow() {
    const prompt = document.getElementById("draw-prompt").value.trim();
    if (!prompt) return ZP.message(message, "Write a prompt first.");
    const [kind, name] = sourceSelect.value.split(/:(.*)/s);
    const frames = document.getElementById("draw-frames").value.trim();
    const body = {
      run_id: Number(runSelect.value),
      prompt,
      negative_prompt: document.getElementById("draw-negative").value.trim(),
      width: number("draw-width"),
      height: number("draw-height"),
      steps: number("draw-steps"),
      guidance: number("draw-guidance"),
      seed: number("draw-seed"),
      frames: frames === "" ? null : Number(frames),
      ...(kind === "export" ? { export: name } : { checkpoint: name }),
    };
    ZP.message(message, "");
    go.disabled = true;
    cancel.hidden = progress.hidden = false;
    cancel.style.display = progress.style.display = "";
    progress.removeAttribute("value"); // loading: no step yet
    status.textContent = "loading the model…";
    drawingNow = new AbortController();
    const poll = setInterval(() => showProgress().catch(() => {}), 500);
    try {
      const d = await api("/api/draw", { method: "POST", body, signal: drawingNow.signal });
      results.prepend(drawing(d));
    } catch (error) {
      if (error.name === "AbortError") ZP.message(message, "Cancelled: the drawing stopped at its next step.");
      else message.replaceChildren(ZP.errorBox(error));
    } finally {
      clearInterval(poll);
      drawingNow = null;
      go.disabled = !sourceSelect.value;
      cancel.hidden = progress.hidden = true;
      cancel.style.display = progress.style.display = "none"; // a button's display rule would show it despite hidden
      status.textContent = "";
      showDevice().catch(() => {});
    }
  }

  async function showProgress() {
    const { busy } = await api("/api/model");
    if (!drawingNow || !busy || busy.kind !== "draw" || busy.step === null) return;
    progress.max = busy.steps;
    progress.value = busy.step;
    status.textContent = `step ${busy.step} of ${busy.steps} · ${ZP.fmtDuration(busy.seconds)}`;
  }

  cancel.addEventListener("click", () => drawingNow && drawingNow.abort());
  runSelect.addEventListener("change", () => loadSources().catch((e) => ZP.message(message, e.message)));
  go.addEventListener("click", drawNow);
  loadRuns().catch((error) => ZP.message(message, error.message));
  showDevice().catch((error) => (deviceBox.textContent = error.message));
})();
