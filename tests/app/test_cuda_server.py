"""The server on a CUDA device: skipped, with the reason, on machines without one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from model.checkpoint import load_checkpoint
from model.reference import generate_naive
from model.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none on this machine"),
]


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_the_bundled_model_served_on_cuda_answers_as_the_naive_loop(repo: Path, dtype: str) -> None:
    """fp32 on the GPU: /generate's greedy tokens are the naive loop's there; auto (bf16 on a GPU that has it)
    serves and streams; /info says where the model runs."""
    checkpoint = repo / "weights" / "shakespeare-char"
    settings = Settings(checkpoint=checkpoint, device="cuda", dtype=dtype)
    body = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": 40, "details": True}}
    with TestClient(create_app(settings)) as c:
        info = c.get("/info").json()
        assert str(info["device"]).startswith("cuda"), info
        r = c.post("/generate", json=body)
        assert r.status_code == 200, r.text
        got = [t["id"] for t in r.json()["details"]["tokens"]]
        stream = c.post("/generate_stream", json=body)
        assert stream.status_code == 200 and stream.text.count("data:") == 40
    assert len(got) == 40
    if dtype == "float32":
        ck = load_checkpoint(checkpoint)
        ck.model.to("cuda")
        prompt = ck.tokenizer.encode("ROMEO:")
        params = SamplingParams(max_new_tokens=40)
        assert got == [t for t, _ in generate_naive(ck.model, prompt, params, n_vocab=ck.tokenizer.n_vocab)]


@pytest.mark.parametrize("eager", [False, True])
def test_info_says_whether_decode_steps_replay_cuda_graphs(repo: Path, eager: bool) -> None:
    """`--enforce-eager` turns the graphs off; by default /info counts them, and a greedy answer is the same."""
    settings = Settings(checkpoint=repo / "weights" / "shakespeare-char", device="cuda", dtype="float32",
                        enforce_eager=eager)
    with TestClient(create_app(settings)) as c:
        graphs = c.get("/info").json()["cuda_graphs"]
        r = c.post("/generate", json={"inputs": "ROMEO:", "parameters": {"max_new_tokens": 30, "details": True}})
    assert r.status_code == 200, r.text
    if eager:
        assert graphs == "off (--enforce-eager)"
    else:
        assert graphs.split()[1:3] == ["captured", "in"] and int(graphs.split()[0]) > 0, graphs
