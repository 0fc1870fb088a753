"""Models the benchmarks share: GPT-2 124M's shape at random init (seeded: the same weights in every script and
run), and Folio's weights as `transformers`' GPT2LMHeadModel, the baseline that runs the same weights."""

from __future__ import annotations

from typing import Any

import torch

from model.config import GPTConfig
from model.gpt import GPT


def gpt2_124m(seed: int = 0) -> GPT:
    """GPT-2 124M's shape (vocabulary padded to 50304, biases on), random init from `seed`."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, bias=True))


def to_hf(model: GPT) -> Any:
    """The same weights in `transformers`' GPT2LMHeadModel (Conv1D layouts, zero biases where Folio has none).
    No EOS token: like Folio's runs here, generation always makes exactly max_new_tokens tokens (an EOS id with
    min_new_tokens would instead forbid that id, and change the greedy tokens)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    hf_cfg = GPT2Config(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, n_positions=c.block_size,
                        vocab_size=c.vocab_size, activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, layer_norm_epsilon=1e-5, bos_token_id=None, eos_token_id=None)
    hf = GPT2LMHeadModel(hf_cfg).eval()
    sd = {k: v for k, v in model.state_dict().items()}
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    with torch.no_grad():
        for name, p in hf.state_dict().items():
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue
            if name in sd:
                src = sd[name]
                p.copy_(src.t() if name.endswith(conv1d) else src)
            else:
                assert name.endswith(".bias"), name  # Folio built without biases: zero
                p.zero_()
    return hf
