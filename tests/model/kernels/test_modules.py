"""`kernels.install`: the module swaps that put the kernels into a GPT, what they keep unchanged (parameters, the
state dict, the tied LM head), where they hand work back to torch's modules, and the mask a fused step skips."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from model import kernels
from model.config import GPTConfig
from model.gpt import GPT, Block, Blocks, CacheStep, KVCache

CONFIG = GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32, bias=True)


def packed_bytes(model: torch.nn.Module) -> int:
    """What panels of 16 outputs of every linear weight take."""
    shapes = [m.weight.shape for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return sum(-(-n_out // 16) * 16 * n_in * 4 for n_out, n_in in shapes)


def test_install_swaps_modules_and_keeps_the_state_dict(built: None) -> None:
    model = GPT(CONFIG).eval()
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = kernels.install(model)
    assert report == kernels.InstallReport(linears=4 * 2 + 1, blocks=2, packed_bytes=packed_bytes(model))
    assert isinstance(model.transformer.h, kernels.FusedBlocks)
    assert not any(m.training for m in model.modules())  # still in eval mode: the swaps keep the mode
    assert not [m for m in model.modules() if type(m) in (torch.nn.Linear, Blocks)]
    # the same Parameter objects under the same names; the packed copies are not saved
    assert [n for n, _ in model.named_parameters()] == names
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert kernels.install(model) == report  # a second install finds everything in place


def test_install_leaves_what_the_kernels_cannot_run(built: None) -> None:
    """Nothing while the kernels are off; fp64 stays torch's; a head size not a multiple of 8 keeps torch's
    blocks (their linears still kernel-backed)."""
    model = GPT(CONFIG).eval()
    with kernels.disabled():
        assert kernels.install(model) == kernels.InstallReport(linears=0, blocks=0, packed_bytes=0)
    assert kernels.install(GPT(CONFIG).double()).linears == 0
    odd = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=12)).eval()
    assert kernels.install(odd, pack=False) == kernels.InstallReport(linears=9, blocks=0, packed_bytes=0)
    assert type(odd.transformer.h) is Blocks and all(type(b) is Block for b in odd.transformer.h)


def test_a_stale_packed_copy_is_repacked_by_a_second_install(built: None) -> None:
    model = GPT(CONFIG).eval()
    kernels.install(model)
    fc = model.transformer.h[0].mlp.c_fc
    with torch.no_grad():
        fc.weight.add_(1.0)
    assert fc.current_packed() is None
    kernels.install(model)
    assert fc.current_packed() is not None
    torch.testing.assert_close(fc.current_packed(), kernels.pack(fc.weight))


def test_fused_blocks_fall_back_to_torchs_block(built: None) -> None:
    """With autograd on (training), or without a cache, a fused block is `Block.forward`: same logits and
    gradients as the model before install."""
    torch.manual_seed(0)
    plain = GPT(CONFIG)
    fused = GPT(CONFIG)
    fused.load_state_dict(plain.state_dict())
    kernels.install(fused)
    idx = torch.randint(0, CONFIG.vocab_size, (2, 9))
    want, got = plain.eval()(idx), fused.eval()(idx)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.square().mean().backward()
    want.square().mean().backward()
    for (name, a), b in zip(fused.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)


def test_a_fused_step_builds_no_attention_mask(built: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mask of torch's attention is built on first use, once per forward: never when every block is fused."""
    masks: list[int] = []
    build_mask = CacheStep.mask.func
    monkeypatch.setattr(CacheStep, "mask", property(lambda step: masks.append(1) or build_mask(step)))
    model = GPT(CONFIG).eval()
    kernels.install(model)
    idx = torch.randint(0, CONFIG.vocab_size, (3, 6))
    with torch.inference_mode():
        cache = KVCache(CONFIG, 3)
        fused = model(idx, cache.step(torch.arange(6).expand(3, 6)))
        assert masks == []
        with kernels.disabled():
            unfused = model(idx, KVCache(CONFIG, 3).step(torch.arange(6).expand(3, 6)))
        assert masks  # torch's path reads it
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)


def test_a_model_the_fused_blocks_ran_in_can_be_copied_and_pickled(built: None) -> None:
    """The fused blocks keep the library's `Stack` between steps; `copy.deepcopy` (bench.quantize copies a served
    model) and pickling leave it out, and the copy makes its own: the same logits (up to summation order: a copied
    weight's version differs from the one its packed copy was made from, so the copy reads the weight itself)."""
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    kernels.install(model)
    idx = torch.randint(0, CONFIG.vocab_size, (1, 5))
    with torch.inference_mode():
        want = model(idx, KVCache(CONFIG, 1).step(torch.arange(5)[None]))
        for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            step = KVCache(CONFIG, 1).step(torch.arange(5)[None])
            torch.testing.assert_close(other(idx, step), want, rtol=1e-5, atol=1e-5)


def test_the_fused_blocks_follow_a_model_changed_after_a_step(built: None) -> None:
    """The fused blocks keep their `Stack` between steps; a weight changed in place, a parameter replaced and a
    product swapped (quantized) after a step are each seen by the next step: it equals torch's blocks then."""
    from model.quantize import quantize

    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    kernels.install(model)
    idx = torch.randint(0, CONFIG.vocab_size, (1, 5))  # fewer rows than the int8 GEMM takes (rounding to int8)
    block = model.transformer.h[1]

    def changes():
        with torch.no_grad():
            block.attn.c_attn.weight.mul_(-1.5)
        yield "a weight changed in place"
        block.ln_2.weight = torch.nn.Parameter(torch.linspace(0.5, 2.0, CONFIG.n_embd))
        yield "a layer norm's weight replaced"
        quantize(model, "int8")
        yield "every product swapped for int8"

    def step() -> torch.Tensor:
        return model(idx, KVCache(CONFIG, 1).step(torch.arange(5)[None]))

    with torch.inference_mode():
        before = step()
        for change in changes():
            got = step()
            with kernels.disabled():
                want = step()
            assert not torch.allclose(got, before, rtol=1e-3, atol=1e-3), change
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=change)
            before = got
