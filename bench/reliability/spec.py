"""One generation request as data (`Spec`: route, prompt, token budget, parameters and stop strings, in both API
families), and `random_spec`: a random mix of them, as the load, disconnect and fault sections send."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from bench.reliability.harness import BLOCK_SIZE, PRINTABLE

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



def _openai_params(rng: random.Random, sample: bool, streamed: bool) -> dict[str, Any]:
    params: dict[str, Any] = {"temperature": round(rng.uniform(0.3, 1.5), 2) if sample else 0}
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
    if streamed:
        params["stream_options"] = {"include_usage": True}
    return params


def _tgi_params(rng: random.Random, sample: bool, long_prompt: bool) -> dict[str, Any]:
    params: dict[str, Any] = {}
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
    return params


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
    sample = rng.random() < 0.6
    if openai:
        params = _openai_params(rng, sample, route.endswith("stream"))
    else:
        params = _tgi_params(rng, sample, long_prompt)
    stop = ["".join(rng.choices(stop_chars, k=rng.choice((1, 1, 2)))) for _ in range(rng.randint(1, 3))] \
        if rng.random() < 0.25 else []
    if not openai and (stop or rng.random() < 0.7):
        params["details"] = True  # without details a stopped request's token count is not on the wire
    return Spec(route, prompt, n, params, stop)
