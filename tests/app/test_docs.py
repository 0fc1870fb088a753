"""/docs (Swagger UI) and /redoc in a real browser that can reach nothing but the server: they render the API from
the server's own copies of their scripts and styles (fastapi-offline), with no request to a CDN. (ReDoc's footer
asks for its maker's logo image from a CDN, hard-coded in its script, and hides it when that fails.) /docs links back
to the playground and the training view."""

from __future__ import annotations

from pathlib import Path

from tests.app.browser import CHROMIUM, CHROMIUM_ARGS, needs_chromium

pytestmark = needs_chromium
ROUTES = {"/generate", "/generate_stream", "/tokenize", "/v1/completions", "/v1/models"}


def test_docs_and_redoc_render_the_routes_offline(server: str, tmp_path: Path) -> None:
    from playwright.sync_api import Route, sync_playwright

    elsewhere: dict[str, list[tuple[str, str]]] = {"/docs": [], "/redoc": []}  # (resource type, URL) per page
    current = ["/docs"]

    def same_origin_only(route: Route) -> None:  # the machine is offline for this page: other hosts fail
        if route.request.url.startswith(server + "/"):
            route.continue_()
        else:
            elsewhere[current[0]].append((route.request.resource_type, route.request.url))
            route.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 1400})
            page.route("**/*", same_origin_only)
            page.goto(server + "/docs")
            page.wait_for_selector(".opblock-summary-path[data-path='/generate']", timeout=20_000)
            swagger = set(page.eval_on_selector_all(".opblock-summary-path", "es => es.map(e => e.dataset.path)"))
            title = page.text_content(".info .title")
            back = page.eval_on_selector_all(".info a", "es => es.map(e => e.getAttribute('href'))")
            page.screenshot(path=str(tmp_path / "docs.png"))
            current[0] = "/redoc"
            page.goto(server + "/redoc")
            page.wait_for_function("document.body.innerText.includes('/generate_stream')", timeout=20_000)
            redoc = page.inner_text("body")
            page.screenshot(path=str(tmp_path / "redoc.png"))
        finally:
            browser.close()
    assert elsewhere["/docs"] == []
    assert {kind for kind, _ in elsewhere["/redoc"]} <= {"image"}, elsewhere
    assert ROUTES <= swagger
    assert title is not None and title.startswith("Folio")
    assert "/" in back and "/training" in back  # the way back to the pages people came from
    assert all(route in redoc for route in ROUTES)
