"""The test folders have no `__init__.py` (pytest's rootdir-relative imports): two test files with one basename
cannot both be collected ("import file mismatch"), and the second folder's whole file errors out in `make test`."""

from __future__ import annotations

from collections import Counter

from helpers import REPO


def test_every_test_file_has_a_basename_of_its_own():
    names = Counter(p.name for p in (REPO / "tests").rglob("test_*.py"))
    assert [name for name, n in names.items() if n > 1] == []
