"""How each API names the model's fields: `model/` raises its errors with neutral names (`prompt`,
`max_new_tokens`, `text`, ...); a route re-raises them with its API's (`inputs`, `parameters.max_new_tokens`,
`max_tokens`, ...) through its table here, so a client reads the name it sent."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from model.inspection import InspectError
from model.sampling_params import ValidationError


@dataclass(frozen=True)
class Api:
    """How one API names the model's fields (`prompt`, `max_new_tokens`, `text`, ...) in its error messages: the
    one place where the neutral names of `model/` become an API's."""

    renamed: dict[str, str]
    prefix: str = ""  # for the fields not renamed
    truncate_hint: str = ""  # how to fit a prompt longer than the context, if the API has a way

    def field(self, name: str) -> str:
        return self.renamed.get(name, self.prefix + name)

    @contextmanager
    def naming_fields(self) -> Iterator[None]:
        """Re-raise `model/`'s `ValidationError`s and `InspectError`s (of the same type) with this API's field
        names, and the truncation hint on a prompt longer than the model's context."""
        try:
            yield
        except (ValidationError, InspectError) as e:
            field = self.field(e.field)
            hint = self.truncate_hint if field == self.field("prompt") and "context" in e.message else ""
            raise type(e)(field, e.message + hint) from None


TGI = Api({"prompt": "inputs"}, prefix="parameters.", truncate_hint=" (parameters.truncate)")
OPENAI = Api({"prompt": "prompt", "max_new_tokens": "max_tokens", "top_n_tokens": "logprobs"})
# POST /inspect: the text looked into is `inputs` (its generation request, `parameters`, is TGI's)
INSPECT = Api({"prompt": "inputs", "text": "inputs"}, truncate_hint=" (truncate keeps the last tokens)")
