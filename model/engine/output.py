"""The output processor (vLLM v1's `OutputProcessor`): what a step's logits become for each request. It chooses
the next tokens (one `Sampler` pass for all rows, the constrained ones under their grammar's mask, computed for
all of them at once), advances each constrained row's matcher, checks stopping, captures streamed attention,
scores prompts, counts tokens, verifies a speculating request's drafted tokens (`verify`), and makes the events:
a `TokenEvent` per token, the last carrying the `Finished` that ends the generation (model/engine/events.py).

It decides nothing about slots, rows or queues (model/engine/scheduler.py): it hands each request's event back,
and the scheduler lets a request that ended leave the batch before its event goes out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from model.engine.attention import TokenAttention, watch
from model.engine.events import EngineError, EngineStats, Finished, GenerationError, TokenEvent, TopToken
from model.engine.request import Request
from model.engine.runner import ModelRunner
from model.sampler import Sampler, SamplerOutput, new_generator
from model.scoring import PromptScorer
from model.stopping import CONSTRAINT_DONE, StoppingCriteria
from model.structured.matcher import ConstraintViolation, RowMatcher, allowed_tokens
from model.tokenizer import Tokenizer

log = logging.getLogger("folio.engine")


class OutputProcessor:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, stats: EngineStats) -> None:
        self.runner, self.tokenizer, self.stats = runner, tokenizer, stats
        self.eos_id = tokenizer.eos_id
        self.sampler = Sampler(tokenizer.n_vocab, tokenizer.eos_id)

    def begin(self, req: Request) -> None:
        """`req`'s sampling, stopping and prompt-scoring state, before its first prefill chunk."""
        req.generator = None if req.params.is_greedy else new_generator(req.seed)
        req.matcher = None if req.params.constraint is None else RowMatcher(req.params.constraint)
        if req.params.prompt_logprobs is not None:
            req.scorer = PromptScorer(req.prompt, req.params.prompt_logprobs, self.tokenizer.n_vocab, self._describe)
        req.stopping = StoppingCriteria(self.tokenizer, max_new_tokens=req.params.max_new_tokens, eos_id=self.eos_id,
                                        stop=req.params.stop, stop_at_eos=req.params.stop_at_eos,
                                        min_tokens=req.params.min_tokens)

    def score_prompts(self, plan: list[tuple[Request, int]], logits: torch.Tensor) -> torch.Tensor:
        """Every position's logits of a prefill forward, (len(plan), width, vocab), to the scorers of the requests
        that score their prompt; each chunk's last logits, (len(plan), vocab)."""
        for i, (req, n) in enumerate(plan):
            if req.scorer is not None:
                req.scorer.add(req.prefilled, logits[i, :n])
        return logits[torch.arange(len(plan)), torch.tensor([n - 1 for _, n in plan])]

    def process(self, reqs: list[Request], logits: torch.Tensor, chosen: Callable[[torch.Tensor], None] | None = None,
                ) -> list[tuple[Request, TokenEvent | Finished | EngineError]]:
        """Choose every row's next token in one sampler pass: each request's `TokenEvent` (its `finished` set when
        it should stop), or the error it failed with alone, or its end without a token (its constraint, satisfied,
        allows only an end of text, which this vocabulary lacks: a regex only the empty output matches). `chosen`,
        where given, is called with the tokens (on the device, a row's -1 not yet known) once they are chosen and
        before anything waits for them or looks at them: the scheduler launches the next step's forward there
        (running ahead)."""
        allowed, stuck = self._masks(reqs, logits.size(-1))
        choice = self.sampler.choose(logits, [req.sample_row(allowed.get(i)) for i, req in enumerate(reqs)])
        if chosen is not None:
            chosen(choice.tokens)
        out = choice.result()
        attention = watch(self.runner.model, self.runner.cache, reqs)
        events: list[tuple[Request, TokenEvent | Finished | EngineError]] = []
        for i, req in enumerate(reqs):
            try:
                if i in stuck:
                    assert req.matcher is not None
                    if req.matcher.satisfied:  # it asks only for the end (no EOS in this vocabulary): it ends here
                        events.append((req, self.finished(req, CONSTRAINT_DONE)))
                        continue
                    raise ConstraintViolation("the constraint allows no token of this model's vocabulary here")
                if i in out.errors:
                    raise out.errors[i]
                if isinstance(seen := attention.get(req.id), Exception):
                    raise seen
                events.append((req, self._token(req, out, i, seen)))
            except Exception as e:
                req.warn(log, "request %d failed choosing a token: %s", req.id, e)
                events.append((req, GenerationError(f"generation failed: {e}")))
        return events

    def verify(self, req: Request, logits: torch.Tensor, draft: list[int]) -> tuple[list[TokenEvent], int,
                                                                                   EngineError | None]:
        """Speculative decoding: `req`'s `draft` verified from `logits`, (len(draft) + 1, vocab), the model's after
        its tokens and each draft prefix (`Sampler.verify`). The events of the tokens it takes (the accepted drafted
        ones, then the model's own), up to the one that ends its generation; how many drafted tokens were accepted;
        the error it failed with, after those events, if any."""
        rows = [req.sample_row(ahead=draft[:i]) for i in range(len(draft) + 1)]
        out = self.sampler.verify(logits, rows, draft)
        accepted = 0
        while accepted < min(len(draft), len(out.tokens)) and out.tokens[accepted] == draft[accepted]:
            accepted += 1
        self.stats.spec_decode_num_drafts_total += 1
        self.stats.spec_decode_num_draft_tokens_total += len(draft)
        self.stats.spec_decode_num_accepted_tokens_total += accepted
        events: list[TokenEvent] = []
        try:
            for i in range(len(out.tokens)):
                if i in out.errors:
                    raise out.errors[i]
                events.append(self._token(req, out, i, None))
                if events[-1].finished is not None:
                    break
        except Exception as e:
            req.warn(log, "request %d failed choosing a token: %s", req.id, e)
            return events, accepted, GenerationError(f"generation failed: {e}")
        return events, accepted, None

    def _masks(self, reqs: list[Request], width: int) -> tuple[dict[int, torch.Tensor], set[int]]:
        """The ids each constrained row may choose next, by row; the rows whose constraint allows none."""
        rows = [i for i, req in enumerate(reqs) if req.matcher is not None]
        if not rows:
            return {}, set()
        masks = allowed_tokens([reqs[i].matcher for i in rows], width)
        some = masks[:, : self.tokenizer.n_vocab].any(dim=1).tolist()
        return dict(zip(rows, masks)), {i for i, ok in zip(rows, some) if not ok}

    def _token(self, req: Request, out: SamplerOutput, i: int, attention: TokenAttention | None) -> TokenEvent:
        token = out.tokens[i]
        complete = False
        if req.matcher is not None:
            req.matcher.advance(token)
            if token != self.eos_id and req.matcher.stuck:
                raise ConstraintViolation("the constraint allows no token of this model's vocabulary after "
                                          f"{self.tokenizer.decode(req.output + [token])[-40:]!r}")
            complete = req.matcher.done
        top = tuple(self._describe(t, lp) for t, lp in out.top[i])
        req.output.append(token)
        req.context.append(token)
        req.pos += 1
        self.stats.generated_tokens_total += 1
        assert req.stopping is not None
        check = req.stopping(token, complete=complete)
        req.text.append(check.text)
        finished = None if check.reason is None else self.finished(req, check.reason, check.stop_sequence)
        scores = req.prompt_scores() if len(req.output) == 1 else None
        return TokenEvent(token, check.text, out.logprobs[i], self._special(token), len(req.output), top, finished,
                          prompt_logprobs=scores, attention=attention)

    def finished(self, req: Request, reason: str, stop_sequence: str | None = None) -> Finished:
        """The end of `req`'s generation: on its last token's event, or its only event if it generated none."""
        return Finished(
            finish_reason=reason, generated_text="".join(req.text), generated_tokens=len(req.output), seed=req.seed,
            prompt_tokens=len(req.prompt), prefill=tuple(req.prompt), stop_sequence=stop_sequence,
            window_slides=req.slides, truncated_prompt_tokens=req.truncated,
            prompt_logprobs=None if req.output else req.prompt_scores(),  # else the first token carried them
        )

    def _describe(self, token: int, logprob: float = 0.0) -> TopToken:
        return TopToken(token, self.tokenizer.decode([token]), logprob, self._special(token))

    def _special(self, token: int) -> bool:
        return self.eos_id is not None and token == self.eos_id
