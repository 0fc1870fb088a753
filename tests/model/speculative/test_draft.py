"""Speculative decoding with a draft model (`speculative_model=PATH`) on the bundled model: greedy text identical to
plain decoding with a well-matched draft (the bundled model itself: nearly every drafted token taken) and a
badly-matched one (a random one-layer model with a shorter context: few taken, its window sliding), alone and
batched with requests of other lengths; a seeded sampled request's text unchanged; the draft's cache rows kept in
step with each request through rejections; a draft with another tokenizer refused, naming both models; a drafted
token's cost in k and in how often requests that draft nothing are probed."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from model.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from model.config import GPTConfig
from model.engine import Engine, EngineConfig
from model.engine.runner import ModelRunner
from model.gpt import GPT
from model.sampling_params import SamplingParams
from model.speculative import Drafting, DraftModelProposer, Speculator, best_k
from model.speculative.speculator import PROBE_BUDGET, PROPOSAL_COST, probe_every
from model.tokenizer import CharTokenizer
from tests.engine.references import together

BUNDLED = Path(__file__).parents[3] / "weights" / "shakespeare-char"
PROMPTS = ["ROMEO:\nWhat say you, my lord?\n", "To be, or not to be", "First Citizen:\nBefore we proceed", "KING"]
LENGTHS = [60, 7, 140, 1]  # the third runs past the served model's 128 positions: its window slides


@pytest.fixture(scope="module")
def bundled() -> Checkpoint:
    return load_checkpoint(BUNDLED)


@pytest.fixture
def make_engine(bundled: Checkpoint) -> Iterator[Callable[..., Engine]]:
    engines: list[Engine] = []

    def make(**kwargs) -> Engine:
        engines.append(Engine(bundled, device="cpu", threads=1, max_batch_size=4, **kwargs).start())
        return engines[-1]

    yield make
    for engine in engines:
        engine.stop(timeout=10)


def random_draft(directory: Path, tokenizer: CharTokenizer, block_size: int = 32) -> Path:
    """A random one-layer model saved as a Folio checkpoint with `tokenizer`."""
    torch.manual_seed(0)
    config = GPTConfig(block_size=block_size, vocab_size=tokenizer.n_vocab, n_layer=1, n_head=2, n_embd=32, bias=False)
    return save_checkpoint(directory, GPT(config), tokenizer)


def jobs(tok: CharTokenizer, **params) -> list[tuple[list[int], SamplingParams]]:
    return [(tok.encode(p), SamplingParams(max_new_tokens=n, **params)) for p, n in zip(PROMPTS, LENGTHS)]


def acceptance(engine: Engine) -> tuple[int, float]:
    drafted = engine.stats.spec_decode_num_draft_tokens_total
    return drafted, engine.stats.spec_decode_num_accepted_tokens_total / max(drafted, 1)


def check_greedy(plain: Engine, spec: Engine, tok: CharTokenizer) -> None:
    work = jobs(tok)
    want = [plain.generate(p, q).token_ids for p, q in work]
    assert [spec.generate(p, q).token_ids for p, q in work] == want  # alone
    assert [r.token_ids for r in together(spec, work)] == want  # batched: four lengths, rows finishing at each
    assert [r.token_ids for r in together(spec, work[1:3])] == want[1:3]


def test_the_served_model_as_its_own_draft_gives_plain_greedy_text_with_nearly_every_draft_taken(
        bundled: Checkpoint, make_engine) -> None:
    # a drafted token priced at nothing: every request drafts all num_speculative_tokens (the measured price of a
    # draft as large as the model would turn drafting off)
    spec = make_engine(speculative_model=str(BUNDLED), num_speculative_tokens=4, draft_token_cost=0.0)
    check_greedy(make_engine(), spec, bundled.tokenizer)
    drafted, rate = acceptance(spec)
    assert drafted > 200 and rate > 0.9, (drafted, rate)
    draft = spec.draft_runner  # its cache: a row per batch slot, as long as the draft's context
    assert draft is not None and draft.cache.k.shape[1:4] == (4, 6, 128)


def test_a_badly_matched_draft_gives_plain_greedy_text_with_few_drafts_taken(bundled: Checkpoint, make_engine,
                                                                            tmp_path: Path) -> None:
    path = random_draft(tmp_path / "draft", bundled.tokenizer, block_size=32)  # its window slides every few steps
    spec = make_engine(speculative_model=str(path), num_speculative_tokens=3, draft_token_cost=0.0)
    check_greedy(make_engine(), spec, bundled.tokenizer)
    drafted, rate = acceptance(spec)
    assert drafted > 0 and rate < 0.5, (drafted, rate)
    assert spec.config.draft_token_cost == 0.0


def test_a_seeded_sampled_request_gives_the_same_text_with_or_without_a_draft(bundled: Checkpoint,
                                                                              make_engine) -> None:
    plain = make_engine()
    spec = make_engine(speculative_model=str(BUNDLED), draft_token_cost=0.0)
    tok = bundled.tokenizer
    for seed in range(3):
        work = jobs(tok, temperature=0.7 + 0.2 * seed, top_k=30, seed=seed)
        want = [plain.generate(p, q).token_ids for p, q in work]
        assert [spec.generate(p, q).token_ids for p, q in work] == want
        assert [r.token_ids for r in together(spec, work)] == want
    drafted, rate = acceptance(spec)
    assert drafted > 100 and 0 < rate < 1, (drafted, rate)


def test_the_draft_measures_its_cost_and_a_request_may_opt_out(bundled: Checkpoint, make_engine) -> None:
    spec = make_engine(speculative_model=str(BUNDLED))
    cost = spec.config.draft_token_cost
    assert cost is not None and cost > 0  # measured: a draft step is not free
    prompt, params = jobs(bundled.tokenizer)[0]
    out = spec.generate(prompt, SamplingParams(max_new_tokens=40, speculate=False))
    assert spec.stats.spec_decode_num_drafts_total == 0
    assert out.token_ids == make_engine().generate(prompt, SamplingParams(max_new_tokens=40)).token_ids


@torch.inference_mode()  # as on the engine's thread
def test_the_draft_rows_follow_each_request_through_rejections(bundled: Checkpoint) -> None:
    """Step by step, with random rejections of the drafted tokens: each proposal is the one a fresh row, fed the
    request's whole text at once, makes (what rejected tokens left in the row is never read)."""
    runner = ModelRunner(bundled, EngineConfig(device="cpu", threads=1, max_batch_size=2))
    proposer = DraftModelProposer(runner, bundled.tokenizer.n_vocab, token_cost=0.0)
    rng = random.Random(0)
    prompt = bundled.tokenizer.encode("HAMLET:\nTo be, or not")
    output: list[int] = []
    row = proposer.begin(0)
    rejected = 0
    while len(prompt) + len(output) < 100:
        k = rng.randint(1, 4)
        draft = proposer.propose([row], [prompt], [output], [k])[0]
        fresh = proposer.propose([proposer.begin(1)], [prompt], [output], [k])[0]
        assert draft == fresh and len(draft) == k
        taken = rng.randint(0, k)  # the served model takes a prefix of the draft, then a token of its own
        rejected += taken < k
        output += draft[:taken] + [rng.randrange(bundled.tokenizer.n_vocab)]
    assert rejected > 5


def test_a_draft_with_another_tokenizer_is_refused_naming_both(bundled: Checkpoint, tmp_path: Path) -> None:
    chars = list(bundled.tokenizer.chars)
    chars[1], chars[2] = chars[2], chars[1]  # as many tokens, two ids swapped
    for name, tokenizer in (("swapped", CharTokenizer(chars)), ("smaller", CharTokenizer(chars[:40]))):
        path = random_draft(tmp_path / name, tokenizer)
        with pytest.raises(ValueError, match="another tokenizer") as err:
            Engine(bundled, device="cpu", threads=1, speculative_model=str(path))
        assert str(path) in str(err.value) and str(BUNDLED) in str(err.value)
        assert f"char, {tokenizer.n_vocab} tokens" in str(err.value) and "char, 65 tokens" in str(err.value)


class CountingProposer:
    """Proposes `token` k times, counting the calls."""

    def __init__(self, token_cost: float) -> None:
        self.token_cost, self.calls = token_cost, 0

    def begin(self, row: int) -> None:
        return None

    def propose(self, states, prompts, outputs, ks) -> list[list[int]]:
        self.calls += 1
        return [[7] * k for k in ks]


def test_a_drafted_tokens_cost_enters_k_and_spaces_the_probes() -> None:
    assert [best_k(0.9, 4, token_cost=c) for c in (0.0, 0.5, 1.0)] == [4, 3, 0]  # dearer drafts, fewer
    assert probe_every(PROPOSAL_COST) == 1  # prompt lookup alone: every step
    for batch in (1, 4):
        # before any step is timed a probe costs its bookkeeping and a drafted token: the closest spacing at which
        # probing every request of the batch stays within the budget
        every, cost = probe_every(0.05 + PROPOSAL_COST, batch), batch * (0.05 + PROPOSAL_COST)
        assert cost / every <= PROBE_BUDGET < cost / (every - 1)
        proposer = CountingProposer(token_cost=0.05)
        speculator = Speculator(proposer, k_max=4)
        spec = speculator.begin(row=0)
        spec.acceptance = 0.05  # no k pays
        shadows = []
        for _ in range(every * 3):
            assert speculator.drafts([Drafting(spec, [1, 2], [], room=8)], batch) == [[]]
            shadows.append(spec.shadow)
            spec.shadow = None  # as `Speculator.chose` leaves it
        assert proposer.calls == 3 and shadows == ([None] * (every - 1) + [7]) * 3
    spec.acceptance = 0.9  # drafts taken: k tokens a step, proposed every step
    assert speculator.drafts([Drafting(spec, [1, 2], [], room=8)]) == [[7] * best_k(0.9, 4, token_cost=0.05)]


class Clock:
    """The speculator's clock in the test: time passes only when a proposal says it took some, so what the
    speculator measures is exactly that (a real clock made a free proposal cost whatever the machine's load did)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class SlowProposer(CountingProposer):
    """A proposal that takes `seconds` (as a draft model's catch-up does), whatever it proposes."""

    def __init__(self, seconds: float, clock: Clock) -> None:
        super().__init__(token_cost=0.0)
        self.seconds, self.clock = seconds, clock

    def propose(self, states, prompts, outputs, ks) -> list[list[int]]:
        self.clock.now += self.seconds
        return super().propose(states, prompts, outputs, ks)


def test_probes_are_spaced_by_what_they_are_measured_to_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr("model.speculative.speculator.time", clock)
    for seconds, steps in ((0.0, 150), (0.002, 150)):
        proposer = SlowProposer(seconds, clock)
        speculator = Speculator(proposer, k_max=4)
        spec = speculator.begin(row=0)
        spec.acceptance = 0.0  # no k pays: only probes
        for _ in range(steps):
            speculator.drafts([Drafting(spec, [1, 2], [], room=8)])
            spec.shadow = None
            speculator.stepped(0.001)  # each plain step measured at 1 ms
        if seconds:  # a 2 ms probe is 2 plain steps: within the budget once every 2 / PROBE_BUDGET = 100 steps
            assert speculator.probe_cost >= 2 and proposer.calls <= 2 and probe_every(speculator.probe_cost) >= 100
        else:  # a free one: every step
            assert speculator.probe_cost < PROBE_BUDGET and proposer.calls == steps
