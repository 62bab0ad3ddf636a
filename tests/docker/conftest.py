"""Docker sandbox tests: they need a Docker engine and the sandbox image, and skip with the reason otherwise.

`.ci/run` installs docker.io, starts dockerd (no bridge, no iptables) and builds the image, so in CI they run.
Locally: start a dockerd, `export DOCKER_HOST=...`, then `make sandbox-image`.
"""

import os

import pytest

from megarl.sandbox.docker import DEFAULT_IMAGE, docker_status

IMAGE = os.environ.get("MEGARL_SANDBOX_IMAGE", DEFAULT_IMAGE)


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    mine = [item for item in items if str(item.fspath).startswith(here)]
    if not mine:
        return
    reason = docker_status(IMAGE)
    for item in mine:
        item.add_marker(pytest.mark.docker)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"docker sandbox unavailable: {reason}"))
