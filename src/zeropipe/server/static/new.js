// New-run page: a form generated from the config schema and a YAML editor, kept in sync;
// every edit is checked by the server (validation, `zeropipe check`, the memory plan).
"use strict";
(function () {
  const { el, api } = ZP;
  const formRoot = document.getElementById("form");
  const yamlArea = document.getElementById("yaml");
  const yamlError = document.getElementById("yaml-error");
  const launchButton = document.getElementById("launch");
  const status = document.getElementById("check-status");

  let config = {}; // the one object both editors show
  const fields = new Map(); // dotted key -> {field, input, row, errorBox}
  const sections = new Map(); // dotted key of an optional sub-section -> {toggle, fieldset}
  let checkSeq = 0;
  let checkTimer = null;
  let yamlTimer = null;

  // --------------------------------------------------- config object
  function getAt(key) {
    return key.split(".").reduce((node, part) => (node && typeof node === "object" ? node[part] : undefined), config);
  }

  function setAt(key, value) {
    const parts = key.split(".");
    let node = config;
    for (const part of parts.slice(0, -1)) {
      if (!node[part] || typeof node[part] !== "object" || Array.isArray(node[part])) node[part] = {};
      node = node[part];
    }
    node[parts[parts.length - 1]] = value;
  }

  function deleteAt(key) {
    const parts = key.split(".");
    const parent = parts.slice(0, -1).reduce((node, part) => (node && typeof node === "object" ? node[part] : undefined), config);
    if (parent && typeof parent === "object") delete parent[parts[parts.length - 1]];
    // An emptied top-level section goes; an emptied optional sub-section stays switched on ({}).
    if (parts.length === 2 && config[parts[0]] && !Object.keys(config[parts[0]]).length) delete config[parts[0]];
  }

  const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);

  // Writing the default is the same as not writing the key: keep the YAML as short as the user's intent.
  function setFromForm(field, value) {
    if (value === undefined || (field.default !== undefined && field.default !== null && same(value, field.default))) deleteAt(field.key);
    else setAt(field.key, value);
    yamlArea.value = dump(config);
    yamlError.replaceChildren();
    scheduleCheck();
  }

  function dump(value) {
    return Object.keys(value).length ? jsyaml.dump(value, { lineWidth: 120, noRefs: true }) : "";
  }

  // ------------------------------------------------------------ form
  // The essentials first (model, data, method, length, GPUs, ZeRO and offload); every other
  // field of the schema folded under "Advanced", by section.
  function buildForm(schema) {
    const essential = new Set(schema.essentials || []);
    const byKey = new Map(schema.sections.flatMap((section) => section.fields.map((field) => [field.key, field])));
    const essentials = (schema.essentials || []).map((key) => byKey.get(key)).filter(Boolean);
    const rest = schema.sections.map((section) => ({ ...section, fields: section.fields.filter((f) => !essential.has(f.key)) })).filter((section) => section.fields.length);
    const count = (list) => list.reduce((n, f) => n + (f.kind === "section" ? count(f.fields) : 1), 0);
    formRoot.replaceChildren(
      el(
        "fieldset",
        { class: "essentials", id: "essentials", dataset: { section: "essentials" } },
        el("legend", {}, "Essentials ", el("span", { class: "help" }, "what, on what, how long, on which GPUs: the plan beside says if it fits")),
        essentials.map((field) => buildField(field, true))
      ),
      el(
        "details",
        { class: "advanced", id: "advanced" },
        el("summary", {}, `Advanced: every other setting (${count(rest.flatMap((s) => s.fields))} fields, each with its default)`),
        rest.map((section) =>
          el("details", { class: "section", dataset: { section: section.name } }, el("summary", {}, el("b", {}, section.name), " ", el("span", { class: "help" }, section.help)), section.fields.map((f) => buildField(f)))
        )
      )
    );
  }

  // `full`: label the field by its whole key (model.path, data.path), as the essentials mix sections.
  function buildField(field, full = false) {
    if (field.kind === "section") {
      const toggle = el("input", { type: "checkbox", id: `use-${field.key}`, dataset: { section: field.key } });
      const fieldset = el(
        "fieldset",
        { dataset: { key: field.key } },
        el("legend", {}, el("label", {}, toggle, " ", el("code", {}, field.key)), " ", el("span", { class: "help" }, field.help)),
        field.fields.map((f) => buildField(f))
      );
      toggle.addEventListener("change", () => {
        if (toggle.checked) setAt(field.key, getAt(field.key) || {});
        else deleteAt(field.key);
        yamlArea.value = dump(config);
        fillForm();
        scheduleCheck();
      });
      sections.set(field.key, { toggle, fieldset });
      return fieldset;
    }
    const id = `field-${field.key.replace(/\./g, "-")}`;
    const input = makeInput(field, id);
    const errorBox = el("div", { class: "error" });
    const row = el("div", { class: `field kind-${field.kind}`, dataset: { key: field.key } }, el("label", { for: id, title: field.key }, full ? field.key : field.name), input, el("div", { class: "help", title: field.help }, field.help), errorBox);
    fields.set(field.key, { field, input, row, errorBox });
    return row;
  }

  function placeholder(field) {
    if (field.default === null || field.default === undefined) return field.nullable ? "(not set)" : "";
    return `default: ${typeof field.default === "object" ? JSON.stringify(field.default) : field.default}`;
  }

  function makeInput(field, id) {
    const attrs = { id, name: field.key, "aria-describedby": `${id}-help` };
    let input;
    switch (field.kind) {
      case "bool":
        input = el("input", { ...attrs, type: "checkbox" });
        input.addEventListener("change", () => setFromForm(field, input.checked));
        break;
      case "select":
        input = el("select", attrs, field.options.map((option, i) => el("option", { value: String(i) }, String(option) + (same(option, field.default) ? " (default)" : ""))));
        input.addEventListener("change", () => setFromForm(field, field.options[Number(input.value)]));
        break;
      case "int":
      case "float":
        input = el("input", { ...attrs, type: "number", step: field.kind === "int" ? "1" : "any", min: field.exclusive_min ? null : field.min, max: field.exclusive_max ? null : field.max, placeholder: placeholder(field) });
        input.addEventListener("input", () => {
          const text = input.value.trim();
          if (text === "") return setFromForm(field, undefined);
          const number = Number(text);
          setFromForm(field, Number.isNaN(number) ? text : number);
        });
        break;
      case "scalar": {
        const listId = `${id}-options`;
        input = el("input", { ...attrs, type: "text", list: listId, placeholder: placeholder(field) });
        input.addEventListener("input", () => setFromForm(field, input.value.trim() === "" ? undefined : parseScalar(input.value)));
        const wrap = el("div", {}, input, el("datalist", { id: listId }, field.options.map((o) => el("option", { value: o }))));
        wrap.inputElement = input;
        return wrap;
      }
      case "yaml":
        input = el("textarea", { ...attrs, rows: 3, spellcheck: "false", placeholder: placeholder(field) });
        input.addEventListener("input", () => {
          const text = input.value.trim();
          if (text === "") return setFromForm(field, undefined);
          try {
            setFromForm(field, jsyaml.load(text));
            fields.get(field.key).errorBox.textContent = "";
          } catch (err) {
            fields.get(field.key).errorBox.textContent = `not YAML: ${err.reason || err.message}`;
          }
        });
        break;
      default:
        input = el("input", { ...attrs, type: "text", placeholder: placeholder(field) });
        input.addEventListener("input", () => setFromForm(field, input.value === "" ? undefined : input.value));
    }
    return input;
  }

  function parseScalar(text) {
    try {
      const value = jsyaml.load(text);
      return value === null || typeof value === "object" ? text : value;
    } catch (err) {
      return text;
    }
  }

  // Show `config` in the form (after the YAML changed, or a section was switched).
  function fillForm() {
    for (const { field, input } of fields.values()) {
      const element = input.inputElement || input;
      if (document.activeElement === element) continue; // do not fight the user's cursor
      const value = getAt(field.key);
      const shown = value === undefined ? field.default : value;
      if (field.kind === "bool") element.checked = !!shown;
      else if (field.kind === "select") element.value = String(Math.max(0, field.options.findIndex((o) => same(o, shown))));
      else if (field.kind === "yaml") element.value = value === undefined ? "" : jsyaml.dump(value, { flowLevel: Array.isArray(value) && value.every((v) => typeof v !== "object") ? 0 : -1 }).trim();
      else element.value = value === undefined || value === null ? "" : String(value);
    }
    for (const [key, { toggle, fieldset }] of sections) {
      const on = getAt(key) !== undefined && getAt(key) !== null;
      toggle.checked = on;
      fieldset.classList.toggle("off", !on);
      for (const control of fieldset.querySelectorAll("input, select, textarea")) if (control !== toggle) control.disabled = !on;
    }
  }

  // ------------------------------------------------------------ YAML
  yamlArea.addEventListener("input", () => {
    clearTimeout(yamlTimer);
    yamlTimer = setTimeout(() => {
      let value;
      try {
        value = jsyaml.load(yamlArea.value);
      } catch (err) {
        const where = err.mark ? ` (line ${err.mark.line + 1}, column ${err.mark.column + 1})` : "";
        yamlInvalid(`not valid YAML${where}: ${err.reason || err.message}`);
        renderCommand({ available: false, reason: "the YAML does not parse: fix it to see the command" });
        return;
      }
      if (value !== null && value !== undefined && (typeof value !== "object" || Array.isArray(value))) {
        yamlInvalid("the top level must be a mapping of sections (model:, data:, train:, ...)");
        return;
      }
      yamlError.replaceChildren();
      config = value || {};
      fillForm();
      scheduleCheck();
    }, 250);
  });

  // ----------------------------------------------------------- check
  // YAML that does not parse is not what the last check saw: the page must not keep saying
  // "ready to launch" (nor keep Launch enabled) for the config as it was before the edit.
  function yamlInvalid(text) {
    clearTimeout(checkTimer);
    checkSeq++; // a check still on its way answers for the old text: ignore it
    yamlError.replaceChildren(el("div", { class: "message error" }, text));
    document.getElementById("check").replaceChildren(el("div", { class: "message error" }, `The YAML cannot be read, so nothing was checked: ${text}`));
    status.textContent = "the YAML is not valid";
    launchButton.disabled = true;
  }

  function scheduleCheck() {
    clearTimeout(checkTimer);
    status.textContent = "checking…";
    launchButton.disabled = true; // until the check of this text answers
    checkTimer = setTimeout(runCheck, 400);
  }

  async function runCheck() {
    const seq = ++checkSeq;
    let result;
    try {
      result = await api("/api/config/check", { method: "POST", body: { yaml: yamlArea.value } });
    } catch (error) {
      if (seq === checkSeq) status.textContent = error.message;
      return;
    }
    if (seq !== checkSeq) return; // an older answer arriving late
    renderCheck(result);
    renderPlan(result.plan);
  }

  function renderCheck(result) {
    for (const { row, errorBox, field } of fields.values()) {
      row.classList.remove("invalid");
      if (field.kind !== "yaml" || !errorBox.textContent.startsWith("not YAML")) errorBox.textContent = "";
    }
    const marks = [...result.problems.map((p) => ({ key: p.key, message: p.message })), ...result.findings.filter((f) => f.severity === "error").map((f) => ({ key: f.key, message: `${f.message} — fix: ${f.fix}` }))];
    for (const mark of marks) {
      const entry = fields.get(mark.key);
      if (entry) {
        entry.row.classList.add("invalid");
        entry.errorBox.textContent = mark.message;
      }
    }
    const box = document.getElementById("check");
    const parts = [];
    if (result.problems.length) {
      parts.push(el("div", { class: "message error" }, `${result.problems.length} problem(s) in the config:`, ZP.problemList(result.problems)));
    }
    if (result.findings.length) {
      parts.push(
        el(
          "ul",
          { class: "findings problems" },
          result.findings.map((f) =>
            el("li", { dataset: { rule: f.rule } }, el("span", { class: `badge sev-${f.severity}` }, f.severity), " ", el("b", {}, f.rule), " ", el("code", {}, f.key), ": ", ZP.rich(f.message), el("div", { class: "small" }, "fix: ", ZP.rich(f.fix), " ", f.link ? el("a", { href: f.link, target: "_blank", rel: "noopener" }, "docs") : ""))
          )
        )
      );
    }
    if (!parts.length) parts.push(el("div", { class: "message ok" }, "No problems found: this config is ready to launch."));
    box.replaceChildren(...parts);
    const errors = result.problems.length + result.findings.filter((f) => f.severity === "error").length;
    renderCommand(result.command);
    status.textContent = errors ? `${errors} problem(s)` : "ready to launch";
    launchButton.disabled = !result.valid;
  }

  // --------------------------------------------------------------- plan
  const FIRST = ["recommendation", "recommended", "verdict", "fits", "why", "reason", "reasons", "explanation"];

  // ------------------------------------------------------ command preview
  const commandBox = document.getElementById("command");

  async function copyText(text, button) {
    try {
      await navigator.clipboard.writeText(text);
    } catch (error) {
      // No clipboard API (a page served over plain http to another host): copy through a selection.
      const area = el("textarea", { style: "position:fixed;left:-9999px" });
      area.value = text;
      document.body.append(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
    const label = button.textContent;
    button.textContent = "copied";
    setTimeout(() => (button.textContent = label), 1200);
  }

  function copyBlock(id, title, text) {
    const button = el("button", { id: `copy-${id}`, class: "small", title: `copy ${title}` }, "Copy");
    button.addEventListener("click", () => copyText(text, button));
    return el("div", { class: "copy-block" }, el("div", { class: "toolbar", style: "margin:4px 0" }, el("strong", { class: "small" }, title), el("span", { class: "spacer" }), button), el("pre", { id: `command-${id}`, class: "command" }, text));
  }

  function renderCommand(command) {
    if (!command) {
      commandBox.replaceChildren(el("span", { class: "muted" }, "fix the problems above to see the command"));
      return;
    }
    if (!command.available) {
      commandBox.replaceChildren(el("span", { class: "muted" }, command.reason));
      return;
    }
    // The file folds away: the New-run page must stay one screen beside the plan.
    const copyYaml = el("button", { id: "copy-yaml", class: "small", title: "copy the config file's text" }, "Copy");
    copyYaml.addEventListener("click", () => copyText(command.yaml, copyYaml));
    const lines = command.yaml.split("\n").length - 1;
    commandBox.replaceChildren(
      copyBlock("line", "command", command.command),
      el("div", { class: "toolbar", style: "margin:4px 0" }, el("strong", { class: "small" }, command.config_path), el("span", { class: "spacer" }), copyYaml),
      el(
        "details",
        { id: "command-details" },
        el("summary", { class: "small" }, `the file (${lines} lines) and the process the UI starts`),
        el("div", { class: "small muted" }, `run from ${command.cwd} as `, el("code", {}, command.argv.join(" ")), ", detached, its output in the run's logs/launcher.log"),
        el("pre", { id: "command-yaml", class: "command" }, command.yaml)
      )
    );
  }

  function isBytesKey(key) {
    return /bytes|memory|ram|_mem/.test(key);
  }

  function renderValue(key, value) {
    if (value === null || value === undefined) return "–";
    if (typeof value === "number") return isBytesKey(key) && value > 1024 ? ZP.fmtBytes(value) : ZP.fmtNumber(value);
    if (typeof value === "boolean") return value ? "yes" : "no";
    if (typeof value === "string") return value;
    if (Array.isArray(value)) {
      if (value.length && value.every((v) => v && typeof v === "object" && !Array.isArray(v))) {
        const columns = [...new Set(value.flatMap(Object.keys))];
        return el("table", {}, el("thead", {}, el("tr", {}, columns.map((c) => el("th", {}, c)))), el("tbody", {}, value.map((row) => el("tr", {}, columns.map((c) => el("td", {}, renderValue(c, row[c])))))));
      }
      return value.map((v) => (typeof v === "object" ? JSON.stringify(v) : String(v))).join(", ");
    }
    return renderTree(value);
  }

  function renderTree(object) {
    const keys = Object.keys(object).sort((a, b) => (FIRST.includes(b) ? 1 : 0) - (FIRST.includes(a) ? 1 : 0));
    return el("dl", { class: "kv" }, keys.map((key) => [el("dt", {}, key.replace(/_/g, " ")), el("dd", {}, renderValue(key, object[key]))]));
  }

  function describeChoice(choice) {
    const parts = [`ZeRO ${choice.zero_stage}`];
    if (choice.offload_optimizer) parts.push("optimizer offload");
    if (choice.offload_param) parts.push("parameter offload");
    parts.push(choice.precision, `micro-batch ${choice.micro_batch_size} × accumulation ${choice.gradient_accumulation_steps}`);
    if (choice.gradient_checkpointing) parts.push("gradient checkpointing");
    return parts.join(", ");
  }

  function termsTable(terms) {
    return el(
      "table",
      {},
      el("thead", {}, el("tr", {}, el("th", {}, "term"), el("th", {}, "size"), el("th", {}, "why"))),
      el("tbody", {}, (terms || []).map((t) => el("tr", {}, el("td", {}, t.name), el("td", { class: "num" }, ZP.fmtBytes(t.bytes)), el("td", { class: "small muted" }, t.explanation))))
    );
  }

  function candidateLine(label, candidate, result) {
    const verdict = candidate.fits ? el("span", { class: "badge sev-ok" }, "fits") : el("span", { class: "badge sev-error" }, "does not fit");
    return el(
      "div",
      { class: "plan-line" },
      el("div", {}, verdict, " ", el("b", {}, `${label}: `), describeChoice(candidate.choice)),
      el(
        "div",
        { class: "small" },
        `per GPU ${ZP.fmtBytes(candidate.per_gpu_bytes)} of ${ZP.fmtBytes(result.usable_gpu_bytes)} usable · per node ${ZP.fmtBytes(candidate.per_node_bytes)} of ${ZP.fmtBytes(result.usable_host_bytes)} usable · relative cost ${ZP.fmtNumber(candidate.relative_cost, 3)}`
      ),
      candidate.why_not ? el("div", { class: "small", style: "color:var(--bad)" }, candidate.why_not) : ""
    );
  }

  function mergeInto(target, fragment) {
    for (const [key, value] of Object.entries(fragment)) {
      if (value && typeof value === "object" && !Array.isArray(value)) {
        if (!target[key] || typeof target[key] !== "object") target[key] = {};
        mergeInto(target[key], value);
      } else target[key] = value;
    }
  }

  function renderPlan(plan) {
    const box = document.getElementById("plan");
    if (!plan || !plan.available) {
      box.replaceChildren(el("div", { class: "muted", id: "plan-unavailable" }, plan ? ZP.rich(plan.reason) : "planner unavailable"));
      return;
    }
    const result = plan.result || {};
    if (!("best" in result) && !("configured" in result)) {
      box.replaceChildren(renderTree(result)); // a planner this page does not know yet: show what it says
      return;
    }
    const parts = [];
    if (result.configured) parts.push(candidateLine("Your config", result.configured, result));
    if (result.best) {
      const same = result.configured && JSON.stringify(result.configured.choice) === JSON.stringify(result.best.choice);
      parts.push(
        same
          ? el("div", { class: "message ok small" }, "Your settings are the planner's recommendation for this hardware.")
          : el("div", {}, candidateLine("Recommended", result.best, result), result.fragment ? el("button", { id: "apply-plan", onclick: () => applyFragment(result.fragment) }, "Use the recommended settings") : "")
      );
    } else {
      parts.push(el("div", { class: "message error" }, ZP.rich(result.reason) || "nothing fits this hardware"));
    }
    for (const note of result.notes || []) parts.push(el("div", { class: "small muted" }, note));
    const shown = result.configured || result.best;
    if (shown) {
      parts.push(el("details", {}, el("summary", {}, `Per GPU: ${ZP.fmtBytes(shown.per_gpu_bytes)}`), termsTable(shown.per_gpu_terms)));
      parts.push(el("details", {}, el("summary", {}, `Per node (host RAM): ${ZP.fmtBytes(shown.per_node_bytes)}`), termsTable(shown.per_node_terms)));
    }
    if ((result.summary || []).length) {
      parts.push(
        el(
          "details",
          {},
          el("summary", {}, "Other combinations"),
          el(
            "table",
            {},
            el("thead", {}, el("tr", {}, el("th", {}, "settings"), el("th", {}, "per GPU"), el("th", {}, "per node"), el("th", {}, "cost"), el("th", {}, ""))),
            el(
              "tbody",
              {},
              result.summary.map((c) =>
                el("tr", {}, el("td", { class: "small" }, describeChoice(c.choice)), el("td", { class: "num" }, ZP.fmtBytes(c.per_gpu_bytes)), el("td", { class: "num" }, ZP.fmtBytes(c.per_node_bytes)), el("td", { class: "num" }, ZP.fmtNumber(c.relative_cost, 3)), el("td", {}, c.fits ? "fits" : el("span", { title: c.why_not || "" }, "no")))
              )
            )
          )
        )
      );
    }
    const facts = {};
    if (result.model) Object.assign(facts, { model: result.model.name, parameters: result.model.total_params, trainable: result.model.trainable_params });
    if (result.hardware) Object.assign(facts, { ranks: `${result.hardware.gpus_per_node} per node × ${result.hardware.nodes} node(s), ${result.hardware.accelerator}`, "GPU memory": ZP.fmtBytes(result.hardware.gpu_memory_bytes), "host RAM": ZP.fmtBytes(result.hardware.host_ram_bytes) });
    parts.push(el("details", {}, el("summary", {}, "Model and hardware"), renderTree(facts), (result.hardware && result.hardware.notes ? result.hardware.notes : []).map((n) => el("div", { class: "small muted" }, n))));
    box.replaceChildren(...parts);
  }

  function applyFragment(fragment) {
    mergeInto(config, fragment);
    yamlArea.value = dump(config);
    fillForm();
    scheduleCheck();
  }

  // ------------------------------------------------------------ launch
  launchButton.addEventListener("click", async () => {
    launchButton.disabled = true;
    const message = document.getElementById("launch-message");
    message.replaceChildren(el("div", { class: "message info" }, "launching…"));
    try {
      const data = await api("/api/runs", { method: "POST", body: { yaml: yamlArea.value } });
      location.href = `/runs/${data.run.id}`;
    } catch (error) {
      message.replaceChildren(ZP.errorBox(error));
      launchButton.disabled = false;
    }
  });

  // ----------------------------------------------------------- presets
  // Start from a shipped example, a saved preset or a past run's config; save this one as a preset.
  const presetSelect = document.getElementById("preset");
  const presetMessage = document.getElementById("preset-message");
  let loadedText = ""; // the YAML as last loaded: asking before replacing the user's edits

  function showYaml(text) {
    yamlArea.value = text;
    loadedText = text;
    config = jsyaml.load(text) || {};
    yamlError.replaceChildren();
    fillForm();
    scheduleCheck();
  }

  async function loadPresets(selected = "") {
    const { presets } = await api("/api/presets");
    const groups = [["example", "Examples"], ["saved", "Saved presets"], ["run", "Past runs"]];
    presetSelect.replaceChildren(
      el("option", { value: "" }, "the small default config"),
      ...groups
        .filter(([kind]) => presets.some((p) => p.kind === kind))
        .map(([kind, label]) => el("optgroup", { label }, presets.filter((p) => p.kind === kind).map((p) => el("option", { value: p.id, title: p.description }, p.kind === "run" ? `${p.name} (${p.description})` : p.name))))
    );
    presetSelect.value = selected;
  }

  async function startFrom(id) {
    const [kind, ...rest] = id.split(":");
    const data = id ? await api(`/api/presets/${kind}/${encodeURIComponent(rest.join(":"))}`) : await api("/api/config/template");
    showYaml(data.yaml);
    const shown = presetSelect.selectedOptions[0];
    ZP.message(presetMessage, id ? `Started from ${shown ? shown.textContent : id}: the run is named ${data.name}.` : "", "info");
  }

  presetSelect.addEventListener("change", async () => {
    if (yamlArea.value !== loadedText && !confirm("Replace the config you edited?")) return;
    try {
      await startFrom(presetSelect.value);
    } catch (error) {
      presetMessage.replaceChildren(ZP.errorBox(error));
    }
  });

  document.getElementById("save-preset").addEventListener("click", async () => {
    const input = document.getElementById("preset-name");
    const name = input.value.trim() || (config.run && config.run.name) || "";
    const save = (overwrite) => api("/api/presets", { method: "POST", body: { name, yaml: yamlArea.value, overwrite } });
    try {
      try {
        await save(false);
      } catch (error) {
        if (!(error.status === 422 && /exists/.test(error.message) && confirm(`Replace the preset ${name}?`))) throw error;
        await save(true);
      }
      await loadPresets(presetSelect.value);
      ZP.message(presetMessage, `Saved as preset ${name}: pick it under "Start from" next time.`, "ok");
    } catch (error) {
      presetMessage.replaceChildren(ZP.errorBox(error));
    }
  });

  // ------------------------------------------------------- data preview
  const previewBox = document.getElementById("preview");

  function renderPreview(data) {
    if (!data.available) {
      previewBox.replaceChildren(el("div", { class: "muted" }, ZP.rich(data.reason)));
      return;
    }
    if (data.family === "diffusion") return renderImagePreview(data);
    const facts = [
      ["data", data.source],
      ["format", data.format ? `${data.format}${data.format_detected ? " (detected)" : " (data.format)"}` : "–"],
      ["records", `${data.records}, ${data.skipped_count} skipped`],
      ["tokenizer", data.tokenizer || "–"],
      ["max_seq_len", data.max_seq_len],
    ];
    const examples = data.examples.map((e) =>
      el(
        "div",
        { class: "example", dataset: { line: e.line } },
        el(
          "div",
          { class: "small muted" },
          `${e.file ? e.file + " " : ""}line ${e.line} · ${e.tokens} tokens, ${e.loss_tokens} learned`,
          e.truncated ? el("span", { class: "badge sev-warning" }, `cut at ${data.max_seq_len} tokens`) : "",
          e.chunks > 1 ? ` · split into ${e.chunks} sequences (first shown)` : ""
        ),
        el("pre", { class: "pieces" }, e.pieces.map((p) => el("span", { class: p.loss ? "learned" : "prompt", title: `${p.tokens} tokens, ${p.loss ? "learned (loss)" : "prompt (masked: no loss)"}` }, p.text)))
      )
    );
    const skipped = skippedTable(data);
    previewBox.replaceChildren(
      el("dl", { class: "kv" }, facts.map(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))])),
      el("div", { class: `message ${data.verdict.starts ? "ok" : "error"}`, id: "preview-verdict" }, data.verdict.text),
      skipped, // first: the records that would be lost are what a preview is most often for
      el("h3", {}, `The first ${examples.length} examples`),
      el("div", { class: "legend small" }, el("span", { class: "prompt" }, "prompt: no loss"), " ", el("span", { class: "learned" }, "learned")),
      ...examples
    );
  }

  function skippedTable(data) {
    if (!data.skipped.length) return "";
    const where = (b) => (b.line ? `${b.file ? b.file + " " : ""}line ${b.line}` : b.file);
    return el(
      "div",
      { id: "skipped" },
      el("h3", {}, `Skipped (${data.skipped_count})`),
      el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "where"), el("th", {}, "why"))), el("tbody", {}, data.skipped.map((b) => el("tr", {}, el("td", { class: "small" }, where(b)), el("td", {}, b.reason)))))
    );
  }

  function renderImagePreview(data) {
    const buckets = Object.entries(data.buckets).map(([bucket, n]) => `${bucket}: ${n}`).join(" · ");
    const facts = [
      ["data", data.source],
      ["layout", data.layout],
      ["images", `${data.records}, ${data.skipped_count} skipped${data.missing_captions ? `, ${data.missing_captions} without a caption (trained on the empty caption)` : ""}`],
      ["buckets (images × repeats)", buckets || "–"],
    ];
    // The whole folder, page by page, with every rejected file: the Dataset page, with this config's bucket settings.
    const images = (config.data && config.data.images) || {};
    const folder = config.data && config.data.path;
    const datasetLink = folder
      ? el("a", { id: "open-dataset", href: `/dataset?${new URLSearchParams({ path: folder, ...Object.fromEntries(["resolution", "bucket_step", "max_aspect", "caption_ext"].filter((k) => images[k] !== undefined).map((k) => [k, images[k]])), ...(images.bucketing === false ? { bucketing: "0" } : {}) })}` }, "see the whole folder on the Dataset page")
      : "";
    previewBox.replaceChildren(
      el("dl", { class: "kv" }, facts.map(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))])),
      el("div", { class: `message ${data.verdict.starts ? "ok" : "error"}`, id: "preview-verdict" }, data.verdict.text),
      datasetLink,
      el(
        "div",
        { class: "thumbs" },
        data.images.map((image) =>
          el(
            "figure",
            { class: "thumb", dataset: { file: image.file } },
            el("img", { src: image.thumbnail, alt: image.caption }),
            el("figcaption", {}, el("div", { class: "small" }, image.caption || el("i", { class: "muted" }, "(no caption)")), el("div", { class: "small muted" }, `${image.file} · ${image.size.join("×")} → bucket ${image.bucket.join("×")}${image.repeats > 1 ? ` · ×${image.repeats}` : ""}`))
          )
        )
      ),
      skippedTable(data)
    );
  }

  document.getElementById("preview-data").addEventListener("click", async () => {
    previewBox.replaceChildren(el("div", { class: "muted" }, "reading the data…"));
    try {
      renderPreview(await api("/api/data/preview", { method: "POST", body: { yaml: yamlArea.value, limit: 10 } }));
    } catch (error) {
      previewBox.replaceChildren(ZP.errorBox(error));
    }
  });

  // ------------------------------------------------------------- start
  (async function start() {
    const wanted = new URLSearchParams(location.search).get("from") || "";
    const [schema] = await Promise.all([api("/api/config/schema"), loadPresets(wanted)]);
    buildForm(schema);
    await startFrom(presetSelect.value === wanted ? wanted : "");
  })().catch((error) => formRoot.replaceChildren(el("div", { class: "message error" }, error.message)));
})();
