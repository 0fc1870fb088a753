"""Reliability evidence, as figures: schema fuzzing and a bad-input table, load, overload, a disconnect storm,
the SIGTERM drain, engine faults, damaged checkpoints, and a trainer killed at random.

    python bench/reliability.py [--quick] [--only fuzz,bad_inputs,...] [--seed N]

Everything runs against real processes on 127.0.0.1: `python -m app` serving the tiny random character-level
checkpoint of the app tests (tests/app/checkpoints.py: 96 characters, block_size 64), and `python -m model.train`
on a tiny config. A character model has no EOS, so a request generates exactly its max_new_tokens unless a stop
string ends it, and one token is one character: every accepted request's token count can be checked exactly.

Sections (each returns its figures and a list of `problems`; empty means the requirement held):

- fuzz: every operation of /openapi.json, positive and negative cases from schemathesis, each response
  checked by schemathesis (no 5xx, documented status, documented content type, response schema) and by
  `check_response` (the error body of its API family, SSE framing and event shapes);
- bad_inputs: a hand-written table (malformed JSON, wrong types, huge numbers, NaN and infinities, negative and
  zero values, empty and 1 MB prompts, invalid UTF-8, characters outside the vocabulary, empty stop strings,
  unknown fields) on every generation route of both API families, each with its expected status;
- load: mixed routes, streaming and not, mixed parameters, from many concurrent clients against a capacity
  below the client count, so some requests get a deliberate 429 and retry; every accepted request must end
  with the right number of tokens; the server's RSS after the run against after a warm-up;
- overload: ten times the capacity (max_batch_size + max_waiting) at once on pre-opened connections: the
  latency of each 429, and the accepted requests' throughput against a burst of exactly the capacity; then the
  latency of lone requests refused while the server is held full;
- disconnects: streams (and a quarter as many whole-body requests) cut at random points; the time until
  /metrics shows an empty batch and queue; the server's greedy output before and after;
- shutdown: SIGTERM during active streams: how each stream ended, the exit code and time, and what new
  requests got meanwhile;
- faults: with `--fault-injection` (a testing aid, app/faults.py), requests that raise inside the model step
  among good ones: the faulty fail alone (424 or a final error event), the good match their reference;
  without the flag the same prompts generate normally;
- checkpoints: damaged checkpoints refused by `python -m app` at startup, exit code 2 and one line;
- training: the trainer SIGKILLed once right as its best checkpoint's weights are replaced, then at random
  moments, `--resume`d each time, its checkpoints loaded after each kill, the final weights and losses compared
  with an uninterrupted run;
- slow_clients: slowloris: as many connections as the server has slots send their headers and half a body (more
  send half their headers, or nothing), each trickling a byte every 0.5 s, while ordinary requests come: their
  statuses and latencies, how and when the server closed the slow connections, and /metrics after;
- oversized: the largest work one request may ask for: the longest /tokenize input the server accepts (its time,
  the answer's size, the server's RSS and /health's latency meanwhile), and 16 stop strings of the longest
  accepted length against none (a request alone, and half of a batch).

`--quick` is the reduced form; tests/reliability/test_reliability.py runs these same functions in CI.
Writes bench/results/reliability.json (or --out) and prints a summary table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "app"))

from checkpoints import CHARS, make_char_checkpoint  # noqa: E402
from server_process import free_port, spawn, stop, wait_healthy  # noqa: E402
from wire import metric, parse_sse  # noqa: E402

from app.faults import DECODE_AFTER, FAULT_DECODE, FAULT_PREFILL  # noqa: E402
from app.schemas import ErrorBody, GenerateResponse, OpenAIError, SimpleToken, StreamResponse  # noqa: E402

RESULTS = REPO / "bench" / "results" / "reliability.json"
BLOCK_SIZE = 64  # the test checkpoint's context
NEW_TOKENS_LIMIT = 512
MAIN_BATCH, MAIN_WAITING = 16, 32  # the main server's capacity: 48, below the load test's client count
# appended after tests/app/server_process.py's SERVER_ARGS, so these win
MAIN_ARGS = ["--max-batch-size", str(MAIN_BATCH), "--max-waiting", str(MAIN_WAITING), "--window-shift", "8",
             "--max-new-tokens-limit", str(NEW_TOKENS_LIMIT), "--max-body-bytes", str(2 * 1024 * 1024)]
PRINTABLE = [c for c in CHARS if c != "\n"]
MAX_PROBLEMS = 25  # problems kept per section (the count is kept in full)


@dataclasses.dataclass(frozen=True)
class Sizes:
    fuzz_examples: int  # schemathesis cases per operation and generation mode
    load_requests: int
    load_clients: int
    load_warmup: int
    overload_batch: int
    overload_waiting: int
    overload_factor: int
    overload_new_tokens: int
    overload_rounds: int
    disconnect_streams: int
    disconnect_wave: int
    shutdown_streams: int
    drain_timeout: float
    fault_good: int
    fault_bad: int
    training_kills: int
    training_iters: int
    slow_batch: int  # the slow-clients server's capacity: batch + waiting
    slow_waiting: int
    slow_connections: int  # connections sending headers and half a body (a quarter more send half their headers)
    slow_requests: int  # ordinary requests meanwhile
    slow_timeout: float  # the server's header and body timeout (0: its defaults)
    stop_new_tokens: int
    stop_batch: int


FULL = Sizes(fuzz_examples=150, load_requests=2000, load_clients=64, load_warmup=200, overload_batch=8,
             overload_waiting=8, overload_factor=10, overload_new_tokens=96, overload_rounds=3,
             disconnect_streams=200, disconnect_wave=36, shutdown_streams=32, drain_timeout=5.0, fault_good=24,
             fault_bad=8, training_kills=5, training_iters=300, slow_batch=16, slow_waiting=64, slow_connections=80,
             slow_requests=64, slow_timeout=3.0, stop_new_tokens=256, stop_batch=16)
QUICK = Sizes(fuzz_examples=25, load_requests=200, load_clients=16, load_warmup=40, overload_batch=2,
              overload_waiting=2, overload_factor=10, overload_new_tokens=128, overload_rounds=1,
              disconnect_streams=30, disconnect_wave=15, shutdown_streams=8, drain_timeout=3.0, fault_good=8,
              fault_bad=4, training_kills=2, training_iters=80, slow_batch=2, slow_waiting=2, slow_connections=8,
              slow_requests=8, slow_timeout=1.0, stop_new_tokens=64, stop_batch=4)


class Problems(list):
    """A section's failed requirements: every one counted, the first MAX_PROBLEMS kept with their detail."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def add(self, message: str) -> None:
        self.count += 1
        if len(self) < MAX_PROBLEMS:
            self.append(message[:600])


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """Resident set size of a process, from /proc (Linux); `field="VmHWM"` for its peak so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


@contextlib.contextmanager
def serve(checkpoint: Path, log: Path, *args: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """A `python -m app` on a free 127.0.0.1 port, healthy; stopped (SIGTERM, then SIGKILL) on exit."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = spawn(checkpoint, log, *args, port=port)
    try:
        wait_healthy(proc, base, log)
        yield base, proc
    finally:
        stop(proc)


def scrape(base: str) -> str:
    return httpx.get(f"{base}/metrics", timeout=10).text


# -- what a response must look like ---------------------------------------------------------------------------


def _fits(model: Any, obj: Any) -> bool:
    """`obj` validates against the pydantic model and holds no field it does not declare."""
    try:
        model.model_validate(obj)
    except Exception:
        return False
    return isinstance(obj, dict) and set(obj) <= set(model.model_fields)


def _openai_error(obj: Any, status: int | None = None) -> bool:
    return (_fits(OpenAIError, obj) and set(obj["error"]) == {"message", "type", "param", "code"}
            and (status is None or obj["error"]["code"] == status))


def _openai_completion(obj: Any, chunk: bool) -> bool:
    if not isinstance(obj, dict) or obj.get("object") != "text_completion":
        return False
    if not {"id", "created", "model", "choices"} <= set(obj):
        return False
    choices = obj["choices"]
    if chunk and choices == [] and isinstance(obj.get("usage"), dict):  # the include_usage chunk
        return True
    return (isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0].get("text"), str)
            and choices[0].get("finish_reason") in (None, "length", "stop"))


def check_response(path: str, streamed: bool, status: int, content_type: str, body: bytes,
                   documented: set[int] | None = None) -> list[str]:
    """Problems with one response: 5xx, a status outside `documented`, or a body that is not its API family's
    shape (TGI `{"error", "error_type"}`, OpenAI `{"error": {"message", "type", "param", "code"}}`, the
    success shapes of each route, SSE framing and the final event of a stream)."""
    where = f"{path} -> {status}"
    problems = []
    if status >= 500:
        problems.append(f"{where}: server error {body[:200]!r}")
    if documented is not None and status not in documented:
        problems.append(f"{where}: status not documented ({sorted(documented)})")
    openai = path.startswith("/v1/")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return [*problems, f"{where}: body is not UTF-8"]
    if path == "/metrics" and status == 200:
        ok = content_type.startswith("text/plain") and "folio_requests_total" in text
        return problems if ok else [*problems, f"{where}: not a Prometheus exposition ({content_type})"]
    if status != 200:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return [*problems, f"{where}: error body is not JSON: {text[:200]!r}"]
        ok = _openai_error(obj, status) if openai else _fits(ErrorBody, obj)
        return problems if ok else [*problems, f"{where}: error body of the wrong shape: {text[:300]}"]
    if streamed:
        if not content_type.startswith("text/event-stream"):
            return [*problems, f"{where}: stream answered as {content_type}"]
        try:
            events = parse_sse(text)
        except (AssertionError, json.JSONDecodeError) as e:
            return [*problems, f"{where}: bad SSE framing: {e}"]
        return problems + [f"{where}: {p}" for p in _stream_problems(events, openai)]
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return [*problems, f"{where}: body is not JSON: {text[:200]!r}"]
    if openai:
        ok = path == "/v1/models" or _openai_completion(obj, chunk=False)
    elif path == "/generate":
        ok = _fits(GenerateResponse, obj)
    elif path == "/":
        ok = isinstance(obj, list) and len(obj) == 1 and _fits(GenerateResponse, obj[0])
    elif path == "/tokenize":
        ok = isinstance(obj, list) and all(_fits(SimpleToken, t) for t in obj)
    else:
        ok = True
    return problems if ok else [*problems, f"{where}: body of the wrong shape: {text[:300]}"]


def _stream_problems(events: list[Any], openai: bool) -> list[str]:
    """A stream must end in a final event: TGI's last token (generated_text set) or error event; OpenAI's
    [DONE], after a finish_reason or an error chunk."""
    if not events:
        return ["empty stream"]
    if openai:
        if events[-1] != "[DONE]":
            return [f"stream does not end in [DONE]: {events[-1]!r}"]
        body = events[:-1]
        bad = [e for e in body if not (_openai_completion(e, chunk=True) or _openai_error(e))]
        if bad:
            return [f"chunk of the wrong shape: {bad[0]!r}"]
        last = body[-1] if body else None
        finished = any(c["choices"] and c["choices"][0]["finish_reason"] for c in body if "choices" in c)
        if not (finished or (last is not None and "error" in last)):
            return ["stream ends without a finish_reason or an error"]
        return []
    *tokens, last = events
    bad = [e for e in tokens if not _fits(StreamResponse, e) or e.get("generated_text") is not None]
    if bad:
        return [f"token event of the wrong shape: {bad[0]!r}"]
    if _fits(ErrorBody, last):
        return []
    if not (_fits(StreamResponse, last) and last.get("generated_text") is not None and last.get("details")):
        return [f"stream ends without a final event: {last!r}"]
    return []


# -- one generation request, built and checked ----------------------------------------------------------------

ROUTES = ("generate", "generate_stream", "root", "root_stream", "completions", "completions_stream")


@dataclasses.dataclass
class Spec:
    """One generation request: route, prompt, token budget and the other parameters, in both API families."""

    route: str
    prompt: str
    max_new_tokens: int
    params: dict[str, Any] = dataclasses.field(default_factory=dict)  # TGI parameters or OpenAI fields
    stop: list[str] = dataclasses.field(default_factory=list)

    @property
    def openai(self) -> bool:
        return self.route.startswith("completions")

    @property
    def streamed(self) -> bool:
        return self.route.endswith("stream")

    def request(self) -> tuple[str, dict[str, Any]]:
        """(path, JSON body)."""
        if self.openai:
            body = {"prompt": self.prompt, "max_tokens": self.max_new_tokens, **self.params}
            if self.stop:
                body["stop"] = self.stop
            if self.streamed:
                body["stream"] = True
            return "/v1/completions", body
        parameters = {"max_new_tokens": self.max_new_tokens, **self.params}
        if self.stop:
            parameters["stop"] = self.stop
        body = {"inputs": self.prompt, "parameters": parameters}
        if self.route == "root_stream":
            body["stream"] = True
        return {"generate": "/generate", "generate_stream": "/generate_stream"}.get(self.route, "/"), body


@dataclasses.dataclass
class Outcome:
    status: int
    text: str = ""  # the generated text (prompt echo removed)
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None  # a non-200 body's message, or a stream's final error event
    problems: list[str] = dataclasses.field(default_factory=list)


def read_outcome(spec: Spec, status: int, content_type: str, body: bytes) -> Outcome:
    """Parse a response to `spec` and check it: shape, and for a finished generation the token count (exactly
    max_new_tokens when it ends by length; at most that and no stop string in the text when a stop string
    ended it) and that text and count agree (one character per token)."""
    path, _ = spec.request()
    out = Outcome(status, problems=check_response(path, spec.streamed, status, content_type, body))
    if out.problems:
        return out
    if status != 200:
        obj = json.loads(body)
        out.error = obj["error"]["message"] if spec.openai else obj["error"]
        return out
    echo = spec.params.get("return_full_text") or spec.params.get("echo")
    if spec.streamed:
        events = parse_sse(body.decode())
        if spec.openai:
            chunks = [e for e in events[:-1] if "choices" in e]
            errors = [e for e in events[:-1] if "error" in e]
            out.text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            out.finish_reason = next((c["choices"][0]["finish_reason"] for c in chunks
                                      if c["choices"] and c["choices"][0]["finish_reason"]), None)
            usage = [c["usage"] for c in chunks if c.get("usage")]
            out.tokens = usage[0]["completion_tokens"] if usage else len(out.text) - (len(spec.prompt) if echo else 0)
            if errors:
                out.error = errors[0]["error"]["message"]
                return out
        else:
            *tokens, last = events
            if "error" in last:
                out.error, out.tokens = last["error"], len(tokens)
                return out
            tokens.append(last)
            out.tokens, out.finish_reason = len(tokens), last["details"]["finish_reason"]
            out.text = last["generated_text"]
            if last["details"]["generated_tokens"] != len(tokens):
                out.problems.append(f"{spec.route}: details say {last['details']['generated_tokens']} tokens, "
                                    f"{len(tokens)} events came")
            if "".join(t["token"]["text"] for t in tokens) != out.text[len(spec.prompt) if echo else 0 :]:
                out.problems.append(f"{spec.route}: the token texts do not add up to generated_text")
    else:
        obj = json.loads(body)
        if spec.openai:
            choice = obj["choices"][0]
            out.text, out.finish_reason = choice["text"], choice["finish_reason"]
            out.tokens = obj["usage"]["completion_tokens"]
        else:
            result = obj[0] if spec.route == "root" else obj
            out.text = result["generated_text"]
            details = result.get("details")
            if details:
                out.tokens, out.finish_reason = details["generated_tokens"], details["finish_reason"]
            else:
                out.tokens, out.finish_reason = len(out.text) - (len(spec.prompt) if echo else 0), "length"
    if echo:
        if not out.text.startswith(spec.prompt):
            out.problems.append(f"{spec.route}: echo/return_full_text does not start with the prompt")
        out.text = out.text[len(spec.prompt):]
    n = spec.max_new_tokens
    if out.finish_reason == "length":
        if out.tokens != n or len(out.text) != n:
            out.problems.append(f"{spec.route}: finished by length with {out.tokens} tokens, {len(out.text)} "
                                f"characters; max_new_tokens was {n}")
    elif out.finish_reason in ("stop", "stop_sequence"):
        if not spec.stop or out.tokens > n or any(s in out.text for s in spec.stop):
            out.problems.append(f"{spec.route}: stopped with {out.tokens} tokens, text {out.text!r}, stop "
                                f"{spec.stop}, max_new_tokens {n}")
    else:
        out.problems.append(f"{spec.route}: unexpected finish_reason {out.finish_reason!r}")
    return out


async def send(client: httpx.AsyncClient, spec: Spec) -> Outcome:
    path, body = spec.request()
    if spec.streamed:
        async with client.stream("POST", path, json=body) as r:
            raw = await r.aread()
    else:
        r = await client.post(path, json=body)
        raw = r.content
    return read_outcome(spec, r.status_code, r.headers.get("content-type", ""), raw)


def random_spec(rng: random.Random, *, max_new_tokens: tuple[int, int] = (1, 48),
                stop_chars: str | list[str] = PRINTABLE, routes: tuple[str, ...] = ROUTES) -> Spec:
    """A request with mixed parameters: route, prompt length (truncated when over the context), sampling or
    greedy, top-k/top-p/temperature/repetition penalty, logprobs, details, echo, and stop strings of one or two
    characters drawn from `stop_chars` (the characters the model tends to emit, so that some stop)."""
    route = rng.choice(routes)
    openai = route.startswith("completions")
    long_prompt = not openai and rng.random() < 0.15
    prompt = "".join(rng.choices(PRINTABLE, k=rng.randint(BLOCK_SIZE + 1, 4 * BLOCK_SIZE) if long_prompt
                                 else rng.randint(1, BLOCK_SIZE)))
    n = rng.randint(*max_new_tokens)
    params: dict[str, Any] = {}
    sample = rng.random() < 0.6
    if openai:
        params["temperature"] = round(rng.uniform(0.3, 1.5), 2) if sample else 0
        if sample and rng.random() < 0.5:
            params["top_p"] = round(rng.uniform(0.5, 1.0), 2)
        if sample and rng.random() < 0.3:
            params["top_k"] = rng.randint(1, 50)
        if rng.random() < 0.5:
            params["seed"] = rng.randrange(2**31)
        if rng.random() < 0.2:
            params["logprobs"] = rng.randint(0, 5)
        if rng.random() < 0.2:
            params["echo"] = True
        if route.endswith("stream"):
            params["stream_options"] = {"include_usage": True}
    else:
        if sample:
            params.update(do_sample=True, temperature=round(rng.uniform(0.3, 1.5), 2))
            if rng.random() < 0.4:
                params["top_k"] = rng.randint(1, 50)
            if rng.random() < 0.4:
                params["top_p"] = round(rng.uniform(0.5, 1.0), 2)
        if rng.random() < 0.5:
            params["seed"] = rng.randrange(2**31)
        if rng.random() < 0.2:
            params["repetition_penalty"] = round(rng.uniform(1.0, 1.5), 2)
        if rng.random() < 0.2:
            params["top_n_tokens"] = rng.randint(1, 5)
        if rng.random() < 0.2:
            params["return_full_text"] = True
        if rng.random() < 0.2:
            params["decoder_input_details"] = True
        if long_prompt:
            params["truncate"] = rng.randint(1, BLOCK_SIZE)
    stop = ["".join(rng.choices(stop_chars, k=rng.choice((1, 1, 2)))) for _ in range(rng.randint(1, 3))] \
        if rng.random() < 0.25 else []
    if not openai and (stop or rng.random() < 0.7):
        params["details"] = True  # without details a stopped request's token count is not on the wire
    return Spec(route, prompt, n, params, stop)


# -- fuzz: schemathesis over /openapi.json --------------------------------------------------------------------


def documented_statuses(base: str) -> dict[tuple[str, str], set[int]]:
    schema = httpx.get(f"{base}/openapi.json", timeout=10).json()
    return {(method.upper(), path): {int(s) for s in op["responses"]}
            for path, ops in schema["paths"].items() for method, op in ops.items()}


def _to_printable(case: Any) -> None:
    """Map the prompt and stop strings of a positive case onto the model's vocabulary, so that the case gets
    past tokenisation and exercises generation with the fuzzed parameters."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in ("inputs", "prompt"):
        if isinstance(body.get(key), str):
            body[key] = "".join(PRINTABLE[ord(c) % len(PRINTABLE)] for c in body[key][:BLOCK_SIZE]) or "a"
    params = body.get("parameters") if isinstance(body.get("parameters"), dict) else body
    stop = params.get("stop")
    if isinstance(stop, list):
        params["stop"] = ["".join(PRINTABLE[ord(c) % len(PRINTABLE)] for c in s) or "a" for s in stop
                          if isinstance(s, str)]


def fuzz(base: str, examples: int, seed: int) -> dict[str, Any]:
    """Every operation of the OpenAPI schema, `examples` positive and `examples` negative cases each (an operation
    without inputs has no negative case; hypothesis also stops early once an operation's inputs are exhausted)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              negative_data_rejection]
    documented = documented_statuses(base)
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    problems = Problems()
    statuses: Counter[int] = Counter()
    per_operation: dict[str, dict[str, int]] = {}
    failures: Counter[str] = Counter()

    def fuzz_test(op: Any, mode: GenerationMode, counts: Counter[str]) -> Callable[[], None]:
        @hypothesis_seed(seed)
        @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case: Any) -> None:
            if mode == GenerationMode.POSITIVE and counts["requests"] % 2:
                _to_printable(case)
            response = case.call(base_url=base, timeout=120)
            counts["requests"] += 1
            statuses[response.status_code] += 1
            try:
                case.validate_response(response, checks=checks)
            except (AssertionError, BaseExceptionGroup) as e:
                for failure in (e.exceptions if isinstance(e, BaseExceptionGroup) else [e]):
                    title = getattr(failure, "title", type(failure).__name__)
                    failures[f"{op.label}: {title}"] += 1
                    problems.add(f"{op.label} ({mode.value}) -> {response.status_code}: {title}: "
                                 f"{str(failure)[:300]} body sent: {str(case.body)[:200]}")
            # 424 is documented, but with no fault injected it is a generation that failed (a stream says so in
            # its final event)
            if response.status_code == 424 or (response.status_code == 200 and (
                    b'"error_type":"generation"' in response.content or b'"code":424' in response.content)):
                failures[f"{op.label}: 424"] += 1
                problems.add(f"{op.label} ({mode.value}): generation failed for {str(case.body)[:300]}: "
                             f"{response.content[:300]!r}")
            body = case.body if isinstance(case.body, dict) else {}
            streamed = op.path == "/generate_stream" or (op.path in ("/", "/v1/completions")
                                                         and body.get("stream") is True)
            if not response.stream_cut_short:
                for p in check_response(op.path, streamed, response.status_code,
                                        (response.headers.get("content-type") or [""])[0], response.content,
                                        documented[(op.method.upper(), op.path)]):
                    failures[f"{op.label}: shape"] += 1
                    problems.add(p)

        return run

    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            counts: Counter[str] = Counter()
            try:
                fuzz_test(op, mode, counts)()
            except Unsatisfiable:
                pass  # GET /health and friends take no input, so there is nothing to negate
            per_operation.setdefault(op.label, {})[mode.value] = counts["requests"]
    return {"requests": sum(statuses.values()), "by_status": dict(sorted(statuses.items())),
            "server_errors": sum(n for s, n in statuses.items() if s >= 500), "per_operation": per_operation,
            "failures": dict(failures), "problems": problems, "problem_count": problems.count}


# -- bad inputs: a hand-written table -------------------------------------------------------------------------

MB = 1024 * 1024
Body = bytes | dict[str, Any]


def bad_input_table() -> list[tuple[str, Body, Body, int, int]]:
    """(name, TGI body, OpenAI body, expected status for TGI, for OpenAI). Bodies are raw bytes or JSON."""
    tgi = lambda **p: {"inputs": "Hello", "parameters": {"max_new_tokens": 4, **p}}  # noqa: E731
    oa = lambda **f: {"prompt": "Hello", "max_tokens": 4, **f}  # noqa: E731
    raw_tgi = lambda params: ('{"inputs": "Hello", "parameters": {"max_new_tokens": 4, ' + params + "}}").encode()  # noqa: E731
    raw_oa = lambda fields: ('{"prompt": "Hello", "max_tokens": 4, ' + fields + "}").encode()  # noqa: E731
    big = "To be, or not to be: that is the question.\n" * (MB // 44 + 1)
    big = big[:MB]
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    rows: list[tuple[str, Body, Body, int, int]] = [
        # malformed JSON
        ("trailing comma", raw_tgi('"seed": 1,'), raw_oa('"seed": 1,'), 422, 422),
        ("truncated JSON", b'{"inputs": "Hello", "param', b'{"prompt": "Hel', 422, 422),
        ("single quotes", b"{'inputs': 'Hello'}", b"{'prompt': 'Hello'}", 422, 422),
        ("empty body", b"", b"", 422, 422),
        ("JSON null", b"null", b"null", 422, 422),
        ("JSON array", b'["Hello"]', b'["Hello"]', 422, 422),
        ("bare string", b'"Hello"', b'"Hello"', 422, 422),
        ("nesting 100000 deep", deep, deep, 422, 422),
        ("garbage bytes", bytes(range(256)), bytes(range(256)), 422, 422),
        # wrong types
        ("prompt is a number", {"inputs": 5}, {"prompt": 5}, 422, 422),
        ("prompt is null", {"inputs": None}, {"prompt": None}, 422, 422),
        ("prompt is an object", {"inputs": {"a": 1}}, {"prompt": {"a": 1}}, 422, 422),
        ("prompt is a list of two", {"inputs": ["a", "b"]}, {"prompt": ["a", "b"]}, 422, 422),
        ("max tokens is a word", tgi(max_new_tokens="many"), oa(max_tokens="many"), 422, 422),
        ("max tokens is a float", tgi(max_new_tokens=4.5), oa(max_tokens=4.5), 422, 422),
        ("max tokens is a numeric string", tgi(max_new_tokens="4"), oa(max_tokens="4"), 422, 422),
        ("details is 1", tgi(details=1), oa(echo=1), 422, 422),
        ("temperature is a list", tgi(temperature=[1]), oa(temperature=[1]), 422, 422),
        ("stop is a number", tgi(stop=5), oa(stop=5), 422, 422),
        ("stop is a string (TGI wants a list)", tgi(stop="a"), oa(stop="a"), 422, 200),
        ("stream is a word", {"inputs": "Hello", "stream": "yes"}, oa(stream="yes"), 422, 422),
        ("parameters is a list", {"inputs": "Hello", "parameters": [1]}, oa(stream_options=[1]), 422, 422),
        ("seed is a boolean", tgi(seed=True), oa(seed=True), 422, 422),
        # huge numbers
        ("max tokens 10^30", tgi(max_new_tokens=10**30), oa(max_tokens=10**30), 422, 422),
        ("max tokens over the limit", tgi(max_new_tokens=NEW_TOKENS_LIMIT + 1),
         oa(max_tokens=NEW_TOKENS_LIMIT + 1), 422, 422),
        ("seed 2^64", tgi(seed=2**64), oa(seed=2**64), 422, 422),
        ("top_k 10^18", tgi(top_k=10**18, do_sample=True), oa(top_k=10**18), 422, 422),
        ("temperature 1e308", tgi(temperature=1e308), oa(temperature=1e308), 422, 422),
        ("temperature 1e400 (inf)", raw_tgi('"temperature": 1e400'), raw_oa('"temperature": 1e400'), 422, 422),
        ("5000-digit integer", raw_tgi('"seed": ' + "9" * 5000), raw_oa('"seed": ' + "9" * 5000), 422, 422),
        ("truncate 10^12", tgi(truncate=10**12), oa(user="x" * 1000), 422, 200),
        # NaN and infinities
        ("temperature NaN", raw_tgi('"temperature": NaN'), raw_oa('"temperature": NaN'), 422, 422),
        ("top_p Infinity", raw_tgi('"top_p": Infinity'), raw_oa('"top_p": Infinity'), 422, 422),
        ("repetition penalty -Infinity", raw_tgi('"repetition_penalty": -Infinity'),
         raw_oa('"repetition_penalty": -Infinity'), 422, 422),
        ("max tokens NaN", raw_tgi('"seed": NaN'), raw_oa('"max_tokens": NaN'), 422, 422),
        # negative and zero values
        ("max tokens 0", tgi(max_new_tokens=0), oa(max_tokens=0), 422, 422),
        ("max tokens -1", tgi(max_new_tokens=-1), oa(max_tokens=-1), 422, 422),
        ("temperature -1", tgi(temperature=-1), oa(temperature=-1), 422, 422),
        ("temperature 0 (greedy)", tgi(temperature=0), oa(temperature=0), 200, 200),
        ("top_p 0", tgi(top_p=0), oa(top_p=0), 422, 422),
        ("top_k 0 (off)", tgi(top_k=0), oa(top_k=0), 200, 200),
        ("top_k -1", tgi(top_k=-1), oa(top_k=-1), 422, 422),
        ("repetition penalty 0", tgi(repetition_penalty=0), oa(repetition_penalty=0), 422, 422),
        ("seed -1", tgi(seed=-1), oa(seed=-1), 422, 422),
        ("truncate 0", tgi(truncate=0), oa(logprobs=-1), 422, 422),
        ("top_n_tokens -1 / logprobs 6", tgi(top_n_tokens=-1), oa(logprobs=6), 422, 422),
        # empty and 1 MB prompts
        ("empty prompt", {"inputs": ""}, {"prompt": ""}, 422, 422),
        ("1 MB prompt (over the context)", {"inputs": big}, {"prompt": big}, 422, 422),
        ("1 MB prompt, truncated to the context", {"inputs": big, "parameters": {"truncate": 32,
                                                                                  "max_new_tokens": 4}},
         {"prompt": [big]}, 200, 422),
        ("1 MB of unknown characters", {"inputs": "é" * (MB // 2)}, {"prompt": "é" * (MB // 2)}, 422, 422),
        ("3 MB body (over the limit)", {"inputs": big * 3}, {"prompt": big * 3}, 413, 413),
        # invalid UTF-8, and characters the char model does not know
        ("invalid UTF-8 byte", b'{"inputs": "Hel\xfflo"}', b'{"prompt": "Hel\xfflo"}', 422, 422),
        ("overlong UTF-8 encoding", b'{"inputs": "\xc0\xafetc"}', b'{"prompt": "\xc0\xafetc"}', 422, 422),
        ("UTF-16 body", '{"inputs": "Hello"}'.encode("utf-16"), '{"prompt": "Hello"}'.encode("utf-16"),
         200, 200),
        ("lone surrogate escape", b'{"inputs": "a\\ud800b"}', b'{"prompt": "a\\ud800b"}', 422, 422),
        ("NUL character", {"inputs": "a\x00b"}, {"prompt": "a\x00b"}, 422, 422),
        ("tab character", {"inputs": "a\tb"}, {"prompt": "a\tb"}, 422, 422),
        ("emoji", {"inputs": "hi 😀"}, {"prompt": "hi 😀"}, 422, 422),
        ("CJK", {"inputs": "中文"}, {"prompt": "中文"}, 422, 422),
        ("unknown character in a stop string", tgi(stop=["é"]), oa(stop=["é"]), 200, 200),
        # empty stop strings
        ("empty stop string", tgi(stop=[""]), oa(stop=""), 422, 422),
        ("empty among stop strings", tgi(stop=["a", ""]), oa(stop=["a", ""]), 422, 422),
        ("17 stop strings", tgi(stop=["a"] * 17), oa(stop=["a"] * 17), 422, 422),
        # unknown and unsupported fields
        ("unknown top-level field", {"inputs": "Hello", "foo": 1}, oa(foo=1), 422, 422),
        ("unknown parameter", tgi(foo=1), oa(stream_options={"foo": 1}), 422, 422),
        ("unsupported: typical_p / suffix", tgi(typical_p=0.5), oa(suffix="x"), 422, 422),
        ("unsupported: grammar / logit_bias", tgi(grammar={"type": "json"}), oa(logit_bias={"1": 1}), 422, 422),
        ("unsupported: best_of 2 / n 2", tgi(best_of=2), oa(n=2), 422, 422),
        ("unsupported: watermark / presence_penalty", tgi(watermark=True), oa(presence_penalty=1), 422, 422),
        ("another model", tgi(), oa(model="gpt-4"), 200, 404),
    ]
    return rows


def bad_inputs(base: str) -> dict[str, Any]:
    """The table on every generation route: /generate, /generate_stream, POST / (and with "stream"),
    /v1/completions (whole and streamed). Every response: its expected status, documented, its family's shape."""
    documented = documented_statuses(base)
    routes = [("/generate", False, False), ("/generate_stream", True, False), ("/", False, False),
              ("/", True, False), ("/v1/completions", False, True), ("/v1/completions", True, True)]
    problems = Problems()
    statuses: Counter[int] = Counter()
    cases = 0
    with httpx.Client(base_url=base, timeout=120) as client:
        for name, tgi_body, oa_body, tgi_status, oa_status in bad_input_table():
            cases += 1
            for path, streamed, openai in routes:
                body, want = (oa_body, oa_status) if openai else (tgi_body, tgi_status)
                if streamed and path != "/generate_stream":
                    if isinstance(body, bytes):
                        continue  # raw bytes cannot carry the flag: the same request as the whole route's
                    body = {"stream": True, **body}
                content = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
                r = client.post(path, content=content, headers={"content-type": "application/json"})
                statuses[r.status_code] += 1
                label = f"{name!r} on {path}{' (stream)' if streamed else ''}"
                if r.status_code != want:
                    problems.add(f"{label}: {r.status_code}, expected {want}: {r.text[:200]}")
                for p in check_response(path, streamed and r.status_code == 200, r.status_code,
                                        r.headers.get("content-type", ""), r.content, documented[("POST", path)]):
                    problems.add(f"{label}: {p}")
    return {"cases": cases, "routes": len(routes), "requests": sum(statuses.values()),
            "by_status": dict(sorted(statuses.items())),
            "server_errors": sum(n for s, n in statuses.items() if s >= 500),
            "problems": problems, "problem_count": problems.count}


# -- load -----------------------------------------------------------------------------------------------------


async def _drive(base: str, specs: list[Spec], clients: int, problems: Problems,
                 emitted: Counter[str] | None = None) -> dict[str, Any]:
    """`clients` concurrent clients working through `specs`; a 429 is retried after a short random pause.
    The characters generated are counted into `emitted`."""
    pending = list(reversed(specs))
    rejected, completed, tokens, attempts = 0, 0, 0, 0
    latencies: list[float] = []
    finished: Counter[str] = Counter()
    rng = random.Random(len(specs))

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal rejected, completed, tokens, attempts
        while pending:
            spec = pending.pop()
            for _ in range(1000):
                attempts += 1
                t0 = time.perf_counter()
                try:
                    out = await send(client, spec)
                except httpx.HTTPError as e:
                    problems.add(f"{spec.route}: transport error {e!r} (cause {e.__cause__!r}) after "
                                 f"{time.perf_counter() - t0:.3f} s, request {spec.request()[1]}"[:600])
                    break
                if out.status == 429:
                    rejected += 1
                    await asyncio.sleep(rng.uniform(0.01, 0.1))
                    continue
                latencies.append(time.perf_counter() - t0)
                if out.status != 200 or out.error:
                    problems.add(f"{spec.route}: {out.status} {out.error or ''} for {spec.request()[1]}"[:500])
                for p in out.problems:
                    problems.add(p)
                completed += out.status == 200 and not out.problems and not out.error
                tokens += out.tokens
                finished[str(out.finish_reason)] += 1
                if emitted is not None:
                    emitted.update(out.text)
                break
            else:
                problems.add(f"{spec.route}: still 429 after 1000 attempts")

    # an idle connection is dropped before uvicorn's 5 s keep-alive timeout would close it: at equal timeouts a
    # request sent just as the server closes the connection gets a reset (about 1 in 3,000 requests here)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients, keepalive_expiry=2.0)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=300) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    wall = time.perf_counter() - t0
    return {"requests": len(specs), "completed": completed, "attempts": attempts, "rejected_429": rejected,
            "tokens": tokens, "seconds": round(wall, 2), "requests_per_s": round(len(specs) / wall, 2),
            "tokens_per_s": round(tokens / wall, 1), "finish_reasons": dict(finished),
            "latency_p50_ms": ms(pct(latencies, 0.5)), "latency_p99_ms": ms(pct(latencies, 0.99))}


def load(base: str, pid: int, requests: int, clients: int, warmup: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    problems = Problems()
    emitted: Counter[str] = Counter()
    warm = asyncio.run(_drive(base, [random_spec(rng) for _ in range(warmup)], clients, problems, emitted))
    time.sleep(0.5)
    rss_warm = rss_kib(pid)
    frequent = [c for c, _ in emitted.most_common(6) if c != "\n"] or PRINTABLE
    specs = [random_spec(rng, stop_chars=frequent) for _ in range(requests)]
    run = asyncio.run(_drive(base, specs, clients, problems))
    time.sleep(0.5)
    rss_after = rss_kib(pid)
    growth = rss_after / rss_warm - 1
    if abs(growth) > 0.10:
        problems.add(f"RSS after the run {rss_after} KiB is {growth:+.1%} off {rss_warm} KiB after warm-up")
    if run["completed"] != requests:
        problems.add(f"{run['completed']} of {requests} requests completed correctly")
    text = scrape(base)
    if metric(text, "folio_running_batch_size") or metric(text, "folio_queue_depth"):
        problems.add("the batch or queue is not empty after the run")
    mix = Counter(s.route for s in specs)
    return {**run, "clients": clients, "capacity": MAIN_BATCH + MAIN_WAITING, "warmup_requests": warmup,
            "warmup": warm, "mix": dict(mix), "streamed": sum(n for r, n in mix.items() if r.endswith("stream")),
            "with_stop_strings": sum(1 for s in specs if s.stop), "rss_after_warmup_kib": rss_warm,
            "rss_after_run_kib": rss_after, "rss_growth": round(growth, 4), "problems": problems,
            "problem_count": problems.count}


# -- overload -------------------------------------------------------------------------------------------------


async def _burst(port: int, n: int, body: bytes) -> list[tuple[int, float, bytes]]:
    """`n` POST /generate at once, each on its own connection opened beforehand: (status, latency, body)."""
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(n)]
    request = (f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, t0: float) -> tuple[int, float, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        data = await reader.readexactly(length)
        latency = time.perf_counter() - t0
        writer.close()
        return status, latency, data

    starts = []
    for _, writer in conns:
        writer.write(request)
        starts.append(time.perf_counter())
    for _, writer in conns:
        await writer.drain()
    return await asyncio.gather(*(one(r, w, t0) for (r, w), t0 in zip(conns, starts)))


async def _lone_refusals(base: str, capacity: int, n: int) -> list[tuple[int, float]]:
    """With the server held at capacity by long generations, `n` requests one after another on a kept-alive
    connection: (status, latency) each. The held generations are cancelled at the end (their sockets closed)."""
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps({"inputs": "hold", "parameters": {"max_new_tokens": 4096}}).encode()
    head = (f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(capacity)]
    for _, writer in held:
        writer.write(head + body)
    out = []
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for _ in range(3000):  # until all are admitted (a request being prefilled shows in neither gauge)
            text = (await client.get("/metrics")).text
            if metric(text, "folio_running_batch_size") + metric(text, "folio_queue_depth") >= capacity:
                break
            await asyncio.sleep(0.01)
        probe = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": 16}}
        for _ in range(n):
            t0 = time.perf_counter()
            r = await client.post("/generate", json=probe)
            out.append((r.status_code, time.perf_counter() - t0))
    for _, writer in held:
        writer.close()
    return out


def overload(checkpoint: Path, workdir: Path, batch: int, waiting: int, factor: int, new_tokens: int,
             rounds: int, timing: bool = True) -> dict[str, Any]:
    """Bursts of `capacity` requests (the non-overloaded figure) and of `factor * capacity` requests, alternated
    `rounds` times, each on connections opened beforehand. Throughput: accepted tokens over the time from the
    burst to the last accepted response; the ratio is taken per round (the bursts of a round run back to back),
    then the median. Then lone requests while the server is held at capacity: a 429 that queues behind no other.
    With `timing`, the issue's two timing requirements count as problems: every 429 of a burst within 50 ms, and
    the throughput ratio at least 0.9 (the CI test leaves them to this bench and checks a relative bound)."""
    capacity = batch + waiting
    problems = Problems()
    body = json.dumps({"inputs": "ROMEO:", "parameters": {"max_new_tokens": new_tokens, "do_sample": True,
                                                           "seed": 1}}).encode()
    figures: dict[str, list[float]] = {"plain_tokens_per_s": [], "overloaded_tokens_per_s": []}
    rejected_latencies: list[float] = []
    accepted_latencies: list[float] = []
    accepted_counts = []
    args = ["--max-batch-size", str(batch), "--max-waiting", str(waiting), "--window-shift", "8"]
    with serve(checkpoint, workdir / "overload.log", *args) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        asyncio.run(_burst(port, capacity, body))  # warm-up
        for _ in range(rounds):
            for label, n in (("plain", capacity), ("overloaded", factor * capacity)):
                results = asyncio.run(_burst(port, n, body))
                accepted = [(lat, data) for status, lat, data in results if status == 200]
                rejected = [lat for status, lat, _ in results if status == 429]
                other = [status for status, _, _ in results if status not in (200, 429)]
                if other:
                    problems.add(f"{label} burst: statuses other than 200 and 429: {Counter(other)}")
                for status, _, data in results:
                    for p in check_response("/generate", False, status, "application/json", data):
                        problems.add(p)
                tokens = 0
                for _, data in accepted:
                    text = json.loads(data)["generated_text"]
                    if len(text) != new_tokens:
                        problems.add(f"an accepted request generated {len(text)} tokens, not {new_tokens}")
                    tokens += len(text)
                wall = max(lat for lat, _ in accepted) if accepted else math.nan
                figures[f"{label}_tokens_per_s"].append(tokens / wall)
                if label == "plain" and rejected:
                    problems.add(f"a burst of exactly the capacity ({capacity}) got {len(rejected)} 429s")
                if label == "overloaded":
                    rejected_latencies += rejected
                    accepted_latencies += [lat for lat, _ in accepted]
                    accepted_counts.append(len(accepted))
                    if len(accepted) < capacity:
                        problems.add(f"only {len(accepted)} of {n} admitted, capacity is {capacity}")
                    if len(accepted) + len(rejected) != n:
                        problems.add(f"{n - len(accepted) - len(rejected)} requests neither admitted nor refused")
        lone = asyncio.run(_lone_refusals(base, capacity, 50))
        if any(status != 429 for status, _ in lone):
            problems.add(f"a lone request while at capacity got {Counter(s for s, _ in lone)}")
        if not math.isfinite(_idle_at(base)):
            problems.add("the held generations were not cancelled")
    ratios = [o / p for p, o in zip(figures["plain_tokens_per_s"], figures["overloaded_tokens_per_s"])]
    lone_latencies = [lat for _, lat in lone]
    slow = [lat for lat in rejected_latencies if lat > 0.05]
    if timing and slow:
        problems.add(f"{len(slow)} of {len(rejected_latencies)} 429s of the bursts took over 50 ms "
                     f"(max {max(slow) * 1000:.1f} ms)")
    if timing and statistics.median(ratios) < 0.9:
        problems.add(f"overloaded throughput is {statistics.median(ratios):.3f} of the plain figure, below 0.9")
    return {"capacity": capacity, "max_batch_size": batch, "max_waiting": waiting, "burst": factor * capacity,
            "new_tokens": new_tokens, "rounds": rounds, "accepted_per_burst": accepted_counts,
            "rejected": len(rejected_latencies), "rejected_latency_p50_ms": ms(pct(rejected_latencies, 0.5)),
            "rejected_latency_p99_ms": ms(pct(rejected_latencies, 0.99)),
            "rejected_latency_max_ms": ms(max(rejected_latencies, default=None)),
            "rejected_within_50ms": sum(lat <= 0.05 for lat in rejected_latencies),
            "accepted_latency_min_ms": ms(min(accepted_latencies, default=None)),
            "accepted_latency_max_ms": ms(max(accepted_latencies, default=None)),
            "plain_tokens_per_s": [round(x, 1) for x in figures["plain_tokens_per_s"]],
            "overloaded_tokens_per_s": [round(x, 1) for x in figures["overloaded_tokens_per_s"]],
            "throughput_ratios": [round(r, 3) for r in ratios], "throughput_ratio": round(statistics.median(ratios), 3),
            "lone_rejected": len(lone), "lone_rejected_latency_p50_ms": ms(pct(lone_latencies, 0.5)),
            "lone_rejected_latency_p99_ms": ms(pct(lone_latencies, 0.99)),
            "lone_rejected_within_50ms": sum(lat <= 0.05 for lat in lone_latencies),
            "problems": problems, "problem_count": problems.count}


# -- disconnect storm -----------------------------------------------------------------------------------------


async def _cut(client: httpx.AsyncClient, spec: Spec, rng: random.Random) -> tuple[str, float]:
    """Send `spec` and hang up at a random point: a stream before its first event (within 50 ms) or after a
    random number of events; a whole-body request after a random wait. Returns how it was cut, and when."""
    path, body = spec.request()
    how = rng.choice(["before the answer", "mid-stream", "mid-stream"]) if spec.streamed else "whole, waiting"

    async def streamed(after_events: int) -> None:
        async with client.stream("POST", path, json=body) as r:
            seen = 0
            async for chunk in r.aiter_raw():
                seen += chunk.count(b"\n\n")
                if seen >= after_events:
                    return

    try:
        if how == "mid-stream":
            await streamed(rng.randint(1, spec.max_new_tokens // 2))
        elif how == "before the answer":
            await asyncio.wait_for(streamed(10**9), timeout=rng.uniform(0.0, 0.05))
        else:
            await asyncio.wait_for(client.post(path, json=body), timeout=rng.uniform(0.05, 1.0))
    except TimeoutError:
        pass
    return how, time.perf_counter()


def _idle_at(base: str, timeout: float = 30.0) -> float:
    """Poll /metrics until the running batch and the queue are empty; when that was seen (inf if never)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        text = scrape(base)
        if metric(text, "folio_running_batch_size") == 0 and metric(text, "folio_queue_depth") == 0:
            return time.perf_counter()
        time.sleep(0.01)
    return math.inf


def disconnects(base: str, streams: int, wave: int, seed: int) -> dict[str, Any]:
    """`streams` long streamed generations in waves of `wave`, each wave with a quarter as many whole-body
    requests beside it (all within the capacity, so none is refused), every one cut at a random point. After each
    wave, the time from its last cut until /metrics shows no running or waiting request. Afterwards the greedy
    output of a fixed prompt must be what it was before, and a batch of mixed requests must complete."""
    rng = random.Random(seed)
    problems = Problems()
    probe = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": 40}}
    before = httpx.post(f"{base}/generate", json=probe, timeout=60).json()
    cancelled_before = metric(scrape(base), "folio_cancelled_requests_total")
    free_times, hows = [], Counter()
    streamed = tuple(r for r in ROUTES if r.endswith("stream"))
    whole = tuple(r for r in ROUTES if not r.endswith("stream"))
    done = 0
    while done < streams:
        n = min(wave, streams - done)
        specs = [random_spec(rng, max_new_tokens=(200, NEW_TOKENS_LIMIT), routes=streamed) for _ in range(n)]
        specs += [random_spec(rng, max_new_tokens=(200, NEW_TOKENS_LIMIT), routes=whole) for _ in range(n // 4)]
        for spec in specs:
            spec.stop = []  # long generations: a slot that is not freed stays busy for seconds

        async def storm(specs: list[Spec] = specs) -> list[tuple[str, float]]:
            limits = httpx.Limits(max_connections=len(specs))
            async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as client:
                return await asyncio.gather(*(_cut(client, s, rng) for s in specs))

        cuts = asyncio.run(storm())
        last_cut = max(t for _, t in cuts)
        hows.update(how for how, _ in cuts)
        free_times.append(max(0.0, _idle_at(base) - last_cut))
        done += n
    cancelled = metric(scrape(base), "folio_cancelled_requests_total") - cancelled_before
    worst = max(free_times)
    if worst > 1.0:
        problems.add(f"a wave's slots took {worst:.3f} s to free after its last cut (limit 1 s)")
    after = httpx.post(f"{base}/generate", json=probe, timeout=60)
    if after.status_code != 200 or after.json() != before:
        problems.add(f"after the storm: {after.status_code} {after.text[:200]}, before: {before}")
    if httpx.get(f"{base}/health", timeout=10).status_code != 200:
        problems.add("/health is not 200 after the storm")
    normal = asyncio.run(_drive(base, [random_spec(rng) for _ in range(24)], 8, problems))
    return {"streams": streams, "whole_requests": sum(n for how, n in hows.items() if how.startswith("whole")),
            "waves": math.ceil(streams / wave), "wave": wave, "cut": dict(hows),
            "completed_after": normal["completed"],
            "cancelled_by_server": int(cancelled), "slots_freed_max_ms": ms(worst),
            "slots_freed_per_wave_ms": [ms(t) for t in free_times], "answers_normally_after": not problems,
            "problems": problems, "problem_count": problems.count}


# -- shutdown -------------------------------------------------------------------------------------------------


def shutdown(checkpoint: Path, workdir: Path, streams: int, drain: float, seed: int) -> dict[str, Any]:
    """SIGTERM while `streams` generations stream (all in the running batch); short ones may finish within the
    drain, long ones cannot. Meanwhile new requests keep arriving on fresh connections."""
    rng = random.Random(seed)
    problems = Problems()
    args = ["--max-batch-size", str(streams), "--max-waiting", "4", "--drain-timeout", str(drain),
            "--window-shift", "8", "--max-new-tokens-limit", "4096"]
    log = workdir / "shutdown.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = spawn(checkpoint, log, *args, port=port)
    outcomes: dict[int, Outcome] = {}
    started = [threading.Event() for _ in range(streams)]
    specs = [Spec("completions_stream" if i % 2 else "generate_stream", "ROMEO:",
                  rng.randint(20, 300) if i % 4 == 0 else 4096, {"seed": i} if i % 2 else {"details": True})
             for i in range(streams)]

    def consume(i: int) -> None:
        path, body = specs[i].request()
        raw = b""
        try:
            with httpx.stream("POST", f"{base}{path}", json=body, timeout=drain + 60) as r:
                for chunk in r.iter_raw():
                    raw += chunk
                    started[i].set()
                status, ctype = r.status_code, r.headers.get("content-type", "")
        except httpx.HTTPError as e:
            outcomes[i] = Outcome(0, problems=[f"stream {i}: transport error {type(e).__name__}: {e}"])
            return
        finally:
            started[i].set()
        outcomes[i] = read_outcome(specs[i], status, ctype, raw)

    probes: Counter[str] = Counter()
    try:
        wait_healthy(proc, base, log)
        threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(streams)]
        for t in threads:
            t.start()
        if not all(e.wait(120) for e in started):
            problems.add("not every stream started within 120 s")
        signalled = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        while proc.poll() is None and time.perf_counter() - signalled < drain + 30:
            try:
                r = httpx.post(f"{base}/generate", json={"inputs": "late", "parameters": {"max_new_tokens": 2}},
                               timeout=5)
                probes[str(r.status_code)] += 1
                if r.status_code != 503:
                    problems.add(f"a request after SIGTERM got {r.status_code}: {r.text[:200]}")
            except httpx.TransportError as e:
                probes[type(e).__name__] += 1
            time.sleep(0.05)
        try:
            rc = proc.wait(max(0.0, drain + 30 - (time.perf_counter() - signalled)))
        except subprocess.TimeoutExpired:
            rc = None
        exit_s = time.perf_counter() - signalled
        for t in threads:
            t.join(30)
    finally:
        stop(proc)
    if rc != 0:
        problems.add(f"exit code {rc} after SIGTERM: {log.read_text()[-500:]}")
    margin = 3.0  # uvicorn's own shutdown after the drain (its graceful timeout is the drain + 2 s)
    if exit_s > drain + margin:
        problems.add(f"exited {exit_s:.2f} s after SIGTERM, drain timeout {drain} s + {margin} s")
    ended: Counter[str] = Counter()
    for i in range(streams):
        out = outcomes.get(i)
        if out is None:
            problems.add(f"stream {i} never ended")
            continue
        for p in out.problems:
            problems.add(f"stream {i}: {p}")
        if out.error is not None:
            if "engine stopped" not in out.error:
                problems.add(f"stream {i} ended with an unexpected error: {out.error}")
            ended["final error event"] += 1
        elif out.status == 200 and not out.problems:
            ended["completed"] += 1
    return {"streams": streams, "drain_timeout_s": drain, "exit_code": rc, "exit_after_s": round(exit_s, 3),
            "ended": dict(ended), "requests_after_signal": dict(probes),
            "admitted_after_signal": probes.get("200", 0), "problems": problems, "problem_count": problems.count}


# -- engine faults --------------------------------------------------------------------------------------------


def faults(checkpoint: Path, workdir: Path, base_off: str, good: int, bad: int, seed: int) -> dict[str, Any]:
    """On a server started with --fault-injection: `bad` requests whose prompt holds a fault marker (prefill and
    decode, whole and streamed, both families) run at once with `good` greedy requests. On `base_off` (started
    without the flag) the same prompts generate normally."""
    rng = random.Random(seed)
    problems = Problems()
    goods = [Spec(ROUTES[i % len(ROUTES)], "".join(rng.choices(PRINTABLE, k=rng.randint(4, 30))),
                  rng.randint(8, 40), {"temperature": 0} if ROUTES[i % len(ROUTES)].startswith("completions")
                  else {"details": True}) for i in range(good)]
    # both families and both phases within the first four, then every other route and phase
    first = [("generate", FAULT_DECODE), ("completions_stream", FAULT_DECODE), ("generate_stream", FAULT_PREFILL),
             ("completions", FAULT_PREFILL)]
    combos = first + [(r, m) for m in (FAULT_DECODE, FAULT_PREFILL) for r in ROUTES if (r, m) not in first]
    bads = [Spec(route, f"Hi {marker} there", DECODE_AFTER + 8,
                 {"temperature": 0} if route.startswith("completions") else {"details": True})
            for route, marker in (combos[i % len(combos)] for i in range(bad))]

    async def run_all(base: str, specs: list[Spec]) -> list[Outcome]:
        async with httpx.AsyncClient(base_url=base, timeout=120,
                                     limits=httpx.Limits(max_connections=len(specs))) as client:
            return await asyncio.gather(*(send(client, s) for s in specs))

    reference = asyncio.run(run_all(base_off, goods))
    markers_off = asyncio.run(run_all(base_off, bads))
    for out in markers_off:
        if out.status != 200 or out.error or out.problems:
            problems.add(f"without --fault-injection the marker prompt failed: {out}")
    with serve(checkpoint, workdir / "faults.log", *MAIN_ARGS, "--fault-injection") as (base, _):
        failed_before = metric(scrape(base), "folio_failed_requests_total")
        mixed = goods + bads
        order = list(range(len(mixed)))
        rng.shuffle(order)
        results = asyncio.run(run_all(base, [mixed[i] for i in order]))
        outcome = {i: results[k] for k, i in enumerate(order)}
        failed = metric(scrape(base), "folio_failed_requests_total") - failed_before
        after = httpx.post(f"{base}/generate", json={"inputs": goods[0].prompt,
                                                      "parameters": {"max_new_tokens": 8}}, timeout=60)
    good_ok = 0
    for i, spec in enumerate(goods):
        out, ref = outcome[i], reference[i]
        for p in out.problems:
            problems.add(f"good request: {p}")
        if out.status != 200 or out.error or out.text != ref.text:
            problems.add(f"good request {spec.route} {spec.prompt!r}: {out.status} {out.error} {out.text!r}, "
                         f"reference {ref.text!r}")
        else:
            good_ok += 1
    bad_ok = 0
    for j, spec in enumerate(bads):
        out = outcome[good + j]
        phase = "prefill" if FAULT_PREFILL in spec.prompt else "decode"
        for p in out.problems:
            problems.add(f"faulty request: {p}")
        want_status = 200 if spec.streamed else 424
        want_tokens = 0 if phase == "prefill" else DECODE_AFTER
        if out.status != want_status or not out.error or "injected fault" not in out.error:
            problems.add(f"faulty {phase} request on {spec.route}: {out.status}, error {out.error!r}")
        elif spec.streamed and out.tokens != want_tokens:
            problems.add(f"faulty {phase} stream on {spec.route}: {out.tokens} tokens before the error event, "
                         f"expected {want_tokens}")
        else:
            bad_ok += 1
    if failed != bad:
        problems.add(f"folio_failed_requests_total rose by {failed}, {bad} requests were made to fail")
    if after.status_code != 200:
        problems.add(f"after the faults: {after.status_code} {after.text[:200]}")
    return {"good": good, "good_matching_reference": good_ok, "faulty": bad, "faulty_failed_alone": bad_ok,
            "failed_requests_metric": int(failed), "markers_without_flag_generate": all(
                o.status == 200 and not o.error for o in markers_off),
            "problems": problems, "problem_count": problems.count}


# -- damaged checkpoints --------------------------------------------------------------------------------------


def damaged_checkpoints(checkpoint: Path, workdir: Path) -> list[tuple[str, Path, str]]:
    """Copies of `checkpoint`, each damaged one way: (name, directory, what the error line must say)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = []

    def copy(name: str) -> Path:
        d = workdir / "damaged" / name.replace(" ", "-")
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(checkpoint, d)
        return d

    weights = checkpoint / "model.safetensors"
    data = weights.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")

    d = copy("flipped bytes in tensor data")
    flipped = bytearray(data)
    for i in range(header + 100, header + 164):
        flipped[i] ^= 0xFF
    (d / "model.safetensors").write_bytes(bytes(flipped))
    out.append(("flipped bytes in tensor data", d, "sha256"))

    d = copy("flipped bytes in the header")
    flipped = bytearray(data)
    for i in range(10, 40):
        flipped[i] ^= 0xFF
    (d / "model.safetensors").write_bytes(bytes(flipped))
    out.append(("flipped bytes in the header", d, "not a readable safetensors file"))

    d = copy("truncated to half")
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    out.append(("truncated to half", d, "not a readable safetensors file"))

    d = copy("truncated to zero bytes")
    (d / "model.safetensors").write_bytes(b"")
    out.append(("truncated to zero bytes", d, "not a readable safetensors file"))

    d = copy("wrong shapes")
    meta = json.loads((d / "config.json").read_text())
    meta["model"]["n_embd"] = 48
    (d / "config.json").write_text(json.dumps(meta))
    out.append(("wrong shapes (config n_embd 48, weights 32)", d, "has shape"))

    d = copy("missing tensors")
    meta = json.loads((d / "config.json").read_text())
    meta["model"]["n_layer"] += 1
    (d / "config.json").write_text(json.dumps(meta))
    out.append(("missing tensors (config has one more layer)", d, "does not match the model config"))

    for field, value in (("n_layer", 100_000), ("n_embd", 10**9)):  # refused before anything is built
        d = copy(f"config {field} {value}")
        meta = json.loads((d / "config.json").read_text())
        meta["model"].update({field: value, "n_head": 1})
        (d / "config.json").write_text(json.dumps(meta))
        out.append((f"config.json with {field} {value}", d, "parameters"))

    d = copy("non-finite weights")
    with safe_open(weights, framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    diverged = state["transformer.h.0.mlp.c_fc.weight"].clone()
    diverged[3, 5] = float("nan")
    save_file({**state, "transformer.h.0.mlp.c_fc.weight": diverged}, d / "model.safetensors")
    meta = json.loads((d / "config.json").read_text())
    meta["weights_sha256"] = hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()  # as a diverged run
    (d / "config.json").write_text(json.dumps(meta))
    out.append(("a NaN among the weights", d, "NaN or infinite"))

    d = copy("pickle renamed")
    torch.save(state, d / "model.safetensors")
    out.append(("pickle renamed to .safetensors", d, "pickle renamed to .safetensors"))
    return out


def checkpoints(checkpoint: Path, workdir: Path) -> dict[str, Any]:
    """`python -m app` on each damaged checkpoint, all at once: exit code 2 and one clear line, nothing served."""
    problems = Problems()
    cases = damaged_checkpoints(checkpoint, workdir)
    procs = [(name, d, needle, spawn(d, workdir / f"{d.name}.log")) for name, d, needle in cases]
    rows = {}
    for name, d, needle, proc in procs:
        try:
            rc = proc.wait(180)
        except subprocess.TimeoutExpired:
            stop(proc)
            rc = None
        lines = (workdir / f"{d.name}.log").read_text().strip().splitlines()
        rows[name] = {"exit_code": rc, "message": lines[0] if len(lines) == 1 else lines}
        if rc != 2:
            problems.add(f"{name}: exit code {rc}, expected 2")
        if len(lines) != 1 or not lines[0].startswith(f"error: cannot serve {d}") or needle not in lines[0]:
            problems.add(f"{name}: expected one line 'error: cannot serve {d}: ...{needle}...', got {lines}")
    return {"cases": rows, "refused": sum(r["exit_code"] == 2 for r in rows.values()), "problems": problems,
            "problem_count": problems.count}


# -- crash-safe training --------------------------------------------------------------------------------------

TRAIN_ARGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "48", "--block-size", "64", "--batch-size", "8",
              "--dropout", "0.1", "--learning-rate", "3e-3", "--min-lr", "3e-4", "--warmup-iters", "10",
              "--eval-interval", "20", "--eval-iters", "4", "--checkpoint-interval", "10", "--log-interval", "5",
              "--device", "cpu", "--threads", "1", "--no-progress"]


def training_text(workdir: Path) -> Path:
    """40 KB of tiny Shakespeare where it lies beside the repository; else this repository's own prose."""
    shakespeare = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
    raw = shakespeare.read_bytes() if shakespeare.is_file() else b"".join(
        p.read_bytes() for p in sorted(REPO.glob("*.md")) + sorted((REPO / "model").glob("*.py")))
    path = workdir / "input.txt"
    path.write_text(raw[:40_000].decode("utf-8", errors="ignore"), encoding="utf-8")
    return path


def _trainer(argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "model.train", *argv], cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT)


def _resume_dir(out: Path) -> Path | None:
    """Where `--resume` reads from (the trainer's own rule: last/, else last.old/ after a torn swap)."""
    if (out / "last" / "resume.pt").is_file():
        return out / "last"
    if (out / "last.old" / "resume.pt").is_file():
        return out / "last.old"
    return None


def _loss_rows(out: Path) -> list[tuple]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln]
    return [(r["step"], r.get("loss"), r.get("lr"), r.get("train_loss"), r.get("val_loss")) for r in rows]


def _await_training(out: Path, after_step: int, proc: subprocess.Popen, timeout: float = 300) -> bool:
    """Wait until the trainer logs a step past `after_step` (its start-up is over); False if it exited first."""
    deadline = time.perf_counter() + timeout
    while proc.poll() is None and time.perf_counter() < deadline:
        try:
            rows = (out / "metrics.jsonl").read_text().splitlines()
        except FileNotFoundError:
            rows = []
        if any(json.loads(r)["step"] > after_step for r in rows[-3:] if r.endswith("}")):
            return True
        time.sleep(0.02)
    return False


def _await_weights_swap(out: Path, proc: subprocess.Popen, timeout: float = 300) -> bool:
    """Spin until `OUT/model.safetensors` is replaced by a new best checkpoint's weights; False if the trainer
    exited first. The trainer is then between the weights' rename and the config's, or just past it."""
    path = out / "model.safetensors"

    def inode() -> int | None:
        try:
            return path.stat().st_ino
        except FileNotFoundError:
            return None

    first = inode()
    deadline = time.perf_counter() + timeout
    while proc.poll() is None and time.perf_counter() < deadline:
        now = inode()
        if first is None:
            first = now  # the first best checkpoint: wait for the one that replaces it
        elif now != first:
            return True
    return False


def training(workdir: Path, kills: int, max_iters: int, seed: int, targeted: bool = True) -> dict[str, Any]:
    """An uninterrupted run, then the same run SIGKILLed and `--resume`d again and again: first (if `targeted`)
    the moment the best checkpoint's new weights are renamed into place, the one moment where weights and config
    on disk disagree, then `kills` times, each at a moment drawn uniformly over the first 80% of the training
    left divided by the kills still to come (start-up excluded: nothing is written then). After every kill the
    checkpoints on disk must load; at the end, weights and losses must equal the uninterrupted run's."""
    import torch
    from safetensors.torch import load_file

    from model.checkpoint import CheckpointError, load_checkpoint, read_config

    rng = random.Random(seed)
    problems = Problems()
    text = training_text(workdir)
    base_argv = ["--data", str(text), *TRAIN_ARGS, "--max-iters", str(max_iters)]
    ref, run = workdir / "train-reference", workdir / "train-killed"
    for d in (ref, run):
        shutil.rmtree(d, ignore_errors=True)
    t0 = time.perf_counter()
    proc = _trainer([*base_argv, "--out", str(ref)], workdir / "train-reference.log")
    started = _await_training(ref, 0, proc)
    startup = time.perf_counter() - t0
    rc = proc.wait(600)
    reference_s = time.perf_counter() - t0
    if rc != 0 or not started:
        problems.add(f"the reference run failed: {(workdir / 'train-reference.log').read_text()[-800:]}")
        return {"problems": problems, "problem_count": problems.count}
    train_s = reference_s - startup

    plan = ["weights renamed"] * targeted + ["random"] * kills
    events: list[dict[str, Any]] = []
    fresh_starts = 0
    for kind in [*plan, None]:
        resume_from = _resume_dir(run)
        step = read_config(resume_from)["training"]["steps"] if resume_from else 0
        if resume_from is None:
            fresh_starts += 1
            argv = [*base_argv, "--out", str(run), "--overwrite"]  # what an attempt killed early left goes
        else:
            argv = ["--resume", "--out", str(run)]
        launched = time.perf_counter()
        proc = _trainer(argv, workdir / "train-killed.log")
        if kind is None:
            rc = proc.wait(600)
            if rc != 0:
                problems.add(f"the final resume exited {rc}: {(workdir / 'train-killed.log').read_text()[-800:]}")
            break
        event: dict[str, Any] = {"kind": kind, "resumed_from_step": step}
        if kind == "random":
            if not _await_training(run, step, proc):
                problems.add(f"the trainer exited ({proc.poll()}) before it logged a step (kill {len(events) + 1})")
                break
            # uniformly over the first 80% of the training left, shared among the kills still to come (a kill
            # drawn near the end would leave the next ones no training to interrupt)
            kills_left = plan[len(events):].count("random")
            delay = rng.uniform(0, 0.8 * train_s * (max_iters - step) / max_iters / kills_left)
            try:
                proc.wait(delay)
                problems.add(f"the run finished before kill {len(events) + 1} ({delay:.2f} s into training)")
                break
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
        else:
            if not _await_weights_swap(run, proc):
                problems.add("the run finished before the best checkpoint was replaced")
                break
            proc.send_signal(signal.SIGKILL)
            event["config_rename_pending"] = (run / "config.next.json").is_file()
        proc.wait()
        event["killed_after_s"] = round(time.perf_counter() - launched, 3)
        loads: dict[str, Any] = {}
        for name in ("", "last", "last.old", "last.tmp"):
            d = run / name if name else run
            if not ((d / "config.json").is_file() or (d / "config.next.json").is_file()):
                continue
            try:
                loads[name or "OUT"] = load_checkpoint(d).training.get("steps")
            except CheckpointError as e:
                loads[name or "OUT"] = f"refused: {e}"
                if name != "last.tmp":  # last.tmp is the half-written next checkpoint; nothing reads it
                    problems.add(f"after kill {len(events) + 1} ({kind}), {d} does not load: {e}")
        nxt = _resume_dir(run)
        event.update(loaded_steps=loads, resumes_from=(nxt.name, read_config(nxt)["training"]["steps"]) if nxt
                     else "a fresh start (no checkpoint yet)")
        events.append(event)

    result: dict[str, Any] = {"max_iters": max_iters, "kills": len(events), "fresh_starts": fresh_starts,
                              "reference_s": round(reference_s, 2), "events": events}
    if (run / "last").is_dir() and (run / "model.safetensors").is_file():
        def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
            return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

        a, b = load_file(ref / "last" / "model.safetensors"), load_file(run / "last" / "model.safetensors")
        diff = max(float((a[k] - b[k]).abs().max()) for k in a)
        same = equal(a, b)
        best_same = equal(load_file(ref / "model.safetensors"), load_file(run / "model.safetensors"))
        ref_t, run_t = read_config(ref / "last")["training"], read_config(run / "last")["training"]
        rows_same = _loss_rows(ref) == _loss_rows(run)
        result.update({
            "final_step": run_t["steps"], "reference_val_loss": ref_t["val_loss"], "val_loss": run_t["val_loss"],
            "reference_train_loss": ref_t["train_loss"], "train_loss": run_t["train_loss"],
            "val_loss_abs_diff": abs(run_t["val_loss"] - ref_t["val_loss"]), "weights_max_abs_diff": diff,
            "final_weights_bitwise_equal": same, "best_checkpoint_bitwise_equal": best_same,
            "metrics_rows_equal": rows_same, "tolerance": "none: bitwise-equal weights, equal losses"})
        if run_t["steps"] != max_iters:
            problems.add(f"the killed run ended at step {run_t['steps']}, not {max_iters}")
        if not same or run_t["val_loss"] != ref_t["val_loss"]:
            problems.add(f"the resumed run's final weights/loss differ from the reference (max |diff| {diff}, "
                         f"val loss {run_t['val_loss']} vs {ref_t['val_loss']})")
        if not best_same:
            problems.add("the best-validation checkpoint differs from the reference's")
        if not rows_same:
            problems.add("metrics.jsonl differs from the reference's")
    else:
        problems.add("the killed run has no checkpoint at the end")
    result.update(problems=problems, problem_count=problems.count)
    return result


# -- slow clients ---------------------------------------------------------------------------------------------


async def _slow_connection(port: int, data: bytes, trickle: bytes, t0: float, out: dict[str, Any]) -> None:
    """Send `data`, then one byte of `trickle` every 0.5 s (a slowloris keeps its connection busy) until the server
    closes the connection (or the task is cancelled): in `out`, what the server answered and when it closed."""
    out.update(answer=b"", closed_after=None)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)

    async def trickle_bytes() -> None:
        for i in range(len(trickle)):
            await asyncio.sleep(0.5)
            writer.write(trickle[i : i + 1])

    trickling = asyncio.ensure_future(trickle_bytes())
    try:
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                out["answer"] += chunk
        out["closed_after"] = time.perf_counter() - t0
    finally:
        trickling.cancel()
        writer.close()


def slow_clients(checkpoint: Path, workdir: Path, batch: int, waiting: int, connections: int, requests: int,
                 timeout: float) -> dict[str, Any]:
    """Slowloris against a server of capacity `batch + waiting`: `connections` connections send their headers and
    half a JSON body, `connections // 4` half their headers, `connections // 8` nothing; then each trickles the
    rest, a byte every 0.5 s. Meanwhile `requests` ordinary requests from up to 8 clients (never more than the
    capacity): their statuses and latencies. Then how and when the server closed the slow connections (`timeout`
    > 0 starts the server with that header and body timeout; 0 leaves the server's defaults, for a server without
    those options), and what /metrics shows after."""
    problems = Problems()
    args = ["--max-batch-size", str(batch), "--max-waiting", str(waiting), "--window-shift", "8"]
    if timeout > 0:
        args += ["--header-timeout", str(timeout), "--body-timeout", str(timeout)]
    body = json.dumps({"inputs": "ROMEO:", "parameters": {"max_new_tokens": 16}}).encode()
    head = (f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    kinds = {"half body": (head + body[: len(body) // 2], body[len(body) // 2 :], connections),
             "half headers": (head[: len(head) // 2], head[len(head) // 2 :], connections // 4),
             "headers from the first byte": (b"", head, connections // 8)}
    window = 2 * timeout + 3 if timeout > 0 else 6.0  # how long the slow connections are watched
    clients = min(8, batch + waiting)  # ordinary clients: never more than the capacity, so none needs a 429

    async def attack(base: str) -> tuple[dict[str, list[dict[str, Any]]], list[tuple[int, float]], dict[str, Any]]:
        port = int(base.rsplit(":", 1)[1])
        t0 = time.perf_counter()
        results: dict[str, list[dict[str, Any]]] = {kind: [{} for _ in range(n)] for kind, (_, _, n) in kinds.items()}
        tasks = {kind: [asyncio.ensure_future(_slow_connection(port, data, trickle, t0, out)) for out in results[kind]]
                 for kind, (data, trickle, _) in kinds.items()}
        await asyncio.sleep(0.2)  # the server has read what they sent
        answers: list[tuple[int, float]] = []
        during: dict[str, Any] = {}
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            async def one(i: int) -> None:
                t = time.perf_counter()
                r = await client.post("/generate", json={"inputs": "ROMEO:", "parameters": {
                    "max_new_tokens": 16, "do_sample": True, "seed": i}})
                answers.append((r.status_code, time.perf_counter() - t))
                if r.status_code == 200 and len(r.json()["generated_text"]) != 16:
                    problems.add(f"an ordinary request generated {len(r.json()['generated_text'])} tokens, not 16")

            async def client_loop(k: int) -> None:
                for i in range(k, requests, clients):
                    await one(i)

            await asyncio.gather(*(client_loop(k) for k in range(clients)))
            during["health"] = (await client.get("/health")).status_code
            text = (await client.get("/metrics")).text
            during["running"] = metric(text, "folio_running_batch_size")
            during["still_open"] = sum(not t.done() for ts in tasks.values() for t in ts)
        every = [t for ts in tasks.values() for t in ts]
        await asyncio.wait(every, timeout=max(0.0, window - (time.perf_counter() - t0)))
        for t in every:  # still open at the end of the window: closed from this side
            t.cancel()
        await asyncio.gather(*every, return_exceptions=True)
        return results, answers, during

    with serve(checkpoint, workdir / "slow.log", *args) as (base, _):
        results, answers, during = asyncio.run(attack(base))
        time.sleep(0.5)  # the client side has closed whatever the server had not
        text = scrape(base)
        after = {"running": metric(text, "folio_running_batch_size"), "queue": metric(text, "folio_queue_depth")}
        with contextlib.suppress(AssertionError):  # only where the server exports them
            after["reserved"] = metric(text, "folio_reserved_slots")
        after["ordinary_request"] = httpx.post(f"{base}/generate", json={"inputs": "ROMEO:"}, timeout=60).status_code
    statuses = Counter(str(s) for s, _ in answers)
    latencies = [lat for _, lat in answers]
    if statuses != Counter({"200": requests}):
        problems.add(f"ordinary requests during the attack got {dict(statuses)}, not {requests} x 200")
    closed: dict[str, dict[str, Any]] = {}
    for kind, outs in results.items():
        times = [o["closed_after"] for o in outs if o["closed_after"] is not None]
        answered = Counter(o["answer"].split(b" ", 2)[1].decode() if o["answer"] else "nothing" for o in outs
                           if o["closed_after"] is not None)
        closed[kind] = {"connections": len(outs), "closed_by_server": len(times), "answers": dict(answered),
                        "closed_after_p50_s": round(pct(times, 0.5), 2) if times else None,
                        "closed_after_max_s": round(max(times), 2) if times else None}
        if len(times) < len(outs):
            problems.add(f"{len(outs) - len(times)} of {len(outs)} '{kind}' connections still open after {window} s")
    if after["running"] or after["queue"] or after.get("reserved"):
        problems.add(f"after the attack /metrics shows {after}")
    if after["ordinary_request"] != 200:
        problems.add(f"an ordinary request after the attack got {after['ordinary_request']}")
    return {"capacity": batch + waiting, "slow_connections": sum(len(o) for o in results.values()),
            "timeout_s": timeout or "server default", "ordinary_requests": requests,
            "ordinary_statuses": dict(statuses), "ordinary_latency_p50_ms": ms(pct(latencies, 0.5)),
            "ordinary_latency_max_ms": ms(max(latencies, default=None)), "during": during, "closed": closed,
            "after": after, "problems": problems, "problem_count": problems.count}


# -- oversized work -------------------------------------------------------------------------------------------


async def _timed_with_health(base: str, path: str, body: dict[str, Any]) -> tuple[httpx.Response, float, list[float]]:
    """POST `body` while /health is polled every 10 ms on another connection: the response, its time, and the
    latency of each /health answer that came while it ran."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as client, \
            httpx.AsyncClient(base_url=base, timeout=600) as prober:
        await prober.get("/health")
        health: list[float] = []
        done = asyncio.Event()

        async def probe() -> None:
            while not done.is_set():
                t = time.perf_counter()
                await prober.get("/health")
                if not done.is_set():
                    health.append(time.perf_counter() - t)
                await asyncio.sleep(0.01)

        probing = asyncio.ensure_future(probe())
        t0 = time.perf_counter()
        r = await client.post(path, json=body)
        elapsed = time.perf_counter() - t0
        done.set()
        await probing
    return r, elapsed, health


def _stop_strings(length: int) -> list[str]:
    """16 stop strings of `length` characters that greedy output will not contain (they alternate two characters
    and end in a third)."""
    return [("ab" * length)[: length - 1] + PRINTABLE[i] for i in range(16)]


def oversized(base: str, pid: int, new_tokens: int, batch: int) -> dict[str, Any]:
    """The largest work one request may ask for. /tokenize: the longest input the server accepts (a body's worth,
    or its --max-tokenize-chars), its time, the answer's size, the server's RSS before and after and its peak, and
    /health's latency meanwhile. Stop strings: a greedy request of `new_tokens` tokens with 16 stop strings of the
    longest length the server accepts (from 4096 characters, halved while it answers 422) against the same request
    without them; then `batch` such requests at once, half with the stop strings, against `batch` without."""
    problems = Problems()

    def text(chars: int) -> str:
        line = "To be, or not to be: that is the question. "  # nothing JSON escapes: a character is a byte
        return (line * (chars // len(line) + 1))[:chars]

    rss_before, peak_before = rss_kib(pid), rss_kib(pid, "VmHWM")
    chars = 2 * MB - 64  # a body's worth (--max-body-bytes 2 MiB on the main server)
    r, elapsed, health = asyncio.run(_timed_with_health(base, "/tokenize", {"inputs": text(chars)}))
    over = None
    if r.status_code == 422 and (m := re.search(r"at most (\d+) characters", r.text)):
        over = {"chars": chars, "status": r.status_code, "seconds": round(elapsed, 3), "answer_bytes": len(r.content)}
        chars = int(m.group(1))
        r, elapsed, health = asyncio.run(_timed_with_health(base, "/tokenize", {"inputs": text(chars)}))
    if r.status_code != 200 or len(r.json()) != chars:
        problems.add(f"the largest /tokenize ({chars} characters) got {r.status_code}: {r.text[:200]}")
    tokenize = {"chars": chars, "status": r.status_code, "seconds": round(elapsed, 3),
                "answer_mb": round(len(r.content) / MB, 2), "rss_before_mb": round(rss_before / 1024),
                "rss_after_mb": round(rss_kib(pid) / 1024), "peak_rss_before_mb": round(peak_before / 1024),
                "peak_rss_after_mb": round(rss_kib(pid, "VmHWM") / 1024), "health_answers_during": len(health),
                "health_latency_p50_ms": ms(pct(health, 0.5)), "health_latency_max_ms": ms(max(health, default=None)),
                "over_the_limit": over}
    if not health and elapsed > 0.1:  # polled every 10 ms: the event loop was held for the whole request
        problems.add(f"/health did not answer during a {elapsed:.2f} s /tokenize")

    def request(stops: list[str]) -> dict[str, Any]:
        return {"inputs": "ROMEO:", "parameters": {"max_new_tokens": new_tokens, "details": True, "stop": stops}}

    length = 4096
    while length > 1:
        r = httpx.post(f"{base}/generate", json=request(_stop_strings(length)), timeout=600)
        if r.status_code != 422:
            break
        length //= 2

    async def run(bodies: list[dict[str, Any]]) -> tuple[float, list[float]]:
        async with httpx.AsyncClient(base_url=base, timeout=600,
                                     limits=httpx.Limits(max_connections=len(bodies))) as client:
            async def one(b: dict[str, Any]) -> float:
                t = time.perf_counter()
                r = await client.post("/generate", json=b)
                if r.status_code != 200 or r.json()["details"]["finish_reason"] != "length":
                    problems.add(f"a stop-string request got {r.status_code}: {r.text[:200]}")
                return time.perf_counter() - t

            t0 = time.perf_counter()
            times = await asyncio.gather(*(one(b) for b in bodies))
            return time.perf_counter() - t0, list(times)

    alone = {label: statistics.median(asyncio.run(run([request(stops)]))[0] for _ in range(3))
             for label, stops in (("without", []), ("with", _stop_strings(length)))}
    plain_wall, _ = asyncio.run(run([request([])] * batch))
    mixed_wall, mixed_times = asyncio.run(run([request([])] * (batch // 2) + [request(_stop_strings(length))]
                                              * (batch - batch // 2)))
    stops = {"stop_strings": 16, "stop_length": length, "new_tokens": new_tokens,
             "alone_without_s": round(alone["without"], 3), "alone_with_s": round(alone["with"], 3),
             "alone_ratio": round(alone["with"] / alone["without"], 2), "batch": batch,
             "batch_plain_tokens_per_s": round(batch * new_tokens / plain_wall, 1),
             "batch_half_with_stops_tokens_per_s": round(batch * new_tokens / mixed_wall, 1),
             "batch_throughput_ratio": round(plain_wall / mixed_wall, 3),
             "plain_requests_in_the_mixed_batch_max_s": round(max(mixed_times[: batch // 2]), 3),
             "plain_batch_s": round(plain_wall, 3)}
    return {"tokenize": tokenize, "stop_strings": stops, "problems": problems, "problem_count": problems.count}


# -- the whole suite ------------------------------------------------------------------------------------------

SECTIONS = ("fuzz", "bad_inputs", "load", "overload", "disconnects", "shutdown", "faults", "checkpoints", "training",
            "slow_clients", "oversized")


def run_all(sizes: Sizes, workdir: Path, seed: int, only: tuple[str, ...] = SECTIONS,
            report: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, dict[str, Any]]:
    ck = make_char_checkpoint(workdir / "tiny-char")
    results: dict[str, dict[str, Any]] = {}

    def timed(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        if name not in only:
            return
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as e:  # a crashed section is a failed one; the others still run
            out = {"problems": [f"the section crashed: {type(e).__name__}: {e}"], "problem_count": 1}
        out["seconds"] = round(time.perf_counter() - t0, 1)
        out["problems"] = list(out["problems"])
        results[name] = out
        if report:
            report(name, out)

    needs_main = {"fuzz", "bad_inputs", "load", "disconnects", "faults", "oversized"} & set(only)
    with contextlib.ExitStack() as stack:
        if needs_main:
            base, proc = stack.enter_context(serve(ck, workdir / "main.log", *MAIN_ARGS))
            # first: its memory figures are of a server that has done nothing else
            timed("oversized", lambda: oversized(base, proc.pid, sizes.stop_new_tokens, sizes.stop_batch))
            timed("fuzz", lambda: fuzz(base, sizes.fuzz_examples, seed))
            timed("bad_inputs", lambda: bad_inputs(base))
            timed("load", lambda: load(base, proc.pid, sizes.load_requests, sizes.load_clients, sizes.load_warmup,
                                       seed))
            timed("disconnects", lambda: disconnects(base, sizes.disconnect_streams, sizes.disconnect_wave, seed))
            timed("faults", lambda: faults(ck, workdir, base, sizes.fault_good, sizes.fault_bad, seed))
    timed("overload", lambda: overload(ck, workdir, sizes.overload_batch, sizes.overload_waiting,
                                       sizes.overload_factor, sizes.overload_new_tokens, sizes.overload_rounds))
    timed("shutdown", lambda: shutdown(ck, workdir, sizes.shutdown_streams, sizes.drain_timeout, seed))
    timed("slow_clients", lambda: slow_clients(ck, workdir, sizes.slow_batch, sizes.slow_waiting,
                                               sizes.slow_connections, sizes.slow_requests, sizes.slow_timeout))
    timed("checkpoints", lambda: checkpoints(ck, workdir))
    timed("training", lambda: training(workdir, sizes.training_kills, sizes.training_iters, seed))
    return results


HEADLINES = {
    "fuzz": lambda r: f"{r['requests']} requests, {r['server_errors']} 5xx, statuses {r['by_status']}",
    "bad_inputs": lambda r: f"{r['cases']} cases x {r['routes']} routes = {r['requests']} requests, "
                            f"{r['server_errors']} 5xx",
    "load": lambda r: f"{r['completed']}/{r['requests']} complete, {r['clients']} clients, {r['rejected_429']} "
                      f"429s retried, {r['tokens_per_s']} tok/s, RSS {r['rss_growth']:+.1%}",
    "overload": lambda r: f"{r['burst']} at once on capacity {r['capacity']}: 429 p50 "
                          f"{r['rejected_latency_p50_ms']} ms, max {r['rejected_latency_max_ms']} ms, throughput "
                          f"x{r['throughput_ratio']}",
    "disconnects": lambda r: f"{r['streams']} cut, slots freed within {r['slots_freed_max_ms']} ms",
    "shutdown": lambda r: f"{r['streams']} streams {r['ended']}, exit {r['exit_code']} after "
                          f"{r['exit_after_s']} s, admitted after signal {r['admitted_after_signal']}",
    "faults": lambda r: f"{r['faulty_failed_alone']}/{r['faulty']} faulty failed alone, "
                        f"{r['good_matching_reference']}/{r['good']} good intact",
    "checkpoints": lambda r: f"{r['refused']}/{len(r['cases'])} refused with exit code 2",
    "slow_clients": lambda r: f"{r['slow_connections']} slow connections on capacity {r['capacity']}: ordinary "
                              f"requests {r['ordinary_statuses']}, p50 {r['ordinary_latency_p50_ms']} ms; half bodies "
                              f"closed {r['closed']['half body']['closed_by_server']}/"
                              f"{r['closed']['half body']['connections']}",
    "oversized": lambda r: f"/tokenize {r['tokenize']['chars']} chars {r['tokenize']['seconds']} s, /health max "
                           f"{r['tokenize']['health_latency_max_ms']} ms, peak RSS "
                           f"{r['tokenize']['peak_rss_after_mb']} MB; 16 stops x{r['stop_strings']['alone_ratio']} "
                           f"alone, batch x{r['stop_strings']['batch_throughput_ratio']}",
    "training": lambda r: f"{r['kills']} SIGKILLs, final val loss {r.get('val_loss')} vs "
                          f"{r.get('reference_val_loss')}, bitwise {r.get('final_weights_bitwise_equal')}",
}


def summary_line(name: str, r: dict[str, Any]) -> str:
    try:
        headline = HEADLINES[name](r)
    except (KeyError, TypeError, ValueError):  # a section that crashed has no figures
        headline = "-"
    verdict = "ok" if not r["problems"] else f"{r['problem_count']} PROBLEMS"
    return f"{name:<12} {verdict:<12} {r.get('seconds', 0):>7.1f} s  {headline}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the reduced sizes the CI test uses")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, checkpoints)")
    for f in dataclasses.fields(Sizes):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(FULL, f.name)), default=None)
    args = p.parse_args()
    only = tuple(s for s in args.only.split(",") if s)
    unknown = set(only) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}")
    sizes = QUICK if args.quick else FULL
    sizes = dataclasses.replace(sizes, **{f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)
                                          if getattr(args, f.name) is not None})
    workdir = Path(tempfile.mkdtemp(prefix="folio-reliability-"))
    print(f"work directory {workdir}", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        results = run_all(sizes, workdir, args.seed, only,
                          report=lambda name, r: print(summary_line(name, r), flush=True))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "sizes": dataclasses.asdict(sizes), "seed": args.seed, "seconds": round(time.perf_counter() - t0, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_average": os.getloadavg()},
        "ok": all(not r["problems"] for r in results.values()), "sections": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\n{'section':<12} {'verdict':<12} {'time':>9}  figures")
    for name, r in results.items():
        print(summary_line(name, r))
    print(f"\nwrote {args.out} ({report['seconds']} s)")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
