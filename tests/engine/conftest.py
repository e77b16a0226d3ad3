"""Shared engine fixtures: the embedded Gemma 3 270M, loaded once per test session."""

from __future__ import annotations

import pytest

TEXT = (
    "The river town grew slowly through the centuries. Merchants arrived with salt and cloth, "
    "monks copied manuscripts by candle light, and in winter the bridge froze so hard that children "
    "skated beneath its arches. Later came the railway, the mills, the long strikes and the quiet "
    "decades after, when the mills fell silent and the town learned to live from its memories. "
)


@pytest.fixture(scope="session")
def llm():
    from swaserve import LLM

    return LLM(device="cpu")


@pytest.fixture(scope="session")
def long_ids(llm) -> list[int]:
    """3,000 tokens of ordinary prose, starting with BOS."""
    ids = llm.tokenizer.encode(TEXT * 60)
    assert len(ids) >= 3000
    return ids[:3000]
