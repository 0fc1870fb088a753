"""LoRA adapters in PEFT's format over a Folio GPT (model/lora/batched.py): parity with PEFT on Hugging Face's GPT-2,
the merged weights, several adapters in one batch (through the torch blocks' hooks and inside the kernels' fused
blocks), and the checks against the base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import kernels
from model.config import GPTConfig
from model.convert import load_hf_gpt2
from model.gpt import GPT, Block, Blocks, KVCache
from model.lora import batched as lora
from model.lora.adapter import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, BLOCK_LINEARS
from model.quantize import quantize
from tests.conftest import make_peft_adapter


@pytest.fixture
def base_and_adapter(hf_gpt2, tmp_path: Path):
    """A random HF GPT-2, the same weights as a Folio GPT, and a PEFT adapter over the HF one."""
    directory, hf = hf_gpt2(n_layer=2, n_head=4, n_embd=64, vocab_size=1000)
    folio = load_hf_gpt2(directory)
    adapter_dir, peft_model = make_peft_adapter(tmp_path / "adapter", hf, r=4, alpha=16, seed=3)
    return folio, adapter_dir, peft_model


IDX = torch.tensor([[5, 17, 300, 42, 999, 0, 7, 7], [1, 2, 3, 4, 5, 6, 7, 8]])


@pytest.mark.parametrize("use_rslora", [False, True])
def test_adapter_logits_equal_peft_and_merged(hf_gpt2, tmp_path: Path, use_rslora: bool) -> None:
    directory, hf = hf_gpt2(n_layer=2, n_head=4, n_embd=64, vocab_size=1000)
    folio = load_hf_gpt2(directory)
    adapter_dir, peft_model = make_peft_adapter(tmp_path / "a", hf, r=4, alpha=16, seed=3, use_rslora=use_rslora)
    adapter = lora.load_adapter(adapter_dir, folio.config)
    assert adapter.rank == 4 and adapter.scaling == (16 / 2 if use_rslora else 16 / 4)
    assert adapter.targets == ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    with torch.no_grad():
        expected = peft_model(IDX).logits
        base = folio(IDX)
        lora.attach(folio)
        with lora.applying([adapter, adapter], "cpu"):
            adapted = folio(IDX)
        merged = lora.merge(load_hf_gpt2(directory), adapter)(IDX)
    assert (base - expected).abs().max() > 1e-2  # the adapter changes the logits
    torch.testing.assert_close(adapted, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(merged, expected, atol=1e-4, rtol=1e-4)


def test_rows_of_one_batch_each_get_their_own_adapter(hf_gpt2, tmp_path: Path) -> None:
    directory, hf = hf_gpt2(n_layer=2, n_head=4, n_embd=64, vocab_size=1000)
    folio = load_hf_gpt2(directory)
    one = lora.load_adapter(make_peft_adapter(tmp_path / "one", n_layer=2, n_head=4, n_embd=64, r=4, seed=1)[0],
                            folio.config)
    two = lora.load_adapter(make_peft_adapter(tmp_path / "two", n_layer=2, n_head=4, n_embd=64, r=8, seed=2,
                                              targets=("c_attn",))[0], folio.config)
    lora.attach(folio)
    idx = IDX[[0, 1, 0]]
    with torch.no_grad():
        with lora.applying([one, None, two], "cpu"):
            mixed = folio(idx)
        alone = []
        for row, adapter in enumerate([one, None, two]):
            with lora.applying([adapter], "cpu"):
                alone.append(folio(idx[row: row + 1]))
    torch.testing.assert_close(mixed, torch.cat(alone), atol=1e-5, rtol=1e-5)
    assert (mixed[0] - mixed[2]).abs().max() > 1e-2  # same tokens, different adapters


def _rewrite(adapter_dir: Path, change) -> None:
    path = adapter_dir / ADAPTER_WEIGHTS_FILE
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def test_mismatches_are_refused_naming_what_differs(base_and_adapter, tmp_path: Path) -> None:
    folio, adapter_dir, _ = base_and_adapter
    config = folio.config
    wider = make_peft_adapter(tmp_path / "wider", n_layer=2, n_head=4, n_embd=128, seed=1)[0]
    with pytest.raises(ValueError, match=r"transformer.h.0.attn.c_attn has lora_A \(4, 128\).*needs lora_A \(4, 64\)"):
        lora.load_adapter(wider, config)
    deeper = make_peft_adapter(tmp_path / "deeper", n_layer=3, n_head=4, n_embd=64, seed=1)[0]
    with pytest.raises(ValueError, match="transformer.h.2.* is not in the base, which has 2 layers"):
        lora.load_adapter(deeper, config)
    cfg = json.loads((adapter_dir / ADAPTER_CONFIG_FILE).read_text())
    (adapter_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps({**cfg, "r": 8}))
    with pytest.raises(ValueError, match="has rank 4 .* says r=8"):
        lora.load_adapter(adapter_dir, config)
    (adapter_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(cfg))
    _rewrite(adapter_dir, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}))
    with pytest.raises(ValueError, match="lm_head.lora_A.weight' is not a LoRA factor"):
        lora.load_adapter(adapter_dir, config)
    dropped = ("lm_head", "h.1.mlp.c_fc.lora_B.weight")
    _rewrite(adapter_dir, lambda t: [t.pop(k) for k in list(t) if any(d in k for d in dropped)])
    with pytest.raises(ValueError, match="transformer.h.1.mlp.c_fc has lora_A but not both"):
        lora.load_adapter(adapter_dir, config)
    with pytest.raises(ValueError, match="adapter directory not found"):
        lora.load_adapter(tmp_path / "nowhere", config)


def _random_adapter(cfg: GPTConfig, rank: int, targets: tuple[str, ...], seed: int) -> lora.LoraAdapter:
    """Random factors (large enough to move the output) for `targets` of every block of a base of `cfg`."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(cfg.n_layer):
        for target in targets:
            n_in, n_out = (cfg.n_embd * k for k in BLOCK_LINEARS[target])
            weights[(layer, target)] = (torch.randn(rank, n_in, generator=g) / n_in ** 0.5,
                                        torch.randn(n_out, rank, generator=g) / rank ** 0.5)
    return lora.LoraAdapter(f"r{rank}", Path("."), rank, 2.0, weights)


# how far the fused call and the torch blocks may differ: summation order for fp32 weights; for int8 and bf16 also a
# product's input rounded (to int16 or int8 for an int8 GEMM, to bf16 for a bf16 one) to its neighbour, where the two
# computed it a few ulps apart (the adapters' deltas themselves move the outputs by ~1)
TOLERANCE = {"fp32": 1e-4, "int8": 2e-2, "bf16": 2e-2}


@pytest.mark.parametrize("weights", ["fp32", "int8", "bf16"])
def test_fused_kernels_add_each_rows_adapter_as_the_hooks_do(kernel_variant, weights: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' fused blocks (one `Stack` call) add each row's adapter inside the call: a 9-token chunk of
    three rows (adapter one of rank 4 on every linear, the base, adapter two of rank 8 on c_attn alone) and then a
    decode step, in every variant this CPU runs, over fp32, int8 and bf16 base weights, equal the torch blocks
    whose hooks add the deltas (the same kernel-backed products underneath); the base row equals a forward without
    adapters. Widths 72, 216 and 288 are no multiple of the kernels' 16 lanes or 64-column pieces."""
    cfg = GPTConfig(block_size=32, vocab_size=50, n_layer=2, n_head=3, n_embd=72, bias=True)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    if weights != "fp32":
        quantize(model, weights)
    kernels.install(model)
    lora.attach(model)
    one = _random_adapter(cfg, 4, tuple(BLOCK_LINEARS), seed=1)
    two = _random_adapter(cfg, 8, ("attn.c_attn",), seed=2)
    blocks, rows, tol = model.transformer.h, torch.tensor([2, 0, 1]), TOLERANCE[weights]
    assert isinstance(blocks, kernels.FusedBlocks)
    caches = {name: KVCache(cfg, 3) for name in ("fused", "hooks", "base")}
    with torch.inference_mode():
        for pos in (torch.arange(9).expand(3, -1), torch.full((3, 1), 9)):
            x = torch.randn(3, pos.shape[1], cfg.n_embd)
            with monkeypatch.context() as m, lora.applying([one, None, two], "cpu"):
                m.setattr(Block, "forward", lambda *_: pytest.fail("the fused blocks fell back to torch's"))
                fused = blocks(x, caches["fused"].step(pos, rows))
                m.undo()
                hooks = Blocks.forward(blocks, x, caches["hooks"].step(pos, rows))
            base = blocks(x, caches["base"].step(pos, rows))
            torch.testing.assert_close(fused, hooks, rtol=tol, atol=tol)
            torch.testing.assert_close(fused[1], base[1], rtol=tol, atol=tol)
            assert min((fused[r] - base[r]).abs().max() for r in (0, 2)) > 0.1  # the adapters apply


def test_fused_kernels_refuse_lora_rows_outside_the_batch_or_in_two_groups(built) -> None:
    cfg = GPTConfig(block_size=8, vocab_size=50, n_layer=1, n_head=2, n_embd=32, bias=True)
    model = GPT(cfg).eval()
    kernels.install(model)
    stack = model.transformer.h.stack(kernels.library())
    one = _random_adapter(cfg, 2, ("attn.c_attn",), seed=1).stack_factors(1)
    cache = KVCache(cfg, 2)
    step = cache.step(torch.zeros(2, 1, dtype=torch.long))
    x = torch.randn(2, 32)
    for rows, why in ((torch.tensor([2]), "LoRA rows within the batch"), (torch.tensor([0, 0]), "in one group")):
        with pytest.raises(RuntimeError, match=why):
            stack.forward(x, cache.k, cache.v, step.token_rows, step.token_pos, [(rows, 1.0, one)])
    with pytest.raises(RuntimeError, match="factors"):
        stack.forward(x, cache.k, cache.v, step.token_rows, step.token_pos, [(torch.tensor([0]), 1.0, one[:2])])
