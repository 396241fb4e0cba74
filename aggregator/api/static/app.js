// fedfleet dashboard: polls the admin API (same origin; the session cookie carries the token).
// Everything about a job (rounds, evaluations, models) comes from the store through the API, so
// it stays on the page after the job ends; the job shown is the active one, else the newest,
// unless the operator clicked another in the jobs table.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
let chosenJob = null;           // picked in the jobs table; null: follow the active / newest job

async function api(path) {
  const resp = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (resp.status === 401) { window.location.assign("/dashboard/"); throw new Error("signed out"); }
  if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
  return resp.json();
}

// A paged listing's first page (aggregator/api/paging.py) and how many rows the whole listing holds
async function apiPage(path) {
  const resp = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (resp.status === 401) { window.location.assign("/dashboard/"); throw new Error("signed out"); }
  if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
  const rows = await resp.json();
  return { rows, total: Number(resp.headers.get("X-Total-Count") ?? rows.length) };
}

// What the tables show, all the dashboard asks for each second: the newest of each listing (each was
// read and sent whole every second, growing with every job the service ever ran)
const JOBS_SHOWN = 50, MODELS_SHOWN = 20, DEPLOYMENTS_SHOWN = 20;

function ago(ts) {
  if (!ts) return "-";
  const s = Math.max(0, Date.now() / 1000 - ts);
  return s < 120 ? `${s.toFixed(0)}s ago` : s < 7200 ? `${(s / 60).toFixed(0)}m ago` : `${(s / 3600).toFixed(1)}h ago`;
}

// Text a device wrote (its profile, a decline reason quoted in a job's summary), shown as the logs
// and the admin CLI show it (protocols/log_text.py): every character Python's str.isprintable
// refuses -- controls, bidirectional overrides and isolates, invisible format characters,
// separators, spaces but the space -- as its Python escape. textContent makes no markup of text,
// but a U+202E in it still showed the rest of the cell reversed (a device id or a file name read
// as another) and a zero-width character hid in it. A backslash is written \\ too: else a
// device's printable text "\u202e" read exactly as an escaped override (no telling which was sent).
const UNPRINTABLE = /[\p{C}\p{Z}\\]/gu;   // C: Cc Cf Cs Co Cn; Z: Zs Zl Zp (lone surrogates are Cs); the backslash

function escapeOf(cp) {
  const hex = (width) => cp.toString(16).padStart(width, "0");
  if (cp === 0x0a) return "\\n";
  if (cp === 0x0d) return "\\r";
  if (cp === 0x09) return "\\t";
  if (cp === 0x5c) return "\\\\";
  return cp < 0x100 ? `\\x${hex(2)}` : cp < 0x10000 ? `\\u${hex(4)}` : `\\U${hex(8)}`;
}

function shown(value) {
  return String(value).replace(UNPRINTABLE, (c) => (c === " " ? c : escapeOf(c.codePointAt(0))));
}

function fillTable(id, rows, onRow) {
  const body = $(id).querySelector("tbody");
  body.replaceChildren(...rows.map((cells, i) => {
    const tr = document.createElement("tr");
    for (const c of cells) {
      const td = document.createElement("td");
      if (c && typeof c === "object") { td.textContent = shown(c.text); td.className = c.cls; } else { td.textContent = shown(c ?? "-"); }
      tr.appendChild(td);
    }
    if (onRow) onRow(tr, i);
    return tr;
  }));
}

// The open round, from the same answer as the rounds table, so the two never disagree.
function drawRound(open) {
  const n = open ? open.participants.length : 0;
  const parts = { accepted: "accepted", declined: "declined", rejected: "rejected", lost: "dropped" };
  for (const [cls, key] of Object.entries(parts)) {
    $("round-progress").querySelector("." + cls).style.width = n ? `${(100 * open[key].length) / n}%` : "0";
  }
  $("round-detail").textContent = open
    ? `round ${open.round}: ${open.accepted.length}/${n} accepted, ${open.pending.length} pending, ` +
      `${open.declined.length} declined, ${open.rejected.length} rejected, ${open.dropped.length} lost; ` +
      `deadline in ${Math.max(0, open.deadline - Date.now() / 1000).toFixed(0)}s, ${(open.bytes_in / 1024).toFixed(1)} KB in`
    : "no open round";
}

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function drawCurve(evals) {
  const pts = evals.filter((e) => e.accuracy !== undefined && e.accuracy !== null);
  const maxX = Math.max(1, ...pts.map((e) => e.contributions || 0));
  const x = (c) => 34 + (361 * (c || 0)) / maxX, y = (a) => 185 - 175 * a;
  $("accuracy-grid").replaceChildren(...[0, 0.25, 0.5, 0.75, 1].flatMap((a) => [
    svgEl("line", { x1: 34, x2: 395, y1: y(a), y2: y(a), class: "grid" }),
    svgEl("text", { x: 2, y: y(a) + 3, class: "tick" }, `${(100 * a).toFixed(0)}%`)]));
  $("accuracy-line").setAttribute("points", pts.map((e) => `${x(e.contributions).toFixed(1)},${y(e.accuracy).toFixed(1)}`).join(" "));
  // a marker per evaluation (at most 200): one evaluation is a point, not an empty chart
  const step = Math.max(1, Math.ceil(pts.length / 200));
  $("accuracy-points").replaceChildren(...pts.filter((_, i) => i % step === 0 || i === pts.length - 1).map((e) =>
    svgEl("circle", { cx: x(e.contributions).toFixed(1), cy: y(e.accuracy).toFixed(1), r: 2.5 })));
  $("accuracy-caption").textContent = pts.length
    ? `x: contributions (0-${maxX}), ${pts.length} evaluations, last ${pts[pts.length - 1].accuracy.toFixed(4)}`
    : "no evaluations with accuracy yet";
}

function showJobs(jobs, total, shown) {
  $("jobs-count").textContent = total > jobs.length ? `(the newest ${jobs.length} of ${total})` : "";
  fillTable("jobs-table", jobs.map((j) => [j.job_id, j.kind, j.state, j.rounds, j.contributions,
    ago(j.started_at), ago(j.finished_at), (j.summary && j.summary.error) || ""]), (tr, i) => {
    tr.dataset.job = jobs[i].job_id;
    if (jobs[i].job_id === shown) tr.className = "selected";
    tr.addEventListener("click", () => { chosenJob = jobs[i].job_id; poll(); });
  });
}

function showDeployments(deployments) {     // newest first, as asked
  fillTable("deployments-table", deployments.map((d) => {
    const last = [...d.history].reverse().find((h) => h.metrics && h.metrics.wma_candidate != null);
    const acc = last ? `${last.metrics.wma_candidate.toFixed(2)}% / ${last.metrics.wma_current.toFixed(2)}%` : "-";
    const cls = d.state === "rolled_back" || d.state === "halted" ? "bad" : d.state === "complete" ? "good" : "";
    // the refusals devices reported, by class (an attack reads as signature/hash/stale/device, a slow
    // network as timeout), and reports refused as not about the device's last assignment
    const classes = Object.entries(d.counts).filter(([k, v]) => k.startsWith("refused:") && v)
      .map(([k, v]) => `${k.slice(8)} ${v}`);
    if (d.counts.late_reports) classes.push(`late reports ${d.counts.late_reports}`);
    const refused = classes.length ? `${d.counts.refused} (${classes.join(", ")})` : d.counts.refused;
    return [d.deployment_id, d.model_id, { text: d.state, cls }, `${d.stage}/${d.stages.length}`, d.cohort, d.guard,
      // a rollback's reason, else why it last changed state (a promotion: the guard it passed, or the operator)
      d.counts.sent_run, d.counts.reported, refused, acc, d.reason || (d.history.at(-1) || {}).why || ""];
  }));
}

const DEVICE_PAGE = 1000;   // /api/devices' default page: a fleet of 100,000 is counted, not listed

function showDevices(devices, online, fleet) {
  const count = (s) => devices.filter((d) => d.status === s).length;
  const whole = devices.length < DEVICE_PAGE;
  const strangers = whole ? count("not enrolled") : fleet.online_not_enrolled;
  const [enrolled, revoked] = whole ? [count("enrolled"), count("revoked")] : [fleet.enrolled, fleet.revoked];
  $("online").textContent = online;
  $("fleet-summary").textContent = `${enrolled + revoked + strangers} known: ${enrolled} enrolled, ` +
    `${strangers} not enrolled, ${revoked} revoked` + (whole ? "" : ` (the first ${devices.length} listed)`);
  fillTable("fleet-table", devices.map((d) => [
    d.device_id, { text: d.status, cls: d.status.replace(" ", "-") },
    { text: d.online ? "online" : "offline", cls: d.online ? "online" : "offline" }, ago(d.last_seen), d.cluster,
    (d.tags || []).join(", "), Object.entries(d.profile).map(([k, v]) => `${k}=${v}`).join(", ").slice(0, 60)]));
}

// the rounds table's rows: the only rounds asked for each second (a job of 50,000 rounds is not read
// whole for it); the open round shown is the first open one among them
const ROUNDS_SHOWN = 15;

async function showJob(job, live) {
  const id = encodeURIComponent(job.job_id);
  const [rounds, evals, models] = await Promise.all([api(`/api/jobs/${id}/rounds?last=${ROUNDS_SHOWN}`), api(`/api/jobs/${id}/evaluations`),
    api(`/api/models?job_id=${id}&order=newest&limit=${MODELS_SHOWN}`)]);
  const isLive = live && live.job_id === job.job_id;
  const open = rounds.find((r) => r.state === "open") || null;
  $("selected-job").textContent = shown(job.job_id);
  $("job-id").textContent = shown(job.job_id);
  $("job-state").textContent = shown(isLive ? live.state + (live.waiting ? ` (${live.waiting})` : "") : job.state);
  $("round-number").textContent = open ? open.round : rounds.length ? rounds[rounds.length - 1].round : "-";
  $("contributions").textContent = isLive ? live.contributions : job.contributions;
  const last = evals.filter((e) => e.accuracy != null).pop();
  $("accuracy").textContent = last ? last.accuracy.toFixed(4) : "-";
  const dpEval = evals.filter((e) => e.privacy != null).pop();
  const dp = isLive && live.privacy ? live.privacy : dpEval ? dpEval.privacy : null;
  // a run whose noise is seeded (tests only) claims no ε: anyone knowing the seed can undo it
  $("privacy").textContent = !dp ? "-" : dp.not_private ? "not private (seeded noise)" : `${dp.epsilon.toFixed(3)} (${dp.delta})`;
  $("privacy-detail").textContent = dp ? `z=${dp.noise_multiplier}, budget ${dp.target_epsilon ?? "none"}` : "no DP";
  drawRound(open);
  fillTable("rounds-table", rounds.slice().reverse().map((r) => [r.round, r.state, r.participants.length,
    r.accepted.length, r.dropped.length, r.declined.length, r.rejected.length,
    r.duration_s == null ? "open" : r.duration_s.toFixed(1) + "s", (r.bytes_in / 1024).toFixed(1)]));
  drawCurve(evals);
  fillTable("models-table", models.map((m) => [m.model_id, m.version, m.round, m.contributions,
    m.metrics.accuracy == null ? "-" : m.metrics.accuracy.toFixed(4), m.final ? "final" : "", m.sha256.slice(0, 12)]));
}

async function refresh() {
  try {
    const [status, jobPage, devices, clusters, deployments, fleet] = await Promise.all([api("/api/status"),
      apiPage(`/api/jobs?order=newest&limit=${JOBS_SHOWN}`), api(`/api/devices?limit=${DEVICE_PAGE}`),
      api("/api/clusters"), api(`/api/deployments?order=newest&limit=${DEPLOYMENTS_SHOWN}`), api("/api/fleet")]);
    const jobs = jobPage.rows;
    const live = status.job;
    const shownId = chosenJob || (live ? live.job_id : jobs.length ? jobs[0].job_id : null);
    showJobs(jobs, jobPage.total, shownId);
    // /api/status counts the devices online (absent without a live service: count the page's)
    showDevices(devices, status.devices_online ?? devices.filter((d) => d.online).length, fleet);
    showDeployments(deployments);
    fillTable("clusters-table", clusters.map((c) => [c.cluster_id, c.label, c.job_id, c.model_id, c.devices]));
    // the job shown (the active one, or the one clicked) may be older than the newest page
    const job = jobs.find((j) => j.job_id === shownId) ||
      (shownId ? await api(`/api/jobs/${encodeURIComponent(shownId)}`) : null);
    if (job) await showJob(job, live);
    $("conn").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    $("conn").textContent = `error: ${err.message}`;
  }
}

async function showCompute() {
  const health = await api("/api/health");
  $("compute-device").textContent = health.compute.device;
  $("compute-detail").textContent = `${health.compute.gpu ?? "no GPU"}; SecAgg unmask: ${health.compute.secagg_unmask}`;
}

// One refresh at a time: the next is due a second after the last settled. A fixed 1 s interval
// started the next while a slow one (a slow server, a large fleet) was unfinished, piling requests
// on the server. A refresh asked for during one (a click in the jobs table) runs as it settles.
const REFRESH_PAUSE_MS = 1000;
let refreshing = false, refreshAgain = false, nextRefresh = null;

async function poll() {
  if (refreshing) { refreshAgain = true; return; }
  clearTimeout(nextRefresh);
  refreshing = true;
  try {
    await refresh();
  } finally {                               // refresh shows its own errors; polling goes on after any
    refreshing = false;
    if (refreshAgain) { refreshAgain = false; poll(); } else nextRefresh = setTimeout(poll, REFRESH_PAUSE_MS);
  }
}

showCompute().catch((err) => { $("compute-detail").textContent = `error: ${err.message}`; });
poll();
