// rft studio: the pages' live parts. Every request goes to the studio's own JSON API (app.py)
// with the token in an Authorization header. The token comes once in the printed URL's fragment
// (#token=..., never sent to a server) and is kept in this origin's localStorage, which a page
// on another port cannot read; the studio sets no cookie.
"use strict";

const $ = (sel, el = document) => el.querySelector(sel);
const $$ = (sel, el = document) => Array.from(el.querySelectorAll(sel));

const TOKEN_KEY = "rft-studio-token";
(() => {
  const m = location.hash.match(/token=([^&]+)/);
  if (!m) return;
  localStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
  history.replaceState(null, "", location.pathname + location.search);  // out of the address bar and history
})();

const auth = () => ({"Authorization": "Bearer " + (localStorage.getItem(TOKEN_KEY) || "")});

async function api(path, body) {
  const headers = auth();
  const opts = body === undefined ? {headers} : {method: "POST", headers: {...headers, "Content-Type": "application/json"}, body: JSON.stringify(body)};
  const r = await fetch(path, opts);
  const text = await r.text();
  let data;
  try { data = JSON.parse(text); } catch (e) { data = {detail: text || r.statusText}; }  // a refusal is one line of text
  if (!r.ok) throw Object.assign(new Error(data.detail || r.statusText), {status: r.status, data});
  return data;
}

function esc(s) {
  return String(s ?? "").replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
}

// a value as HTML text: escaped, whatever a file under the root put there (a run's files are data)
function fmt(v) {
  if (v === null || v === undefined) return "";
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toPrecision(4);
  return esc(v);
}

// ------------------------------------------------------------------ compose

const compose = {
  keys: {},          // key -> override text the user set
  timer: null,
  seq: 0,
  launch: null,      // the launch whose console is shown
  offset: 0,

  choices() {
    const out = {};
    $$("select[data-group]").forEach(s => { out[s.dataset.group] = s.value; });
    return out;
  },

  body() { return {choices: this.choices(), keys: this.keys}; },

  schedule() {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.refresh(), 250);
  },

  async refresh() {
    const seq = ++this.seq;
    document.body.dataset.composing = "1";
    let r;
    try { r = await api("/api/compose", this.body()); }
    catch (e) { r = {error: e.message, command: "", plan: "", yaml: "", values: {}}; }
    if (seq !== this.seq) return;  // a newer change is on its way
    $("#command").textContent = r.command;
    $("#plan").textContent = r.plan || (r.error ? "(no plan: see the error)" : "");
    $("#yaml").textContent = r.yaml;
    const err = $("#error");
    err.hidden = !r.error;
    err.textContent = r.error ? "configuration error: " + r.error : "";
    this.showImports(r.imports || []);
    for (const [key, value] of Object.entries(r.values || {})) {
      const input = $(`[data-key="${CSS.escape(key)}"]`);
      if (!input || key in this.keys || document.activeElement === input) continue;
      if (input.tagName === "SELECT" && !$$("option", input).some(o => o.value === value)) {
        input.add(new Option(value, value));
      }
      input.value = value;
    }
    for (const row of $$("tr[data-row]")) row.classList.toggle("edited", row.dataset.row in this.keys);
    delete document.body.dataset.composing;
    document.body.dataset.composed = String(seq);
  },

  showImports(imports) {
    const box = $("#imports");
    box.hidden = !imports.length;
    box.innerHTML = imports.length ? "<b>imports from outside rft and this repository</b> (the run will import and run this code; " +
      "launch asks first):<ul>" + imports.map(i => `<li><code>${esc(i.path)}</code> (${esc(i.key)})</li>`).join("") + "</ul>" : "";
  },

  async start(confirmed = []) {
    const body = {...this.body(), sweep: $("#sweep").checked, sweep_params: $("#sweep-params").value,
                  launcher: $("#launcher").value, confirm_imports: confirmed};
    try {
      const r = await api("/api/launch", body);
      this.launch = r.id; this.offset = 0; $("#console").textContent = "";
      this.poll();
    } catch (e) {
      const imports = e.status === 409 && e.data.imports;
      if (imports && !confirmed.length) this.showImports(imports);
      if (imports && !confirmed.length && window.confirm("This run imports code from outside rft and this repository:\n\n" +
          imports.map(i => `${i.path}  (${i.key})`).join("\n") + "\n\nLaunch it only if you trust that code. Launch?")) {
        return this.start(imports.map(i => i.path));
      }
      $("#launch-status").textContent = e.message; $("#launch-status").dataset.status = "refused";
    }
  },

  comments() {
    $$("select[data-group]").forEach(s => {
      $("#comment-" + CSS.escape(s.dataset.group)).textContent = s.selectedOptions[0]?.title || "";
    });
  },

  async poll() {
    if (this.launch === null) return;
    try {
      const r = await api(`/api/launch/${this.launch}?offset=${this.offset}`);
      const con = $("#console");
      const atEnd = con.scrollTop + con.clientHeight >= con.scrollHeight - 4;
      con.textContent += r.text;
      if (atEnd) con.scrollTop = con.scrollHeight;
      this.offset = r.offset;
      $("#launch-status").textContent = `launch ${r.id}: ${r.status} — ${r.command}`;
      $("#launch-status").dataset.status = r.status;
      $("#stop").disabled = r.status !== "running";
      if (r.status === "running" || r.text) setTimeout(() => this.poll(), 1000);
    } catch (e) { $("#launch-status").textContent = e.message; }
  },

  init() {
    $$("select[data-group]").forEach(s => s.addEventListener("change", () => { this.comments(); this.schedule(); }));
    $$("[data-key]").forEach(input => {
      const changed = () => { this.keys[input.dataset.key] = input.value; this.schedule(); };
      input.addEventListener(input.tagName === "SELECT" ? "change" : "input", changed);
    });
    $$("[data-reset]").forEach(b => b.addEventListener("click", () => { delete this.keys[b.dataset.reset]; this.schedule(); }));
    $("#key-filter").addEventListener("input", e => {
      const q = e.target.value.trim().toLowerCase();
      $$("tr[data-row]").forEach(row => { row.hidden = q && !row.dataset.row.toLowerCase().includes(q); });
      if (q) $$("details.section").forEach(d => { d.open = $$("tr[data-row]", d).some(r => !r.hidden); });
    });
    $("#save-study").addEventListener("click", async () => {
      const out = $("#study-result");
      try {
        const r = await api("/api/study", {...this.body(), name: $("#study-name").value, overwrite: $("#study-overwrite").checked});
        out.className = ""; out.textContent = `saved ${r.path}: ${r.command}`;
      } catch (e) { out.className = "error"; out.textContent = e.message; }
    });
    $("#launch").addEventListener("click", () => this.start());
    $("#stop").addEventListener("click", () => { if (this.launch !== null) api(`/api/launch/${this.launch}/stop`, {}); });
    this.comments();
    this.refresh();
  },
};

// ------------------------------------------------------------------ runs

const runs = {
  checked: new Set(),
  metric: "eval/accuracy",

  async refresh() {
    let data;
    try { data = await api("/api/runs"); } catch (e) { return; }
    const tbody = $("#runs tbody");
    tbody.innerHTML = data.runs.map(r => `<tr data-run="${esc(r.id)}">
      <td><input type="checkbox" data-pick="${esc(r.id)}" ${this.checked.has(r.id) ? "checked" : ""}></td>
      <td>${esc(r.id)}</td><td>${esc(r.stage)}</td><td class="status">${esc(r.status)}</td><td>${fmt(r.steps)}</td>
      <td>${fmt(r.last_eval)}</td><td>${fmt(r.train_s)}</td>
      <td><a href="/rollouts?run=${encodeURIComponent(r.id)}">rollouts</a></td></tr>`).join("");
    $$("[data-pick]", tbody).forEach(box => box.addEventListener("change", () => {
      box.checked ? this.checked.add(box.dataset.pick) : this.checked.delete(box.dataset.pick);
      this.metrics(); this.chart();
    }));
    const sel = $("#sweep-choice");
    const known = new Set($$("option", sel).map(o => o.value));
    data.sweeps.forEach(s => { if (!known.has(s.id)) sel.add(new Option(`${s.id} (${s.jobs} jobs)`, s.id)); });
  },

  query() { return Array.from(this.checked).map(r => "run=" + encodeURIComponent(r)).join("&"); },

  async metrics() {
    if (!this.checked.size) return;
    const names = await api("/api/metrics?" + this.query());
    const sel = $("#metric");
    if (names.join("\n") === $$("option", sel).map(o => o.value).join("\n")) return;  // unchanged: keep the open menu
    sel.innerHTML = names.map(n => `<option ${n === this.metric ? "selected" : ""}>${esc(n)}</option>`).join("");
    if (!names.includes(this.metric) && names.length) { this.metric = names[0]; sel.value = this.metric; }
  },

  async stages() {
    if (!this.checked.size) return;
    const names = await api("/api/stages?" + this.query());
    const sel = $("#stage");
    const known = new Set($$("option", sel).map(o => o.value));
    names.forEach(n => { if (!known.has(n)) sel.add(new Option(n, n)); });
  },

  async chart() {
    // the 2 s refresh and a changed choice can each have a request out: only the newest call draws
    // (an older answer arriving last would put back the curves of the choice before)
    const ticket = this.chartTicket = (this.chartTicket || 0) + 1;
    const q = `metric=${encodeURIComponent(this.metric)}&stage=${encodeURIComponent($("#stage").value)}&`;
    const traces = this.checked.size ? await api("/api/curves?" + q + this.query()) : [];
    if (ticket !== this.chartTicket) return;
    const data = traces.map(t => ({x: t.x, y: t.y, name: t.name, mode: "lines+markers", type: "scatter"}));
    Plotly.react("chart", data, {title: {text: this.metric}, xaxis: {title: {text: "step"}}, yaxis: {title: {text: this.metric}},
                                 margin: {t: 40}, legend: {orientation: "h"}}, {displaylogo: false});
  },

  async sweep() {
    const id = $("#sweep-choice").value;
    const out = $("#sweep-table");
    if (!id) { out.innerHTML = ""; return; }
    try {
      const t = await api("/api/sweep?sweep=" + encodeURIComponent(id));
      out.innerHTML = table("jobs", t.jobs) + (t.configs.length ? "<h3>by configuration (mean ± std over seeds)</h3>" + table("configs", t.configs) : "");
    } catch (e) { out.innerHTML = `<div class="error">${esc(e.message)}</div>`; }
  },

  init() {
    $("#metric").addEventListener("change", e => { this.metric = e.target.value; this.chart(); });
    $("#stage").addEventListener("change", () => this.chart());
    $("#sweep-choice").addEventListener("change", () => this.sweep());
    // a run that trains logs new metrics (eval first, then the step's): list, then draw, every 2 s
    const tick = async () => {
      try { await this.refresh(); await this.metrics(); await this.stages(); await this.chart(); } finally { setTimeout(tick, 2000); }
    };
    tick();
  },
};

function table(id, rows) {
  if (!rows.length) return "<p>no rows</p>";
  const cols = Object.keys(rows[0]);
  return `<table class="list" id="table-${id}"><thead><tr>${cols.map(c => `<th>${esc(c)}</th>`).join("")}</tr></thead><tbody>` +
    rows.map(r => `<tr>${cols.map(c => `<td>${fmt(r[c])}</td>`).join("")}</tr>`).join("") + "</tbody></table>";
}

// ------------------------------------------------------------------ rollouts

const rollouts = {
  async runs() {
    const data = await api("/api/runs");
    const sel = $("#run");
    data.runs.forEach(r => sel.add(new Option(r.id, r.id)));
    if (sel.dataset.initial) { sel.value = sel.dataset.initial; await this.sources(); }
  },

  async sources() {
    const run = $("#run").value;
    const sel = $("#source");
    sel.innerHTML = "";
    if (!run) return;
    const list = await api("/api/rollouts/sources?run=" + encodeURIComponent(run));
    list.forEach(s => sel.add(new Option(`${s.path} (${s.kind}, ${s.error ? "unreadable" : s.count})`, s.path)));
    if (!list.length) $("#rollout-count").textContent = "this run stored no experiences and no eval trajectories";
    else await this.show();
  },

  async show() {
    const p = new URLSearchParams({run: $("#run").value, source: $("#source").value, min_reward: $("#min-reward").value,
                                   max_reward: $("#max-reward").value, step: $("#step").value});
    let r;
    try { r = await api("/api/rollouts?" + p); }
    catch (e) { $("#rollout-count").textContent = e.message; return; }
    $("#rollout-count").textContent = `${r.matched} of ${r.read} match` + (r.read < r.total ? ` (the first ${r.read} of ${r.total} stored read)` : "") +
      (r.rows.length < r.matched ? `; the first ${r.rows.length} shown` : "");
    $("#rollouts tbody").innerHTML = r.rows.map(x => {
      const parts = Object.entries(x.parts || {}).map(([k, v]) => `${esc(k)}=${fmt(v)}`).join(" ");
      const response = x.segments ? `<div class="turn">` + x.segments.map(g =>
          `<span class="${g.trained ? "trained" : "masked"}" title="${g.trained ? "trained (loss mask 1)" : "masked (loss mask 0)"}">${esc(g.text)}</span>`).join("") + "</div>"
        : x.turns ? x.turns.map(t => `<div class="turn ${t.trained ? "trained" : "masked"}" title="${t.trained ? "trained (loss mask 1)" : "masked (context only)"}">` +
        `<span class="role">${esc(t.role)}</span>${esc(t.content)}${t.tool_calls ? " " + esc(JSON.stringify(t.tool_calls)) : ""}</div>`).join("")
        : `<div class="turn trained">${esc(x.response)}</div>`;
      return `<tr data-reward="${esc(x.reward)}"><td>${fmt(x.i)}</td><td>${fmt(x.step)}</td><td>${esc(x.task_id)}</td><td class="reward">${fmt(x.reward)}</td>` +
             `<td>${parts}</td><td>${fmt(x.length)}</td><td class="text">${esc(x.prompt)}</td><td class="text">${response}</td></tr>`;
    }).join("");
  },

  init() {
    $("#run").addEventListener("change", () => this.sources());
    $("#source").addEventListener("change", () => this.show());
    $("#filter").addEventListener("click", () => this.show());
    this.runs();
  },
};

// the page's own part comes from the API (with the token), then starts
(async () => {
  const page = document.body.dataset.page;
  try {
    $("#main").innerHTML = await (await fetchPage(page)).text();
  } catch (e) { $("#main").innerHTML = `<p class="error">${esc(e.message)}</p>`; return; }
  ({compose, runs, rollouts})[page]?.init();
})();

async function fetchPage(page) {
  const r = await fetch(`/api/page/${page}${location.search}`, {headers: auth()});
  if (!r.ok) throw new Error((await r.text()) || r.statusText);
  return r;
}
