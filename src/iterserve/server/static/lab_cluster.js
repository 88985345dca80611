// The lab page's cluster view: N replicas behind the server's own router, on simulated
// time (POST /v1/lab/cluster, lab/cluster.py). Self-contained: it builds its form and
// results inside <section id="cluster"> and shares nothing with lab.js but the CSS classes.
// Runs only when asked (the Run / Compare buttons), so the single-replica view is unchanged.
"use strict";
(function () {
  const root = document.getElementById("cluster-app");
  if (!root) return;
  const section = document.getElementById("cluster");

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "text") node.textContent = v;
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) if (c !== null && c !== undefined) node.append(c);
    return node;
  }

  // name, label, default, kind (int | float | check | select), extra
  const FIELDS = [
    ["data_parallel_size", "Replicas", 4, "int", { min: 1 }],
    ["router", "Router", "prefix_aware", "select",
      { choices: ["round_robin", "least_loaded", "prefix_aware"] }],
    ["max_num_seqs", "Slots per replica", 8, "int", { min: 1 }],
    ["requests", "Requests", 400, "int", { min: 1 }],
    ["arrival_rate_s", "Arrival rate (requests/s)", 3, "float", { min: 0, step: 0.5,
      placeholder: "all at t=0" }],
    ["prompt_min", "Own prompt, min", 8, "int", { min: 1 }],
    ["prompt_max", "max", 40, "int", { min: 1 }],
    ["prefix_groups", "Shared prefixes", 64, "int", { min: 0 }],
    ["prefix_len", "Prefix tokens", 256, "int", { min: 0 }],
    ["enable_prefix_caching", "Prefix caching", true, "check", {}],
    ["cost_model", "Cost model", "smollm2-cpu", "select",
      { choices: ["smollm2-cpu", "default_cost_model"] }],
    ["search", "Search", "", "select", { choices: ["", "rate", "replicas"],
      labels: ["none", "highest rate", "fewest replicas"] }],
    ["search_p99_ttft_ms", "for p99 TTFT under (ms)", "", "float", { min: 0, step: 100,
      placeholder: "target" }],
  ];

  function field([name, label, value, kind, extra]) {
    const id = "cl-" + name;
    if (kind === "check") {
      return el("div", { class: "field check" },
        el("input", { id, name, type: "checkbox", checked: value }),
        el("label", { for: id, text: label }));
    }
    let input;
    if (kind === "select") {
      input = el("select", { id, name });
      extra.choices.forEach((c, i) => input.append(
        el("option", { value: c, selected: c === value, text: (extra.labels || [])[i] || c })));
    } else {
      input = el("input", { id, name, type: "number", value: value === "" ? null : value,
        min: extra.min, step: extra.step || (kind === "int" ? 1 : "any"),
        placeholder: extra.placeholder, "data-kind": kind });
    }
    return el("div", { class: "field" }, el("label", { for: id, text: label }), input);
  }

  // Table styles for this section only (lab.css has no tables).
  document.head.append(el("style", { text:
    "#cluster table{border-collapse:collapse;width:100%;font-size:.88rem;" +
    "font-variant-numeric:tabular-nums;margin:4px 0 12px}" +
    "#cluster th,#cluster td{text-align:right;padding:3px 8px;border-bottom:1px solid var(--line)}" +
    "#cluster th:first-child,#cluster td:first-child{text-align:left}" +
    "#cluster td .meter{min-width:60px}#cluster-form{max-width:680px}" }));

  const form = el("form", { id: "cluster-form", novalidate: true });
  const rows = [[0, 1], [2, 3], [4], [5, 6], [7, 8], [9], [10], [11, 12]];
  for (const r of rows) form.append(el("div", { class: "field-row" }, ...r.map(i => field(FIELDS[i]))));
  form.append(el("div", { class: "form-buttons" },
    el("button", { type: "submit", id: "cluster-run", class: "primary", text: "Run cluster" }),
    el("button", { type: "button", id: "cluster-compare-btn", text: "Compare routers" })));
  const error = el("div", { id: "cluster-error", class: "error", role: "alert", hidden: true });
  const status = el("p", { id: "cluster-status", class: "status", role: "status",
    "aria-live": "polite" });
  const figures = el("div", { id: "cluster-figures" });
  const replicas = el("div", { id: "cluster-replicas" });
  const compare = el("div", { id: "cluster-compare" });
  const search = el("p", { id: "cluster-search", class: "verdict" });
  root.append(el("p", { class: "help", text: "One engine scheduler per replica, routed by " +
    "the server's own router (core/router.py) as each request arrives; times are simulated " +
    "seconds from the cost model. Runs POST /v1/lab/cluster." }),
    form, error, status, figures, search, replicas, compare);

  function options(router) {
    const o = {};
    for (const [name, , , kind] of FIELDS) {
      const input = form.elements[name];
      input.removeAttribute("aria-invalid");
      if (kind === "check") { o[name] = input.checked; continue; }
      if (input.value === "") continue;
      o[name] = kind === "int" ? Number.parseInt(input.value, 10)
        : kind === "float" ? Number(input.value) : input.value;
    }
    if (o.prompt_min !== undefined || o.prompt_max !== undefined) {
      o.prompt_len = [o.prompt_min ?? 8, o.prompt_max ?? o.prompt_min ?? 40];
    }
    delete o.prompt_min; delete o.prompt_max;
    if (!o.search) { delete o.search; delete o.search_p99_ttft_ms; }
    if (router) { o.router = router; delete o.search; delete o.search_p99_ttft_ms; }
    o.batching = "continuous";
    return o;
  }

  async function post(body) {
    const resp = await fetch("/v1/lab/cluster", { method: "POST",
      headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    const data = await resp.json();
    if (!resp.ok) {
      const err = new Error((data.error && data.error.message) || resp.statusText);
      err.param = data.error && data.error.param;
      throw err;
    }
    return data;
  }

  const f = (x, d) => Number(x).toLocaleString("en-US",
    { minimumFractionDigits: d, maximumFractionDigits: d });
  const pct = x => f(100 * x, 1) + "%";

  function figure(metric, label, value, text) {
    return el("div", { class: "figure" }, el("dt", { text: label }),
      el("dd", { "data-cluster-metric": metric, "data-value": value, text }));
  }

  function render(r) {
    const dl = el("dl", { class: "figure-list" },
      figure("throughput_tokens_per_s", "throughput (tokens/s)", r.throughput_tokens_per_s,
        f(r.throughput_tokens_per_s, 1)),
      figure("requests_per_s", "requests/s", r.requests_per_s, f(r.requests_per_s, 2)),
      r.p50_ttft_s === undefined ? null :
        figure("p50_ttft_s", "p50 TTFT (s)", r.p50_ttft_s, f(r.p50_ttft_s, 3)),
      r.p99_ttft_s === undefined ? null :
        figure("p99_ttft_s", "p99 TTFT (s)", r.p99_ttft_s, f(r.p99_ttft_s, 3)),
      r.p99_itl_s === undefined ? null :
        figure("p99_itl_s", "p99 ITL (s)", r.p99_itl_s, f(r.p99_itl_s, 4)),
      figure("prefix_cache_hit_rate", "prefix-cache hit rate", r.prefix_cache_hit_rate,
        pct(r.prefix_cache_hit_rate)),
      figure("load_imbalance", "load imbalance (max/mean)", r.load_imbalance,
        f(r.load_imbalance, 2)),
      figure("refused", "refused", r.refused, f(r.refused, 0)));
    figures.replaceChildren(el("h3", { text: `${r.replicas} replicas, router ${r.router}: ` +
      `${f(r.served, 0)} requests in ${f(r.time_s, 1)} simulated s` }), dl);

    const meter = x => el("div", { class: "meter" },
      el("span", { style: `width:${Math.min(100, 100 * x).toFixed(1)}%` }));
    const table = el("table", { class: "cluster-replicas" },
      el("thead", {}, el("tr", {}, ...["replica", "requests", "busy", "slot utilisation",
        "hit rate", "preemptions"].map(h => el("th", { scope: "col", text: h })))));
    const body = el("tbody");
    for (const p of r.per_replica) {
      body.append(el("tr", { "data-replica": p.replica },
        el("td", { text: String(p.replica) }),
        el("td", { "data-col": "requests", "data-value": p.requests, text: f(p.requests, 0) }),
        el("td", { "data-col": "busy_frac", "data-value": p.busy_frac }, pct(p.busy_frac),
          meter(p.busy_frac)),
        el("td", { "data-col": "slot_utilization", "data-value": p.slot_utilization },
          pct(p.slot_utilization), meter(p.slot_utilization)),
        el("td", { "data-col": "prefix_cache_hit_rate", "data-value": p.prefix_cache_hit_rate,
          text: pct(p.prefix_cache_hit_rate) }),
        el("td", { text: f(p.preemptions, 0) })));
    }
    table.append(body);
    replicas.replaceChildren(el("h3", { text: "Per replica" }), table);

    const s = r.search;
    if (!s) search.textContent = "";
    else if (s.kind === "rate") {
      search.textContent = s.max_rate_rps
        ? `Highest rate with p99 TTFT ≤ ${s.p99_ttft_ms} ms on ${r.replicas} replicas: ` +
          `${f(s.max_rate_rps, 2)} requests/s (${s.runs.length} runs).`
        : `No rate meets p99 TTFT ≤ ${s.p99_ttft_ms} ms on ${r.replicas} replicas.`;
    } else {
      search.textContent = s.replicas
        ? `Fewest replicas for ${r.workload.arrival_rate_s} requests/s at p99 TTFT ≤ ` +
          `${s.p99_ttft_ms} ms: ${s.replicas} (${s.runs.length} runs).`
        : `More than ${s.max_replicas} replicas would be needed.`;
    }
    if (s) search.setAttribute("data-value", s.kind === "rate" ? s.max_rate_rps : s.replicas);
  }

  function renderCompare(results) {
    const table = el("table", { class: "cluster-compare" },
      el("thead", {}, el("tr", {}, ...["router", "hit rate", "p50 TTFT (s)", "p99 TTFT (s)",
        "throughput (tokens/s)"].map(h => el("th", { scope: "col", text: h })))));
    const body = el("tbody");
    for (const r of results) {
      body.append(el("tr", { "data-router": r.router },
        el("td", { text: r.router }),
        el("td", { "data-col": "prefix_cache_hit_rate", "data-value": r.prefix_cache_hit_rate,
          text: pct(r.prefix_cache_hit_rate) }),
        el("td", { "data-col": "p50_ttft_s", "data-value": r.p50_ttft_s ?? "",
          text: r.p50_ttft_s === undefined ? "–" : f(r.p50_ttft_s, 3) }),
        el("td", { "data-col": "p99_ttft_s", "data-value": r.p99_ttft_s ?? "",
          text: r.p99_ttft_s === undefined ? "–" : f(r.p99_ttft_s, 3) }),
        el("td", { "data-col": "throughput_tokens_per_s",
          "data-value": r.throughput_tokens_per_s, text: f(r.throughput_tokens_per_s, 1) })));
    }
    table.append(body);
    compare.replaceChildren(el("h3", { text: "The same workload under each router" }), table);
  }

  async function run(kind) {
    error.hidden = true;
    section.setAttribute("aria-busy", "true");
    status.textContent = "Simulating…";
    const t0 = performance.now();
    try {
      if (kind === "compare") {
        const results = [];
        for (const router of ["round_robin", "least_loaded", "prefix_aware"]) {
          results.push(await post(options(router)));
        }
        renderCompare(results);
      } else {
        render(await post(options(null)));
      }
      status.textContent = `Done in ${f((performance.now() - t0) / 1000, 1)} s.`;
    } catch (err) {
      error.textContent = err.message;
      error.hidden = false;
      status.textContent = "";
      const name = err.param === "prompt_len" ? "prompt_min" : err.param;
      if (name && form.elements[name]) form.elements[name].setAttribute("aria-invalid", "true");
    } finally {
      section.removeAttribute("aria-busy");
      const runs = Number(section.getAttribute("data-cluster-runs") || 0) + 1;
      section.setAttribute("data-cluster-runs", String(runs));
    }
  }

  form.addEventListener("submit", ev => { ev.preventDefault(); run("single"); });
  document.getElementById("cluster-compare-btn").addEventListener("click", () => run("compare"));
})();
