"""Issue 13's red-team classes as regression tests on the Docker backend (the local twin:
`tests/sandbox/test_redteam_local.py`; the tests and checks both run: `tests/redteam_checks.py`; the programs:
`tests/redteam_cases.py`). Skipped with the reason where there is no Docker engine or sandbox image
(`tests/docker/conftest.py`).

Code-verifier cases run both ways the verifier runs its trusted harness on Docker (`persistent_harness=True`:
containers whose pid 1 is the persistent harness; `False`: one job per case in the runner containers), with one
worker. Tests of state left between cases (classes 2, 3, 4, 7, 8, 9 and the property) start from fresh containers
and remove them afterwards; the others share the pool. Plain-job variants go through `DockerSandbox.run(Job(...))`.
Verifiers are built with the default memory (the pool's containers are sized by it, 1152 MB) and a row that asks
for less (`memory_mb` in the gold) gets less: that per-case limit is what classes 7 and 9 hold the backend to.
The tests both backends run alike are imported from `redteam_checks` where they run (the place sets the order); the
fixtures below give them the Docker backend.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

import redteam_cases as rc
import redteam_checks as checks
from megarl.sandbox import Job, Limits
from megarl.sandbox.docker import DEFAULT_IMAGE, LABEL, DockerSandbox
from megarl.verifiers.code import CodeVerifier
from redteam_checks import host_segment, host_sockets, persistent, problems  # noqa: F401 - the shared fixtures

IMAGE = os.environ.get("MEGARL_SANDBOX_IMAGE", DEFAULT_IMAGE)


def verifier(persistent: bool, **kwargs) -> CodeVerifier:
    return CodeVerifier(backend="docker", image=IMAGE, workers=1, persistent_harness=persistent, **kwargs)


def sandbox(limits: Limits) -> DockerSandbox:
    """A single-worker sandbox (its own containers) for plain jobs (`new_sandbox`'s; the class 4 and 7 checks and
    the numpy probe take it directly)."""
    return DockerSandbox(workers=1, image=IMAGE, limits=limits)


@pytest.fixture
def fresh():
    """A single-worker Docker code verifier on fresh containers, removed again after the test. (Verifiers with
    the same backend, worker count and image share one pool per process: closing it makes new containers.)"""
    with checks.fresh_verifiers(verifier) as make:
        yield make


@pytest.fixture
def shared():
    """The pool as the last test left it (every test that leaves state behind closes it): for cases that
    leave nothing."""
    return verifier


@pytest.fixture(scope="module", autouse=True)
def _pool_closed_at_the_end():
    yield
    rc.close_quietly(verifier(True).sandbox)


@pytest.fixture
def new_sandbox():
    """What the shared plain-job tests make their sandbox with."""
    return sandbox


# ---- class 1 ---------------------------------------------------------------------------------------------------

test_class1_helpers_come_from_the_row = checks.class1_helpers_come_from_the_row


# ---- class 2 ---------------------------------------------------------------------------------------------------

test_class2_no_oracle_across_cases = checks.class2_no_oracle_across_cases


# ---- class 3 ---------------------------------------------------------------------------------------------------

test_class3_no_sabotage_of_later_cases = checks.class3_no_sabotage_of_later_cases


# ---- class 4 ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", [".", "/tmp"])
def test_class4_deep_tree_code_verifier(fresh, persistent, where):
    checks.class4_deep_tree_code_verifier(fresh, persistent, where, root_on_host=False)


@pytest.mark.parametrize("where", [".", "/tmp"])
def test_class4_deep_tree_plain_job(where):
    checks.class4_deep_tree_plain_job(sandbox, where, root_on_host=False, attack_shown=True)


# ---- class 5 ---------------------------------------------------------------------------------------------------

test_class5_host_unix_sockets_plain_job = checks.class5_host_unix_sockets_plain_job
test_class5_host_unix_sockets_code_verifier = checks.class5_host_unix_sockets_code_verifier


# ---- class 6 ---------------------------------------------------------------------------------------------------

test_class6_host_segment_plain_job = checks.class6_host_segment_plain_job
test_class6_host_segment_code_verifier = checks.class6_host_segment_code_verifier


# ---- class 7 ---------------------------------------------------------------------------------------------------

def _containers_mb() -> float:
    """What the sandbox's containers hold now (docker stats: memory less page cache), in MB: measured on them,
    not on the host, whose other processes would blur it."""
    ids = subprocess.run(["docker", "ps", "-q", "--filter", f"label={LABEL}"], capture_output=True,
                         text=True).stdout.split()
    if not ids:
        return 0.0
    out = subprocess.run(["docker", "stats", "--no-stream", "--format", "{{.MemUsage}}"] + ids, capture_output=True,
                         text=True).stdout
    units = {"B": 1 / (1 << 20), "KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}
    total = 0.0
    for line in out.splitlines():
        used = line.split("/")[0].strip()
        number = used.rstrip("BKMGiTb")
        total += float(number) * units[used[len(number):]]
    return total


def _settled_drop(before_mb: float, threshold_mb: float = 300, within_s: float = 5.0) -> float:
    """How much more the containers hold after a case than `before_mb` (`_containers_mb()` before it): the
    smallest excess seen within `within_s`."""
    best = _containers_mb() - before_mb
    deadline = time.monotonic() + within_s
    while best >= threshold_mb and time.monotonic() < deadline:
        time.sleep(0.25)
        best = min(best, _containers_mb() - before_mb)
    return best


class _ContainersHeld:
    """Class 7's meter here: how much more the sandbox's containers hold 5 s after the attack than before it."""

    def start(self, warm) -> None:
        warm()  # the containers are up before memory is measured
        self.before = _containers_mb()

    def stop(self, sandbox) -> None:
        self.drop = _settled_drop(self.before)

    def on_host(self) -> list[str]:
        return []

    def held(self, case: bool) -> list[str]:
        if self.drop < 300:
            return []
        ended = "verify() returned" if case else "the job ended"
        return [f"the containers still hold {self.drop:.0f} MB more 5 s after {ended}"]


@pytest.mark.slow
@pytest.mark.parametrize("attack", list(rc.MEMORY_ATTACKS))
def test_class7_memory_code_verifier(fresh, persistent, attack):
    checks.class7_memory_code_verifier(fresh, persistent, attack, _ContainersHeld())


@pytest.mark.slow
@pytest.mark.parametrize("attack", list(rc.MEMORY_ATTACKS))
def test_class7_memory_plain_job(attack):
    checks.class7_memory_plain_job(sandbox, attack, _ContainersHeld(),
                                   Limits(wall_s=30, cpu_s=30, memory_mb=1024),  # 1152 MB containers
                                   Limits(wall_s=30, cpu_s=30, memory_mb=rc.MEMORY_LIMIT_MB))


# ---- class 8 ---------------------------------------------------------------------------------------------------

test_class8_crashes_lose_nothing = checks.class8_crashes_lose_nothing
test_class8_partial_score_survives_a_crash = checks.class8_partial_score_survives_a_crash


# ---- class 9 ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in rc.class9_work()])
def test_class9_harness_work_is_bounded(fresh, persistent, name):
    """The containers bound what the harness can take (1152 MB): no cap of the test's own is needed here."""
    case = next(c for c in rc.class9_work() if c.name == name)
    v = fresh(persistent, time_s=20.0)
    assert v.verify(rc.GOOD_F, rc.F_CHECK).score == 1.0  # the containers are up before the clock starts
    with rc.MemSampler() as mem:
        start = time.monotonic()
        r = v.verify(case.program, case.gold)
        seconds = time.monotonic() - start
    checks.class9_bounded(name, {"score": r.score, "normalized": r.normalized, "seconds": seconds}, mem.drop_mb)


# ---- class 10 --------------------------------------------------------------------------------------------------

test_class10_forged_exit_status = checks.class10_forged_exit_status


# ---- class 11 --------------------------------------------------------------------------------------------------

test_class11_clone_namespaces_plain_job = checks.class11_clone_namespaces_plain_job
test_class11_clone_namespaces_code_verifier = checks.class11_clone_namespaces_code_verifier


# ---- class 12 --------------------------------------------------------------------------------------------------

test_class12_correct_programs_pass = checks.class12_correct_programs_pass


def test_class12_numpy_program_passes(shared, persistent):
    """Expected to pass once the image carries the host's site-packages; until then an explicit xfail, and only
    when a plain job confirms the image has no numpy anywhere its Python looks (site-packages included, which the
    pool's `python -S` leaves out): numpy in the image but out of the program's reach is a failure."""
    pytest.importorskip("numpy", reason="the host Python has no numpy: nothing for the image to carry")
    r = checks.class12_numpy_verdict(shared, persistent)
    if r.score != 1.0:
        sb = sandbox(Limits(wall_s=20, cpu_s=20))
        try:
            probe = sb.run(Job("import site\nsite.main()\nimport numpy\nprint(numpy.__version__)"))
        finally:
            rc.close_quietly(sb)
        if probe.status != "ok":
            pytest.xfail(f"the sandbox image {IMAGE} has no numpy (issue 13: it must carry the host's "
                         f"site-packages or say why not): {probe.stderr.strip().splitlines()[-1:]}")
    assert r.score == 1.0, rc.describe(r)


# ---- the property ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_property_no_case_sees_what_another_did(fresh, persistent):
    """20 observers interleaved with polluters on one worker: every observer sees the same state."""
    checks.property_no_case_sees_what_another_did(fresh, persistent, strict_close=False)
