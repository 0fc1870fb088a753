"""The playground's training view (/training) in headless Chromium, against a real server with --watch on the
directory `python -m model.train` writes to: the loss curve and provenance equal the run's metrics.jsonl and
config.json, each checkpoint swapped in adds a sample whose weights are the ones served, and the compare view
shows two models' answers to one prompt and seed, equal to /v1/completions' (and says when only one is
served); at a desktop and a phone width nothing scrolls sideways, the chart's text and the inputs are readable
and the numbers formatted. Screenshots in bench/results/."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.testing import serving
from model.testing import make_char_checkpoint
from model.train.__main__ import main as train_main
from tests import REPO
from tests.app.browser import launched, needs_chromium
from tests.train.runs import tiny_argv

pytestmark = [needs_chromium, pytest.mark.slow]
RESULTS = REPO / "bench" / "results"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("run")
    shakespeare = data_dir / "tinyshakespeare" / "input.txt"
    text = root / "input.txt"
    text.write_text(shakespeare.read_text(encoding="utf-8")[:20_000] if shakespeare.is_file()
                    else "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400)))
    out = root / "mine"
    assert train_main(tiny_argv(text, out, max_iters=20)) == 0
    return out


@pytest.fixture(scope="module")
def server(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    other = make_char_checkpoint(tmp_path_factory.mktemp("other") / "other")
    with serving(run, tmp_path_factory.mktemp("log") / "server.log", "--watch", "0.2", "--models", str(other)) \
            as (base, _):
        yield base


@pytest.fixture
def page() -> Iterator[Any]:
    with launched() as browser:
        yield browser.new_context(viewport={"width": 1000, "height": 1300}).new_page()


def rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]


def test_training_view_follows_the_run_and_samples_each_checkpoint(server: str, run: Path, page: Any,
                                                                   tmp_path: Path) -> None:
    page.goto(f"{server}/training")
    page.wait_for_function("document.querySelectorAll('#samples .card').length === 1", timeout=30_000)
    evals = [r for r in rows(run) if "val_loss" in r]
    assert page.locator("circle.val").count() == len(evals)
    assert float(page.locator("#latest").get_attribute("data-val")) == pytest.approx(evals[-1]["val_loss"])
    training = json.loads((run / "config.json").read_text())["training"]
    assert page.locator("td[data-key=steps]").inner_text() == str(training["steps"])
    first = page.locator("#samples .card").first.get_attribute("data-fingerprint")
    with httpx.Client(base_url=server, timeout=60) as http:
        assert http.post("/generate", json={"inputs": "x"}).headers["x-folio-checkpoint"] == first
        # train on: the server swaps in the new best checkpoint, the view samples it
        shutil.copy(run / "config.json", tmp_path / "before.json")
        assert train_main(["--resume", "--out", str(run), "--max-iters", "40"]) == 0
        # the run may save more than one new best; the server and the view end on the last one written
        newest = json.loads((run / "config.json").read_text())["weights_sha256"][:16]
        page.wait_for_function(f"document.querySelector('#samples .card').dataset.fingerprint === '{newest}'",
                               timeout=30_000)
        assert newest != first and http.post("/generate", json={"inputs": "x"}).headers["x-folio-checkpoint"] == newest
        assert page.locator("#samples .card").count() >= 2
        want = http.post("/v1/completions", json={"prompt": "ROMEO:", "model": "mine", "max_tokens": 80,
                                                  "temperature": 0.8, "seed": 1}).json()["choices"][0]["text"]
    assert page.locator("#samples .card .text").first.inner_text() == want
    n_evals = len([r for r in rows(run) if "val_loss" in r])
    page.wait_for_function(f"document.querySelectorAll('circle.val').length === {n_evals}", timeout=30_000)
    RESULTS.mkdir(exist_ok=True)
    page.screenshot(path=str(RESULTS / "training_view.png"), full_page=True)


def test_compare_view_shows_two_models_answers(server: str, page: Any) -> None:
    page.goto(f"{server}/training")
    page.wait_for_function("document.getElementById('cmpB').options.length === 2", timeout=30_000)
    page.select_option("#cmpA", "mine")
    page.select_option("#cmpB", "other")
    page.click("#compare")
    page.wait_for_function("document.querySelectorAll('#compared .card').length === 2", timeout=30_000)
    texts = page.locator("#compared .card .text").all_inner_texts()
    with httpx.Client(base_url=server, timeout=60) as http:
        want = [http.post("/v1/completions", json={"prompt": "JULIET:", "model": m, "max_tokens": 80,
                                                   "temperature": 0.8, "seed": 7}).json()["choices"][0]["text"]
                for m in ("mine", "other")]
    assert texts == want and texts[0] != texts[1]
    page.screenshot(path=str(RESULTS / "compare_view.png"), full_page=True)


def test_the_playground_links_to_the_training_view(server: str, page: Any) -> None:
    page.goto(f"{server}/")
    page.click("#training_link")
    page.wait_for_url(f"{server}/training")
    page.wait_for_function("document.getElementById('cmpB').options.length === 2", timeout=30_000)


@pytest.mark.parametrize("width, height", [(1280, 800), (390, 844)], ids=["desktop", "phone"])
def test_training_view_reads_well_on_a_phone_and_a_desktop(server: str, run: Path, width: int, height: int,
                                                           tmp_path: Path) -> None:
    with launched() as browser:
        page = browser.new_context(viewport={"width": width, "height": height}).new_page()
        missing: list[str] = []
        page.on("response", lambda r: missing.append(r.url) if r.status == 404 else None)
        page.goto(f"{server}/training")
        page.wait_for_function("document.querySelectorAll('#chart circle.val').length > 0", timeout=30_000)
        page.screenshot(path=str(tmp_path / f"training-{width}px.png"), full_page=True)
        assert missing == [] and page.get_attribute("link[rel=icon]", "href").startswith("data:image/svg+xml")
        assert page.locator("a[href='/docs']").count() == 1  # the API docs linked
        # nothing widens the page (the dataset's 64-character hash breaks)
        assert page.evaluate("document.documentElement.scrollWidth") <= width
        # the chart's text is as large as the page's small print, and its axes are named
        sizes = page.evaluate("[...document.querySelectorAll('#chart text')].map(t => t.getBoundingClientRect()"
                              ".height)")
        assert min(sizes) >= 12, sizes
        titles = page.locator("#chart .axis-title").all_text_contents()
        assert titles == ["training step", "loss (cross-entropy)"]
        # inputs a thumb can hit, with text a phone does not zoom into
        for field in ("#model", "#prompt", "#seed", "#cmpA", "#cmpPrompt", "#compare"):
            box = page.evaluate(f"(() => {{ const e = document.querySelector('{field}'); return "
                                "[e.getBoundingClientRect().height, parseFloat(getComputedStyle(e).fontSize)]; })()")
            assert box[0] >= 40 and box[1] >= 16, (field, box)
        # numbers as a person reads them
        training = json.loads((run / "config.json").read_text())["training"]
        shown = {k: page.locator(f"td[data-key={k}]").inner_text()
                 for k in ("tokens_seen", "train_loss", "wall_time_s")}
        wall = math.floor(training["wall_time_s"] + 0.5)  # the page rounds halves up (Math.round), not to even
        assert shown == {"tokens_seen": f"{training['tokens_seen']:,}", "train_loss": f"{training['train_loss']:.4f}",
                         "wall_time_s": (f"{wall // 60} min " if wall >= 60 else "") + f"{wall % 60} s"}


def test_compare_says_when_only_one_model_is_served(server: str, page: Any) -> None:
    one = {"object": "list", "data": [{"id": "mine", "object": "model", "created": 0, "owned_by": "folio"}]}
    page.route("**/v1/models", lambda route: route.fulfill(status=200, json=one))
    page.goto(f"{server}/training")
    page.wait_for_function("document.getElementById('cmpB').options.length === 1", timeout=30_000)
    assert page.is_visible("#cmp_note") and "Only one model is served here (mine)" in page.inner_text("#cmp_note")
    page.click("#compare")
    assert page.inner_text("#compared") == ("A and B are both mine: pick two different models to compare "
                                            "(only one is served here)")
    assert page.locator("#compared .card").count() == 0
