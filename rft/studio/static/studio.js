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
  return String(s ?? "").replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}

// a number as text: 4 significant digits without trailing zeros (0.5, not 0.5000), whole above 1000
function num(v) {
  if (typeof v !== "number") return v === null || v === undefined ? "" : String(v);
  if (Number.isInteger(v)) return String(v);
  return Math.abs(v) >= 1000 ? String(Math.round(v)) : String(Number(v.toPrecision(4)));
}

// a value as HTML text: escaped, whatever a file under the root put there (a run's files are data)
function fmt(v) { return esc(num(v)); }

function when(t) {  // seconds since the epoch -> "2026-11-27 13:05"
  if (!t) return "";
  const d = new Date(t * 1000), p = n => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}`;
}

function duration(s) {
  if (s === null || s === undefined) return "";
  s = Math.round(s);
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor(s % 3600 / 60)} min`;
}

// rows of a table kept in place: each row's element stays (focus, ticks and open menus with it);
// only cells whose text changed are written, rows move only when their order changed
function placeRows(tbody, wanted) {
  const active = document.activeElement;
  wanted.forEach((tr, i) => { if (tbody.children[i] !== tr) tbody.insertBefore(tr, tbody.children[i] || null); });
  while (tbody.children.length > wanted.length) tbody.lastElementChild.remove();
  if (active && active !== document.activeElement && active.isConnected) active.focus({preventScroll: true});
}

function setText(el, text) { if (el.textContent !== text) el.textContent = text; }

function sweepLabel(s) {  // "4 of 6 jobs": the job directories of the jobs the sweep planned (null: not known)
  return s.planned > s.jobs ? `${s.jobs} of ${s.planned} jobs` : `${s.jobs} jobs`;
}

// ------------------------------------------------------------------ jobs (compose and runs pages)

const jobs = {
  shown: null,       // the launch whose console is shown
  offset: 0,
  rows: new Map(),

  async refresh() {
    let list;
    try { list = await api("/api/launches"); } catch (e) { return; }
    const tbody = $("#jobs tbody");
    for (const j of list) {
      let tr = this.rows.get(j.id);
      if (!tr) {
        tr = document.createElement("tr");
        tr.dataset.job = j.id;
        tr.innerHTML = `<td>${fmt(j.id)}</td><td><code></code></td><td class="status"></td><td>${esc(when(j.started))}</td>` +
          `<td class="links"></td><td><button data-show="${j.id}">console</button> <button data-stop="${j.id}">stop</button></td>`;
        $("code", tr).textContent = j.command;
        this.rows.set(j.id, tr);
      }
      setText($(".status", tr), j.status);
      tr.dataset.status = j.status;
      const link = j.run ? `<a href="/runs?run=${encodeURIComponent(j.run)}">${esc(j.run)}</a>`
        : j.sweep ? `<a href="/runs?sweep=${encodeURIComponent(j.sweep)}">${esc(j.sweep)}</a>` : "";
      const links = $(".links", tr);
      if (links.dataset.html !== link) { links.innerHTML = link; links.dataset.html = link; }
      $("[data-stop]", tr).disabled = j.status !== "running";
      tr.classList.toggle("shown", j.id === this.shown);
    }
    placeRows(tbody, list.slice().reverse().map(j => this.rows.get(j.id)));  // newest first
    if (this.shown === null && list.length) this.show(list[list.length - 1].id);
  },

  show(id) {
    this.shown = id; this.offset = 0; $("#console").textContent = "";
    $$("#jobs tr[data-job]").forEach(tr => tr.classList.toggle("shown", Number(tr.dataset.job) === id));
    this.poll();
  },

  async poll() {
    const id = this.shown;
    if (id === null) return;
    clearTimeout(this.timer);
    try {
      const r = await api(`/api/launch/${id}?offset=${this.offset}`);
      if (id !== this.shown) return;  // another job was chosen meanwhile
      const con = $("#console");
      const atEnd = con.scrollTop + con.clientHeight >= con.scrollHeight - 4;
      con.textContent += r.text;
      if (atEnd) con.scrollTop = con.scrollHeight;
      this.offset = r.offset;
      $("#launch-status").textContent = `launch ${r.id}: ${r.status} — ${r.command}`;
      $("#launch-status").dataset.status = r.status;
      $("#stop").disabled = r.status !== "running";
      if (r.status === "running" || r.status === "stopping" || r.text) this.timer = setTimeout(() => this.poll(), 1000);
    } catch (e) { $("#launch-status").textContent = e.message; }
  },

  async stop(id) {
    try { await api(`/api/launch/${id}/stop`, {}); } catch (e) { $("#launch-status").textContent = e.message; }
    this.refresh(); if (id === this.shown) this.poll();
  },

  init() {
    $("#jobs").addEventListener("click", e => {
      const b = e.target.closest("button");
      if (b?.dataset.show) this.show(Number(b.dataset.show));
      if (b?.dataset.stop) this.stop(Number(b.dataset.stop));
    });
    $("#stop").addEventListener("click", () => { if (this.shown !== null) this.stop(this.shown); });
    const tick = async () => { try { await this.refresh(); } finally { setTimeout(tick, 2000); } };
    tick();
  },
};

// ------------------------------------------------------------------ compose

const compose = {
  keys: {},          // key -> override text the user set
  picked: new Set(), // the groups the user chose; the others show what the composition chose (a study's)
  timer: null,
  seq: 0,

  choices() {
    const out = {};
    $$("select[data-group]").forEach(s => { if (this.picked.has(s.dataset.group)) out[s.dataset.group] = s.value; });
    return out;
  },

  body() {
    return {choices: this.choices(), keys: this.keys, sweep: $("#sweep").checked, sweep_params: $("#sweep-params").value,
            launcher: $("#launcher").value};
  },

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
    for (const [group, option] of Object.entries(r.choices || {})) {  // an experiment's groups, as composed
      const sel = $(`select[data-group="${CSS.escape(group)}"]`);
      if (sel && sel.value !== option && $$("option", sel).some(o => o.value === option)) { sel.value = option; this.comments(); }
    }
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
    const refused = $("#launch-refused");
    refused.hidden = true;
    try {
      const r = await api("/api/launch", {...this.body(), confirm_imports: confirmed});
      await jobs.refresh();
      jobs.show(r.id);
    } catch (e) {
      const imports = e.status === 409 && e.data.imports;
      if (imports && !confirmed.length) this.showImports(imports);
      if (imports && !confirmed.length && window.confirm("This run imports code from outside rft and this repository:\n\n" +
          imports.map(i => `${i.path}  (${i.key})`).join("\n") + "\n\nLaunch it only if you trust that code. Launch?")) {
        return this.start(imports.map(i => i.path));
      }
      refused.hidden = false; refused.textContent = e.message;
      $("#launch-status").textContent = e.message; $("#launch-status").dataset.status = "refused";
    }
  },

  comments() {
    $$("select[data-group]").forEach(s => {
      $("#comment-" + CSS.escape(s.dataset.group)).textContent = s.selectedOptions[0]?.title || "";
    });
  },

  init() {
    $$("select[data-group]").forEach(s => s.addEventListener("change", () => {
      this.picked.add(s.dataset.group); this.comments(); this.schedule();
    }));
    $$("[data-key]").forEach(input => {
      const changed = () => { this.keys[input.dataset.key] = input.value; this.schedule(); };
      input.addEventListener(input.tagName === "SELECT" ? "change" : "input", changed);
    });
    $$("[data-reset]").forEach(b => b.addEventListener("click", () => { delete this.keys[b.dataset.reset]; this.schedule(); }));
    ["#sweep", "#launcher"].forEach(s => $(s).addEventListener("change", () => this.schedule()));
    $("#sweep-params").addEventListener("input", () => this.schedule());
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
    this.comments();
    this.refresh();
    jobs.init();
  },
};

// ------------------------------------------------------------------ runs

const BASE_COLUMNS = [
  {key: "id", label: "run"}, {key: "status", label: "status"}, {key: "stage", label: "stage"},
  {key: "steps", label: "steps", num: true}, {key: "last_eval", label: "last eval", num: true},
  {key: "train_s", label: "train s", num: true, title: "seconds in the steps, evals and saves of the stage shown (not start-up or model loading)"},
  {key: "started", label: "started", title: "when the run, or its last resume, started (its .hydra/ record)"},
  {key: "duration_s", label: "wall time", num: true, title: "from its start to its last metrics (to now, while it runs)"},
];

const runs = {
  checked: new Set(),
  metric: "eval/accuracy",
  data: {runs: [], columns: [], sweeps: []},
  sort: {key: "started", dir: -1},
  rows: new Map(),
  groups: new Map(),
  signature: "",

  columns() { return [...BASE_COLUMNS, ...this.data.columns.map(k => ({key: "p:" + k, label: k}))]; },

  value(r, key) { return key.startsWith("p:") ? r.params[key.slice(2)] : r[key]; },

  text(r, key) {
    const v = this.value(r, key);
    return key === "started" ? when(v) : key === "duration_s" ? duration(v) : num(v);
  },

  header() {
    const cols = this.columns();
    const signature = cols.map(c => c.key).join("\n");
    if (signature === this.signature) return;
    this.signature = signature;
    $("#runs thead").innerHTML = "<tr><th><span hidden>tick</span></th>" + cols.map(c =>
      `<th data-col="${esc(c.key)}" title="${esc(c.title || "")}"><button data-sort="${esc(c.key)}">${esc(c.label)}</button></th>`).join("") +
      "<th></th></tr>";
    this.rows.clear(); this.groups.clear();
    $("#runs tbody").innerHTML = "";
  },

  row(r) {
    let tr = this.rows.get(r.id);
    const cols = this.columns();
    if (!tr) {
      tr = document.createElement("tr");
      tr.dataset.run = r.id;
      tr.innerHTML = `<td><input type="checkbox" data-pick="${esc(r.id)}" aria-label="tick ${esc(r.id)}"></td>` +
        cols.map(c => `<td data-col="${esc(c.key)}" class="${c.num ? "num" : ""}${c.key === "status" ? " status" : ""}"></td>`).join("") +
        `<td class="links"><a href="/rollouts?run=${encodeURIComponent(r.id)}">rollouts</a></td>`;
      $("[data-pick]", tr).checked = this.checked.has(r.id);
      this.rows.set(r.id, tr);
    }
    cols.forEach((c, i) => setText(tr.children[i + 1], this.text(r, c.key)));
    const status = $(".status", tr);
    status.dataset.status = r.status; status.title = r.detail;
    const links = $(".links", tr);
    if (r.bench && !$("[data-bench]", links)) links.insertAdjacentHTML("beforeend", ` <button data-bench="${esc(r.id)}">bench</button>`);
    return tr;
  },

  visible(r) {
    const q = $("#run-search").value.trim().toLowerCase(), s = $("#status-filter").value;
    const text = [r.id, r.stage, r.status, r.config].join(" ").toLowerCase();
    return (!q || text.includes(q)) && (!s || r.status === s);
  },

  ordered() {
    const {key, dir} = this.sort;
    const cmp = (a, b) => {
      const x = this.value(a, key), y = this.value(b, key);
      if (x === y) return 0;
      if (x === null || x === undefined || x === "") return 1;
      if (y === null || y === undefined || y === "") return -1;
      return (typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y), undefined, {numeric: true})) * dir;
    };
    const list = this.data.runs.slice().sort(cmp);
    if (!$("#group-config").checked) return list.map(r => ({r}));
    const by = new Map();
    list.forEach(r => { if (!by.has(r.config)) by.set(r.config, []); by.get(r.config).push(r); });
    return [...by.entries()].flatMap(([config, rs]) => [{group: config, rs}, ...rs.map(r => ({r}))]);
  },

  groupRow(config, rs) {
    let tr = this.groups.get(config);
    if (!tr) {
      tr = document.createElement("tr");
      tr.className = "config-group"; tr.dataset.group = config;
      tr.innerHTML = `<td colspan="${this.columns().length + 2}"></td>`;
      this.groups.set(config, tr);
    }
    const done = rs.filter(r => r.status === "done").length;
    setText(tr.firstElementChild, `${config}: ${rs.length} run${rs.length > 1 ? "s" : ""}, ${done} done`);
    tr.hidden = !rs.some(r => this.visible(r));
    return tr;
  },

  render() {
    this.header();
    const seen = new Set(this.data.runs.map(r => r.id));
    for (const id of this.rows.keys()) if (!seen.has(id)) this.rows.delete(id);
    const wanted = this.ordered().map(x => {
      if (x.group !== undefined) return this.groupRow(x.group, x.rs);
      const tr = this.row(x.r);
      tr.hidden = !this.visible(x.r);
      return tr;
    });
    placeRows($("#runs tbody"), wanted);
    $$("#runs thead th[data-col]").forEach(th => th.setAttribute("aria-sort", th.dataset.col === this.sort.key ?
      (this.sort.dir > 0 ? "ascending" : "descending") : "none"));
    const shown = this.data.runs.filter(r => this.visible(r)).length;
    setText($("#runs-count"), `${this.data.runs.length} runs` + (shown < this.data.runs.length ? `, ${shown} shown` : ""));
  },

  async refresh() {
    try { this.data = await api("/api/runs"); } catch (e) { setText($("#runs-count"), e.message); return; }
    this.render();
    const sel = $("#sweep-choice");
    const known = new Map($$("option", sel).map(o => [o.value, o]));
    this.data.sweeps.forEach(s => {  // a running sweep's count grows as its jobs start
      const label = `${s.id} (${sweepLabel(s)})`, old = known.get(s.id);
      if (!old) sel.add(new Option(label, s.id)); else if (old.text !== label) old.text = label;
    });
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
    const stage = $("#stage").value;
    const q = `metric=${encodeURIComponent(this.metric)}&stage=${encodeURIComponent(stage)}&`;
    $("#to-dashboard").href = "/dashboard?" + this.query();
    const traces = this.checked.size ? await api("/api/curves?" + q + this.query()) : [];
    if (ticket !== this.chartTicket) return;
    this.traces = traces;
    const data = traces.map(t => ({x: t.x, y: t.y, customdata: t.step, name: t.name, mode: "lines+markers", type: "scatter",
      hovertemplate: "%{y:.4g} at step %{customdata} (click: its rollouts)<extra>%{fullData.name}</extra>"}));
    // each stage after the one before: a dotted line where a stage starts, named
    const starts = stage === "all" ? traces.filter(t => t.offset > 0) : [];
    const narrow = $("#chart").clientWidth < 600;
    Plotly.react("chart", data, {
      title: {text: this.metric},
      xaxis: {title: {text: stage === "all" ? "step (each stage after the one before)" : "step"}},
      yaxis: {title: {text: this.metric}},
      // beside the plot (below it on a narrow screen), clear of the axis title
      legend: narrow ? {orientation: "h", x: 0, y: -0.35, yanchor: "top"} : {x: 1.02, xanchor: "left", y: 1},
      margin: {t: 40, b: narrow ? 150 : 60}, hoverlabel: {namelength: -1},
      shapes: starts.map(t => ({type: "line", x0: t.offset, x1: t.offset, yref: "paper", y0: 0, y1: 1, line: {dash: "dot", color: "#888", width: 1}})),
      annotations: starts.map(t => ({x: t.offset, yref: "paper", y: 1, text: t.stage, showarrow: false, xanchor: "left", yanchor: "bottom", font: {size: 10}})),
    }, {displaylogo: false, responsive: true});
    if (!this.clickBound) { $("#chart").on("plotly_click", e => this.jump(e.points[0])); this.clickBound = true; }
  },

  // a point of a curve -> that step's rollouts, in groups (the rollouts page picks the source)
  jump(point) {
    const t = this.traces?.[point.curveNumber];
    if (!t) return;
    location.href = "/rollouts?" + new URLSearchParams({run: t.run, stage: t.stage || "", step: t.step[point.pointIndex],
                                                        metric: this.metric, view: "groups"});
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

  async diff() {
    const out = $("#diff");
    const [a, b] = Array.from(this.checked);
    if (this.checked.size !== 2) { out.innerHTML = `<p class="error">tick two runs to compare their configs (${this.checked.size} ticked)</p>`; return; }
    try {
      const rows = await api(`/api/diff?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`);
      out.innerHTML = `<h3>config diff: ${rows.length} key${rows.length === 1 ? "" : "s"} differ</h3><div class="scroll"><table class="list" id="table-diff">` +
        `<thead><tr><th>key</th><th>${esc(a)}</th><th>${esc(b)}</th></tr></thead><tbody>` +
        rows.map(r => `<tr><td>${esc(r.key)}</td><td>${esc(r.a)}</td><td>${esc(r.b)}</td></tr>`).join("") + "</tbody></table></div>";
    } catch (e) { out.innerHTML = `<div class="error">${esc(e.message)}</div>`; }
  },

  async bench(id) {
    const out = $("#bench");
    try {
      const b = await api("/api/bench?run=" + encodeURIComponent(id));
      out.innerHTML = `<h3>bench: ${esc(id)}</h3><div class="scroll">${table("bench", b.rows)}</div>`;
      if (b.png) { const img = new Image(); img.alt = `bench results of ${id}`; img.src = b.png; out.append(img); }
    } catch (e) { out.innerHTML = `<div class="error">${esc(e.message)}</div>`; }
  },

  async csv() {
    const r = await fetch("/api/runs.csv", {headers: auth()});
    const a = document.createElement("a");
    a.href = URL.createObjectURL(await r.blob()); a.download = "runs.csv";
    document.body.append(a); a.click(); a.remove();
  },

  init() {
    const params = new URLSearchParams(location.search);
    params.getAll("run").forEach(r => this.checked.add(r));
    $("#metric").addEventListener("change", e => { this.metric = e.target.value; this.chart(); });
    $("#stage").addEventListener("change", () => this.chart());
    $("#sweep-choice").addEventListener("change", () => this.sweep());
    $("#runs tbody").addEventListener("change", e => {
      const box = e.target.closest("[data-pick]");
      if (!box) return;
      box.checked ? this.checked.add(box.dataset.pick) : this.checked.delete(box.dataset.pick);
      this.metrics(); this.chart();
    });
    $("#runs").addEventListener("click", e => {
      const b = e.target.closest("button");
      if (b?.dataset.bench) this.bench(b.dataset.bench);
      if (b?.dataset.sort) {
        this.sort = {key: b.dataset.sort, dir: this.sort.key === b.dataset.sort ? -this.sort.dir : 1};
        this.render();
      }
    });
    ["#run-search", "#status-filter", "#group-config"].forEach(s => $(s).addEventListener("input", () => this.render()));
    $("#diff-runs").addEventListener("click", () => this.diff());
    $("#export-csv").addEventListener("click", () => this.csv());
    // a run that trains logs new metrics (eval first, then the step's): list, then draw, every 2 s
    const tick = async () => {
      try { await this.refresh(); await this.metrics(); await this.stages(); await this.chart(); } finally { setTimeout(tick, 2000); }
    };
    tick().then(() => {
      const sweep = params.get("sweep");
      if (sweep) { $("#sweep-choice").value = sweep; this.sweep(); }
    });
    jobs.init();
  },
};

function table(id, rows) {
  if (!rows.length) return "<p>no rows</p>";
  const cols = Object.keys(rows[0]);
  return `<table class="list" id="table-${id}"><thead><tr>${cols.map(c => `<th>${esc(c)}</th>`).join("")}</tr></thead><tbody>` +
    rows.map(r => `<tr>${cols.map(c => `<td>${fmt(r[c])}</td>`).join("")}</tr>`).join("") + "</tbody></table>";
}

// ------------------------------------------------------------------ dashboard

// TensorBoard's smoothing: an exponential moving average, debiased so that it starts at the first value
function ema(ys, a) {
  if (!a) return ys;
  let s = 0, n = 0;
  return ys.map(y => {
    if (y === null || y === undefined) return null;
    s = a * s + (1 - a) * y; n += 1;
    return s / (1 - Math.pow(a, n));
  });
}

const dashboard = {
  // the view lives in the address: run (each ticked), open (each panel group shown), smooth, x, bands
  state() {
    const p = new URLSearchParams(location.search);
    return {runs: p.getAll("run"), open: p.getAll("open"), smooth: Number(p.get("smooth") || 0),
            x: ["time", "experiences"].includes(p.get("x")) ? p.get("x") : "step", bands: p.get("bands") === "1"};
  },

  save() {
    const p = new URLSearchParams();
    $$("#dash-runs input:checked").forEach(b => p.append("run", b.value));
    $$("#panels details[open]").forEach(d => p.append("open", d.dataset.prefix));
    p.set("smooth", $("#smooth").value); p.set("x", $("#xaxis").value); p.set("bands", $("#bands").checked ? "1" : "0");
    history.replaceState(null, "", "/dashboard?" + p);
  },

  async list(s) {
    const data = await api("/api/runs");
    $("#dash-runs").innerHTML = data.runs.map(r => `<label data-run="${esc(r.id)}"><input type="checkbox" value="${esc(r.id)}"` +
      `${s.runs.includes(r.id) ? " checked" : ""}> ${esc(r.id)} <span class="hint">${esc(r.config)}</span></label>`).join("");
  },

  async load() {
    const ids = $$("#dash-runs input:checked").map(b => b.value);
    const status = $("#dash-status");
    if (!ids.length) { this.data = null; $("#panels").innerHTML = $("#dash-key").innerHTML = ""; status.textContent = "tick runs to see their metrics"; return; }
    const ticket = this.ticket = (this.ticket || 0) + 1;
    let data;
    try { data = await api("/api/dashboard?" + ids.map(r => "run=" + encodeURIComponent(r)).join("&")); }
    catch (e) { if (ticket === this.ticket) { status.textContent = e.message; status.className = "error"; } return; }
    if (ticket !== this.ticket) return;
    this.data = data;
    status.className = "";
    const keys = [...new Set(this.data.runs.flatMap(r => Object.keys(r.metrics)))].sort();
    status.textContent = `${ids.length} run${ids.length === 1 ? "" : "s"}, ${keys.length} metrics`;
    if (keys.join("\n") === this.keys && $("#panels").children.length) { this.draw(); return; }  // the same panels: redrawn in place
    this.keys = keys.join("\n");
    const open = this.open ?? new Set(this.data.prefixes.slice(0, 2));
    $("#panels").innerHTML = this.data.prefixes.map(p => `<details data-prefix="${esc(p)}"${open.has(p) ? " open" : ""}>` +
      `<summary>${esc(p)}/ (${keys.filter(k => k.split("/")[0] === p).length})</summary><div class="panel-grid">` +
      keys.filter(k => k.split("/")[0] === p).map(k => `<div class="panel" data-metric="${esc(k)}"></div>`).join("") + "</div></details>").join("");
    this.draw();
  },

  // one colour per run and per configuration, the same in every panel (and in the key above them)
  colour(i) { return ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"][i % 10]; },

  key() {
    // a run of a configuration drawn as a band shows alone where the others did not log the metric
    const bands = $("#bands").checked ? this.data.configs : [];
    $("#dash-key").innerHTML = this.data.runs.map((r, i) => `<span style="color:${this.colour(i)}">■</span> ${esc(r.name)}`)
      .concat(bands.map((c, j) => `<span style="color:${this.colour(this.data.runs.length + j)}">■</span> ${esc(c.config)} (mean ± std of ${c.runs.length})`))
      .join(" &nbsp; ");
  },

  traces(key) {
    const smooth = Number($("#smooth").value), x = $("#xaxis").value, bands = $("#bands").checked;
    const banded = new Set(bands ? this.data.configs.filter(c => c.bands[key]).flatMap(c => c.runs) : []);
    const out = this.data.runs.map((r, i) => [r, i]).filter(([r]) => key in r.metrics && !banded.has(r.id)).map(([r, i]) => ({
      x: r[x], y: ema(r.metrics[key], smooth), name: r.name, mode: "lines", type: "scatter", connectgaps: true, line: {color: this.colour(i)}}));
    for (const [j, c] of (bands ? this.data.configs : []).entries()) {
      const b = c.bands[key], colour = this.colour(this.data.runs.length + j);
      if (!b) continue;
      const up = b.mean.map((m, i) => m + b.std[i]), down = b.mean.map((m, i) => m - b.std[i]);
      out.push({x: b[x], y: ema(down, smooth), mode: "lines", line: {width: 0}, showlegend: false, hoverinfo: "skip", name: c.config + " - std"},
               {x: b[x], y: ema(up, smooth), mode: "lines", line: {width: 0}, fill: "tonexty", fillcolor: colour + "33", showlegend: false, hoverinfo: "skip", name: c.config + " + std"},
               {x: b[x], y: ema(b.mean, smooth), mode: "lines", name: `${c.config} (mean of ${c.runs.length})`, line: {width: 2, color: colour}});
    }
    return out;
  },

  draw() {
    if (!this.data) return;
    this.key();
    const x = $("#xaxis").value;
    $$("#panels details[open] .panel").forEach(div => {
      const key = div.dataset.metric;
      const starts = [...new Set(this.data.runs.filter(r => key in r.metrics).flatMap(r => r.stages.filter(s => s[x] > 0).map(s => s[x])))];
      Plotly.react(div, this.traces(key), {
        title: {text: key, font: {size: 12}}, height: 240, margin: {t: 30, l: 45, r: 10, b: 35}, showlegend: false,
        xaxis: {title: {text: {time: "s", experiences: "experiences"}[x] || "step"}}, hoverlabel: {namelength: -1},
        shapes: starts.map(s => ({type: "line", x0: s, x1: s, yref: "paper", y0: 0, y1: 1, line: {dash: "dot", color: "#888", width: 1}})),
      }, {displaylogo: false, responsive: true});
    });
  },

  async init() {
    const s = this.state();
    $("#smooth").value = s.smooth; $("#smooth-value").textContent = $("#smooth").value;
    $("#xaxis").value = s.x; $("#bands").checked = s.bands;
    if (s.open.length) this.open = new Set(s.open);
    await this.list(s);
    $("#dash-runs").addEventListener("change", async () => { await this.load(); this.save(); });
    $("#dash-search").addEventListener("input", e => $$("#dash-runs label").forEach(l => {
      l.hidden = !l.dataset.run.toLowerCase().includes(e.target.value.toLowerCase()); }));
    $("#smooth").addEventListener("input", () => { $("#smooth-value").textContent = $("#smooth").value; this.draw(); this.save(); });
    ["#xaxis", "#bands"].forEach(sel => $(sel).addEventListener("change", () => { this.draw(); this.save(); }));
    // a group opened or closed: drawn when opened, and remembered
    $("#panels").addEventListener("toggle", e => {
      this.open = new Set($$("#panels details[open]").map(d => d.dataset.prefix)); this.draw(); this.save(); }, true);
    // a run that trains logs new metrics: read again every 5 s (only the newest answer draws)
    const tick = async () => { try { await this.load(); } finally { setTimeout(tick, 5000); } };
    await tick();
  },
};

// ------------------------------------------------------------------ rollouts

const rollouts = {
  offset: 0,
  // the orders of each view (rollouts.py's and groups.py's SORTS: the server checks them)
  sorts: {rows: {"": "stored order", reward_desc: "reward, highest first", reward_asc: "reward, lowest first", length_desc: "length, longest first"},
          groups: {"": "stored order", spread: "reward spread, widest first", mean_desc: "mean reward, highest first", mean_asc: "mean reward, lowest first"}},
  view() { return $("#view").value; },
  limit() { return this.view() === "groups" ? 5 : 50; },

  async runs() {
    const data = await api("/api/runs");
    const sel = $("#run");
    data.runs.forEach(r => sel.add(new Option(r.id, r.id)));
    if (sel.dataset.initial) { sel.value = sel.dataset.initial; await this.sources(new URLSearchParams(location.search)); }
  },

  // a jump from a curve's point (?stage=&step=&metric=, the runs page): the stage's stored
  // experiences of the explore step that training step `step` learned from (step - 1: its
  // reward/ metrics are that explore step's), or an eval/ metric's trajectories of that step
  target(params, list) {
    const stage = params.get("stage"), step = Number(params.get("step")), metric = params.get("metric") || "";
    const under = s => !stage || s.path.startsWith(stage + "/");
    if (metric.startsWith("eval/")) {
      const evals = list.filter(s => under(s) && s.kind === "eval" && ("/" + s.path).includes(`/eval_trajectories/step_${step}/`));  // a run of one stage: no stage dir
      const set = metric.split("/").length > 2 ? metric.split("/")[1] : "";
      const hit = evals.find(s => ("/" + s.path).endsWith(`/${set}.jsonl`)) || evals[0];
      if (hit) return {source: hit.path, step, note: `${metric} at step ${step}: the eval's trajectories of that step`};
    }
    const exp = list.find(s => under(s) && s.kind === "experiences");
    if (exp) return {source: exp.path, step: step - 1, note: `${metric || "a curve"} at step ${step}: training step ${step} learned from explore step ${step - 1}, whose groups these are`};
    return {source: list[0].path, step: "", note: `stage ${stage} stored no rollouts of step ${step} (buffer=sql or buffer=file keeps experiences)`};
  },

  async sources(params) {
    const run = $("#run").value;
    const sel = $("#source");
    sel.innerHTML = "";
    if (!run) return;
    const list = await api("/api/rollouts/sources?run=" + encodeURIComponent(run));
    list.forEach(s => sel.add(new Option(`${s.path} (${s.kind}, ${s.error ? "unreadable" : s.count})`, s.path)));
    if (!list.length) { $("#rollout-count").textContent = "this run stored no experiences and no eval trajectories"; return; }
    this.jumpNote = "";
    if (params?.get("view")) { $("#view").value = params.get("view"); this.setView(); }
    if (params?.get("source")) sel.value = params.get("source");
    else if (params?.get("step")) {
      const t = this.target(params, list);
      sel.value = t.source; $("#step").value = t.step; this.jumpNote = t.note;
    }
    await this.show(0);
  },

  setView() {
    const groups = this.view() === "groups";
    $("#groups").hidden = !groups; $("#rows-view").hidden = groups;
    $("#min-reward").disabled = $("#max-reward").disabled = groups;  // a group is shown whole
    $("#step-label").textContent = groups ? "explore step" : "version / step";
    $("#sort").innerHTML = Object.entries(this.sorts[this.view()]).map(([k, v]) => `<option value="${k}">${esc(v)}</option>`).join("");
  },

  async show(offset) {
    const groups = this.view() === "groups";
    const p = new URLSearchParams({run: $("#run").value, source: $("#source").value, step: $("#step").value,
                                   search: $("#search").value, sort: $("#sort").value, offset, limit: this.limit()});
    if (!groups) { p.set("min_reward", $("#min-reward").value); p.set("max_reward", $("#max-reward").value); }
    const count = $("#rollout-count");
    const ticket = this.ticket = (this.ticket || 0) + 1;  // only the newest request shows its rows
    this.offset = offset;  // a second "next" before this answer pages on from here
    let r;
    try { r = await api((groups ? "/api/rollouts/groups?" : "/api/rollouts?") + p); }
    catch (e) { if (ticket === this.ticket) { count.textContent = e.message; count.className = "error"; } return; }
    if (ticket !== this.ticket) return;
    count.className = "";
    const n = groups ? r.groups.length : r.rows.length, last = offset + n;
    count.textContent = `${r.matched}${groups ? " groups" : ""} of ${r.read}${groups ? " rollouts" : ""} match` +
      (r.read < r.total ? ` (the first ${r.read} of ${r.total} stored read)` : "") +
      (n < r.matched ? `; ${n ? offset + 1 : 0}-${last} shown` : "");
    $("#page-prev").disabled = offset === 0;
    $("#page-next").disabled = last >= r.matched;
    if (groups) this.drawGroups(r); else this.drawRows(r);
  },

  drawRows(r) {
    $("#rollouts tbody").innerHTML = r.rows.map(x => `<tr data-reward="${esc(x.reward)}"><td>${fmt(x.i)}</td><td>${fmt(x.step)}</td>` +
      `<td>${esc(x.task_id)}</td><td class="reward">${fmt(x.reward)}</td><td>${parts(x)}</td><td>${fmt(x.length)}</td>` +
      `<td class="text">${esc(x.prompt)}</td><td class="text">${response(x)}</td></tr>`).join("");
  },

  drawGroups(r) {
    $("#group-notes").textContent = [this.jumpNote, r.advantage, r.references && "reference answers: " + r.references,
                                     r.steps.length ? `explore steps stored: ${r.steps[0]}-${r.steps[r.steps.length - 1]}` : ""].filter(Boolean).join(" · ");
    $("#group-list").innerHTML = r.groups.map(g => `<section class="group-view" data-group="${esc(g.group_id)}">` +
      `<h3>task ${esc(g.task_id)} · explore step ${fmt(g.step)} · ${g.size} rollouts · reward ${fmt(g.mean)} ± ${fmt(g.std)}</h3>` +
      `<div class="reference">reference answer: <code>${g.reference === null ? "(not found)" : esc(g.reference)}</code></div>` +
      `<div class="turn masked">${esc(g.prompt)}</div><div class="members">` +
      g.members.map(m => `<div class="member" data-i="${m.i}"><div class="score">#${fmt(m.i)} · reward <b class="reward">${fmt(m.reward)}</b>` +
        ` · advantage <b class="advantage">${m.advantage === null ? "-" : fmt(m.advantage)}</b>${m.length === null ? "" : ` · ${fmt(m.length)} token${m.length === 1 ? "" : "s"}`}` +
        `<div>${parts(m)}</div></div>${response(m)}</div>`).join("") + "</div></section>").join("");
  },

  init() {
    this.setView();
    $("#run").addEventListener("change", () => this.sources());
    $("#source").addEventListener("change", () => this.show(0));
    $("#view").addEventListener("change", () => { this.setView(); this.show(0); });
    $("#sort").addEventListener("change", () => this.show(0));
    // the filter button, or Enter in any of the fields
    $("#rollout-form").addEventListener("submit", e => { e.preventDefault(); this.show(0); });
    $("#page-prev").addEventListener("click", () => this.show(Math.max(0, this.offset - this.limit())));
    $("#page-next").addEventListener("click", () => this.show(this.offset + this.limit()));
    this.runs();
  },
};

function parts(x) { return Object.entries(x.parts || {}).map(([k, v]) => `${esc(k)}=${fmt(v)}`).join(" "); }

// a response as text: its tokens in runs of equal loss mask, a conversation's turns, or its text
function response(x) {
  if (x.segments) return `<div class="turn">` + x.segments.map(g =>
    `<span class="${g.trained ? "trained" : "masked"}" title="${g.trained ? "trained (loss mask 1)" : "masked (loss mask 0)"}">${esc(g.text)}</span>`).join("") + "</div>";
  if (x.turns) return x.turns.map(t => `<div class="turn ${t.trained ? "trained" : "masked"}" title="${t.trained ? "trained (loss mask 1)" : "masked (context only)"}">` +
    `<span class="role">${esc(t.role)}</span>${esc(t.content)}${t.tool_calls ? " " + esc(JSON.stringify(t.tool_calls)) : ""}</div>`).join("");
  return `<div class="turn trained">${esc(x.response)}</div>`;
}

// the page's own part comes from the API (with the token), then starts
(async () => {
  const page = document.body.dataset.page;
  try {
    $("#main").innerHTML = await (await fetchPage(page)).text();
  } catch (e) { $("#main").innerHTML = `<p class="error">${esc(e.message)}</p>`; return; }
  ({compose, runs, dashboard, rollouts})[page]?.init();
})();

async function fetchPage(page) {
  const r = await fetch(`/api/page/${page}${location.search}`, {headers: auth()});
  if (!r.ok) throw new Error((await r.text()) || r.statusText);
  return r;
}
