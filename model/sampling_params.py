"""What a request may ask of the sampler, validated: `SamplingParams`, and the `ValidationError` every layer
below HTTP raises for a parameter outside its range (`field` names the parameter, the message gives the allowed
range and the value)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from model.previews import preview
from model.stopping import MAX_STOP_CHARS, MAX_STOP_STRINGS

if TYPE_CHECKING:
    from model.lora.batched import LoraAdapter

MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 1024  # entries in one request's logit_bias
MAX_TOP_N = 20  # alternatives reported per token


class ValidationError(ValueError):
    """A parameter outside its allowed range; `field` names it, the message gives range and value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ContextTooLong(ValidationError):
    """A prompt longer than the model's context (OpenAI's `context_length_exceeded`, which clients look for)."""


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

@runtime_checkable
class CompiledConstraint(Protocol):
    """A structured-output constraint compiled for the engine's tokenizer: `model.structured.Constraint` (made by
    `model.structured.compile_constraint`, off the engine thread); `matcher()` gives a request its own matcher."""

    tokenizer: Any  # the Folio tokenizer it was compiled for
    ll_tokenizer: Any  # llguidance's view of it

    def matcher(self) -> Any: ...


@dataclass(frozen=True)
class AttentionSpec:
    """Which attention weights come with each generated token (`model.engine.attention`): those of these layers
    (None: all) and heads (None: one row per layer, the mean over its heads). Checked against the model by the
    engine."""

    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None


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
    stop_at_eos: bool = True  # False: EOS is a token like any other (OpenAI's `ignore_eos`)
    presence_penalty: float = 0.0  # OpenAI: subtracted once from the logit of every id already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted once per time an id was generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, bias) added to the logits; -100 bans, 100 forces
    min_tokens: int = 0  # neither EOS nor a stop string ends generation before this many tokens
    min_p: float | None = None  # keep tokens at least min_p times as likely as the most likely one; 0 or None: off
    prompt_logprobs: int | None = None  # score the prompt: each token's logprob and this many alternatives
    attention: AttentionSpec | None = None  # send each token's attention weights
    # structured output: the output must satisfy this compiled constraint (model/structured/); generation ends with
    # reason "stop" once it is complete and the grammar allows nothing more, even before min_tokens
    constraint: CompiledConstraint | None = None
    # the LoRA adapter the request runs through (model/lora.py; loaded by its engine: `Engine.load_adapter`); None:
    # the base model
    adapter: LoraAdapter | None = None
    # speculative decoding (where the engine has it: `EngineConfig.speculative_model`): False decodes this request
    # one token a step (model/speculative/speculator.py says which requests cannot speculate anyway)
    speculate: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_N)
        # 0 new tokens: only score the prompt
        _int("max_new_tokens", self.max_new_tokens, 0 if self.prompt_logprobs is not None else 1, 1_000_000)
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
        _float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.min_p is not None:
            _float("min_p", self.min_p, 0.0, 1.0)
        _int("min_tokens", self.min_tokens, 0, self.max_new_tokens)
        self._check_logit_bias()
        _int("top_n_tokens", self.top_n_tokens, 0, MAX_TOP_N)
        for name in ("do_sample", "greedy", "stop_at_eos", "speculate"):
            if not isinstance(getattr(self, name), bool):
                raise ValidationError(name, f"must be true or false, got {preview(getattr(self, name))}")
        check_stop_strings(self.stop)
        if self.attention is not None and not isinstance(self.attention, AttentionSpec):
            raise ValidationError("attention", f"must be an AttentionSpec, got {preview(self.attention)}")
        if self.constraint is not None and not isinstance(self.constraint, CompiledConstraint):
            raise ValidationError("constraint", f"must be a compiled Constraint (model.structured.compile_constraint), "
                                                f"got {preview(self.constraint)}")

    def _check_logit_bias(self) -> None:
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValidationError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for entry in self.logit_bias:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise ValidationError("logit_bias", f"must map token ids to numbers, got {preview(entry)}")
            _int("logit_bias", entry[0], 0, 2**31 - 1)
            _float("logit_bias", entry[1], -100.0, 100.0)

    @property
    def has_sampling_controls(self) -> bool:
        return (
            (self.temperature is not None and self.temperature != 1.0)
            or bool(self.top_k)
            or (self.top_p is not None and self.top_p < 1.0)
            or bool(self.min_p)
        )

    @property
    def penalises_output(self) -> bool:
        """Whether choosing a token depends on the tokens generated so far (beyond the repetition penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.min_tokens)

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
