// kvserve's status page: polls dashboard/state (same origin) and redraws. No library.
"use strict";

const POLL_MS = 1500;
const SVG_NS = "http://www.w3.org/2000/svg";
const byId = (id) => document.getElementById(id);

function text(id, value) {
  const element = byId(id);
  if (element.textContent !== value) element.textContent = value;
}

function percent(fraction) {
  return fraction === null || fraction === undefined ? "–" : (100 * fraction).toFixed(1) + " %";
}

function number(value, digits = 0) {
  return value === null || value === undefined ? "–" : value.toLocaleString("en-US", {
    maximumFractionDigits: digits, minimumFractionDigits: digits,
  });
}

function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 1 ? (1000 * value).toFixed(value < 0.01 ? 1 : 0) + " ms" : value.toFixed(2) + " s";
}

function cells(row, values) {
  row.replaceChildren(...values.map((value) => {
    const cell = document.createElement("td");
    if (value instanceof Node) cell.append(value); else cell.textContent = value;
    return cell;
  }));
}

function stateBadge(state) {
  const badge = document.createElement("span");
  badge.className = "state-" + state;
  badge.textContent = state;
  return badge;
}

function drawEngines(engines) {
  const body = byId("engines").tBodies[0];
  body.replaceChildren(...engines.map((engine) => {
    const row = document.createElement("tr");
    row.dataset.engine = engine.engine;
    cells(row, [
      String(engine.engine) + (engine.kv_role ? " (" + engine.kv_role + ")" : ""),
      stateBadge(engine.state),
      number(engine.num_running),
      number(engine.num_waiting),
      percent(engine.kv_cache_usage),
      percent(engine.prefix_cache_hit_rate),
      engine.hostname ? engine.hostname + (engine.pid ? " pid " + engine.pid : "") : "–",
    ]);
    if (engine.reason) row.title = engine.reason;
    return row;
  }));
}

function drawLatency(id, latency) {
  cells(byId(id), [seconds(latency.p50), seconds(latency.p90), seconds(latency.p99), number(latency.count)]);
  const label = document.createElement("th");
  label.textContent = id === "ttft" ? "TTFT" : "ITL";
  label.title = id === "ttft" ? "time to first token" : "inter-token latency";
  byId(id).prepend(label);
}

function drawTenants(tenants) {
  byId("tenants_hidden").hidden = tenants !== null;
  byId("tenants").hidden = tenants === null;
  if (tenants === null) return;
  byId("tenants").tBodies[0].replaceChildren(...tenants.map((tenant) => {
    const row = document.createElement("tr");
    cells(row, [
      tenant.name, number(tenant.num_running), number(tenant.num_waiting), number(tenant.requests),
      number(tenant.prompt_tokens) + " / " + number(tenant.completion_tokens),
      number(tenant.total_requests), number(tenant.total_tokens),
    ]);
    return row;
  }));
}

// The goodput panel: all requests with targets first, then each tenant (for admin keys).
function drawSlo(slo) {
  text("goodput", number(slo.goodput_per_s, 2));
  text("goodput_window", "(goodput over the last " + Math.round(slo.goodput_window_s) + " s; counts since start)");
  const outcomes = (targets, name) => {
    const target = targets.find((t) => t.target === name);
    return number(target.met) + " / " + number(target.missed);
  };
  const rows = [{ name: "all requests", goodput_per_s: slo.goodput_per_s, targets: slo.targets }]
    .concat(slo.tenants || []);
  byId("slo").tBodies[0].replaceChildren(...rows.map((entry) => {
    const row = document.createElement("tr");
    row.dataset.tenant = entry.name;
    cells(row, [entry.name, number(entry.goodput_per_s, 2),
      outcomes(entry.targets, "ttft"), outcomes(entry.targets, "tpot")]);
    return row;
  }));
}

function byTtl(counts) {
  return Object.entries(counts).map(([ttl, count]) => ttl + ": " + number(count)).join(", ") || "-";
}

function drawPins(pins) {
  byId("pins_section").hidden = !pins || pins.length === 0;
  if (!pins) return;
  byId("pins").tBodies[0].replaceChildren(...pins.map((pin) => {
    const row = document.createElement("tr");
    cells(row, [
      String(pin.engine), number(pin.num_pinned_blocks), byTtl(pin.hits), byTtl(pin.misses),
      number(pin.num_expired), number(pin.num_yielded),
    ]);
    return row;
  }));
}

function drawSpec(spec) {
  byId("spec_section").hidden = spec === null;
  if (spec === null) return;
  text("spec_acceptance", percent(spec.acceptance_rate));
  text("spec_length", number(spec.mean_acceptance_length, 2));
  text("spec_total", "(" + percent(spec.acceptance_rate_total) + " since start)");
  text("spec_positions", "Accepted per draft position: " +
    spec.accepted_per_position.map((rate) => percent(rate)).join(", "));
}

// A line chart in a 300x100 viewBox: one polyline per series, gaps where a value is null.
function drawChart(id, series, fixedMax) {
  const svg = byId(id);
  const values = series.flatMap((s) => s.values.filter((v) => v !== null));
  const top = fixedMax || Math.max(1, ...values) * 1.1;
  const children = [];
  for (const y of [25, 50, 75]) {
    const line = document.createElementNS(SVG_NS, "line");
    for (const [name, value] of [["x1", 0], ["x2", 300], ["y1", y], ["y2", y]]) line.setAttribute(name, value);
    line.setAttribute("class", "grid");
    children.push(line);
  }
  for (const s of series) {
    const n = s.values.length;
    let points = [];
    const flush = () => {
      if (points.length > 1) {
        const line = document.createElementNS(SVG_NS, "polyline");
        line.setAttribute("points", points.join(" "));
        line.setAttribute("class", s.name);
        children.push(line);
      }
      points = [];
    };
    s.values.forEach((value, i) => {
      if (value === null) { flush(); return; }
      const x = n > 1 ? (300 * i) / (n - 1) : 0;
      points.push(x.toFixed(1) + "," + (100 - (100 * value) / top).toFixed(1));
    });
    flush();
  }
  const label = document.createElementNS(SVG_NS, "text");
  label.setAttribute("x", "2");
  label.setAttribute("y", "10");
  label.textContent = fixedMax ? "" : number(top, top < 10 ? 1 : 0);
  children.push(label);
  svg.replaceChildren(...children);
}

function draw(state) {
  document.title = "kvserve: " + state.model;
  text("model", state.model + " · " + state.version);
  const status = byId("status");
  status.textContent = state.status;
  status.className = "badge " + state.status;
  byId("logout").hidden = !state.needs_key;
  text("updated", "up " + Math.round(state.uptime_s) + " s");
  text("num_running", number(state.num_running));
  text("num_waiting", number(state.num_waiting));
  text("kv_cache_usage", percent(state.kv_cache_usage));
  text("prefix_cache_hit_rate", percent(state.prefix_cache_hit_rate ?? state.prefix_cache_hit_rate_total));
  text("prompt_tokens_per_s", number(state.prompt_tokens_per_s, 1));
  text("generation_tokens_per_s", number(state.generation_tokens_per_s, 1));
  text("finished_requests_total", number(state.finished_requests_total));
  text("generation_tokens_total", number(state.generation_tokens_total));
  text("window", state.window_s < 60 ? "(last " + Math.round(state.window_s) + " s)"
    : "(last " + Math.round(state.window_s / 60) + " min)");
  drawEngines(state.engines);
  drawLatency("ttft", state.ttft);
  drawLatency("itl", state.itl);
  drawSpec(state.spec_decode);
  drawTenants(state.tenants);
  drawSlo(state.slo);
  drawPins(state.pins);
  const h = state.history;
  drawChart("chart_throughput", [
    { name: "prompt", values: h.prompt_tokens_per_s },
    { name: "output", values: h.generation_tokens_per_s },
  ]);
  drawChart("chart_requests", [
    { name: "running", values: h.num_running },
    { name: "waiting", values: h.num_waiting },
  ]);
  drawChart("chart_kv", [{ name: "kv", values: h.kv_cache_usage }], 1);
}

async function poll() {
  try {
    const response = await fetch("dashboard/state", { cache: "no-store", credentials: "same-origin" });
    if (response.status === 401) {
      window.location.assign("dashboard/login");
      return;
    }
    if (!response.ok) throw new Error("HTTP " + response.status);
    draw(await response.json());
    text("error", "");
  } catch (error) {
    text("error", "Cannot reach the server: " + error.message);
  }
  setTimeout(poll, POLL_MS);
}

poll();
