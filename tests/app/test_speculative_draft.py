"""`--speculative-model PATH` end to end: a server drafting with a draft model answers with plain decoding's text and
counts its drafts in /metrics; a draft model with another tokenizer stops the start (exit 2), naming both models."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from app.testing import log_tail, serving, spawn, stop
from model.checkpoint import save_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.tokenizer import CharTokenizer

BUNDLED = Path(__file__).parents[2] / "weights" / "shakespeare-char"


def test_a_draft_model_serves_plain_decodings_text(tmp_path: Path) -> None:
    body = {"prompt": "ROMEO:\nWhat say you, my lord?\n", "max_tokens": 40, "temperature": 0}
    with serving(BUNDLED, tmp_path / "server.log", "--speculative-model", str(BUNDLED),
                 "--num-speculative-tokens", "3") as (url, _), \
            httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
        spec = client.post("/v1/completions", json=body)
        plain = client.post("/v1/completions", json={**body, "speculate": False})
        metrics = client.get("/metrics").text
    assert spec.status_code == plain.status_code == 200, (spec.text, plain.text)
    assert spec.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert "vllm:spec_decode_num_drafts_total" in metrics  # counted where the server speculates


def test_a_draft_model_with_another_tokenizer_stops_the_start(tmp_path: Path) -> None:
    torch.manual_seed(0)
    draft = save_checkpoint(tmp_path / "draft", GPT(GPTConfig(block_size=16, vocab_size=3, n_layer=1, n_head=1,
                                                               n_embd=8)), CharTokenizer(["a", "b", "c"]))
    log = tmp_path / "server.log"
    proc = spawn(BUNDLED, log, "--speculative-model", str(draft))
    try:
        code = proc.wait(timeout=120)
    finally:
        stop(proc)
    last = log_tail(log, 1)
    assert code == 2, log_tail(log)
    assert last.startswith(f"error: cannot serve {BUNDLED}") and "another tokenizer" in last, last
    assert str(draft) in last and "char, 3 tokens" in last and "char, 65 tokens" in last, last
