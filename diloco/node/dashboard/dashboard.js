// diloco-node dashboard: renders /api/state (embedded in the page, then polled).
// Charts are plain SVG. Peer-supplied strings are inserted as text nodes only.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf",
  "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"];
const POLL_MS = 2000;
const MAX_DOTS = 400;  // per series: beyond this a chart draws the line only
let colours = {};

function el(tag, attrs, children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const child of children || []) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function short(peer) { return "…" + peer.slice(-8); }

function colour(peer) {
  if (!(peer in colours)) colours[peer] = PALETTE[Object.keys(colours).length % PALETTE.length];
  return colours[peer];
}

function swatch(peer) {
  const s = el("span", {class: "swatch"});
  s.style.background = colour(peer);
  return s;
}

function num(x, digits) {
  if (x === null || x === undefined) return "–";
  return Number(x).toLocaleString("en-US", {maximumFractionDigits: digits ?? 0});
}

function bytes(x) {
  if (x === null || x === undefined) return "–";
  const units = ["B", "kB", "MB", "GB", "TB", "PB"];
  let i = 0;
  while (Math.abs(x) >= 1000 && i < units.length - 1) { x /= 1000; i++; }
  return x.toFixed(i ? 2 : 0) + " " + units[i];
}

function duration(s) {
  if (s === null || s === undefined) return "–";
  if (s < 90) return s.toFixed(0) + " s";
  if (s < 5400) return (s / 60).toFixed(0) + " min";
  return (s / 3600).toFixed(1) + " h";
}

function clockTime(t) {  // seconds since the epoch -> this browser's local HH:MM:SS
  return new Date(t * 1000).toLocaleTimeString("en-GB", {hour12: false});
}

function ago(s) {
  if (s === null || s === undefined) return "–";
  return s < 90 ? s.toFixed(0) + " s ago" : (s / 60).toFixed(1) + " min ago";
}

function table(id, header, rows) {
  const t = document.getElementById(id);
  t.replaceChildren(el("tr", {}, header.map((h) => el("th", {}, [h]))));
  for (const row of rows) t.append(row);
}

function cell(value, cls) { return el("td", cls ? {class: cls} : {}, [value]); }

function renderRun(run) {
  document.getElementById("run-name").textContent = run.name ? "· " + run.name : "";
  const bits = [];
  if (run.run_id) bits.push("run " + run.run_id);
  if (run.preset) bits.push("model " + run.preset + " (" + num(run.num_params) + " parameters)");
  if (run.steps) bits.push(num(run.steps) + " steps");
  if (run.sync_every) bits.push("H = " + run.sync_every);
  if (run.codec) bits.push("codec " + run.codec);
  document.getElementById("run-line").textContent = bits.join(" · ");
  const updated = run.updated_s_ago === null ? "never" : ago(run.updated_s_ago);
  document.getElementById("status").textContent = run.status + " · last read " + updated;
  const state = document.getElementById("run-state");
  state.textContent = run.state;
  state.className = "state " + run.state;
  const progress = [];
  if (run.steps) {
    progress.push("step " + num(run.global_step) + " / " + num(run.steps) +
      " (" + (100 * run.progress).toFixed(0) + "%)");
  }
  if (run.state === "training" && run.eta_s !== null) progress.push("about " + duration(run.eta_s) + " left");
  if (run.final_eval) {
    progress.push("final held-out loss " + run.final_eval.loss.toFixed(4) + " at step " +
      num(run.final_eval.step));
  }
  document.getElementById("progress").textContent = progress.join(" · ");
  const join = document.getElementById("join");
  join.hidden = !run.join_command;
  document.getElementById("join-command").textContent = run.join_command || "";
}

function renderTotals(t) {
  const cards = [
    ["peers training", num(t.peers_alive) + " / " + num(t.peers_seen) + " seen"],
    ["global step", num(t.global_step)],
    ["tokens trained", num(t.tokens)],
    ["tokens / s (swarm)", num(t.tokens_per_s)],
    ["bytes sent (all nodes)", bytes(t.bytes_sent)],
    ["data-parallel would send", bytes(t.dp_bytes_estimate) +
      (t.dp_ratio ? " (" + num(t.dp_ratio, 1) + "×)" : "")],
    ["rounds ok / partial / failed",
      num(t.rounds_ok) + " / " + num(t.rounds_partial) + " / " + num(t.rounds_failed)],
  ];
  document.getElementById("totals").replaceChildren(...cards.map(([label, value]) =>
    el("div", {class: "card"}, [el("div", {class: "label"}, [label]),
      el("div", {class: "value"}, [value])])));
}

function renderPeers(peers) {
  table("peers", ["peer", "state", "step", "runs on", "tokens/s", "CU",
    "loss", "final eval", "tokens", "sent", "received", "failed rounds", "healed", "last seen",
    "reached", "version"],
  peers.map((p) => el("tr", {class: p.alive ? "alive" : "gone", "data-peer": p.peer_id}, [
    el("td", {class: "text", title: p.peer_id}, [swatch(p.peer_id), p.name]),
    cell(p.state, "text"),
    cell(num(p.step)),
    cell([p.device || "–", p.precision || "–", num(p.batch_size)].join(" · "), "text"),
    cell(num(p.tokens_per_s)),
    cell(p.cu === null ? "–" : (100 * p.cu).toFixed(1) + "%"),
    cell(p.loss === null ? "–" : p.loss.toFixed(4)),
    cell(p.final_eval === null ? "–" : p.final_eval.toFixed(4)),
    cell(num(p.tokens)),
    cell(bytes(p.bytes_sent)),
    cell(bytes(p.bytes_received)),
    cell(num(p.failed_rounds)),
    cell(num(p.healed_fragments)),
    cell(ago(p.last_seen_s)),
    cell(p.reachability, "text"),
    cell(p.software_version, "text"),
  ])));
}

function extent(values) {
  let lo = Math.min(...values), hi = Math.max(...values);
  if (lo === hi) { lo -= 0.5; hi += 0.5; }
  return [lo, hi];
}

// The wall time the swarm reached ``step``, from the dashboard's (step, time) samples:
// interpolated between two, extrapolated at the ends; null with fewer than two.
function timeAt(clock, step) {
  if (clock.length < 2) return null;
  let i = 1;
  while (i < clock.length - 1 && clock[i][0] < step) i++;
  const [s0, t0] = clock[i - 1], [s1, t1] = clock[i];
  return t0 + (step - s0) * (t1 - t0) / (s1 - s0);
}

function lineChart(id, series, yLabel, clock) {
  const W = 640, H = 296, L = 56, R = 12, T = 12, B = 52;
  const box = document.getElementById(id);
  const root = svg("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "loss-chart"});
  const all = series.flatMap((s) => s.points);
  root.setAttribute("data-points", all.length);
  if (!all.length) {
    const t = svg("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"});
    t.textContent = id === "chart-outer" ?
      "no evaluations yet (nodes publish them with --eval-every N)" : "no losses yet";
    root.append(t);
    box.replaceChildren(root);
    return;
  }
  const [x0, x1] = extent(all.map((p) => p[0]));
  const [y0, y1] = extent(all.map((p) => p[1]));
  const x = (v) => L + (v - x0) / (x1 - x0) * (W - L - R);
  const y = (v) => T + (y1 - v) / (y1 - y0) * (H - T - B);
  root.append(svg("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"}));
  root.append(svg("line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"}));
  for (let i = 0; i <= 4; i++) {
    const xv = x0 + (x1 - x0) * i / 4, yv = y0 + (y1 - y0) * i / 4;
    const xt = svg("text", {x: x(xv), y: H - B + 14, "text-anchor": "middle"});
    xt.textContent = num(xv);
    const when = timeAt(clock, xv);
    if (when !== null) {
      const anchor = i === 0 ? "start" : i === 4 ? "end" : "middle";  // inside the box
      const tt = svg("text", {x: x(xv), y: H - B + 28, "text-anchor": anchor, class: "time-tick"});
      tt.textContent = clockTime(when);
      root.append(tt);
    }
    const yt = svg("text", {x: L - 4, y: y(yv) + 4, "text-anchor": "end"});
    yt.textContent = yv.toFixed(3);
    root.append(xt, yt);
  }
  const xl = svg("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle"});
  xl.textContent = clock.length < 2 ? "inner step" : "inner step, and when the swarm reached it";
  const yl = svg("text", {x: 12, y: T + (H - T - B) / 2, "text-anchor": "middle",
    transform: `rotate(-90 12 ${T + (H - T - B) / 2})`});
  yl.textContent = yLabel;
  root.append(xl, yl);
  for (const s of series) {
    const c = colour(s.peer_id);
    const g = svg("g", {class: "series", "data-peer": s.peer_id});
    g.append(svg("polyline", {fill: "none", stroke: c, "stroke-width": 1.5,
      points: s.points.map((p) => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" ")}));
    if (s.points.length <= MAX_DOTS) {
      for (const p of s.points) {
        const dot = svg("circle", {cx: x(p[0]).toFixed(1), cy: y(p[1]).toFixed(1), r: 2.5,
          fill: c, class: "point"});
        const tip = svg("title");
        tip.textContent = short(s.peer_id) + " step " + p[0] + ": " + p[1].toFixed(4);
        dot.append(tip);
        g.append(dot);
      }
    }
    root.append(g);
  }
  box.replaceChildren(root);
}

function renderTimeline(rounds, run) {
  const box = document.getElementById("timeline");
  if (!rounds.length) {
    box.replaceChildren(el("p", {}, ["no rounds yet"]));
    return;
  }
  const fragments = [...new Set(rounds.map((r) => r.fragment))].sort((a, b) => a - b);
  const W = 1300, L = 80, R = 12, ROW = 22, T = 8, B = 30;
  const H = T + ROW * fragments.length + B;
  const pad = (run.sync_every || 10) / 2;  // a round is drawn H/2 steps wide
  const [lo, hi] = extent(rounds.map((r) => r.step));
  const x0 = lo - pad / 2, x1 = hi + pad / 2;
  const x = (v) => L + (v - x0) / (x1 - x0) * (W - L - R);
  const width = Math.max(3, pad / (x1 - x0) * (W - L - R));
  const root = svg("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "timeline"});
  const fill = {ok: "#2ca02c", partial: "#ff9f1c", failed: "#d62728"};
  fragments.forEach((f, i) => {
    const label = svg("text", {x: 4, y: T + ROW * i + 15});
    label.textContent = "fragment " + f;
    root.append(label);
  });
  for (const r of rounds) {
    const rect = svg("rect", {x: x(r.step) - width / 2, y: T + ROW * fragments.indexOf(r.fragment) + 3,
      width: width, height: ROW - 6, rx: 2, fill: fill[r.outcome], class: "round " + r.outcome});
    const tip = svg("title");
    tip.textContent = `fragment ${r.fragment} round ${r.round} at step ${r.step}: ${r.outcome}, ` +
      `${r.members} members, ${r.seconds.toFixed(2)} s, ${bytes(r.bytes_sent)} sent` +
      (r.failed_by.length ? `, failed for ${r.failed_by.map(short).join(" ")}` : "");
    rect.append(tip);
    root.append(rect);
  }
  for (let i = 0; i <= 4; i++) {
    const v = lo + (hi - lo) * i / 4;
    const t = svg("text", {x: x(v), y: H - 10, "text-anchor": "middle"});
    t.textContent = num(v);
    root.append(t);
  }
  box.replaceChildren(root);
}

function renderRounds(rounds) {
  const newest = rounds.slice(-12).reverse();
  table("rounds", ["fragment", "round", "step", "outcome", "members", "seconds",
    "bytes sent (all)", "reported by", "failed for"],
  newest.map((r) => el("tr", {class: r.outcome}, [
    cell(r.fragment), cell(r.round), cell(num(r.step)), cell(r.outcome, "text"),
    cell(r.members), cell(r.seconds.toFixed(2)), cell(bytes(r.bytes_sent)),
    cell(r.reported_by.map(short).join(" "), "text"),
    cell(r.failed_by.map(short).join(" "), "text"),
  ])));
}

function renderFragments(fragments, peers) {
  const alive = peers.filter((p) => p.alive).map((p) => p.peer_id);
  table("fragments", ["fragment", "newest", "agreed", ...alive.map(short)],
    fragments.map((f) => {
      const byPeer = Object.fromEntries(f.cells.map((c) => [c.peer_id, c]));
      return el("tr", {}, [cell(f.fragment), cell("v" + f.newest_version),
        cell(f.agreed ? "yes" : "NO"),
        ...alive.map((peer) => {
          const c = byPeer[peer];
          if (!c) return cell("–");
          const td = cell("v" + c.version + " " + c.state_hash.slice(0, 8), "text " + c.mark);
          td.title = c.mark + ": " + c.state_hash;
          return td;
        })]);
    }));
}

function render(state) {
  renderRun(state.run);
  renderTotals(state.totals);
  for (const p of state.peers) colour(p.peer_id);  // stable colours: peer order
  renderPeers(state.peers);
  lineChart("chart-outer", state.loss.outer, "held-out loss (outer weights)", state.loss.clock);
  lineChart("chart-train", state.loss.train, "training loss", state.loss.clock);
  renderTimeline(state.rounds, state.run);
  renderRounds(state.rounds);
  renderFragments(state.fragments, state.peers);
}

async function poll() {
  try {
    const response = await fetch("/api/state", {cache: "no-store"});
    if (response.ok) render(await response.json());
  } catch (error) {
    document.getElementById("status").textContent = "dashboard unreachable: " + error;
  }
}

render(JSON.parse(document.getElementById("initial-state").textContent));
setInterval(poll, POLL_MS);
