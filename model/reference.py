"""The naive reference loop: nanoGPT's `generate`, kept as the oracle the fast engine is tested against.

Every step runs a full forward over the context cropped to the last `block_size` tokens (no KV cache),
then picks the next token with `model.sampler.choose_token`. Slow and obviously right.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from model.gpt import GPT
from model.sampler import choose_token, new_generator
from model.sampling_params import SamplingParams
from model.stopping import check_stop_token


@torch.no_grad()
def generate_naive(
    model: GPT,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    n_vocab: int,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (token id, logits it was chosen from) until EOS or `max_new_tokens`."""
    if not prompt_ids:
        raise ValueError("prompt must hold at least one token")
    device = next(model.parameters()).device
    if generator is None and not params.is_greedy:
        generator = new_generator(params.seed if params.seed is not None else 0)
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    block = model.config.block_size
    last = torch.tensor([-1], device=device)  # the logits of the last position only
    for n in range(1, params.max_new_tokens + 1):
        logits = model(idx[:, -block:], take=last)[0, -1]
        token = choose_token(logits, params, n_vocab=n_vocab, context=idx[0], generator=generator,
                             output=idx[0, len(prompt_ids):].tolist(), eos_id=eos_id)
        yield token, logits
        idx = torch.cat([idx, torch.tensor([[token]], device=device)], dim=1)
        stop, _ = check_stop_token(token, n, params.max_new_tokens, eos_id, params.stop_at_eos, params.min_tokens)
        if stop:
            return
