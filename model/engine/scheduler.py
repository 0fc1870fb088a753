"""The scheduler: the queues a request passes through (waiting, then a slot in the `Batch`: prefilling, running),
the capacity rule, and the engine thread's loop that admits, prefills and decodes. What the logits of a step become
(tokens, stops, events) is the output processor's (model/engine/output.py).

One iteration of the loop:
1. drop cancelled requests (their slot is free before the next model step);
2. admit waiting requests into free batch slots (FIFO), up to `max_batch_size`;
3. prefill: the next chunk of the oldest admitted request, with the admitted requests whose chunks are
   closest to its length, up to `prefill_chunk` tokens in one forward (`prefill.plan_prefill`); a long prompt
   therefore takes several iterations, and running streams get a decode step between its chunks;
4. one decode step for every running request of the `Batch`: each row at its own position, with its own
   sampling parameters, generator and stopping criteria (the `OutputProcessor` chooses for all rows in one pass).
   With speculative decoding (`EngineConfig.speculative_model`), a request's drafted tokens (model/speculative/)
   are more rows of that forward, in its cache row at the positions after its last token, and the output processor
   verifies them (`OutputProcessor.verify`): the request takes the drafted tokens the model agrees with, then one of
   its own; the others advance by one token as without.
   With async scheduling (on by default on CUDA), the next decode step's forward is launched on this step's tokens
   as soon as they are chosen, before the host looks at them, and the next iteration takes its logits
   (model/engine/ahead.py): the host's work on a step overlaps the device's work on the next.

Sliding window: position embeddings cover `block_size` positions. When a row's next token would sit at
position `block_size`, the window slides: the row keeps its last `block_size - window_shift + 1` tokens,
re-prefilled at positions 0.., so the next `window_shift - 1` tokens decode from the cache before the next
slide. With `window_shift=1` every step past the window re-prefills the last `block_size` tokens, which is
exactly what nanoGPT's cropping `generate` does (and what the reference loop does). The result reports how
often the window slid.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model.devices import to_device
from model.engine import ahead
from model.engine.ahead import Ahead
from model.engine.batch import Batch
from model.engine.config import EngineConfig
from model.engine.events import EngineError, EngineStats, EngineStopped, Finished, GenerationError, Overloaded
from model.engine.jobs import Job
from model.engine.output import OutputProcessor
from model.engine.prefill import plan_prefill
from model.engine.prefix_cache import shares_prefix
from model.engine.request import Request
from model.engine.runner import ModelRunner
from model.speculative import Drafting, Proposer, Speculator, speculates
from model.tokenizer import Tokenizer

log = logging.getLogger("folio.engine")


@dataclass
class Ready:
    """A forward run ahead, done: its `logits`, and the row of them each running request takes, by request id."""

    logits: torch.Tensor
    index: dict[int, int]


class Scheduler:
    """Every request from its submission to its last event. `lock` guards the queues; the loop runs on the engine
    thread (`run`), submissions and cancellations come from any thread."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig,
                 proposer: Proposer | None = None) -> None:
        """`config` as resolved (`Engine.config`: its `window_shift` set); `proposer`: where speculative decoding's
        drafts come from (None: off)."""
        assert config.window_shift is not None
        self.runner = runner
        self.block_size = runner.block_size
        self.max_batch_size, self.max_waiting = config.max_batch_size, config.max_waiting
        self.prefill_chunk, self.window_shift = config.prefill_chunk, config.window_shift
        self.prefix_cache = config.prefix_cache
        self.speculator = None if proposer is None else Speculator(proposer, config.num_speculative_tokens)
        self.stats = EngineStats()
        self.output = OutputProcessor(runner, tokenizer, self.stats)
        self.batch = Batch(config.max_batch_size, prefix_cache=config.prefix_cache)
        self.waiting: deque[Request] = deque()
        self.jobs: deque[Job] = deque()  # model work besides generation, a step per loop iteration
        self.reserved = 0  # slots held by `Engine.reserve` for requests not yet submitted
        self.lock = threading.Condition()
        self.stopping = False
        self.closing = False  # admits nothing new; what is in flight finishes (`Engine.drain`)
        self.step_started: float | None = None  # monotonic time the current loop iteration began; None when idle
        self.fault_hook: Callable[[list[Request]], None] | None = None  # test hook: fault injection
        self.flush: Callable[[], None] = lambda: None  # hands the events of a step to their event loops
        # running ahead (async scheduling: model/engine/ahead.py)
        self.async_scheduling = bool(config.async_scheduling)
        self.ahead: Ahead | None = None  # the forward run ahead, not yet taken

    # -- from any thread, under `lock` ------------------------------------------------------------------
    def in_flight(self) -> int:
        return len(self.batch) + len(self.waiting) + len(self.jobs)

    def refuse_if_full(self) -> None:
        # bound the total, not just the waiting queue: requests wait in `waiting` until the engine thread
        # admits them, so a burst (or an engine not yet started) must not grow the backlog past capacity;
        # reserved slots count as taken
        if self.in_flight() + self.reserved >= self.max_batch_size + self.max_waiting:
            self.stats.rejected_total += 1
            raise Overloaded(f"the server is at capacity ({self.max_batch_size} running, {self.max_waiting} waiting)")

    def enqueue(self, req: Request) -> None:
        self.waiting.append(req)
        self.stats.waiting = len(self.waiting)
        self.lock.notify_all()

    def cancel(self, req: Request | Job) -> None:
        if not req.cancelled and (req in self.waiting or req in self.batch or req in self.jobs):
            req.cancelled = True
            self.lock.notify_all()

    def add_job(self, job: Job) -> None:
        self.jobs.append(job)
        self.lock.notify_all()

    def fail_all(self, err: EngineError) -> None:
        failed = list(self.waiting) + self.batch.clear()
        for job in self.jobs:
            job.deliver(err)
        self.jobs.clear()
        self.waiting.clear()
        self.stats.waiting = 0
        self._count_running()
        for req in failed:
            req.sink(err)

    # -- the engine thread ----------------------------------------------------------------------------
    def run(self) -> None:
        torch.set_grad_enabled(False)
        self.runner.on_engine_thread()
        while True:
            ready = self._join_ahead()  # before anything else touches the cache
            with self.lock:
                self.step_started = None
                while not (self.stopping or self.in_flight()):
                    self.lock.wait()
                self.step_started = time.monotonic()
                if self.stopping:
                    self.fail_all(EngineStopped("the engine stopped before this request finished"))
                    self.flush()
                    self.runner.release()  # here, after the last step: nothing replays what it frees
                    return
                self._reap_cancelled()
                while self.waiting and len(self.batch) < self.max_batch_size:
                    self.batch.admit(self.waiting.popleft())
                self.stats.waiting = len(self.waiting)
                self._count_running()
            try:
                with torch.inference_mode():
                    if self.batch.prefilling:
                        self._prefill_step()
                        self.flush()  # first tokens go out now, not after the decode step
                    if self.batch.running:
                        with self.runner.decode_context():
                            self._decode_step(ready)
                    if self.jobs:
                        self._job_step()
            except Exception as e:  # a bug in the loop itself: fail what is in flight, keep serving
                log.exception("engine step failed")
                with self.lock:
                    for req in self.batch.running + self.batch.prefilling:
                        self._fail(req, GenerationError(f"generation failed: {e}"))
            self.flush()

    def _job_step(self) -> None:
        """One step of the oldest job; then it goes to the back of the queue (jobs take turns), or delivers."""
        job = self.jobs[0]
        try:
            next(job.steps)
            with self.lock:
                self.jobs.rotate(-1)
            return
        except StopIteration:
            outcome = job.result()
        except Exception as e:
            log.warning("job %d failed: %s", job.id, e)
            self.stats.failed_total += 1
            outcome = GenerationError(f"the job failed: {e}")
        with self.lock:
            self.jobs.remove(job)
        job.deliver(outcome)

    def _reap_cancelled(self) -> None:
        for job in [j for j in self.jobs if j.cancelled]:
            self.jobs.remove(job)
            self.stats.cancelled_total += 1
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            self.stats.cancelled_total += 1
        self.stats.cancelled_total += len(self.batch.filter(lambda r: r.cancelled))
        self._count_running()

    def _fail(self, req: Request, err: EngineError) -> None:
        self.stats.failed_total += 1
        self._leave(req)
        req.sink(err)

    def _leave(self, req: Request) -> None:
        """`req` gives up its slot (and row): finished, or failed."""
        if req in self.batch:
            self.batch.leave(req)
        self._count_running()

    def _count_running(self) -> None:
        """The running-batch gauge: the slots taken, by requests being prefilled or decoded. Updated wherever a
        request takes or leaves a slot, before its last event is sent, so that a client told its request ended
        never finds it still counted in /metrics."""
        self.stats.running = len(self.batch)

    def _begin(self, req: Request) -> None:
        """Give `req` a cache row, with the longest prefix of its prompt any row holds (in place if that row is
        free, else copied), and its sampling and stopping state."""
        req.prefilled = self.batch.take_row(req, reuse=self._reuses(req), copy=self.runner.copy_prefix)
        self.stats.cached_prompt_tokens_total += req.prefilled
        req.context = list(req.prompt)
        self.output.begin(req)
        if self.speculator is not None and speculates(req.params):
            req.speculation = self.speculator.begin(req.row)
        self.stats.prompt_tokens_total += len(req.prompt)

    def _reuses(self, req: Request) -> bool:
        # a scored prompt needs the logits of every position: it computes them all
        return self.prefix_cache and req.params.prompt_logprobs is None

    def _ready(self, req: Request) -> bool:
        """A request that has not begun waits while another request prefills the same first tokens: once they are
        in the cache it copies them instead of computing them too (n samples of one prompt share one prefill)."""
        if req.row >= 0 or not self._reuses(req):
            return True
        return not any(o.row >= 0 and o.prefilling and o.params.adapter is req.params.adapter
                       and shares_prefix(o.prompt, req.prompt) for o in self.batch.prefilling)

    def _run_fault_hook(self, reqs: list[Request], phase: str) -> list[Request]:
        """Run the fault-injection hook (`fault_hook`) per request; a request it raises for fails alone. The rest."""
        if self.fault_hook is None:
            return reqs
        kept = []
        for req in reqs:
            try:
                self.fault_hook([req])
                kept.append(req)
            except Exception as e:
                req.warn(log, "request %d failed%s: %s", req.id, phase, e)
                self._fail(req, GenerationError(f"generation failed{phase}: {e}"))
        return kept

    def _prefill_step(self) -> None:
        """Feed the next prompt chunk of every request `plan_prefill` packs into one forward; the requests whose
        prompt is then all in the cache start decoding with their first token."""
        for req in list(self.batch.prefilling):
            if req.row < 0 and self._ready(req):
                self._begin(req)
        begun = [r for r in self.batch.prefilling if r.row >= 0]
        if not begun:
            return
        plan = plan_prefill(begun, self.prefill_chunk, self.block_size)
        kept = self._run_fault_hook([req for req, _ in plan], " during prefill")
        plan = [(req, n) for req, n in plan if req in kept]
        if not plan:
            return
        try:
            logits = self._forward_plan(plan)
        except Exception as e:
            for req, _ in plan:
                req.warn(log, "request %d failed in prefill: %s", req.id, e)
                self._fail(req, GenerationError(f"generation failed during prefill: {e}"))
            return
        done = []
        for i, (req, n) in enumerate(plan):
            req.prefilled += n
            req.pos = req.prefilled
            if not req.prefilling:
                self.batch.start_decoding(req)
                done.append(i)
        scoring_only = [i for i in done if plan[i][0].params.max_new_tokens == 0]
        for i in scoring_only:  # it asked for no token, it only scored its prompt: its end is its only event
            req = plan[i][0]
            finished = self.output.finished(req, "length")
            self._leave(req)
            req.sink(finished)
        sampled = [i for i in done if i not in scoring_only]
        if sampled:
            self._emit([plan[i][0] for i in sampled], logits[sampled])

    def _forward_plan(self, plan: list[tuple[Request, int]]) -> torch.Tensor:
        """The plan's chunks in one forward: each chunk's last logits, (len(plan), vocab). Requests that score
        their prompt get every position's logits first."""
        chunks = [req.prompt[req.prefilled : req.prefilled + n] for req, n in plan]
        rows, starts = [req.row for req, _ in plan], [req.prefilled for req, _ in plan]
        scoring = any(req.scorer for req, _ in plan)
        with self.batch.writing(rows, starts, chunks):
            logits = self.runner.forward_chunks(rows, chunks, starts, every_position=scoring,
                                                adapters=[req.params.adapter for req, _ in plan])
        return self.output.score_prompts(plan, logits) if scoring else logits

    def _join_ahead(self) -> Ready | None:
        """The forward run ahead, if one was, once done: the cache rows it wrote recorded (the tokens the host saw,
        a row whose request left among them), and its logits for the requests still running at the rows and
        positions it fed. One that failed leaves its rows unknown, and they decode again."""
        run, self.ahead = self.ahead, None
        if run is None:
            return None
        if run.logits is None:
            log.warning("a decode step run ahead failed (its rows decode again): %s", run.error)
            for row in run.rows:
                self.batch.contents.forget(row)
            return None
        index = {}
        for i, (req, row, position, token) in enumerate(zip(run.reqs, run.rows, run.positions, run.fed)):
            if token is None:
                continue
            self.batch.contents.wrote(row, position, [token])
            if req.row == row and req.pos == position + 1:  # still running, this token taken
                index[req.id] = i
        return Ready(run.logits, index) if index else None

    def _decode_step(self, ready: Ready | None = None) -> None:
        """One token for every running row, from the forward run ahead (`ready`) where it holds the row's logits;
        rows whose window is full slide it (re-prefill) first."""
        reqs = self._run_fault_hook(list(self.batch.running), "")
        early = {} if ready is None else ready.index  # the rows run ahead: their row of its logits, by request id
        slid: dict[int, torch.Tensor] = {}  # the logits of rows whose window slid, by request id
        for req in reqs:
            if req.id not in early and self.batch.slide(req, self.window_shift, self.block_size):
                with self.batch.writing([req.row], [0], [req.context]):
                    slid[req.id] = self.runner.forward_chunks([req.row], [req.context], [0],
                                                              adapters=[req.params.adapter])[0]
                req.pos = len(req.context)
        if not reqs:
            return
        normal = [req for req in reqs if req.id not in slid and req.id not in early]
        drafts = self._drafts(normal)
        start = time.perf_counter()
        logits = None
        first: dict[int, int] = {}  # by request id: its first row among the forward's
        if normal:
            # each request's last token, then its drafted ones (speculative decoding), as rows of one forward: each
            # at its own position of the request's cache row, attending to the tokens before it there
            rows, tokens, positions, adapters = [], [], [], []
            for r in normal:
                fed = [r.context[-1], *drafts.get(r.id, ())]
                first[r.id] = len(tokens)
                rows += [r.row] * len(fed)
                tokens += fed
                positions += range(r.pos - 1, r.pos - 1 + len(fed))
                adapters += [r.params.adapter] * len(fed)
            with self.batch.writing(rows, positions, [[t] for t in tokens]):
                logits = self.runner.decode(rows, tokens, positions, adapters)
        plain = [r for r in reqs if r.id not in drafts]
        if plain:
            if ready is not None and all(r.id in early for r in plain):  # every row run ahead (the usual step)
                index = [early[r.id] for r in plain]
                whole = index == list(range(ready.logits.size(0)))
                self._emit(plain, ready.logits if whole else ready.logits[index], may_run_ahead=True)
            elif slid or drafts or early:  # the plain rows' logits, from wherever each came (`plain` keeps the order)
                got = dict(slid)
                if ready is not None:
                    got.update((i, ready.logits[j]) for i, j in early.items())
                self._emit(plain, torch.stack([got[r.id] if r.id in got else logits[first[r.id]]  # type: ignore[index]
                                               for r in plain]), may_run_ahead=True)
            else:
                self._emit(plain, logits, may_run_ahead=True)
        for r in normal:
            if r.id in drafts:
                draft = drafts[r.id]
                self._emit_verified(r, logits[first[r.id]: first[r.id] + len(draft) + 1], draft)
        if self.speculator is not None and not drafts and not slid:
            self.speculator.stepped(time.perf_counter() - start)  # what a probe's cost is measured against

    def _drafts(self, reqs: list[Request]) -> dict[int, list[int]]:
        """The tokens each speculating request drafts this step, by request id (only those that draft some): at
        most what it may still generate and its window still holds, less the token the step yields anyway; fewer,
        or none, the more requests share the step (`Speculator.drafts`)."""
        if self.speculator is None:
            return {}
        drafting, ids, batch = [], [], len(reqs)
        every = self.speculator.probe_spacing(batch)
        for r in reqs:
            if r.speculation is not None and self.speculator.may_draft(r.speculation, batch, every):
                room = min(r.params.max_new_tokens - len(r.output) - 1, self.block_size - r.pos)
                if room > 0:
                    drafting.append(Drafting(r.speculation, r.prompt, r.output, room))
                    ids.append(r.id)
        if not drafting:
            return {}
        return {i: draft for i, draft in zip(ids, self.speculator.drafts(drafting, batch)) if draft}

    def _emit_verified(self, req: Request, logits: torch.Tensor, draft: list[int]) -> None:
        """Stream the tokens a speculating request takes from its verified `draft`. Its cache row is recorded as
        holding its last token and the drafted ones accepted, never one rejected: their keys and values, left in the
        row past its position, are overwritten by the next steps' tokens before any query reads them."""
        start, last = req.pos - 1, req.context[-1]
        events, accepted, error = self.output.verify(req, logits, draft)
        assert req.speculation is not None
        Speculator.verified(req.speculation, accepted)
        if req.row >= 0:  # the drafted tokens it took (one that ended it, not those accepted after)
            self.batch.contents.wrote(req.row, start, [last, *draft[:min(accepted, len(events))]])
        for ev in events:
            if ev.finished is not None:
                self._leave(req)
            req.sink(ev)
        if error is not None:
            self._fail(req, error)

    def _runs_ahead(self, reqs: list[Request]) -> list[int]:
        """Which of a decode step's `reqs` the next step's forward runs ahead for (model/engine/ahead.py): none where
        running ahead is off, or the next step must first be seen by the host (a request to admit or prefill, a
        job, speculative decoding, streamed attention, fault injection, the engine stopping); else every row that
        cannot end at its length or slide its window at this step's token."""
        if (not self.async_scheduling or self.stopping or self.jobs or self.batch.prefilling
                or self.speculator is not None or self.fault_hook is not None
                or (self.waiting and len(self.batch) < self.max_batch_size)
                or any(r.params.attention is not None for r in reqs)):
            return []
        return [i for i, r in enumerate(reqs) if not r.cancelled and r.pos < self.block_size
                and len(r.output) + 1 < r.params.max_new_tokens]

    def _emit(self, reqs: list[Request], logits: torch.Tensor, *, may_run_ahead: bool = False) -> None:
        """Stream each row's next token (`OutputProcessor.process`); a request that ends leaves the batch first, a
        row whose choice failed fails alone. A decode step's rows (`may_run_ahead`) may have the next step's
        forward launched on their tokens as soon as they are chosen (`_runs_ahead`)."""
        which = self._runs_ahead(reqs) if may_run_ahead else []
        launched: list[Ahead] = []

        def run_ahead(tokens: torch.Tensor) -> None:
            chosen = tokens if len(which) == len(reqs) else tokens[to_device(which, tokens.device)]
            launched.append(ahead.launch(self.runner, [reqs[i] for i in which], chosen))

        fed: dict[int, int] = {}  # by request id: the token it took, where it took one
        for req, ev in self.output.process(reqs, logits, run_ahead if which else None):
            if isinstance(ev, EngineError):
                self._fail(req, ev)
                continue
            if isinstance(ev, Finished):  # ended without a token (its constraint allows only the empty output)
                self._leave(req)
                req.sink(ev)
                continue
            fed[req.id] = ev.id
            if req.speculation is not None:
                Speculator.chose(req.speculation, ev.id)  # what its proposal would have drafted: a sample of its rate
            if ev.finished is not None:
                self._leave(req)
            req.sink(ev)
        if launched:
            self.ahead = launched[0]
            self.ahead.fed = [fed.get(req.id) for req in self.ahead.reqs]
