// Generate page: pick a run and its checkpoint or export, send a prompt, read the answer as it streams in.
"use strict";
(function () {
  const { el, api } = ZP;
  const runSelect = document.getElementById("gen-run");
  const sourceSelect = document.getElementById("gen-source");
  const status = document.getElementById("gen-status");
  const answers = document.getElementById("gen-answers");
  const send = document.getElementById("gen-send");
  const wanted = new URLSearchParams(location.search).get("run");

  async function loadRuns() {
    const { runs } = await api("/api/runs");
    const usable = runs.filter((r) => !["starting"].includes(r.state));
    ZP.fillRuns(runSelect, usable, "no run yet", wanted);
    await loadSources();
  }

  async function loadSources() {
    if (!(await ZP.fillSources(sourceSelect, runSelect.value))) return;
    send.disabled = !sourceSelect.value;
  }

  async function generate() {
    const prompt = document.getElementById("gen-prompt").value.trim();
    if (!prompt) return ZP.message(document.getElementById("gen-message"), "Write a prompt first.", "error");
    const [kind, name] = sourceSelect.value.split(/:(.*)/s);
    const body = {
      run_id: Number(runSelect.value),
      prompt,
      max_new_tokens: ZP.numberOf("gen-max-new-tokens"),
      temperature: ZP.numberOf("gen-temperature") ?? 0,
      top_p: ZP.numberOf("gen-top-p") ?? 1,
      seed: ZP.numberOf("gen-seed") ?? 0,
      raw: document.getElementById("gen-raw").checked,
      image: document.getElementById("gen-image").value.trim() || null,
      ...(kind === "export" ? { export: name } : { checkpoint: name }),
    };
    ZP.message(document.getElementById("gen-message"), "");
    const output = el("pre", { class: "answer-text" });
    const meta = el("div", { class: "small muted" }, "loading the model…");
    const entry = el("div", { class: "answer", dataset: { state: "running" } }, el("div", { class: "answer-prompt" }, el("b", {}, "> "), prompt, body.image ? el("span", { class: "small" }, `  [${body.image}]`) : ""), output, meta);
    answers.prepend(entry);
    send.disabled = true;
    status.textContent = "generating…";
    let tokens = 0;
    try {
      const response = await fetch("/api/generate", { method: "POST", headers: { "Content-Type": "application/json", Accept: "text/event-stream" }, body: JSON.stringify(body) });
      if (!response.ok) {
        const data = await response.json().catch(() => ({ detail: response.statusText }));
        throw Object.assign(new Error(data.detail || `HTTP ${response.status}`), { status: response.status, data });
      }
      for await (const { event, data } of ZP.postEvents(response)) {
        if (event === "source") meta.textContent = `${data.source} on ${data.device}`;
        else if (event === "token") {
          output.textContent += data.text;
          entry.dataset.tokens = String(++tokens);
        } else if (event === "done") {
          output.textContent = data.output;
          meta.textContent += ` · ${data.seconds} s`;
          entry.dataset.state = "done";
        } else if (event === "error") {
          entry.dataset.state = "failed";
          entry.append(el("div", { class: "message error" }, data.detail));
        }
      }
    } catch (error) {
      entry.dataset.state = "failed";
      entry.append(ZP.errorBox(error));
    } finally {
      if (entry.dataset.state === "running") entry.dataset.state = "failed";
      send.disabled = false;
      status.textContent = "";
    }
  }

  runSelect.addEventListener("change", () => loadSources().catch((e) => ZP.message(document.getElementById("gen-message"), e.message)));
  send.addEventListener("click", generate);
  document.getElementById("gen-prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) generate();
  });
  loadRuns().catch((error) => ZP.message(document.getElementById("gen-message"), error.message));
})();
