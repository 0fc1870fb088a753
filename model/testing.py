"""Tiny checkpoints for tests and benchmarks, written with `save_checkpoint` (shared by `tests/` and `bench/`, as
`torch.testing` is by torch's own tests; `app/testing.py` holds the server-side aids).

- `random_gpt`: the one tiny-model factory under all of them: a seeded random GPT in eval mode, the same weights
  for the same arguments, its matrices optionally scaled up from GPT-2's init so that logits are spread out.
- `make_char_checkpoint`: a seeded random GPT (block_size 64, 2 layers, n_embd 32) over a character tokenizer of
  printable ASCII plus newline (or the characters given). Weights are scaled up from GPT-2's init so that logits
  are spread out: greedy output must not hang on a near tie that the KV-cache path and the naive loop could break
  differently. A character model has no EOS: a request makes exactly its max_new_tokens unless a stop string
  ends it, and one token is one character, so token counts can be checked from the text alone.
- `make_bpe_checkpoint`: GPT-2's BPE (vocab_size 50304, n_embd 16, 1 layer) with weights set by hand so that,
  whatever the prompt, greedy decoding cycles through single-byte tokens that spell "😀中" (F0 9F 98 80 E4 B8
  AD). Every character is split across tokens, which is what UTF-8-safe streaming must handle; a random model
  would mostly emit byte soup where U+FFFD is the right answer.
- `make_gpt2_shaped_checkpoint`: a seeded random GPT over GPT-2's BPE with GPT-2's vocabulary (50304), GPT-2
  small's shape by default (smaller for tests), its matrices scaled up like the char model's so that attention is
  peaked rather than uniform.
- `tiny_checkpoint`: the engine tests' model, in memory: a seeded random GPT over 65 characters (letters,
  punctuation, CJK) whose vocabulary is padded to 72, like GPT-2's 50257 -> 50304, with the padded rows of the
  LM head scaled so that only masking keeps them out; optionally one character doubles as EOS.
"""

from __future__ import annotations

from pathlib import Path

import torch

from model.checkpoint import Checkpoint, save_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.tokenizer import BPETokenizer, CharTokenizer

CHARS = sorted({chr(c) for c in range(32, 127)} | {"\n"})  # 96 characters
TRAINING = {"note": "random weights for the app tests", "iters": 0, "seed": 1234, "dataset": "none"}
EMOJI_CJK = "😀中"
# the engine tests' 65 characters: letters, punctuation and CJK, so that text is not all ASCII
ENGINE_CHARS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(" .,;!?\n") + [chr(0x4E00 + i) for i in range(32)]
ENGINE_VOCAB_SIZE = 72  # padded past the tokenizer, like GPT-2's 50257 -> 50304: ids 65..71 must never come out


def random_gpt(config: GPTConfig, *, seed: int, scale: float = 1.0) -> GPT:
    """A GPT initialised from `torch.manual_seed(seed)`, in eval mode, every matrix (not the biases and LayerNorm
    gains) multiplied by `scale`."""
    torch.manual_seed(seed)
    model = GPT(config).eval()
    if scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(scale)
    return model


def make_char_checkpoint(directory: Path, *, seed: int = 1234, chars: list[str] = CHARS, n_layer: int = 2,
                         n_embd: int = 32) -> Path:
    """The seeded random character-level checkpoint, written to `directory` (returned); larger with more layers
    or a wider embedding (memory tests)."""
    config = GPTConfig(block_size=64, vocab_size=len(chars), n_layer=n_layer, n_head=2, n_embd=n_embd)
    model = random_gpt(config, seed=seed, scale=4.0)
    return save_checkpoint(directory, model, CharTokenizer(chars), training=TRAINING)


def make_bpe_checkpoint(directory: Path, tok: BPETokenizer) -> Path:
    """A hand-wired bigram: the MLP recognises each cycle token and pushes the residual towards the next one.

    Cycle tokens t_k get the embedding u_k = e_2k - e_2k+1 (zero mean, mutually orthogonal); every other token
    embeds to 0, so its logit is 0. Attention and position embeddings contribute nothing. MLP hidden unit k
    fires only on t_k (LayerNorm makes u_k into sqrt(8) u_k) and writes 10 u_k+1; the output bias writes 3 u_0,
    so any other token leads into the cycle at t_0.
    """
    cycle = [tok.enc.encode_single_token(bytes([b])) for b in EMOJI_CJK.encode("utf-8")]
    torch.manual_seed(0)
    config = GPTConfig(block_size=64, vocab_size=50304, n_layer=1, n_head=2, n_embd=16)
    model = GPT(config).eval()
    d = config.n_embd
    u = torch.zeros(len(cycle), d)
    for k in range(len(cycle)):
        u[k, 2 * k], u[k, 2 * k + 1] = 1.0, -1.0
    z = u * 8**0.5  # LayerNorm(u_k) with unit gain, zero bias
    with torch.no_grad():
        model.transformer.wte.weight.zero_()
        model.transformer.wte.weight[cycle] = u
        model.transformer.wpe.weight.zero_()
        block = model.transformer.h[0]
        block.attn.c_proj.weight.zero_()
        block.attn.c_proj.bias.zero_()
        block.mlp.c_fc.weight.zero_()
        block.mlp.c_fc.bias.fill_(-100.0)  # unused hidden units stay off
        block.mlp.c_proj.weight.zero_()
        for k in range(len(cycle)):
            block.mlp.c_fc.weight[k] = 2 * z[k]  # pre-activation 2 * 8 = 16 on t_k, 0 - 8 = -8 elsewhere
            block.mlp.c_fc.bias[k] = -8.0
            block.mlp.c_proj.weight[:, k] = 10 * u[(k + 1) % len(cycle)] / 8.0
        block.mlp.c_proj.bias.copy_(3 * u[0])
        model.transformer.ln_f.weight.fill_(10.0)
    return save_checkpoint(directory, model, tok, training={"note": "hand-wired UTF-8 cycle"})


def make_gpt2_shaped_checkpoint(directory: Path, tok: BPETokenizer, *, n_layer: int = 12, n_head: int = 12,
                                head_size: int = 64, block_size: int = 1024, scale: float = 4.0, seed: int = 0) -> Path:
    """A random GPT with GPT-2's vocabulary (GPT-2 small's shape by default), written to `directory`."""
    config = GPTConfig(block_size=block_size, vocab_size=50304, n_layer=n_layer, n_head=n_head,
                       n_embd=head_size * n_head)
    model = random_gpt(config, seed=seed, scale=scale)
    return save_checkpoint(directory, model, tok, training={"note": "random weights, GPT-2's shapes"})


def tiny_checkpoint(block_size: int = 32, *, seed: int = 1, eos_id: int | None = None) -> Checkpoint:
    """The engine tests' random GPT in memory, the same weights for the same arguments.

    Weights are scaled up from GPT-2's init so that logits are spread out (near ties would make greedy parity
    depend on the last bit), and the padded rows of the tied LM head are scaled further so that a padded id is
    the largest logit nearly every step: only masking keeps them out.
    """
    config = GPTConfig(block_size=block_size, vocab_size=ENGINE_VOCAB_SIZE, n_layer=2, n_head=2, n_embd=32)
    model = random_gpt(config, seed=seed, scale=8.0)
    with torch.no_grad():
        model.lm_head.weight[len(ENGINE_CHARS):] *= 4.0
    tokenizer = CharTokenizer(ENGINE_CHARS)
    tokenizer.eos_id = eos_id  # a character that doubles as end-of-text, for EOS tests
    return Checkpoint(path=None, config=config, tokenizer=tokenizer, model=model)  # type: ignore[arg-type]
