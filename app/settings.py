"""Server configuration: every field from `--flag`, `FOLIO_*` environment variables, or its default
(in that order of precedence), validated at start-up so that a mistake is one line, not a traceback or a
server that runs with a setting silently dropped."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.api.protocol import MAX_SEQUENCES
from app.http.auth import PROTECTED_DOC
from model.chat_template import load_chat_template
from model.cli import DEFAULT_CHECKPOINT, check_threads
from model.devices import resolve_device
from model.engine import EngineConfig
from model.engine.config import MAX_SPECULATIVE_TOKENS, NGRAM

ENV_PREFIX = "FOLIO_"
# FOLIO_* variables that are not server options: read by other parts of Folio, or by docker compose on the host.
# Any other FOLIO_* name that is not an option's stops the server: a misspelled FOLIO_API_KEY must not leave it open.
OTHER_VARIABLES = {
    "FOLIO_KERNEL_DIR": "where the CPU kernels are built and found (model/kernels.py)",
    "FOLIO_CPU_KERNELS": "0 turns the CPU kernels off (model/kernels.py)",
    "FOLIO_GPT2_BPE_DIR": "GPT-2's BPE files for the trainer and the converter (model/tokenizer.py)",
    "FOLIO_WEIGHTS": "the host directory docker/compose.yaml mounts at /weights",
    "FOLIO_WEIGHTS_VOLUME": "where docker/entrypoint.sh looks for a mounted checkpoint",
    "FOLIO_REPLICAS": "how many replicas docker/compose.yaml runs",
    "FOLIO_REPLICA_THREADS": "--threads of each replica in docker/compose.yaml",
    "FOLIO_GPU_PORT": "the CUDA service's host port in docker/compose.yaml",
    "FOLIO_PROXY_PORT": "nginx's host port in docker/compose.yaml",
    "FOLIO_HEALTH_TIMEOUT": "seconds docker/healthcheck.py waits for /health",
    "FOLIO_PEERS_CACHE": "where bench/peers/ keeps the peer servers it sets up",
    "FOLIO_PEERS_CONVERT_VENV": ("set: bench/peers/ converts models in a virtualenv of its own, even where the "
                                 "project's python could"),
    "FOLIO_TEST_DATA": "the test suite's data directory (tests/conftest.py), for a server the tests start",
}
ORIGIN = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s]+")  # scheme://host[:port], as browsers send it


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # --dtype (auto: None)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    checkpoint: Path = Field(DEFAULT_CHECKPOINT, description="checkpoint directory to serve")
    model_id: str | None = Field(None, description="name reported by /info and /v1/models (default: dir name)")
    # several models in one server (app/serving/models.py): any of these turns the model registry on
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="more checkpoints to serve beside --checkpoint, each DIR or NAME=DIR "
        "(comma-separated or a JSON list; --checkpoint given several times fills it too); OpenAI's `model` field or "
        "the X-Folio-Model header picks one")
    # LoRA adapters over the models (app/serving/models.py; model/lora.py)
    lora_modules: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="LoRA adapters in PEFT's format to serve over the default model, each "
        "NAME=DIR (vLLM's flag; comma-separated or a JSON list in the environment); each is a model name for "
        "OpenAI's `model` field or the X-Folio-Model header")
    enable_lora: bool = Field(False, description="accept adapters loaded at run time (POST /v1/load_lora_adapter) "
                              "without --lora-modules")
    max_loras: int = Field(4, ge=1, le=64, description="LoRA adapters served at once (with --lora-modules or "
                           "--enable-lora)")
    models_dir: Path | None = Field(None, description="serve every checkpoint directory under this one as well, "
                                    "each named by its directory")
    max_loaded: int | None = Field(None, ge=1, description="models in memory at once, loads in progress included; a "
                                   "load with no room unloads the least recently used idle model (nothing running, "
                                   "queued or reserved), or waits (up to --load-wait, then 503 with Retry-After) "
                                   "until one is idle (unset: no limit)")
    load_wait: float = Field(30.0, gt=0, description="seconds a request waits for its model to load before a 503 "
                             "with Retry-After")
    watch: float = Field(0.0, ge=0, description="check every loaded checkpoint's config.json this often (seconds) "
                         "and swap in changed weights without dropping a request (0: off; POST /admin/reload "
                         "works whenever the registry is on)")
    chat_template: str | None = Field(
        None, description="the chat template (Jinja2) for checkpoints that carry none: a file, or the template's "
        "text (vLLM's flag); without it, such models get Folio's default template (model/chat_template.py)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    threads: int = Field(0, description="CPU threads, at most the machine's cores (0: by the model's size, one per "
                         "8M parameters)")
    max_batch_size: int = Field(16, ge=1, le=1024, description="requests decoded together")
    max_waiting: int = Field(64, ge=0, le=100_000, description="admitted requests waiting for a batch slot")
    max_sequences_per_request: int = Field(
        0, ge=0, le=MAX_SEQUENCES, description="sequences one request may run: OpenAI's prompts x max(n, best_of), "
        "TGI's best_of (its max_best_of); more is refused with 422 naming the fields, the limit and the value. "
        "0: half of --max-batch-size (at least 1), so that one request leaves half of the batch to the others")
    prefill_chunk: int = Field(512, ge=1, description="prompt tokens prefilled per engine step")
    window_shift: int = Field(0, ge=0, description="tokens the context window slides by (0: block_size/8)")
    max_new_tokens_default: int = Field(20, ge=1, description="max_new_tokens when a request sets none")
    max_new_tokens_limit: int = Field(4096, ge=1, description="largest max_new_tokens a request may ask for")
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024, description="larger request bodies get 413")
    api_key: SecretStr | None = Field(None, description="if set, these routes need 'Authorization: Bearer <key>', "
                                      f"checked before anything else: {PROTECTED_DOC} (surrounding whitespace is "
                                      "ignored; an empty key is refused)")
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="allowed CORS origins: '*' for any, or origins such as "
        "https://example.com, comma-separated (or a JSON list)")
    max_header_bytes: int = Field(16 * 1024, ge=1024, description="a larger request line + headers gets 431")
    header_timeout: float = Field(10.0, gt=0, description="seconds a request's line and headers may take (408)")
    body_timeout: float = Field(30.0, gt=0, description="seconds a request's body may take after its headers (408)")
    max_connections: int = Field(1000, ge=1, description="open connections beyond this get 503 with Retry-After, "
                                 "and are closed (uvicorn's limit_concurrency)")
    forwarded_allow_ips: str | None = Field(
        None, description="proxies whose X-Forwarded-For and X-Forwarded-Proto are believed (the client's address in "
        "the access log is then the one they forward): comma-separated addresses or networks, '*' for any "
        "(uvicorn's forwarded_allow_ips). Unset: none, not even 127.0.0.1; the client is the connection's peer")
    max_tokenize_chars: int = Field(65536, ge=1, description="/tokenize inputs longer than this get 422")
    drain_timeout: float = Field(30.0, ge=0, le=86_400, description="seconds in-flight requests get after SIGTERM")
    # one engine iteration is a prefill chunk plus a decode step, and a decode step re-prefills each row whose
    # window slides: GPT-2 small on 2 CPU threads takes ~5 s for a 512-token chunk and ~7 s per slide, so 16 rows
    # sliding together take ~2 minutes; the default leaves room for that, a stuck engine still fails in minutes
    liveness_stall_seconds: float = Field(300.0, gt=0, description="GET /health/live fails once one engine step "
                                          "has run this long")
    retry_after: int = Field(1, ge=0, description="Retry-After seconds on 429")
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    log_format: Literal["text", "json"] = Field("text", description="text: a readable line per event; json: one "
                                                "JSON object per line, for log collectors (app/http/requestlog.py)")
    quantize: Literal["none", "int8", "bf16", "int4"] = Field(
        "none", description="weights of the blocks' products and the LM head stored as int8 (a scale per output "
        "row; a quarter of fp32's bytes), bf16 (half) or int4 (a fp16 scale per group of 32, as llama.cpp's q4_0; "
        "4.5 bits a weight), quantized at load; activations stay fp32 (model/quantize)")
    kv_cache_dtype: Literal["auto", "fp32", "fp16"] = Field(
        "auto", description="the KV cache's element type: fp16 halves its memory and the bytes each decode step's "
        "attention reads (keys and values rounded to half precision as written, saturated at +-65504); auto: fp16 "
        "where the weights are quantized (--quantize, or a quantized checkpoint) and computed in fp32, else the "
        "model's dtype (model/engine/runner.py)")
    enforce_eager: bool = Field(False, description="on CUDA, decode without CUDA graphs (vLLM's flag): every step's "
                                "kernels launched one by one, as on the CPU. By default a step replays a graph "
                                "captured at start-up for its batch and context size (model/engine/graphs.py)")
    async_scheduling: Literal["auto", "on", "off"] = Field(
        "auto", description="run ahead (vLLM's async scheduling): the next decode step's forward launched on a "
        "step's chosen tokens before the host has looked at them, so that the host's work on a step (stops, text, "
        "events) overlaps the device's work on the next; the tokens are the same either way. auto: on CUDA, off "
        "on a CPU, where the forward is computed as it is launched (model/engine/ahead.py)")
    gc_freeze: bool = Field(True, description="freeze the heap for Python's garbage collector once the default model "
                            "serves (gc.freeze, as vLLM does after its start-up): collections skip start-up's "
                            "objects, so none walks them all while the event loop and the engine wait, ~0.2 s "
                            "(model/heap.py); --no-gc-freeze leaves the collector as Python has it")
    compile: bool = Field(False, description="on CUDA, compile the decode step before its CUDA graphs are captured "
                          "(torch.compile: fewer, fused kernels a step), at the cost of a minute or more at start-up; "
                          "nothing without the graphs (--enforce-eager, or the CPU)")
    speculative_model: str | None = Field(
        None, description="speculative decoding (vLLM's flag): [ngram] drafts tokens by prompt lookup, from the "
        "n-grams of each request's prompt and output; a checkpoint directory drafts them with that model (its "
        "tokenizer must be the served model's), greedily; either way they are verified together in one forward and "
        "the output is the same as without (docs/engine.md). Unset: off")
    num_speculative_tokens: int = Field(4, ge=1, le=MAX_SPECULATIVE_TOKENS, description="with --speculative-model: "
                                        "the most tokens drafted per request and step (each request's own number "
                                        "adapts to how many of its drafts are taken)")
    ngram_prompt_lookup_max: int = Field(4, ge=1, le=MAX_SPECULATIVE_TOKENS, description="with --speculative-model "
                                         "[ngram]: the longest n-gram looked up")
    ngram_prompt_lookup_min: int = Field(1, ge=1, le=MAX_SPECULATIVE_TOKENS, description="with --speculative-model "
                                         "[ngram]: the shortest n-gram looked up")
    fault_injection: bool = Field(False, description="testing aid, never in production: prompts holding "
                                  "'<fault:prefill>' or '<fault:decode>' fail inside the model step (app/faults.py)")

    @field_validator("threads")
    @classmethod
    def _threads(cls, value: int) -> int:
        return check_threads(value)

    @field_validator("speculative_model")
    @classmethod
    def _draft_model_exists(cls, value: str | None) -> str | None:
        if value is None or value == NGRAM or Path(value).is_dir():
            return value
        raise ValueError(f"must be {NGRAM!r} (prompt lookup) or a draft model's checkpoint directory, got {value!r} "
                         "(no such directory)")

    @field_validator("chat_template")
    @classmethod
    def _chat_template_loads(cls, value: str | None) -> str | None:
        load_chat_template(value)  # a file that cannot be read or a template that does not compile stops the start
        return value

    @field_validator("api_key")
    @classmethod
    def _api_key_not_empty(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        key = value.get_secret_value().strip()
        if not key:
            raise ValueError("the key is empty, which would let 'Authorization: Bearer ' with nothing after it "
                             "through; set a key, or unset the option to serve without one")
        return SecretStr(key)

    @field_validator("models", "lora_modules", mode="before")
    @classmethod
    def _split_models(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = json.loads(value) if value.strip().startswith("[") else value.split(",")
        return [v.strip() for v in value if v.strip()] if isinstance(value, list) else value

    @property
    def sequences_per_request(self) -> int:
        """--max-sequences-per-request, its 0 resolved: half of the batch."""
        return self.max_sequences_per_request or max(1, self.max_batch_size // 2)

    def engine_config(self) -> EngineConfig:
        """The engine's configuration these settings give (each model's engine is built with it; a reload checks its
        memory with it first)."""
        return EngineConfig(
            device=resolve_device(self.device),
            dtype=DTYPES.get(self.dtype),
            max_batch_size=self.max_batch_size,
            max_waiting=self.max_waiting,
            prefill_chunk=self.prefill_chunk,
            window_shift=self.window_shift or None,
            threads=self.threads or None,
            kv_cache_dtype=self.kv_cache_dtype,
            enforce_eager=self.enforce_eager,
            async_scheduling={"auto": None, "on": True, "off": False}[self.async_scheduling],
            compile=self.compile,
            max_loras=self.max_loras if self.lora_enabled else 0,
            speculative_model=self.speculative_model,
            num_speculative_tokens=self.num_speculative_tokens,
            ngram_prompt_lookup_max=self.ngram_prompt_lookup_max,
            ngram_prompt_lookup_min=self.ngram_prompt_lookup_min,
        )

    @property
    def lora_enabled(self) -> bool:
        """Whether engines take LoRA adapters: --lora-modules or --enable-lora."""
        return self.enable_lora or bool(self.lora_modules)

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _split_origins(cls, value: Any) -> Any:
        """`*`, `a,b` or `["a", "b"]` from the environment; the flag's words may hold commas too."""
        if isinstance(value, str):
            if value.strip().startswith("["):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"not a JSON list of origins ({e})") from None
            else:
                value = [value]
        if not isinstance(value, list):
            return value
        origins = [o.strip() for item in value for o in (item.split(",") if isinstance(item, str) else [item])]
        bad = [o for o in origins if isinstance(o, str) and o and o != "*" and not ORIGIN.fullmatch(o)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not an origin: use '*' or scheme://host[:port], with no path "
                             "(https://example.com, not https://example.com/)")
        return [o for o in origins if o != ""]

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower_log_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _default_within_limit(self) -> Settings:
        if self.max_new_tokens_default > self.max_new_tokens_limit:
            raise ValueError(f"--max-new-tokens-default ({self.max_new_tokens_default}) is larger than "
                             f"--max-new-tokens-limit ({self.max_new_tokens_limit})")
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError(f"--ngram-prompt-lookup-min ({self.ngram_prompt_lookup_min}) is larger than "
                             f"--ngram-prompt-lookup-max ({self.ngram_prompt_lookup_max})")
        return self


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def check_environment(environ: Mapping[str, str]) -> None:
    """Refuse `FOLIO_*` variables that are neither an option nor in OTHER_VARIABLES (names compared without
    regard to case, as the settings read them), naming the closest real one."""
    known = {env_name(name) for name in Settings.model_fields} | set(OTHER_VARIABLES)
    for name in sorted(environ):
        if name.upper().startswith(ENV_PREFIX) and name.upper() not in known:
            # compared without the prefix all names share, which would make any two look alike
            close = difflib.get_close_matches(name.upper().removeprefix(ENV_PREFIX),
                                              sorted(k.removeprefix(ENV_PREFIX) for k in known), n=1)
            hint = f"did you mean {ENV_PREFIX}{close[0]}?" if close else "it is not a Folio setting."
            raise ValueError(
                f"unknown environment variable {name}: {hint} Server options are FOLIO_<OPTION> for each option "
                "of `python -m app --help`; the other FOLIO_* variables are listed in docs/configuration.md"
            )
