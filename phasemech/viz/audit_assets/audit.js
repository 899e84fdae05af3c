// phasemech audit page: reads the JSON embedded in #phasemech-data, draws with plotly.js.
// The figures are drawn in Python (phasemech.viz.audit.audit_figures) and only replayed here;
// this script picks the setting, fills the summary strip and the clicked head's side panel.
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("phasemech-data").textContent);
  const $ = (id) => document.getElementById(id);
  const st = { s: D.initial, label: null, phase: -1 };
  const cfg = { displaylogo: false, responsive: true };
  const font = { family: "Helvetica, Arial, sans-serif", size: 12 };

  const fmt = (x, nd = 3) => (x === null || x === undefined ? "–" : Number(x).toFixed(nd));
  const ci = (lo, hi, nd = 3) => `[${fmt(lo, nd)}, ${fmt(hi, nd)}]`;
  const esc = (x) => String(x).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  const setting = () => D.settings[st.s];
  const phases = () => Array.from({ length: D.stride }, (_, p) => p);
  // a fresh copy each draw: plotly keeps (and later edits) the objects it is given
  const copy = (x) => JSON.parse(JSON.stringify(x));

  // ------------------------------------------------------------------ header and summary strip
  function renderMeta() {
    const m = D.meta;
    $("meta").textContent = `model ${m.model} · task ${m.task} · regime ${m.regime} · context ${m.context} tokens · stride ${D.stride} · ${m.contents} contents`;
  }
  function renderSummary() {
    const s = setting(), e = s.summary;
    const cells = [
      `<span class="cell" id="sum-setting"><b>${esc(s.name)}</b>${e.description ? ": " + esc(e.description) : ""}</span>`,
      `<span class="cell" id="sum-acc">accuracy <b>${fmt(e.accuracy)}</b> (null ${fmt(D.null_accuracy)})</span>`,
    ];
    e.acc_by_phase.forEach((a, p) => {
      cells.push(`<span class="cell phase" data-phase="${p}">φ${p} ${fmt(a)}</span>`);
    });
    cells.push(`<span class="cell" id="sum-gap">debiased phase gap <b>${fmt(e.debiased_gap)}</b> ${ci(e.gap_lo, e.gap_hi)}</span>`);
    cells.push(`<span class="cell" id="sum-p">p<sub>perm</sub> ${fmt(e.p_perm)} · p<sub>Cochran</sub> ${fmt(e.p_cochran)}</span>`);
    $("summary").innerHTML = cells.join("");
    $("claim").textContent = `What an average or random-offset test would report: ${e.average_claim}`;
    highlight();
  }
  function highlight() {
    document.querySelectorAll("#summary .phase, #head-numbers tr[data-phase]").forEach((el) => {
      el.classList.toggle("hl", Number(el.dataset.phase) === st.phase);
    });
  }

  // ------------------------------------------------------------------ the three figures
  function draw(id, fig) {
    const f = copy(fig);
    return Plotly.react($(id), f.data, f.layout, cfg);
  }
  function headShapes() {
    const h = setting().heads, i = h.labels.indexOf(st.label);
    if (i < 0) return [];
    return [{ type: "rect", xref: "paper", yref: "y", x0: 0, x1: 1, y0: i - 0.5, y1: i + 0.5,
      line: { color: "#d55e00", width: 2, dash: "dot" } }];
  }

  // ------------------------------------------------------------------ head side panel
  function renderTable(h, i) {
    const s = setting();
    const rows = [`<tr><th>phase</th><th>null</th><th>${esc(s.name)}</th><th>Δ</th></tr>`];
    phases().forEach((p) => {
      const a = h.null_mass[i][p], b = h.mass[i][p];
      const diff = a === null || b === null ? null : b - a;
      rows.push(`<tr data-phase="${p}"><td>${p}</td><td>${fmt(a)}</td><td>${fmt(b)}</td><td>${fmt(diff)}</td></tr>`);
    });
    $("head-numbers").innerHTML = rows.join("");
  }
  function renderHeadPlot(h, i) {
    const s = setting();
    const bar = (name, y, color) => ({ type: "bar", name, x: phases(), y, marker: { color, line: { color: "#333", width: 1 } },
      hovertemplate: `${name}<br>phase %{x}<br>mass %{y:.3f}<extra></extra>` });
    Plotly.react($("head-plot"), [bar("null", h.null_mass[i], s.colors.null), bar(esc(s.name), h.mass[i], s.colors.setting)],
      { font, height: 260, barmode: "group", margin: { l: 50, r: 10, t: 30, b: 80 },
        title: { text: `${esc(st.label)}: attention mass on the needle`, font: { size: 12 } },
        legend: { orientation: "h", y: -0.4 },
        xaxis: { tickvals: phases(), title: { text: "needle phase" } }, yaxis: { rangemode: "tozero" } }, cfg);
  }
  function selectHead(label) {
    const h = setting().heads, i = h.labels.indexOf(label);
    if (i < 0) return;
    st.label = label;
    $("head-title").textContent = label;
    $("head-title").dataset.layer = h.layer[i];
    $("head-title").dataset.head = h.head[i];
    $("head-sub").textContent = `mass by phase: null vs ${setting().name}`;
    renderTable(h, i);
    renderHeadPlot(h, i);
    highlight();
    Plotly.relayout($("heads-plot"), { shapes: headShapes() });
  }

  // ------------------------------------------------------------------ setting
  function showSetting(k) {
    st.s = k;
    const s = setting();
    $("setting").value = String(k);
    renderSummary();
    draw("accuracy-plot", s.figures.accuracy);
    draw("depth-plot", s.figures.depth);
    draw("heads-plot", s.figures.heads);
    // keep the inspected head across settings when it exists there
    selectHead(s.heads.labels.includes(st.label) ? st.label : s.heads.initial);
  }

  // ------------------------------------------------------------------ wiring
  D.settings.forEach((s, k) => {
    const o = document.createElement("option");
    o.value = String(k);
    o.textContent = s.name;
    $("setting").appendChild(o);
  });
  $("setting-picker").hidden = D.settings.length < 2;
  $("setting").addEventListener("change", () => showSetting(Number($("setting").value)));
  renderMeta();
  showSetting(D.initial);
  $("heads-plot").on("plotly_click", (ev) => {
    const pt = ev.points[0];
    // a click picks the head and highlights the cell's phase; the same cell again clears it
    const again = String(pt.y) === st.label && pt.x === st.phase;
    st.phase = again || typeof pt.x !== "number" ? -1 : pt.x;
    selectHead(String(pt.y));
  });
  window.phasemechAudit = { state: st, data: D, selectHead, showSetting };
})();
