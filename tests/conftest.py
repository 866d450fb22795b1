"""Markers (registered in pytest.ini): ``gpu`` needs CUDA (skipped without it), ``sglang`` needs the
CPU SGLang tier (skipped when sglang is not importable), ``slow`` leaves a test out of ``make test``
(``make test-all`` runs it)."""
import importlib.util

import pytest
import torch


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
