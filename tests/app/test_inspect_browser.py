"""The playground's look inside in a real browser (Debian's chromium driven by Playwright) against real servers, the
bundled character model and a GPT-2-shaped BPE model: what each view shows (a token's probability, alternatives and
attention over the text; the heatmap's cells; the logit lens' cells) is checked against /inspect's numbers, by
mouse and by keyboard, on a desktop and a phone width. Each view is photographed; with SCREENSHOTS_DIR set the
pictures are copied there too (the manual's, docs/inspect.md, come from `SCREENSHOTS_DIR=bench/results`).

Skipped, with the reason, only where no chromium binary is installed (CI installs it in .ci/run)."""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.testing import serving
from model.testing import make_gpt2_shaped_checkpoint
from model.tokenizer import BPETokenizer
from tests.app.browser import launched, needs_chromium

pytestmark = needs_chromium
READY = "document.getElementById('inspect').dataset.ready === 'true'"
DONE = "document.getElementById('status').textContent.includes('tokens ·')"
PROMPT = "ROMEO:\nBut soft, what light"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with launched() as browser:
        yield browser


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        yield page
        assert errors == [], errors  # no script error on the way
    finally:
        context.close()


@pytest.fixture(scope="module")
def bundled_server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving(repo / "weights" / "shakespeare-char", tmp_path_factory.mktemp("bundled") / "server.log") as (base, _):
        yield base


@pytest.fixture(scope="module")
def bpe_server(gpt2_tok: BPETokenizer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("gpt2-shaped")
    ckpt = make_gpt2_shaped_checkpoint(directory / "ckpt", gpt2_tok, n_layer=2, n_head=12, head_size=16,
                                       block_size=256)
    with serving(ckpt, directory / "server.log") as (base, _):
        yield base


def photograph(page: Any, tmp_path: Path, name: str, selector: str | None = None) -> Path:
    path = tmp_path / f"inspect_{name}.png"
    (page.locator(selector).screenshot(path=str(path)) if selector else page.screenshot(path=str(path),
                                                                                       full_page=True))
    if os.environ.get("SCREENSHOTS_DIR"):
        shutil.copy(path, Path(os.environ["SCREENSHOTS_DIR"]) / path.name)
    return path


def generate(page: Any, base: str, prompt: str, n: int, seed: int) -> list[dict]:
    """Generate in the page (sampled, seeded); the parameters it sent."""
    sent: list[dict] = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/generate_stream") else None)
    page.goto(base + "/")
    page.wait_for_function(READY)
    page.fill("#prompt", prompt)
    page.fill("#max_new_tokens", str(n))
    page.fill("#seed", str(seed))
    page.click("#go")
    page.wait_for_function(DONE)
    page.wait_for_function("document.querySelectorAll('#output .ptok').length > 0")  # the prompt's tokens
    return sent


def inspect(base: str, **body: Any) -> dict:
    r = httpx.post(f"{base}/inspect", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def token_view(page: Any) -> dict:
    """What the Tokens view shows for the active token, and the attention drawn over the text."""
    return page.evaluate("""() => ({
        p: Number(document.querySelector('#token_info .prob').dataset.p),
        alternatives: [...document.querySelectorAll('#token_info .alts li')].map(li => Number(li.dataset.id)),
        active: Number(document.querySelector('#output .active').dataset.index),
        prompt: [...document.querySelectorAll('#output .ptok')].map(s => s.dataset.attention ?? null),
        generated: [...document.querySelectorAll('#output span.token')].map(s => s.dataset.attention ?? null),
    })""")


def check_token_against_inspect(view: dict, answer: dict, position: int, layer: int, head: int) -> None:
    """The view of the token at `position` (among prompt and generated tokens) against /inspect's numbers."""
    token = answer["tokens"][position]
    assert view["p"] == pytest.approx(math.exp(token["logprob"]), abs=1e-4)
    assert view["alternatives"] == [a["id"] for a in token["top_tokens"]]
    row = next(m for m in answer["attention"]["maps"] if (m["layer"], m["head"]) == (layer, head))["weights"]
    drawn = [float(w) for w in (view["prompt"] + view["generated"])[:position]]
    # chosen by the token before it, over all before: the stream's decode steps (the fused kernels) against the
    # full forward, each rounded to 6 decimals, so a few units in the 6th
    assert drawn == pytest.approx(row[position - 1], abs=5e-6)
    assert all(w is None for w in (view["prompt"] + view["generated"])[position:])


def test_tokens_view_shows_what_inspect_computes(bundled_server: str, page: Any, tmp_path: Path) -> None:
    sent = generate(page, bundled_server, PROMPT, 40, seed=9)
    params = sent[-1]["parameters"]
    assert params["attention"] == {"heads": list(range(6))} and params["top_n_tokens"] == 5
    page.select_option("#attn_layer", "2")
    page.select_option("#attn_head", "3")
    page.hover("#output span.token >> nth=12")
    view = token_view(page)
    text = PROMPT + "".join(s.text_content() for s in page.query_selector_all("#output span.token"))
    answer = inspect(bundled_server, inputs=text, layers=[2], heads=[3], lens=False)  # one character a token
    assert view["active"] == 12
    check_token_against_inspect(view, answer, len(PROMPT) + 12, 2, 3)
    photograph(page, tmp_path, "tokens")
    # by keyboard: focus the first generated token, then move with the arrow keys
    page.focus("#output span.token >> nth=0")
    for _ in range(5):
        page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowLeft")
    assert page.evaluate("document.activeElement.dataset.index") == "4"
    check_token_against_inspect(token_view(page), answer, len(PROMPT) + 4, 2, 3)
    assert page.evaluate("[...document.querySelectorAll('#output span.token')].filter(s => s.tabIndex === 0)"
                         ".map(s => s.dataset.index)") == ["4"]  # one tab stop: the roving token
    # the mean of all heads of all layers: the mean of /inspect's 36 rows
    page.select_option("#attn_layer", "mean")
    page.select_option("#attn_head", "mean")
    view = token_view(page)
    every = inspect(bundled_server, inputs=text, lens=False)["attention"]["maps"]
    position = len(PROMPT) + 4
    mean = [sum(m["weights"][position - 1][k] for m in every) / 36 for k in range(position)]
    assert [float(w) for w in (view["prompt"] + view["generated"])[:position]] == pytest.approx(mean, abs=1e-5)


def heatmap_cells(page: Any, cells: list[tuple[int, int]]) -> list[int]:
    """The red channel at the centre of each (query, key) cell of the canvas (darker blue: a larger weight)."""
    return page.evaluate("""(cells) => {
        const c = document.getElementById('heatmap'), n = Number(c.dataset.size), ctx = c.getContext('2d');
        const size = c.width / n;
        return cells.map(([q, k]) => ctx.getImageData(Math.floor((k + .5) * size), Math.floor((q + .5) * size),
                                                      1, 1).data[0]);
    }""", cells)


def test_heatmap_and_lens_show_inspects_numbers(bundled_server: str, page: Any, tmp_path: Path) -> None:
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/inspect") else None)
    generate(page, bundled_server, PROMPT, 30, seed=4)
    page.select_option("#attn_layer", "1")
    page.select_option("#attn_head", "4")
    page.focus("#tab_tokens")
    page.keyboard.press("ArrowRight")  # the tabs by keyboard: on to the attention map
    page.wait_for_function("document.getElementById('heatmap').dataset.size")
    answer = inspect(bundled_server, **bodies[-1])
    assert bodies[-1]["layers"] == [1] and bodies[-1]["truncate"] == 128
    n = len(answer["tokens"])
    assert page.get_attribute("#heatmap", "data-size") == str(n) == str(len(PROMPT) + 30)
    weights = next(m for m in answer["attention"]["maps"] if m["head"] == 4)["weights"]
    page.focus("#heatmap")
    for key in ["ArrowDown"] * 20 + ["ArrowRight"] * 7:
        page.keyboard.press(key)
    cursor = page.evaluate("Object.assign({}, document.getElementById('heatmap').dataset)")
    assert (cursor["query"], cursor["key"]) == ("20", "7")
    assert float(cursor["weight"]) == pytest.approx(weights[20][7], abs=1e-9)
    assert f"{weights[20][7]:.4f}" in page.text_content("#heat_info")
    strongest = max(range(21), key=lambda k: weights[20][k])
    weakest = min(range(21), key=lambda k: weights[20][k])
    dark, light = heatmap_cells(page, [(20, strongest), (20, weakest)])
    assert dark < light  # drawn: the larger weight the deeper blue
    photograph(page, tmp_path, "heatmap")

    page.click("#tab_lens")
    page.wait_for_function("document.querySelectorAll('#lens tbody tr').length > 0")
    cells = page.evaluate("[...document.querySelectorAll('#lens tbody tr')].map(tr => "
                          "[...tr.querySelectorAll('td')].map(td => [Number(td.dataset.id), Number(td.dataset.p)]))")
    want = [[pos[0] for pos in layer["top"]] for layer in reversed(answer["lens"])]  # the last layer on top
    assert [[i for i, _ in row] for row in cells] == [[i for i, _ in row] for row in want]
    assert [p for row in cells for _, p in row] == pytest.approx([p for row in want for _, p in row], abs=1e-9)
    page.click("#lens tbody tr:nth-child(1) td:nth-child(4)")  # the last layer, position 2
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowRight")
    info = page.text_content("#lens_info")
    layer = answer["lens"][-2]
    assert info.startswith(f"layer {layer['layer']}, after") and "(position 3)" in info  # layer 5 of 0..6
    assert f"{layer['top'][3][0][1]:.3f}" in info
    photograph(page, tmp_path, "lens")


def test_a_gpt2_bpe_model(bpe_server: str, page: Any, tmp_path: Path) -> None:
    prompt = "It was the best of times, it was the worst"
    sent = generate(page, bpe_server, prompt, 24, seed=2)
    params = sent[-1]["parameters"]
    assert params["attention"] == {"heads": list(range(12))}  # 2 x 12 x 256 weights a token: every head fits
    # the same request through /inspect's generation gives the same ids as the stream, exactly
    answer = inspect(bpe_server, inputs=prompt, parameters={k: v for k, v in params.items() if k != "attention"},
                     layers=[1], heads=[7], lens=False)
    n_prompt = sum(1 for t in answer["tokens"] if not t["generated"])
    assert page.eval_on_selector_all("#output .ptok", "s => s.length") == n_prompt
    page.select_option("#attn_layer", "1")
    page.select_option("#attn_head", "7")
    page.hover("#output span.token >> nth=9")
    check_token_against_inspect(token_view(page), answer, n_prompt + 9, 1, 7)
    photograph(page, tmp_path, "bpe_tokens")
    page.click("#tab_lens")
    page.wait_for_function("document.querySelectorAll('#lens tbody tr').length === 3")
    vocab_shown = page.eval_on_selector_all("#lens tbody td", "tds => tds.slice(0, 5).map(td => td.textContent)")
    assert all(vocab_shown)
    page.click("#tab_heatmap")
    page.wait_for_function("document.getElementById('heatmap').dataset.size")
    photograph(page, tmp_path, "bpe_heatmap")


@pytest.mark.parametrize("view", ["tokens", "heatmap", "lens"])
def test_each_view_fits_a_phone(bundled_server: str, browser: Any, view: str, tmp_path: Path) -> None:
    context = browser.new_context(viewport={"width": 375, "height": 740}, has_touch=True, is_mobile=True)
    try:
        page = context.new_page()
        generate(page, bundled_server, PROMPT, 60, seed=1)
        page.tap("#output span.token >> nth=30")
        assert page.evaluate("document.querySelector('#output .active').dataset.index") == "30"
        if view != "tokens":
            page.tap(f"#tab_{view}")
            page.wait_for_function("document.getElementById('heatmap').dataset.size" if view == "heatmap" else
                                   "document.querySelectorAll('#lens tbody tr').length === 7")
        width = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        assert width[0] <= width[1], f"the page scrolls sideways at 375 px in the {view} view: {width}"
        box = page.evaluate("document.getElementById('heatmap').getBoundingClientRect().width")
        assert view != "heatmap" or 200 < box <= 375
        photograph(page, tmp_path, f"phone_{view}")
    finally:
        context.close()


@pytest.mark.parametrize("width, height", [(1280, 800), (390, 844)], ids=["desktop", "phone"])
def test_each_picture_explains_itself(bundled_server: str, page: Any, width: int, height: int,
                                      tmp_path: Path) -> None:
    page.set_viewport_size({"width": width, "height": height})
    generate(page, bundled_server, PROMPT, 40, seed=9)
    text = PROMPT + "".join(s.text_content() for s in page.query_selector_all("#output span.token"))
    # the probability colouring has its key, and looking inside says what it costs
    assert page.is_visible("#prob_legend") and page.locator("#prob_legend .swatch").count() == 5
    assert "slower" in page.text_content("#look_cost") and page.is_visible("#look_cost")

    # a token's attention painted over the text goes when the pointer leaves the tokens
    page.hover("#output span.token >> nth=12")
    assert page.locator("#output .attended").count() > 0
    page.hover("h1")
    assert page.locator("#output .attended, #output .active").count() == 0

    # the heatmap: the hovered cell's query and key named on its axes and marked in the text, the window underlined
    page.click("#tab_heatmap")
    page.wait_for_function("document.getElementById('heatmap').dataset.size > 0")
    n = int(page.get_attribute("#heatmap", "data-size"))
    assert n == len(text)  # one character a token, all inside the context
    q, k = 20, 5
    page.locator("#heatmap").scroll_into_view_if_needed()
    box = page.locator("#heatmap").bounding_box()
    page.mouse.move(box["x"] + (k + 0.5) * box["width"] / n, box["y"] + (q + 0.5) * box["height"] / n)
    assert (page.get_attribute("#heatmap", "data-query"), page.get_attribute("#heatmap", "data-key")) == ("20", "5")
    assert page.text_content("#output .attn-query") == text[q] and page.text_content("#output .attn-key") == text[k]
    assert page.text_content("#heat_queries").startswith(f"query {q}: ")
    assert page.text_content("#heat_keys").startswith(f"key {k}: ")
    assert page.locator("#output .analysed").count() == n
    assert page.is_visible("#attn_layer") and page.is_visible("#attn_head")
    photograph(page, tmp_path, f"heatmap_axes_{width}px")

    # the lens: explained, its sideways scroll announced, the layer and head choices (which it ignores) hidden
    page.click("#tab_lens")
    page.wait_for_function("document.querySelectorAll('#lens td').length > 0")
    assert page.is_visible("#lens_explain") and "each layer" in page.text_content("#lens_explain")
    scrolls = page.evaluate("(() => { const b = document.querySelector('.lens-scroll');"
                            " return b.scrollWidth > b.clientWidth; })()")
    assert scrolls and page.is_visible("#lens_scroll_hint")
    assert page.text_content("#lens_scroll_hint").startswith(f"{n} positions: scroll sideways")
    assert page.is_hidden("#attn_layer") and page.is_hidden("#attn_head")
    assert page.locator("#output .attended, #output .attn-query").count() == 0
    photograph(page, tmp_path, f"lens_explained_{width}px")


def heatmap_cursor(page: Any) -> tuple[int, int]:
    """The heatmap's chosen cell: (query, key)."""
    return int(page.get_attribute("#heatmap", "data-query")), int(page.get_attribute("#heatmap", "data-key"))


def shown(character: str) -> str:
    """A character as the page labels it (inspect.js' `shown`): spaces and newlines made visible."""
    return {" ": "␣", "\n": "⏎", "\t": "⇥"}.get(character, character)


@pytest.fixture(params=[(1280, 800), (390, 844)], ids=["desktop", "phone"])
def touch_page(browser: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A page on a touch screen (a phone, or a desktop-sized touch screen), which a mouse can drive too."""
    width, height = request.param
    context = browser.new_context(viewport={"width": width, "height": height}, has_touch=True,
                                  is_mobile=width < 600)
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        yield page
        assert errors == [], errors
    finally:
        context.close()


def test_a_tap_on_the_heatmap_magnifies_the_cells_around_it(bundled_server: str, touch_page: Any,
                                                             tmp_path: Path) -> None:
    page = touch_page
    width = page.viewport_size["width"]
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/inspect") else None)
    generate(page, bundled_server, PROMPT, 110, seed=3)  # 135 characters: the map is the last 128
    text = PROMPT + "".join(s.text_content() for s in page.query_selector_all("#output span.token"))
    page.select_option("#attn_layer", "2")
    page.select_option("#attn_head", "1")
    page.tap("#tab_heatmap")
    page.wait_for_function("document.getElementById('heatmap').dataset.size > 0")
    n = int(page.get_attribute("#heatmap", "data-size"))
    first = len(text) - n
    assert n == 128 and bodies[-1]["layers"] == [2]
    weights = next(m for m in inspect(bundled_server, **bodies[-1])["attention"]["maps"] if m["head"] == 1)["weights"]
    page.locator("#heatmap").scroll_into_view_if_needed()
    box = page.locator("#heatmap").bounding_box()
    assert box["width"] / n < 5  # a cell of the whole map: a few px, too small for a finger

    def at(q: int, k: int) -> tuple[float, float]:  # the centre of a cell of the whole map
        return box["x"] + (k + 0.5) * box["width"] / n, box["y"] + (q + 0.5) * box["height"] / n

    # a mouse, as before: hovering and clicking pick the cell under it, nothing is magnified
    page.mouse.move(*at(60, 50))
    page.mouse.click(*at(61, 52))
    assert heatmap_cursor(page) == (61, 52)
    assert page.is_hidden("#heat_zoom") and page.is_visible("#heatmap")

    # a finger: the tap magnifies the cells around it, in the map's place
    page.touchscreen.tap(*at(100, 90))
    photograph(page, tmp_path, f"heatmap_tapped_{width}px")
    page.wait_for_selector("#heat_zoom:not([hidden])", timeout=5000)
    assert page.is_hidden("#heatmap")
    zoom = page.evaluate("Object.assign({}, document.getElementById('heat_zoom').dataset)")
    q0, k0, size = int(zoom["q0"]), int(zoom["k0"]), int(zoom["size"])
    assert size >= 8 and q0 <= 100 < q0 + size and k0 <= 90 < k0 + size
    # each cell large enough for a fingertip, its weight /inspect's, its row and column labelled with their tokens
    sides = page.eval_on_selector_all("#zoom_cells .cell", "cs => cs.map(c => c.getBoundingClientRect().width)")
    assert min(sides) >= 26 - 0.5, sides  # inspect.js' ZOOM_CELL, less the rounding of fractional px
    drawn = page.eval_on_selector_all("#zoom_cells .cell", "cs => cs.map(c => [+c.dataset.q, +c.dataset.k, "
                                      "+c.dataset.w])")
    assert {(q, k) for q, k, _ in drawn} == {(q, k) for q in range(q0, q0 + size)
                                             for k in range(k0, k0 + size) if k <= q}
    assert [w for *_, w in drawn] == pytest.approx([weights[q][k] for q, k, _ in drawn], abs=1e-9)
    assert page.eval_on_selector_all("#zoom_cells .label.q", "ls => ls.map(l => l.textContent)") == \
        [shown(text[first + q]) for q in range(q0, q0 + size)]
    assert page.eval_on_selector_all("#zoom_cells .label.k", "ls => ls.map(l => l.textContent)") == \
        [shown(text[first + k]) for k in range(k0, k0 + size)]
    page_width = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert page_width[0] <= page_width[1], page_width  # no sideways scroll

    # a tap on a magnified cell shows what hovering shows: the query and key in the text, the weight
    q, k = q0 + size - 1, k0 + 1
    page.tap(f"#zoom_cells .cell[data-q='{q}'][data-k='{k}']")
    assert heatmap_cursor(page) == (q, k)
    marked = "[...document.querySelectorAll('#output .ptok, #output span.token')].findIndex(s => " \
             "s.classList.contains('attn-{}'))"
    assert (page.evaluate(marked.format("query")), page.evaluate(marked.format("key"))) == (first + q, first + k)
    assert f"{weights[q][k]:.4f}" in page.text_content("#heat_info")
    assert page.text_content("#heat_queries").startswith(f"query {q}: ")
    assert page.text_content("#heat_keys").startswith(f"key {k}: ")
    assert page.get_attribute("#zoom_cells .cell.at", "data-q") == str(q)
    assert page.text_content("#zoom_cells .label.q.at") == shown(text[first + q])
    assert page.text_content("#zoom_cells .label.k.at") == shown(text[first + k])
    photograph(page, tmp_path, f"heatmap_zoom_{width}px")

    # the window moves by half its side; "whole map" gives the map back, the cell chosen kept
    page.tap("#heat_zoom [data-pan='up']")
    assert int(page.get_attribute("#heat_zoom", "data-q0")) == max(0, q0 - (size + 1) // 2)
    page.tap("#zoom_close")
    assert page.is_hidden("#heat_zoom") and page.is_visible("#heatmap")
    assert heatmap_cursor(page) == (q, k)


def test_the_analysed_window_is_underlined_only_on_the_heatmap(bundled_server: str, touch_page: Any,
                                                               tmp_path: Path) -> None:
    page = touch_page
    width = page.viewport_size["width"]
    generate(page, bundled_server, PROMPT, 110, seed=3)
    tokens = page.locator("#output .ptok, #output span.token")
    page.tap("#tab_heatmap")
    page.wait_for_function("document.getElementById('heatmap').dataset.size > 0")
    n = int(page.get_attribute("#heatmap", "data-size"))
    analysed = "[...document.querySelectorAll('#output .ptok, #output span.token')].map(s => " \
               "s.classList.contains('analysed'))"
    total = tokens.count()
    assert n == 128 < total and page.evaluate(analysed) == [False] * (total - n) + [True] * n
    page.tap("#tab_lens")
    page.wait_for_function("document.querySelectorAll('#lens td').length > 0")
    photograph(page, tmp_path, f"lens_underline_{width}px")
    assert page.locator("#output .analysed").count() == 0  # the lens covers every position: no window to mark
    page.tap("#tab_tokens")
    page.tap("#output span.token >> nth=50")
    assert page.locator("#output .analysed").count() == 0
    page.tap("#tab_heatmap")
    page.wait_for_function("document.querySelectorAll('#output .analysed').length > 0")
    assert page.evaluate(analysed) == [False] * (total - n) + [True] * n
