"""Issue 13's red-team classes as regression tests on the Docker backend (the local twin:
`tests/unit/test_redteam_local.py`; the programs: `tests/redteam_cases.py`). Skipped with the reason where there is
no Docker engine or sandbox image (`tests/docker/conftest.py`).

Code-verifier cases run both ways the verifier runs its trusted harness on Docker (`persistent_harness=True`:
containers whose pid 1 is the persistent harness; `False`: one job per case in the runner containers), with one
worker. Tests of state left between cases (classes 2, 3, 4, 7, 8, 9 and the property) start from fresh containers
and remove them afterwards; the others share the pool. Plain-job variants go through `DockerSandbox.run(Job(...))`.
Verifiers are built with the default memory (the pool's containers are sized by it, 1152 MB) and a row that asks
for less (`memory_mb` in the gold) gets less: that per-case limit is what classes 7 and 9 hold the backend to.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid

import pytest

import redteam_cases as rc
from megarl.sandbox import Job, Limits
from megarl.sandbox.docker import DEFAULT_IMAGE, LABEL, DockerSandbox
from megarl.verifiers.code import CodeVerifier
from sandbox_cases import humaneval_problems

IMAGE = os.environ.get("MEGARL_SANDBOX_IMAGE", DEFAULT_IMAGE)
MODES = {"persistent harness": True, "harness as a job": False}


@pytest.fixture(params=list(MODES), scope="module")
def persistent(request) -> bool:
    return MODES[request.param]


def verifier(persistent: bool, **kwargs) -> CodeVerifier:
    return CodeVerifier(backend="docker", image=IMAGE, workers=1, persistent_harness=persistent, **kwargs)


@pytest.fixture
def fresh():
    """A single-worker Docker code verifier on fresh containers, removed again after the test. (Verifiers with
    the same backend, worker count and image share one pool per process: closing it makes new containers.)"""
    made = []

    def make(persistent: bool, **kwargs) -> CodeVerifier:
        v = verifier(persistent, **kwargs)
        rc.close_quietly(v.sandbox)
        made.append(v)
        return v

    yield make
    for v in made:
        rc.close_quietly(v.sandbox)


@pytest.fixture
def shared():
    """The pool as the last test left it (every test that leaves state behind closes it): for cases that
    leave nothing."""
    return verifier


@pytest.fixture(scope="module", autouse=True)
def _pool_closed_at_the_end():
    yield
    rc.close_quietly(verifier(True).sandbox)


@pytest.fixture(scope="module")
def problems():
    return humaneval_problems()


# ---- class 1 ---------------------------------------------------------------------------------------------------

CLASS1 = [f"HumanEval/{n} {kind}" for n in rc.HELPER_HACKS
          for kind in ("helpers redefined", "canonical, prompt + body", "canonical, entry point only")]


@pytest.mark.parametrize("name", CLASS1)
def test_class1_helpers_come_from_the_row(shared, persistent, problems, name):
    case = next(c for c in rc.class1_helpers(problems) if c.name == name)
    r = shared(persistent).verify(case.program, case.gold)
    assert r.score == case.score, (case.why, rc.describe(r))


# ---- class 2 ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("channel", rc.ORACLE_CHANNELS)
def test_class2_no_oracle_across_cases(fresh, persistent, problems, channel):
    """The oracle's control (it passes on its 7th run when its state persists) is in the local tests."""
    token = uuid.uuid4().hex
    problem = rc.humaneval(problems, rc.ORACLE_PROBLEM)
    program, gold = rc.class2_oracle(channel, token), rc.humaneval_gold(problem)
    v = fresh(persistent, time_s=10.0)
    for k in range(1, 16):
        r = v.verify(program, gold)
        assert r.score == 0.0, f"the oracle passed is_prime on submission {k}, its state kept in {channel}"


# ---- class 3 ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("writer", list(rc.class3_writers()))
@pytest.mark.parametrize("saboteur", ["none"] + list(rc.class3_saboteurs()))
def test_class3_no_sabotage_of_later_cases(fresh, persistent, saboteur, writer):
    v = fresh(persistent)
    if saboteur != "none":
        v.verify(rc.class3_saboteurs()[saboteur], rc.ADD)
    case = rc.class3_writers()[writer]
    r = v.verify(case.program, case.gold)
    assert r.score == 1.0, (f"after {saboteur!r}", rc.describe(r))


# ---- class 4 ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", [".", "/tmp"])
def test_class4_deep_tree_code_verifier(fresh, persistent, where):
    v = fresh(persistent, time_s=10.0)
    made = v.verify(rc.deep_tree_program(where), rc.ADD)
    after = v.verify(rc.AFTER_DEEP_TREE, rc.AFTER_DEEP_TREE_GOLD)
    raised = rc.close_error(v.sandbox)
    problems = rc.deep_tree_problems(made=None if rc.no_sandbox_error(made) else rc.describe(made),
                                     after=None if after.score == 1.0 and rc.no_sandbox_error(after)
                                     else rc.describe(after), raised=raised)
    assert not problems, problems


@pytest.mark.parametrize("where", [".", "/tmp"])
def test_class4_deep_tree_plain_job(where):
    sb = DockerSandbox(workers=1, image=IMAGE, limits=Limits(wall_s=20, cpu_s=20))
    try:
        made = sb.run(Job(rc.deep_tree_program(where, then="")))
        after = sb.run(Job(rc.AFTER_DEEP_TREE_JOB))
        raised = rc.close_error(sb)
    finally:
        rc.close_quietly(sb)
    problems = rc.deep_tree_problems(
        made=None if made.status == "ok" else f"{made.status} {made.detail}",
        after=None if (after.status, after.stdout) == ("ok", "clean\n") else f"{after.status} {after.stdout!r}",
        raised=raised)
    assert not problems, problems
    assert "DEEP-TREE-MADE" in made.stdout, made.stdout[-300:]  # the attack happened


# ---- class 5 ---------------------------------------------------------------------------------------------------

@pytest.fixture
def host_sockets(tmp_path):
    """As in the local tests: a 0777 socket in a root-owned 0700 dir, a 0600 one in a 0700 dir, an abstract one."""
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


def test_class5_host_unix_sockets_plain_job(host_sockets):
    addresses = {name: listener.address for name, listener in host_sockets.items()}
    sb = DockerSandbox(workers=1, image=IMAGE, limits=Limits(wall_s=10, cpu_s=10))
    try:
        r = sb.run(Job(rc.unix_probe_program(addresses, as_function=False)))
    finally:
        rc.close_quietly(sb)
    reached = [name for name, listener in host_sockets.items() if listener.accepted()]
    assert r.status == "ok" and r.stdout.count("refused") == 3, (r.status, r.stdout, r.stderr[-300:])
    assert "CONNECTED" not in r.stdout and not reached, (r.stdout, reached)


def test_class5_host_unix_sockets_code_verifier(shared, persistent, host_sockets):
    addresses = {name: listener.address for name, listener in host_sockets.items()}
    r = shared(persistent).verify(rc.unix_probe_program(addresses, as_function=True), rc.unix_probe_gold())
    reached = [name for name, listener in host_sockets.items() if listener.accepted()]
    assert r.score == 1.0 and not reached, (rc.describe(r), reached)


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
    sb = DockerSandbox(workers=1, image=IMAGE, limits=Limits(wall_s=10, cpu_s=10))
    try:
        r = sb.run(Job(rc.host_ipc_program(seg.key, as_function=False)))
    finally:
        rc.close_quietly(sb)
    assert r.status == "ok" and r.stdout.startswith("refused"), (r.status, r.stdout, r.stderr[-300:])
    assert seg.read(len(content)) == content, "a job overwrote the host's segment"


def test_class6_host_segment_code_verifier(shared, persistent, host_segment):
    seg, content = host_segment
    gold = rc.HOST_IPC_GOLD
    r = shared(persistent).verify(rc.host_ipc_program(seg.key, as_function=True), gold)
    assert r.score == 1.0, rc.describe(r)
    assert seg.read(len(content)) == content, "a case overwrote the host's segment"


# ---- class 7 ---------------------------------------------------------------------------------------------------

def _containers_mb() -> float:
    """What the sandbox's containers hold now (docker stats: memory less page cache), in MB: measured on them,
    not on the host, whose other processes would blur it."""
    ids = subprocess.run(["docker", "ps", "-q", "--filter", f"label={LABEL}"], capture_output=True, text=True).stdout.split()
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


@pytest.mark.slow
@pytest.mark.parametrize("attack", list(rc.MEMORY_ATTACKS))
def test_class7_memory_code_verifier(fresh, persistent, attack):
    v = fresh(persistent, time_s=20.0)
    v.verify(rc.GOOD_ADD, rc.ADD)  # the containers are up before memory is measured
    before = _containers_mb()
    r = v.verify(rc.MEMORY_ATTACKS[attack], rc.MEMORY_GOLD)
    drop = _settled_drop(before)
    problems = []
    if r.score != 0.0:
        problems.append(f"~1 GB held at once under a {rc.MEMORY_LIMIT_MB} MB limit ({rc.describe(r)})")
    if drop >= 300:
        problems.append(f"the containers still hold {drop:.0f} MB more 5 s after verify() returned")
    assert not problems, (attack, problems)


@pytest.mark.slow
@pytest.mark.parametrize("attack", list(rc.MEMORY_ATTACKS))
def test_class7_memory_plain_job(attack):
    sb = DockerSandbox(workers=1, image=IMAGE, limits=Limits(wall_s=30, cpu_s=30, memory_mb=1024))  # 1152 MB
    try:
        sb.run(Job("print(1)"))
        before = _containers_mb()
        r = sb.run(Job(rc.memory_job(attack), limits=Limits(wall_s=30, cpu_s=30, memory_mb=rc.MEMORY_LIMIT_MB)))
        drop = _settled_drop(before)
    finally:
        rc.close_quietly(sb)
    problems = []
    if "HELD" in r.stdout:
        problems.append(f"~1 GB held at once under a {rc.MEMORY_LIMIT_MB} MB limit")
    if drop >= 300:
        problems.append(f"the containers still hold {drop:.0f} MB more 5 s after the job ended")
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
    r = fresh(persistent, reward=case.reward).verify(case.program, case.gold)
    assert r.score == pytest.approx(case.score), rc.describe(r)


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
    result = {"score": r.score, "normalized": r.normalized, "seconds": seconds}
    assert not rc.class9_problems(result, mem.drop_mb), (name, rc.class9_problems(result, mem.drop_mb))


# ---- class 10 --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [c.name for c in rc.class10_forged_status()])
def test_class10_forged_exit_status(shared, persistent, name):
    case = next(c for c in rc.class10_forged_status() if c.name == name)
    r = shared(persistent).verify(case.program, case.gold)
    assert r.score == case.score, rc.describe(r)


# ---- class 11 --------------------------------------------------------------------------------------------------

def test_class11_clone_namespaces_plain_job():
    sb = DockerSandbox(workers=1, image=IMAGE, limits=Limits(wall_s=10, cpu_s=10))
    try:
        r = sb.run(Job(rc.class11_clone(as_function=False)))
    finally:
        rc.close_quietly(sb)
    assert r.status == "ok" and r.stdout.count("refused") == 2, (r.status, r.stdout, r.stderr[-300:])
    assert "CREATED" not in r.stdout, r.stdout


def test_class11_clone_namespaces_code_verifier(shared, persistent):
    r = shared(persistent).verify(rc.class11_clone(as_function=True), rc.CLONE_GOLD)
    assert r.score == 1.0, rc.describe(r)


# ---- class 12 --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [c.name for c in rc.class12_correct()])
def test_class12_correct_programs_pass(shared, persistent, name):
    case = next(c for c in rc.class12_correct() if c.name == name)
    r = shared(persistent, time_s=10.0).verify(case.program, case.gold)
    assert r.score == 1.0, rc.describe(r)


def test_class12_numpy_program_passes(shared, persistent):
    """Expected to pass once the image carries the host's site-packages; until then an explicit xfail, and only
    when a plain job confirms the image has no numpy anywhere its Python looks (site-packages included, which the
    pool's `python -S` leaves out): numpy in the image but out of the program's reach is a failure."""
    pytest.importorskip("numpy", reason="the host Python has no numpy: nothing for the image to carry")
    case = rc.NUMPY_CASE
    r = shared(persistent, time_s=10.0).verify(case.program, case.gold)
    if r.score != 1.0:
        sb = DockerSandbox(workers=1, image=IMAGE, limits=Limits(wall_s=20, cpu_s=20))
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
        rc.close_quietly(v.sandbox)
        rc.property_cleanup(ipc_before)
    distinct = sorted(set(seen))
    assert len(distinct) == 1, (f"{len(distinct)} different states seen over 20 runs; changing: "
                                f"{rc.differences(seen)}; first two: {distinct[:2]}")
