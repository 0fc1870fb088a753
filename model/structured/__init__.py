"""Structured output: constrained decoding on llguidance (its grammars, matchers and token masks).

- `spec`: `ConstraintSpec`, what a request may constrain (a JSON schema, any JSON object, a regex, a choice, a Lark
  grammar), its limits, and `ConstraintError`, the validation error a refused spec raises;
- `compiler`: a spec compiled for a tokenizer (`Constraint`, which `SamplingParams.constraint` carries), with a
  cache, a time bound and worker threads of its own (`compile_constraint`, `compile_constraint_async`,
  `ConstraintCompiler`);
- `matcher`: a request's matcher while it generates (`RowMatcher`) and a batch's masks (`allowed_tokens`).
"""

from model.structured.compiler import (
    COMPILE_TIMEOUT_S,
    Constraint,
    ConstraintCompiler,
    compile_constraint,
    compile_constraint_async,
    default_compiler,
    ll_tokenizer,
)
from model.structured.matcher import ConstraintViolation, RowMatcher, allowed_tokens
from model.structured.spec import (
    MAX_CHOICES,
    MAX_SCHEMA_PROPERTIES,
    MAX_SPEC_CHARS,
    ConstraintError,
    ConstraintSpec,
)

__all__ = [
    "COMPILE_TIMEOUT_S", "MAX_CHOICES", "MAX_SCHEMA_PROPERTIES", "MAX_SPEC_CHARS", "Constraint", "ConstraintCompiler",
    "ConstraintError", "ConstraintSpec", "ConstraintViolation", "RowMatcher", "allowed_tokens", "compile_constraint",
    "compile_constraint_async", "default_compiler", "ll_tokenizer",
]
