"""Issue 13's red-team classes as regression tests on the local backend (the Docker twin:
`tests/docker/test_redteam_docker.py`; the tests and checks both run: `tests/redteam_checks.py`; the programs:
`tests/redteam_cases.py`).

Code-verifier cases run both ways the verifier runs its trusted harness here (`persistent_harness=True`: the
worker's persistent harness; `False`: one sandbox job per case), on a single worker restarted for each test, so
that what one test leaves cannot reach the next; plain-job variants go through `LocalSandbox.run(Job(...))` where
the class applies to any job (IPC, unix sockets, memory, deep trees, clone flags). Only the public API is used
(plus `LocalSandbox._root`, to check what is left on disk). The tests both backends run alike are imported from
`redteam_checks` where they run (the place sets the order); the fixtures below give them the local backend.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

import redteam_cases as rc
import redteam_checks as checks
from megarl.sandbox import Job, Limits
from megarl.sandbox.local import LocalSandbox
from megarl.verifiers.code import CodeVerifier
from redteam_checks import host_segment, host_sockets, persistent, problems  # noqa: F401 - the shared fixtures

REPO = Path(__file__).resolve().parents[2]
ROOT = os.geteuid() == 0


def _child_env() -> dict:
    """The environment of a child Python that imports megarl from this checkout and the shared test cases."""
    paths = [str(REPO), str(REPO / "tests"), str(REPO / "tools" / "bench"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def verifier(persistent: bool, **kwargs) -> CodeVerifier:
    return CodeVerifier(workers=1, persistent_harness=persistent, **kwargs)


def sandbox(limits: Limits) -> LocalSandbox:
    """A single-worker sandbox for plain jobs (`new_sandbox`'s; the class 4 and 7 checks take it directly)."""
    return LocalSandbox(workers=1, limits=limits)


@pytest.fixture
def fresh():
    """Make a single-worker code verifier on a freshly started sandbox; closed again after the test. (Verifiers
    with the same backend and worker count share one sandbox per process: closing it restarts its worker.)"""
    with checks.fresh_verifiers(verifier) as make:
        yield make


@pytest.fixture
def shared(fresh):
    """For cases that leave nothing (Docker runs them on its shared pool): here too a freshly started worker."""
    return fresh


@pytest.fixture
def new_sandbox():
    """What the shared plain-job tests make their sandbox with."""
    return sandbox


# ---- class 1 ---------------------------------------------------------------------------------------------------

test_class1_helpers_come_from_the_row = checks.class1_helpers_come_from_the_row


# ---- class 2 ---------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not ROOT, reason="the control runs in fresh pid and IPC namespaces (root)")
@pytest.mark.parametrize("channel", [c if c != "pid_counter" else pytest.param(c, marks=pytest.mark.slow)
                                     for c in rc.ORACLE_CHANNELS])
def test_class2_control_the_oracle_passes_when_its_state_persists(problems, tmp_path, channel):
    """Without this the oracle tests below could pass for a broken oracle."""
    token = uuid.uuid4().hex
    try:
        n = rc.control_oracle(rc.class2_oracle(channel, token), rc.humaneval(problems, rc.ORACLE_PROBLEM),
                              str(tmp_path))
    finally:
        os.chmod(tmp_path, 0o700)
        rc.oracle_leftovers_cleanup(token)
    assert 1 < n <= 15, f"the {channel} oracle did not learn is_prime's answers even with its state kept ({n})"


test_class2_no_oracle_across_cases = checks.class2_no_oracle_across_cases


# ---- class 3 ---------------------------------------------------------------------------------------------------

test_class3_no_sabotage_of_later_cases = checks.class3_no_sabotage_of_later_cases


# ---- class 4 ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", [".", "/tmp"])
def test_class4_deep_tree_code_verifier(fresh, persistent, where):
    checks.class4_deep_tree_code_verifier(fresh, persistent, where, root_on_host=True)


@pytest.mark.parametrize("where", [".", "/tmp"])
def test_class4_deep_tree_plain_job(where):
    checks.class4_deep_tree_plain_job(sandbox, where, root_on_host=True, attack_shown=where == ".")


# ---- class 5 ---------------------------------------------------------------------------------------------------

test_class5_host_unix_sockets_plain_job = checks.class5_host_unix_sockets_plain_job
test_class5_host_unix_sockets_code_verifier = checks.class5_host_unix_sockets_code_verifier


_NONROOT_SOCKET = r'''
import json, os, socket, tempfile
from megarl.sandbox import Job, Limits
from megarl.sandbox.local import LocalSandbox
import redteam_cases as rc
base = tempfile.mkdtemp(prefix="megarl-redteam-agent-", dir={top!r})
os.chmod(base, 0o700)
listener = rc.UnixListener(os.path.join(base, "agent.sock"), 0o600)  # ssh-agent's layout, owned by this user
sb = LocalSandbox(workers=1, limits=Limits(wall_s=10, cpu_s=10))
try:
    r = sb.run(Job(rc.unix_probe_program({{"b-user-agent": listener.address}}, as_function=False)))
    out = {{"status": r.status, "stdout": r.stdout, "reached": listener.accepted(), "describe": sb.describe()}}
finally:
    sb.close()
    listener.close()
    os.rmdir(base)
print(json.dumps(out))
'''


@pytest.mark.skipif(not ROOT or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
                    reason="needs root (to become an unprivileged user), setpriv and /usr/bin/python3")
def test_class5_user_agent_socket_as_non_root():
    """(b) as the issue saw it: a non-root user's 0600 socket in its 0700 directory (ssh-agent), and a job of the
    same user (as non-root, jobs keep the user's uid)."""
    if any(not os.stat(p).st_mode & 0o005 for p in [REPO, *REPO.parents] if str(p) != "/"):
        pytest.skip("the checkout is not world-readable")
    top = tempfile.mkdtemp(prefix="megarl-redteam-nonroot-")
    try:
        os.chmod(top, 0o777)
        script = Path(top) / "probe.py"
        script.write_text(_NONROOT_SOCKET.format(top=top))
        script.chmod(0o644)
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                               str(script)], capture_output=True, text=True, timeout=120, cwd="/", env=_child_env())
    finally:
        shutil.rmtree(top, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["status"] == "ok" and "refused" in out["stdout"], out
    assert "CONNECTED" not in out["stdout"] and not out["reached"], out


# ---- class 6 ---------------------------------------------------------------------------------------------------

test_class6_host_segment_plain_job = checks.class6_host_segment_plain_job
test_class6_host_segment_code_verifier = checks.class6_host_segment_code_verifier


def _outlived(before, after, keys, made) -> list:
    left = []
    for kind in ("shm", "msg", "sem"):
        for key, ident in after[kind] - before[kind]:
            if key in keys or (kind == "shm" and key == 0 and ident == made.get("private")):
                left.append((kind, hex(key), ident))
    return left


def _remove_made(keys, made):
    rc.remove_sysv_by_key(*keys)
    if made.get("private", -1) >= 0:
        rc.remove_sysv("shm", made["private"])


def test_class6_objects_do_not_outlive_a_plain_job():
    token = uuid.uuid4().hex
    keys = rc.ipc_creator_keys(token)
    before = rc.sysvipc()
    sb = LocalSandbox(workers=1, limits=Limits(wall_s=10, cpu_s=10))
    made = {}
    try:
        r = sb.run(Job(rc.ipc_creator_program(token, as_function=False)))
        made = rc.made_ids(r.stdout)
        left = _outlived(before, rc.sysvipc(), keys, made)
    finally:
        rc.close_quietly(sb)
        _remove_made(keys, made)
    assert r.status == "ok" and made, (r.status, r.stdout, r.stderr[-300:])
    assert not left, f"SysV objects of the job are still on the host after it ended: {left} ({r.stdout.strip()})"


def test_class6_objects_do_not_outlive_a_case(fresh, persistent):
    token = uuid.uuid4().hex
    keys = rc.ipc_creator_keys(token)
    before = rc.sysvipc()
    v = fresh(persistent)
    made = {}
    try:
        r = v.verify(rc.ipc_creator_program(token, as_function=True), {"inputs": [[]], "outputs": [["x"]],
                                                                       "fn_name": "make"})
        made = rc.made_ids(r.normalized)
        left = _outlived(before, rc.sysvipc(), keys, made)
    finally:
        v.sandbox.close()
        _remove_made(keys, made)
    assert made, rc.describe(r)
    assert not left, f"SysV objects of the case are still on the host after verify() returned: {left}"


# ---- class 7 ---------------------------------------------------------------------------------------------------

class _FilesHeld:
    """Class 7's meter here: the bytes left in the sandbox's root (/dev/shm) after the attack, and the files the
    attacks write (`rc.HOST_HELD_PATHS`) if they reached the host."""

    def start(self, warm) -> None:
        pass  # nothing to measure before: the root holds nothing of the attack yet

    def stop(self, sandbox) -> None:
        self.left = rc.tree_bytes(sandbox._root)

    def on_host(self) -> list[str]:
        return [f"wrote {path} on the host" for path in rc.host_held_cleanup()]

    def held(self, case: bool) -> list[str]:
        if self.left < 32 << 20:
            return []
        if case:
            return [f"{self.left >> 20} MB of the case's files still held after verify() returned"]
        return [f"{self.left >> 20} MB of the job's files still held after it ended"]


@pytest.mark.slow
@pytest.mark.parametrize("attack", list(rc.MEMORY_ATTACKS))
def test_class7_memory_code_verifier(fresh, persistent, attack):
    checks.class7_memory_code_verifier(fresh, persistent, attack, _FilesHeld(), memory_mb=rc.MEMORY_LIMIT_MB)


@pytest.mark.slow
@pytest.mark.parametrize("attack", list(rc.MEMORY_ATTACKS))
def test_class7_memory_plain_job(attack):
    checks.class7_memory_plain_job(sandbox, attack, _FilesHeld(),
                                   Limits(wall_s=30, cpu_s=30, memory_mb=rc.MEMORY_LIMIT_MB))


# ---- class 8 ---------------------------------------------------------------------------------------------------

test_class8_crashes_lose_nothing = checks.class8_crashes_lose_nothing
test_class8_partial_score_survives_a_crash = checks.class8_partial_score_survives_a_crash


# ---- class 9 ---------------------------------------------------------------------------------------------------

_CLASS9_DRIVER = r'''
import json, time
import redteam_cases as rc
from megarl.verifiers.code import CodeVerifier
case = next(c for c in rc.class9_work() if c.name == {name!r})
v = CodeVerifier(workers=1, time_s={time_s}, memory_mb=rc.CLASS9_MEMORY_MB, persistent_harness={persistent})
warm = v.verify(rc.GOOD_F, rc.F_CHECK)  # the worker and its harness are up before the clock starts
print("READY", flush=True)
start = time.monotonic()
r = v.verify(case.program, case.gold)
seconds = time.monotonic() - start
v.sandbox.close()
print(json.dumps({{"warm": warm.score, "score": r.score, "outcome": r.outcome, "normalized": r.normalized,
                  "seconds": seconds}}))
'''
CLASS9_TIME_S = 20.0  # per test: walls of 25 s (call mode) and 45 s (check), so "a few seconds" is well under


def _address_space_cap():
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # what keeps the machine safe if the hole is open


@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in rc.class9_work()])
def test_class9_harness_work_is_bounded(persistent, name):
    """Run in a child process whose address space (and so its sandbox's, which inherits it) is capped at 3 GB:
    with the hole open the harness grows until the cap instead of taking the machine."""
    script = _CLASS9_DRIVER.format(name=name, time_s=CLASS9_TIME_S, persistent=persistent)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_address_space_cap, env=_child_env())
    try:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()[-2000:]
        with rc.MemSampler() as mem:
            out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["warm"] == 1.0, result
    checks.class9_bounded(name, result, mem.drop_mb)


# ---- class 10 --------------------------------------------------------------------------------------------------

test_class10_forged_exit_status = checks.class10_forged_exit_status


# ---- class 11 --------------------------------------------------------------------------------------------------

test_class11_clone_namespaces_plain_job = checks.class11_clone_namespaces_plain_job
test_class11_clone_namespaces_code_verifier = checks.class11_clone_namespaces_code_verifier


# ---- class 12 --------------------------------------------------------------------------------------------------

test_class12_correct_programs_pass = checks.class12_correct_programs_pass


def test_class12_numpy_program_passes(fresh, persistent):
    pytest.importorskip("numpy", reason="the host Python has no numpy: nothing for the sandbox to offer")
    r = checks.class12_numpy_verdict(fresh, persistent)
    assert r.score == 1.0, rc.describe(r)


# ---- the property ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_property_no_case_sees_what_another_did(fresh, persistent):
    """20 observers interleaved with polluters on one worker: every observer sees the same state."""
    checks.property_no_case_sees_what_another_did(fresh, persistent, strict_close=True)
