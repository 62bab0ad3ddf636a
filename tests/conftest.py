import os
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megarl from the checkout
# The benches' case modules (tools/bench/sandbox_cases.py), last: nothing there may shadow an installed module.
sys.path.append(str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
# The planted hacker's catalogue (tests/e2e/hack_catalogue.py), for the tests that read it; last, like the benches'.
sys.path.append(str(Path(__file__).resolve().parent / "e2e"))

from helpers import ENV_FOLDERS, build_test_starter, group_of, make_tiny_hf_model


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("qwen2"), "qwen2", tie=False)


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("llama"), "llama", tie=True, seed=1)


@pytest.fixture()
def process_group():
    """Megatron's parallel state over one in-process gloo rank (TP 1, PP 1), for an actor built in a unit test."""
    from megarl.mcore import parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    parallel.init_distributed(tp=1, pp=1, timeout_s=60, seed=0)
    yield
    parallel.destroy()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture()
def one_rank_group():
    """A one-process gloo group, for code whose metrics or checks reduce over ranks."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def starter():
    """A briefly pre-trained starter model and its data, built by the real tool (`helpers.build_test_starter`)."""
    return build_test_starter()


# The tests that need an environment of their own (helpers.ENV_FOLDERS) run last, so that `.ci/run` can build the
# environments while the rest runs; then `make test`'s xdist groups: `helpers.group_of` says which and why.
# tryfirst: the markers must be there before pytest-xdist's own hook reads them into the node ids.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    env_dirs = {Path(__file__).parent / d for d in ENV_FOLDERS.values()}
    items.sort(key=lambda item: any(d in Path(str(item.fspath)).parents for d in env_dirs))  # stable
    if not config.pluginmanager.hasplugin("xdist"):
        return
    groups: dict[Path, str] = {}
    for item in items:
        path = Path(str(item.fspath))
        if path not in groups:
            groups[path] = group_of(path)
        item.add_marker(pytest.mark.xdist_group(groups[path]))
