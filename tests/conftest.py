"""Markers: ``gpu`` needs CUDA (skipped without it), ``sglang`` needs the CPU SGLang tier
(skipped when sglang is not importable), ``slow`` marks long tests (run by default)."""
import importlib.util

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "sglang: needs the SGLang CPU tier (tools/setup_env.sh)")
    config.addinivalue_line("markers", "slow: takes more than a minute on 2 cores")


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs CUDA")
    no_sglang = pytest.mark.skip(reason="sglang is not installed (run tools/setup_env.sh)")
    have_sglang = importlib.util.find_spec("sglang") is not None
    for item in items:
        # markers, not keywords: keywords also hold the names of the folders above the test (a
        # checkout in a folder named "gpu" would skip every test)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if item.get_closest_marker("sglang") and not have_sglang:
            item.add_marker(no_sglang)
