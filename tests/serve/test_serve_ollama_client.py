"""The official `ollama` Python client against a real `pagelm serve`: what it parses into its
pydantic models must be valid there (a malformed field fails the whole call)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from serve_helpers import REQUEST_S

ollama = pytest.importorskip("ollama", reason="the ollama client is not installed (pip install -e '.[test]')")


def test_ps_parses_in_the_official_client_and_never_expires(smol):
    (model,) = ollama.Client(host=smol.url, timeout=REQUEST_S).ps().models
    assert model.name == smol.model and model.context_length == 2048 and model.size > 0
    assert model.expires_at > datetime.now(timezone.utc) + timedelta(days=365 * 100)  # the model stays loaded
