"""Shared test fixtures: repository paths, the test data directory, GPT-2's BPE tokenizer built once, a tiny
seeded GPT."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from model import heap
from model.config import GPTConfig
from model.gpt import GPT
from model.testing import random_gpt
from model.tokenizer import BPETokenizer, gpt2_tokenizer
from tests import REPO

# the data the tests read lives beside the repository, never inside it: gpt2-bpe/{vocab.bpe,encoder.json} and
# tinyshakespeare/input.txt under ../shared/data, or under the directory FOLIO_TEST_DATA names (docs/tests.md)
DATA_DIR = Path(os.environ.get("FOLIO_TEST_DATA") or REPO.parent / "shared" / "data")
BPE_DIR = DATA_DIR / "gpt2-bpe"


@pytest.fixture(scope="session")
def repo() -> Path:
    """The repository root."""
    return REPO


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The test data directory (FOLIO_TEST_DATA, else ../shared/data); any file in it may be absent."""
    return DATA_DIR


@pytest.fixture(scope="session")
def bpe_dir() -> Path:
    """The folder holding GPT-2's vocab.bpe and encoder.json (it may be absent; `gpt2_tok` skips then)."""
    return BPE_DIR


@pytest.fixture(scope="session")
def gpt2_tok() -> BPETokenizer:
    """GPT-2's BPE from the local files (built once per session; tiktoken never touches the network)."""
    missing = [name for name in ("vocab.bpe", "encoder.json") if not (BPE_DIR / name).is_file()]
    if missing:
        pytest.skip(f"GPT-2 BPE files {missing} not found in {BPE_DIR} (docs/tests.md; FOLIO_TEST_DATA)")
    return gpt2_tokenizer(BPE_DIR)


@pytest.fixture
def tiny_config() -> GPTConfig:
    return GPTConfig(block_size=32, vocab_size=65, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)


@pytest.fixture
def tiny_model(tiny_config: GPTConfig) -> GPT:
    """A randomly initialised GPT in eval mode, the same weights every time (seeded)."""
    return random_gpt(tiny_config, seed=1234)


@pytest.fixture
def hf_gpt2(tmp_path_factory: pytest.TempPathFactory):
    """Factory: a random GPT2LMHeadModel (eval mode) saved with save_pretrained -> (directory, model).

    Every parameter is perturbed after init so that biases and LayerNorm gains are not their trivial 0 and 1
    and a mapping mistake in them shows up in the logits. Nothing is downloaded.
    """
    transformers = pytest.importorskip("transformers")

    def make(*, seed: int = 0, **overrides: object) -> tuple[Path, torch.nn.Module]:
        settings = dict(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=1000)
        settings.update(overrides)
        last = int(settings["vocab_size"]) - 1  # keep HF's bos/eos ids inside a small vocabulary
        config = transformers.GPT2Config(**settings, bos_token_id=last, eos_token_id=last)
        torch.manual_seed(seed)
        hf = transformers.GPT2LMHeadModel(config).eval()
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.05 * torch.randn_like(p))
        directory = tmp_path_factory.mktemp("hf-gpt2")
        hf.save_pretrained(directory)
        return directory, hf

    return make


def make_peft_adapter(directory: Path, hf_model: torch.nn.Module | None = None, *, n_layer: int = 2, n_head: int = 2,
                      n_embd: int = 32, vocab_size: int = 65, r: int = 4, alpha: float = 8.0, seed: int = 0,
                      targets: tuple[str, ...] = ("c_attn", "c_proj", "c_fc"), use_rslora: bool = False,
                      ) -> tuple[Path, torch.nn.Module]:
    """A LoRA adapter made by PEFT itself for a GPT2LMHeadModel (`hf_model`, else a random one of this shape: an
    adapter depends on the base's shape only), its lora_B random (PEFT starts it at zero, which would change
    nothing), saved with save_pretrained to `directory` -> (directory, the PEFT model, in eval mode)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    if hf_model is None:
        config = transformers.GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=64,
                                         vocab_size=vocab_size, bos_token_id=0, eos_token_id=0)
        torch.manual_seed(seed)
        hf_model = transformers.GPT2LMHeadModel(config).eval()
    lora_config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), fan_in_fan_out=True,
                                  lora_dropout=0.0, use_rslora=use_rslora)
    model = peft.get_peft_model(hf_model, lora_config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(directory)
    return directory, model


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """The heap frozen for the garbage collector as a server's is (model/heap.py), given back after the test: the
    rest of the suite runs on a heap like any test process's."""
    heap.freeze()
    try:
        yield
    finally:
        heap.unfreeze()
