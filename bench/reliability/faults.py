"""Section `faults`: with `--fault-injection` (a testing aid, app/faults.py), requests that raise inside the model
step among good ones: the faulty fail alone (424 or a final error event), the good match their reference; without
the flag the same prompts generate normally."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import httpx

from app.faults import DECODE_AFTER, FAULT_DECODE, FAULT_PREFILL
from app.testing import metric, serving
from bench.reliability.harness import MAIN_ARGS, PRINTABLE, Problems, scrape
from bench.reliability.outcome import Outcome, send
from bench.reliability.spec import ROUTES, Spec


def _goods(rng: random.Random, n: int) -> list[Spec]:
    """Greedy requests on every route in turn."""
    return [Spec(ROUTES[i % len(ROUTES)], "".join(rng.choices(PRINTABLE, k=rng.randint(4, 30))),
                 rng.randint(8, 40), {"temperature": 0} if ROUTES[i % len(ROUTES)].startswith("completions")
                 else {"details": True}) for i in range(n)]


def _bads(n: int) -> list[Spec]:
    """Requests whose prompt holds a fault marker: both families and both phases within the first four, then
    every other route and phase."""
    first = [("generate", FAULT_DECODE), ("completions_stream", FAULT_DECODE), ("generate_stream", FAULT_PREFILL),
             ("completions", FAULT_PREFILL)]
    combos = first + [(r, m) for m in (FAULT_DECODE, FAULT_PREFILL) for r in ROUTES if (r, m) not in first]
    return [Spec(route, f"Hi {marker} there", DECODE_AFTER + 8,
                 {"temperature": 0} if route.startswith("completions") else {"details": True})
            for route, marker in (combos[i % len(combos)] for i in range(n))]


async def _send_all(base: str, specs: list[Spec]) -> list[Outcome]:
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=httpx.Limits(max_connections=len(specs))) as c:
        return await asyncio.gather(*(send(c, s) for s in specs))


def _check_good(spec: Spec, out: Outcome, ref: Outcome, problems: Problems) -> bool:
    for p in out.problems:
        problems.add(f"good request: {p}")
    if out.status != 200 or out.error or out.text != ref.text:
        problems.add(f"good request {spec.route} {spec.prompt!r}: {out.status} {out.error} {out.text!r}, "
                     f"reference {ref.text!r}")
        return False
    return True


def _check_bad(spec: Spec, out: Outcome, problems: Problems) -> bool:
    """A faulty request fails alone: 424 (a stream: a final error event, after the tokens made before the fault)."""
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
        return True
    return False


def run(checkpoint: Path, workdir: Path, base_off: str, good: int, bad: int, seed: int) -> dict[str, Any]:
    """On a server started with --fault-injection: `bad` requests whose prompt holds a fault marker (prefill and
    decode, whole and streamed, both families) run at once with `good` greedy requests. On `base_off` (started
    without the flag) the same prompts generate normally."""
    rng = random.Random(seed)
    problems = Problems()
    goods, bads = _goods(rng, good), _bads(bad)
    reference = asyncio.run(_send_all(base_off, goods))
    markers_off = asyncio.run(_send_all(base_off, bads))
    for out in markers_off:
        if out.status != 200 or out.error or out.problems:
            problems.add(f"without --fault-injection the marker prompt failed: {out}")
    with serving(checkpoint, workdir / "faults.log", *MAIN_ARGS, "--fault-injection") as (base, _):
        failed_before = metric(scrape(base), "folio_failed_requests_total")
        mixed = goods + bads
        order = list(range(len(mixed)))
        rng.shuffle(order)
        results = asyncio.run(_send_all(base, [mixed[i] for i in order]))
        outcome = {i: results[k] for k, i in enumerate(order)}
        failed = metric(scrape(base), "folio_failed_requests_total") - failed_before
        after = httpx.post(f"{base}/generate", json={"inputs": goods[0].prompt,
                                                      "parameters": {"max_new_tokens": 8}}, timeout=60)
    good_ok = sum(_check_good(spec, outcome[i], reference[i], problems) for i, spec in enumerate(goods))
    bad_ok = sum(_check_bad(spec, outcome[good + j], problems) for j, spec in enumerate(bads))
    if failed != bad:
        problems.add(f"folio_failed_requests_total rose by {failed}, {bad} requests were made to fail")
    if after.status_code != 200:
        problems.add(f"after the faults: {after.status_code} {after.text[:200]}")
    return problems.figures(good=good, good_matching_reference=good_ok, faulty=bad, faulty_failed_alone=bad_ok,
                            failed_requests_metric=int(failed), markers_without_flag_generate=all(
                                o.status == 200 and not o.error for o in markers_off))
