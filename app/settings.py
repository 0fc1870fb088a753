"""Server configuration: every field from `--flag`, `FOLIO_*` environment variables, or its default
(in that order of precedence)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "weights" / "shakespeare-char"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FOLIO_", extra="forbid")

    checkpoint: Path = Field(DEFAULT_CHECKPOINT, description="checkpoint directory to serve")
    model_id: str | None = Field(None, description="name reported by /info and /v1/models (default: dir name)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    threads: int = Field(0, ge=0, description="CPU threads for torch (0: all cores)")
    max_batch_size: int = Field(16, ge=1, le=1024, description="requests decoded together")
    max_waiting: int = Field(64, ge=0, le=100_000, description="admitted requests waiting for a batch slot")
    prefill_chunk: int = Field(512, ge=1, description="prompt tokens prefilled per engine step")
    window_shift: int = Field(0, ge=0, description="tokens the context window slides by (0: block_size/8)")
    max_new_tokens_default: int = Field(20, ge=1, description="max_new_tokens when a request sets none")
    max_new_tokens_limit: int = Field(4096, ge=1, description="largest max_new_tokens a request may ask for")
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024, description="larger request bodies get 413")
    api_key: SecretStr | None = Field(None, description="if set, generation routes need 'Bearer <key>'")
    cors_origins: list[str] = Field(default_factory=list, description="allowed CORS origins ('*' for any)")
    drain_timeout: float = Field(30.0, ge=0, description="seconds in-flight requests get after SIGTERM")
    # one engine iteration is a prefill chunk plus a decode step, and a decode step re-prefills each row whose
    # window slides: GPT-2 small on 2 CPU threads takes ~5 s for a 512-token chunk and ~7 s per slide, so 16 rows
    # sliding together take ~2 minutes; the default leaves room for that, a stuck engine still fails in minutes
    liveness_stall_seconds: float = Field(300.0, gt=0, description="GET /health/live fails once one engine step "
                                          "has run this long")
    retry_after: int = Field(1, ge=0, description="Retry-After seconds on 429")
    log_level: str = "info"
    fault_injection: bool = Field(False, description="testing aid, never in production: prompts holding "
                                  "'<fault:prefill>' or '<fault:decode>' fail inside the model step (app/faults.py)")
