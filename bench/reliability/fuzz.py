"""Section `fuzz`: every operation of /openapi.json, positive and negative cases from schemathesis, each response
checked by schemathesis (no 5xx, documented status, documented content type, response schema) and by
`check_response` (the error body of its API family, SSE framing and event shapes)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from bench.reliability.harness import BLOCK_SIZE, PRINTABLE, Problems, documented_statuses
from bench.reliability.shapes import check_response


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


def _checks() -> list[Callable[..., Any]]:
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    return [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
            negative_data_rejection]


class _Fuzzer:
    """Runs schemathesis' cases against one server and tallies statuses, failures and problems."""

    def __init__(self, base: str, examples: int, seed: int) -> None:
        self.base, self.examples, self.seed = base, examples, seed
        self.checks = _checks()
        self.documented = documented_statuses(base)
        self.problems = Problems()
        self.statuses: Counter[int] = Counter()
        self.failures: Counter[str] = Counter()

    def test(self, op: Any, mode: Any, counts: Counter[str]) -> Callable[[], None]:
        """A hypothesis test of `examples` cases of `op` in `mode`, counting its requests into `counts`."""
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as hypothesis_seed
        from schemathesis import GenerationMode

        @hypothesis_seed(self.seed)
        @settings(max_examples=self.examples, database=None, deadline=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case: Any) -> None:
            if mode == GenerationMode.POSITIVE and counts["requests"] % 2:
                _to_printable(case)
            response = case.call(base_url=self.base, timeout=120)
            counts["requests"] += 1
            self.statuses[response.status_code] += 1
            self.check(op, mode, case, response)

        return run

    def check(self, op: Any, mode: Any, case: Any, response: Any) -> None:
        """schemathesis' checks, then: no 424 (nothing was made to fail), then `check_response`."""
        try:
            case.validate_response(response, checks=self.checks)
        except (AssertionError, BaseExceptionGroup) as e:
            for failure in (e.exceptions if isinstance(e, BaseExceptionGroup) else [e]):
                title = getattr(failure, "title", type(failure).__name__)
                self.failures[f"{op.label}: {title}"] += 1
                self.problems.add(f"{op.label} ({mode.value}) -> {response.status_code}: {title}: "
                                  f"{str(failure)[:300]} body sent: {str(case.body)[:200]}")
        # 424 is documented, but with no fault injected it is a generation that failed (a stream says so in
        # its final event)
        if response.status_code == 424 or (response.status_code == 200 and (
                b'"error_type":"generation"' in response.content or b'"type":"server_error"' in response.content)):
            self.failures[f"{op.label}: 424"] += 1
            self.problems.add(f"{op.label} ({mode.value}): generation failed for {str(case.body)[:300]}: "
                              f"{response.content[:300]!r}")
        body = case.body if isinstance(case.body, dict) else {}
        streamed = op.path == "/generate_stream" or (op.path in ("/", "/v1/completions")
                                                     and body.get("stream") is True)
        if not response.stream_cut_short:
            for p in check_response(op.path, streamed, response.status_code,
                                    (response.headers.get("content-type") or [""])[0], response.content,
                                    self.documented[(op.method.upper(), op.path)]):
                self.failures[f"{op.label}: shape"] += 1
                self.problems.add(p)


def run(base: str, examples: int, seed: int) -> dict[str, Any]:
    """Every operation of the OpenAPI schema, `examples` positive and `examples` negative cases each (an operation
    without inputs has no negative case; hypothesis also stops early once an operation's inputs are exhausted)."""
    import schemathesis
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    fuzzer = _Fuzzer(base, examples, seed)
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    per_operation: dict[str, dict[str, int]] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            counts: Counter[str] = Counter()
            try:
                fuzzer.test(op, mode, counts)()
            except Unsatisfiable:
                pass  # GET /health and friends take no input, so there is nothing to negate
            per_operation.setdefault(op.label, {})[mode.value] = counts["requests"]
    statuses = fuzzer.statuses
    return fuzzer.problems.figures(
        requests=sum(statuses.values()), by_status=dict(sorted(statuses.items())),
        server_errors=sum(n for s, n in statuses.items() if s >= 500), per_operation=per_operation,
        failures=dict(fuzzer.failures))
