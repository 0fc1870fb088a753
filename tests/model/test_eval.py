"""`python -m model.eval`: windows cover every token once, and the score is the sum of the same prompt
log-probabilities the engine reports for each window."""

from __future__ import annotations

import math

import pytest

from model.checkpoint import load_checkpoint
from model.engine import Engine
from model.eval import main, score, windows
from model.sampling_params import SamplingParams


@pytest.mark.parametrize("n, block, stride", [(2, 8, 8), (17, 8, 8), (16, 8, 8), (40, 8, 3), (9, 8, 1), (100, 16, 7)])
def test_windows_score_each_position_at_most_once(n, block, stride) -> None:
    """Non-overlapping windows (stride = block) score all but each window's first token, like a prompt; sliding
    ones every token but the text's first."""
    spans = windows(n, block, stride)
    scored = [p for start, end, first in spans for p in range(first, end)]
    unscored = set(range(0, n, block)) if stride == block else {0}
    assert sorted(scored) == [p for p in range(n) if p not in unscored]
    assert all(end - start <= block and start < first <= end for start, end, first in spans)
    if stride < block:  # every scored token sees at least block - stride tokens of context (or all before it)
        assert all(first - start >= min(first, block - stride) for start, end, first in spans)


def test_score_equals_the_engines_prompt_logprobs(repo, data_dir, tmp_path) -> None:
    ck = load_checkpoint(repo / "weights" / "shakespeare-char")
    text = data_dir / "tinyshakespeare" / "input.txt"
    if not text.is_file():
        pytest.skip(f"{text} not found (docs/tests.md; FOLIO_TEST_DATA)")
    ids = ck.tokenizer.encode(text.read_text(encoding="utf-8")[:300])
    block = ck.config.block_size
    engine = Engine(ck, device="cpu", threads=1).start()
    try:
        want = 0.0
        for start in range(0, len(ids) - 1, block):
            chunk = ids[start : start + block]
            result = engine.generate(chunk, SamplingParams(max_new_tokens=0, prompt_logprobs=0))
            want -= sum(t.logprob for t in result.finished.prompt_logprobs[1:])
    finally:
        engine.stop()
    got = score(ck.model, ck.tokenizer, ids)
    assert got.tokens == len(ids) - math.ceil(len(ids) / block) and got.characters == got.tokens
    assert got.nll == pytest.approx(want, rel=1e-5)
    path = tmp_path / "text.txt"
    path.write_text(ck.tokenizer.decode(ids), encoding="utf-8")
    assert main(["--checkpoint", str(repo / "weights" / "shakespeare-char"), "--data", str(path)]) == 0
    assert main(["--checkpoint", str(repo / "weights" / "shakespeare-char"), "--data", str(tmp_path / "none")]) == 2
