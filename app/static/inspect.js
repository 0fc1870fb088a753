// Looking inside the model, in the playground: each generated token's probability, alternatives and attention
// (streamed with it: parameters.attention), an attention heatmap and a logit-lens grid (POST /inspect).
// playground.html calls the five hooks of window.FolioInspect (reset, extend, started, token, init); everything
// else lives here.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const el = (tag, { dataset = {}, ...props } = {}, ...children) => {
    const node = Object.assign(document.createElement(tag), props);
    Object.assign(node.dataset, dataset);
    node.append(...children);
    return node;
  };
  // a token's text as it can be read in a list or a cell: spaces, newlines and tabs made visible
  const shown = (t) => (t === "" ? "∅" : t.replace(/ /g, "␣").replace(/\n/g, "⏎").replace(/\t/g, "⇥"));
  const fmt = (p) => (p >= 0.001 || p === 0 ? p.toFixed(3) : p.toExponential(1));
  const layerName = (l) => (l === 0 ? "0 (embeddings)" : String(l));
  // a weight in [0, 1] as the heatmap's blue: the square root shows the small ones
  const heatColour = (w) => {
    const t = Math.sqrt(w);
    return `rgb(${Math.round(255 - 218 * t)}, ${Math.round(255 - 156 * t)}, ${Math.round(255 - 20 * t)})`;
  };
  const ZOOM_CELL = 26;  // px: a magnified cell's least side, a fingertip's target (WCAG's minimum is 24)
  const ZOOM_MAX = 16;   // cells a side of the magnified window, where the screen has room

  const state = {
    limits: null, promptText: "", promptTokens: null, generated: [], active: -1,
    inspected: null, inspectedKey: "", cursor: { q: 0, k: 0 }, lensCursor: { r: 0, c: 0 },
    zoom: null,  // the heatmap's magnified window, opened by a tap: { q0, k0, size }
  };

  // -- the panel ---------------------------------------------------------------------------------------
  function build() {
    const section = $("inspect");
    const look = el("label", {}, el("input", { type: "checkbox", id: "look", checked: true }), " look inside",
      el("span", { id: "look_cost", className: "hint", textContent: " · each token then carries its alternatives " +
                   "and attention weights: the stream runs several times slower (uncheck for full speed)" }));
    const layer = el("label", { className: "attn-pick" }, "layer ", el("select", { id: "attn_layer" }));
    const head = el("label", { className: "attn-pick" }, "head ", el("select", { id: "attn_head" }));
    const tabs = el("div", { className: "tabs", role: "tablist", ariaLabel: "views" });
    for (const [id, name] of [["tokens", "Tokens"], ["heatmap", "Attention map"], ["lens", "Logit lens"]]) {
      tabs.append(el("button", { type: "button", id: `tab_${id}`, role: "tab", textContent: name,
                                 ariaSelected: String(id === "tokens"), ariaControls: `view_${id}` }));
    }
    const tokenView = el("div", { id: "view_tokens", role: "tabpanel" },
      el("div", { id: "token_info", className: "info", ariaLive: "polite",
                  textContent: "Generate, then hover, tap or focus a generated token (← → move between them)." }));
    const heatView = el("div", { id: "view_heatmap", role: "tabpanel", hidden: true },
      el("div", { className: "heat-grid" },
        el("div", { id: "heat_keys", className: "axis keys", textContent: "keys: the tokens attended to →" }),
        el("div", { id: "heat_queries", className: "axis queries", textContent: "queries: each token ↓" }),
        el("canvas", { id: "heatmap", tabIndex: 0, role: "img", ariaLabel: "attention heatmap: query by key" }),
        el("div", { id: "heat_zoom", role: "group", ariaLabel: "the heatmap magnified", hidden: true },
          el("div", { className: "zoom-bar" },
            ...[["up", "▲", "earlier queries"], ["down", "▼", "later queries"], ["left", "◀", "earlier keys"],
                ["right", "▶", "later keys"]].map(([pan, text, label]) =>
              el("button", { type: "button", textContent: text, ariaLabel: label, title: label, dataset: { pan } })),
            el("button", { type: "button", id: "zoom_close", textContent: "✕ whole map" }),
            el("span", { id: "zoom_where", className: "hint" })),
          el("div", { id: "zoom_cells" }))),
      el("div", { className: "legend", textContent: "rows: each token as the query · columns: the tokens it " +
                  "attends to · the deeper the blue, the larger the weight (colour by its square root) · the " +
                  "cell under the pointer names its query and key on the axes and marks them in the text " +
                  "(query red, key blue); on a touch screen, tap the map to magnify the cells around the tap, " +
                  "then tap a cell · the dotted underline marks the tokens analysed" }),
      el("div", { id: "heat_info", className: "info", ariaLive: "polite" }));
    const lensView = el("div", { id: "view_lens", role: "tabpanel", hidden: true },
      el("div", { id: "lens_explain", className: "legend", textContent: "What the model would predict next if it " +
                  "stopped after each layer: a row per layer (the top one is its real prediction), a column per " +
                  "position in the text; each cell is the likeliest next token, on blue as deep as its " +
                  "probability (white 0 → deep blue 1)." }),
      el("div", { id: "lens_scroll_hint", className: "scroll-hint", hidden: true }),
      el("div", { className: "lens-scroll" }, el("table", { id: "lens" })),
      el("div", { id: "lens_info", className: "info", ariaLive: "polite" }));
    section.append(el("div", { className: "inspect-controls" }, look, layer, head), tabs, tokenView, heatView,
                   lensView);
    section.hidden = false;
    section.dataset.built = "true";
    tabs.addEventListener("click", (e) => { if (e.target.role === "tab") select(e.target.id.slice(4)); });
    tabs.addEventListener("keydown", moveTab);
    for (const id of ["attn_layer", "attn_head"]) $(id).addEventListener("change", redraw);
    bindTokens();
    bindHeatmap();
    bindLens();
  }

  function options(select, n, what) {
    select.replaceChildren(el("option", { value: "mean", textContent: `mean of all ${what}s` }));
    for (let i = 0; i < n; i++) select.append(el("option", { value: String(i), textContent: `${what} ${i}` }));
  }

  function select(view) {
    for (const name of ["tokens", "heatmap", "lens"]) {
      $(`tab_${name}`).ariaSelected = String(name === view);
      $(`view_${name}`).hidden = name !== view;
    }
    for (const pick of document.querySelectorAll(".attn-pick")) pick.hidden = view === "lens";  // the lens ignores it
    clearHighlight();
    clearAnalysed();  // the window is the heatmap's: drawHeatmap underlines it again
    state.active = -1;
    if (view !== "tokens") load();
  }

  function moveTab(e) {
    const order = ["tokens", "heatmap", "lens"];
    const i = order.indexOf(document.activeElement.id.slice(4));
    if (i < 0 || !["ArrowLeft", "ArrowRight"].includes(e.key)) return;
    const next = order[(i + (e.key === "ArrowRight" ? 1 : 2)) % 3];
    $(`tab_${next}`).focus();
    select(next);
  }

  function redraw() {
    if (state.active >= 0) showToken(state.active);
    if (!$("view_heatmap").hidden || !$("view_lens").hidden) load();
  }

  // -- what the stream asks for ------------------------------------------------------------------------
  // every head of every layer where the limits allow it, else each layer's mean over its heads, else the last layer
  function attentionSpec(maxNew) {
    if (!state.limits) return null;
    const { n_layer: L, n_head: H, block_size: T } = state.limits.model;
    const { max_token_weights: perToken, max_request_weights: total } = state.limits.stream_attention;
    const fits = (rows) => rows * T <= perToken && rows * T * maxNew <= total;
    const all = [...Array(H).keys()];
    if (fits(L * H)) return { heads: all };
    if (fits(L)) return {};
    return fits(1) ? { layers: [L - 1] } : null;
  }

  function extend(params) {
    if (!$("look")?.checked) return;
    params.top_n_tokens = 5;
    const spec = attentionSpec(params.max_new_tokens || 1);
    if (spec) params.attention = spec;
  }

  // -- tokens: probability, alternatives, attention as highlight over the text ---------------------------
  // a run begins: nothing of the previous run stays on show (its tokens, heatmap and lens)
  function reset() {
    if (!$("inspect").dataset.built) return;
    clearHighlight();
    Object.assign(state, { promptText: "", promptTokens: null, generated: [], active: -1, inspected: null,
                           inspectedKey: "" });
    closeZoom();
    $("token_info").textContent = "Generate, then hover, tap or focus a generated token (← → move between them).";
    for (const id of ["heat_info", "lens_info"]) $(id).textContent = "";
    $("lens").replaceChildren();
    const canvas = $("heatmap");
    canvas.getContext("2d").clearRect(0, 0, canvas.width, canvas.height);
  }

  async function started(promptSpan, prompt, headers) {
    Object.assign(state, { promptText: prompt, promptTokens: null, generated: [], active: -1,
                           inspected: null, inspectedKey: "" });
    $("token_info").textContent = "Hover, tap or focus a generated token (← → move between them).";
    try {  // the prompt's tokens, so that attention to each of them can be shown on it
      const r = await fetch("/tokenize", { method: "POST", headers, body: JSON.stringify({ inputs: prompt }) });
      if (!r.ok) return;
      const tokens = await r.json();
      promptSpan.replaceChildren(...tokens.map((t) => el("span", { className: "ptok", textContent: t.text })));
      state.promptTokens = [...promptSpan.children];
    } catch { /* the prompt stays one piece: attention to it is not drawn */ }
  }

  function token(span, ev) {
    const i = state.generated.length;
    state.generated.push({ span, ev });
    span.dataset.index = i;
    span.tabIndex = i === 0 ? 0 : -1;
  }

  // the span of a token by its index among the prompt's and the generated tokens
  function spanAt(index) {
    const n = state.promptTokens ? state.promptTokens.length : null;
    if (n === null) return null;
    return index < n ? state.promptTokens[index] : state.generated[index - n]?.span ?? null;
  }

  // the streamed rows for the layer and head chosen (a mean where "mean" is chosen or only the mean was sent)
  function chosenRow(att) {
    const layerSel = $("attn_layer").value, headSel = $("attn_head").value;
    const per = att.heads ? att.heads.length : 1;
    const li = layerSel === "mean" ? att.layers.map((_, i) => i) : [att.layers.indexOf(Number(layerSel))];
    const hi = !att.heads || headSel === "mean" ? [...Array(per).keys()] : [att.heads.indexOf(Number(headSel))];
    if (li.includes(-1) || hi.includes(-1)) return null;
    const rows = li.flatMap((l) => hi.map((h) => att.weights[l * per + h]));
    return rows[0].map((_, k) => rows.reduce((s, r) => s + r[k], 0) / rows.length);
  }

  function clearHighlight() {
    const marked = "#output .attended, #output .active, #output .attn-query, #output .attn-key";
    for (const s of document.querySelectorAll(marked)) {
      s.classList.remove("attended", "active", "attn-query", "attn-key");
      delete s.dataset.attention;
    }
  }

  function showToken(i) {
    const { span, ev } = state.generated[i];
    state.active = i;
    clearHighlight();
    span.classList.add("active");
    const p = Math.exp(ev.token.logprob);
    const info = $("token_info");
    const alts = el("ol", { className: "alts" }, ...ev.top_tokens.map((a) => el("li", {
      textContent: `${shown(a.text)} ${fmt(Math.exp(a.logprob))}`, dataset: { id: a.id, p: Math.exp(a.logprob) } })));
    info.replaceChildren(
      el("div", {}, el("b", { textContent: shown(ev.token.text) }), ` · token ${i + 1} · id ${ev.token.id} · p = `,
         el("span", { className: "prob", textContent: fmt(p), dataset: { p } })),
      el("div", {}, "alternatives: ", alts));
    const row = ev.attention ? chosenRow(ev.attention) : null;
    if (!row) {
      info.append(el("div", { textContent: ev.attention ? "attention: not sent for this layer and head"
                                                         : "attention: not asked for (look inside was off)" }));
      return;
    }
    const top = Math.max(...row);
    const ranked = row.map((w, k) => [w, k]).sort((a, b) => b[0] - a[0]).slice(0, 3);
    row.forEach((w, k) => {
      const target = spanAt(ev.attention.start + k);
      if (!target) return;
      target.classList.add("attended");
      target.dataset.attention = w;
      target.style.setProperty("--w", (0.85 * w / top).toFixed(3));
    });
    const name = (k) => spanAt(ev.attention.start + k)?.textContent ?? `#${ev.attention.start + k}`;
    info.append(el("div", { className: "attends", textContent: "attends most to: " +
      ranked.map(([w, k]) => `${shown(name(k))} ${fmt(w)}`).join(" · ") }));
  }

  function bindTokens() {
    const out = $("output");
    const target = (e) => e.target.closest?.("#output span.token");
    out.addEventListener("mouseover", (e) => { const t = target(e); if (t) showToken(Number(t.dataset.index)); });
    // the attention shown while the pointer is on a token goes when it leaves the tokens (focus keeps its own)
    out.addEventListener("mouseout", (e) => {
      if (!target(e) || e.relatedTarget?.closest?.("#output span.token")) return;
      if (document.activeElement?.closest?.("#output span.token")) return;
      clearHighlight();
      state.active = -1;
    });
    out.addEventListener("click", (e) => { const t = target(e); if (t) { t.focus(); showToken(Number(t.dataset.index)); } });
    out.addEventListener("focusin", (e) => { const t = target(e); if (t) showToken(Number(t.dataset.index)); });
    out.addEventListener("keydown", (e) => {
      const t = target(e);
      if (!t) return;
      const i = Number(t.dataset.index), last = state.generated.length - 1;
      const next = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: last }[e.key];
      if (e.key === "Escape") { clearHighlight(); state.active = -1; return; }
      if (next === undefined || next < 0 || next > last) return;
      e.preventDefault();
      t.tabIndex = -1;
      const span = state.generated[next].span;
      span.tabIndex = 0;
      span.focus();
    });
  }

  // -- /inspect: the heatmap and the lens ----------------------------------------------------------------
  function shownText() {
    return state.promptText + state.generated.map((g) => g.ev.token.text).join("");
  }

  async function load() {
    if (!state.limits) return;
    const text = shownText() || $("prompt").value;
    const layer = $("attn_layer").value;
    const key = `${layer}\u0000${text}`;
    if (state.inspectedKey === key) return draw();
    const body = { inputs: text, truncate: state.limits.model.block_size, lens_top: 3, top_n: 0 };
    if (layer !== "mean") body.layers = [Number(layer)];
    for (const id of ["heat_info", "lens_info"]) $(id).textContent = "inspecting…";
    try {
      const r = await fetch("/inspect", { method: "POST", headers: currentHeaders(), body: JSON.stringify(body) });
      const answer = await r.json();
      if (!r.ok) throw new Error(`${r.status}: ${answer.error || JSON.stringify(answer)}`);
      Object.assign(state, { inspected: answer, inspectedKey: key, cursor: { q: 0, k: 0 }, lensCursor: { r: 0, c: 0 } });
      closeZoom();  // a new text: its window is elsewhere
      draw();
    } catch (e) {
      for (const id of ["heat_info", "lens_info"]) $(id).textContent = String(e.message || e);
    }
  }

  function currentHeaders() {
    const key = $("api_key").value.trim();
    return key ? { "Content-Type": "application/json", Authorization: `Bearer ${key}` }
               : { "Content-Type": "application/json" };
  }

  function draw() {
    drawHeatmap();
    drawLens();
  }

  // the chosen layer's and head's map from /inspect (dense or sparse) as an n x n matrix, means where asked
  function matrix() {
    const { tokens, attention } = state.inspected;
    const n = tokens.length, headSel = $("attn_head").value;
    const maps = attention.maps.filter((m) => headSel === "mean" || m.head === Number(headSel));
    const grid = new Float64Array(n * n);
    for (const m of maps) {
      m.weights.forEach((row, q) => row.forEach((w, j) => {
        grid[q * n + (m.keys ? m.keys[q][j] : j)] += w / maps.length;
      }));
    }
    return { n, grid };
  }

  function drawHeatmap() {
    const canvas = $("heatmap");
    if (!state.inspected || $("view_heatmap").hidden) return;
    const { n, grid } = matrix();
    if (state.zoom) drawZoom(n, grid);
    else paintMap(n, grid);
    const { q, k } = state.cursor;
    const tok = state.inspected.tokens;
    const w = grid[q * n + k];
    Object.assign(canvas.dataset, { query: q, key: k, weight: w, size: n });
    markInText(n, q, k);
    $("heat_keys").textContent = `key ${k}: ${shown(tok[k].text)} (the token attended to) →`;
    $("heat_queries").textContent = `query ${q}: ${shown(tok[q].text)} ↓`;
    const what = `layer ${$("attn_layer").value}, head ${$("attn_head").value}`;
    const moves = state.zoom ? "tap a cell" : "arrow keys move";
    $("heat_info").textContent = `query ${q} ${shown(tok[q].text)} → key ${k} ${shown(tok[k].text)}: ` +
      `${w.toFixed(4)} (${what}; ${state.inspected.attention.format}; ${moves})`;
  }

  // the whole map on the canvas, the cursor's cell outlined
  function paintMap(n, grid) {
    const canvas = $("heatmap");
    const css = canvas.clientWidth || 320, ratio = window.devicePixelRatio || 1;
    canvas.width = canvas.height = Math.round(css * ratio);
    const ctx = canvas.getContext("2d"), cell = canvas.width / n;
    ctx.fillStyle = "#f3f4f6";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    for (let q = 0; q < n; q++) {
      for (let k = 0; k <= q; k++) {
        ctx.fillStyle = heatColour(grid[q * n + k]);
        ctx.fillRect(k * cell, q * cell, Math.ceil(cell), Math.ceil(cell));
      }
    }
    const { q, k } = state.cursor;
    ctx.strokeStyle = "#b00020";
    ctx.lineWidth = Math.max(1, ratio * 1.5);
    ctx.strokeRect(k * cell, q * cell, cell, cell);
  }

  // the magnified window: its cells large enough to tap, its rows and columns labelled with their tokens (the
  // cursor's query red, its key blue, as in the text); the cells above the diagonal (the future) stay blank
  function drawZoom(n, grid) {
    const { q0, k0, size } = state.zoom, { q, k } = state.cursor, tok = state.inspected.tokens;
    const label = (i, axis) => el("div", {
      className: `label ${axis}${(axis === "q" ? q : k) === i ? " at" : ""}`, textContent: shown(tok[i].text),
      title: `${axis === "q" ? "query" : "key"} ${i}: ${shown(tok[i].text)}` });
    const cells = [el("div", { className: "label corner", textContent: "q\\k",
                               title: "rows: queries, columns: keys" })];
    for (let c = k0; c < k0 + size; c++) cells.push(label(c, "k"));
    for (let r = q0; r < q0 + size; r++) {
      cells.push(label(r, "q"));
      for (let c = k0; c < k0 + size; c++) {
        if (c > r) { cells.push(el("div", { className: "future" })); continue; }
        const w = grid[r * n + c], at = r === q && c === k;
        const cell = el("button", { type: "button", className: at ? "cell at" : "cell", tabIndex: at ? 0 : -1,
                                    ariaLabel: `query ${r} ${shown(tok[r].text)}, key ${c} ${shown(tok[c].text)}: ` +
                                               w.toFixed(4), dataset: { q: r, k: c, w } });
        cell.style.background = heatColour(w);
        cells.push(cell);
      }
    }
    const box = $("zoom_cells");
    box.style.setProperty("--side", size + 1);
    box.replaceChildren(...cells);
    Object.assign($("heat_zoom").dataset, { q0, k0, size });
    $("zoom_where").textContent = `queries ${q0}–${q0 + size - 1} · keys ${k0}–${k0 + size - 1} of ${n}`;
    const bar = $("heat_zoom").querySelector(".zoom-bar");
    const can = { up: q0 > 0, down: q0 + size < n, left: k0 > 0, right: k0 + size < n };
    for (const b of bar.querySelectorAll("[data-pan]")) b.disabled = !can[b.dataset.pan];
  }

  // a tap on the map: the window of cells around it, magnified in the map's place
  function openZoom() {
    const n = state.inspected?.tokens.length ?? 0;
    if (!n) return;
    $("heatmap").hidden = true;
    $("heat_zoom").hidden = false;
    // size + 1 columns (one of labels) and size 1 px lines between them in the box's width, each at least ZOOM_CELL
    const side = $("zoom_cells").clientWidth;
    const size = Math.min(n, ZOOM_MAX, Math.max(2, Math.floor((side - ZOOM_CELL) / (ZOOM_CELL + 1))));
    const around = (i) => Math.min(n - size, Math.max(0, i - Math.floor(size / 2)));
    state.zoom = { q0: around(state.cursor.q), k0: around(state.cursor.k), size };
    drawHeatmap();
  }

  function closeZoom() {
    if (!state.zoom) return;
    state.zoom = null;
    $("heat_zoom").hidden = true;
    $("heatmap").hidden = false;
    drawHeatmap();
  }

  function panZoom(direction) {
    const n = state.inspected.tokens.length, { size } = state.zoom, step = Math.ceil(size / 2);
    const [dq, dk] = { up: [-step, 0], down: [step, 0], left: [0, -step], right: [0, step] }[direction];
    const clamp = (i) => Math.min(n - size, Math.max(0, i));
    Object.assign(state.zoom, { q0: clamp(state.zoom.q0 + dq), k0: clamp(state.zoom.k0 + dk) });
    drawHeatmap();
  }

  function clearAnalysed() {
    for (const s of document.querySelectorAll("#output .analysed")) s.classList.remove("analysed");
  }

  // the analysed window (the last n tokens) underlined in the text, the cell's query and key marked in it
  function markInText(n, q, k) {
    clearHighlight();
    clearAnalysed();
    const total = state.promptTokens ? state.promptTokens.length + state.generated.length : 0;
    if (!total || shownText() === "") return;
    const first = total - n;
    for (let i = Math.max(0, first); i < total; i++) spanAt(i)?.classList.add("analysed");
    spanAt(first + q)?.classList.add("attn-query");
    spanAt(first + k)?.classList.add("attn-key");
  }

  function bindHeatmap() {
    const canvas = $("heatmap");
    const moveTo = (q, k) => {
      const n = state.inspected?.tokens.length ?? 0;
      if (!n) return;
      q = Math.min(n - 1, Math.max(0, q));
      state.cursor = { q, k: Math.min(q, Math.max(0, k)) };
      drawHeatmap();
    };
    canvas.addEventListener("keydown", (e) => {
      const { q, k } = state.cursor;
      const step = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] }[e.key];
      if (!step) return;
      e.preventDefault();
      moveTo(q + step[0], k + step[1]);
    });
    const pointer = (e) => {
      const n = state.inspected?.tokens.length ?? 0, box = canvas.getBoundingClientRect();
      if (n) moveTo(Math.floor((e.clientY - box.top) / box.height * n), Math.floor((e.clientX - box.left) / box.width * n));
    };
    canvas.addEventListener("mousemove", pointer);
    // a mouse's click picks the cell under it; a finger's (a touch or a pen: the cells are a few px) magnifies
    // the cells around it, where one can be tapped
    let finger = false;  // the last press's pointer (a click's own pointerType where the browser gives none)
    const isFinger = (type) => type === "touch" || type === "pen";
    canvas.addEventListener("pointerdown", (e) => { finger = isFinger(e.pointerType); });
    canvas.addEventListener("click", (e) => {
      pointer(e);
      if (e.pointerType ? isFinger(e.pointerType) : finger) openZoom();
    });
    const zoom = $("heat_zoom");
    zoom.addEventListener("click", (e) => {
      const cell = e.target.closest?.("button.cell"), pan = e.target.closest?.("[data-pan]");
      if (cell) moveTo(Number(cell.dataset.q), Number(cell.dataset.k));
      else if (pan) panZoom(pan.dataset.pan);
      else if (e.target.closest?.("#zoom_close")) closeZoom();
    });
    zoom.addEventListener("keydown", (e) => { if (e.key === "Escape") closeZoom(); });
  }

  function drawLens() {
    if (!state.inspected || $("view_lens").hidden) return;
    const { lens, vocab, tokens } = state.inspected;
    const table = $("lens");
    const head = el("tr", {}, el("th", { textContent: "layer" }),
                    ...tokens.map((t, c) => el("th", { textContent: shown(t.text), title: `position ${c}` })));
    const rows = [...lens].reverse().map((layer, r) => el("tr", {}, el("th", {
      textContent: String(layer.layer), title: layer.layer === 0 ? "the embeddings" : `after block ${layer.layer}` }),
      ...layer.top.map(([[id, p]], c) => el("td", {
        textContent: shown(vocab[id]), tabIndex: -1, className: p > 0.55 ? "dark" : "",
        style: `background: rgba(37, 99, 235, ${p.toFixed(3)})`, dataset: { r, c, id, p } }))));
    table.replaceChildren(el("thead", {}, head), el("tbody", {}, ...rows));
    focusLens(state.lensCursor.r, state.lensCursor.c, false);
    const box = table.parentElement, hint = $("lens_scroll_hint");
    hint.hidden = box.scrollWidth <= box.clientWidth;  // a table wider than its box says so
    hint.textContent = `${tokens.length} positions: scroll sideways (or use ← →) to see them all →`;
  }

  function focusLens(r, c, focus = true) {
    const rows = $("lens").tBodies[0]?.rows;
    if (!rows?.length) return;
    r = Math.min(rows.length - 1, Math.max(0, r));
    c = Math.min(rows[0].cells.length - 2, Math.max(0, c));
    for (const cell of $("lens").querySelectorAll("td[tabindex='0']")) cell.tabIndex = -1;
    const cell = rows[r].cells[c + 1];
    cell.tabIndex = 0;
    if (focus) cell.focus();
    state.lensCursor = { r, c };
    const { lens, vocab, tokens } = state.inspected;
    const layer = lens[lens.length - 1 - r];
    $("lens_info").textContent = `layer ${layerName(layer.layer)}, after ${shown(tokens[c].text)} (position ${c}): ` +
      layer.top[c].map(([id, p]) => `${shown(vocab[id])} ${fmt(p)}`).join(" · ");
  }

  function bindLens() {
    const table = $("lens");
    table.addEventListener("keydown", (e) => {
      const step = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] }[e.key];
      if (!step) return;
      e.preventDefault();
      focusLens(state.lensCursor.r + step[0], state.lensCursor.c + step[1]);
    });
    const pick = (e) => {
      const cell = e.target.closest?.("td");
      if (cell) focusLens(Number(cell.dataset.r), Number(cell.dataset.c), e.type === "click");
    };
    table.addEventListener("mouseover", pick);
    table.addEventListener("click", pick);
  }

  // -- start ------------------------------------------------------------------------------------------
  async function init() {
    build();
    try {
      const r = await fetch("/inspect/limits");
      state.limits = await r.json();
      options($("attn_layer"), state.limits.model.n_layer, "layer");
      options($("attn_head"), state.limits.model.n_head, "head");
      $("inspect").dataset.ready = "true";
    } catch {
      $("token_info").textContent = "looking inside is unavailable (no /inspect/limits)";
    }
  }

  window.FolioInspect = { extend, started, token, reset, init };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
