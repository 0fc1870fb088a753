"""The GPT: parity with Hugging Face GPT-2, causality, KV-cache equivalence, nanoGPT names, init, size."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from model.config import GPTConfig
from model.convert import load_hf_gpt2
from model.gpt import GPT, KVCache
from model.hugepages import HUGE_PAGE, zeros_on_huge_pages

# --- parity with transformers --------------------------------------------------------------------------------


def test_logits_match_transformers_gpt2(hf_gpt2) -> None:
    directory, hf = hf_gpt2()
    model = load_hf_gpt2(directory)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 1000, (3, 64), generator=g)  # the full context, n_positions = 64
    with torch.no_grad():
        want = hf(idx).logits
        got = model(idx)
        got_last = model(idx[:, :17], take=torch.tensor([-1, -1, -1]))
    assert got.shape == want.shape == (3, 64, 1000)
    assert (got - want).abs().max().item() <= 1e-4
    assert got_last.shape == (3, 1, 1000)
    assert (got_last - want[:, 16:17]).abs().max().item() <= 1e-4


# --- causality -----------------------------------------------------------------------------------------------


def test_future_tokens_never_change_earlier_logits(tiny_model: GPT) -> None:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 65, (2, 32), generator=g)
    with torch.no_grad():
        base = tiny_model(idx)
        for t in (1, 10, 31):
            changed = idx.clone()
            changed[:, t:] = (changed[:, t:] + 1 + torch.randint(0, 63, changed[:, t:].shape, generator=g)) % 65
            out = tiny_model(changed)
            assert torch.allclose(out[:, :t], base[:, :t], atol=1e-6, rtol=0)
            assert not torch.allclose(out[:, t], base[:, t], atol=1e-3)  # the changed position does move


# --- KV cache ------------------------------------------------------------------------------------------------


def _full_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture
def seqs() -> torch.Tensor:
    return torch.randint(0, 65, (3, 32), generator=torch.Generator().manual_seed(2))


def test_prefill_then_one_token_steps_equal_full_forward(tiny_model: GPT, seqs: torch.Tensor) -> None:
    idx = seqs[:2]
    full = _full_logits(tiny_model, idx)
    cache = KVCache(tiny_model.config, batch_size=2)
    with torch.no_grad():
        prefill = tiny_model(idx[:, :8], cache.step(torch.arange(8).expand(2, 8)))
        assert _max_diff(prefill, full[:, :8]) <= 1e-5
        for t in range(8, 32):
            pos = torch.full((2, 1), t)
            step = tiny_model(idx[:, t : t + 1], cache.step(pos, kv_len=t + 1))
            assert step.shape == (2, 1, 65)
            assert _max_diff(step[:, 0], full[:, t]) <= 1e-5, f"position {t}"


def test_chunked_prefill_equals_full_forward(tiny_model: GPT, seqs: torch.Tensor) -> None:
    idx = seqs[:2]
    full = _full_logits(tiny_model, idx)
    cache = KVCache(tiny_model.config, batch_size=2)
    pieces, start = [], 0
    with torch.no_grad():
        for size in (5, 1, 11, 15):
            pos = torch.arange(start, start + size).expand(2, size)
            pieces.append(tiny_model(idx[:, start : start + size], cache.step(pos)))
            start += size
    assert start == 32
    assert _max_diff(torch.cat(pieces, dim=1), full) <= 1e-5


def test_rows_at_different_positions_decode_together(tiny_model: GPT, seqs: torch.Tensor) -> None:
    idx = seqs[:2]
    full = _full_logits(tiny_model, idx)
    cache = KVCache(tiny_model.config, batch_size=2)
    cache.k.normal_()  # stale garbage in every slot: only slots 0..pos of a row may ever be read
    cache.v.normal_()
    lengths = [10, 4]
    with torch.no_grad():
        for row, n in enumerate(lengths):  # prefill each row alone, to a different length
            tiny_model(idx[row : row + 1, :n], cache.step(torch.arange(n)[None], torch.tensor([row])))
        for _ in range(6):  # then decode both rows in one batch, each at its own position
            pos = torch.tensor(lengths)[:, None]  # (2, 1)
            tokens = torch.stack([idx[r, n] for r, n in enumerate(lengths)])[:, None]
            step = tiny_model(tokens, cache.step(pos))
            for r, n in enumerate(lengths):
                assert _max_diff(step[r, 0], full[r, n]) <= 1e-5, f"row {r} position {n}"
            lengths = [n + 1 for n in lengths]


def test_rows_select_a_subset_of_cache_rows(tiny_model: GPT, seqs: torch.Tensor) -> None:
    full = _full_logits(tiny_model, seqs)
    cache = KVCache(tiny_model.config, batch_size=4)
    with torch.no_grad():
        # cache rows 3, 0, 2 hold seqs
        tiny_model(seqs[:, :12], cache.step(torch.arange(12).expand(3, 12), torch.tensor([3, 0, 2])))
        # decode only sequences 2 and 0, in that order, from their cache rows 2 and 3; row 1 is never touched
        rows = torch.tensor([2, 3])
        for t in range(12, 20):
            step = tiny_model(seqs[[2, 0], t : t + 1], cache.step(torch.full((2, 1), t), rows))
            assert _max_diff(step[0, 0], full[2, t]) <= 1e-5
            assert _max_diff(step[1, 0], full[0, t]) <= 1e-5
        assert cache.k[:, 1].abs().sum().item() == 0.0


def test_a_read_only_step_attends_to_the_cache_and_writes_nothing(tiny_model: GPT, seqs: torch.Tensor) -> None:
    """`KVCache.step(..., write=False)`: a token already fed (its keys and values in the cache) fed again gives its
    logits from the keys and values in the cache, and the cache is left bit for bit as it was, whatever the step
    computes for it (streamed attention reads a decode step's cache this way)."""
    full = _full_logits(tiny_model, seqs[:2])
    cache = KVCache(tiny_model.config, batch_size=2)
    with torch.no_grad():
        tiny_model(seqs[:2, :10], cache.step(torch.arange(10).expand(2, 10)))
        k, v = cache.k.clone(), cache.v.clone()
        pos = torch.tensor([[9], [4]])
        again = tiny_model(seqs[:2].gather(1, pos), cache.step(pos, write=False))
        assert torch.equal(cache.k, k) and torch.equal(cache.v, v)
        assert _max_diff(again[0, 0], full[0, 9]) <= 1e-5 and _max_diff(again[1, 0], full[1, 4]) <= 1e-5
        other = (seqs[:2].gather(1, pos) + 1) % 65  # another token: its own keys would differ, none is written
        tiny_model(other, cache.step(pos, write=False))
        assert torch.equal(cache.k, k) and torch.equal(cache.v, v)


def test_take_returns_each_rows_chosen_position(tiny_model: GPT, seqs: torch.Tensor) -> None:
    full = _full_logits(tiny_model, seqs)
    take = torch.tensor([5, 0, 11, 3])[: seqs.shape[0]]
    with torch.no_grad():
        out = tiny_model(seqs[:, :12], take=take)
    assert out.shape == (seqs.shape[0], 1, full.shape[-1])
    for r, t in enumerate(take.tolist()):
        assert _max_diff(out[r, 0], full[r, t]) <= 1e-5


def test_cache_longer_than_block_size_is_refused(tiny_config: GPTConfig) -> None:
    with pytest.raises(ValueError, match="exceeds block_size"):
        KVCache(tiny_config, batch_size=1, max_len=tiny_config.block_size + 1)


def _vm_flags_and_huge_kb(address: int) -> tuple[list[str], int]:
    """The VmFlags and AnonHugePages (kB) of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside, flags, huge = False, [], 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            flags = line.split()[1:]
        elif inside and head == "AnonHugePages:":
            huge = int(line.split()[1])
    return flags, huge


@pytest.mark.skipif(sys.platform != "linux", reason="transparent huge pages are Linux's")
def test_a_cpu_cache_is_advised_onto_huge_pages_and_starts_zeroed() -> None:
    """The cache's whole 2 MiB pages carry the huge-page advice (VmFlags "hg") given before the first write, so the
    kernel backs them with 2 MiB pages where transparent huge pages are on; the cache reads as zeros."""
    config = GPTConfig(block_size=256, vocab_size=64, n_layer=4, n_head=4, n_embd=128)
    cache = KVCache(config, batch_size=32, dtype=torch.float16)  # 8 MiB each
    for t in (cache.k, cache.v):
        assert t.dtype == torch.float16 and not t.any()
        flags, huge = _vm_flags_and_huge_kb(t.data_ptr() + HUGE_PAGE + 4096)
        assert "hg" in flags, flags
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        print(f"\nTHP {mode.strip()}: {huge} kB of the cache on huge pages")
    small = zeros_on_huge_pages((16,), torch.float32)  # less than a page: left as it is
    assert small.tolist() == [0.0] * 16


# --- names, init, size ---------------------------------------------------------------------------------------


def _nanogpt_parameter_names(n_layer: int, bias: bool) -> list[str]:
    """nanoGPT's `named_parameters()` order (lm_head.weight is wte's tensor, so it is listed once)."""

    def layer(prefix: str, kinds: tuple[str, ...]) -> list[str]:
        return [f"{prefix}.{k}" for k in kinds]

    wb = ("weight", "bias") if bias else ("weight",)
    names = ["transformer.wte.weight", "transformer.wpe.weight"]
    for i in range(n_layer):
        h = f"transformer.h.{i}"
        for sub in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            names += layer(f"{h}.{sub}", wb)
    return names + layer("transformer.ln_f", wb)


@pytest.mark.parametrize("bias", [True, False])
def test_parameter_names_are_nanogpts(bias: bool) -> None:
    config = GPTConfig(block_size=8, vocab_size=11, n_layer=2, n_head=2, n_embd=8, bias=bias)
    model = GPT(config)
    names = _nanogpt_parameter_names(2, bias)
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == [*names, "lm_head.weight"]
    assert model.lm_head.weight is model.transformer.wte.weight
    # nn.Linear layouts, (out, in)
    assert model.transformer.h[0].attn.c_attn.weight.shape == (24, 8)
    assert model.transformer.h[0].mlp.c_fc.weight.shape == (32, 8)
    assert model.transformer.h[0].mlp.c_proj.weight.shape == (8, 32)


def test_gpt2_init() -> None:
    torch.manual_seed(0)
    n_layer = 4
    model = GPT(GPTConfig(block_size=16, vocab_size=512, n_layer=n_layer, n_head=4, n_embd=128))
    residual = torch.cat([p.flatten() for n, p in model.named_parameters() if n.endswith("c_proj.weight")])
    other = torch.cat(
        [p.flatten() for n, p in model.named_parameters() if n.endswith(("c_attn.weight", "c_fc.weight"))]
    )
    want = 0.02 / math.sqrt(2 * n_layer)
    assert residual.std().item() == pytest.approx(want, rel=0.05)
    assert other.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.transformer.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    assert all(torch.count_nonzero(b) == 0 for b in biases)
    assert all(torch.all(m.weight == 1) for m in model.modules() if type(m).__name__ == "LayerNorm")


@pytest.mark.parametrize("bias", [True, False])
def test_num_params_matches_config(bias: bool) -> None:
    config = GPTConfig(block_size=16, vocab_size=70, n_layer=3, n_head=2, n_embd=16, bias=bias)
    model = GPT(config)
    assert model.num_params() == config.num_params() == sum(p.numel() for p in set(model.parameters()))
    assert model.num_params(non_embedding=True) == config.num_params(non_embedding=True)
    assert config.num_params() - config.num_params(non_embedding=True) == 16 * 16
