"""The playground page in a real browser: Debian's chromium driven by Playwright against real servers (the shared
one, and one started with an API key), in both its modes: a completion streamed from /generate_stream, and a chat
whose turns go through /v1/chat/completions (each request carrying the replies before it, compared with what the
server answers to the same body).

Skipped, with the reason, only where no chromium binary is installed (CI installs it in .ci/run)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.testing import serving
from tests.app.browser import launched, needs_chromium

pytestmark = needs_chromium
API_KEY = "pl4yground-k3y"
DONE = "document.getElementById('status').textContent.includes('tokens ·')"
FAILED = "document.getElementById('status').className === 'error'"
SETTLED = f"({DONE} || {FAILED}) && !document.getElementById('go').disabled"


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """One headless chromium for the module; each test gets its own context (its own session storage)."""
    with launched() as browser:
        yield browser


@pytest.fixture
def page(browser) -> Iterator[object]:  # noqa: ANN001
    context = browser.new_context()
    try:
        yield context.new_page()
    finally:
        context.close()


@pytest.fixture(scope="module")
def keyed_server(char_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second `python -m app`, started with `--api-key`."""
    log = tmp_path_factory.mktemp("keyed-server") / "server.log"
    with serving(char_checkpoint, log, "--api-key", API_KEY) as (base, _):
        yield base


def output_tokens(page) -> str:  # noqa: ANN001
    return "".join(s.text_content() for s in page.query_selector_all("#output span.token"))


def generate(page) -> str:  # noqa: ANN001
    """Click Generate and wait for the stream's end or an error; the status line."""
    page.click("#go")
    page.wait_for_function(SETTLED)
    return page.text_content("#status")


def test_playground_streams_tokens_coloured_by_probability(server: str, page, tmp_path: Path) -> None:  # noqa: ANN001
    prompt, n = "Hello there", 40
    expected = httpx.post(f"{server}/generate", timeout=30, json={
        "inputs": prompt, "parameters": {"max_new_tokens": n, "greedy": True}}).json()["generated_text"]
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
    generate(page)
    spans = page.query_selector_all("#output span.token")
    texts = [s.text_content() for s in spans]
    logprobs = [float(s.get_attribute("data-logprob")) for s in spans]
    backgrounds = [s.evaluate("e => e.style.background") for s in spans]
    status = page.text_content("#status")
    batches = page.evaluate("window.batches")
    page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
    assert len(spans) == n
    assert "".join(texts) == expected  # the page shows exactly what /generate returns
    assert all(lp <= 0 for lp in logprobs)
    assert all(bg.startswith("rgba") for bg in backgrounds)  # coloured by probability
    assert f"{n} tokens" in status and "length" in status
    assert sum(batches) >= n + 1 and len(batches) > 1  # prompt span + tokens, arriving over several reads


SIZES = pytest.mark.parametrize("width, height", [(1280, 800), (390, 844)], ids=["desktop", "phone"])
INFO_LOADED = "document.getElementById('model').textContent.includes('parameters')"


def field_note(page, field: str) -> str:  # noqa: ANN001
    """The error shown under `field`, which is marked invalid; it must be on screen and inside the page's width."""
    assert page.get_attribute(f"#{field}", "aria-invalid") == "true"
    assert page.is_visible(f"#{field}_msg")
    box = page.eval_on_selector(f"#{field}_msg", "e => e.getBoundingClientRect().right")
    assert box <= page.evaluate("window.innerWidth"), f"#{field}_msg runs off the page"
    return page.text_content(f"#{field}_msg")


@SIZES
def test_playground_shows_errors_at_the_field_within_the_servers_limits(server: str, page, width: int,  # noqa: ANN001
                                                                        height: int, tmp_path: Path) -> None:
    info = httpx.get(f"{server}/info", timeout=30).json()
    limit, block = info["max_new_tokens_limit"], info["block_size"]
    sent: list[str] = []
    page.on("request", lambda r: sent.append(r.url) if r.url.endswith("/generate_stream") else None)
    page.set_viewport_size({"width": width, "height": height})
    page.goto(server + "/")
    page.wait_for_function(INFO_LOADED)
    assert page.get_attribute("#max_new_tokens", "max") == str(limit)  # the server's limit, from /info
    assert page.get_attribute("#truncate", "max") == str(block)
    # inputs a thumb can hit, with text a phone does not zoom into
    for field in ("#max_new_tokens", "#temperature", "#seed", "#truncate", "#api_key", "#go", "#prompt"):
        box = page.evaluate(f"(() => {{ const e = document.querySelector('{field}'); return "
                            "[e.getBoundingClientRect().height, parseFloat(getComputedStyle(e).fontSize)]; })()")
        assert box[0] >= 40 and box[1] >= 16, (field, box)

    # past the limit, or empty: said at the field before anything is sent (empty is not "got 0")
    page.fill("#max_new_tokens", str(limit + 1))
    generate(page)
    assert field_note(page, "max_new_tokens") == f"max tokens: from 1 to {limit}, got {limit + 1}"
    assert page.evaluate("document.activeElement.id") == "max_new_tokens"
    page.fill("#max_new_tokens", "")
    assert page.is_hidden("#max_new_tokens_msg")  # editing the field takes its note away
    generate(page)
    assert field_note(page, "max_new_tokens") == f"max tokens: empty; type a whole number from 1 to {limit}"
    assert sent == []

    # the server's 422 goes to the field it names (TGI names it at the start of its message)
    page.fill("#max_new_tokens", "5")
    page.fill("#prompt", "x" * (block + 10))
    status = generate(page)
    assert status.startswith("422: inputs:") and field_note(page, "prompt") .startswith(status)
    page.screenshot(path=str(tmp_path / f"too-long-{width}px.png"), full_page=True)
    # a prompt past the context: one click keeps its last tokens (parameters.truncate) and generates
    assert page.text_content("#keep_last") == f"keep the last {block} tokens and generate"
    page.click("#keep_last")
    page.wait_for_function(SETTLED)
    assert "5 tokens ·" in page.text_content("#status") and page.input_value("#truncate") == str(block)
    assert page.is_hidden("#prompt_msg") and page.get_attribute("#prompt", "aria-invalid") is None

    # greedy decoding samples nothing: its controls are greyed out
    page.check("#greedy")
    assert [page.is_disabled(f"#{f}") for f in ("temperature", "top_k", "top_p")] == [True] * 3
    page.uncheck("#greedy")
    assert [page.is_disabled(f"#{f}") for f in ("temperature", "top_k", "top_p")] == [False] * 3


@SIZES
def test_playground_marks_the_characters_the_model_does_not_know(server: str, page, width: int,  # noqa: ANN001
                                                                 height: int, tmp_path: Path) -> None:
    page.set_viewport_size({"width": width, "height": height})
    page.goto(server + "/")
    page.wait_for_function(INFO_LOADED)
    page.fill("#max_new_tokens", "6")
    page.check("#greedy")
    assert "6 tokens ·" in generate(page)
    page.hover("#output span.token >> nth=2")
    assert "token 3" in page.text_content("#token_info")

    # a snowman and an invisible variation selector, named by its code point where it stands in the prompt
    page.fill("#prompt", "Hi \u2603\ufe0f there\u200b")
    assert page.is_visible("#prompt_marks")
    assert [m.text_content() for m in page.query_selector_all("#prompt_marks mark")] == ["\u2603", "U+FE0F", "U+200B"]
    assert page.text_content("#prompt_marks div:last-child") == "Hi \u2603U+FE0F thereU+200B"
    status = generate(page)
    assert status.startswith("422: inputs:") and "vocabulary" in field_note(page, "prompt")
    page.screenshot(path=str(tmp_path / f"unknown-{width}px.png"), full_page=True)
    # the failed run leaves nothing of the run before it on show
    assert output_tokens(page) == ""
    assert "token 3" not in page.text_content("#token_info")
    page.fill("#prompt", "Hi there")
    assert page.is_hidden("#prompt_marks")


def test_playground_asks_for_the_api_key_and_sends_it_as_bearer(keyed_server: str, page, tmp_path: Path) -> None:  # noqa: ANN001
    sent: list[tuple[str, str | None]] = []
    page.on("request", lambda r: sent.append((r.url, r.headers.get("authorization"))))
    page.goto(keyed_server + "/")
    page.wait_for_function("document.getElementById('model').textContent.includes('parameters')")
    page.fill("#prompt", "Hello")
    page.fill("#max_new_tokens", "12")
    page.check("#greedy")

    # without a key: the 401 is explained and the key field asks for one
    status = generate(page)
    assert status.startswith("401") and "needs an API key" in status, status
    assert page.get_attribute("#api_key", "aria-invalid") == "true"
    assert page.evaluate("document.activeElement.id") == "api_key"
    page.screenshot(path=str(tmp_path / "playground-key-needed.png"), full_page=True)

    # with the key: the stream runs, and shows what /generate gives with the same key
    page.fill("#api_key", API_KEY)
    status = generate(page)
    assert "12 tokens ·" in status, status
    expected = httpx.post(f"{keyed_server}/generate", timeout=30, headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"inputs": "Hello", "parameters": {"max_new_tokens": 12, "greedy": True}})
    assert output_tokens(page) == expected.json()["generated_text"]
    assert page.get_attribute("#api_key", "aria-invalid") != "true"
    streams = [auth for url, auth in sent if url.endswith("/generate_stream")]
    assert streams == [None, f"Bearer {API_KEY}"]

    # kept in this tab's session storage only, never in a URL
    assert page.evaluate("sessionStorage.getItem('folio.apiKey')") == API_KEY
    assert page.evaluate("localStorage.length") == 0
    assert all(API_KEY not in url for url, _ in sent) and API_KEY not in page.url
    page.reload()
    assert page.input_value("#api_key") == API_KEY
    other = page.context.browser.new_context()
    try:
        fresh = other.new_page()
        fresh.goto(keyed_server + "/")
        assert fresh.input_value("#api_key") == ""
    finally:
        other.close()

    # a wrong key is told apart from a missing one
    page.fill("#api_key", "not-the-key")
    status = generate(page)
    assert status.startswith("401") and "refused" in status, status
    page.fill("#api_key", "")
    assert page.evaluate("sessionStorage.getItem('folio.apiKey')") is None


def test_playground_keeps_seeds_exact(server: str, page) -> None:  # noqa: ANN001
    seed = 2**63 - 25  # a double cannot hold it: as a JavaScript Number it becomes 2**63, past the API's range
    bodies: list[str] = []
    page.on("request", lambda r: bodies.append(r.post_data) if r.url.endswith("/generate_stream") else None)
    page.goto(server + "/")
    page.fill("#prompt", "ROMEO:")
    page.fill("#max_new_tokens", "30")
    page.fill("#seed", str(seed))
    status = generate(page)
    sent = json.loads(bodies[-1])
    assert sent["parameters"]["seed"] == seed  # the digits as typed, not rounded
    assert f"seed {seed} ·" in status, status
    # the same request through /generate gives the text the page shows
    again = httpx.post(f"{server}/generate", timeout=30, json=sent).json()["generated_text"]
    assert output_tokens(page) == again

    # a seed the server drew is shown exactly and can be put back into the form
    page.fill("#seed", "")
    status = generate(page)
    assert "seed" not in json.loads(bodies[-1])["parameters"]
    drawn, text = page.get_attribute("#reuse_seed", "data-seed"), output_tokens(page)
    assert drawn.isdigit() and f"seed {drawn} ·" in status, (drawn, status)
    page.click("#reuse_seed")
    assert page.input_value("#seed") == drawn
    generate(page)
    assert json.loads(bodies[-1])["parameters"]["seed"] == int(drawn)
    assert output_tokens(page) == text

    # what is not a whole number never leaves the page
    page.fill("#seed", "12x")
    status = generate(page)
    assert page.get_attribute("#status", "class") == "error" and "seed" in status and "12x" in status, status
    assert len(bodies) == 3


def _stream_of(word: str, pieces: int) -> str:
    """Server-sent events in /generate_stream's shape (TGI's StreamResponse) spelling `word` in `pieces` tokens."""
    size = -(-len(word) // pieces)
    chunks = [word[i:i + size] for i in range(0, len(word), size)]
    events = []
    for i, text in enumerate(chunks):
        last = i == len(chunks) - 1
        events.append({"index": i + 1, "token": {"id": 0, "text": text, "logprob": -0.1, "special": False},
                       "top_tokens": [], "generated_text": word if last else None,
                       "details": {"finish_reason": "length", "generated_tokens": len(chunks), "seed": 7,
                                   "input_length": 1} if last else None})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events)


@pytest.mark.parametrize("width, height", [(1280, 800), (375, 740)], ids=["desktop", "phone"])
def test_playground_wraps_a_long_word_inside_the_output_box(server: str, page, width: int, height: int,  # noqa: ANN001
                                                             tmp_path: Path) -> None:
    word = "Honorificabilitudinitatibus" * 30  # 810 characters without a break opportunity
    page.set_viewport_size({"width": width, "height": height})
    # a random test model rarely writes such a word: the stream is the server's shape, served by the browser
    page.route("**/generate_stream", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=_stream_of(word, 12)))
    page.goto(server + "/")
    page.fill("#prompt", "x" * 120)
    assert "tokens ·" in generate(page)
    page.screenshot(path=str(tmp_path / f"playground-{width}px.png"), full_page=True)
    assert output_tokens(page) == word
    box = page.evaluate("(() => { const e = document.getElementById('output');"
                        " return [e.scrollWidth, e.clientWidth]; })()")
    assert box[0] <= box[1], f"the output box scrolls: content {box[0]} px wide in a {box[1]} px box"
    page_width = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert page_width[0] <= page_width[1], f"the page scrolls sideways at {width} px: {page_width}"


# -- chat mode: a conversation through /v1/chat/completions ------------------------------------------------------

CHAT_DONE = "!document.getElementById('go').disabled"
CHAT_ROUTE = "/v1/chat/completions"


def open_chat(page, base: str) -> None:  # noqa: ANN001
    page.goto(base + "/#chat")
    page.wait_for_function("document.getElementById('model').textContent.includes('parameters')")


def send(page, text: str) -> str:  # noqa: ANN001
    """Type `text` into the message box, Send, and wait for the reply's end or an error; the status line."""
    page.fill("#user_input", text)
    page.click("#go")
    page.wait_for_function(CHAT_DONE)
    return page.text_content("#status")


def shown_turns(page) -> list[tuple[str, str]]:  # noqa: ANN001
    return [(t.get_attribute("class").split()[1], t.query_selector(".content").text_content())
            for t in page.query_selector_all("#conversation .msg")]


def reply_of(server: str, sent: dict, **headers: str) -> dict:
    """What /v1/chat/completions answers, not streamed, to the body the page sent: the choice."""
    body = {k: v for k, v in sent.items() if k not in ("stream", "stream_options")}
    r = httpx.post(server + CHAT_ROUTE, json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_streams_two_turns_each_reply_sent_back_with_the_next(server: str, page, tmp_path: Path) -> None:  # noqa: ANN001
    n = 6  # the test model's context is 64 characters: two turns and their template must fit in it
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith(CHAT_ROUTE) else None)
    open_chat(page, server)
    assert page.is_hidden("#prompt") and page.is_hidden("#output") and page.text_content("#go") == "Send"
    page.fill("#system", "Be")
    page.fill("#max_new_tokens", str(n))
    page.fill("#seed", "7")  # sampled (temperature 0.8), seeded: a direct call with the same body answers the same

    send(page, "Hi")
    first = reply_of(server, bodies[0])
    reply1 = first["choices"][0]["message"]["content"]
    status = send(page, "Yo")
    second = reply_of(server, bodies[1])
    reply2 = second["choices"][0]["message"]["content"]
    page.screenshot(path=str(tmp_path / "chat-two-turns.png"), full_page=True)

    assert [b["messages"] for b in bodies] == [
        [{"role": "system", "content": "Be"}, {"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be"}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": reply1}, {"role": "user", "content": "Yo"}]]
    assert bodies[1]["seed"] == 7 and bodies[1]["max_completion_tokens"] == n and bodies[1]["temperature"] == 0.8
    assert bodies[1]["stream"] is True and bodies[1]["logprobs"] is True
    # the page shows exactly what the server answers to each of those bodies
    assert shown_turns(page) == [("user", "Hi"), ("assistant", reply1), ("user", "Yo"), ("assistant", reply2)]
    assert page.evaluate("FolioChat.turns()") == bodies[1]["messages"][1:] + [{"role": "assistant",
                                                                              "content": reply2}]
    assert reply1 != reply2 and len(reply1) == len(reply2) == n
    # each reply token in its own span, coloured by its probability as the server reports it
    for turn, answer in zip(page.query_selector_all("#conversation .msg.assistant"), (first, second), strict=True):
        spans = turn.query_selector_all("span.token")
        want = answer["choices"][0]["logprobs"]["content"]
        assert [s.text_content() for s in spans] == [t["token"] for t in want]
        assert [float(s.get_attribute("data-logprob")) for s in spans] == pytest.approx([t["logprob"] for t in want])
        assert all(s.evaluate("e => e.style.background").startswith("rgba(255, ") for s in spans)
        assert all("alternatives" in s.get_attribute("title") for s in spans)  # top_logprobs, in the tooltip
    total = second["usage"]["total_tokens"]
    assert total > 64  # the test model's context: the next turn would be refused
    assert status.startswith(f"{n} tokens · length · conversation {total} tokens, past the context of 64: Clear "
                             "conversation to go on · seed 7 · "), status
    assert page.is_hidden("#inspect")


def test_chat_shows_a_bad_request_takes_the_turn_back_and_clears(server: str, page, tmp_path: Path) -> None:  # noqa: ANN001
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith(CHAT_ROUTE) else None)
    open_chat(page, server)
    page.fill("#max_new_tokens", "4")
    page.check("#greedy")
    send(page, "Hi")
    reply = reply_of(server, bodies[0])["choices"][0]["message"]["content"]
    assert bodies[0]["temperature"] == 0 and shown_turns(page) == [("user", "Hi"), ("assistant", reply)]
    assert page.text_content("#status").startswith("4 tokens · length · conversation 25 of 64 tokens · ")

    # OpenAI's error body, shown as the server wrote it; the field it names is marked; the turn is taken back
    page.uncheck("#greedy")
    page.fill("#temperature", "3")  # the completion mode's range (TGI's) allows it, OpenAI's [0, 2] does not
    status = send(page, "Yo")
    error = httpx.post(server + CHAT_ROUTE, json=bodies[1], timeout=30)
    assert error.status_code == 400 and error.json()["error"]["param"] == "temperature"
    assert status == f"400: {error.json()['error']['message']}"
    assert page.get_attribute("#status", "class") == "error"
    assert field_note(page, "temperature") == status  # under the field, by the completion tab's code
    assert page.evaluate("document.activeElement.id") == "temperature"
    assert shown_turns(page) == [("user", "Hi"), ("assistant", reply)]
    assert page.input_value("#user_input") == "Yo"  # to send again
    page.screenshot(path=str(tmp_path / "chat-error.png"), full_page=True)

    # fixed, sent again: the conversation before the error goes with it
    page.fill("#temperature", "0.8")
    assert page.get_attribute("#temperature", "aria-invalid") is None
    page.check("#greedy")
    page.click("#go")
    page.wait_for_function(CHAT_DONE)
    assert [m["content"] for m in bodies[2]["messages"]] == ["Hi", reply, "Yo"]
    assert len(shown_turns(page)) == 4

    # an empty message never leaves the page
    status = send(page, "   ")
    assert status.startswith("your message") and page.get_attribute("#user_input", "aria-invalid") == "true"
    assert len(bodies) == 3

    # cleared: the next turn starts a new conversation
    page.click("#clear")
    assert shown_turns(page) == [] and page.evaluate("FolioChat.turns()") == []
    send(page, "Yo")
    assert bodies[3]["messages"] == [{"role": "user", "content": "Yo"}]
    assert len(shown_turns(page)) == 2

    # and the completion mode is as it was
    page.click("#mode_completion")
    assert page.is_visible("#prompt") and page.is_hidden("#conversation") and page.text_content("#go") == "Generate"
    page.fill("#prompt", "Hello")
    page.fill("#max_new_tokens", "5")
    assert "5 tokens ·" in generate(page)
    assert page.url == server + "/"


def test_chat_asks_for_the_api_key(keyed_server: str, page) -> None:  # noqa: ANN001
    open_chat(page, keyed_server)
    page.fill("#max_new_tokens", "3")
    status = send(page, "Hi")
    assert status.startswith("401") and "needs an API key" in status and "Send again" in status, status
    assert page.get_attribute("#api_key", "aria-invalid") == "true" and shown_turns(page) == []
    page.fill("#api_key", API_KEY)
    assert "3 tokens ·" in send(page, "Hi")
    assert [role for role, _ in shown_turns(page)] == ["user", "assistant"]


def test_chat_stop_keeps_what_came_as_the_reply(server: str, page) -> None:  # noqa: ANN001
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith(CHAT_ROUTE) else None)
    open_chat(page, server)
    page.fill("#max_new_tokens", "4000")  # far more than comes before Stop (the window shifts past the context)
    page.fill("#user_input", "Hi")
    page.click("#go")
    page.wait_for_function("document.querySelectorAll('#conversation .msg.assistant span.token').length >= 3")
    page.click("#stop")
    page.wait_for_function(CHAT_DONE)
    status = page.text_content("#status")
    [(_, said)] = [t for t in shown_turns(page) if t[0] == "assistant"]
    assert status == f"stopped after {len(said)} tokens", status
    assert page.evaluate("FolioChat.turns()") == [{"role": "user", "content": "Hi"},
                                                 {"role": "assistant", "content": said}]
    send(page, "Yo")  # and the next turn carries it
    assert [m["content"] for m in bodies[-1]["messages"]] == ["Hi", said, "Yo"]


def _chat_stream_of(word: str, pieces: int) -> str:
    """Server-sent chunks in /v1/chat/completions' shape spelling `word` in `pieces` tokens."""
    size = -(-len(word) // pieces)
    chunks = [{"role": "assistant", "content": ""}] + [{"content": word[i:i + size]}
                                                       for i in range(0, len(word), size)]
    events = []
    for i, delta in enumerate(chunks):
        lp = None if i == 0 else {"content": [{"token": delta["content"], "logprob": -0.5, "bytes": [],
                                               "top_logprobs": []}]}
        events.append({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [{
            "index": 0, "delta": delta, "logprobs": lp, "finish_reason": "length" if i == len(chunks) - 1 else None}]})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


@pytest.mark.parametrize("width, height", [(1280, 800), (375, 740)], ids=["desktop", "phone"])
def test_chat_wraps_a_long_word_inside_the_conversation(server: str, page, width: int, height: int,  # noqa: ANN001
                                                         tmp_path: Path) -> None:
    word = "Honorificabilitudinitatibus" * 30
    page.set_viewport_size({"width": width, "height": height})
    page.route("**" + CHAT_ROUTE, lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=_chat_stream_of(word, 12)))
    open_chat(page, server)
    page.fill("#system", "y" * 200)
    assert "12 tokens · length ·" in send(page, "x" * 300)
    page.screenshot(path=str(tmp_path / f"chat-{width}px.png"), full_page=True)
    assert shown_turns(page) == [("user", "x" * 300), ("assistant", word)]
    box = page.evaluate("(() => { const e = document.getElementById('conversation');"
                        " return [e.scrollWidth, e.clientWidth]; })()")
    assert box[0] <= box[1], f"the conversation scrolls sideways: content {box[0]} px wide in a {box[1]} px box"
    page_width = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert page_width[0] <= page_width[1], f"the page scrolls sideways at {width} px: {page_width}"


@SIZES
def test_playground_has_what_people_expect(server: str, browser, width: int, height: int,  # noqa: ANN001
                                           tmp_path: Path) -> None:
    context = browser.new_context(viewport={"width": width, "height": height}, color_scheme="dark")
    context.grant_permissions(["clipboard-read", "clipboard-write"])
    try:
        page = context.new_page()
        missing: list[str] = []
        page.on("response", lambda r: missing.append(r.url) if r.status == 404 else None)
        sent: list[dict] = []
        page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/generate_stream") else None)
        page.goto(server + "/")
        page.wait_for_function(INFO_LOADED)
        # a favicon in the page (no /favicon.ico asked for, none 404 on load)
        assert missing == [] and page.get_attribute("link[rel=icon]", "href").startswith("data:image/svg+xml")
        assert page.get_attribute("#docs_link", "href") == "/docs" and page.is_visible("#keys_hint")
        assert "Ctrl+Enter" in page.text_content("#keys_hint")
        # the system's dark preference is followed
        background = page.evaluate("getComputedStyle(document.documentElement).backgroundColor")
        assert background == "rgb(18, 21, 27)", background

        # stop sequences and the repetition penalty go to the server; Ctrl+Enter generates
        page.fill("#prompt", "Hello")
        page.fill("#max_new_tokens", "24")
        page.fill("#repetition_penalty", "1.3")
        page.fill("#stop_at", "zz\\n\\n|qq")
        page.press("#prompt", "Control+Enter")
        page.wait_for_function(SETTLED)
        params = sent[-1]["parameters"]
        assert params["repetition_penalty"] == 1.3 and params["stop"] == ["zz\n\n", "qq"]
        seed = page.get_attribute("#reuse_seed", "data-seed")
        text = page.text_content("#output")

        # copy: the prompt and the output, as text
        page.click("#copy")
        assert page.evaluate("navigator.clipboard.readText()") == text

        # share: a link that opens the page with the prompt, the settings and the run's seed
        page.click("#share")
        url = page.input_value("#share_url")
        assert url.startswith(server + "/#share=") and page.evaluate("navigator.clipboard.readText()") == url
        page.screenshot(path=str(tmp_path / f"extras-{width}px.png"), full_page=True)
        again = context.new_page()
        again.goto(url)
        again.wait_for_function(INFO_LOADED)
        restored = {f: again.input_value(f"#{f}") for f in ("prompt", "max_new_tokens", "repetition_penalty",
                                                             "stop_at", "seed")}
        assert restored == {"prompt": "Hello", "max_new_tokens": "24", "repetition_penalty": "1.3",
                            "stop_at": "zz\\n\\n|qq", "seed": seed}
        again.click("#go")
        again.wait_for_function(SETTLED)
        assert again.text_content("#output") == text  # the same text again
    finally:
        context.close()
