"""`make test`'s scheduling: under `--dist loadgroup` every test carries its file's xdist group in its node id
(`helpers.group_of`, applied in tests/conftest.py), so that a file's module fixtures are built on one worker only,
and the files that run isolated programs share one group and run one at a time. pytest 9 with pytest-xdist 3.8
drops the groups in silence (setup.py pins pytest < 9 for that). This file's text avoids the words that put a file
in the shared group, so it keeps its own."""

import os
from pathlib import Path

import pytest
from helpers import HOST_GROUP, group_of


def test_this_file_runs_in_its_own_group_under_loadgroup(request):
    if os.environ.get("PYTEST_XDIST_WORKER") is None or not request.config.getoption("loadgroup", False):
        pytest.skip("not under `pytest -n N --dist loadgroup` (as `make test` runs)")
    assert request.node.nodeid.endswith("@" + Path(__file__).name), (
        f"{request.node.nodeid!r} has no xdist group of its own: --dist loadgroup ignores the groups "
        f"(pytest {pytest.__version__})")


def test_groups_by_directory_and_by_what_a_file_runs(tmp_path):
    box = "sand" + "box"  # spelled apart: see the docstring
    for sub, text, want in [("unit", "def test_x(): assert 1\n", "test_a.py"),
                            ("unit", "import subprocess  # pg" + "rep -u 65534\n", HOST_GROUP),
                            ("e2e", f"CMD = ['--{box}', 'local']\n", HOST_GROUP),
                            (box, "def test_x(): assert 1\n", HOST_GROUP)]:
        path = tmp_path / sub / "test_a.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        assert group_of(path) == want, (sub, text)
