"""The CPU decode kernels against torch: `linear` against F.linear, the one-token attention against the masked
SDPA path (each in every variant this CPU runs: `kernel_variant`), and the fallbacks that must hand work back to
torch untouched."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from torch.nn import functional as F

from model import kernels
from model.config import GPTConfig
from model.gpt import GPT, KVCache
from model.kernels import build, loader, ops
from tests.model.conftest import with_kernels_and_without


def run_python(code: str, cwd) -> subprocess.CompletedProcess:  # noqa: ANN001
    """`code` in a fresh interpreter (a fresh kernel pool), from the repository root."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 32, 64])
@pytest.mark.parametrize("n_out, n_in", [(65, 192), (101, 64), (2304, 768), (8, 3072), (7, 8)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_torch(kernel_variant: build.Variant, rows: int, n_out: int, n_in: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + n_out)
    x = torch.randn(rows, n_in, generator=g)
    w = torch.randn(n_out, n_in, generator=g) / n_in**0.5
    b = torch.randn(n_out, generator=g) if bias else None
    with torch.inference_mode():
        got = kernels.linear(x, w, b)
        ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    assert got.shape == (rows, n_out)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [kernels.PACKED_MIN_ROWS, 6, 7, 13, 32, kernels.MAX_ROWS])
@pytest.mark.parametrize("n_out, n_in", [(65, 192), (101, 60), (2304, 768), (16, 3072), (7, 8)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_torch(kernel_variant: build.Variant, rows: int, n_out: int, n_in: int,
                                     bias: bool) -> None:
    """Weights packed in panels of 16 outputs (a partial last panel; any input width) give F.linear's result."""
    g = torch.Generator().manual_seed(rows * 1000 + n_out)
    model = torch.nn.Sequential(torch.nn.Linear(n_in, n_out, bias=bias))
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(n_out, n_in, generator=g) / n_in**0.5)
    assert kernels.install(model).packed_bytes == -(-n_out // 16) * 16 * n_in * 4
    layer = model[0]
    assert isinstance(layer, kernels.KernelLinear) and layer.current_packed() is not None
    x = torch.randn(rows, n_in, generator=g)
    with torch.inference_mode():
        got = layer(x)
        ref = F.linear(x.double(), layer.weight.double(), None if not bias else layer.bias.double()).float()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_packed_copy_is_not_used_once_the_weight_changes(built: None) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 40))
    kernels.install(model)
    layer = model[0]
    x = torch.randn(8, 64)
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # in place: the packed copy is now stale
    assert layer.current_packed() is None
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def new_threads_count() -> int:
    """torch's thread count as a thread started now sees it (what earlier tests' servers left it at)."""
    seen: list[int] = []
    other = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    other.start()
    other.join()
    return seen[0]


def test_serial_torch_ops_is_per_thread_and_restores(built: None) -> None:
    threads, elsewhere = torch.get_num_threads(), new_threads_count()
    seen = []
    with kernels.serial_torch_ops():
        seen.append(torch.get_num_threads())
        seen.append(new_threads_count())
        x, w = torch.randn(32, 64), torch.randn(16, 64)
        with torch.inference_mode():
            torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert seen[0] == 1
    assert seen[1] == elsewhere  # another thread keeps its count
    assert torch.get_num_threads() == threads


def test_linear_keeps_leading_dims(built: None) -> None:
    x, w = torch.randn(2, 3, 64), torch.randn(16, 64)
    with torch.inference_mode():
        torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        assert kernels.linear(x, w).shape == (2, 3, 16)


def test_linear_hands_other_cases_to_torch(built: None) -> None:
    """More rows than MAX_ROWS, autograd, widths not a multiple of 8, other dtypes: exactly F.linear."""
    w = torch.randn(24, 64)
    many = torch.randn(kernels.MAX_ROWS + 1, 64)
    with torch.inference_mode():
        assert torch.equal(kernels.linear(many, w), F.linear(many, w))
        odd_x, odd_w = torch.randn(1, 60), torch.randn(24, 60)
        assert torch.equal(kernels.linear(odd_x, odd_w), F.linear(odd_x, odd_w))
        x64, w64 = torch.randn(1, 64, dtype=torch.float64), w.double()
        assert torch.equal(kernels.linear(x64, w64), F.linear(x64, w64))
    x = torch.randn(1, 64, requires_grad=True)
    y = kernels.linear(x, w)  # grad enabled: torch's op, so training still gets gradients
    assert torch.equal(y, F.linear(x, w)) and y.requires_grad


def test_disabled_restores(built: None) -> None:
    loaded = f"loaded ({kernels.variant().name})"
    with kernels.disabled():
        assert kernels.status() != loaded
    assert kernels.status() == loaded


@pytest.mark.parametrize("setting", ["1", "0", "avx2", "avx2vnni", "avx512", "avx512vnni", "sse"])
def test_folio_cpu_kernels_picks_a_variant_or_says_why_not(setting: str) -> None:
    variant, why_not = loader.chosen_variant(setting)
    flags = build.cpu_flags()
    if setting == "1":
        assert variant == build.best_variant() and why_not is None
    elif setting in ("avx2", "avx2vnni", "avx512", "avx512vnni"):
        runs = {v.name: v.cpu_flags <= flags for v in build.VARIANTS}[setting]
        assert (variant is not None and variant.name == setting) if runs else "this CPU lacks" in why_not
    else:
        want = "turned off" if setting == "0" else "none of 0, 1, avx2, avx2vnni, avx512, avx512vnni"
        assert variant is None and want in why_not


def test_using_a_variant_makes_it_the_processs_within_the_block(built: None) -> None:
    """`loader.using(name)` (the kernel_variant fixture's): that variant's library within the block, the one
    `load()` chose after it, also after an error inside; a variant this CPU cannot run is refused, naming why."""
    chosen = kernels.library()
    for variant in build.VARIANTS:
        if not variant.cpu_flags <= build.cpu_flags():
            with pytest.raises(ValueError, match="this CPU lacks"):
                with loader.using(variant.name):
                    pass
            continue
        with pytest.raises(KeyError), loader.using(variant.name) as used:
            assert used == variant and kernels.variant() == variant and kernels.status() == f"loaded ({variant.name})"
            assert kernels.library().__name__ == build.library_name(variant)
            raise KeyError("inside")
        assert kernels.library() is chosen
    with pytest.raises(ValueError, match="none of 0, 1, avx2"):
        with loader.using("sse"):
            pass


def same_cache(kv: torch.dtype) -> float:
    """The tolerance between the kernels and torch's path over caches of type `kv`: summation order alone for fp32;
    for fp16 also a key or value the two computed a rounding apart that lands on neighbouring halves."""
    return 1e-5 if kv == torch.float32 else 1e-4


@pytest.mark.parametrize("n_head, n_embd", [(4, 64), (6, 192), (2, 16), (2, 256), (1, 72)])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("kv", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_decode_attention_matches_sdpa_path(kernel_variant: build.Variant, n_head: int, n_embd: int, packed: bool,
                                            kv: torch.dtype) -> None:
    """Rows at different positions in non-contiguous cache rows: decode steps through the kernels (all blocks in
    one `Stack` call; the products from packed weights or not) give the logits of torch's masked-SDPA path over a
    cache of the same type and (fp32) of the full forward. Head sizes 8-128, so every width of the attention's
    register blocks; an fp16 cache's keys and values are rounded as written, which both paths do."""
    torch.manual_seed(n_embd)
    cfg = GPTConfig(block_size=48, vocab_size=67, n_layer=2, n_head=n_head, n_embd=n_embd, bias=True)
    model = GPT(cfg).eval()
    assert (kernels.install(model, pack=packed).packed_bytes > 0) == packed
    B, start, steps = 5, torch.tensor([3, 11, 1, 7, 30]), 12
    idx = torch.randint(0, cfg.vocab_size, (B, int(start.max()) + steps))
    rows = torch.tensor([5, 0, 2, 1, 4])
    with torch.inference_mode():
        full = model(idx)
        results = {}
        for name in ("kernel", "torch"):
            cache = KVCache(cfg, 6, dtype=kv)
            logits = []
            for b in range(B):  # prefill each row's own prompt
                model(idx[b : b + 1, : start[b]], cache.step(torch.arange(int(start[b]))[None], rows[b : b + 1]))
            for t in range(steps):
                pos = (start + t)[:, None]
                tok = idx.gather(1, pos)
                if name == "kernel":
                    out = model(tok, cache.step(pos, rows))
                else:
                    with kernels.disabled():
                        out = model(tok, cache.step(pos, rows))
                logits.append(out[:, 0])
            results[name] = torch.stack(logits, 1)
        expected = torch.stack([full[b, start[b] : start[b] + steps] for b in range(B)])
    # a key computed in another summation order may round to the neighbouring fp16 (a few in thousands)
    torch.testing.assert_close(results["kernel"], results["torch"], rtol=same_cache(kv), atol=same_cache(kv))
    # fp16's rounding moves the logits by ~1e-3 from the fp32 forward's; fp32's by summation order only
    tol = 1e-5 if kv == torch.float32 else 1e-2
    torch.testing.assert_close(results["kernel"], expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("kv", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_prompt_chunks_through_the_fused_blocks(kernel_variant: build.Variant, packed: bool, kv: torch.dtype) -> None:
    """A chunked prefill of three rows (several tokens per row, so tokens of one row read keys written in the same
    call, and a second chunk after the first) through the fused blocks gives the logits of torch's masked-SDPA
    path and of the full forward."""
    torch.manual_seed(1)
    cfg = GPTConfig(block_size=32, vocab_size=61, n_layer=2, n_head=4, n_embd=64, bias=True)
    model = GPT(cfg).eval()
    kernels.install(model, pack=packed)
    B, first, second = 3, 7, 9
    assert B * (first + second) > B * second and B * max(first, second) <= kernels.FUSED_MAX_TOKENS
    idx = torch.randint(0, cfg.vocab_size, (B, first + second))
    rows = torch.tensor([2, 0, 3])
    def chunks() -> torch.Tensor:
        cache = KVCache(cfg, 4, dtype=kv)
        a = model(idx[:, :first], cache.step(torch.arange(first).expand(B, -1), rows))
        b = model(idx[:, first:], cache.step(torch.arange(first, first + second).expand(B, -1), rows))
        return torch.cat([a, b], dim=1)

    with torch.inference_mode():
        got, want = with_kernels_and_without(chunks)
        full = model(idx)
    torch.testing.assert_close(got, want, rtol=same_cache(kv), atol=same_cache(kv))
    tol = 1e-5 if kv == torch.float32 else 1e-2
    torch.testing.assert_close(got, full, rtol=tol, atol=tol)


@pytest.mark.parametrize("n_head, n_embd", [(2, 16), (3, 72), (4, 256), (2, 144)])
@pytest.mark.parametrize("kv", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_long_prompt_chunks_attend_in_blocks(kernel_variant: build.Variant, n_head: int, n_embd: int,
                                             kv: torch.dtype) -> None:
    """Chunks of 37 and 63 tokens of two rows and a 5-token chunk of a third in one forward, then the rest: runs of
    at least 8 tokens of a row attend in blocks (several key blocks, a run starting past 0, head sizes 8-64 and
    not a multiple of 16), the short one token by token; the logits equal torch's path and the full forward."""
    torch.manual_seed(n_embd)
    cfg = GPTConfig(block_size=128, vocab_size=61, n_layer=2, n_head=n_head, n_embd=n_embd, bias=True)
    model = GPT(cfg).eval()
    kernels.install(model)
    idx = torch.randint(0, cfg.vocab_size, (3, 100))
    rows = torch.tensor([1, 2, 0])
    def chunks() -> tuple[torch.Tensor, torch.Tensor]:
        cache = KVCache(cfg, 3, dtype=kv)
        a = model(idx[:2, :37], cache.step(torch.arange(37).expand(2, -1), rows[:2]))
        c = model(idx[2:, :5], cache.step(torch.arange(5)[None], rows[2:]))
        b = model(idx[:2, 37:], cache.step(torch.arange(37, 100).expand(2, -1), rows[:2]))
        return torch.cat([a, b], dim=1), c

    with torch.inference_mode():
        got, want = with_kernels_and_without(chunks)
        full = model(idx)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=same_cache(kv), atol=same_cache(kv))
    tol = 1e-5 if kv == torch.float32 else 1e-2
    torch.testing.assert_close(got[0], full[:2], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1], full[2:, :5], rtol=tol, atol=tol)


@pytest.mark.parametrize("n_embd", [72, 192])
@pytest.mark.parametrize("kv", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_each_kernel_variants_fused_blocks_equal_torchs(kernel_variant: build.Variant, n_embd: int,
                                                        kv: torch.dtype) -> None:
    """Every variant this CPU runs (its own vector width: 8 or 16 lanes), the others skipped naming the flags it
    lacks: a 40-token chunk of each of two rows (attention in blocks), then a decode step of both, through that
    variant's `Stack`, against torch's blocks over a cache of the same type; head sizes 24 (not a multiple of 16)
    and 64."""
    lib = kernels.library()
    torch.manual_seed(n_embd)
    cfg = GPTConfig(block_size=64, vocab_size=50, n_layer=2, n_head=3, n_embd=n_embd, bias=True)
    model = GPT(cfg).eval()
    kernels.install(model)
    stack = model.transformer.h.stack(lib)
    rows = torch.tensor([2, 0])
    caches = {name: KVCache(cfg, 3, dtype=kv) for name in ("kernel", "torch")}
    with torch.inference_mode():
        for pos in (torch.arange(40).expand(2, -1), torch.full((2, 1), 40)):
            x = torch.randn(2, pos.shape[1], n_embd)
            step = caches["kernel"].step(pos, rows)
            got = stack.forward(x.reshape(-1, n_embd), caches["kernel"].k, caches["kernel"].v, step.token_rows,
                                step.token_pos)
            with kernels.disabled():
                want = model.transformer.h(x, caches["torch"].step(pos, rows))
            torch.testing.assert_close(got.view_as(want), want, rtol=same_cache(kv), atol=same_cache(kv))


@pytest.mark.parametrize("shape", [(32, 50257), (1, 50257), (5, 65), (3, 7), (2, 16)])
def test_row_argmax_and_logsumexp_equal_torchs(kernel_variant: build.Variant, shape: tuple[int, int]) -> None:
    """The sampler's one pass per row: the first of tied largest values (as `argmax`), -inf entries (a padded
    vocabulary), widths not a multiple of the vector; a row with an infinity or a NaN is torch's."""
    torch.manual_seed(shape[1])
    x = torch.randn(*shape) * 5
    x[0, 3] = x[0, -1] = x[0].max() + 1  # a tie: the first wins
    x[-1, ::2] = float("-inf")
    ids, lse = ops.row_argmax_logsumexp(x)
    assert torch.equal(ids, x.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(x, dim=-1))
    x[0, 1] = float("nan")
    ids, lse = ops.row_argmax_logsumexp(x)
    assert torch.equal(ids, x.argmax(dim=-1)) and torch.isnan(lse[0])
    usable = x[:, : shape[1] - 1]  # rows apart by more than their width: a padded vocabulary's usable ids, a view
    ids, lse = ops.row_argmax_logsumexp(usable)
    assert torch.equal(ids, usable.argmax(dim=-1)) and torch.isnan(lse[0])
    torch.testing.assert_close(lse[1:], torch.logsumexp(usable[1:], dim=-1))


def test_a_decode_step_with_many_rows(kernel_variant: build.Variant) -> None:
    """40 rows of a 512-wide block: GELU is split over the kernel pool's threads, the products use packed
    weights; the step's output equals torch's path."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=8, n_embd=512, bias=True)
    model = GPT(cfg).eval()
    kernels.install(model)
    B = 40
    idx = torch.randint(0, cfg.vocab_size, (B, 6))
    with torch.inference_mode():
        out = {}
        for name in ("kernel", "torch"):
            cache = KVCache(cfg, B)
            model(idx[:, :5], cache.step(torch.arange(5).expand(B, -1)))
            step = idx[:, 5:]
            pos = torch.full((B, 1), 5)
            if name == "kernel":
                out[name] = model(step, cache.step(pos))
            else:
                with kernels.disabled():
                    out[name] = model(step, cache.step(pos))
        full = model(idx)[:, 5:]
    torch.testing.assert_close(out["kernel"], out["torch"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["kernel"], full, rtol=1e-5, atol=1e-5)


def test_decode_attention_refuses_bad_rows(built: None) -> None:
    k = torch.zeros(2, 2, 8, 8)
    qkv = torch.randn(1, 48)
    with pytest.raises(RuntimeError, match="row or position"):
        kernels.decode_attention(qkv, k, k.clone(), torch.tensor([2]), torch.tensor([0]), 2)
    with pytest.raises(RuntimeError, match="row or position"):
        kernels.decode_attention(qkv, k, k.clone(), torch.tensor([0]), torch.tensor([8]), 2)


def test_built_library_is_reused(built: None, repo) -> None:  # noqa: ANN001
    """A second process finds the built library and imports it without compiling (no compiler needed)."""
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO); from model import kernels; "
            "import torch.utils.cpp_extension as c; c.load = None; "  # compiling would now fail
            "sys.exit(0 if kernels.load() else 1)")
    r = run_python(code, repo)
    assert r.returncode == 0, r.stderr
    assert "building" not in r.stderr


# a fresh interpreter with the kernels loaded and a product big enough to use the pool (two threads): `check()`.
# The reference is computed up front: torch's matmul uses OpenMP, which a forked child cannot use after its parent
# did (GNU OpenMP is not fork-safe), and the fork test is about the kernels' pool only.
POOL_SETUP = (
    "import torch; from model import kernels; assert kernels.load(); torch.set_num_threads(2)\n"
    "torch.set_grad_enabled(False); w, x = torch.randn(576, 192), torch.randn(20, 192); ref = x @ w.t()\n"
    "def check():\n"
    "    torch.testing.assert_close(kernels.linear(x, w), ref, rtol=1e-5, atol=1e-4)\n"
)


def test_pool_serves_a_first_call_from_a_new_thread(built: None, repo) -> None:  # noqa: ANN001
    """A fresh process whose first kernel call comes from a thread other than the main one (the engine's): the
    pool's worker starts while the first job is published, and must not miss it (that hung once)."""
    code = POOL_SETUP + (
        "import threading\n"
        "def run():\n"
        "    torch.set_grad_enabled(False)\n"
        "    for _ in range(200):\n"
        "        check()\n"
        "t = threading.Thread(target=run); t.start(); t.join()\n"
        "print('pool threads', kernels.library().pool_threads())\n"
    )
    r = run_python(code, repo)
    assert r.returncode == 0 and "pool threads 2" in r.stdout, r.stderr


def test_pool_works_in_a_forked_child(built: None, repo) -> None:  # noqa: ANN001
    """A child forked after the pool started has none of its worker threads; its first call makes its own pool
    instead of waiting forever for workers that are not there."""
    code = POOL_SETUP + (
        "import os\n"
        "check()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    check()\n"
        "    os._exit(0)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print('child exit', os.waitstatus_to_exitcode(status))\n"
    )
    r = run_python(code, repo)
    assert r.returncode == 0 and "child exit 0" in r.stdout, r.stderr


def test_use_threads_sets_the_calling_threads_counts_and_grows_the_pool(built: None) -> None:
    """An engine's thread asks for its model's thread count: its torch ops get it, and the pool grows to it where an
    earlier, smaller model made the pool (two models in one process). In a process of its own: the pool never
    shrinks."""
    code = """if True:
        import threading, torch
        from model import kernels
        kernels.load()
        torch.set_num_threads(1)
        seen = []
        def engine_thread(n):
            kernels.use_threads(n)
            seen.append((torch.get_num_threads(), kernels.library().pool_threads()))
        for n in (1, 3):
            worker = threading.Thread(target=engine_thread, args=(n,))
            worker.start()
            worker.join()
        print(seen)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[(1, 1), (3, 3)]"
