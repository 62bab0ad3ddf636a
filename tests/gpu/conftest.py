"""Tests under tests/gpu need a CUDA GPU: they are marked `gpu` and skipped where torch sees none.

Import CUDA-only packages (transformer_engine, ...) inside the tests or with `pytest.importorskip`, since a
module that fails to import is a collection error, which no skip marker can turn into a skip.
"""

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees every collected item, not only this directory's, hence the path filter.
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
