"""What OpenAI's endpoints share on the wire: the error body, and `stream_options`."""

from __future__ import annotations

from pydantic import BaseModel, Field

from app.api.protocol import StrictModel


class StreamOptions(StrictModel):
    include_usage: bool = False



class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int | str | None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail
    request_id: str | None = Field(None, description="the request's ID, as in the X-Request-Id response header")
