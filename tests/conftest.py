"""Real models for the tests, pulled once into the pagelm store (PAGELM_HOME or ~/.cache/pagelm)."""

import pytest

from pagelm import store


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    return str(store.pull("smollm2-135m"))


@pytest.fixture(scope="session")
def gemma3_gguf() -> str:
    return str(store.pull("gemma3-270m"))
