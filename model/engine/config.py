"""The engine's configuration: one object, built once (from the server's settings in app/main.py, or from a
script's keywords, `Engine(checkpoint, max_batch_size=8)`) and handed whole to the engine, its scheduler and its
model runner. `Engine.config` is the configuration as resolved for its model and machine (the device, the dtype,
the threads and the window shift that "unset" stood for)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NGRAM = "[ngram]"  # `speculative_model` for prompt lookup (vLLM's name)
MAX_SPECULATIVE_TOKENS = 16  # num_speculative_tokens and the n-gram sizes at most


@dataclass(frozen=True)
class EngineConfig:
    device: str | torch.device | None = None  # None: the best available (model/devices.py)
    dtype: torch.dtype | None = None  # None: the device's default
    max_batch_size: int = 16  # requests decoded together, each in its own KV-cache row
    max_waiting: int = 64  # submitted requests waiting for a slot, beyond which submissions are refused
    prefill_chunk: int = 512  # prompt tokens prefilled per engine step
    window_shift: int | None = None  # tokens the context window slides by; None: block_size // 8
    threads: int | None = None  # CPU threads; None: by the model's size (model/engine/runner.py)
    kv_cache_dtype: str = "auto"  # the KV cache's element type: auto, fp32, fp16 (runner.resolve_kv_cache_dtype)
    enforce_eager: bool = False  # decode steps without CUDA graphs (vLLM's name; model/engine/graphs.py)
    compile: bool = False  # the decode step the CUDA graphs capture compiled first (torch.compile; graphs.py)
    # the next decode step's forward launched on a step's chosen tokens before the host has looked at them (vLLM's
    # async scheduling; model/engine/ahead.py); None: on CUDA (on a CPU it only reorders a step's work)
    async_scheduling: bool | None = None
    prefix_cache: bool = True  # reuse the keys and values of a prompt's prefix a cache row already holds
    max_loras: int = 0  # LoRA adapters loaded at once (`Engine.load_adapter`); 0: adapters off (no hooks at all)
    # speculative decoding (model/speculative/; vLLM's option names): "[ngram]" drafts by prompt lookup, any other
    # value is the directory of a draft model's checkpoint (with the served model's tokenizer); None: off
    speculative_model: str | None = None
    num_speculative_tokens: int = 4  # the most tokens drafted and verified per request and step
    ngram_prompt_lookup_max: int = 4  # the longest n-gram looked up (tried first)
    ngram_prompt_lookup_min: int = 1  # the shortest
    # with a draft model: a drafted token's cost in decode steps of the served model at batch 1; None: measured when
    # the engine is built (`speculative.measure_token_cost`)
    draft_token_cost: float | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_waiting < 0 or self.prefill_chunk < 1 or self.max_loras < 0:
            raise ValueError("max_batch_size and prefill_chunk must be >= 1, max_waiting and max_loras >= 0")
        if self.speculative_model is not None and not self.speculative_model.strip():
            raise ValueError(f"speculative_model must be {NGRAM!r} (prompt lookup), a draft model's checkpoint "
                             f"directory or unset, got {self.speculative_model!r}")
        if self.draft_token_cost is not None and not 0 <= self.draft_token_cost < float("inf"):
            raise ValueError(f"draft_token_cost must be a finite number >= 0, got {self.draft_token_cost}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.ngram_prompt_lookup_min <= self.ngram_prompt_lookup_max <= MAX_SPECULATIVE_TOKENS:
            raise ValueError("the n-gram sizes must satisfy 1 <= ngram_prompt_lookup_min <= ngram_prompt_lookup_max "
                             f"<= {MAX_SPECULATIVE_TOKENS}, got {self.ngram_prompt_lookup_min} and "
                             f"{self.ngram_prompt_lookup_max}")

    def window_shift_for(self, block_size: int) -> int:
        """`window_shift`, or its default for a context of `block_size`; ValueError outside [1, block_size - 1]."""
        shift = self.window_shift or max(1, block_size // 8)
        if not 1 <= shift < block_size:
            raise ValueError(f"window_shift must be in [1, {block_size - 1}], got {shift}")
        return shift
