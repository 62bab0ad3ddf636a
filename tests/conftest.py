import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megarl from the checkout
# The benches' case modules (tools/bench/sandbox_cases.py), last: nothing there may shadow an installed module.
sys.path.append(str(Path(__file__).resolve().parents[1] / "tools" / "bench"))

from helpers import make_tiny_hf_model, build_test_starter


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen2"), "qwen2", tie=False)


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("llama"), "llama", tie=True, seed=1)


@pytest.fixture(scope="session")
def starter():
    """A briefly pre-trained starter model and its data, built by the real tool (`helpers.build_test_starter`)."""
    return build_test_starter()


# `make test` runs the suite on two xdist workers (`-n 2 --dist loadgroup`): a 2-core machine is half idle while a
# test waits on its subprocesses' start-up. Each test file stays on one worker (its module fixtures are built once),
# and every file that runs sandboxes, code harnesses or Docker containers (all of tests/sandbox and tests/docker, and
# any other file naming them) goes to one worker in turn: those tests count host-wide processes, uids and
# containers, which another file's sandbox running beside them would change.
_HOST_STATE = re.compile(r"sandbox|harness|docker|pgrep|/proc/")


HOST_GROUP = "host-sandboxes"


def group_of(path: Path) -> str:
    """The xdist group of a test file: "host-sandboxes" or the file's name."""
    host = path.parent.name in ("sandbox", "docker") or _HOST_STATE.search(path.read_text())
    return HOST_GROUP if host else path.name


# tryfirst: the markers must be there before pytest-xdist's own hook reads them into the node ids.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    groups: dict[Path, str] = {}
    for item in items:
        path = Path(str(item.fspath))
        if path not in groups:
            groups[path] = group_of(path)
        item.add_marker(pytest.mark.xdist_group(groups[path]))
