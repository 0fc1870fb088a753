"""The playground page in a real browser: Debian's chromium driven by Playwright against a real server.

Skipped, with the reason, only where no chromium binary is installed (CI installs it in .ci/run)."""

from __future__ import annotations

from pathlib import Path

import httpx
from browser import CHROMIUM, CHROMIUM_ARGS, needs_chromium

pytestmark = needs_chromium


def test_playground_streams_tokens_coloured_by_probability(server: str, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    prompt, n = "Hello there", 40
    expected = httpx.post(f"{server}/generate", timeout=30, json={
        "inputs": prompt, "parameters": {"max_new_tokens": n, "greedy": True}}).json()["generated_text"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page()
            page.goto(server + "/")
            page.wait_for_function("document.getElementById('model').textContent.includes('parameters')")
            page.fill("#prompt", prompt)
            page.fill("#max_new_tokens", str(n))
            page.check("#greedy")
            # record each batch of tokens as it lands in the page
            page.evaluate("""() => {
                window.batches = [];
                new MutationObserver(m => window.batches.push(m.length))
                    .observe(document.getElementById('output'), {childList: true});
            }""")
            page.click("#go")
            page.wait_for_function("document.getElementById('status').textContent.includes('tokens ·')")
            spans = page.query_selector_all("#output span.token")
            texts = [s.text_content() for s in spans]
            logprobs = [float(s.get_attribute("data-logprob")) for s in spans]
            backgrounds = [s.evaluate("e => e.style.background") for s in spans]
            status = page.text_content("#status")
            batches = page.evaluate("window.batches")
            page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
        finally:
            browser.close()
    assert len(spans) == n
    assert "".join(texts) == expected  # the page shows exactly what /generate returns
    assert all(lp <= 0 for lp in logprobs)
    assert all(bg.startswith("rgba") for bg in backgrounds)  # coloured by probability
    assert f"{n} tokens" in status and "length" in status
    assert sum(batches) >= n + 1 and len(batches) > 1  # prompt span + tokens, arriving over several reads


def test_playground_shows_validation_errors(server: str) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page()
            page.goto(server + "/")
            page.fill("#max_new_tokens", "0")
            page.click("#go")
            page.wait_for_function("document.getElementById('status').className === 'error'")
            status = page.text_content("#status")
        finally:
            browser.close()
    assert status.startswith("422") and "max_new_tokens" in status
