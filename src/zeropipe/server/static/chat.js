// Chat page: a conversation with a run's checkpoint or export. The history lives in this page and is
// sent whole with each turn; the server renders it with the run's chat template.
"use strict";
(function () {
  const { el, api } = ZP;
  const runSelect = document.getElementById("chat-run");
  const sourceSelect = document.getElementById("chat-source");
  const log = document.getElementById("chat-log");
  const input = document.getElementById("chat-input");
  const send = document.getElementById("chat-send");
  const status = document.getElementById("chat-status");
  const messageBox = document.getElementById("chat-message");
  const deviceBox = document.getElementById("chat-device");
  const turnsBox = document.getElementById("chat-turns");
  const MAX_TURNS = 40;
  const wanted = new URLSearchParams(location.search).get("run");
  let history = []; // [{role, content}], oldest first: what the next turn sends

  async function loadRuns() {
    const { runs } = await api("/api/runs");
    // Diffusion runs draw pictures (their gallery, the Draw page); they do not answer.
    const usable = runs.filter((r) => r.state !== "starting" && !r.has_samples);
    runSelect.replaceChildren(...usable.map((r) => el("option", { value: r.id }, `${r.name} (${r.state})`)));
    if (!usable.length) runSelect.append(el("option", { value: "" }, "no language-model run yet"));
    if (wanted && usable.some((r) => String(r.id) === wanted)) runSelect.value = wanted;
    await loadSources();
  }

  async function loadSources() {
    sourceSelect.replaceChildren();
    if (!runSelect.value) return;
    const detail = await api(`/api/runs/${runSelect.value}`);
    const complete = detail.checkpoints.filter((c) => c.complete);
    const exports = detail.exports.filter((e) => e.state === "done");
    sourceSelect.append(
      ...complete.map((c) => el("option", { value: `checkpoint:${c.tag}` }, `checkpoint ${c.tag}${c.latest ? " (latest)" : ""}`)),
      ...exports.map((e) => el("option", { value: `export:${e.out_path.split("/").pop()}` }, `export ${e.out_path.split("/").pop()}${e.merge ? " (merged)" : ""}`))
    );
    if (!sourceSelect.options.length) sourceSelect.append(el("option", { value: "" }, "no complete checkpoint or export yet"));
    send.disabled = !sourceSelect.value;
  }

  async function showDevice() {
    const state = await api("/api/model");
    const idle = ZP.fmtDuration(state.idle_seconds);
    deviceBox.textContent = state.loaded
      ? `loaded: ${state.loaded} on ${state.device} (${state.device_reason}); let go after ${idle} idle`
      : `a model loads on ${state.device} (${state.device_reason}) and is let go after ${idle} idle`;
  }

  function numberOf(id) {
    const text = document.getElementById(id).value.trim();
    return text === "" ? null : Number(text);
  }

  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const event = (block.match(/^event: (.*)$/m) || [])[1];
        const data = (block.match(/^data: (.*)$/m) || [])[1];
        if (event && data) yield { event, data: JSON.parse(data) };
      }
    }
  }

  function bubble(role, text) {
    const body = el("div", { class: "turn-text" }, text);
    const meta = el("div", { class: "turn-meta" });
    const node = el("div", { class: `turn ${role}`, dataset: { role } }, body, meta);
    log.append(node);
    log.scrollTop = log.scrollHeight;
    return { node, body, meta };
  }

  function countTurns() {
    const turns = history.filter((m) => m.role === "user").length;
    turnsBox.textContent = turns ? `${turns} turn${turns > 1 ? "s" : ""} (at most ${MAX_TURNS})` : "";
  }

  async function sendTurn() {
    const text = input.value.trim();
    if (!text) return ZP.message(messageBox, "Write a message first.", "error");
    if (history.filter((m) => m.role === "user").length >= MAX_TURNS) return ZP.message(messageBox, `A conversation holds at most ${MAX_TURNS} turns: start a new chat.`, "error");
    const [kind, name] = sourceSelect.value.split(/:(.*)/s);
    const messages = [...history, { role: "user", content: text }];
    const body = {
      run_id: Number(runSelect.value),
      system: document.getElementById("chat-system").value,
      messages,
      max_new_tokens: numberOf("chat-max-new-tokens"),
      temperature: numberOf("chat-temperature") ?? 0,
      top_p: numberOf("chat-top-p") ?? 1,
      seed: numberOf("chat-seed") ?? 0,
      image: document.getElementById("chat-image").value.trim() || null,
      ...(kind === "export" ? { export: name } : { checkpoint: name }),
    };
    ZP.message(messageBox, "");
    const asked = bubble("user", text);
    const answer = bubble("assistant", "");
    answer.node.dataset.state = "running";
    answer.meta.textContent = "loading the model…";
    send.disabled = true;
    status.textContent = "answering…";
    let output = "";
    try {
      const response = await fetch("/api/chat", { method: "POST", headers: { "Content-Type": "application/json", Accept: "text/event-stream" }, body: JSON.stringify(body) });
      if (!response.ok) {
        const data = await response.json().catch(() => ({ detail: response.statusText }));
        throw Object.assign(new Error(data.detail || `HTTP ${response.status}`), { status: response.status, data });
      }
      for await (const { event, data } of events(response)) {
        if (event === "source") answer.meta.textContent = `${data.source} on ${data.device}`;
        else if (event === "token") {
          output += data.text;
          answer.body.textContent = output;
        } else if (event === "done") {
          output = data.output;
          answer.body.textContent = output;
          answer.meta.textContent += ` · ${data.prompt_tokens} tokens of conversation read · ${data.seconds} s`;
          answer.node.dataset.promptTokens = String(data.prompt_tokens);
          answer.node.dataset.state = "done";
          // Only an answered turn joins the history: a failed one can be sent again.
          history = [...messages, { role: "assistant", content: output }];
          input.value = "";
        } else if (event === "error") {
          answer.node.dataset.state = "failed";
          answer.node.append(el("div", { class: "message error" }, data.detail));
        }
      }
    } catch (error) {
      answer.node.dataset.state = "failed";
      answer.node.append(ZP.errorBox(error));
    } finally {
      if (answer.node.dataset.state === "running") answer.node.dataset.state = "failed";
      if (answer.node.dataset.state === "failed") asked.node.classList.add("unsent");
      send.disabled = !sourceSelect.value;
      status.textContent = "";
      countTurns();
      showDevice().catch(() => {});
    }
  }

  function newChat() {
    history = [];
    log.replaceChildren();
    ZP.message(messageBox, "");
    countTurns();
  }

  runSelect.addEventListener("change", () => {
    newChat();
    loadSources().catch((e) => ZP.message(messageBox, e.message));
  });
  sourceSelect.addEventListener("change", newChat);
  send.addEventListener("click", sendTurn);
  document.getElementById("chat-new").addEventListener("click", newChat);
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) sendTurn();
  });
  loadRuns().catch((error) => ZP.message(messageBox, error.message));
  showDevice().catch((error) => (deviceBox.textContent = error.message));
})();
