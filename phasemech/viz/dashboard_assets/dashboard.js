// phasemech dashboard: reads the JSON embedded in #phasemech-data, draws with plotly.js.
// Everything shown is precomputed in Python (phasemech.dashboard.model_panel); this script only
// selects, formats and highlights.
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("phasemech-data").textContent);
  const $ = (id) => document.getElementById(id);
  const st = { m: 0, h: 0, phase: -1 };
  const cfg = { displaylogo: false, responsive: true };
  const font = { family: "Helvetica, Arial, sans-serif", size: 12 };

  const fmt = (x, nd = 3) => (x === null || x === undefined ? "–" : Number(x).toFixed(nd));
  const ci = (lo, hi, nd = 3) => `[${fmt(lo, nd)}, ${fmt(hi, nd)}]`;
  const uniq = (xs) => Array.from(new Set(xs));
  const esc = (x) => String(x).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  // the same ranking as phasemech.dashboard.head_rank_key: Holm-significant first, then the
  // range of the per-phase ablation effect
  const rankKey = (h) => [h.p_holm !== null && h.p_holm < 0.05 ? 1 : 0, h.effect_range ?? 0];
  const better = (a, b) => { const x = rankKey(a), y = rankKey(b); return x[0] !== y[0] ? x[0] > y[0] : x[1] > y[1]; };
  const model = () => D.models[st.m];
  const head = () => model().heads[st.h];
  const phases = () => Array.from({ length: model().phase_stride }, (_, p) => p);
  const phaseColor = (p) => {
    const d = model().phase_stride;
    const t = d > 1 ? p / (d - 1) : 0;
    // sample the embedded phase colour scale (piecewise linear in RGB)
    const s = D.phase_scale;
    let i = 0;
    while (i < s.length - 2 && t > s[i + 1][0]) i++;
    const [t0, c0] = s[i], [t1, c1] = s[i + 1];
    const f = t1 > t0 ? (t - t0) / (t1 - t0) : 0;
    const a = c0.match(/\d+(\.\d+)?/g).map(Number), b = c1.match(/\d+(\.\d+)?/g).map(Number);
    return `rgb(${a.slice(0, 3).map((v, k) => Math.round(v + f * (b[k] - v))).join(",")})`;
  };

  // ------------------------------------------------------------------ model pickers
  function fillSelect(el, values, labels, keep) {
    el.innerHTML = "";
    values.forEach((v, i) => {
      const o = document.createElement("option");
      o.value = String(v);
      o.textContent = labels ? labels[i] : String(v);
      el.appendChild(o);
    });
    if (keep !== undefined && values.map(String).includes(String(keep))) el.value = String(keep);
  }
  function refreshPickers(keepModel) {
    const design = $("design").value;
    const strides = uniq(D.models.filter((m) => m.design === design).map((m) => m.stride)).sort((a, b) => a - b);
    fillSelect($("stride"), strides, null, keepModel !== undefined ? D.models[keepModel].stride : $("stride").value);
    const stride = Number($("stride").value);
    const idx = D.models.map((m, i) => i).filter((i) => D.models[i].design === design && D.models[i].stride === stride);
    fillSelect($("model"), idx, idx.map((i) => D.models[i].name), keepModel);
    showModel(Number($("model").value));
  }

  // ------------------------------------------------------------------ summary strip
  function renderSummary() {
    const m = model(), s = m.summary;
    const cells = [
      `<span class="cell"><b>${esc(m.name)}</b> (${esc(m.design)}, d=${m.phase_stride}, ${m.n_heads} heads, step ${m.trained_steps ?? "?"})</span>`,
      `<span class="cell" id="sum-acc">accuracy <b>${fmt(s.accuracy)}</b> (n=${s.n})</span>`,
    ];
    s.per_phase.forEach((r) => {
      cells.push(`<span class="cell phase" data-phase="${r.phase}">φ${r.phase} ${fmt(r.accuracy)} ${ci(r.lo, r.hi)}</span>`);
    });
    cells.push(`<span class="cell" id="sum-gap">debiased phase gap <b>${fmt(s.debiased_gap)}</b> ${ci(s.gap_lo, s.gap_hi)} (raw ${fmt(s.raw_gap)}, p<sub>perm</sub> ${fmt(s.p_perm, 3)})</span>`);
    $("summary").innerHTML = cells.join("");
    highlightSummary();
  }
  function highlightSummary() {
    document.querySelectorAll("#summary .phase").forEach((el) => {
      el.classList.toggle("hl", Number(el.dataset.phase) === st.phase);
    });
  }

  // ------------------------------------------------------------------ head x phase heatmap
  function heatShapes() {
    const m = model(), shapes = [];
    if (st.phase >= 0) {
      shapes.push({ type: "rect", xref: "x", yref: "paper", x0: st.phase - 0.5, x1: st.phase + 0.5, y0: 0, y1: 1,
        line: { color: "#000", width: 2.5 } });
    }
    shapes.push({ type: "rect", xref: "paper", yref: "y", x0: 0, x1: 1, y0: st.h - 0.5, y1: st.h + 0.5,
      line: { color: "#000", width: 2, dash: "dot" } });
    return shapes;
  }
  function renderHeatmap() {
    const m = model(), view = $("view").value;
    const z = m.heads.map((h) => (view === "effect" ? h.effect : h.mass));
    const flat = z.flat().filter((v) => v !== null);
    let trace;
    if (view === "effect") {
      const zmax = Math.max(0.01, ...flat.map(Math.abs));
      trace = { z, colorscale: D.effect_scale, zmin: -zmax, zmax, zmid: 0,
        colorbar: { title: { text: "Δ acc" }, thickness: 12 },
        customdata: m.heads.map((h) => h.effect.map((_, p) => [h.effect_lo[p], h.effect_hi[p], h.effect_n[p]])),
        hovertemplate: "%{y} phase %{x}<br>effect %{z:.3f}<br>95% CI [%{customdata[0]:.3f}, %{customdata[1]:.3f}]<br>n %{customdata[2]}<extra></extra>" };
    } else {
      trace = { z, colorscale: D.phase_scale, zmin: 0, zmax: Math.max(0.01, ...flat),
        colorbar: { title: { text: "mass" }, thickness: 12 },
        customdata: m.heads.map((h) => h.mass_n),
        hovertemplate: "%{y} phase %{x}<br>mass on needle %{z:.3f}<br>n %{customdata}<extra></extra>" };
    }
    Object.assign(trace, { type: "heatmap", x: phases(), y: m.heads.map((h) => h.label), xgap: 1, ygap: 1 });
    const layout = { font, margin: { l: 60, r: 10, t: 40, b: 45 }, height: Math.max(260, 34 * m.heads.length + 90),
      title: { text: view === "effect" ? "zero-ablation effect on accuracy by needle phase" : "attention mass from the answer onto its needle", font: { size: 13 } },
      xaxis: { title: { text: "needle phase" }, tickvals: phases(), fixedrange: true },
      yaxis: { autorange: "reversed", fixedrange: true }, shapes: heatShapes() };
    Plotly.react($("heatmap"), [trace], layout, cfg);
    $("note").textContent = (view === "effect"
      ? "Ablated minus intact accuracy (red: ablating the head hurts targets of that phase), cluster-bootstrap 95% CIs over contents in hover. "
      : "Mean attention from the answer position onto its needle token, by the needle's phase. ")
      + `Phases on ${m.grid_note}; compressed layers: ${m.compressed_layers.length ? m.compressed_layers.join(", ") : "none (dense)"}. Click a cell to inspect a head.`;
  }

  // ------------------------------------------------------------------ side panels
  function renderTable() {
    const h = head(), rows = ["<tr><th>phase</th><th>mass on needle</th><th>ablation effect</th><th>95% CI</th><th>n</th></tr>"];
    phases().forEach((p) => {
      rows.push(`<tr data-phase="${p}" class="${p === st.phase ? "hl" : ""}"><td>${p}</td><td>${fmt(h.mass[p])}</td><td>${fmt(h.effect[p])}</td><td>${ci(h.effect_lo[p], h.effect_hi[p])}</td><td>${h.effect_n[p]}</td></tr>`);
    });
    rows.push(`<tr><td colspan="5" style="text-align:left">overall effect ${fmt(h.overall)}, specialisation index ${fmt(h.si)}, p<sub>Holm</sub> ${fmt(h.p_holm)}, served phase ${h.served_phase ?? "–"}</td></tr>`);
    $("head-numbers").innerHTML = rows.join("");
  }
  function barColors() {
    return phases().map((p) => (st.phase < 0 || p === st.phase ? phaseColor(p) : "#dddddd"));
  }
  function renderMass() {
    const h = head();
    Plotly.react($("mass-plot"), [{ type: "bar", x: phases(), y: h.mass, marker: { color: barColors(), line: { color: "#333", width: 1 } },
      customdata: h.mass_n, hovertemplate: "phase %{x}<br>mass %{y:.3f}<br>n %{customdata}<extra></extra>" }],
      { font, height: 200, margin: { l: 50, r: 10, t: 30, b: 35 }, title: { text: `${h.label}: attention mass on the needle`, font: { size: 12 } },
        xaxis: { tickvals: phases(), title: { text: "needle phase" }, zeroline: false }, yaxis: { rangemode: "tozero" } }, cfg);
  }
  function renderEffect() {
    const h = head();
    const up = h.effect.map((e, p) => (e === null || h.effect_hi[p] === null ? null : h.effect_hi[p] - e));
    const down = h.effect.map((e, p) => (e === null || h.effect_lo[p] === null ? null : e - h.effect_lo[p]));
    Plotly.react($("effect-plot"), [{ type: "scatter", mode: "markers+lines", x: phases(), y: h.effect,
      marker: { color: barColors(), size: 9, line: { color: "#333", width: 1 } }, line: { color: "#777", width: 1 },
      error_y: { type: "data", symmetric: false, array: up, arrayminus: down, color: "#333" },
      hovertemplate: "phase %{x}<br>effect %{y:.3f}<extra></extra>" }],
      { font, height: 200, margin: { l: 50, r: 10, t: 30, b: 35 }, title: { text: `${h.label}: zero-ablation effect on accuracy (95% CI)`, font: { size: 12 } },
        xaxis: { tickvals: phases(), title: { text: "needle phase" }, zeroline: false },
        shapes: [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: 0, y1: 0, line: { color: "#999", dash: "dot" } }] }, cfg);
  }
  function renderPattern() {
    const m = model(), h = head(), ex = m.example;
    // the target shown: the farthest of the highlighted phase, else of the phase this head
    // attends most (as phasemech.dashboard.example_target), else the first example's farthest
    let want = st.phase;
    if (want < 0) {
      let best = -1;
      h.mass.forEach((v, p) => { if (v !== null && (best < 0 || v > h.mass[best])) best = p; });
      want = best;
    }
    const phaseOf = (n) => (((n - ex.grid_offset) % ex.stride) + ex.stride) % ex.stride;
    let e = 0, pick = null;
    for (let i = 0; i < ex.examples.length && pick === null; i++) {
      const t = ex.examples[i].targets.find(([n]) => phaseOf(n) === want);
      if (t) { e = i; pick = t; }
    }
    const [needle, query] = pick || ex.examples[0].targets[0];
    const z = ex.examples[e].patterns[h.layer][h.head];
    const nk = z[0].length, d = ex.stride, off = ex.grid_offset;
    const shapes = [];
    for (let k = 1; k < nk; k++) {
      if ((((k - off) % d) + d) % d === 0) {
        shapes.push({ type: "line", x0: k - 0.5, x1: k - 0.5, y0: -0.5, y1: z.length - 0.5, line: { color: "#4477aa", width: 1, dash: "dot" } });
      }
    }
    if (st.phase >= 0) {
      for (let k = 0; k < nk; k++) {
        if ((((k - off) % d) + d) % d === st.phase) {
          shapes.push({ type: "rect", x0: k - 0.5, x1: k + 0.5, y0: -0.5, y1: z.length - 0.5, line: { width: 0 }, fillcolor: "rgba(255,200,0,0.25)" });
        }
      }
    }
    shapes.push({ type: "rect", x0: needle - 0.5, x1: needle + 0.5, y0: -0.5, y1: z.length - 0.5, line: { color: "#d55e00", width: 2 } });
    shapes.push({ type: "rect", x0: -0.5, x1: nk - 0.5, y0: query - 0.5, y1: query + 0.5, line: { color: "#009e73", width: 2 } });
    const needlePhase = (((needle - off) % d) + d) % d;
    Plotly.react($("pattern-plot"), [{ type: "heatmap", z, colorscale: "Greys", reversescale: true, zmin: 0, zmax: 1,
      colorbar: { title: { text: "attn" }, thickness: 10 },
      hovertemplate: "query %{y} → key %{x}<br>attention %{z:.3f}<extra></extra>" }],
      { font, height: 380, margin: { l: 50, r: 10, t: 50, b: 40 },
        title: { text: `${h.label} on one example: needle at ${needle} (phase ${needlePhase}, orange), query ${query} (green), attention ${fmt(z[query][needle])}<br>dotted: chunk starts of the reference grid${h.compressed ? "; effective token pattern" : ""}`, font: { size: 11 } },
        xaxis: { title: { text: "key position" } }, yaxis: { title: { text: "query position" }, autorange: "reversed" }, shapes }, cfg);
  }
  function selectHead(i) {
    st.h = i;
    const m = model(), h = head();
    $("head-title").textContent = `${m.name} · ${h.label}`;
    $("head-title").dataset.layer = h.layer;
    $("head-title").dataset.head = h.head;
    renderTable(); renderMass(); renderEffect(); renderPattern();
    Plotly.relayout($("heatmap"), { shapes: heatShapes() });
  }
  function showModel(i) {
    st.m = i;
    const m = model();
    $("phase").max = String(m.phase_stride - 1);
    if (st.phase > m.phase_stride - 1) st.phase = -1;
    $("phase").value = String(st.phase);
    $("phase-label").textContent = st.phase < 0 ? "all" : String(st.phase);
    // start on the most phase-specialised head of a compressed layer (any layer if dense)
    const pool = m.heads.some((h) => h.compressed) ? m.heads.filter((h) => h.compressed) : m.heads;
    let bestHead = pool[0];
    pool.forEach((h) => { if (better(h, bestHead)) bestHead = h; });
    const best = m.heads.indexOf(bestHead);
    st.h = best;
    renderSummary(); renderHeatmap(); selectHead(best);
  }
  function setPhase(p) {
    st.phase = p;
    $("phase").value = String(p);
    $("phase-label").textContent = p < 0 ? "all" : String(p);
    highlightSummary(); renderTable(); renderMass(); renderEffect(); renderPattern();
    Plotly.relayout($("heatmap"), { shapes: heatShapes() });
  }

  // ------------------------------------------------------------------ wiring
  const designs = uniq(D.models.map((m) => m.design));
  fillSelect($("design"), designs);
  $("design").addEventListener("change", () => refreshPickers());
  $("stride").addEventListener("change", () => refreshPickers());
  $("model").addEventListener("change", () => showModel(Number($("model").value)));
  $("view").addEventListener("change", () => { renderHeatmap(); });
  $("phase").addEventListener("input", (e) => setPhase(Number(e.target.value)));
  // open on the model the page was written for (D.initial), else the first one
  if (D.initial !== null) $("design").value = D.models[D.initial].design;
  refreshPickers(D.initial === null ? undefined : D.initial);
  $("heatmap").on("plotly_click", (ev) => {
    const pt = ev.points[0];
    const i = model().heads.findIndex((h) => h.label === pt.y);
    // a click selects the head and highlights the cell's phase; the same cell again clears it
    const again = i === st.h && pt.x === st.phase;
    if (i >= 0) selectHead(i);
    if (typeof pt.x === "number") setPhase(again ? -1 : pt.x);
  });
  window.phasemechDashboard = { state: st, data: D, selectHead, setPhase, showModel };
})();
