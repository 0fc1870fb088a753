"""Deploy fixtures: the metric names Folio's /metrics exports, scraped from the real app serving the bundled
model (the one the image and the Kubernetes manifests serve)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.main import create_app
from app.settings import Settings
from tests import REPO


@pytest.fixture(scope="session")
def exported_metric_names() -> set[str]:
    """Every sample name on /metrics (`..._total`, `..._bucket`, ...) once a request has been served."""
    settings = Settings(checkpoint=REPO / "weights" / "shakespeare-char", device="cpu", threads=1)
    with TestClient(create_app(settings)) as client:
        r = client.post("/generate", json={"inputs": "ROMEO:", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        text = client.get("/metrics").text
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
