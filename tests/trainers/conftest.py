from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from .helpers import EMBEDDED


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """The first 40 documents of the embedded corpus, cut to 8 KB each (~67 k tokens): tokenised in < 1 s,
    where the whole embedded corpus takes ~20 s on this CPU."""
    path = tmp_path_factory.mktemp("corpus") / "micro.jsonl"
    with gzip.open(EMBEDDED, "rt", encoding="utf-8") as f, open(path, "w", encoding="utf-8") as out:
        for _, line in zip(range(40), f):
            doc = json.loads(line)
            out.write(json.dumps({"id": doc["id"], "text": doc["text"][:8000]}) + "\n")
    return path
