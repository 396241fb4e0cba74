// fedfleet dashboard: polls the admin API (same origin; the session cookie carries the token).
"use strict";

const $ = (id) => document.getElementById(id);

async function api(path) {
  const resp = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
  return resp.json();
}

function ago(ts) {
  if (!ts) return "-";
  const s = Math.max(0, Date.now() / 1000 - ts);
  return s < 120 ? `${s.toFixed(0)}s ago` : s < 7200 ? `${(s / 60).toFixed(0)}m ago` : `${(s / 3600).toFixed(1)}h ago`;
}

function fillTable(id, rows) {
  const body = $(id).querySelector("tbody");
  body.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    for (const c of cells) {
      const td = document.createElement("td");
      if (c && typeof c === "object") { td.textContent = c.text; td.className = c.cls; } else { td.textContent = c ?? "-"; }
      tr.appendChild(td);
    }
    return tr;
  }));
}

function drawRound(cur) {
  const segs = ["accepted", "declined", "rejected", "lost"];
  const n = cur ? cur.participants.length : 0;
  for (const s of segs) {
    $("round-progress").querySelector("." + s).style.width = n ? `${(100 * cur[s].length) / n}%` : "0";
  }
  $("round-detail").textContent = cur
    ? `round ${cur.round}: ${cur.accepted.length}/${n} accepted, ${cur.pending.length} pending, ` +
      `${cur.declined.length} declined, ${cur.rejected.length} rejected, ${cur.lost.length} lost; ` +
      `deadline in ${Math.max(0, cur.deadline - Date.now() / 1000).toFixed(0)}s, ${(cur.bytes_in / 1024).toFixed(1)} KB in`
    : "no open round";
}

function drawCurve(evals) {
  const pts = evals.filter((e) => e.accuracy !== undefined && e.accuracy !== null);
  const maxX = Math.max(1, ...pts.map((e) => e.contributions));
  $("accuracy-line").setAttribute("points",
    pts.map((e) => `${(30 + (365 * e.contributions) / maxX).toFixed(1)},${(180 - 175 * e.accuracy).toFixed(1)}`).join(" "));
  $("accuracy-caption").textContent = pts.length
    ? `x: contributions (0-${maxX}), ${pts.length} evaluations, last ${pts[pts.length - 1].accuracy.toFixed(4)}`
    : "no evaluations with accuracy yet";
}

let lastJob = null;

async function showCompute() {
  const health = await api("/api/health");
  $("compute-device").textContent = health.compute.device;
  $("compute-detail").textContent = `${health.compute.gpu ?? "no GPU"}; SecAgg unmask: ${health.compute.secagg_unmask}`;
}

async function refresh() {
  try {
    const status = await api("/api/status");
    const job = status.job;
    if (job) lastJob = job.job_id;
    $("job-id").textContent = job ? job.job_id : lastJob ?? "-";
    $("job-state").textContent = job ? job.state : "no active job";
    $("round-number").textContent = job ? job.round : "-";
    $("contributions").textContent = job ? job.contributions : "-";
    $("online").textContent = status.devices_online ? status.devices_online.length : "-";
    $("accuracy").textContent = job && job.accuracy != null ? job.accuracy.toFixed(4) : "-";
    const dp = job ? job.privacy : null;
    $("privacy").textContent = dp ? `${dp.epsilon.toFixed(3)} (${dp.delta})` : "-";
    $("privacy-detail").textContent = dp ? `z=${dp.noise_multiplier}, budget ${dp.target_epsilon ?? "none"}` : "no DP";
    drawRound(job ? job.current_round : null);
    const [devices, clusters] = await Promise.all([api("/api/devices"), api("/api/clusters")]);
    fillTable("fleet-table", devices.map((d) => [
      d.device_id, { text: d.status, cls: d.status === "revoked" ? "revoked" : "" },
      { text: d.online ? "online" : "offline", cls: d.online ? "online" : "offline" }, ago(d.last_seen), d.cluster,
      Object.entries(d.profile).map(([k, v]) => `${k}=${v}`).join(", ").slice(0, 60)]));
    fillTable("clusters-table", clusters.map((c) => [c.cluster_id, c.label, c.job_id, c.model_id, c.devices]));
    if (lastJob) {
      const [rounds, evals] = await Promise.all([api(`/api/jobs/${lastJob}/rounds`), api(`/api/jobs/${lastJob}/evaluations`)]);
      fillTable("rounds-table", rounds.slice(-15).reverse().map((r) => [r.round, r.state, r.participants.length,
        r.accepted.length, r.dropped.length, r.duration_s == null ? "open" : r.duration_s.toFixed(1) + "s",
        (r.bytes_in / 1024).toFixed(1)]));
      drawCurve(evals);
    }
    $("conn").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    $("conn").textContent = `error: ${err.message}`;
  }
}

showCompute().catch((err) => { $("compute-detail").textContent = `error: ${err.message}`; });
refresh();
setInterval(refresh, 1000);
