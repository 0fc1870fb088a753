"""OpenAI completions' answers: the engine's results and events written as a completion's JSON and its stream's
chunks: a choice's `logprobs` block (prompt tokens first when echoed: the first has no context, so its logprob and
alternatives are null, as OpenAI and vLLM write them), the `n` best of `best_of`, usage. The route (router.py beside
it) submits."""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from app.api.openai.completions.protocol import CompletionRequest
from app.api.openai.protocol import finish_reason, usage
from app.http.errors import exception_body
from app.http.requestlog import RequestRecord
from app.http.sse import sse
from app.serving.samples import ranked
from app.serving.service import GenerationService, cancel_all
from model.engine import Finished, GenerationStream, Result, TokenEvent
from model.scoring import PromptToken


@dataclass
class Scored:
    """A token as the logprobs block shows it: generated (a `TokenEvent`) or echoed (a `PromptToken`)."""

    id: int
    logprob: float | None
    top: list[tuple[int, float]] | None  # the alternatives' ids and logprobs

    @classmethod
    def of(cls, t: TokenEvent | PromptToken) -> Scored:
        if isinstance(t, PromptToken) and t.logprob is None:
            return cls(t.id, None, None)
        return cls(t.id, t.logprob, [(a.id, a.logprob) for a in t.top_tokens])


def token_string(raw: bytes) -> str:
    """A token as OpenAI's logprobs name it: its text, or where its bytes are no whole UTF-8 characters on their own
    (a byte-level BPE token inside a character), `bytes:\\xe2\\x80` as OpenAI writes those."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Where each of a choice's tokens starts in its text (`text_offset`), token after token, from `start`
    characters: a token inside a character starts where that character does, as the stream's text has it."""

    def __init__(self, start: int = 0) -> None:
        self.offset = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, raw: bytes) -> int:
        """The offset of the token of bytes `raw`, the one after the last."""
        start = self.offset
        self.offset += len(self._decoder.decode(raw))
        return start


def logprobs_block(tokens: Sequence[Scored], bytes_of: Callable[[int], bytes], offsets: TextOffsets) -> dict[str, Any]:
    """`{tokens, token_logprobs, top_logprobs, text_offset}`, the offsets counted on by `offsets`."""
    raws = [bytes_of(t.id) for t in tokens]
    return {"tokens": [token_string(raw) for raw in raws], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [None if t.top is None else {token_string(bytes_of(i)): lp for i, lp in t.top}
                             for t in tokens],
            "text_offset": [offsets.next(raw) for raw in raws]}


def choice_logprobs(result: Result, echoed: bool, bytes_of: Callable[[int], bytes]) -> dict[str, Any]:
    """A whole choice's logprobs: the prompt's tokens (if echoed), then the generated ones."""
    prompt = [Scored.of(t) for t in result.prompt_logprobs or ()] if echoed else []
    return logprobs_block(prompt + [Scored.of(t) for t in result.tokens], bytes_of, TextOffsets())


def best(results: list[Result], n: int) -> list[Result]:
    """OpenAI's choices: the n best (`ranked`), or all of them in their order when there are only n."""
    return results if len(results) == n else ranked(results)[:n]


async def complete(request: Request, service: GenerationService, body: CompletionRequest,
                    streams: list[list[GenerationStream]], echoes: list[str], cid: str, created: int,
                    ) -> dict[str, Any]:
    results = await service.results(request, [s for group in streams for s in group])
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for k, echo in enumerate(echoes):
        mine = results[k * len(streams[0]):(k + 1) * len(streams[0])]
        prompt_tokens += mine[0].finished.prompt_tokens
        completion_tokens += sum(r.finished.generated_tokens for r in mine)
        for result in best(mine, body.n):
            lp = choice_logprobs(result, body.echo, service.token_bytes) if body.logprobs is not None else None
            choices.append({"text": echo + result.text, "index": len(choices), "logprobs": lp,
                            "finish_reason": finish_reason(result.finished)})
    return {"id": cid, "object": "text_completion", "created": created, "model": service.model_id,
            "system_fingerprint": service.fingerprint, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


def _prompt_scores(ev: TokenEvent | Finished) -> list[Scored] | None:
    scores = ev.prompt_logprobs
    return None if scores is None else [Scored.of(t) for t in scores]


@dataclass
class ChunkWriter:
    """The server-sent chunks of one streamed completion."""

    cid: str
    created: int
    model: str
    include_usage: bool
    fingerprint: str

    def chunk(self, index: int, text: str, finish: str | None, lp: dict[str, Any] | None = None) -> bytes:
        out = {"id": self.cid, "object": "text_completion", "created": self.created, "model": self.model,
               "system_fingerprint": self.fingerprint,
               "choices": [{"text": text, "index": index, "logprobs": lp, "finish_reason": finish}]}
        if self.include_usage:
            out["usage"] = None
        return sse(out)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return sse({"id": self.cid, "object": "text_completion", "created": self.created, "model": self.model,
                    "choices": [], "usage": usage(prompt_tokens, completion_tokens)})


async def stream_choices(service: GenerationService, streams: list[list[GenerationStream]], echoes: list[str],
                  chunks: ChunkWriter, logprobs: bool, record: RequestRecord | None) -> AsyncIterator[bytes]:
    """Every choice's tokens as they come, interleaved (each chunk names its `index`), then the usage if asked."""
    flat = [s for group in streams for s in group]
    per_prompt = len(streams[0])
    offsets = [TextOffsets(len(echoes[i // per_prompt])) for i in range(len(flat))]  # each choice's, after its echo
    prompt_tokens = sum(group[0].prompt_tokens for group in streams)
    completion_tokens = 0
    echoed = [False] * len(flat)
    items = service.interleaved(flat, record)
    try:
        async for item in items:
            if isinstance(item, Exception):
                yield sse(exception_body("/v1/completions", item)[1])
                break
            index, batch = item
            out = []
            if not echoed[index]:  # the echo goes first, with the prompt's logprobs (they come with the first event)
                echoed[index] = True
                if echoes[index // per_prompt]:
                    scored = _prompt_scores(batch[0]) if logprobs else None
                    lp = logprobs_block(scored, service.token_bytes, TextOffsets()) if scored is not None else None
                    out.append(chunks.chunk(index, echoes[index // per_prompt], None, lp))
            for ev in batch:
                if isinstance(ev, Finished):  # max_tokens 0: the echo was all, and the end is the only event
                    out.append(chunks.chunk(index, "", finish_reason(ev)))
                    break
                finish = finish_reason(ev.finished) if ev.finished else None
                if ev.text or finish or logprobs:
                    lp = logprobs_block([Scored.of(ev)], service.token_bytes, offsets[index]) if logprobs else None
                    out.append(chunks.chunk(index, ev.text, finish, lp))
                completion_tokens += 1
            if out:
                yield b"".join(out)
        else:
            if chunks.include_usage:
                yield chunks.usage(prompt_tokens, completion_tokens)
        yield sse("[DONE]")
    finally:
        await items.aclose()  # its readers stop
        cancel_all(flat)
