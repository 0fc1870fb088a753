"""`--api-key`'s help names the routes the key guards: every route of the OpenAPI schema is asked without the key,
and those answered 401 are exactly those the help lists as guarded; the others it names as open are open."""

from __future__ import annotations

import re
from collections.abc import Callable

from fastapi.testclient import TestClient

from app.settings import Settings

# a path in the help: "/", "/generate", "/models/{name}/training", "/health*" (every /health route)
PATH = r"(?<![\w>])/[\w/{}*]*"


def test_the_api_key_help_names_every_route_the_key_guards(make_client: Callable[..., TestClient]) -> None:
    """Ask every route in the schema without the key (an empty JSON body: the key is checked before the body)."""
    guarded_text, _, open_text = Settings.model_fields["api_key"].description.partition("(open:")
    guarded_named, open_named = set(re.findall(PATH, guarded_text)), set(re.findall(PATH, open_text))
    client = make_client(api_key="s3cret")
    guarded, open_ = set(), set()
    for path, operations in client.get("/openapi.json").json()["paths"].items():
        for method in operations:
            r = client.request(method.upper(), path.replace("{name}", "shakespeare-char"), json={})
            (guarded if r.status_code == 401 else open_).add(path)
    assert guarded == guarded_named, f"guarded but not in the help: {guarded - guarded_named}; named but open: " \
                                     f"{guarded_named - guarded}"
    assert open_named <= {p for p in open_ if not p.startswith("/health")} | {"/health*"}
    assert {p for p in open_ if p.startswith("/health")} and guarded.isdisjoint(open_)
