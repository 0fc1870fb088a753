"""LoRA adapters in the engine: one batch mixing the base and several adapters equals each request alone, a
request through an adapter equals the merged model, on fp32 (kernels), int8 and bf16 base weights."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from model.checkpoint import Checkpoint
from model.engine import Engine
from model.lora import batched as lora
from model.lora.adapter import LoRAConfig, add_lora, merge_adapter, read_adapter, save_adapter
from model.quantize import quantize
from model.sampling_params import SamplingParams, ValidationError
from model.testing import tiny_checkpoint
from tests.conftest import make_peft_adapter
from tests.engine.references import together

GREEDY = SamplingParams(max_new_tokens=12, greedy=True, stop_at_eos=False)
PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 8], [1, 2, 3, 4, 6, 9], [3, 1, 4, 1, 5]]


@pytest.fixture
def adapters(tmp_path: Path) -> list[Path]:
    """Two PEFT adapters for the tiny engine model's shape: rank 4 on every target, rank 8 on c_attn alone."""
    return [make_peft_adapter(tmp_path / "one", r=4, alpha=8, seed=1)[0],
            make_peft_adapter(tmp_path / "two", r=8, alpha=32, seed=2, targets=("c_attn",))[0]]


def _quantized(kind: str) -> Checkpoint:
    ck = tiny_checkpoint()
    quantize(ck.model, kind)
    return ck


@pytest.mark.parametrize("weights", ["fp32", "int8", "bf16"])
def test_a_batch_mixing_base_and_adapters_equals_each_request_alone(make_engine, adapters, weights) -> None:
    ck = tiny_checkpoint() if weights == "fp32" else _quantized(weights)
    engine = make_engine(ck, max_loras=2, max_batch_size=8)
    one, two = (engine.load_adapter(name, path) for name, path in zip(("one", "two"), adapters))
    jobs = [(p, replace(GREEDY, adapter=a)) for p in PROMPTS for a in (None, one, two)]
    mixed = together(engine, jobs)
    alone = [engine.generate(p, params) for p, params in jobs]
    assert [r.token_ids for r in mixed] == [r.token_ids for r in alone]
    # the adapters change what is generated: the same prompt gives three different outputs
    for i in range(len(PROMPTS)):
        assert len({tuple(r.token_ids) for r in mixed[3 * i: 3 * i + 3]}) == 3


def test_a_request_through_an_adapter_equals_the_merged_model(make_engine, adapters) -> None:
    ck = tiny_checkpoint()
    merged = copy.deepcopy(ck)
    lora.merge(merged.model, lora.load_adapter(adapters[0], ck.config))
    engine = make_engine(ck, max_loras=1)
    adapter = engine.load_adapter("one", adapters[0])
    reference = make_engine(merged)
    for prompt in PROMPTS:
        assert (engine.generate(prompt, replace(GREEDY, adapter=adapter)).token_ids
                == reference.generate(prompt, GREEDY).token_ids)


def test_a_prefix_written_through_one_adapter_is_not_reused_by_another(make_engine, adapters) -> None:
    engine = make_engine(max_loras=1, max_batch_size=1)
    adapter = engine.load_adapter("one", adapters[0])
    prompt = PROMPTS[0] * 4
    engine.generate(prompt, GREEDY)  # the base's keys and values for the prompt stay in the row
    through = engine.generate(prompt, replace(GREEDY, adapter=adapter))
    fresh = make_engine(max_loras=1, max_batch_size=1)
    fresh_adapter = fresh.load_adapter("one", adapters[0])
    assert through.token_ids == fresh.generate(prompt, replace(GREEDY, adapter=fresh_adapter)).token_ids


def test_limits_names_and_unloading(make_engine, adapters) -> None:
    engine = make_engine(max_loras=1)
    with pytest.raises(ValueError, match="adapters are off"):
        make_engine().load_adapter("one", adapters[0])
    adapter = engine.load_adapter("one", adapters[0])
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_adapter("one", adapters[1])
    with pytest.raises(ValueError, match=r"1 adapters are loaded, the most max_loras allows \(1\)"):
        engine.load_adapter("two", adapters[1])
    other = make_engine(max_loras=1)
    with pytest.raises(ValidationError, match="was not loaded by this engine"):
        other.generate(PROMPTS[0], replace(GREEDY, adapter=adapter))
    before = engine.generate(PROMPTS[0], replace(GREEDY, adapter=adapter)).token_ids
    assert engine.unload_adapter("one") is adapter and engine.adapters == {}
    # a request that holds it still runs through it
    assert engine.generate(PROMPTS[0], replace(GREEDY, adapter=adapter)).token_ids == before
    engine.load_adapter("two", adapters[1])
    assert list(engine.adapters) == ["two"]


def test_an_adapter_for_another_shape_is_refused(make_engine, tmp_path: Path) -> None:
    engine: Engine = make_engine(max_loras=1)
    wide = make_peft_adapter(tmp_path / "wide", n_embd=64, seed=1)[0]
    with pytest.raises(ValueError, match=r"lora_A \(4, 64\) .* needs lora_A \(4, 32\)"):
        engine.load_adapter("wide", wide)
    assert engine.adapters == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_batch_on_cuda_equals_each_request_alone(make_engine, adapters, dtype) -> None:
    """fp32 adapters over fp32 or bf16 activations on CUDA (the hook computes the deltas in fp32)."""
    engine = make_engine(tiny_checkpoint(), device="cuda", dtype=dtype, max_loras=2, max_batch_size=8)
    one, two = (engine.load_adapter(name, path) for name, path in zip(("one", "two"), adapters))
    assert one.weights[(0, "attn.c_attn")][0].device.type == "cuda"
    jobs = [(p, replace(GREEDY, adapter=a)) for p in PROMPTS for a in (None, one, two)]
    mixed = together(engine, jobs)
    alone = [engine.generate(p, params) for p, params in jobs]
    if dtype == torch.float32:
        assert [r.token_ids for r in mixed] == [r.token_ids for r in alone]
    else:  # bf16 sums depend on the batch's shape: most first tokens agree, and the adapters change the output
        assert sum(m.token_ids[0] == a.token_ids[0] for m, a in zip(mixed, alone)) >= len(jobs) - 2
    assert len({tuple(r.token_ids) for r in mixed[:3]}) == 3


def test_an_adapter_folio_trained_serves_as_its_merge(make_engine, tmp_path: Path) -> None:
    """An adapter as `folio train --lora` writes it (model/lora/adapter.py's LoRA modules, saved in PEFT's format)
    and served beside its base answers as the base with it merged (`folio merge`'s fold) answers alone."""
    ck = tiny_checkpoint()
    trained = copy.deepcopy(ck.model)
    torch.manual_seed(5)
    config = LoRAConfig(r=4, lora_alpha=8, target_modules=("c_attn", "c_proj", "c_fc"))
    for module in add_lora(trained, config).values():  # B starts at zero: give it what training would
        torch.nn.init.normal_(module.lora_B.weight, std=0.2)
    path = save_adapter(tmp_path / "trained", trained, config)
    merged = copy.deepcopy(ck)
    merge_adapter(merged.model, read_adapter(path))
    engine = make_engine(ck, max_loras=1)
    adapter = engine.load_adapter("trained", path)
    reference = make_engine(merged)
    outputs = set()
    for prompt in PROMPTS:
        served = engine.generate(prompt, replace(GREEDY, adapter=adapter)).token_ids
        assert served == reference.generate(prompt, GREEDY).token_ids
        outputs.add((tuple(served), tuple(engine.generate(prompt, GREEDY).token_ids)))
    assert all(a != b for a, b in outputs)  # the adapter changes the answers
