"""Sampling: validated parameters and pure functions over a logits vector plus an explicit generator.

Order of operations for one next-token choice (the same in the naive loop, the offline sampler and the
engine):

1. ids the tokenizer cannot decode (a padded vocabulary, e.g. 50257..50303) get -inf;
2. repetition penalty (CTRL / Hugging Face): for every id already in the context, a positive logit is
   divided by the penalty and a negative one multiplied by it;
3. greedy decoding (see `SamplingParams.is_greedy`) takes the argmax here, and stops;
4. temperature divides the logits;
5. top-k keeps the k largest logits (ties at the k-th value are kept);
6. top-p keeps the smallest set of most likely tokens whose probability reaches p (at least one);
7. softmax over what is left, one draw from the request's own `torch.Generator`.

Reported log-probabilities are the model's own: log-softmax of the logits after step 1 only, so they do
not depend on temperature, top-k or top-p.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field, replace

import torch

from model.stopping import MAX_STOP_CHARS, MAX_STOP_STRINGS

MAX_SEED = 2**63 - 1
PREVIEW_CHARS = 80
# a bounded repr: the ends of a long string or number, the first items of a container
_REPR = reprlib.Repr()
_REPR.maxlevel = 2
_REPR.maxtuple = _REPR.maxlist = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 4
_REPR.maxstring = _REPR.maxlong = _REPR.maxother = PREVIEW_CHARS


def preview(value: object) -> str:
    """`repr(value)` cut short for an error message: at most about PREVIEW_CHARS characters, with the value's size
    when it was cut, whatever its size (a 5 MB string or a million-item list costs no more than a short one).
    Like repr, it escapes what JSON could not carry as is (a lone surrogate)."""
    shown = _REPR.repr(value)
    if len(shown) > PREVIEW_CHARS:
        shown = shown[: PREVIEW_CHARS - 3] + "..."
    if isinstance(value, str) and (len(value) > PREVIEW_CHARS or shown != repr(value)):
        shown += f" ({len(value)} characters)"
    elif isinstance(value, list | tuple | dict) and len(value) > 4:
        shown += f" ({len(value)} items)"
    elif isinstance(value, int) and "..." in shown:
        shown += f" ({len(str(abs(value)))} digits)"
    return shown


class ValidationError(ValueError):
    """A parameter outside its allowed range; `field` names it, the message gives range and value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check_stop_strings(stop: object) -> None:
    """Stop strings: a list of at most MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_CHARS characters."""
    if not isinstance(stop, tuple | list) or any(not isinstance(s, str) for s in stop):
        raise ValidationError("stop", f"must be a list of strings, got {preview(stop)}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValidationError("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}")
    for s in stop:
        if not s:
            raise ValidationError("stop", "stop strings must be non-empty, got an empty string ('')")
        if len(s) > MAX_STOP_CHARS:
            raise ValidationError("stop", f"a stop string may have at most {MAX_STOP_CHARS} characters, got one of "
                                          f"{len(s)}: {preview(s)}")


@dataclass(frozen=True)
class SamplingParams:
    """Validated generation parameters for one request. `None` means 'not set' (TGI's semantics)."""

    max_new_tokens: int = 20
    temperature: float | None = None  # 0 means greedy
    top_k: int | None = None  # 0 or None: off
    top_p: float | None = None  # 1.0 or None: off
    do_sample: bool = False
    greedy: bool = False
    repetition_penalty: float | None = None  # 1.0 or None: off
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    top_n_tokens: int = 0  # alternatives reported per token
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        _int("max_new_tokens", self.max_new_tokens, 1, 1_000_000)
        if self.temperature is not None:
            _float("temperature", self.temperature, 0.0, 100.0)
        if self.top_k is not None:
            _int("top_k", self.top_k, 0, 1_000_000)
        if self.top_p is not None:
            _float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.repetition_penalty is not None:
            _float("repetition_penalty", self.repetition_penalty, 0.0, 100.0, low_open=True)
        if self.seed is not None:
            _int("seed", self.seed, 0, MAX_SEED)
        _int("top_n_tokens", self.top_n_tokens, 0, 20)
        for name in ("do_sample", "greedy", "stop_at_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ValidationError(name, f"must be true or false, got {preview(getattr(self, name))}")
        check_stop_strings(self.stop)

    @property
    def has_sampling_controls(self) -> bool:
        return (
            (self.temperature is not None and self.temperature != 1.0)
            or bool(self.top_k)
            or (self.top_p is not None and self.top_p < 1.0)
        )

    @property
    def is_greedy(self) -> bool:
        """Greedy when asked (`greedy`, temperature 0) or when nothing asks for sampling: no `do_sample`
        and no temperature, top-k or top-p (Hugging Face TGI's rule)."""
        if self.greedy or self.temperature == 0:
            return True
        return not (self.do_sample or self.has_sampling_controls)

    def with_seed(self, seed: int) -> SamplingParams:
        return replace(self, seed=seed)


def _int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValidationError(name, f"must be an integer in [{lo}, {hi}], got {preview(value)}")


def _float(name: str, value: object, lo: float, hi: float, low_open: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (lo < value if low_open else lo <= value) and value <= hi  # type: ignore[operator]
    if not ok:
        lb = "(" if low_open else "["
        raise ValidationError(name, f"must be a number in {lb}{lo}, {hi}], got {preview(value)}")


def new_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def mask_unusable(logits: torch.Tensor, n_vocab: int) -> torch.Tensor:
    """Step 1: ids >= n_vocab (a padded vocabulary) can never be chosen."""
    if logits.size(-1) > n_vocab:
        logits = logits.clone()
        logits[..., n_vocab:] = float("-inf")
    return logits


def apply_repetition_penalty(logits: torch.Tensor, context: torch.Tensor, penalty: float) -> torch.Tensor:
    """Step 2, on a 1-D logits vector; `context` holds the ids seen so far (prompt and output). The result stays
    finite: a tiny penalty (which favours repetition) divides a positive logit towards the largest float."""
    if penalty == 1.0 or context.numel() == 0:
        return logits
    logits = logits.clone()
    ids = context.unique()
    picked = logits[ids]
    biggest = torch.finfo(logits.dtype).max
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty).clamp(-biggest, biggest)
    return logits


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Step 5: keep logits >= the k-th largest; the rest become -inf."""
    if not k or k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Step 6: keep the smallest most-likely set whose probability mass reaches p (always >= 1 token)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # a token is dropped when the mass strictly before it already reaches p; the most likely one never is (a p
    # below float32's smallest positive number compares as 0, and the mass before the first token is 0)
    drop_sorted = (probs.cumsum(-1) - probs) >= p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sampling_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Steps 4-7 up to the softmax: the exact distribution a sampled token is drawn from."""
    temperature = params.temperature if params.temperature is not None else 1.0
    # shifted by the maximum first (softmax does that anyway), so that dividing by a tiny temperature takes
    # logits towards -inf, never to +inf (inf - inf would make the softmax NaN); a temperature below the dtype's
    # smallest normal number would round to 0 in the division and is taken as that number
    temperature = max(temperature, torch.finfo(logits.dtype).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    logits = top_k_filter(logits, params.top_k or 0)
    logits = top_p_filter(logits, params.top_p if params.top_p is not None else 1.0)
    return torch.softmax(logits, dim=-1)


def choose_token(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    n_vocab: int,
    context: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """The next token id from a 1-D logits vector, following steps 1-7."""
    logits = mask_unusable(logits.float(), n_vocab)
    if params.repetition_penalty not in (None, 1.0) and context is not None:
        logits = apply_repetition_penalty(logits, context, params.repetition_penalty)
    if params.is_greedy:
        return int(torch.argmax(logits))
    probs = sampling_distribution(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, n_vocab: int, chosen: int, top_n: int = 0) -> tuple[float, list]:
    """The model's log-probability of `chosen` and its `top_n` most likely alternatives [(id, logprob)]."""
    logp = torch.log_softmax(mask_unusable(logits.float(), n_vocab), dim=-1)
    top: list[tuple[int, float]] = []
    if top_n:
        values, ids = torch.topk(logp, top_n)
        top = list(zip(ids.tolist(), values.tolist()))
    return float(logp[chosen]), top
