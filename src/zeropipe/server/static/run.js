// Run page: live charts, logs, diagnosis, checkpoints, stop / resume / export, sample gallery.
"use strict";
(function () {
  const { el, api } = ZP;
  const runId = document.getElementById("run").dataset.runId;
  const base = `/api/runs/${runId}`;
  const ENDED = ["completed", "failed", "stopped", "lost"];

  // Each chart draws the columns whose names match `keys` (exact) or `prefix` (one per rank).
  const CHARTS = {
    // Held-out evaluations (train.eval_every) on the same axes, as points at their steps.
    loss: { title: "loss", keys: ["loss", "eval_loss"], sparse: ["eval_loss"] },
    lr: { title: "learning rate", keys: ["lr"] },
    // Language models report tokens/s; diffusion runs have no tokens and report samples (images)/s.
    // Before the first step the family is not known from the metrics: the title says only "throughput".
    throughput: { title: "throughput (tokens/s)", keys: ["tokens_per_s"], fallback: { title: "throughput (images/s)", keys: ["samples_per_s"] }, empty: "throughput" },
    host_ram: { title: "host RAM per rank (RSS)", prefix: "host_rss_bytes/", format: ZP.fmtBytes },
    gpu: { title: "GPU memory per rank (max allocated)", prefix: "gpu_max_allocated_bytes/", format: ZP.fmtBytes },
    grad_norm: { title: "gradient norm", keys: ["grad_norm"] },
  };
  const charts = {};
  window.zpCharts = charts; // for the browser tests and the curious

  let detail = null;
  let columns = { step: [] }; // step + every metric column, as the page holds them
  let lastStep = 0;
  let source = null;
  let state = null;
  let logName = null;
  let logTimer = null;
  let exportTimer = null;
  let watchedExport = null; // id of the export started from this page
  let detailTimer = null;

  // ------------------------------------------------------------ charts
  function chartKeys(spec) {
    if (spec.keys) return spec.keys.filter((k) => k in columns);
    return Object.keys(columns)
      .filter((k) => k.startsWith(spec.prefix))
      .sort((a, b) => Number(a.split("/")[1]) - Number(b.split("/")[1]));
  }

  function hasValues(keys) {
    return keys.some((k) => columns[k].some((v) => v !== null));
  }

  function drawCharts() {
    for (let [name, spec] of Object.entries(CHARTS)) {
      const empty = spec.empty || spec.title;
      if (spec.fallback && !hasValues(chartKeys(spec))) spec = spec.fallback;
      const container = document.querySelector(`[data-chart="${name}"]`);
      const keys = chartKeys(spec);
      const hasData = keys.some((k) => columns[k].some((v) => v !== null));
      if (name === "gpu") container.hidden = !hasData;
      if (!hasData) {
        const text = `${empty}: no data yet`;
        const shown = container.querySelector(".empty");
        if (!shown || shown.textContent !== text) container.replaceChildren(el("div", { class: "empty" }, text));
        container.dataset.points = "0";
        delete charts[name];
        continue;
      }
      let chart = charts[name];
      if (!chart || chart.keys.join() !== keys.join()) {
        container.replaceChildren();
        const labels = spec.prefix ? keys.map((k) => `rank ${k.split("/")[1]}`) : keys;
        chart = new ZP.Chart(container, { title: spec.title, labels, format: spec.format, sparse: spec.sparse });
        chart.keys = keys;
        charts[name] = chart;
      }
      chart.set(columns.step, keys.map((k) => columns[k]));
    }
  }

  function chartWidth() {
    return Math.max(300, document.getElementById("chart-loss").clientWidth || 600);
  }

  async function loadMetrics() {
    const data = await api(`${base}/metrics?width=${chartWidth()}`);
    columns = { step: data.step, ...data.series };
    lastStep = data.step.length ? data.step[data.step.length - 1] : 0;
    drawCharts();
  }

  function appendMetrics(window_) {
    // A reconnected stream resends from where it started: keep only steps we do not have.
    const fresh = window_.step.map((s, i) => [s, i]).filter(([s]) => s > lastStep);
    if (!fresh.length) return;
    const n = columns.step.length;
    for (const key of Object.keys(window_.series)) if (!(key in columns)) columns[key] = new Array(n).fill(null);
    for (const [s, i] of fresh) {
      columns.step.push(s);
      for (const key of Object.keys(columns)) {
        if (key === "step") continue;
        const values = window_.series[key];
        columns[key].push(values ? values[i] : null);
      }
    }
    lastStep = columns.step[columns.step.length - 1];
    drawCharts();
  }

  function mergeEvals(evals) {
    // Evaluations arrive after their step's row: put each on its step.
    const n = columns.step.length;
    const at = new Map(columns.step.map((s, i) => [s, i]));
    for (const key of Object.keys(evals)) {
      if (key === "step") continue;
      if (!(key in columns)) columns[key] = new Array(n).fill(null);
      evals.step.forEach((s, i) => {
        if (at.has(s)) columns[key][at.get(s)] = evals[key][i];
      });
    }
    drawCharts();
  }

  // -------------------------------------------------------------- head
  function renderHead(run) {
    document.getElementById("run-name").replaceChildren(run.name, " ", ZP.badge(run.state));
    document.title = `${run.name} · ZeRO-Pipe`;
    const fact = (label, value) => el("span", {}, `${label} `, el("b", {}, value));
    document.getElementById("facts").replaceChildren(
      fact("step", run.total_steps ? `${run.step} / ${run.total_steps}` : `${run.step}`),
      fact("ETA", ZP.fmtDuration(run.eta_s)),
      fact("loss", `${ZP.fmtNumber(run.first_loss)} → ${ZP.fmtNumber(run.last_loss)}`),
      fact("step time", run.step_time_s ? `${ZP.fmtNumber(run.step_time_s, 3)} s` : "–"),
      fact("ranks", run.world_size ? `${run.world_size} × ${run.accelerator}${runNodes().length ? ` on ${runNodes().length} nodes` : ""}` : "–"),
      fact("ZeRO", run.zero_stage ?? "–"),
      fact("started", ZP.fmtTime(run.first_started_at || run.started_at || run.created_at)),
      run.started_at && run.first_started_at && run.started_at - run.first_started_at > 60 ? fact("resumed", ZP.fmtTime(run.started_at)) : "",
      fact("duration", ZP.fmtDuration(run.duration_s)),
      run.ended_at ? fact("ended", ZP.fmtTime(run.ended_at)) : ""
    );
    renderActions(run);
    renderDiagnosis(run);
  }

  function renderActions(run) {
    const actions = document.getElementById("actions");
    const buttons = [];
    if (["running", "starting", "stopping"].includes(run.state)) {
      buttons.push(el("button", { class: "danger", id: "stop", disabled: run.state === "stopping", onclick: stopRun }, run.state === "stopping" ? "Stopping…" : "Stop"));
    }
    if (run.state === "running") {
      buttons.push(el("button", { id: "sample-now", onclick: sampleNow, title: "every rank draws the run's samples (a diffusion run's images, a language model's answers) at its next step, with the current weights" }, "Sample now"));
    }
    const complete = (detail ? detail.checkpoints : []).filter((c) => c.complete && (!run.total_steps || c.step < run.total_steps));
    if (ENDED.includes(run.state) && complete.length) {
      const select = el("select", { id: "resume-checkpoint", "aria-label": "checkpoint to resume from" }, complete.map((c) => el("option", { value: c.tag }, `${c.tag}${c.latest ? " (latest)" : ""}`)));
      // The rank count to resume on: the checkpoint's by default; another one is converted to a
      // universal checkpoint and keeps the global batch (the server refuses counts that cannot).
      const savedRanks = () => (complete.find((c) => c.tag === select.value) || {}).world_size || run.world_size || 1;
      const ranks = el("input", { id: "resume-ranks", type: "number", min: 1, step: 1, value: savedRanks(), style: "width: 4.5em", "aria-label": "ranks to resume on",
        title: "ranks (GPUs) to resume on; another count than the checkpoint's keeps the global batch by recomputing the accumulation" });
      select.addEventListener("change", () => { ranks.value = savedRanks(); });
      const gpus = () => (/^[0-9]+$/.test(ranks.value) ? Number(ranks.value) : ranks.value === "" ? null : ranks.value);
      buttons.push(select, el("label", { for: "resume-ranks" }, "on"), ranks, el("span", {}, "ranks"), el("button", { class: "primary", id: "resume", onclick: () => resumeRun(select.value, gpus()) }, "Resume"));
    }
    // The server says what this run's family can do (a diffusion model answers no prompts).
    const generate = (detail && detail.actions && detail.actions.generate) || { available: true };
    if ((detail ? detail.checkpoints : []).some((c) => c.complete) && generate.available) buttons.push(el("a", { class: "button", id: "generate-link", href: `/generate?run=${run.id}` }, "Generate"));
    if ((detail ? detail.checkpoints : []).some((c) => c.complete) && generate.available) buttons.push(el("a", { class: "button", id: "chat-link", href: `/chat?run=${run.id}` }, "Chat"));
    const drawing = (detail && detail.actions && detail.actions.draw) || { available: false };
    if ((drawing.available || run.has_samples) && (detail ? detail.checkpoints : []).some((c) => c.complete)) buttons.push(el("a", { class: "button", id: "draw-link", href: `/draw?run=${run.id}` }, "Draw"));
    buttons.push(el("a", { class: "button", id: "new-from-run", href: `/new?from=run:${run.id}`, title: "a new run with this run's config" }, "New run from this config"));
    if (ENDED.includes(run.state)) {
      buttons.push(el("button", { id: "rename", onclick: () => showRename(run) }, "Rename"));
      buttons.push(el("button", { class: "danger", id: "delete", onclick: () => deleteRun(run) }, "Delete"));
    }
    actions.replaceChildren(...buttons);
  }

  function renderDiagnosis(run) {
    const box = document.getElementById("diagnosis");
    const diagnosis = (detail && detail.status && detail.status.diagnosis) || run.diagnosis;
    const show = ["failed", "lost"].includes(run.state) && diagnosis;
    box.hidden = !show;
    if (show) document.getElementById("diagnosis-text").replaceChildren(...[].concat(ZP.rich(diagnosis.text || JSON.stringify(diagnosis, null, 2))));
  }

  function say(text, kind = "ok") {
    ZP.message(document.getElementById("action-message"), text, kind);
  }

  async function stopRun() {
    if (!confirm("Stop this run? Every rank is stopped; resume later from its last checkpoint.")) return;
    try {
      const data = await api(`${base}/stop`, { method: "POST", body: {} });
      say("Stop sent: the launcher is stopping every rank.", "info");
      onRun(data.run);
    } catch (error) {
      document.getElementById("action-message").replaceChildren(ZP.errorBox(error));
    }
  }

  async function sampleNow() {
    try {
      const data = await api(`${base}/sample`, { method: "POST", body: {} });
      say(
        data.already_pending
          ? "Samples were already asked for: the ranks draw them at their next step."
          : `Asked at step ${data.step}: every rank draws the samples together at its next step; they appear below.`,
        "info"
      );
    } catch (error) {
      document.getElementById("action-message").replaceChildren(ZP.errorBox(error));
    }
  }

  function showRename(run) {
    const input = el("input", { id: "rename-name", type: "text", value: run.name, size: 24, "aria-label": "new name" });
    const box = document.getElementById("action-message");
    const submit = async () => {
      try {
        const data = await api(`${base}/rename`, { method: "POST", body: { name: input.value.trim() } });
        say(`Renamed: the run is now ${data.run.name}, in ${data.run.path}.`, "ok");
        onRun(data.run);
        loadDetail();
      } catch (error) {
        box.replaceChildren(ZP.errorBox(error));
      }
    };
    input.addEventListener("keydown", (event) => event.key === "Enter" && submit());
    box.replaceChildren(el("div", { class: "toolbar" }, "New name:", input, el("button", { class: "primary", id: "rename-save", onclick: submit }, "Rename"), el("button", { onclick: () => box.replaceChildren() }, "Cancel")));
    input.focus();
    input.select();
  }

  async function deleteRun(run) {
    const checkpoints = detail ? detail.checkpoints : [];
    const bytes = checkpoints.reduce((n, c) => n + (c.size_bytes || 0), 0);
    const exports = detail ? detail.exports.length : 0;
    const what = [`its ${checkpoints.length} checkpoint(s) (${ZP.fmtBytes(bytes)})`, `${exports} export(s)`, "its logs and metrics"].join(", ");
    if (!confirm(`Delete run ${run.name} with ${what}?\n\n${run.path} is removed from the disk. This cannot be undone.`)) return;
    try {
      await api(base, { method: "DELETE", body: { confirm: run.name } });
      location.href = `/?deleted=${encodeURIComponent(run.name)}`;
    } catch (error) {
      document.getElementById("action-message").replaceChildren(ZP.errorBox(error));
    }
  }

  async function resumeRun(tag, gpus) {
    // Resuming from an older checkpoint sets the newer ones aside: say so and ask first.
    const chosen = (detail ? detail.checkpoints : []).find((c) => c.tag === tag);
    const newer = (detail ? detail.checkpoints : []).filter((c) => chosen && c.step > chosen.step);
    const aside = newer.length
      ? `\n\n${newer.length} newer checkpoint${newer.length === 1 ? "" : "s"} (${newer.map((c) => c.tag).join(", ")}) will be moved aside into checkpoints/superseded-DATE (not deleted), and the metrics after step ${chosen.step} dropped.`
      : "";
    if (!confirm(`Resume ${detail ? detail.run.name : "this run"} from ${tag}${gpus ? ` on ${gpus} rank${gpus === 1 ? "" : "s"}` : ""}?${aside}`)) return;
    try {
      const data = await api(`${base}/resume`, { method: "POST", body: { checkpoint: tag, gpus, confirm: true } });
      say(`Resuming from ${tag}${gpus ? ` on ${gpus} rank${gpus === 1 ? "" : "s"}` : ""}.`, "info");
      onRun(data.run);
      follow();
    } catch (error) {
      document.getElementById("action-message").replaceChildren(ZP.errorBox(error));
    }
  }

  // ------------------------------------------------------------ detail
  async function loadDetail() {
    clearTimeout(detailTimer);
    detail = await api(base);
    // New checkpoints appear while a run trains: look again every few seconds until it ends.
    if (!ENDED.includes(detail.run.state)) detailTimer = setTimeout(() => loadDetail().catch(() => {}), 5000);
    state = detail.run.state;
    renderHead(detail.run);
    renderProgress();
    renderCheckpoints();
    renderExports();
    renderEvaluations();
    renderNodes();
    renderLogTabs();
    renderGenerations();
    renderCompletions();
    const paths = [`run directory: ${detail.run.path}`];
    if (detail.tensorboard) paths.push(`TensorBoard: tensorboard --logdir ${detail.run.path}`);
    document.getElementById("paths").textContent = paths.join(" · ");
    if (detail.run.has_samples) loadGallery();
  }

  // Before its first step a run prepares (a diffusion run builds its pipeline, fills its
  // caches): say what it is doing instead of showing nothing for minutes.
  function renderProgress() {
    const box = document.getElementById("progress");
    const progress = detail.progress;
    box.hidden = !progress;
    if (!progress) return;
    const count = progress.total ? ` ${progress.done ?? 0} of ${progress.total}` : "";
    const ago = Math.max(0, Math.round(Date.now() / 1000 - progress.at));
    box.replaceChildren(el("span", { class: "badge state-starting" }, "preparing"), " ", `${progress.phase}${count}`, el("span", { class: "muted" }, ` (${ago} s ago)`));
  }

  function renderCheckpoints() {
    const rows = detail.checkpoints.map((c) =>
      el(
        "tr",
        {},
        el("td", {}, el("code", {}, c.tag), c.latest ? el("span", { class: "muted small" }, " latest") : ""),
        el("td", { class: "num" }, c.step),
        el("td", { class: "small" }, c.complete ? ZP.fmtTime(c.saved_at) : el("span", { class: "badge state-failed" }, "incomplete")),
        el("td", { class: "num small" }, ZP.fmtBytes(c.size_bytes)),
        el("td", {}, c.complete ? el("button", { onclick: () => startExport(c.tag) }, "Export") : "")
      )
    );
    document.querySelector("#checkpoints tbody").replaceChildren(...rows);
    document.getElementById("no-checkpoints").hidden = rows.length > 0;
    const complete = detail.checkpoints.filter((c) => c.complete);
    const form = document.getElementById("export-form");
    // Redraw the export form only when the checkpoints change: the user may be typing in it.
    const signature = complete.map((c) => c.tag).join();
    if (form.dataset.signature === signature && form.childElementCount) return;
    form.dataset.signature = signature;
    if (!complete.length) {
      form.replaceChildren(el("span", { class: "muted" }, "Export needs a complete checkpoint."));
      return;
    }
    form.replaceChildren(
      el("select", { id: "export-checkpoint", "aria-label": "checkpoint to export" }, complete.map((c) => el("option", { value: c.tag }, c.tag))),
      el("input", { id: "export-name", type: "text", placeholder: "folder name (default: the tag)", size: 22 }),
      el("label", { class: "small" }, el("input", { id: "export-merge", type: "checkbox" }), " merge LoRA"),
      el("select", { id: "export-dtype", "aria-label": "dtype" }, el("option", { value: "" }, "run's dtype"), ["bf16", "fp16", "fp32"].map((d) => el("option", { value: d }, d))),
      el("button", { class: "primary", id: "export", onclick: () => startExport(document.getElementById("export-checkpoint").value) }, "Export")
    );
  }

  async function startExport(tag) {
    const name = (document.getElementById("export-name") || {}).value || null;
    const merge = !!(document.getElementById("export-merge") || {}).checked;
    const dtype = (document.getElementById("export-dtype") || {}).value || null;
    try {
      const data = await api(`${base}/export`, { method: "POST", body: { checkpoint: tag, name, merge, dtype } });
      watchedExport = data.export.id;
      await loadDetail();
    } catch (error) {
      document.getElementById("export-message").replaceChildren(ZP.errorBox(error));
    }
  }

  // The line under the export form follows the export just started: running, then done or failed.
  function renderExportMessage() {
    const box = document.getElementById("export-message");
    const watched = detail.exports.find((e) => e.id === watchedExport);
    if (!watched) return;
    if (watched.state === "running") ZP.message(box, `Exporting ${watched.checkpoint} to ${watched.out_path}…`, "info");
    else if (watched.state === "done") ZP.message(box, `Exported ${watched.checkpoint} to ${watched.out_path}`, "ok");
    else ZP.message(box, `The export of ${watched.checkpoint} failed: its log is in the table below`, "error");
  }

  function renderExports() {
    const rows = detail.exports.map((e) =>
      el(
        "tr",
        {},
        el("td", {}, el("code", { title: e.out_path }, e.name || e.out_path)),
        el("td", { class: "small" }, e.checkpoint, e.merge ? " · merged" : "", e.dtype ? ` · ${e.dtype}` : ""),
        el(
          "td",
          {},
          ZP.badge(e.state === "done" ? "completed" : e.state),
          e.state === "done" ? [" ", el("a", { class: "download", href: `${base}/exports/${encodeURIComponent(e.out_path.split("/").pop())}/archive`, download: "" }, "download .tar")] : "",
          e.log_tail && e.log_tail.length ? el("pre", { class: "log small" }, e.log_tail.join("\n")) : ""
        )
      )
    );
    document.querySelector("#exports tbody").replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { colspan: 3, class: "muted" }, "none yet"))]));
    renderExportMessage();
    clearTimeout(exportTimer);
    if (detail.exports.some((e) => e.state === "running")) exportTimer = setTimeout(loadDetail, 2000);
  }

  // ------------------------------------------------------- evaluations
  let evalTimer = null;

  function renderEvaluations() {
    const form = document.getElementById("eval-form");
    const complete = detail.checkpoints.filter((c) => c.complete);
    const evaluate = (detail.actions && detail.actions.evaluate) || { available: true };
    const signature = complete.map((c) => c.tag).join() + String(detail.held_out) + String(evaluate.available);
    if (form.dataset.signature !== signature || !form.childElementCount) {
      form.dataset.signature = signature;
      form.replaceChildren(
        ...(!evaluate.available
          ? [el("span", { class: "muted", id: "eval-unavailable" }, evaluate.reason)]
          : complete.length
          ? [
              el("select", { id: "eval-checkpoint", "aria-label": "checkpoint to evaluate" }, complete.map((c) => el("option", { value: c.tag }, c.tag))),
              el("input", { id: "eval-data", type: "text", size: 34, placeholder: detail.held_out ? "data file (default: the run's held-out data)" : "data file to evaluate on (no held-out data)" }),
              el("button", { class: "primary", id: "evaluate", onclick: startEval }, "Evaluate"),
            ]
          : [el("span", { class: "muted" }, "Evaluation needs a complete checkpoint.")])
      );
    }
    const fmt = (v) => (v === undefined || v === null ? "–" : ZP.fmtNumber(v));
    const rows = detail.evaluations.map((e) =>
      el(
        "tr",
        { dataset: { state: e.state } },
        el("td", {}, el("code", {}, e.checkpoint)),
        el("td", { class: "small" }, e.data || "held-out data"),
        el("td", { class: "num eval-loss" }, fmt(e.result && e.result.loss)),
        el("td", { class: "num" }, fmt(e.result && e.result.perplexity)),
        el("td", { class: "num" }, e.result ? e.result.tokens : "–"),
        el("td", {}, ZP.badge(e.state === "done" ? "completed" : e.state), e.log_tail.length ? el("pre", { class: "log small" }, e.log_tail.join("\n")) : "")
      )
    );
    document.querySelector("#evaluations tbody").replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { colspan: 6, class: "muted" }, "none yet"))]));
    clearTimeout(evalTimer);
    if (detail.evaluations.some((e) => e.state === "running")) evalTimer = setTimeout(loadDetail, 2000);
  }

  async function startEval() {
    const checkpoint = document.getElementById("eval-checkpoint").value;
    const data = document.getElementById("eval-data").value.trim() || null;
    try {
      await api(`${base}/eval`, { method: "POST", body: { checkpoint, data } });
      ZP.message(document.getElementById("eval-message"), "");
      await loadDetail();
    } catch (error) {
      document.getElementById("eval-message").replaceChildren(ZP.errorBox(error));
    }
  }

  function renderGenerations() {
    const card = document.getElementById("generations-card");
    card.hidden = !detail.generations.length;
    document
      .querySelector("#generations tbody")
      .replaceChildren(...detail.generations.map((g) => el("tr", {}, el("td", {}, g.prompt), el("td", {}, el("code", {}, g.output)), el("td", { class: "num" }, g.step ?? ""))));
  }

  // A GRPO run's completions (the model's own text: set as text, never as markup), the last few steps, newest first.
  function renderCompletions() {
    const rows = detail.completions || [];
    document.getElementById("completions-card").hidden = !rows.length;
    const steps = [...new Set(rows.map((c) => c.step))].sort((a, b) => b - a).slice(0, 5);
    const shown = steps.flatMap((step) => rows.filter((c) => c.step === step));
    const rewards = (values) => Object.entries(values || {}).map(([name, value]) => `${name} ${value === null ? "–" : ZP.fmtNumber(value, 3)}`).join(", ");
    document.querySelector("#completions tbody").replaceChildren(
      ...shown.map((c) =>
        el("tr", { dataset: { step: c.step } }, el("td", { class: "num" }, `${c.step ?? ""}`), el("td", {}, `${c.prompt ?? ""}`),
          el("td", {}, el("code", { class: "completion" }, `${c.completion ?? ""}`)), el("td", { class: "small" }, rewards(c.rewards)),
          el("td", { class: "num" }, typeof c.advantage === "number" ? c.advantage.toFixed(3) : ""))
      )
    );
  }

  // -------------------------------------------------------------- nodes
  // A multi-node run's status.json lists its nodes (zeropipe.launch.multinode): ranks grouped by node, each node's host RAM.
  function runNodes() {
    return (detail && detail.status && Array.isArray(detail.status.nodes) && detail.status.nodes) || [];
  }

  function renderNodes() {
    const nodes = runNodes();
    document.getElementById("nodes-card").hidden = !nodes.length;
    document.querySelector("#nodes tbody").replaceChildren(
      ...nodes.map((n) =>
        el(
          "tr",
          { dataset: { node: n.node_rank } },
          el("td", { class: "num" }, `${n.node_rank}`),
          el("td", {}, n.host, n.hostname && n.hostname !== n.host ? el("span", { class: "muted small" }, ` (${n.hostname})`) : "", el("span", { class: "muted small" }, ` · ${n.transport}`)),
          el("td", { class: "node-ranks" }, (n.ranks || []).map((r) => `rank ${r}`).join(", ")),
          el("td", { class: "num" }, ZP.fmtBytes(n.host_ram_used_bytes)),
          el("td", { class: "num" }, ZP.fmtBytes(n.host_ram_peak_bytes)),
          el("td", { class: "num" }, ZP.fmtBytes(n.host_ram_total_bytes)),
          el("td", { class: "num small" }, (n.rank_rss_peak_bytes || []).map((b, i) => `${(n.ranks || [])[i] ?? i}: ${ZP.fmtBytes(b)}`).join(" · "))
        )
      )
    );
  }

  // -------------------------------------------------------------- logs
  function nodeOfLog(name) {
    const match = /^rank(\d+)$/.exec(name);
    const node = match && runNodes().find((n) => (n.ranks || []).includes(Number(match[1])));
    return node ? ` · node ${node.node_rank}` : "";
  }

  function renderLogTabs() {
    const names = detail.logs;
    if (!logName || !names.includes(logName)) logName = names.includes("rank0") ? "rank0" : names[0] || null;
    document.getElementById("log-tabs").replaceChildren(
      ...names.map((name) => el("button", { class: name === logName ? "active" : "", dataset: { log: name }, onclick: () => ((logName = name), renderLogTabs()) }, name + nodeOfLog(name)))
    );
    loadLog();
  }

  async function loadLog() {
    clearTimeout(logTimer);
    const pre = document.getElementById("log");
    if (!logName) return;
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 20;
    try {
      const data = await api(`${base}/logs/${logName}?lines=300`);
      pre.textContent = data.lines.join("\n") || "(empty)";
      if (atBottom) pre.scrollTop = pre.scrollHeight;
    } catch (error) {
      pre.textContent = error.message;
    }
    if (!ENDED.includes(state)) logTimer = setTimeout(loadLog, 2000);
  }

  // ----------------------------------------------------------- gallery
  // A sample at full size over the page (scaled up to fit when it is small); a click or Escape closes it.
  function showFullSize(url, caption) {
    const image = el("img", { src: url, alt: caption });
    const box = el("div", { id: "lightbox", class: "lightbox", role: "dialog", "aria-label": caption },
      el("figure", {}, image, el("figcaption", {}, caption, " · ", el("span", { class: "size" }), " · ", el("a", { href: url, target: "_blank" }, "open the file"))));
    image.addEventListener("load", () => {
      box.querySelector(".size").textContent = `${image.naturalWidth}×${image.naturalHeight} px`;
      image.classList.toggle("pixelated", image.naturalWidth < 256);
    });
    const close = () => {
      box.remove();
      document.removeEventListener("keydown", onKey);
    };
    const onKey = (event) => event.key === "Escape" && close();
    box.addEventListener("click", (event) => event.target.tagName !== "A" && close());
    document.addEventListener("keydown", onKey);
    document.getElementById("lightbox")?.remove();
    document.body.append(box);
  }

  async function loadGallery() {
    const { samples } = await api(`${base}/samples`);
    const card = document.getElementById("gallery-card");
    card.hidden = !samples.length;
    const prompts = [...new Set(samples.map((s) => s.prompt ?? ""))];
    const steps = [...new Set(samples.map((s) => s.step))].sort((a, b) => b - a);
    const header = el("tr", {}, el("th", {}, "step"), prompts.map((p) => el("th", { class: "prompt" }, p || "(no prompt)")));
    const rows = steps.map((step) =>
      el(
        "tr",
        { dataset: { step } },
        el("td", { class: "num" }, step),
        prompts.map((prompt) =>
          el(
            "td",
            {},
            samples
              .filter((s) => s.step === step && (s.prompt ?? "") === prompt)
              .map((s) => {
                const url = `${base}/samples/${s.file.split("/").map(encodeURIComponent).join("/")}`;
                const caption = `${prompt || "(no prompt)"} · step ${step}`;
                const image = el("img", { src: url, alt: `${prompt} at step ${step}`, loading: "lazy", title: "click for full size" });
                // Tiny samples (a 32 px test model) are drawn big and sharp rather than as specks.
                image.addEventListener("load", () => image.classList.toggle("pixelated", image.naturalWidth < 128));
                return el("a", { href: url, target: "_blank", class: "sample", onclick: (event) => { event.preventDefault(); showFullSize(url, caption); } }, image);
              })
          )
        )
      )
    );
    document.getElementById("gallery").replaceChildren(el("table", {}, el("thead", {}, header), el("tbody", {}, rows)));
  }

  // ------------------------------------------------------------ stream
  function onRun(run) {
    const changed = run.state !== state;
    state = run.state;
    // "Stop sent", "Resuming…": said until the run's state answers them.
    if (changed) document.querySelectorAll("#action-message .message.info").forEach((node) => node.remove());
    if (detail) detail.run = run;
    renderHead(run);
    if (changed) loadDetail();
  }

  function follow() {
    if (source) source.close();
    source = ZP.stream(`${base}/stream?after_step=${lastStep}`, {
      metrics: appendMetrics,
      evals: mergeEvals,
      run: onRun,
      reload: loadMetrics,
      end: () => {
        source.close(); // the run has ended: nothing more will come, and the server is still there
        ZP.checkConnection();
        loadDetail();
        loadMetrics();
      },
    });
  }

  document.getElementById("config-details").addEventListener("toggle", async (event) => {
    if (!event.target.open) return;
    const data = await api(`${base}/config`);
    document.getElementById("config").textContent = data.yaml || "(no config.yaml yet)";
  });

  (async function start() {
    await loadDetail();
    await loadMetrics();
    if (!ENDED.includes(state)) follow();
  })().catch((error) => say(error.message, "error"));
})();
