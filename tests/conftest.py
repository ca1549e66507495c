"""Shared fixtures: fixed seeds, one thread (the CI machine has 2 cores), tiny configs."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Token-stream caches go to a per-session temp dir, never the user's ~/.cache."""
    monkeypatch.setenv("QBENCH_CACHE", str(tmp_path_factory.getbasetemp() / "qbench-cache"))


@pytest.fixture(autouse=True)
def _fixed_kernel_dispatch(monkeypatch):
    """The real layers take the fixed kernel rule (``paths.rule``), not timings of a busy machine, so a test
    knows which path runs; the measured dispatch has its own tests (test_paths.py)."""
    monkeypatch.setenv("QBENCH_DISPATCH", "rule")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    if not torch.cuda.is_available():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
