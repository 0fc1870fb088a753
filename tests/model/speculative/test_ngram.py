"""Prompt lookup's drafts and the choice of how many to verify (model/speculative/)."""

from __future__ import annotations

import random

import pytest

from model.speculative import Drafting, NgramIndex, NgramProposer, Speculator, best_k
from model.speculative.speculator import PRIOR_ACCEPTANCE, probe_every


def naive_propose(history: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The longest suffix (n_max down to n_min) found earlier, its latest occurrence: the tokens after it."""
    for n in range(min(n_max, len(history)), n_min - 1, -1):
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                seq = list(history)
                for i in range(start + n, start + n + k):
                    seq.append(seq[i])
                return seq[len(history):]
    return []


def test_the_draft_follows_the_latest_occurrence_of_the_longest_suffix() -> None:
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    assert index.propose(2) == [7, 5]  # (1? no) 2 3 last seen before the end at index 5: followed by 7 5
    index.extend([1, 2, 3])
    assert index.propose(3) == [7, 5, 2]  # 1 2 3 (n = 3) latest at 4..6
    index.extend([4])
    assert index.propose(3) == []  # 4 never occurred before
    index.extend([6, 6])
    assert index.propose(5) == [6, 6, 6, 6, 6]  # 6 followed 6, and that 6 is the last: the period repeats
    index.extend([8, 6, 8])
    assert index.propose(5) == [6, 8, 6, 8, 6]


@pytest.mark.parametrize("n_min, n_max", [(1, 1), (1, 4), (2, 3), (3, 5)])
def test_the_index_grown_a_token_at_a_time_drafts_as_a_search_of_the_whole_history(n_min: int, n_max: int) -> None:
    rng = random.Random(n_min * 10 + n_max)
    index = NgramIndex(n_min, n_max)
    history: list[int] = []
    for _ in range(400):
        token = rng.randrange(4)
        history.append(token)
        index.extend([token])
        for k in (1, 3, 6):
            assert index.propose(k) == naive_propose(history, k, n_min, n_max), (history, k)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="1 <= n_min <= n_max, got 3 and 2"):
        NgramIndex(3, 2)


def test_k_grows_with_the_acceptance_rate_and_is_0_where_no_draft_pays() -> None:
    ks = [best_k(a / 20, 8) for a in range(20)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 8
    assert best_k(0.1, 8) == 0  # 1.1 tokens a step do not pay for a 14% dearer step
    assert best_k(0.2, 8) == 1
    assert best_k(0.95, 8) == 8
    assert [best_k(0.6, 8, batch) for batch in (1, 2, 4, 8)] == sorted([best_k(0.6, 8, b) for b in (1, 2, 4, 8)],
                                                                      reverse=True)
    assert best_k(0.6, 8, 1) > 0 and best_k(0.6, 8, 8) == 0  # a step shared by 8 requests: drafts must be surer


def test_rejections_turn_drafting_off_and_matching_proposals_turn_it_back_on() -> None:
    speculator = Speculator(NgramProposer(n_min=1, n_max=2), k_max=4)
    spec = speculator.begin(row=0)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]

    def step(room: int = 10) -> list[int]:
        return speculator.drafts([Drafting(spec, prompt, [], room)])[0]

    first = step()
    assert first and first == [3, 1, 2, 3][: best_k(PRIOR_ACCEPTANCE, 4)]  # as many as the prior rate pays for
    for _ in range(20):  # every draft rejected at its first token
        draft = step()
        if not draft:
            break
        Speculator.verified(spec, accepted=0)
    assert draft == [] and spec.shadow == 3  # off; the proposal is still compared with what comes
    for _ in range(20):  # the model now takes what the proposal says
        draft = step()
        if draft:
            break
        Speculator.chose(spec, 3)
    assert draft[:1] == [3]
    assert step(room=2) == [3, 1][: len(draft)]  # never more than the room


def test_requests_with_nothing_to_draft_or_probe_are_left_out_until_their_probe_is_due() -> None:
    speculator = Speculator(NgramProposer(n_min=1, n_max=2), k_max=4)
    spec = speculator.begin(row=0)
    spec.acceptance = 0.0
    alone = speculator.probe_spacing(batch=1)
    assert all(speculator.may_draft(spec, 1, alone) for _ in range(5))  # alone: a probe every step
    every = speculator.probe_spacing(batch=8)  # at 8 requests, further apart
    assert every == probe_every(speculator.probe_cost, batch=8) > 1
    spec.idle = 0
    asked = [speculator.may_draft(spec, 8, every) for _ in range(every)]
    assert asked == [False] * (every - 1) + [True] and spec.idle == every - 1 and spec.drafted == []
    spec.acceptance = 0.95  # drafts that pay even in a batch of 8: never left out
    assert speculator.may_draft(spec, 8, every)
