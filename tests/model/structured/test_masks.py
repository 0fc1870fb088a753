"""The pieces under the engine: a batch's masks from the matchers (`allowed_tokens`: the right ids, in order, at any
logits width), the sampler applying them per row (step 6, after every bias and penalty), and stopping on a
complete constraint (reason "stop", after EOS and stop strings)."""

from __future__ import annotations

import torch

from model.sampler import Sampler, SampleRow, new_generator
from model.sampling_params import SamplingParams
from model.stopping import CONSTRAINT_DONE, EOS_TOKEN, LENGTH, StoppingCriteria
from model.structured import ConstraintSpec, RowMatcher, allowed_tokens
from model.testing import ENGINE_CHARS, ENGINE_VOCAB_SIZE, tiny_checkpoint


def test_allowed_tokens_are_the_ids_that_begin_an_accepted_output(compiler) -> None:
    tok = tiny_checkpoint().tokenizer
    rows = [RowMatcher(compiler.compile(ConstraintSpec.choice(choices), tok))
            for choices in (["ab", "cd"], ["z", "!?"], ["\u4e00\u4e01"])]
    masks = allowed_tokens(rows, ENGINE_VOCAB_SIZE)
    assert masks.shape == (3, ENGINE_VOCAB_SIZE) and masks.dtype == torch.bool
    got = [set(m.nonzero().flatten().tolist()) for m in masks]
    assert got == [set(tok.encode("ac")), set(tok.encode("z!")), set(tok.encode("\u4e00"))]
    assert allowed_tokens(rows[:1], 10).shape == (1, 10)  # narrower logits: cut, never an error
    rows[0].advance(tok.encode("a")[0])
    assert set(allowed_tokens(rows[:1], ENGINE_VOCAB_SIZE)[0].nonzero().flatten().tolist()) == set(tok.encode("b"))
    rows[0].advance(tok.encode("b")[0])
    assert rows[0].done and not rows[0].stuck


def test_the_sampler_chooses_only_allowed_ids() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    allowed = torch.zeros(50, dtype=torch.bool)
    allowed[[3, 17, 41]] = True
    sampler = Sampler(n_vocab=48)
    greedy = SampleRow(SamplingParams(), allowed=allowed)
    # a penalty that would lift a masked logit (a repetition penalty below 1 multiplies a negative logit by less than
    # 1, and clamps -inf to the largest finite float) and a bias that would force one: the mask still wins
    sampled = SampleRow(SamplingParams(do_sample=True, logit_bias={5: 100.0}, repetition_penalty=0.9),
                        new_generator(1), history=list(range(50)), allowed=allowed)
    chosen: tuple[set[int], set[int]] = (set(), set())
    for _ in range(200):
        out = sampler(logits, [greedy, sampled])
        chosen[0].add(out.tokens[0])
        chosen[1].add(out.tokens[1])
    assert chosen[0] == {max((3, 17, 41), key=lambda i: logits[0, i].item())}
    assert chosen[1] == {3, 17, 41}


def test_a_free_row_draws_the_same_beside_a_constrained_row() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 30)
    allowed = torch.zeros(30, dtype=torch.bool)
    allowed[:4] = True
    rows = lambda: [SampleRow(SamplingParams(do_sample=True), new_generator(5), allowed=allowed),  # noqa: E731
                    SampleRow(SamplingParams(do_sample=True), new_generator(9))]
    beside, alone = rows(), rows()[1:]
    sampler = Sampler(n_vocab=30)
    assert ([sampler(logits, beside).tokens[1] for _ in range(50)]
            == [sampler(logits[1:], alone).tokens[0] for _ in range(50)])


def test_a_complete_constraint_stops_with_reason_stop() -> None:
    tok = tiny_checkpoint(eos_id=ENGINE_CHARS.index("!")).tokenizer
    ids = tok.encode("abc!")

    def run(complete_at: int, max_new_tokens: int = 10, stop: tuple[str, ...] = ()) -> tuple[str, str | None]:
        crit = StoppingCriteria(tok, max_new_tokens=max_new_tokens, eos_id=tok.eos_id, stop=stop)
        text = ""
        for n, t in enumerate(ids):
            check = crit(t, complete=n == complete_at)
            text += check.text
            if check.reason:
                return text, check.reason
        return text, None

    assert run(1) == ("ab", CONSTRAINT_DONE)
    assert run(1, max_new_tokens=2) == ("ab", CONSTRAINT_DONE)  # complete on the last allowed token: complete
    assert run(3) == ("abc", EOS_TOKEN)  # EOS first
    assert run(5, max_new_tokens=2) == ("ab", LENGTH)
    assert run(1, stop=("b",)) == ("a", "stop_sequence")
