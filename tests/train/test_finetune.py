"""Fine-tuning: `--init-from` continues a model with its own shape and tokenizer; instruction data trains only on
what the assistant says (a context token gets no gradient); `--lora` trains an adapter alone (the base untouched,
AdamW's state for the adapter only), learns a new text, resumes exactly and writes PEFT's format."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.checkpoint import load_checkpoint, read_config
from model.config import GPTConfig
from model.lora.adapter import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, LoRAConfig, read_adapter, trainable_parameters
from model.train.__main__ import main
from model.train.config import resolve_config
from model.train.instructions import IGNORE_INDEX, prepare_instructions
from model.train.optim import adamw_state_bytes
from model.train.trainer import Trainer, lm_loss
from tests import REPO
from tests.train.runs import loss_rows, metrics, tiny_argv, train, write_file

BUNDLED = REPO / "weights" / "shakespeare-char"
SENTENCES = ["the cat sat on the mat.", "a dog ran to the park.", "we sing of the sea.", "my hat is red and old."]
# a short run's settings; the shape is the base's
RUN = ["--batch-size", "8", "--eval-interval", "10", "--eval-iters", "2", "--log-interval", "5", "--warmup-iters", "5",
       "--dropout", "0", "--device", "cpu", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def base(text_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny character model trained 40 steps on Shakespeare: the model the tests fine-tune."""
    out = tmp_path_factory.mktemp("base") / "run"
    train(tiny_argv(text_file, out))
    return out


@pytest.fixture(scope="module")
def new_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Text unlike Shakespeare, in characters the base knows: four sentences in a seeded order."""
    rng = random.Random(0)
    return write_file(tmp_path_factory.mktemp("text") / "new.txt",
                      "\n".join(rng.choice(SENTENCES) for _ in range(800)) + "\n")


def _argv(data: Path, out: Path, base: Path, *extra: str, max_iters: int = 20) -> list[str]:
    return ["--data", str(data), "--out", str(out), "--init-from", str(base), *RUN, "--max-iters", str(max_iters),
            *extra]


# -- --init-from -------------------------------------------------------------------------------------------------


def test_init_from_continues_the_base_with_its_shape_and_tokenizer(base: Path, new_text: Path, tmp_path: Path) -> None:
    ck = load_checkpoint(base)
    cfg, _ = resolve_config(_argv(new_text, tmp_path / "ft", base))
    trainer = Trainer(cfg)
    assert trainer.model_config == ck.config  # dropout 0 in both: the shape whole
    start = trainer.model.state_dict()
    assert all(torch.equal(start[k], v) for k, v in ck.model.state_dict().items())
    trainer.run()
    tuned = load_checkpoint(tmp_path / "ft")
    assert tuned.config == ck.config and tuned.tokenizer.chars == ck.tokenizer.chars
    assert tuned.training["base"]["source_sha256"] == ck.meta["weights_sha256"]
    assert tuned.training["train_config"]["n_embd"] == 32 and tuned.training["train_config"]["tokenizer"] == "char"
    assert not torch.equal(tuned.model.transformer.wte.weight, ck.model.transformer.wte.weight)  # all weights train


@pytest.mark.parametrize("flag", [["--n-embd", "64"], ["--tokenizer", "gpt2"], ["--block-size", "16"]])
def test_a_shape_flag_beside_init_from_is_one_error_line(base: Path, new_text: Path, tmp_path: Path, flag: list[str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_argv(new_text, tmp_path / "ft", base, *flag)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {flag[0]} cannot be set with --init-from"), err
    assert not (tmp_path / "ft").exists()


def test_lora_without_a_base_is_an_error(new_text: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(tiny_argv(new_text, tmp_path / "out", "--lora")) == 2
    assert "--lora trains an adapter on a model: name it with --init-from" in capsys.readouterr().err


# -- instruction data --------------------------------------------------------------------------------------------

CONVERSATION = {"messages": [
    {"role": "system", "content": "be brief."}, {"role": "user", "content": "who art thou?"},
    {"role": "assistant", "content": "a king."}, {"role": "user", "content": "and she?"},
    {"role": "assistant", "content": "the queen."}, {"role": "user", "content": "so."}]}
PAIR = {"prompt": "the cat sat on the", "completion": " mat."}
SHORT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho."}]}  # 26 characters


def _jsonl(path: Path, records: list[dict]) -> Path:
    return write_file(path, "".join(json.dumps(r) + "\n" for r in records))


def test_only_the_assistants_tokens_are_labelled(base: Path, tmp_path: Path) -> None:
    tok = load_checkpoint(base).tokenizer
    ds = prepare_instructions(_jsonl(tmp_path / "d.jsonl", [CONVERSATION, PAIR, PAIR]), tokenizer=tok, block_size=128)
    conversation, pair = ds.train
    trained = tok.decode(conversation.labels[conversation.labels != IGNORE_INDEX].tolist())
    assert trained == "a king.\n\nthe queen.\n\n"  # the default template's turns; the last user turn is dropped
    rendered = tok.decode(conversation.ids.tolist())
    assert rendered.startswith("SYSTEM:\nbe brief.\n\nUSER:\nwho art thou?\n\nASSISTANT:\na king.")
    assert tok.decode(pair.labels[pair.labels != IGNORE_INDEX].tolist()) == " mat."
    assert len(ds.val) == 1


def test_a_masked_token_contributes_no_gradient(base: Path, tmp_path: Path) -> None:
    ck = load_checkpoint(base)
    ds = prepare_instructions(_jsonl(tmp_path / "d.jsonl", [SHORT, PAIR, PAIR]), tokenizer=ck.tokenizer,
                              block_size=32)
    x, y = ds.batch("train", 4, 32, torch.Generator().manual_seed(0))
    last = (y != IGNORE_INDEX).float().cumsum(-1).argmax(-1)  # each row's final labelled position
    context = (y == IGNORE_INDEX) & (torch.arange(y.shape[1]) < last[:, None])  # the prompts' positions
    assert context.sum() >= 4 * 17  # "the cat sat on the" and "USER:\nhi\n\nASSISTANT:\n" are context
    logits = ck.model(x)
    logits.retain_grad()
    lm_loss(logits, y).backward()
    grad = logits.grad.abs().sum(-1)  # (B, T)
    assert torch.all(grad[y == IGNORE_INDEX] == 0)  # context and padding: exactly nothing
    assert torch.all(grad[y != IGNORE_INDEX] > 0)
    # and the weights' gradient is the same whatever a masked position's next token would have been
    wte = ck.model.transformer.wte.weight
    first = wte.grad.clone()
    wte.grad = None
    x2 = x.clone()
    x2[y == IGNORE_INDEX] = 0  # the inputs matter, so only those after a row's final label (its padding) change
    for row in range(x.shape[0]):
        x2[row, : last[row] + 1] = x[row, : last[row] + 1]
    lm_loss(ck.model(x2), y).backward()
    assert torch.equal(wte.grad, first)


def test_an_instruction_run_trains_through_the_same_loop(base: Path, tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "d.jsonl", [SHORT, PAIR] * 10)
    train(_argv(data, tmp_path / "ft", base, max_iters=10))
    assert [r["step"] for r in metrics(tmp_path / "ft") if "val_loss" in r] == [10]
    assert (tmp_path / "ft" / "loss.png").is_file()
    assert read_config(tmp_path / "ft")["training"]["dataset"] == "d.jsonl"


# -- LoRA --------------------------------------------------------------------------------------------------------


def test_lora_learns_a_new_text_and_leaves_the_base_alone(new_text: Path, tmp_path: Path) -> None:
    """The bundled model, a rank-8 adapter on every projection, 30 steps: the new text's validation loss falls from
    the base's (measured before the first step: a fresh adapter is the identity) to a fraction of it."""
    out = tmp_path / "adapter"
    cfg, _ = resolve_config(_argv(new_text, out, BUNDLED, "--lora", "--lora-rank", "8", "--lora-alpha", "16",
                                  "--lora-targets", "c_attn,c_proj,c_fc", "--learning-rate", "1e-2",
                                  "--batch-size", "4", max_iters=30))
    trainer = Trainer(cfg)
    before = trainer.estimate_loss()["val"]
    result = trainer.run()
    after = result["best_val"]
    print(f"bundled model, LoRA r=8: validation loss on the new text {before:.3f} -> {after:.3f}")
    assert after < 0.25 * before, (before, after)

    bundled = load_checkpoint(BUNDLED)
    lora = LoRAConfig(r=8, lora_alpha=16.0, target_modules=("c_attn", "c_proj", "c_fc"))
    n_adapter = trainable_parameters(bundled.config, lora)
    trained = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in trained) == n_adapter == 6 * 8 * (192 * 4 + 192 * 2 + 192 * 5 + 192 * 5)
    state = [t for s in trainer.optimizer.state.values() for t in s.values()]
    assert sum(t.numel() * t.element_size() for t in state) == adamw_state_bytes(n_adapter, len(trained))
    for name, p in bundled.model.named_parameters():  # the base did not move (an adapted linear's is `.base`)
        assert torch.equal(trainer.model.get_parameter(re.sub(r"\.(c_attn|c_proj|c_fc)\.", r".\1.base.", name)), p)

    assert sorted(p.name for p in out.iterdir()) == [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, "data", "last",
                                                     "loss.png", "metrics.jsonl"]
    adapter = read_adapter(out)
    assert adapter.config == lora
    assert adapter.folio["training"]["base"]["source_sha256"] == bundled.meta["weights_sha256"]
    assert adapter.folio["training"]["val_loss"] == after


def test_gpt2_124m_optimizer_state_under_lora() -> None:
    """What the docs state: AdamW's state for GPT-2 small's shape, fully fine-tuned and with a rank-8 adapter on
    c_attn (PEFT's default), from the parameter counts (`adamw_state_bytes`, checked against a real optimizer above)."""
    gpt2 = GPTConfig(vocab_size=50257)
    assert gpt2.num_params() == 124_439_808
    full = adamw_state_bytes(gpt2.num_params(), 2 + 12 * 12 + 2)  # wte, wpe; 12 tensors a block; ln_f
    lora = adamw_state_bytes(trainable_parameters(gpt2, LoRAConfig(r=8)), 2 * 12)
    assert (full, lora) == (995_519_056, 2_359_392)


def test_lora_resume_is_exact(base: Path, new_text: Path, tmp_path: Path) -> None:
    """Stopped at step 10 and resumed, a LoRA run with adapter dropout ends with the uninterrupted run's adapter."""
    lora = ["--lora", "--lora-dropout", "0.1", "--lora-targets", "c_attn,mlp.c_proj", "--learning-rate", "1e-2"]
    train(_argv(new_text, tmp_path / "full", base, *lora))
    train(_argv(new_text, tmp_path / "split", base, *lora, "--stop-after", "10"))
    assert read_adapter(tmp_path / "split" / "last").folio["training"]["steps"] == 10
    train(["--resume", "--out", str(tmp_path / "split")])
    for sub in ("last", "."):
        a = load_file(tmp_path / "full" / sub / ADAPTER_WEIGHTS_FILE)
        b = load_file(tmp_path / "split" / sub / ADAPTER_WEIGHTS_FILE)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sub
    assert loss_rows(tmp_path / "full") == loss_rows(tmp_path / "split")
