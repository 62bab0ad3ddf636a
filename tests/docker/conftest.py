"""Docker sandbox tests: they need a Docker engine and the sandbox image, and skip with the reason otherwise.

`.ci/run` installs docker.io, starts dockerd (no bridge, no iptables) and builds the image, so in CI they run.
Locally: start a dockerd, `export DOCKER_HOST=...`, then `make sandbox-image`.

`make test` runs the red-team classes that leave state between cases (2, 4, 7, 8, 9 and the property test) on
Docker with the persistent harness only, the mode the trainer and `megarl-verify` always use; the harness as a
job per case (`CodeVerifier(persistent_harness=False)`, Python API only) runs the other classes there, and every
class on the local backend (`tests/sandbox/test_redteam_local.py`: the same guest harness). Those Docker runs
took ~60 % of the red-team file's time; `MEGARL_REDTEAM_EVERY_MODE=1` runs them too.
"""

import os

import pytest

from megarl.sandbox.docker import DEFAULT_IMAGE, docker_status

IMAGE = os.environ.get("MEGARL_SANDBOX_IMAGE", DEFAULT_IMAGE)
# Red-team tests run with the persistent harness only, unless MEGARL_REDTEAM_EVERY_MODE=1 (the docstring says why).
PERSISTENT_ONLY = {"test_class2_no_oracle_across_cases", "test_class4_deep_tree_code_verifier",
                   "test_class7_memory_code_verifier", "test_class8_crashes_lose_nothing",
                   "test_class8_partial_score_survives_a_crash", "test_class9_harness_work_is_bounded",
                   "test_property_no_case_sees_what_another_did"}
JOB_MODE = "harness as a job"  # redteam_checks.MODES' id of persistent_harness=False


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    mine = [item for item in items if str(item.fspath).startswith(here)]
    if not mine:
        return
    if os.environ.get("MEGARL_REDTEAM_EVERY_MODE") != "1":
        dropped = [item for item in mine if item.originalname in PERSISTENT_ONLY and JOB_MODE in item.name]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if item not in dropped]
            mine = [item for item in mine if item not in dropped]
    reason = docker_status(IMAGE)
    for item in mine:
        item.add_marker(pytest.mark.docker)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"docker sandbox unavailable: {reason}"))
