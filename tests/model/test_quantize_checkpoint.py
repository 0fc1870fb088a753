"""The products of every kernel variant this CPU runs against the dequantized product; an offline int8
checkpoint (`python -m model.quantize`): config.json says so, it loads without quantizing again, and its model
equals the one quantized at load, logits bit for bit and greedy tokens one for one."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from model.checkpoint import CheckpointError, load_checkpoint
from model.kernels import build
from model.kernels.ops import dequantize, linear, pack
from model.quantize import SWAPS, Int8Linear, quantize
from model.quantize.__main__ import main
from model.reference import generate_naive
from model.sampling_params import SamplingParams
from tests.model.conftest import bf16_gemm_bound, gemm, int8_product_as_served


def test_an_offline_int8_checkpoint_equals_quantizing_at_load(repo, tmp_path) -> None:
    main(["--checkpoint", str(repo / "weights" / "shakespeare-char"), "--out", str(tmp_path / "q8")])
    assert json.loads((tmp_path / "q8" / "config.json").read_text())["quantization"] == "int8"
    offline = load_checkpoint(tmp_path / "q8").model
    at_load = load_checkpoint(repo / "weights" / "shakespeare-char").model
    quantize(at_load, "int8")
    assert sum(isinstance(m, Int8Linear) for m in offline.modules()) == 4 * offline.config.n_layer + 1
    assert all(type(m) is not torch.nn.Linear for m in offline.modules())
    for (name, a), (_, b) in zip(offline.state_dict().items(), at_load.state_dict().items(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    idx = torch.randint(0, offline.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(offline(idx), at_load(idx))
    greedy = SamplingParams(max_new_tokens=64, greedy=True)
    prompt = [1, 2, 3]
    a = [t for t, _ in generate_naive(offline, prompt, greedy, n_vocab=offline.config.vocab_size)]
    b = [t for t, _ in generate_naive(at_load, prompt, greedy, n_vocab=at_load.config.vocab_size)]
    assert a == b and len(a) == 64


def test_an_unknown_quantization_in_config_is_refused(repo, tmp_path) -> None:
    main(["--checkpoint", str(repo / "weights" / "shakespeare-char"), "--out", str(tmp_path / "q8")])
    config = tmp_path / "q8" / "config.json"
    meta = json.loads(config.read_text())
    meta["quantization"] = "int3"
    config.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="quantization must be one of"):
        load_checkpoint(tmp_path / "q8")


def test_an_int8_checkpoint_is_not_quantized_twice(repo, tmp_path) -> None:
    main(["--checkpoint", str(repo / "weights" / "shakespeare-char"), "--out", str(tmp_path / "q8")])
    with pytest.raises(ValueError, match="already quantized"):
        main(["--checkpoint", str(tmp_path / "q8"), "--out", str(tmp_path / "again")])


def test_a_server_on_an_int8_checkpoint_says_int8_and_generates_as_quantize_at_load(repo, tmp_path) -> None:
    main(["--checkpoint", str(repo / "weights" / "shakespeare-char"), "--out", str(tmp_path / "q8")])
    body = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": 24, "greedy": True}}
    texts = []
    for checkpoint, kind in ((tmp_path / "q8", "none"), (repo / "weights" / "shakespeare-char", "int8")):
        settings = Settings(checkpoint=checkpoint, device="cpu", threads=1, quantize=kind)
        with TestClient(create_app(settings)) as c:
            assert c.get("/info").json()["quantization"] == "int8"
            r = c.post("/generate", json=body)
            assert r.status_code == 200, r.text
            texts.append(r.json()["generated_text"])
    assert texts[0] == texts[1] and len(texts[0]) == 24


@pytest.mark.parametrize("kind", ["fp32", "int8", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 5, 13, 16, 64])
@pytest.mark.parametrize("width", [96, 104])
def test_each_kernel_variants_products_equal_the_dequantized_one(kernel_variant: build.Variant, kind: str, rows: int,
                                                                  width: int) -> None:
    """Every variant this CPU runs (built here if need be), the others skipped naming the flags it lacks; fp32,
    int8 and bf16 weights, from the weight and from its packed copy, widths a multiple of 16 and of 8 only."""
    torch.manual_seed(rows)
    lin = torch.nn.Linear(width, 40)  # 40 outputs: two whole panels and a partial one
    q = SWAPS[kind](lin) if kind != "fp32" else None
    stored, scale = (lin.weight.detach(), None) if q is None else (q.stored, q.scale_or_none)
    x = torch.randn(rows, width)
    with torch.inference_mode():
        for packed in (None, pack(stored)):
            got = linear(x, stored, lin.bias.detach(), packed, scale)
            # int8: the rows rounded as the kernels say (to int16 in avx512vnni), else the fp32 product up to
            # summation order; bf16 from 16 rows in torch's bf16 GEMM where the CPU multiplies bf16
            want = x.double() @ dequantize(stored, scale).double().T + lin.bias.double()
            if kind == "int8":
                want = int8_product_as_served(x, stored, scale, lin.bias.detach(), packed is not None)
            slack = bf16_gemm_bound(x, dequantize(stored, scale)) if gemm(rows, stored) == "bf16" else 2e-5
            assert ((got.double() - want).abs() <= slack).all(), (packed is None, (got.double() - want).abs().max())
