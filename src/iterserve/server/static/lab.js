/* The /lab page: runs the lab on the server (POST /v1/lab/run) and draws what it returns.
 *
 * Plain JS, no build step and nothing fetched from the internet: the charts are small
 * hand-written SVG. The page keeps one piece of state (the last result and the user's
 * selection) and re-renders from it, so a re-run with another knob updates in place.
 *
 * Stable hooks for tests and scripts:
 *   [data-mode=M][data-metric=K]      a figure of mode M; data-value holds the raw number
 *   [data-mode=M][data-step-metric=K] the replayed step's counts of mode M
 *   body[data-runs]                   how many runs have been rendered
 *   #trace[data-request-id]           the request whose trace is shown
 */
(function () {
  "use strict";

  const MODES = ["static", "continuous"];
  const SVG_NS = "http://www.w3.org/2000/svg";

  const state = {
    result: null,        // last /v1/lab/run response
    step: 0,             // replayed step
    maxStep: 0,
    trace: null,         // {mode, id} of the request whose trace is shown
    inflight: null,      // AbortController of the running request
    lastKey: null,       // the options of the latest run, as JSON
    playTimer: null,
    presets: null,       // GET /v1/lab/presets: name -> {description, options}
  };

  const $ = (sel) => document.querySelector(sel);

  // A server started with --api-key answers 401 to every route but the page itself: ask
  // for the key once (kept for the tab's session) and send it as a Bearer token.
  const KEY_STORE = "iterserve-api-key";
  let keyPrompt = null;
  async function apiFetch(url, opts = {}) {
    const send = () => {
      const key = sessionStorage.getItem(KEY_STORE);
      const headers = Object.assign({}, opts.headers || {});
      if (key) headers["Authorization"] = `Bearer ${key}`;
      return fetch(url, Object.assign({}, opts, { headers }));
    };
    let resp = await send();
    if (resp.status === 401) {
      keyPrompt = keyPrompt || Promise.resolve(
        window.prompt("This iterserve server needs its API key (--api-key):"));
      const key = await keyPrompt;
      if (key) {
        sessionStorage.setItem(KEY_STORE, key);
        resp = await send();
        if (resp.status === 401) {
          sessionStorage.removeItem(KEY_STORE);
          keyPrompt = null;                  // a wrong key: ask again next time
        }
      }
    }
    return resp;
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    setAttrs(node, attrs);
    for (const c of children) if (c != null) node.append(c);
    return node;
  }

  function svg(tag, attrs, ...children) {
    const node = document.createElementNS(SVG_NS, tag);
    setAttrs(node, attrs);
    for (const c of children) if (c != null) node.append(c);
    return node;
  }

  function setAttrs(node, attrs) {
    if (!attrs) return;
    for (const [k, v] of Object.entries(attrs)) {
      if (v == null || v === false) continue;
      if (k === "text") node.textContent = v;
      else if (k === "dataset") Object.assign(node.dataset, v);
      else node.setAttribute(k, v === true ? "" : v);
    }
  }

  function fmt(x, digits) {
    if (x == null || Number.isNaN(x)) return "–";
    if (typeof x !== "number") return String(x);
    if (Number.isInteger(x) && digits == null) return x.toLocaleString("en-US");
    return x.toLocaleString("en-US", {
      minimumFractionDigits: digits ?? 1, maximumFractionDigits: digits ?? 1,
    });
  }

  // The lab names requests "req-000012"; the page says "#12".
  const shortId = (id) => {
    const m = /^req-0*(\d+)$/.exec(String(id));
    return "#" + (m ? m[1] : String(id));
  };

  const plural = (unit, v) => (unit === "steps" && v === 1 ? "step" : unit);

  const pct = (x) => (x == null ? "–" : fmt(100 * x, 1) + " %");

  /* ------------------------------------------------------------------ options */

  /* The lab's options from the form. Only fields the user changed from their initial value
   * are sent, so the untouched form is exactly the lab's reference case ({}), whatever the
   * lab's defaults are. Values the lab would reject are sent as typed: the server's 400
   * message is the one place that says what is wrong. */
  function collectOptions() {
    const form = $("#controls");
    const options = {};
    const pairs = {};
    // Under a preset, the fields it sets are always sent: one put back to the form's
    // default (policy fcfs, say) must override the preset, not fall back to it.
    const preset = (state.presets || {})[$("#opt-preset").value];
    const fromPreset = new Set(preset ? Object.keys(preset.options) : []);
    const send = (input) => changed(input) || fromPreset.has(input.name);
    for (const input of form.querySelectorAll("[name]")) {
      const name = input.name;
      if (input.dataset.pair != null) {
        (pairs[name] ||= [])[Number(input.dataset.pair)] = input;
        continue;
      }
      if (!send(input)) continue;
      const v = parseValue(input);
      if (v !== undefined) options[name] = v;
    }
    for (const [name, [lo, hi]] of Object.entries(pairs)) {
      if (!send(lo) && !send(hi)) continue;
      if (lo.value === "" && hi.value === "") { options[name] = null; continue; }
      if (lo.value === "" || hi.value === "") {
        throw new FormError(name, `${name}: give both a minimum and a maximum (or neither)`);
      }
      options[name] = [parseValue(lo), parseValue(hi)];
    }
    options.per_request = true;
    return options;
  }

  class FormError extends Error {
    constructor(param, message) { super(message); this.param = param; }
  }

  function changed(input) {
    if (input.type === "checkbox") return input.checked !== input.defaultChecked;
    if (input.tagName === "SELECT") {
      const def = [...input.options].find((o) => o.defaultSelected) || input.options[0];
      return input.value !== def.value;
    }
    return input.value !== input.defaultValue;
  }

  function parseValue(input) {
    if (input.type === "checkbox") return input.checked;
    const raw = input.value.trim();
    const kind = input.dataset.kind;
    if (raw === "") return input.tagName === "SELECT" ? undefined : null;
    if (kind === "bool") return raw === "true";
    if (kind === "int" || kind === "float") {
      const n = Number(raw);
      return Number.isFinite(n) ? n : raw;
    }
    return raw;
  }

  /* ------------------------------------------------------------------ running */

  async function run() {
    clearError();
    let options;
    try {
      options = collectOptions();
    } catch (err) {
      if (err instanceof FormError) { showError(err.message, err.param); return; }
      throw err;
    }
    // One run per distinct set of options: Enter in a field fires both "change" and
    // "submit", and the lab is deterministic, so a repeat would only redraw the same thing.
    const key = JSON.stringify(options);
    if (key === state.lastKey) return;
    state.lastKey = key;
    if (state.inflight) state.inflight.abort();
    const ctrl = new AbortController();
    state.inflight = ctrl;
    setStatus("Running the lab…");
    document.body.setAttribute("aria-busy", "true");
    const started = performance.now();
    try {
      const resp = await apiFetch("/v1/lab/run", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(options),
        signal: ctrl.signal,
      });
      const body = await resp.json().catch(() => null);
      if (!resp.ok) {
        const e = body && body.error;
        showError(e ? e.message : `the server answered ${resp.status}`, e && e.param);
        setStatus("");
        state.lastKey = null;
        return;
      }
      state.result = body;
      render();
      const ms = Math.round(performance.now() - started);
      setStatus(`Ran ${Object.keys(body).join(" and ")} batching in ${ms} ms.`);
      document.body.dataset.runs = String(Number(document.body.dataset.runs || 0) + 1);
    } catch (err) {
      if (err.name === "AbortError") return;
      showError(`could not reach the server: ${err.message}`);
      setStatus("");
      state.lastKey = null;
    } finally {
      if (state.inflight === ctrl) {
        state.inflight = null;
        document.body.removeAttribute("aria-busy");
      }
    }
  }

  let debounce = null;
  function runSoon() {
    clearTimeout(debounce);
    debounce = setTimeout(run, 350);
  }

  function setStatus(text) { $("#status").textContent = text; }

  function clearError() {
    const box = $("#error");
    box.hidden = true;
    box.textContent = "";
    for (const f of document.querySelectorAll("[aria-invalid]")) f.removeAttribute("aria-invalid");
  }

  function showError(message, param) {
    const box = $("#error");
    box.textContent = message;
    box.hidden = false;
    if (param) {
      for (const f of document.querySelectorAll(`#controls [name="${CSS.escape(param)}"]`)) {
        f.setAttribute("aria-invalid", "true");
      }
    }
  }

  /* ------------------------------------------------------------------ rendering */

  function modesIn(result) { return MODES.filter((m) => result && result[m]); }

  function render() {
    const result = state.result;
    const modes = modesIn(result);
    state.maxStep = Math.max(0, ...modes.map((m) => result[m].steps - 1));
    state.step = Math.min(state.step, state.maxStep);
    const slider = $("#step-slider");
    slider.max = String(state.maxStep);
    slider.value = String(state.step);
    renderFigures(result, modes);
    renderCharts(result, modes);
    renderTimelines(result, modes);
    renderStep();
    renderTracePicker(result, modes);
    if (state.trace && result[state.trace.mode]) showTrace(state.trace.mode, state.trace.id, false);
    else clearTrace();
  }

  const FIGURES = [
    // [metric, label, decimals (integers always print whole), unit, hint]
    ["steps", "Decode steps", 0, "", "scheduler steps until the last request finished"],
    ["utilization", "Slot utilisation", 1, "%", "share of slot-steps that held a request"],
    ["mean_latency", "Mean latency", 1, "steps", "arrival to finish, in steps"],
    ["p99_latency", "p99 latency", 1, "steps", "arrival to finish, in steps"],
    ["throughput_tokens_per_s", "Throughput", 0, "tok/s", "output tokens per simulated second"],
    ["time_s", "Simulated time", 2, "s", "from the cost model"],
    ["mean_ttft", "Mean TTFT", 1, "steps", "arrival to first token"],
    ["p99_ttft", "p99 TTFT", 1, "steps", "arrival to first token"],
    ["p99_itl", "p99 inter-token", 2, "steps", "between output tokens"],
    ["preemptions", "Preemptions", 0, "", "requests evicted to free KV blocks"],
    // In simulated seconds (the cost model), shown when the run has them.
    ["p99_ttft_s", "p99 TTFT", 2, "s", "arrival to first token, simulated seconds"],
    ["p99_itl_s", "p99 inter-token", 3, "s", "between output tokens, simulated seconds"],
    ["max_itl_s", "Longest token gap", 3, "s", "the longest stall between two output tokens"],
    ["p99_ttft_s_urgent", "p99 TTFT, urgent", 3, "s", "the urgent class (priority 0) only"],
    // Overload and SLOs: only when the run set a target, a queue bound or a timeout.
    ["goodput_rps", "Goodput", 2, "req/s", "requests per simulated second that met both SLO targets"],
    ["slo_met", "Met both SLOs", 0, "", "requests whose TTFT and TPOT met the targets"],
    ["refused", "Refused (SLO)", 0, "", "refused at arrival: could not meet the TTFT target (a 429 on a server)"],
    ["refused_queue_full", "Refused (queue full)", 0, "", "refused at arrival by the queue bound (a 503 on a server)"],
    ["timed_out", "Timed out", 0, "", "ended by the request or queue timeout"],
  ];

  function figureText(metric, v, decimals) {
    if (metric === "utilization") return fmt(100 * v, decimals);
    return Number.isInteger(v) ? fmt(v) : fmt(v, decimals);
  }

  function renderFigures(result, modes) {
    const box = $("#figures");
    box.replaceChildren();
    for (const mode of modes) {
      const r = result[mode];
      const other = modes.find((m) => m !== mode);
      const dl = el("dl", { class: "figure-list" });
      for (const [metric, label, decimals, unit, hint] of FIGURES) {
        if (r[metric] == null) continue;
        const better = other ? compare(metric, r[metric], result[other][metric]) : "";
        const fig = el("div", { class: "figure" + (better ? " " + better : ""), title: hint },
          el("dt", { text: label }),
          el("dd", {},
            el("span", { class: "num", dataset: { mode, metric, value: String(r[metric]) },
              text: figureText(metric, r[metric], decimals) }),
            unit ? el("span", { class: "unit", text: " " + plural(unit, r[metric]) }) : null,
            better === "better" ? el("span", { class: "mark", title: `better than ${other}`, text: " ✓" }) : null));
        if (metric === "utilization") {
          fig.append(el("div", { class: "meter", "aria-hidden": "true" },
            el("span", { style: `width:${Math.min(100, 100 * r[metric])}%` })));
        }
        dl.append(fig);
      }
      box.append(el("article", { class: `mode-card mode-${mode}`, dataset: { mode } },
        el("h3", {}, el("span", { class: "mode-dot" }), `${mode[0].toUpperCase()}${mode.slice(1)} batching`),
        el("p", { class: "mode-sub",
          text: `${fmt(r.requests)} requests · ${fmt(r.tokens)} tokens · ${fmt(r.slots)} slots` }),
        dl));
    }
    $("#verdict").textContent = verdict(result, modes);
  }

  // Which side of a pair is better, for a quiet highlight. Higher is better only for these.
  const HIGHER_IS_BETTER = new Set(["utilization", "throughput_tokens_per_s", "goodput_rps",
    "slo_met"]);
  const NEUTRAL = new Set(["time_s"]);

  function compare(metric, a, b) {
    if (b == null || a === b || NEUTRAL.has(metric)) return "";
    const aBetter = HIGHER_IS_BETTER.has(metric) ? a > b : a < b;
    return aBetter ? "better" : "worse";
  }

  function goodputLine(r) {
    if (r.goodput_rps == null) return "";
    return ` Goodput ${fmt(r.goodput_rps, 2)} requests/s: ${fmt(r.slo_met)} of ` +
      `${fmt(r.requests)} met both targets, ${fmt(r.refused)} refused.`;
  }

  function verdict(result, modes) {
    if (modes.length < 2) {
      const r = result[modes[0]];
      return `${modes[0]} batching: ${fmt(r.steps)} steps at ${pct(r.utilization)} slot utilisation.` +
        goodputLine(r);
    }
    const s = result.static, c = result.continuous;
    const ratio = s.steps / Math.max(1, c.steps);
    const faster = ratio >= 1
      ? `Continuous batching finishes in ${fmt(c.steps)} steps instead of ${fmt(s.steps)} (${fmt(ratio, 2)}× fewer)`
      : `Static batching finishes in ${fmt(s.steps)} steps instead of ${fmt(c.steps)} (${fmt(1 / ratio, 2)}× fewer)`;
    return `${faster}; slots are busy ${pct(c.utilization)} of the time vs ${pct(s.utilization)}, ` +
      `and mean latency is ${fmt(c.mean_latency, 1)} vs ${fmt(s.mean_latency, 1)} steps.` +
      goodputLine(c);
  }

  /* --- the slot x step occupancy chart ------------------------------------------ */

  function niceTicks(max, count) {
    if (max <= 0) return [0];
    const raw = max / count;
    const mag = 10 ** Math.floor(Math.log10(raw));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
    const ticks = [];
    for (let t = 0; t <= max + 1e-9; t += step) ticks.push(Math.round(t * 1000) / 1000);
    return ticks;
  }

  /* A segment ended by preemption: it neither runs into the request's next segment (a
   * prefill→decode hand-over) nor ends at the finish. Derived from segments, so the mark is
   * right whatever the lab calls the event (preempted / swapped_out). */
  function preemptedEnds(req) {
    const starts = new Set(req.segments.map((s) => s.start));
    return req.segments.filter((s) => s.end !== req.finish && !starts.has(s.end));
  }

  function urgentSet(reqs) {
    const prios = new Set(reqs.map((r) => r.priority));
    if (prios.size < 2) return new Set();
    const top = Math.min(...prios);   // lower value = more urgent, as in vLLM
    return new Set(reqs.filter((r) => r.priority === top).map((r) => r.id));
  }

  function renderCharts(result, modes) {
    const box = $("#charts");
    box.replaceChildren();
    const xmax = Math.max(1, ...modes.map((m) => result[m].steps));
    // The legend lists only what these charts show.
    const reqs = modes.flatMap((m) => result[m].per_request || []);
    const shows = {
      prefill: reqs.some((r) => r.segments.some((g) => g.kind === "prefill")),
      preempt: reqs.some((r) => preemptedEnds(r).length > 0),
      urgent: urgentSet(reqs).size > 0,
    };
    for (const item of document.querySelectorAll("#legend [data-legend]")) {
      item.hidden = shows[item.dataset.legend] === false;
    }
    const width = Math.max(320, box.clientWidth || 800);
    for (const mode of modes) {
      const r = result[mode];
      const wrap = el("figure", { class: `chart mode-${mode}`, dataset: { mode } });
      wrap.append(el("figcaption", {},
        el("span", { class: "mode-dot" }),
        el("strong", { text: `${mode}` }),
        ` · ${fmt(r.steps)} steps · ${pct(r.utilization)} busy`));
      wrap.append(occupancyChart(mode, r, xmax, width));
      box.append(wrap);
    }
  }

  function occupancyChart(mode, r, xmax, width) {
    const reqs = r.per_request || [];
    const slots = r.slots;
    // Both charts of the reference case (8 slots) fit above the fold at 1280x800.
    const rowH = Math.max(5, Math.min(16, Math.floor(160 / slots)));
    const m = { left: 52, right: 12, top: 6, bottom: 22 };
    const plotW = width - m.left - m.right;
    const height = m.top + slots * rowH + m.bottom;
    const sx = (s) => m.left + (s / xmax) * plotW;
    const root = svg("svg", {
      class: "occupancy", width, height, viewBox: `0 0 ${width} ${height}`,
      role: "img", "aria-label": `${mode} batching: ${reqs.length} requests over ${slots} slots ` +
        `and ${r.steps} steps, ${pct(r.utilization)} of slot-steps busy`,
      dataset: { mode },
    });
    // Slot rows and labels.
    const labelEvery = Math.ceil(12 / rowH);
    for (let s = 0; s < slots; s++) {
      const y = m.top + s * rowH;
      root.append(svg("rect", { class: "row" + (s % 2 ? " odd" : ""), x: m.left, y, width: plotW, height: rowH }));
      if (s % labelEvery === 0) {
        root.append(svg("text", { class: "slot-label", x: m.left - 6, y: y + rowH / 2 + 4, "text-anchor": "end",
          text: `slot ${s}` }));
      }
    }
    // Past the end of this mode's run (the other mode took longer): shaded.
    if (r.steps < xmax) {
      root.append(svg("rect", { class: "after-end", x: sx(r.steps), y: m.top,
        width: sx(xmax) - sx(r.steps), height: slots * rowH }));
      root.append(svg("text", { class: "end-label", x: sx(r.steps) + 6, y: m.top + 14,
        text: `all done at step ${fmt(r.steps)}` }));
    }
    const urgent = urgentSet(reqs);
    const bars = svg("g", { class: "bars" });
    for (const req of reqs) {
      const kind = req.long ? "long" : "short";
      for (const seg of req.segments) {
        // A hair of gap so back-to-back requests in one slot read as separate bars.
        const x = sx(seg.start);
        const full = sx(seg.end) - x;
        const w = Math.max(1, full > 4 ? full - 1 : full);
        const pad = rowH >= 8 ? 1 : 0.5;
        const y = m.top + seg.slot * rowH + pad;
        bars.append(svg("rect", {
          class: `seg ${kind} ${seg.kind}` + (urgent.has(req.id) ? " urgent" : ""),
          x: x.toFixed(2), y, width: w.toFixed(2), height: rowH - 2 * pad, rx: rowH > 8 ? 2 : 0,
          dataset: { requestId: String(req.id), mode },
        }, svg("title", { text: `request ${shortId(req.id)} (${kind}, ${req.output_len} output tokens` +
          (req.prompt_len ? `, ${req.prompt_len} prompt tokens` : "") +
          `): ${seg.kind} in slot ${seg.slot}, steps ${seg.start}–${seg.end}` })));
      }
      for (const seg of preemptedEnds(req)) {
        const x = sx(seg.end);
        const y = m.top + seg.slot * rowH;
        bars.append(svg("path", {
          class: "preempt-mark", d: `M${x - 4},${y} L${x + 4},${y} L${x},${y + Math.min(8, rowH)} Z`,
          dataset: { requestId: String(req.id), mode },
        }, svg("title", { text: `request ${shortId(req.id)} preempted at step ${seg.end}` })));
      }
    }
    root.append(bars);
    // Step axis.
    const axisY = m.top + slots * rowH;
    root.append(svg("line", { class: "axis", x1: m.left, x2: m.left + plotW, y1: axisY, y2: axisY }));
    for (const t of niceTicks(xmax, Math.max(2, Math.floor(plotW / 90)))) {
      root.append(svg("line", { class: "tick", x1: sx(t), x2: sx(t), y1: axisY, y2: axisY + 4 }));
      root.append(svg("text", { class: "tick-label", x: sx(t), y: axisY + 16, "text-anchor": "middle", text: fmt(t) }));
    }
    // Replay cursor.
    root.append(svg("line", { class: "cursor", x1: sx(0), x2: sx(0), y1: m.top, y2: axisY,
      dataset: { x0: String(m.left), plotw: String(plotW), xmax: String(xmax) } }));
    return root;
  }

  /* Per mode, the queue over the whole run: running and waiting requests, and the share
   * of KV blocks in use shaded behind them; the replay cursor moves across it. */
  function renderTimelines(result, modes) {
    const box = $("#timelines");
    box.replaceChildren();
    const xmax = Math.max(1, ...modes.map((m) => result[m].steps));
    const width = Math.max(300, Math.floor((box.clientWidth || 800) / Math.max(1, modes.length)) - 12);
    for (const mode of modes) {
      const tl = result[mode].timeline;
      if (!tl) continue;
      box.append(timelineChart(mode, tl, xmax, width));
    }
  }

  function timelineChart(mode, tl, xmax, width) {
    const height = 110, m = { left: 34, right: 10, top: 8, bottom: 20 };
    const plotW = width - m.left - m.right, plotH = height - m.top - m.bottom;
    const n = tl.running.length;
    const ymax = Math.max(1, ...tl.running, ...tl.waiting);
    const sx = (s) => m.left + (s / xmax) * plotW;
    const sy = (v) => m.top + (1 - v / ymax) * plotH;
    // One point per pixel column at most: a 90,000-step run stays a light SVG.
    const stride = Math.max(1, Math.floor(n / plotW));
    const idx = [];
    for (let i = 0; i < n; i += stride) idx.push(i);
    if (n && idx[idx.length - 1] !== n - 1) idx.push(n - 1);
    const root = svg("svg", { class: "timeline", width, height, viewBox: `0 0 ${width} ${height}`,
      role: "img", dataset: { mode },
      "aria-label": `${mode}: running and waiting requests per step` +
        (tl.num_kv_blocks ? ", with KV blocks in use shaded" : "") });
    if (tl.num_kv_blocks && tl.kv_blocks_used) {
      const top = (i) => m.top + (1 - tl.kv_blocks_used[i] / tl.num_kv_blocks) * plotH;
      const pts = idx.map((i) => `${sx(i).toFixed(1)},${top(i).toFixed(1)}`);
      root.append(svg("path", { class: "kv-area",
        d: `M${sx(idx[0])},${m.top + plotH} L${pts.join(" L")} L${sx(idx[idx.length - 1])},${m.top + plotH} Z` },
        svg("title", { text: "KV blocks in use (share of the pool)" })));
    }
    for (const t of niceTicks(ymax, 3)) {
      root.append(svg("line", { class: "grid", x1: m.left, x2: m.left + plotW, y1: sy(t), y2: sy(t) }));
      root.append(svg("text", { class: "tick-label", x: m.left - 4, y: sy(t) + 4, "text-anchor": "end", text: fmt(t) }));
    }
    for (const key of ["waiting", "running"]) {
      root.append(svg("polyline", { class: `line ${key}`,
        points: idx.map((i) => `${sx(i).toFixed(1)},${sy(tl[key][i]).toFixed(1)}`).join(" ") }));
    }
    root.append(svg("text", { class: "tick-label", x: m.left, y: height - 4, text: "step 0" }));
    root.append(svg("text", { class: "tick-label", x: m.left + plotW, y: height - 4, "text-anchor": "end",
      text: `step ${fmt(xmax)}` }));
    root.append(svg("line", { class: "cursor", x1: sx(0), x2: sx(0), y1: m.top, y2: m.top + plotH,
      dataset: { x0: String(m.left), plotw: String(plotW), xmax: String(xmax) } }));
    return el("figure", { class: `timeline-fig mode-${mode}`, dataset: { mode } },
      el("figcaption", {}, el("span", { class: "mode-dot" }), `${mode}: queue over the run`),
      root,
      el("div", { class: "legend" },
        el("span", {}, el("i", { class: "swatch line-running" }), "running"),
        el("span", {}, el("i", { class: "swatch line-waiting" }), "waiting"),
        tl.num_kv_blocks ? el("span", {}, el("i", { class: "swatch kv" }), "KV blocks in use") : null));
  }

  function moveCursors() {
    for (const line of document.querySelectorAll("#charts .cursor, #timelines .cursor")) {
      const { x0, plotw, xmax } = line.dataset;
      const x = Number(x0) + ((state.step + 0.5) / Number(xmax)) * Number(plotw);
      line.setAttribute("x1", x.toFixed(2));
      line.setAttribute("x2", x.toFixed(2));
    }
  }

  function highlightSelected() {
    const sel = state.trace;
    for (const chart of document.querySelectorAll("#charts svg")) {
      const active = sel && chart.dataset.mode === sel.mode;
      chart.classList.toggle("has-selection", !!active);
      for (const node of chart.querySelectorAll(".selected")) node.classList.remove("selected");
      if (active) {
        for (const node of chart.querySelectorAll(`[data-request-id="${CSS.escape(String(sel.id))}"]`)) node.classList.add("selected");
      }
    }
  }

  /* --- replay: one step of each mode -------------------------------------------- */

  function stateAt(r, step) {
    // Who is where at `step`, from the per-request segments; the counts come from the
    // lab's timeline when it has one (it is the authority), else from the same derivation.
    const s = Math.min(step, r.steps - 1);
    const running = [], waiting = [], preempted = [], finished = [];
    for (const req of r.per_request || []) {
      if (req.finish != null && req.finish <= s) { finished.push(req); continue; }
      if (req.arrival > s) continue;
      if (req.segments.some((g) => g.start <= s && s < g.end)) { running.push(req); continue; }
      if (req.segments.some((g) => g.end <= s)) preempted.push(req);
      else waiting.push(req);
    }
    const tl = r.timeline || {};
    const at = (key, fallback) => (tl[key] && tl[key][s] != null ? tl[key][s] : fallback);
    return {
      step: s, running, waiting, preempted, finished,
      counts: {
        running: at("running", running.length),
        waiting: at("waiting", waiting.length + preempted.length),
        preempted: at("preempted", preempted.length),
        finished: at("finished", finished.length),
        kv_blocks_used: at("kv_blocks_used", null),
      },
      numKvBlocks: tl.num_kv_blocks || null,
      done: step >= r.steps,
    };
  }

  function renderStep() {
    $("#step-value").textContent = fmt(state.step);
    $("#step-slider").value = String(state.step);
    moveCursors();
    const box = $("#step-view");
    box.replaceChildren();
    const result = state.result;
    if (!result) return;
    for (const mode of modesIn(result)) {
      const st = stateAt(result[mode], state.step);
      const counts = el("dl", { class: "step-counts" });
      for (const [key, label] of [["running", "running"], ["waiting", "waiting"],
        ["preempted", "preempted"], ["finished", "finished"]]) {
        counts.append(el("div", { class: `count ${key}` + (st.counts[key] > 0 ? " nonzero" : "") },
          el("dt", { text: label }),
          el("dd", { dataset: { mode, stepMetric: key, value: String(st.counts[key]) }, text: fmt(st.counts[key]) })));
      }
      const kv = st.counts.kv_blocks_used;
      if (kv != null) {
        const total = st.numKvBlocks;
        counts.append(el("div", { class: "count kv" },
          el("dt", { text: "KV blocks" }),
          el("dd", { dataset: { mode, stepMetric: "kv_blocks_used", value: String(kv) },
            text: total ? `${fmt(kv)} / ${fmt(total)}` : fmt(kv) }),
          total ? el("div", { class: "meter", "aria-hidden": "true" },
            el("span", { style: `width:${Math.min(100, (100 * kv) / total)}%` })) : null));
      }
      const chips = el("div", { class: "chips", "aria-label": `${mode}: requests running at this step` });
      for (const req of st.running.slice(0, 64)) {
        chips.append(el("button", { type: "button", class: `chip ${req.long ? "long" : "short"}`,
          dataset: { requestId: String(req.id), mode }, text: shortId(req.id),
          title: `request ${shortId(req.id)}: show its trace` }));
      }
      if (st.running.length > 64) chips.append(el("span", { text: ` +${st.running.length - 64} more` }));
      box.append(el("article", { class: `step-card mode-${mode}`, dataset: { mode } },
        el("h3", {}, el("span", { class: "mode-dot" }),
          st.done ? `${mode}: all finished at step ${fmt(result[mode].steps)}` : `${mode} at step ${fmt(st.step)}`),
        counts, st.running.length ? el("p", { class: "chips-title", text: "Running:" }) : null, chips));
    }
  }

  function setStep(step) {
    state.step = Math.max(0, Math.min(state.maxStep, step));
    renderStep();
  }

  function togglePlay(force) {
    const btn = $("#play");
    const playing = force != null ? force : !state.playTimer;
    clearInterval(state.playTimer);
    state.playTimer = null;
    if (playing) {
      if (state.step >= state.maxStep) setStep(0);
      const stride = Math.max(1, Math.round(state.maxStep / 400));
      state.playTimer = setInterval(() => {
        if (state.step >= state.maxStep) { togglePlay(false); return; }
        setStep(state.step + stride);
      }, 25);
    }
    btn.textContent = playing ? "Pause" : "Play";
    btn.setAttribute("aria-pressed", String(playing));
  }

  /* --- one request's trace ------------------------------------------------------ */

  function renderTracePicker(result, modes) {
    const modeSel = $("#trace-mode");
    const prevMode = state.trace ? state.trace.mode : modeSel.value;
    modeSel.replaceChildren(...modes.map((m) => el("option", { value: m, text: m })));
    modeSel.value = modes.includes(prevMode) ? prevMode : modes[modes.length - 1];
    fillRequestPicker();
  }

  function fillRequestPicker() {
    const result = state.result;
    const mode = $("#trace-mode").value;
    const sel = $("#trace-request");
    const reqs = (result && result[mode] && result[mode].per_request) || [];
    sel.replaceChildren(...reqs.map((r) => el("option", { value: String(r.id),
      text: `${shortId(r.id)} · ${r.long ? "long" : "short"} · ${r.output_len} tokens` })));
    if (state.trace && state.trace.mode === mode) sel.value = String(state.trace.id);
  }

  function findRequest(mode, id) {
    const reqs = (state.result && state.result[mode] && state.result[mode].per_request) || [];
    return reqs.find((r) => String(r.id) === String(id));
  }

  function clearTrace() {
    state.trace = null;
    const box = $("#trace");
    delete box.dataset.requestId;
    delete box.dataset.mode;
    box.replaceChildren(el("p", { class: "help", text: "Click a bar in a chart, or pick a request above." }));
    highlightSelected();
  }

  function showTrace(mode, id, scroll = true) {
    const req = findRequest(mode, id);
    if (!req) { clearTrace(); return; }
    state.trace = { mode, id: req.id };
    $("#trace-mode").value = mode;
    fillRequestPicker();
    const box = $("#trace");
    box.dataset.requestId = String(req.id);
    box.dataset.mode = mode;
    const kind = req.long ? "long" : "short";
    const facts = [
      ["arrival", "Arrived", req.arrival], ["first_scheduled", "Admitted", req.first_scheduled],
      ["first_token", "First token", req.first_token], ["finish", "Finished", req.finish],
      ["latency", "Latency", req.latency], ["ttft", "Time to first token", req.ttft],
      ["preemptions", "Preemptions", req.preemptions],
    ];
    const dl = el("dl", { class: "trace-facts" });
    for (const [key, label, v] of facts) {
      dl.append(el("div", {}, el("dt", { text: label }),
        el("dd", { dataset: { traceFact: key, value: String(v) },
          text: key === "preemptions" ? fmt(v) : (v == null ? "–" : `step ${fmt(v, Number.isInteger(v) ? 0 : 1)}`) })));
    }
    for (const f of dl.querySelectorAll('[data-trace-fact="latency"], [data-trace-fact="ttft"]')) {
      const v = Number(f.dataset.value);
      f.textContent = f.dataset.value === "null" ? "–"
        : `${fmt(v, Number.isInteger(v) ? 0 : 1)} ${plural("steps", v)}`;
    }
    const events = eventList(req.events || [], (ev) => ev.time_s != null ? `${fmt(ev.time_s, 3)} s` : "");
    box.replaceChildren(
      el("h3", { text: `Request ${shortId(req.id)} (${mode} batching)` }),
      el("p", { class: "trace-sub", text: `${kind} · ${fmt(req.output_len)} output tokens` +
        (req.prompt_len ? ` · ${fmt(req.prompt_len)} prompt tokens` : "") +
        (req.priority != null ? ` · priority ${req.priority}` : "") }),
      lifeline(req, state.result[mode].steps), dl,
      el("h4", { text: "Events" }), events);
    highlightSelected();
    if (scroll) box.scrollIntoView({ block: "nearest", behavior: "smooth" });
  }

  /* A request's events, one per row: step, name, time (as `timeText` says), other fields. */
  const EVENT_KEYS = new Set(["event", "step", "time", "time_s"]);
  function eventList(evs, timeText) {
    const ol = el("ol", { class: "events" });
    for (const ev of evs) {
      const extra = Object.entries(ev).filter(([k]) => !EVENT_KEYS.has(k))
        .map(([k, v]) => `${k.replace(/_/g, " ")} ${typeof v === "object" ? JSON.stringify(v) : v}`).join(", ");
      ol.append(el("li", { dataset: { event: ev.event } },
        el("span", { class: "ev-step", text: ev.step == null ? "" : `step ${fmt(ev.step)}` }),
        el("span", { class: `ev-name ev-${ev.event}`, text: ev.event.replace(/_/g, " ") }),
        el("span", { class: "ev-time", text: timeText(ev) }),
        el("span", { class: "ev-extra", text: extra })));
    }
    return ol;
  }

  /* The request's life on one line: waiting (from arrival) and then its segments. */
  function lifeline(req, steps) {
    const width = 600, height = 34, m = { l: 8, r: 8 };
    const end = Math.max(req.finish ?? steps, 1);
    const start = Math.min(req.arrival, ...req.segments.map((s) => s.start));
    const span = Math.max(1, end - start);
    const sx = (s) => m.l + ((s - start) / span) * (width - m.l - m.r);
    const root = svg("svg", { class: "lifeline", viewBox: `0 0 ${width} ${height}`, role: "img",
      "aria-label": `request ${req.id}: arrives at step ${req.arrival}, finishes at step ${req.finish}` });
    root.append(svg("rect", { class: "wait", x: sx(req.arrival), y: 8, width: Math.max(1, sx(end) - sx(req.arrival)), height: 12 }));
    for (const seg of req.segments) {
      root.append(svg("rect", { class: `seg ${req.long ? "long" : "short"} ${seg.kind}`, x: sx(seg.start), y: 6,
        width: Math.max(1, sx(seg.end) - sx(seg.start)), height: 16 },
        svg("title", { text: `${seg.kind} in slot ${seg.slot}, steps ${seg.start}–${seg.end}` })));
    }
    for (const seg of preemptedEnds(req)) {
      const x = sx(seg.end);
      root.append(svg("path", { class: "preempt-mark", d: `M${x - 5},2 L${x + 5},2 L${x},12 Z` }));
    }
    root.append(svg("text", { class: "tick-label", x: m.l, y: 32, text: `step ${fmt(start)}` }));
    root.append(svg("text", { class: "tick-label", x: width - m.r, y: 32, "text-anchor": "end", text: `step ${fmt(end)}` }));
    return root;
  }

  /* ------------------------------------------------------------------ live view */

  const LIVE_POLL_MS = 1000;
  const LIVE_RETRY_MS = 10000;   // no model loaded: ask again now and then, quietly
  const openLiveTraces = new Set();

  async function pollLive() {
    let next = LIVE_RETRY_MS;
    try {
      const resp = await apiFetch("/v1/engine/stats", { cache: "no-store" });
      if (resp.ok) {
        renderLive(await resp.json());
        next = LIVE_POLL_MS;
      } else {
        $("#live").hidden = true;
      }
    } catch (err) {
      $("#live").hidden = true;
    }
    setTimeout(pollLive, next);
  }

  function renderLive(s) {
    $("#live").hidden = false;
    $("#live-model").textContent = s.model || "";
    const usage = s.kv_cache_usage;
    const figs = [
      ["step", "Step", fmt(s.step)], ["num_running", "Running", fmt(s.num_running)],
      ["num_waiting", "Waiting", fmt(s.num_waiting)], ["num_swapped", "Swapped", fmt(s.num_swapped)],
      ["kv_cache_usage", "KV cache", pct(usage), `${fmt(s.num_blocks - s.num_free_blocks)} / ${fmt(s.num_blocks)} blocks`],
      ["num_preemptions_total", "Preemptions", fmt(s.num_preemptions_total)],
    ];
    const dl = el("dl", { class: "figure-list live-list" });
    for (const [key, label, text, sub] of figs) {
      const fig = el("div", { class: "figure" }, el("dt", { text: label }),
        el("dd", { dataset: { live: key, value: String(s[key]) } }, text,
          sub ? el("span", { class: "unit sub", text: sub }) : null));
      if (key === "kv_cache_usage" && usage != null) {
        fig.append(el("div", { class: "meter", "aria-hidden": "true" },
          el("span", { style: `width:${Math.min(100, 100 * usage)}%` })));
      }
      dl.append(fig);
    }
    $("#live-figures").replaceChildren(dl);

    const hist = s.history || [];
    const charts = $("#live-charts");
    const width = Math.max(300, Math.floor((charts.clientWidth || 800) / 2) - 12);
    charts.replaceChildren(
      lineChart("Tokens per step", hist, [["num_batched_tokens", "tokens", "tokens"]], width, "bars"),
      lineChart("Queue", hist, [["num_running", "running", "running"], ["num_waiting", "waiting", "waiting"],
        ["num_swapped", "swapped", "swapped"]], width));

    const rows = (s.recent_requests || []).map((r) => {
      const det = el("details", { dataset: { requestId: r.request_id } });
      det.open = openLiveTraces.has(r.request_id);
      det.addEventListener("toggle", () => {
        if (det.open) openLiveTraces.add(r.request_id); else openLiveTraces.delete(r.request_id);
      });
      det.append(el("summary", {}, el("code", { text: r.request_id }),
        ` · ${r.status}${r.finish_reason ? " (" + r.finish_reason + ")" : ""} · ` +
        `${fmt(r.prompt_tokens)} prompt + ${fmt(r.output_tokens)} output tokens` +
        (r.num_preemptions ? ` · ${r.num_preemptions} preemptions` : "")));
      const t0 = r.events && r.events.length ? r.events[0].time : 0;
      const ol = eventList(r.events || [], (ev) => ev.time == null ? "" : `+${fmt(1000 * (ev.time - t0), 1)} ms`);
      det.append(ol);
      return det;
    });
    $("#live-requests").replaceChildren(...(rows.length ? rows : [el("p", { class: "help", text: "No requests yet." })]));
  }

  /* A small multi-series chart of the engine's recent steps (lines, or bars for one series). */
  function lineChart(title, hist, series, width, style) {
    const height = 120, m = { l: 36, r: 8, t: 8, b: 18 };
    const n = hist.length;
    const ymax = Math.max(1, ...series.flatMap(([k]) => hist.map((h) => h[k] || 0)));
    const sx = (i) => m.l + (n <= 1 ? 0 : (i / (n - 1)) * (width - m.l - m.r));
    const sy = (v) => m.t + (1 - v / ymax) * (height - m.t - m.b);
    const root = svg("svg", { class: "live-chart", width, height, viewBox: `0 0 ${width} ${height}`,
      role: "img", "aria-label": `${title} over the last ${n} steps` });
    for (const t of niceTicks(ymax, 3)) {
      root.append(svg("line", { class: "grid", x1: m.l, x2: width - m.r, y1: sy(t), y2: sy(t) }));
      root.append(svg("text", { class: "tick-label", x: m.l - 4, y: sy(t) + 4, "text-anchor": "end", text: fmt(t) }));
    }
    for (const [key, , cls] of series) {
      if (style === "bars") {
        const bw = Math.max(1, (width - m.l - m.r) / Math.max(1, n) - 1);
        hist.forEach((h, i) => root.append(svg("rect", { class: `bar ${cls}`,
          x: m.l + (i * (width - m.l - m.r)) / Math.max(1, n), y: sy(h[key] || 0), width: bw,
          height: Math.max(0, sy(0) - sy(h[key] || 0)) })));
      } else if (n) {
        root.append(svg("polyline", { class: `line ${cls}`,
          points: hist.map((h, i) => `${sx(i).toFixed(1)},${sy(h[key] || 0).toFixed(1)}`).join(" ") }));
      }
    }
    const legend = el("div", { class: "legend" }, ...series.map(([, label, cls]) =>
      el("span", {}, el("i", { class: `swatch line-${cls}` }), label)));
    return el("figure", { class: "live-fig" }, el("figcaption", { text: title }), root, legend);
  }

  /* ------------------------------------------------------------------ wiring */

  function resetForm() {
    $("#controls").reset();
    $("#preset-description").textContent = "";
    clearError();
    run();
  }

  /* Presets (GET /v1/lab/presets): picking one resets the form and fills every field the
   * preset sets, so the page shows what will run; the run sends the preset's name too, for
   * what has no field (its cost model). Changing a field afterwards overrides the preset. */
  async function loadPresets() {
    let presets = {};
    try {
      const resp = await apiFetch("/v1/lab/presets");
      if (resp.ok) presets = await resp.json();
    } catch (err) { /* an older server: no presets, the select stays at "none" */ }
    state.presets = presets;
    const select = $("#opt-preset");
    for (const [name, p] of Object.entries(presets)) {
      select.append(el("option", { value: name, text: name, title: p.description }));
    }
  }

  function applyPreset() {
    const name = $("#opt-preset").value;
    const form = $("#controls");
    form.reset();
    $("#opt-preset").value = name;
    const preset = (state.presets || {})[name];
    $("#preset-description").textContent = preset ? preset.description : "";
    if (!preset) return;
    for (const [key, value] of Object.entries(preset.options)) {
      const inputs = form.querySelectorAll(`[name="${CSS.escape(key)}"]`);
      for (const input of inputs) {
        const v = Array.isArray(value) ? value[Number(input.dataset.pair)] : value;
        if (input.type === "checkbox") input.checked = Boolean(v);
        else input.value = String(v);
      }
    }
  }

  function init() {
    const form = $("#controls");
    form.addEventListener("submit", (e) => { e.preventDefault(); clearTimeout(debounce); run(); });
    form.addEventListener("change", runSoon);
    $("#reference-case").addEventListener("click", resetForm);
    // Fills the form before the form's own change listener (bubbling) re-runs it.
    $("#opt-preset").addEventListener("change", applyPreset);
    loadPresets();
    $("#new-seed").addEventListener("click", () => {
      $("#opt-seed").value = String(Math.floor(Math.random() * 1e6));
      runSoon();
    });
    $("#step-slider").addEventListener("input", (e) => setStep(Number(e.target.value)));
    $("#play").addEventListener("click", () => togglePlay());
    $("#trace-mode").addEventListener("change", fillRequestPicker);
    $("#show-trace").addEventListener("click", () => showTrace($("#trace-mode").value, $("#trace-request").value));
    // Bars and running-request chips open a trace (the pickers above are the keyboard path
    // for bars; chips are buttons).
    for (const area of [$("#charts"), $("#step-view")]) {
      area.addEventListener("click", (e) => {
        const hit = e.target.closest("[data-request-id]");
        if (hit) showTrace(hit.dataset.mode, hit.dataset.requestId);
      });
    }
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => {
        if (!state.result) return;
        const modes = modesIn(state.result);
        renderCharts(state.result, modes);
        renderTimelines(state.result, modes);
        moveCursors();
        highlightSelected();
      }, 150);
    });
    run();
    pollLive();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
