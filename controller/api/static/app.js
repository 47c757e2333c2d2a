// metalguard fleet dashboard (docs/dashboard.md): vanilla JS, no build step, no CDN.
// Reads the controller's API (docs/api.md) with the operator's bearer token; the live
// event stream is GET /v1/events read with fetch() so that it can send the token header.
"use strict";

(() => {
  const API = new URL("../", location.href); // the controller's root: /ui/ -> /
  const GRADES = ["HEALTHY", "SUB_HEALTHY", "FAILING", "MAINTENANCE", "UNREACHABLE"];
  const TOKEN_KEY = "metalguard.token";
  const MAX_EVENTS = 200;
  const POLL_LIVE_MS = 30000; // slow poll while the event stream is live
  const POLL_DOWN_MS = 5000; // faster while it is down
  const REFRESH_DEBOUNCE_MS = 400;
  const HEATMAP_MAX = 2000; // above this many nodes the fleet shows one cell per rack
  const PAGE = 5000; // GET /v1/nodes's largest page
  const WORST_FIRST = ["FAILING", "UNREACHABLE", "SUB_HEALTHY", "MAINTENANCE", "HEALTHY"];

  const state = {
    token: sessionStorage.getItem(TOKEN_KEY) || "",
    lastSeq: null,
    live: false,
    refreshTimer: null,
    pollTimer: null,
    rendering: false,
    again: false,
    streamAbort: null,
    painted: false,
  };

  class HttpError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // --- small helpers -------------------------------------------------------------------

  /** An element with attributes and children; text is always text (never HTML). */
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.className = v;
      else if (k === "text") el.textContent = v;
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else if (k === "dataset") Object.assign(el.dataset, v);
      else el.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }

  const SVG = "http://www.w3.org/2000/svg";
  function s(tag, attrs) {
    const el = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
    return el;
  }

  function fmtTime(ts) {
    if (ts === null || ts === undefined) return "—";
    return new Date(ts * 1000).toLocaleTimeString();
  }

  function fmtDateTime(ts) {
    if (ts === null || ts === undefined) return "—";
    return new Date(ts * 1000).toLocaleString();
  }

  function fmtValue(v) {
    if (v === null || v === undefined) return "—";
    if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toFixed(3);
    if (typeof v === "object") return JSON.stringify(v);
    return String(v);
  }

  const COLLATOR = new Intl.Collator(undefined, { numeric: true }); // one, not one per call
  function naturalCompare(a, b) {
    return COLLATOR.compare(String(a), String(b));
  }

  function gradeBadge(grade) {
    return h("span", { class: `badge g-${grade}`, text: grade });
  }

  function showError(message) {
    const el = document.getElementById("error");
    el.textContent = message || "";
    el.hidden = !message;
  }

  async function api(path) {
    const headers = { Accept: "application/json" };
    if (state.token) headers.Authorization = `Bearer ${state.token}`;
    const response = await fetch(new URL(path, API), { headers, cache: "no-store" });
    let body = null;
    try {
      body = await response.json();
    } catch (_) {
      body = null;
    }
    if (!response.ok) {
      const message = body && body.error ? body.error.message : response.statusText;
      throw new HttpError(response.status, message);
    }
    return body;
  }

  function explain(err) {
    if (err instanceof HttpError && err.status === 401) {
      document.getElementById("token").focus();
      return `This controller needs a token (${err.message}): enter a read token above.`;
    }
    return `Could not reach the controller: ${err.message}`;
  }

  // --- routing -------------------------------------------------------------------------

  function route() {
    const hash = location.hash.replace(/^#\/?/, "");
    const [view, ...rest] = hash.split("/");
    if (view === "node" && rest.length) return { view: "node", node: decodeURIComponent(rest.join("/")) };
    if (view === "rack" && rest.length === 3) {
      const [region, cluster, rack] = rest.map(decodeURIComponent);
      return { view: "rack", region, cluster, rack };
    }
    if (view === "fleet" && rest[0] === "nodes") return { view: "fleet", nodes: true };
    if (view === "jobs") return { view: "jobs" };
    if (view === "instances") return { view: "instances" };
    return { view: "fleet" };
  }

  function markNav(view) {
    for (const [id, name] of [["nav-fleet", "fleet"], ["nav-jobs", "jobs"], ["nav-instances", "instances"]]) {
      const a = document.getElementById(id);
      if (name === view || ((view === "node" || view === "rack") && name === "fleet")) a.setAttribute("aria-current", "page");
      else a.removeAttribute("aria-current");
    }
  }

  /** Render the current view; calls made while one runs coalesce into one more. */
  async function render(moveFocus) {
    if (state.rendering) {
      state.again = true;
      return;
    }
    state.rendering = true;
    const r = route();
    const main = document.getElementById("view");
    const focused = document.activeElement && main.contains(document.activeElement)
      ? document.activeElement.dataset.focusKey : null;
    main.setAttribute("aria-busy", "true");
    markNav(r.view);
    try {
      let content;
      if (r.view === "node") content = await nodeView(r.node);
      else if (r.view === "jobs") content = await jobsView();
      else if (r.view === "instances") content = await instancesView();
      else if (r.view === "rack") content = await rackView(r);
      else content = await fleetView(r.nodes);
      main.replaceChildren(...content);
      document.body.dataset.view = r.view;
      if (!state.painted) {
        state.painted = true; // the first view on screen: a mark after its frame is painted
        requestAnimationFrame(() => setTimeout(() => performance.mark("metalguard:first-view")));
      }
      showError("");
      if (focused) {
        const again = main.querySelector(`[data-focus-key="${CSS.escape(focused)}"]`);
        if (again) again.focus();
      } else if (moveFocus) {
        main.focus();
      }
    } catch (err) {
      showError(explain(err));
    } finally {
      main.setAttribute("aria-busy", "false");
      state.rendering = false;
      if (state.again) {
        state.again = false;
        render(false);
      }
    }
  }

  function scheduleRefresh() {
    if (state.refreshTimer) return;
    state.refreshTimer = setTimeout(() => {
      state.refreshTimer = null;
      render(false);
    }, REFRESH_DEBOUNCE_MS);
  }

  function schedulePoll() {
    clearTimeout(state.pollTimer);
    state.pollTimer = setTimeout(() => {
      render(false).finally(schedulePoll);
    }, state.live ? POLL_LIVE_MS : POLL_DOWN_MS);
  }

  // --- fleet: region -> cluster -> rack -> node -----------------------------------------

  function counts(nodes) {
    const by = Object.fromEntries(GRADES.map((g) => [g, 0]));
    for (const n of nodes) by[n.grade] = (by[n.grade] || 0) + 1;
    return by;
  }

  function countList(nodes, label) {
    const by = counts(nodes);
    return h(
      "ul",
      { class: "counts", "aria-label": `${label}: grade counts` },
      Object.entries(by)
        .filter(([, n]) => n > 0)
        .map(([g, n]) => h("li", { class: `g-${g}`, dataset: { grade: g }, text: `${n} ${g}` })),
    );
  }

  function groupBy(items, key) {
    const map = new Map();
    for (const item of items) {
      const k = key(item);
      if (!map.has(k)) map.set(k, []);
      map.get(k).push(item);
    }
    return [...map.entries()].sort(([a], [b]) => naturalCompare(a, b));
  }

  /** What tells the nodes of one group apart: their names less the common prefix (but
   * whole: ``r1c1k2n5`` among ``r1c1k2n*`` shows ``n5``, ``gpu-017`` shows ``017``). */
  function shortNames(nodes) {
    const names = nodes.map((n) => n.node);
    let cut = names.length > 1 ? Math.min(...names.map((x) => x.length)) : 0;
    for (const x of names) while (cut > 0 && x.slice(0, cut) !== names[0].slice(0, cut)) cut -= 1;
    while (cut > 0 && /[0-9]/.test(names[0][cut - 1])) cut -= 1; // whole numbers
    while (cut > 0 && /[A-Za-z]/.test(names[0][cut - 1])) cut -= 1; // and their letters
    return new Map(names.map((x) => [x, x.slice(cut).slice(-5)]));
  }

  /** A node's provisioning in words: "instance acme-1 active, tenant acme" (or null for a
   * node provisioning does not know, or one with no instance). */
  function provisionText(p) {
    if (!p) return null;
    const flagged = p.flagged ? ", flagged after failed deploys" : "";
    if (!p.instance) return p.flagged ? `provisioning: ${p.state}${flagged}` : null;
    return `instance ${p.instance} ${p.state}, tenant ${p.tenant}${flagged}`;
  }

  function nodeButton(n, short) {
    const why = n.reasons && n.reasons.length ? n.reasons[0].message || n.reasons[0].signal : "";
    const flags = [n.cordoned && "cordoned", n.held && "held"].filter(Boolean).join(", ");
    const prov = provisionText(n.provision);
    const label = `${n.node}: ${n.grade}, score ${fmtValue(n.score)}${flags ? `, ${flags}` : ""}${prov ? `, ${prov}` : ""}${why ? `; ${why}` : ""}`;
    const p = n.provision || null;
    const provClass = p && (p.instance || p.flagged) ? ` prov prov-${p.state}${p.flagged ? " prov-flagged" : ""}` : "";
    return h(
      "li",
      {},
      h("button", {
        type: "button",
        class: `node g-${n.grade}${n.cordoned ? " cordoned" : ""}${provClass}`,
        "aria-label": label,
        title: label,
        dataset: {
          node: n.handle,
          grade: n.grade,
          focusKey: `node:${n.handle}`,
          ...(p ? { provision: p.state } : {}),
          ...(p && p.tenant ? { tenant: p.tenant } : {}),
        },
        onclick: () => {
          location.hash = `#/node/${encodeURIComponent(n.handle)}`;
        },
        text: short,
      }),
    );
  }

  function nodeGrid(rack, nodes) {
    const short = shortNames(nodes);
    const grid = h("ul", { class: "nodes", "aria-label": `nodes of rack ${rack}` }, nodes.map((n) => nodeButton(n, short.get(n.node))));
    grid.style.gridTemplateColumns = `repeat(${nodes.length > 16 ? 8 : 4}, 30px)`; // CSSOM: CSP allows it
    return grid;
  }

  function legend(provisioned) {
    return h(
      "ul",
      { class: "legend", "aria-label": "Grade colours" },
      GRADES.map((g) => h("li", {}, h("span", { class: `swatch g-${g}`, "aria-hidden": "true" }), g)),
      provisioned
        ? h("li", {}, h("span", { class: "swatch prov-swatch", "aria-hidden": "true" }), "booted for a tenant (hover for the instance)")
        : null,
    );
  }

  /** Under a rack's grid: each node booted for a tenant, "n1 acme · active". */
  function rackTenants(rack, nodes) {
    const short = shortNames(nodes);
    const booted = nodes.filter((n) => n.provision && n.provision.instance);
    if (!booted.length) return null;
    return h(
      "ul",
      { class: "rack-tenants", "aria-label": `tenants' nodes of rack ${rack}` },
      booted.map((n) =>
        h(
          "li",
          { dataset: { node: n.handle, tenant: n.provision.tenant, provision: n.provision.state } },
          h("a", { href: `#/node/${encodeURIComponent(n.handle)}`, text: short.get(n.node) }),
          ` ${n.provision.tenant} · ${n.provision.state}`,
        ),
      ),
    );
  }

  /** Instances per tenant and state, for the fleet's heading ("acme: 2 active"). */
  function tenantSummary(nodes) {
    const by = new Map();
    for (const n of nodes) {
      const p = n.provision;
      if (!p || !p.instance) continue;
      const key = `${p.tenant}: ${p.state}`;
      by.set(key, (by.get(key) || 0) + 1);
    }
    if (!by.size) return null;
    const parts = [...by.entries()].sort(([a], [b]) => naturalCompare(a, b)).map(([k, c]) => {
      const [tenant, st] = k.split(": ");
      return `${tenant}: ${c} ${st}`;
    });
    return h("p", { id: "tenants", class: "muted" }, "Tenants' nodes: ", h("a", { href: "#/instances", text: parts.join(" · ") }));
  }

  /** GET /v1/qos by "region/cluster", or an empty map where the controller has no QoS
   * routes (404) or the view cannot be read: the heatmap never waits on it. */
  async function qosClusters() {
    try {
      const { clusters } = await api("v1/qos");
      return new Map(clusters.map((c) => [`${c.region}/${c.cluster}`, c]));
    } catch (_) {
      return new Map();
    }
  }

  function fmtRate(v) {
    if (v === null || v === undefined) return "—";
    if (v >= 100) return `${Math.round(v)}/s`;
    return `${v.toFixed(v >= 10 ? 1 : 2)}/s`;
  }

  /** A cluster's congestion: pause frames and RDMA transmit waits (never a node fault by
   * themselves), its most congested nodes and its nodes in QoS status degraded. */
  function congestionPanel(cluster, q) {
    const facts = [
      q.profile_version === null ? "no QoS profile" : `profile v${q.profile_version}`,
      `${q.nodes_reporting}/${q.nodes} nodes reporting`,
      `pause frames ${fmtRate(q.pause_frames_per_s)}`,
      `xmit_wait ${fmtRate(q.xmit_wait_per_s)}`,
    ];
    const panel = h(
      "div",
      { class: "congestion", role: "group", "aria-label": `congestion of cluster ${cluster}`, dataset: { congestion: cluster } },
      h("p", { class: "congestion-facts", text: `Congestion: ${facts.join(" · ")}` }),
    );
    if (q.top.length) {
      panel.append(
        h(
          "ol",
          { class: "congested", "aria-label": `most congested nodes of cluster ${cluster}` },
          q.top.map((n) =>
            h(
              "li",
              { dataset: { congested: n.handle } },
              h("a", { href: `#/node/${encodeURIComponent(n.handle)}`, text: n.node }),
              ` ${Math.round(n.share * 100)}% · pause ${fmtRate(n.pause_frames_per_s)} · xmit_wait ${fmtRate(n.xmit_wait_per_s)}`,
            ),
          ),
        ),
      );
    }
    if (q.degraded.length) {
      panel.append(
        h(
          "p",
          { class: "qos-degraded" },
          "QoS degraded: ",
          q.degraded.flatMap((d, i) => [
            i ? ", " : "",
            h("a", {
              href: `#/node/${encodeURIComponent(d.handle)}`,
              text: `${d.node} (${d.interfaces.map((x) => x.interface).join(", ")})`,
              title: d.interfaces.flatMap((x) => x.reasons || []).join("; "),
            }),
          ]),
        ),
      );
    }
    return panel;
  }

  /** Every page of GET /v1/nodes with these filters (``query``: URLSearchParams). */
  async function allNodes(query) {
    const nodes = [];
    let cursor = null;
    do {
      const q = new URLSearchParams(query);
      q.set("limit", String(PAGE));
      if (cursor) q.set("cursor", cursor);
      const page = await api(`v1/nodes?${q}`);
      nodes.push(...page.nodes);
      cursor = page.next;
    } while (cursor);
    return nodes;
  }

  /** The fleet: one cell per node up to HEATMAP_MAX nodes (or with ``#/fleet/nodes``),
   * above that one cell per rack (GET /v1/summary), which opens the rack's nodes. */
  async function fleetView(everyNode) {
    const [summary, qos] = await Promise.all([api("v1/summary?by=rack"), qosClusters()]);
    if (summary.total > HEATMAP_MAX && !everyNode) return rackFleet(summary, qos);
    return nodeFleet(await allNodes(""), qos);
  }

  function rackBox(rack, inRack) {
    inRack.sort((a, b) => naturalCompare(a.node, b.node));
    return h(
      "div",
      { class: "rack", role: "group", "aria-label": `rack ${rack}: ${inRack.length} nodes`, dataset: { rack } },
      h("p", { class: "rack-title", text: `rack ${rack} · ${inRack.length}` }),
      countList(inRack, `rack ${rack}`),
      nodeGrid(rack, inRack),
      rackTenants(rack, inRack),
    );
  }

  function nodeFleet(nodes, qos) {
    const out = [
      h("h2", { text: `Fleet: ${nodes.length} node${nodes.length === 1 ? "" : "s"}` }),
      countList(nodes, "fleet"),
      legend(nodes.some((n) => n.provision && n.provision.instance)),
      tenantSummary(nodes),
    ];
    if (!nodes.length) out.push(h("p", { class: "muted", text: "No node has reported yet." }));
    for (const [region, inRegion] of groupBy(nodes, (n) => n.region)) {
      const section = h(
        "section",
        { class: "region card", "aria-label": `region ${region}`, dataset: { region } },
        h("h2", {}, `region ${region}`, h("span", { class: "muted", text: `${inRegion.length} nodes` }), countList(inRegion, `region ${region}`)),
      );
      for (const [cluster, inCluster] of groupBy(inRegion, (n) => n.cluster)) {
        const racks = h("div", { class: "racks" });
        for (const [rack, inRack] of groupBy(inCluster, (n) => n.rack || "(no rack)")) racks.append(rackBox(rack, inRack));
        section.append(
          h(
            "section",
            { class: "cluster", "aria-label": `cluster ${cluster}`, dataset: { cluster } },
            h("h3", {}, `cluster ${cluster}`, h("span", { class: "muted", text: `${inCluster.length} nodes` }), countList(inCluster, `cluster ${cluster}`)),
            qos.has(`${region}/${cluster}`) ? congestionPanel(cluster, qos.get(`${region}/${cluster}`)) : null,
            racks,
          ),
        );
      }
      out.push(section);
    }
    return out;
  }

  /** Grade counts as the counts list (``by``: grade -> nodes). */
  function gradeCounts(by, label) {
    return h(
      "ul",
      { class: "counts", "aria-label": `${label}: grade counts` },
      GRADES.filter((g) => by[g] > 0).map((g) => h("li", { class: `g-${g}`, dataset: { grade: g }, text: `${by[g]} ${g}` })),
    );
  }

  function addCounts(into, by) {
    for (const [g, n] of Object.entries(by)) into[g] = (into[g] || 0) + n;
    return into;
  }

  function rackHash(g) {
    return `#/rack/${[g.region, g.cluster, g.rack].map(encodeURIComponent).join("/")}`;
  }

  /** A rack's cell: its worst grade's colour, its node count; a click opens its nodes. */
  function rackCell(g) {
    const worst = WORST_FIRST.find((x) => g.grades[x] > 0) || "HEALTHY";
    const name = g.rack || "(no rack)";
    const grades = GRADES.filter((x) => g.grades[x] > 0).map((x) => `${g.grades[x]} ${x}`).join(", ");
    const label = `rack ${name}: ${g.nodes} nodes, ${grades}${g.cordoned ? `, ${g.cordoned} cordoned` : ""}`;
    return h(
      "li",
      {},
      h("button", {
        type: "button",
        class: `rack-cell g-${worst}${g.cordoned ? " cordoned" : ""}`,
        "aria-label": label,
        title: label,
        dataset: { rack: g.rack, cluster: g.cluster, region: g.region, grade: worst, focusKey: `rack:${g.region}/${g.cluster}/${g.rack}` },
        onclick: () => {
          location.hash = rackHash(g);
        },
        text: String(g.nodes),
      }),
    );
  }

  function rackFleet(summary, qos) {
    const out = [
      h("h2", { text: `Fleet: ${summary.total} nodes` }),
      gradeCounts(summary.grades, "fleet"),
      legend(false),
      h("p", { class: "muted", id: "summarised" }, `One cell per rack (more than ${HEATMAP_MAX} nodes): its worst grade, its node count; open a rack for its nodes, or `, h("a", { href: "#/fleet/nodes", text: "every node" }), "."),
    ];
    const regions = groupBy(summary.groups, (g) => g.region);
    for (const [region, inRegion] of regions) {
      const section = h(
        "section",
        { class: "region card", "aria-label": `region ${region}`, dataset: { region } },
        h("h2", {}, `region ${region}`, h("span", { class: "muted", text: `${inRegion.reduce((n, g) => n + g.nodes, 0)} nodes` }), gradeCounts(inRegion.reduce((by, g) => addCounts(by, g.grades), {}), `region ${region}`)),
      );
      for (const [cluster, racks] of groupBy(inRegion, (g) => g.cluster)) {
        const total = racks.reduce((n, g) => n + g.nodes, 0);
        racks.sort((a, b) => naturalCompare(a.rack, b.rack));
        section.append(
          h(
            "section",
            { class: "cluster summarised", "aria-label": `cluster ${cluster}`, dataset: { cluster } },
            h("h3", {}, `cluster ${cluster}`, h("span", { class: "muted", text: `${total} nodes · ${racks.length} racks` }), gradeCounts(racks.reduce((by, g) => addCounts(by, g.grades), {}), `cluster ${cluster}`)),
            qos.has(`${region}/${cluster}`) ? congestionPanel(cluster, qos.get(`${region}/${cluster}`)) : null,
            h("ul", { class: "rack-cells", "aria-label": `racks of cluster ${cluster}` }, racks.map(rackCell)),
          ),
        );
      }
      out.push(section);
    }
    return out;
  }

  /** One rack's nodes (``#/rack/region/cluster/rack``), from the summarised fleet. */
  async function rackView(r) {
    const q = new URLSearchParams({ region: r.region, cluster: r.cluster });
    if (r.rack) q.set("rack", r.rack);
    const nodes = (await allNodes(q)).filter((n) => n.rack === r.rack);
    const name = r.rack || "(no rack)";
    return [
      h("p", {}, h("a", { href: "#/fleet", text: "← fleet", "aria-label": "Back to the fleet" })),
      h("h2", { id: "rack-title", dataset: { rack: r.rack } }, `rack ${name} `, h("span", { class: "muted", text: `region ${r.region} · cluster ${r.cluster} · ${nodes.length} nodes` })),
      legend(nodes.some((n) => n.provision && n.provision.instance)),
      nodes.length ? h("div", { class: "racks" }, rackBox(name, nodes)) : h("p", { class: "muted", text: "No node in this rack." }),
    ];
  }

  // --- node page -----------------------------------------------------------------------

  function scoreChart(kept, now) {
    // the last score holds until the node was last seen
    const points = kept.length && now && now > kept[kept.length - 1][0] ? [...kept, [now, kept[kept.length - 1][1]]] : kept;
    const W = 640, H = 180, L = 34, R = 8, T = 8, B = 22;
    const svg = s("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img" });
    if (!points.length) {
      svg.setAttribute("aria-label", "score history: no points yet");
      return svg;
    }
    const t0 = points[0][0];
    const t1 = Math.max(points[points.length - 1][0], t0 + 1);
    const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
    const y = (v) => T + (1 - Math.max(0, Math.min(100, v)) / 100) * (H - T - B);
    for (const v of [0, 50, 100]) {
      svg.append(s("line", { class: "axis", x1: L, x2: W - R, y1: y(v), y2: y(v) }));
      const label = s("text", { x: 4, y: y(v) + 3 });
      label.textContent = String(v);
      svg.append(label);
    }
    // a step line: the score holds until the next point, then up to now
    const pts = [];
    points.forEach(([t, v], i) => {
      if (i > 0) pts.push(`${x(t).toFixed(1)},${y(points[i - 1][1]).toFixed(1)}`);
      pts.push(`${x(t).toFixed(1)},${y(v).toFixed(1)}`);
    });
    svg.append(s("polyline", { class: "line", points: pts.join(" ") }));
    for (const [t, anchor, tx] of [[t0, "start", L], [t1, "end", W - R]]) {
      const label = s("text", { x: tx, y: H - 6, "text-anchor": anchor });
      label.textContent = fmtTime(t);
      svg.append(label);
    }
    const last = points[points.length - 1][1];
    const low = Math.min(...points.map((p) => p[1]));
    svg.setAttribute(
      "aria-label",
      `score history: ${points.length} points from ${fmtTime(t0)} to ${fmtTime(t1)}, now ${fmtValue(last)}, lowest ${fmtValue(low)}`,
    );
    const title = s("title", {});
    title.textContent = svg.getAttribute("aria-label");
    svg.prepend(title);
    return svg;
  }

  function sparkline(samples) {
    const svg = s("svg", { class: "spark", viewBox: "0 0 120 24", "aria-hidden": "true" });
    if (samples.length < 2) return svg;
    const ts = samples.map((p) => p[0]), vs = samples.map((p) => Number(p[1]) || 0);
    const t0 = Math.min(...ts), t1 = Math.max(...ts, t0 + 1);
    const v0 = Math.min(...vs), v1 = Math.max(...vs, v0 + 1);
    const pts = samples.map(([t, v]) => `${(((t - t0) / (t1 - t0)) * 118 + 1).toFixed(1)},${(23 - ((Number(v) - v0) / (v1 - v0)) * 22).toFixed(1)}`);
    svg.append(s("polyline", { points: pts.join(" ") }));
    return svg;
  }

  function table(caption, headers, rows, attrs) {
    return h(
      "table",
      attrs || {},
      h("caption", { class: "muted", text: caption }),
      h("thead", {}, h("tr", {}, headers.map((t) => h("th", { scope: "col", text: t })))),
      h("tbody", {}, rows),
    );
  }

  function reasonsTable(reasons) {
    if (!reasons.length) return h("p", { id: "reasons", class: "muted", text: "Nothing is wrong: no reasons." });
    return table(
      "Why the node has its score",
      ["signal", "value", "threshold", "rule", "message"],
      reasons.map((r) =>
        h(
          "tr",
          { class: "reason" },
          h("td", { text: r.signal }),
          h("td", { class: "num", text: fmtValue(r.value) }),
          h("td", { class: "num", text: fmtValue(r.threshold) }),
          h("td", { text: r.rule || "" }),
          h("td", { text: r.message || "" }),
        ),
      ),
      { id: "reasons" },
    );
  }

  function historyTable(history) {
    if (!history.length) return h("p", { class: "muted", text: "No grade change yet." });
    return table(
      "Grade changes, newest first",
      ["time", "from", "to", "score", "by", "why"],
      [...history].reverse().map((c) =>
        h(
          "tr",
          {},
          h("td", { text: fmtDateTime(c.ts) }),
          h("td", {}, gradeBadge(c.grade_from)),
          h("td", {}, gradeBadge(c.grade_to)),
          h("td", { class: "num", text: fmtValue(c.score) }),
          h("td", { text: c.by }),
          h("td", { text: c.message || (c.reasons || []).map((r) => r.message).join("; ") }),
        ),
      ),
      { id: "grade-history" },
    );
  }

  function countersTable(signals) {
    const keys = Object.keys(signals).sort(naturalCompare);
    if (!keys.length) return h("p", { class: "muted", text: "No counter samples kept." });
    return table(
      "Recent counters (the samples behind the rates)",
      ["counter", "latest", "change over window", "samples", "resets", "trend"],
      keys.map((k) => {
        const { samples, resets } = signals[k];
        const first = samples.length ? samples[0][1] : null;
        const last = samples.length ? samples[samples.length - 1][1] : null;
        const delta = typeof first === "number" && typeof last === "number" ? last - first : null;
        return h(
          "tr",
          {},
          h("td", { text: k }),
          h("td", { class: "num", text: fmtValue(last) }),
          h("td", { class: "num", text: delta === null ? "—" : `+${fmtValue(delta)}` }),
          h("td", { class: "num", text: String(samples.length) }),
          h("td", { class: "num", text: String(resets) }),
          h("td", {}, sparkline(samples)),
        );
      }),
      { id: "counters" },
    );
  }

  function qosTable(qos) {
    if (!qos || !qos.length) return h("p", { id: "qos", class: "muted", text: "No QoS verdict in the newest batch." });
    return table(
      "QoS verdicts of the newest batch",
      ["interface", "profile version", "status", "reasons"],
      qos.map((q) =>
        h(
          "tr",
          {},
          h("td", { text: q.interface }),
          h("td", { class: "num", text: fmtValue(q.version) }),
          h("td", { class: `q-${q.status}`, text: q.status }),
          h("td", { text: (q.reasons || []).join("; ") }),
        ),
      ),
      { id: "qos" },
    );
  }

  function bmcFacts(bmc) {
    if (!bmc) return h("p", { id: "bmc", class: "muted", text: "No word from this node's BMC." });
    const readings = bmc.readings || {};
    const sensors = Array.isArray(readings) ? readings : readings.sensors || [];
    return h(
      "dl",
      { class: "facts", id: "bmc" },
      h("dt", { text: "received" }), h("dd", { text: fmtDateTime(bmc.received_ts) }),
      h("dt", { text: "power" }), h("dd", { text: bmc.power_on === null || bmc.power_on === undefined ? "unknown" : bmc.power_on ? "on" : "off" }),
      h("dt", { text: "health" }), h("dd", { text: fmtValue(bmc.health) }),
      h("dt", { text: "readings" }),
      h("dd", { text: Array.isArray(sensors) && sensors.length ? `${sensors.length} sensors` : JSON.stringify(readings).slice(0, 300) }),
    );
  }

  /** The node's instances (GET /v1/instances?node=), or null where the controller has no
   * provisioning (404) or they cannot be read: the node page never waits on it. */
  async function nodeInstances(handle) {
    try {
      const { instances } = await api(`v1/instances?node=${encodeURIComponent(handle)}`);
      return instances;
    } catch (_) {
      return null;
    }
  }

  function instanceFacts(instances) {
    if (instances === null) return h("p", { id: "instance", class: "muted", text: "No provisioning on this controller." });
    const live = instances.filter((i) => i.state !== "released" && i.state !== "deploy_failed");
    const shown = live.length ? live[live.length - 1] : instances[instances.length - 1];
    if (!shown) return h("p", { id: "instance", class: "muted", text: "No instance has been on this node." });
    return h(
      "dl",
      { class: "facts", id: "instance", dataset: { instance: shown.instance_id, state: shown.state, tenant: shown.tenant } },
      h("dt", { text: "instance" }), h("dd", { text: shown.instance_id }),
      h("dt", { text: "state" }), h("dd", { text: shown.state + (shown.error ? ` (${shown.error})` : "") }),
      h("dt", { text: "tenant" }), h("dd", { text: shown.tenant }),
      h("dt", { text: "image" }), h("dd", { text: shown.image }),
      h("dt", { text: "volume" }), h("dd", { text: shown.volume }),
      h("dt", { text: "ready" }), h("dd", { text: fmtDateTime(shown.ready_ts) }),
      h("dt", { text: "history" }),
      h("dd", { text: (shown.history || []).map((t) => `${fmtTime(t.ts)} ${t.state}${t.reason ? ` (${t.reason})` : ""}`).join(" → ") || "—" }),
    );
  }

  async function nodeView(handle) {
    const [body, instances] = await Promise.all([api(`v1/nodes/${encodeURIComponent(handle)}`), nodeInstances(handle)]);
    const r = body.record;
    const name = r.node.node;
    const flags = [
      r.cordoned && "cordoned", r.maintenance && "maintenance", r.held && "held (repeat offender)",
      r.rail_flagged && "held in service by the safety rail",
    ].filter(Boolean);
    return [
      h("p", {}, h("a", { href: "#/fleet", text: "← fleet", "aria-label": "Back to the fleet" })),
      h("h2", { id: "node-title", dataset: { node: body.handle, grade: r.grade } }, `node ${name} `, gradeBadge(r.grade)),
      h(
        "dl",
        { class: "facts card", "aria-label": "node facts" },
        h("dt", { text: "handle" }), h("dd", { text: body.handle }),
        h("dt", { text: "score" }), h("dd", { id: "node-score", text: fmtValue(r.score) }),
        h("dt", { text: "place" }), h("dd", { text: `region ${r.node.region} · cluster ${r.node.cluster} · rack ${r.rack || "—"}` }),
        h("dt", { text: "state" }), h("dd", { text: flags.length ? flags.join(", ") : "in service" }),
        r.operator_reason ? [h("dt", { text: "operator" }), h("dd", { text: `${r.operator_by}: ${r.operator_reason}` })] : null,
        h("dt", { text: "running jobs" }), h("dd", { text: String(r.running_jobs) }),
        r.slurm_jobs != null ? [h("dt", { text: "Slurm jobs" }), h("dd", { text: String(r.slurm_jobs) })] : null,
        h("dt", { text: "DMA isolation" }),
        h("dd", {
          id: "node-dma",
          text: r.dma_posture ? [r.dma_posture, ...(r.dma_reasons || [])].join(" — ") : "not reported",
          title: "isolated: sensitive jobs and instances may go here (docs/security.md)",
        }),
        h("dt", { text: "last seen" }), h("dd", { text: fmtDateTime(r.last_seen_ts) }),
      ),
      h("section", { class: "card", "aria-labelledby": "h-reasons" }, h("h3", { id: "h-reasons", text: "Current reasons" }), reasonsTable(r.reasons || [])),
      h("section", { class: "card", "aria-labelledby": "h-score" }, h("h3", { id: "h-score", text: "Score history" }), scoreChart(body.scores || [], r.last_seen_ts)),
      h("section", { class: "card", "aria-labelledby": "h-history" }, h("h3", { id: "h-history", text: "Grade history" }), historyTable(r.history || [])),
      h("section", { class: "card", "aria-labelledby": "h-counters" }, h("h3", { id: "h-counters", text: "Recent counters" }), countersTable(body.signals || {})),
      h("section", { class: "card", "aria-labelledby": "h-qos" }, h("h3", { id: "h-qos", text: "QoS" }), qosTable(body.qos)),
      h("section", { class: "card", "aria-labelledby": "h-bmc" }, h("h3", { id: "h-bmc", text: "BMC" }), bmcFacts(body.bmc)),
      h("section", { class: "card", "aria-labelledby": "h-instance" }, h("h3", { id: "h-instance", text: "Provisioning" }), instanceFacts(instances)),
    ];
  }

  // --- jobs ----------------------------------------------------------------------------

  /** A job's moves: transitions from one placement to another, with the nodes that
   * changed, the step it resumed at and the first reason given since the last move. */
  function moves(status) {
    const out = [];
    let why = "";
    for (const t of status.history || []) {
      const from = t.from_nodes || [];
      const to = t.to_nodes || [];
      if (from.length && !to.length && !why) why = t.reason || "";
      if (from.length && to.length) {
        out.push({
          ts: t.ts,
          from: from.filter((x) => !to.includes(x)),
          to: to.filter((x) => !from.includes(x)),
          step: t.step,
          why,
        });
        why = "";
      }
    }
    return out;
  }

  /** Node handles as names; a long list as its first two and a count. */
  function shortNodes(handles) {
    const names = (handles || []).map((x) => x.split(".").pop());
    if (names.length > 4) return `${names.slice(0, 2).join(", ")}, … (${names.length} nodes)`;
    return names.join(", ") || "—";
  }

  async function jobsView() {
    let jobs;
    try {
      ({ jobs } = await api("v1/jobs"));
    } catch (err) {
      if (err instanceof HttpError && (err.status === 404 || err.status === 405)) {
        return [h("h2", { text: "Jobs" }), h("p", { id: "no-jobs-api", class: "muted", text: "No job API on this controller (it runs without a job manager)." })];
      }
      throw err;
    }
    const details = await Promise.all(
      jobs.slice(-100).map((j) => api(`v1/jobs/${encodeURIComponent(j.id)}`).catch(() => null)),
    );
    const byId = new Map(details.filter(Boolean).map((d) => [d.id, d.status]));
    const rows = jobs.map((j) => {
      const st = byId.get(j.id) || {};
      const mv = moves(st);
      return h(
        "tr",
        { dataset: { job: j.id, state: j.state } },
        h("td", { text: j.id }),
        h("td", { text: j.name }),
        h("td", { text: j.tenant }),
        h("td", { text: j.state }),
        h("td", { text: shortNodes(j.placement), title: (j.placement || []).join(", ") }),
        h("td", { class: "num", text: fmtValue(j.step) }),
        h("td", { class: "num", text: fmtValue(j.last_checkpoint_step) }),
        h("td", { class: "num", text: String(j.restarts) }),
        h(
          "td",
          {},
          mv.length
            ? h("ul", { class: "moves" }, mv.map((m) => h("li", { text: `${fmtTime(m.ts)} ${shortNodes(m.from)} → ${shortNodes(m.to)}${m.step !== null && m.step !== undefined ? ` at step ${m.step}` : ""}${m.why ? ` (${m.why})` : ""}` })))
            : h("span", { class: "muted", text: "—" }),
        ),
        h("td", { class: "num", text: st.downtime_s !== undefined ? `${fmtValue(st.downtime_s)} s` : "—" }),
        h("td", { text: j.reason || st.digest || "" }),
      );
    });
    return [
      ...(await tenantsPanel()),
      h("h2", { text: `Jobs: ${jobs.length}` }),
      jobs.length
        ? table("Jobs, oldest first", ["id", "name", "tenant", "state", "placement", "step", "checkpoint", "restarts", "moves (from → to, step)", "downtime", "reason / digest"], rows, { id: "jobs" })
        : h("p", { class: "muted", text: "No job submitted." }),
    ];
  }

  /** GET /v1/tenants as a table (guarantee, in use, borrowed, lent, waiting), or nothing
   * where the controller has no tenants route or no tenant yet. */
  async function tenantsPanel() {
    let body;
    try {
      body = await api("v1/tenants");
    } catch (_) {
      return [];
    }
    if (!body.tenants.length) return [];
    const rows = body.tenants.map((t) =>
      h(
        "tr",
        { dataset: { tenant: t.name } },
        h("td", { text: t.name }),
        h("td", { class: "num", text: t.quota ? String(t.guarantee) : "— (idle only)" }),
        h("td", { class: "num", text: String(t.in_use) }),
        h("td", { class: "num", text: String(t.borrowed) }),
        h("td", { class: "num", text: String(t.lent) }),
        h("td", { class: "num", text: `${t.waiting} (${t.waiting_jobs} jobs)` }),
      ),
    );
    return [
      h("h2", { text: `Tenants (fleet: ${body.fleet_gpus} GPUs)` }),
      table("Tenants' quotas and use, in GPUs", ["tenant", "guarantee", "in use", "borrowed", "lent", "waiting"], rows, { id: "tenants-quota" }),
    ];
  }

  // --- instances (provisioning: docs/provisioning.md) ------------------------------------

  async function instancesView() {
    let instances, nodes;
    try {
      [{ instances }, { nodes }] = await Promise.all([api("v1/instances"), api("v1/provision/nodes")]);
    } catch (err) {
      if (err instanceof HttpError && (err.status === 404 || err.status === 405)) {
        return [h("h2", { text: "Instances" }), h("p", { id: "no-provision-api", class: "muted", text: "No provisioning on this controller (its config has no [provision] section)." })];
      }
      throw err;
    }
    const rows = [...instances].reverse().map((i) =>
      h(
        "tr",
        { dataset: { instance: i.instance_id, state: i.state, tenant: i.tenant } },
        h("td", { text: i.instance_id }),
        h("td", { text: i.tenant }),
        h("td", { text: i.image }),
        h("td", { text: i.state }),
        h("td", {}, i.node ? h("a", { href: `#/node/${encodeURIComponent(i.node)}`, text: i.node.split(".").pop() }) : "—"),
        h("td", { text: i.volume }),
        h("td", { class: "num", text: String(i.attempts) }),
        h("td", { text: fmtTime(i.ready_ts) }),
        h("td", { text: i.error || (i.history && i.history.length ? i.history[i.history.length - 1].reason : "") }),
      ),
    );
    const counts = new Map();
    for (const n of nodes) counts.set(n.state, (counts.get(n.state) || 0) + 1);
    const flagged = nodes.filter((n) => n.flagged).map((n) => n.node.split(".").pop());
    return [
      h("h2", { text: `Instances: ${instances.length}` }),
      h(
        "p",
        { id: "provision-nodes", class: "muted" },
        `Provisioned nodes: ${nodes.length} (${[...counts.entries()].map(([st, c]) => `${c} ${st}`).join(", ") || "none"})`,
        flagged.length ? `; flagged after failed deploys: ${flagged.join(", ")}` : "",
      ),
      instances.length
        ? table("Instances, newest first", ["id", "tenant", "image", "state", "node", "volume", "attempts", "ready", "error / last step"], rows, { id: "instances" })
        : h("p", { class: "muted", text: "No instance deployed." }),
    ];
  }

  // --- live events (SSE over fetch, so the token travels in a header) ------------------

  function setConn(which, text) {
    const el = document.getElementById("conn");
    el.dataset.state = which;
    el.textContent = `events: ${text}`;
    const wasLive = state.live;
    state.live = which === "live";
    if (wasLive !== state.live) schedulePoll();
  }

  function eventClass(kind) {
    if (/isolated|unreachable|tripped|drift|unsupported|preempted|held|deploy_failed|node_failing|provision_flagged/.test(kind)) return "k-bad";
    if (/sub_healthy|cordoned|maintenance|rescheduled|switching|releasing|replaced/.test(kind)) return "k-warn";
    if (/returned|uncordoned|applied|finished|instance\.active/.test(kind)) return "k-good";
    return "";
  }

  function addEvent(e) {
    if (document.getElementById("events-pause").checked) return;
    const list = document.getElementById("events");
    const why = e.reasons && e.reasons.length ? e.reasons[0].message : e.message;
    const handle = e.node ? `${e.node.region}.${e.node.cluster}.${e.node.node}` : null;
    list.prepend(
      h(
        "li",
        { dataset: { kind: e.kind } },
        h("span", { class: "muted", text: `${fmtTime(e.ts)} ` }),
        h("span", { class: `kind ${eventClass(e.kind)}`, text: e.kind }),
        " ",
        handle
          ? h("a", { href: `#/node/${encodeURIComponent(handle)}`, text: e.node.node })
          : e.job_id ? h("a", { href: "#/jobs", text: e.job_id }) : e.region,
        why ? h("div", { text: why }) : null,
      ),
    );
    while (list.children.length > MAX_EVENTS) list.lastElementChild.remove();
  }

  function onMessage(id, data) {
    if (id) state.lastSeq = id;
    let event;
    try {
      event = JSON.parse(data);
    } catch (_) {
      return;
    }
    addEvent(event);
    scheduleRefresh();
  }

  /** Parse one SSE block (lines up to a blank line). */
  function onBlock(block) {
    let id = null;
    const data = [];
    for (const line of block.split(/\r?\n/)) {
      if (!line || line.startsWith(":")) continue;
      const at = line.indexOf(":");
      const field = at < 0 ? line : line.slice(0, at);
      const value = at < 0 ? "" : line.slice(at + 1).replace(/^ /, "");
      if (field === "id") id = value;
      else if (field === "data") data.push(value);
    }
    if (data.length) onMessage(id, data.join("\n"));
  }

  async function streamOnce() {
    const headers = { Accept: "text/event-stream" };
    if (state.token) headers.Authorization = `Bearer ${state.token}`;
    let path = "v1/events?since=15m";
    if (state.lastSeq) {
      headers["Last-Event-ID"] = state.lastSeq; // resume without a gap or a repeat
      path = "v1/events";
    }
    state.streamAbort = new AbortController();
    const response = await fetch(new URL(path, API), { headers, cache: "no-store", signal: state.streamAbort.signal });
    if (!response.ok) throw new HttpError(response.status, response.statusText);
    setConn("live", "live");
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let m;
      while ((m = /\r?\n\r?\n/.exec(buffer))) {
        onBlock(buffer.slice(0, m.index));
        buffer = buffer.slice(m.index + m[0].length);
      }
    }
  }

  async function streamForever() {
    let delay = 1000;
    for (;;) {
      try {
        await streamOnce();
        delay = 1000;
        setConn("down", "stream ended; reconnecting");
      } catch (err) {
        if (err.name === "AbortError") {
          setConn("connecting", "reconnecting");
          delay = 0;
        } else {
          setConn("down", err.status === 401 ? "needs a token" : `down (${err.message}); retrying`);
        }
      }
      await new Promise((resolve) => setTimeout(resolve, delay));
      delay = Math.min(Math.max(delay, 1000) * 2, 15000);
    }
  }

  // --- token ---------------------------------------------------------------------------

  function takeTokenFromUrl() {
    const url = new URL(location.href);
    const fromQuery = url.searchParams.get("token");
    if (fromQuery === null) return;
    sessionStorage.setItem(TOKEN_KEY, fromQuery);
    state.token = fromQuery;
    url.searchParams.delete("token"); // out of the address bar and the history
    history.replaceState(null, "", url.pathname + url.search + url.hash);
  }

  function useToken(token) {
    state.token = token;
    if (token) sessionStorage.setItem(TOKEN_KEY, token);
    else sessionStorage.removeItem(TOKEN_KEY);
    if (state.streamAbort) state.streamAbort.abort(); // reconnect with the new token
    render(false);
  }

  function start() {
    takeTokenFromUrl();
    const input = document.getElementById("token");
    input.value = state.token;
    document.getElementById("token-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      useToken(input.value.trim());
    });
    document.getElementById("token-clear").addEventListener("click", () => {
      input.value = "";
      useToken("");
    });
    window.addEventListener("hashchange", () => render(true));
    render(false);
    schedulePoll();
    streamForever();
  }

  start();
})();
