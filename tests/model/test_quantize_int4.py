"""4-bit weights (model/quantize's "int4", csrc/int4.cpp): the group quantization against its own definition and
llama.cpp's q4_0 byte order, the products of every kernel variant this CPU runs against a float64 reference from
the dequantized weight with the same activation rounding (x rounded to int8 per row and group of 32); the fused
blocks against the unfused kernel path; an offline int4 checkpoint, and an engine on it against the naive loop."""

from __future__ import annotations

import json

import pytest
import torch

from model import kernels
from model.checkpoint import load_checkpoint
from model.engine import Engine
from model.gpt import GPT, Blocks, GPTConfig, KVCache
from model.kernels import build
from model.kernels.ops import INT4_GROUP, dequantize, int4_values
from model.quantize import Int4Linear, Int8Linear, quantize, quantize_groups
from model.quantize.__main__ import main
from model.reference import generate_naive
from model.sampling_params import SamplingParams


def int4_reference(x: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The integer path's product in float64, independently of int4.cpp, and its fp32 bound: each row of x rounded
    per group of 32 to int8 (scale max |x_g| / 127 in fp32, 1 for an all-zero group; torch.round of x / scale, half
    to even), times q (the weight's 4-bit values), summed exactly per group, times the group's two scales, summed,
    plus the bias. The kernels add the groups in fp32 (one rounding of the scales' product and one of each
    multiply-add per group, then the lanes): within (groups + 32) * 2^-24 of the sum of the terms' magnitudes."""
    M, n_in = x.shape
    groups = x.view(M, n_in // INT4_GROUP, INT4_GROUP)
    amax = groups.abs().amax(dim=2, keepdim=True)
    row_scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    xq = torch.round(groups / row_scale)
    assert xq.abs().max() <= 127
    q = int4_values(stored).view(stored.shape[0], n_in // INT4_GROUP, INT4_GROUP)
    dots = torch.einsum("mgj,ogj->mog", xq.double(), q.double())  # exact: integers below 2^53
    terms = dots * row_scale.double().squeeze(2)[:, None, :] * scale.double()[None, :, :]
    want = terms.sum(dim=2) + (0 if bias is None else bias.double())
    bound = terms.abs().sum(dim=2) * (n_in // INT4_GROUP + 32) * 2**-24 + 1e-6
    return want, bound


def test_groups_are_scaled_as_q4_0_and_packed_in_its_byte_order() -> None:
    torch.manual_seed(0)
    w = torch.randn(6, 96) * torch.linspace(0.01, 3, 6)[:, None]
    w[2, 32:64] = 0.0  # an all-zero group: scale 0, every q 0
    packed, scale = quantize_groups(w)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 48)
    assert scale.dtype == torch.float16 and scale.shape == (6, 3)
    groups = w.view(6, 3, 32)
    largest = groups.gather(2, groups.abs().argmax(dim=2, keepdim=True)).squeeze(2)
    assert torch.equal(scale, (largest / -8).half())
    q = int4_values(packed).view(6, 3, 32)
    assert q.min() >= -8 and q.max() <= 7
    nonzero = scale != 0
    # the value of largest magnitude is exactly -8 steps: the 16 levels are all used
    assert torch.equal(q.gather(2, groups.abs().argmax(dim=2, keepdim=True)).squeeze(2)[nonzero],
                       torch.full((int(nonzero.sum()),), -8, dtype=torch.int8))
    assert (q[2, 1] == 0).all()
    # rounding: half a step, a whole one where +8 steps is clamped to 7 (the opposite end of the range)
    error = (dequantize(packed, scale).view(6, 3, 32) - groups).abs()
    step = scale.float().abs()[:, :, None]
    assert (error <= torch.where(q == 7, step, step / 2) * (1 + 2**-9) + 1e-12).all()
    # byte j of a group: weight j + 8 in its low nibble, weight 16 + j + 8 in its high one (llama.cpp's q4_0)
    for o, g, j in ((0, 0, 0), (1, 2, 15), (5, 1, 7)):
        byte = int(packed[o, g * 16 + j])
        assert (byte & 0x0F, byte >> 4) == (int(q[o, g, j]) + 8, int(q[o, g, 16 + j]) + 8)


def test_int4_linear_keeps_its_types_and_state_dict_names() -> None:
    lin = torch.nn.Linear(64, 24)
    q = Int4Linear(lin)
    assert set(q.state_dict()) == {"weight_int4", "scale", "bias"}
    q.to(dtype=torch.float32)  # a model's .to(dtype) (a second engine on the model) leaves the fp16 scales alone
    assert q.scale.dtype == torch.float16 and q.weight_int4.dtype == torch.uint8
    q.pack()
    assert q.packed is None  # the kernels read the bytes as stored
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(72, 8))
    quantize(model, "int4")
    assert isinstance(model[0], Int4Linear) and isinstance(model[1], Int8Linear)  # 72: no whole groups of 32


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 31, 64, 65, 200])
@pytest.mark.parametrize("width", [96, 128, 160, 416, 544, 736, 1056])
@pytest.mark.parametrize("bias", [True, False])
def test_int4_products_equal_the_reference(kernel_variant: build.Variant, rows: int, width: int, bias: bool) -> None:
    """In every kernel variant this CPU runs: the dot products' blocks of 2 groups (8 lanes) or 4 (16), in runs of 8
    groups sharing one conversion of their scales, and what is left at a row's end (widths of 3, 4, 5, 13, 17, 23
    and 33 groups: part of a run, whole blocks and a part of one); rows in tiles of 3 or 4 and pieces of
    MAX_ROWS; 42 outputs (tasks of 4 and a remainder of 2):
    within the fp32 bound of the float64 reference. Without the kernels, the product with the dequantized
    weight."""
    torch.manual_seed(rows * width)
    lin = torch.nn.Linear(width, 42, bias=bias)
    q = Int4Linear(lin)
    x = torch.randn(rows, width) * torch.rand(rows, 1) * 4
    x[0, :32] = 0.0  # an all-zero group of a row
    with torch.inference_mode():
        got = q(x).double()
        with kernels.disabled():
            plain = q(x).double()
    want, bound = int4_reference(x, q.stored, q.scale, lin.bias if bias else None)
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()
    dequantized = x.double() @ q.dequantized().double().T + (lin.bias.double() if bias else 0)
    torch.testing.assert_close(plain, dequantized, rtol=1e-5, atol=1e-4)
    # the activations' rounding is small beside the weights': within 1% of the product's size
    assert (got - dequantized).abs().max() <= 0.01 * dequantized.abs().max()
    print(f"int4 rows {rows} width {width}: max error {(got - want).abs().max().item():.2e} "
          f"(bound {bound.min().item():.1e}..{bound.max().item():.1e})")


GEMM_ROWS = [build.INT4_GEMM_MIN_ROWS - 1, build.INT4_GEMM_MIN_ROWS, build.INT4_GEMM_MIN_ROWS + 1, 7, 13, 256, 301]


@pytest.mark.parametrize("rows", sorted({r for r in GEMM_ROWS if r >= 1}))
@pytest.mark.parametrize(("width", "outputs"), [(32, 100), (96, 7), (1056, 61)])
def test_int4_gemm_equals_the_reference(kernel_variant: build.Variant, rows: int, width: int, outputs: int) -> None:
    """Either side of INT4_GEMM_MIN_ROWS (the dot products below, the GEMM from it) and of the GEMM's pieces of 256
    rows, rows not a multiple of its tiles (4 or 3 rows), outputs not a multiple of a task's (48 or 16) or of a
    register's, one group a row or 33: within the fp32 bound of the float64 reference of the integer path."""
    torch.manual_seed(rows * width + outputs)
    lin = torch.nn.Linear(width, outputs)
    q = Int4Linear(lin)
    x = torch.randn(rows, width) * torch.rand(rows, 1) * 4
    x[-1, -32:] = 0.0  # an all-zero group
    with torch.inference_mode():
        got = q(x).double()
    want, bound = int4_reference(x, q.stored, q.scale, lin.bias)
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()


def test_the_gemm_follows_a_weight_changed_in_place_and_an_inference_weight(kernel_variant: build.Variant) -> None:
    """The GEMM multiplies from a packed copy of the weight, made at first use: a weight written in place since (a
    new version) is packed again, and a weight made under inference mode (no version to tell) is packed for each
    call; either way the product is the reference's for the weight as it is now."""
    torch.manual_seed(0)
    a, b = Int4Linear(torch.nn.Linear(96, 61)), Int4Linear(torch.nn.Linear(96, 61))
    x = torch.randn(build.INT4_GEMM_MIN_ROWS + 3, 96)
    with torch.inference_mode():
        a(x)  # packed
    with torch.no_grad():
        a.stored.copy_(b.stored)
        a.scale.copy_(b.scale)
    with torch.inference_mode():
        got = a(x).double()
        fresh = Int4Linear(torch.nn.Linear(96, 61))
        assert fresh.stored.is_inference()
        got_fresh = fresh(x).double()
    want, bound = int4_reference(x, b.stored, b.scale, a.bias)
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()
    want, bound = int4_reference(x, fresh.stored, fresh.scale, fresh.bias)
    assert ((got_fresh - want).abs() <= bound).all(), (got_fresh - want).abs().max()


def test_the_gemm_follows_scales_changed_in_place(kernel_variant: build.Variant) -> None:
    """The packed copy holds the scales beside the nibbles: scales written in place since it was made (the bytes
    unchanged) are packed again too."""
    torch.manual_seed(2)
    a = Int4Linear(torch.nn.Linear(96, 61))
    x = torch.randn(build.INT4_GEMM_MIN_ROWS + 3, 96)
    with torch.inference_mode():
        a(x)  # packed
    with torch.no_grad():
        a.scale.mul_(2)
    with torch.inference_mode():
        got = a(x).double()
    want, bound = int4_reference(x, a.stored, a.scale, a.bias)
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()


@pytest.mark.parametrize("rows", [5, 40])
def test_a_row_with_a_nan_comes_out_nan_and_leaves_the_others(kernel_variant: build.Variant, rows: int) -> None:
    torch.manual_seed(1)
    q = Int4Linear(torch.nn.Linear(160, 40))
    x = torch.randn(rows, 160)
    with torch.inference_mode():
        clean = q(x)
        x[1, 150], x[3, 3] = float("nan"), float("inf")
        poisoned = q(x)
    assert poisoned[[1, 3]].isnan().all()
    others = [m for m in range(rows) if m not in (1, 3)]
    assert torch.equal(poisoned[others], clean[others])


@pytest.mark.parametrize("rows", [3, 40])
def test_the_widest_values_do_not_overflow(kernel_variant: build.Variant, rows: int) -> None:
    """Every weight -8 or +7 steps and every activation +-127 steps over 4096 columns: a lane's int32 sum and the
    unsigned-by-signed byte products (at most 15 * 127 a byte, 2 * 15 * 127 a pair in vpmaddubsw's int16) exact."""
    lin = torch.nn.Linear(4096, 8, bias=False)
    with torch.no_grad():
        lin.weight.fill_(-1.0)
        lin.weight[::2, 1::2] = 0.875  # +7 steps of the scale 1/8
    q = Int4Linear(lin)
    assert int4_values(q.stored).min() == -8 and int4_values(q.stored).max() == 7
    x = torch.full((rows, 4096), 2.0)
    x[1::3] = -2.0
    with torch.inference_mode():
        got = q(x)
    want = x.double() @ q.dequantized().double().T
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("n_embd", [64, 96])
def test_int4_fused_blocks_equal_the_unfused_kernel_path(kernel_variant: build.Variant, n_embd: int) -> None:
    """The fused `Stack` takes int4 products: a 12-token chunk of two rows and a decode step equal `Blocks.forward`
    over the same kernel-backed int4 products (torch's attention and element-wise ops between them), up to a
    product's input rounded to a neighbouring int8 step where the two computed it a few ulps apart."""
    torch.manual_seed(n_embd)
    cfg = GPTConfig(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=n_embd, bias=True)
    model = GPT(cfg).eval()
    quantize(model, "int4")
    kernels.install(model)
    blocks = model.transformer.h
    assert isinstance(blocks, kernels.FusedBlocks)
    assert all(isinstance(m, Int4Linear) for b in blocks for m in (b.attn.c_attn, b.mlp.c_proj))
    rows = torch.tensor([1, 0])
    caches = {name: KVCache(cfg, 2) for name in ("fused", "unfused")}
    with torch.inference_mode():
        for pos in (torch.arange(12).expand(2, -1), torch.full((2, 1), 12)):
            x = torch.randn(2, pos.shape[1], n_embd)
            fused = blocks(x, caches["fused"].step(pos, rows))
            unfused = Blocks.forward(blocks, x, caches["unfused"].step(pos, rows))
            torch.testing.assert_close(fused, unfused, rtol=2e-2, atol=2e-2)
            assert (fused - unfused).abs().mean() < 1e-4  # nearly all equal to fp32 summation order


def test_an_offline_int4_checkpoint_equals_quantizing_at_load_and_an_engine_its_naive_loop(repo, tmp_path) -> None:
    main(["--checkpoint", str(repo / "weights" / "shakespeare-char"), "--out", str(tmp_path / "q4"), "--kind", "int4"])
    assert json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"] == "int4"
    ck = load_checkpoint(tmp_path / "q4")
    at_load = load_checkpoint(repo / "weights" / "shakespeare-char").model
    quantize(at_load, "int4")
    assert sum(isinstance(m, Int4Linear) for m in ck.model.modules()) == 4 * ck.config.n_layer
    assert isinstance(ck.model.lm_head, Int8Linear)  # the head stays int8 (model/quantize, four_bit)
    for (name, a), (_, b) in zip(ck.model.state_dict().items(), at_load.state_dict().items(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    stored = sum(t.numel() * t.element_size() for n, t in ck.model.state_dict().items() if "h." in n and "ln" not in n
                 and "bias" not in n)
    assert stored == ck.config.n_layer * 12 * ck.config.n_embd ** 2 * (0.5 + 2 / 32)  # 4.5 bits a weight
    kernels.load()
    prompt, params = ck.tokenizer.encode("ROMEO:"), SamplingParams(max_new_tokens=24, greedy=True)
    want = [t for t, _ in generate_naive(ck.model, prompt, params, n_vocab=ck.tokenizer.n_vocab)]
    # an fp32 cache as the naive loop has none (fp16 keys moved a near-tie, 0.005 apart in log-probability, at the
    # 9th token)
    engine = Engine(ck, threads=1, kv_cache_dtype="fp32").start()
    try:
        assert engine.generate(prompt, params).token_ids == want
    finally:
        engine.stop()
