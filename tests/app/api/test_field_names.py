"""Each API names `model/`'s neutral fields its own way, in one place (`app.api.fields.Api`): the engine's and the
inspector's errors (`prompt`, `text`, `max_new_tokens`, ...) come back under TGI's, OpenAI's and /inspect's names,
with the truncation hint only where the API has a way to truncate and the prompt is over the model's context."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.api.inspect.protocol import INSPECT
from app.api.openai.completions.protocol import OPENAI
from app.api.protocol import Api
from app.api.tgi.protocol import TGI
from app.testing import assert_openai_error, assert_tgi_error
from model.inspection import InspectError, InspectTooLarge
from model.sampling_params import ContextTooLong, ValidationError

CONTEXT = "the prompt is 300 tokens, more than the model's context of 128"


@pytest.mark.parametrize(("api", "error", "field", "message"), [
    (TGI, ContextTooLong("prompt", CONTEXT), "inputs", CONTEXT + " (parameters.truncate)"),
    (TGI, ValidationError("prompt", "token ids must be in [0, 64]"), "inputs", "token ids must be in [0, 64]"),
    (TGI, ValidationError("max_new_tokens", "must be an integer in [1, 256]"), "parameters.max_new_tokens",
     "must be an integer in [1, 256]"),
    (OPENAI, ContextTooLong("prompt", CONTEXT), "prompt", CONTEXT),
    (OPENAI, ValidationError("top_n_tokens", "at most 4"), "logprobs", "at most 4"),
    (OPENAI, ValidationError("seed", "at most 9"), "seed", "at most 9"),
    (INSPECT, InspectError("text", "must be 1 to 128 tokens (the model's context), got 300"), "inputs",
     "must be 1 to 128 tokens (the model's context), got 300 (truncate keeps the last tokens)"),
    (INSPECT, InspectTooLarge("layers", "layers x heads x tokens is 9"), "layers", "layers x heads x tokens is 9"),
], ids=["tgi-context", "tgi-ids", "tgi-prefixed", "openai-context", "openai-renamed", "openai-same",
        "inspect-context", "inspect-budget"])
def test_an_api_renames_the_field_and_keeps_the_error_type(api: Api, error: Exception, field: str,
                                                           message: str) -> None:
    with pytest.raises(type(error)) as caught:
        with api.naming_fields():
            raise error
    # InspectTooLarge stays a 413, InspectError a 422, ContextTooLong OpenAI's context_length_exceeded
    assert type(caught.value) is type(error)
    assert (caught.value.field, caught.value.message) == (field, message)
    assert str(caught.value) == f"{field}: {message}"


def test_an_error_naming_nothing_passes_through() -> None:
    with pytest.raises(KeyError):
        with TGI.naming_fields():
            raise KeyError("not a field's error")


@pytest.mark.parametrize(("route", "body", "field"), [
    ("/generate", {"inputs": "h\u00e9llo"}, "inputs"),
    ("/v1/completions", {"prompt": "h\u00e9llo"}, "prompt"),
    ("/inspect", {"inputs": "h\u00e9llo"}, "inputs"),
])
def test_text_the_tokenizer_cannot_encode_names_the_apis_prompt_field(client: TestClient, route: str, body: dict,
                                                                      field: str) -> None:
    """The char tokenizer has no 'é': each API's prompt field is named (tokenised by `GenerationService.encode`)."""
    r = client.post(route, json=body)
    if route.startswith("/v1/"):
        message = assert_openai_error(r, 400, "invalid_request_error", field)
    else:
        message = assert_tgi_error(r, 422, "validation")
    assert message.startswith(f"{field}: ") and "'\u00e9'" in message, message


def test_another_model_on_a_one_model_server_is_the_tables_404(client: TestClient) -> None:
    """/v1/completions naming a model this server does not serve: `ModelNotFound`, answered through the error
    table like the model registry's (no Retry-After: trying again will not help)."""
    r = client.post("/v1/completions", json={"prompt": "hi", "model": "m" * 200})
    message = assert_openai_error(r, 404, "invalid_request_error", "model", "is not served here",
                                  code="model_not_found")
    assert "(200 characters)" in message and len(message) < 300
    assert "retry-after" not in r.headers


@pytest.mark.parametrize(("route", "body", "field"), [
    ("/v1/completions", {"prompt": "hi " * 100}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 100}]}, "messages"),
])
def test_a_prompt_over_the_context_is_openais_context_length_exceeded(client: TestClient, route: str, body: dict,
                                                                      field: str) -> None:
    """The code clients look for (LangChain, LiteLLM) on a prompt over the context; another invalid field's code is
    null, as OpenAI's mostly are."""
    message = assert_openai_error(client.post(route, json=body), 400, "invalid_request_error", field,
                                  "more than the model's context", code="context_length_exceeded")
    assert message.startswith(f"{field}: the prompt is ")
    assert_openai_error(client.post(route, json={**body, "temperature": 5}), 400, "invalid_request_error",
                        "temperature", code=None)
