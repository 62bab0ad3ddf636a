"""Issue 13's red-team classes as regression tests on the local backend (the Docker twin:
`tests/docker/test_redteam_docker.py`; the programs: `tests/redteam_cases.py`).

Code-verifier cases run both ways the verifier runs its trusted harness here (`persistent_harness=True`: the
worker's persistent harness; `False`: one sandbox job per case), on a single worker restarted for each test, so
that what one test leaves cannot reach the next; plain-job variants go through `LocalSandbox.run(Job(...))` where
the class applies to any job (IPC, unix sockets, memory, deep trees, clone flags). Only the public API is used
(plus `LocalSandbox._root`, to check what is left on disk).
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
from megarl.sandbox import Job, Limits
from megarl.sandbox.local import LocalSandbox
from megarl.verifiers.code import CodeVerifier
from sandbox_cases import humaneval_problems

REPO = Path(__file__).resolve().parents[2]
MODES = {"persistent harness": True, "harness as a job": False}
ROOT = os.geteuid() == 0


@pytest.fixture(params=list(MODES), scope="module")
def persistent(request) -> bool:
    return MODES[request.param]


@pytest.fixture
def fresh():
    """Make a single-worker code verifier on a freshly started sandbox; closed again after the test. (Verifiers
    with the same backend and worker count share one sandbox per process: closing it restarts its worker.)"""
    made = []

    def make(persistent: bool, **kwargs) -> CodeVerifier:
        v = CodeVerifier(workers=1, persistent_harness=persistent, **kwargs)
        rc.close_quietly(v.sandbox)
        made.append(v)
        return v

    yield make
    for v in made:
        rc.close_quietly(v.sandbox)


@pytest.fixture(scope="module")
def problems():
    return humaneval_problems()


# ---- class 1 ---------------------------------------------------------------------------------------------------

CLASS1 = [f"HumanEval/{n} {kind}" for n in rc.HELPER_HACKS
          for kind in ("helpers redefined", "canonical, prompt + body", "canonical, entry point only")]


@pytest.mark.parametrize("name", CLASS1)
def test_class1_helpers_come_from_the_row(fresh, persistent, problems, name):
    case = next(c for c in rc.class1_helpers(problems) if c.name == name)
    r = fresh(persistent).verify(case.program, case.gold)
    assert r.score == case.score, (case.why, rc.describe(r))


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


@pytest.mark.slow
@pytest.mark.parametrize("channel", rc.ORACLE_CHANNELS)
def test_class2_no_oracle_across_cases(fresh, persistent, problems, channel):
    token = uuid.uuid4().hex
    problem = rc.humaneval(problems, rc.ORACLE_PROBLEM)
    program, gold = rc.class2_oracle(channel, token), rc.humaneval_gold(problem)
    v = fresh(persistent, time_s=10.0)
    try:
        for k in range(1, 16):
            r = v.verify(program, gold)
            assert r.score == 0.0, f"the oracle passed is_prime on submission {k}, its state kept in {channel}"
    finally:
        rc.close_quietly(v.sandbox)
        rc.oracle_leftovers_cleanup(token)


# ---- class 3 ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("writer", list(rc.class3_writers()))
@pytest.mark.parametrize("saboteur", ["none"] + list(rc.class3_saboteurs()))
def test_class3_no_sabotage_of_later_cases(fresh, persistent, saboteur, writer):
    """`none`: the writer alone on a fresh worker (what it scores without sabotage)."""
    v = fresh(persistent)
    if saboteur != "none":
        v.verify(rc.class3_saboteurs()[saboteur], rc.ADD)
    case = rc.class3_writers()[writer]
    r = v.verify(case.program, case.gold)
    assert r.score == 1.0, (f"after {saboteur!r}", rc.describe(r))


# ---- class 4 ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", [".", "/tmp"])
def test_class4_deep_tree_code_verifier(fresh, persistent, where):
    before = rc.sandbox_dirs()
    v = fresh(persistent, time_s=10.0)
    sandbox = v.sandbox
    made = v.verify(rc.deep_tree_program(where), rc.ADD)
    after = v.verify(rc.AFTER_DEEP_TREE, rc.AFTER_DEEP_TREE_GOLD)
    root = sandbox._root
    raised = rc.close_error(sandbox)
    left = os.path.exists(root)
    rc.close_quietly(sandbox)
    problems = rc.deep_tree_problems(made=None if rc.no_sandbox_error(made) else rc.describe(made),
                                     after=None if after.score == 1.0 and rc.no_sandbox_error(after)
                                     else rc.describe(after), raised=raised,
                                     left=root if left or rc.stray_sandbox_dirs(before) else None)
    assert not problems, problems


@pytest.mark.parametrize("where", [".", "/tmp"])
def test_class4_deep_tree_plain_job(where):
    before = rc.sandbox_dirs()
    sb = LocalSandbox(workers=1, limits=Limits(wall_s=20, cpu_s=20))
    try:
        made = sb.run(Job(rc.deep_tree_program(where, then="")))
        after = sb.run(Job(rc.AFTER_DEEP_TREE_JOB))
        root = sb._root
        raised = rc.close_error(sb)
        left = os.path.exists(root)
    finally:
        rc.close_quietly(sb)
    problems = rc.deep_tree_problems(
        made=None if made.status == "ok" else f"{made.status} {made.detail}",
        after=None if (after.status, after.stdout) == ("ok", "clean\n") else f"{after.status} {after.stdout!r}",
        raised=raised, left=root if left or rc.stray_sandbox_dirs(before) else None)
    assert not problems, problems
    if where == ".":
        assert "DEEP-TREE-MADE" in made.stdout, made.stdout[-300:]  # the attack happened


# ---- class 5 ---------------------------------------------------------------------------------------------------

@pytest.fixture
def host_sockets(tmp_path):
    """(a) a 0777 socket in a root-owned 0700 directory, (b) a 0600 socket in a 0700 directory, (c) an abstract
    socket; the tmp dir is made traversable like `make_secret` does."""
    tmp_path.chmod(0o755)
    listeners = {}
    try:
        for name, mode in (("a-0777-in-0700-dir", 0o777), ("b-0600-in-0700-dir", 0o600)):
            d = tmp_path / name
            d.mkdir(mode=0o700)
            listeners[name] = rc.UnixListener(str(d / "s.sock"), mode)
        listeners["c-abstract"] = rc.UnixListener("\0megarl-redteam-" + uuid.uuid4().hex)
        yield listeners
    finally:
        for listener in listeners.values():
            listener.close()


def _reached(listeners) -> list[str]:
    return [name for name, listener in listeners.items() if listener.accepted()]


def test_class5_host_unix_sockets_plain_job(host_sockets):
    addresses = {name: listener.address for name, listener in host_sockets.items()}
    sb = LocalSandbox(workers=1, limits=Limits(wall_s=10, cpu_s=10))
    try:
        r = sb.run(Job(rc.unix_probe_program(addresses, as_function=False)))
    finally:
        rc.close_quietly(sb)
    reached = _reached(host_sockets)
    assert r.status == "ok" and r.stdout.count("refused") == 3, (r.status, r.stdout, r.stderr[-300:])
    assert "CONNECTED" not in r.stdout and not reached, (r.stdout, reached)


def test_class5_host_unix_sockets_code_verifier(fresh, persistent, host_sockets):
    addresses = {name: listener.address for name, listener in host_sockets.items()}
    r = fresh(persistent).verify(rc.unix_probe_program(addresses, as_function=True), rc.unix_probe_gold())
    reached = _reached(host_sockets)
    assert r.score == 1.0 and not reached, (rc.describe(r), reached)


_NONROOT_SOCKET = r'''
import json, os, socket, sys, tempfile
sys.path.insert(0, {repo!r})
from megarl.sandbox import Job, Limits
from megarl.sandbox.local import LocalSandbox
sys.path.insert(0, {tests!r})
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
        script.write_text(_NONROOT_SOCKET.format(repo=str(REPO), tests=str(REPO / "tests"), top=top))
        script.chmod(0o644)
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                               str(script)], capture_output=True, text=True, timeout=120, cwd="/")
    finally:
        shutil.rmtree(top, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["status"] == "ok" and "refused" in out["stdout"], out
    assert "CONNECTED" not in out["stdout"] and not out["reached"], out


# ---- class 6 ---------------------------------------------------------------------------------------------------

@pytest.fixture
def host_segment():
    token = uuid.uuid4().hex
    content = b"HOST-" + token.encode()
    rc.remove_sysv_by_key(rc.token_key(token))
    seg = rc.HostSegment(rc.token_key(token), content)
    try:
        yield seg, content
    finally:
        seg.remove()


def test_class6_host_segment_plain_job(host_segment):
    seg, content = host_segment
    sb = LocalSandbox(workers=1, limits=Limits(wall_s=10, cpu_s=10))
    try:
        r = sb.run(Job(rc.host_ipc_program(seg.key, as_function=False)))
    finally:
        rc.close_quietly(sb)
    assert r.status == "ok" and r.stdout.startswith("refused"), (r.status, r.stdout, r.stderr[-300:])
    assert seg.read(len(content)) == content, "a job overwrote the host's segment"


def test_class6_host_segment_code_verifier(fresh, persistent, host_segment):
    seg, content = host_segment
    gold = rc.HOST_IPC_GOLD
    r = fresh(persistent).verify(rc.host_ipc_program(seg.key, as_function=True), gold)
    assert r.score == 1.0, rc.describe(r)
    assert seg.read(len(content)) == content, "a case overwrote the host's segment"


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

@pytest.mark.slow
@pytest.mark.parametrize("attack", list(rc.MEMORY_ATTACKS))
def test_class7_memory_code_verifier(fresh, persistent, attack):
    v = fresh(persistent, memory_mb=rc.MEMORY_LIMIT_MB, time_s=20.0)
    r = v.verify(rc.MEMORY_ATTACKS[attack], rc.MEMORY_GOLD)
    left = rc.tree_bytes(v.sandbox._root)
    problems = [f"wrote {path} on the host" for path in rc.host_held_cleanup()]
    if r.score != 0.0:
        problems.append(f"~1 GB held at once under a {rc.MEMORY_LIMIT_MB} MB limit ({rc.describe(r)})")
    if left >= 32 << 20:
        problems.append(f"{left >> 20} MB of the case's files still held after verify() returned")
    assert not problems, (attack, problems)


@pytest.mark.slow
@pytest.mark.parametrize("attack", list(rc.MEMORY_ATTACKS))
def test_class7_memory_plain_job(attack):
    sb = LocalSandbox(workers=1, limits=Limits(wall_s=30, cpu_s=30, memory_mb=rc.MEMORY_LIMIT_MB))
    try:
        r = sb.run(Job(rc.memory_job(attack)))
        left = rc.tree_bytes(sb._root)
    finally:
        rc.close_quietly(sb)
    problems = [f"wrote {path} on the host" for path in rc.host_held_cleanup()]
    if "HELD" in r.stdout:
        problems.append(f"~1 GB held at once under a {rc.MEMORY_LIMIT_MB} MB limit")
    if left >= 32 << 20:
        problems.append(f"{left >> 20} MB of the job's files still held after it ended")
    assert not problems, (attack, problems, r.status, r.stdout[-200:])


# ---- class 8 ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [c.name for c in rc.class8_crashes()])
def test_class8_crashes_lose_nothing(fresh, persistent, name):
    case = next(c for c in rc.class8_crashes() if c.name == name)
    v = fresh(persistent)
    r = v.verify(case.program, case.gold)
    after = v.verify(rc.GOOD_F, rc.F_CHECK)
    problems = []
    if r.score != 0.0 or not rc.no_sandbox_error(r):
        problems.append(f"the case: {rc.describe(r)}")
    if after.score != 1.0 or not rc.no_sandbox_error(after):
        problems.append(f"the next case on the worker: {rc.describe(after)}")
    assert not problems, problems


@pytest.mark.parametrize("name", [c.name for c in rc.class8_fraction()])
def test_class8_partial_score_survives_a_crash(fresh, persistent, name):
    case = next(c for c in rc.class8_fraction() if c.name == name)
    v = fresh(persistent, reward=case.reward)
    r = v.verify(case.program, case.gold)
    assert r.score == pytest.approx(case.score), rc.describe(r)


# ---- class 9 ---------------------------------------------------------------------------------------------------

_CLASS9_DRIVER = r'''
import json, sys, time
sys.path[:0] = [{repo!r}, {tests!r}]
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
    script = _CLASS9_DRIVER.format(repo=str(REPO), tests=str(REPO / "tests"), name=name, time_s=CLASS9_TIME_S,
                                   persistent=persistent)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_address_space_cap)
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
    assert not rc.class9_problems(result, mem.drop_mb), (name, rc.class9_problems(result, mem.drop_mb))


# ---- class 10 --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [c.name for c in rc.class10_forged_status()])
def test_class10_forged_exit_status(fresh, persistent, name):
    case = next(c for c in rc.class10_forged_status() if c.name == name)
    r = fresh(persistent).verify(case.program, case.gold)
    assert r.score == case.score, rc.describe(r)


# ---- class 11 --------------------------------------------------------------------------------------------------

def test_class11_clone_namespaces_plain_job():
    sb = LocalSandbox(workers=1, limits=Limits(wall_s=10, cpu_s=10))
    try:
        r = sb.run(Job(rc.class11_clone(as_function=False)))
    finally:
        rc.close_quietly(sb)
    assert r.status == "ok" and r.stdout.count("refused") == 2, (r.status, r.stdout, r.stderr[-300:])
    assert "CREATED" not in r.stdout, r.stdout


def test_class11_clone_namespaces_code_verifier(fresh, persistent):
    r = fresh(persistent).verify(rc.class11_clone(as_function=True), rc.CLONE_GOLD)
    assert r.score == 1.0, rc.describe(r)


# ---- class 12 --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [c.name for c in rc.class12_correct()])
def test_class12_correct_programs_pass(fresh, persistent, name):
    case = next(c for c in rc.class12_correct() if c.name == name)
    r = fresh(persistent, time_s=10.0).verify(case.program, case.gold)
    assert r.score == 1.0, rc.describe(r)


def test_class12_numpy_program_passes(fresh, persistent):
    pytest.importorskip("numpy", reason="the host Python has no numpy: nothing for the sandbox to offer")
    case = rc.NUMPY_CASE
    r = fresh(persistent, time_s=10.0).verify(case.program, case.gold)
    assert r.score == 1.0, rc.describe(r)


# ---- the property ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_property_no_case_sees_what_another_did(fresh, persistent):
    """20 observers interleaved with polluters on one worker: every observer sees the same state."""
    v = fresh(persistent)
    observer, dirty = rc.observer_program(), rc.polluters()
    seen, ipc_before = [], rc.sysvipc()
    try:
        for i in range(20):
            r = v.verify(observer, rc.OBSERVE_GOLD)
            seen.append(rc.observation(r.normalized))
            assert seen[-1], f"observer {i} reported nothing: {rc.describe(r)}"
            v.verify(dirty[i % len(dirty)], rc.ADD)
    finally:
        v.sandbox.close()
        rc.property_cleanup(ipc_before)
    distinct = sorted(set(seen))
    assert len(distinct) == 1, (f"{len(distinct)} different states seen over 20 runs; changing: "
                                f"{rc.differences(seen)}; first two: {distinct[:2]}")
