"""Issue 13's red-team regression tests, written once for both backends (`tests/sandbox/test_redteam_local.py`,
`tests/docker/test_redteam_docker.py`; the programs and host helpers: `tests/redteam_cases.py`). Not a test module:
nothing here is collected where it stands.

Two kinds of functions:
- Tests both backends run as they are, marks and parametrization included (`class1_...`, `class3_...`): each test
  module imports them under its `test_` name where they run (the import's place sets the order pytest runs them in)
  and supplies the fixtures they ask for. Shared ones are defined here (`persistent`, `problems`, `host_sockets`,
  `host_segment`); each backend defines `fresh(persistent, **kwargs)` (a code verifier on a fresh sandbox, closed
  after the test), `shared(persistent, **kwargs)` (one for cases that leave nothing: Docker's pool as the last test
  left it, a fresh one on the local backend) and `new_sandbox` (`new_sandbox(limits)`: a single-worker sandbox for
  plain jobs, which the test closes).
- Checks a test module calls with what differs between the backends (class 4's root on the host, class 7's
  measurement, class 9's run, the property's close): the test functions, their marks and parametrization stay in the
  test modules.
Nothing here is backend-specific: no import of the Docker backend (the local tests import this module).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Callable, Protocol

import pytest

import redteam_cases as rc
from megarl.sandbox import Job, Limits
from sandbox_cases import humaneval_problems

MODES = {"persistent harness": True, "harness as a job": False}  # the `persistent` fixture's ids and values


# ---- fixtures ----------------------------------------------------------------------------------------------------

@pytest.fixture(params=list(MODES), scope="module")
def persistent(request) -> bool:
    return MODES[request.param]


@pytest.fixture(scope="module")
def problems():
    return humaneval_problems()


@contextlib.contextmanager
def fresh_verifiers(new: Callable):
    """What a backend's `fresh` fixture yields: `make(persistent, **kwargs)`, a code verifier from
    `new(persistent, **kwargs)` whose sandbox is closed first, so that it starts afresh (verifiers with the same
    backend and worker count share one sandbox per process: closing it restarts its worker or makes new
    containers); every one made is closed again at the end."""
    made = []

    def make(persistent: bool, **kwargs):
        v = new(persistent, **kwargs)
        rc.close_quietly(v.sandbox)
        made.append(v)
        return v

    yield make
    for v in made:
        rc.close_quietly(v.sandbox)


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


@pytest.fixture
def host_segment():
    """A SysV shared-memory segment of the host under a per-test key, and what it holds: (segment, content)."""
    token = uuid.uuid4().hex
    content = b"HOST-" + token.encode()
    rc.remove_sysv_by_key(rc.token_key(token))
    seg = rc.HostSegment(rc.token_key(token), content)
    try:
        yield seg, content
    finally:
        seg.remove()


# ---- class 1 ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [f"HumanEval/{n} {kind}" for n in rc.HELPER_HACKS
                                  for kind in ("helpers redefined", "canonical, prompt + body",
                                               "canonical, entry point only")])
def class1_helpers_come_from_the_row(shared, persistent, problems, name):
    case = next(c for c in rc.class1_helpers(problems) if c.name == name)
    r = shared(persistent).verify(case.program, case.gold)
    assert r.score == case.score, (case.why, rc.describe(r))


# ---- class 2 ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("channel", rc.ORACLE_CHANNELS)
def class2_no_oracle_across_cases(fresh, persistent, problems, channel):
    """The oracle's control (it passes on its 7th run when its state persists) is in the local tests."""
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
def class3_no_sabotage_of_later_cases(fresh, persistent, saboteur, writer):
    """`none`: the writer alone on a fresh worker (what it scores without sabotage)."""
    v = fresh(persistent)
    if saboteur != "none":
        v.verify(rc.class3_saboteurs()[saboteur], rc.ADD)
    case = rc.class3_writers()[writer]
    r = v.verify(case.program, case.gold)
    assert r.score == 1.0, (f"after {saboteur!r}", rc.describe(r))


# ---- class 4 ---------------------------------------------------------------------------------------------------

def _left_on_host(root_on_host: bool, root, left: bool, before: set[str]):
    """What close() left of the sandbox's files here (its root, or another sandbox directory): None if nothing."""
    return root if root_on_host and (left or rc.stray_sandbox_dirs(before)) else None


def class4_deep_tree_code_verifier(make, persistent, where, *, root_on_host: bool):
    before = rc.sandbox_dirs() if root_on_host else set()
    v = make(persistent, time_s=10.0)
    sandbox = v.sandbox
    made = v.verify(rc.deep_tree_program(where), rc.ADD)
    after = v.verify(rc.AFTER_DEEP_TREE, rc.AFTER_DEEP_TREE_GOLD)
    root = sandbox._root if root_on_host else None
    raised = rc.close_error(sandbox)
    left = root_on_host and os.path.exists(root)
    rc.close_quietly(sandbox)
    problems = rc.deep_tree_problems(made=None if rc.no_sandbox_error(made) else rc.describe(made),
                                     after=None if after.score == 1.0 and rc.no_sandbox_error(after)
                                     else rc.describe(after), raised=raised,
                                     left=_left_on_host(root_on_host, root, left, before))
    assert not problems, problems


def class4_deep_tree_plain_job(new_sandbox, where, *, root_on_host: bool, attack_shown: bool):
    """`attack_shown`: the job that makes the tree must also report it made it."""
    before = rc.sandbox_dirs() if root_on_host else set()
    sb = new_sandbox(Limits(wall_s=20, cpu_s=20))
    try:
        made = sb.run(Job(rc.deep_tree_program(where, then="")))
        after = sb.run(Job(rc.AFTER_DEEP_TREE_JOB))
        root = sb._root if root_on_host else None
        raised = rc.close_error(sb)
        left = root_on_host and os.path.exists(root)
    finally:
        rc.close_quietly(sb)
    problems = rc.deep_tree_problems(
        made=None if made.status == "ok" else f"{made.status} {made.detail}",
        after=None if (after.status, after.stdout) == ("ok", "clean\n") else f"{after.status} {after.stdout!r}",
        raised=raised, left=_left_on_host(root_on_host, root, left, before))
    assert not problems, problems
    if attack_shown:
        assert "DEEP-TREE-MADE" in made.stdout, made.stdout[-300:]  # the attack happened


# ---- class 5 ---------------------------------------------------------------------------------------------------

def _addresses(listeners) -> dict[str, str]:
    return {name: listener.address for name, listener in listeners.items()}


def _reached(listeners) -> list[str]:
    return [name for name, listener in listeners.items() if listener.accepted()]


def class5_host_unix_sockets_plain_job(new_sandbox, host_sockets):
    addresses = _addresses(host_sockets)
    sb = new_sandbox(Limits(wall_s=10, cpu_s=10))
    try:
        r = sb.run(Job(rc.unix_probe_program(addresses, as_function=False)))
    finally:
        rc.close_quietly(sb)
    reached = _reached(host_sockets)
    assert r.status == "ok" and r.stdout.count("refused") == 3, (r.status, r.stdout, r.stderr[-300:])
    assert "CONNECTED" not in r.stdout and not reached, (r.stdout, reached)


def class5_host_unix_sockets_code_verifier(shared, persistent, host_sockets):
    addresses = _addresses(host_sockets)
    r = shared(persistent).verify(rc.unix_probe_program(addresses, as_function=True), rc.unix_probe_gold())
    reached = _reached(host_sockets)
    assert r.score == 1.0 and not reached, (rc.describe(r), reached)


# ---- class 6 ---------------------------------------------------------------------------------------------------

def class6_host_segment_plain_job(new_sandbox, host_segment):
    seg, content = host_segment
    sb = new_sandbox(Limits(wall_s=10, cpu_s=10))
    try:
        r = sb.run(Job(rc.host_ipc_program(seg.key, as_function=False)))
    finally:
        rc.close_quietly(sb)
    assert r.status == "ok" and r.stdout.startswith("refused"), (r.status, r.stdout, r.stderr[-300:])
    assert seg.read(len(content)) == content, "a job overwrote the host's segment"


def class6_host_segment_code_verifier(shared, persistent, host_segment):
    seg, content = host_segment
    r = shared(persistent).verify(rc.host_ipc_program(seg.key, as_function=True), rc.HOST_IPC_GOLD)
    assert r.score == 1.0, rc.describe(r)
    assert seg.read(len(content)) == content, "a case overwrote the host's segment"


# ---- class 7 ---------------------------------------------------------------------------------------------------

class Meter(Protocol):
    """How a backend measures what a memory attack still holds once its case (job) ended; one per test."""

    def start(self, warm: Callable[[], object]) -> None:
        """Before the attack. `warm` runs a harmless case (job) on the sandbox, for a meter that needs it up."""

    def stop(self, sandbox) -> None:
        """Right after the attack, the sandbox still open."""

    def on_host(self) -> list[str]:
        """What the attack wrote on the host outside the sandbox (listed first; after a plain job's sandbox closed)."""

    def held(self, case: bool) -> list[str]:
        """What the sandbox still held after the case (`case`) or job ended: the problems, [] if it let go."""


def class7_memory_code_verifier(make, persistent, attack, meter: Meter, **kwargs):
    v = make(persistent, time_s=20.0, **kwargs)
    meter.start(lambda: v.verify(rc.GOOD_ADD, rc.ADD))
    r = v.verify(rc.MEMORY_ATTACKS[attack], rc.MEMORY_GOLD)
    meter.stop(v.sandbox)
    problems = meter.on_host()
    if r.score != 0.0:
        problems.append(f"~1 GB held at once under a {rc.MEMORY_LIMIT_MB} MB limit ({rc.describe(r)})")
    problems += meter.held(case=True)
    assert not problems, (attack, problems)


def class7_memory_plain_job(new_sandbox, attack, meter: Meter, limits: Limits, job_limits: Limits | None = None):
    """`limits`: the sandbox's; `job_limits`: the attack job's own (None: the sandbox's)."""
    sb = new_sandbox(limits)
    try:
        meter.start(lambda: sb.run(Job("print(1)")))
        r = sb.run(Job(rc.memory_job(attack), limits=job_limits))
        meter.stop(sb)
    finally:
        rc.close_quietly(sb)
    problems = meter.on_host()
    if "HELD" in r.stdout:
        problems.append(f"~1 GB held at once under a {rc.MEMORY_LIMIT_MB} MB limit")
    problems += meter.held(case=False)
    assert not problems, (attack, problems, r.status, r.stdout[-200:])


# ---- class 8 ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [c.name for c in rc.class8_crashes()])
def class8_crashes_lose_nothing(fresh, persistent, name):
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
def class8_partial_score_survives_a_crash(fresh, persistent, name):
    case = next(c for c in rc.class8_fraction() if c.name == name)
    r = fresh(persistent, reward=case.reward).verify(case.program, case.gold)
    assert r.score == pytest.approx(case.score), rc.describe(r)


# ---- class 9 ---------------------------------------------------------------------------------------------------

def class9_bounded(name, result: dict, drop_mb: float):
    """`result`: the case's score, verdict (`normalized`) and seconds; `drop_mb`: how far host memory fell."""
    assert not rc.class9_problems(result, drop_mb), (name, rc.class9_problems(result, drop_mb))


# ---- class 10 --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [c.name for c in rc.class10_forged_status()])
def class10_forged_exit_status(shared, persistent, name):
    case = next(c for c in rc.class10_forged_status() if c.name == name)
    r = shared(persistent).verify(case.program, case.gold)
    assert r.score == case.score, rc.describe(r)


# ---- class 11 --------------------------------------------------------------------------------------------------

def class11_clone_namespaces_plain_job(new_sandbox):
    sb = new_sandbox(Limits(wall_s=10, cpu_s=10))
    try:
        r = sb.run(Job(rc.class11_clone(as_function=False)))
    finally:
        rc.close_quietly(sb)
    assert r.status == "ok" and r.stdout.count("refused") == 2, (r.status, r.stdout, r.stderr[-300:])
    assert "CREATED" not in r.stdout, r.stdout


def class11_clone_namespaces_code_verifier(shared, persistent):
    r = shared(persistent).verify(rc.class11_clone(as_function=True), rc.CLONE_GOLD)
    assert r.score == 1.0, rc.describe(r)


# ---- class 12 --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [c.name for c in rc.class12_correct()])
def class12_correct_programs_pass(shared, persistent, name):
    case = next(c for c in rc.class12_correct() if c.name == name)
    r = shared(persistent, time_s=10.0).verify(case.program, case.gold)
    assert r.score == 1.0, rc.describe(r)


def class12_numpy_verdict(make, persistent):
    """The numpy program's verdict (the tests assert on it; the Docker one first asks why it failed)."""
    case = rc.NUMPY_CASE
    return make(persistent, time_s=10.0).verify(case.program, case.gold)


# ---- the property ------------------------------------------------------------------------------------------------

def property_no_case_sees_what_another_did(make, persistent, *, strict_close: bool):
    """`strict_close`: an error of the sandbox's `close()` at the end fails the test (else it is ignored)."""
    v = make(persistent)
    observer, dirty = rc.observer_program(), rc.polluters()
    seen, ipc_before = [], rc.sysvipc()
    try:
        for i in range(20):
            r = v.verify(observer, rc.OBSERVE_GOLD)
            seen.append(rc.observation(r.normalized))
            assert seen[-1], f"observer {i} reported nothing: {rc.describe(r)}"
            v.verify(dirty[i % len(dirty)], rc.ADD)
    finally:
        if strict_close:
            v.sandbox.close()
        else:
            rc.close_quietly(v.sandbox)
        rc.property_cleanup(ipc_before)
    distinct = sorted(set(seen))
    assert len(distinct) == 1, (f"{len(distinct)} different states seen over 20 runs; changing: "
                                f"{rc.differences(seen)}; first two: {distinct[:2]}")
