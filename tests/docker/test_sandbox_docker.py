"""The Docker backend against the same containment suite as the local one, plus pool hygiene and HumanEval."""

import json
import os
import uuid

import pytest

from megarl.sandbox import Job, Limits
from megarl.sandbox.docker import DEFAULT_IMAGE, DockerSandbox
from megarl.verifiers.code import CodeVerifier
from sandbox_cases import (KEY_HUNT_FUNCTION, KEY_HUNT_IO, SECRET_ADD, SECRET_IO, Listener, attacks, check_attack,
                           humaneval_hacks, humaneval_problems, make_secret, target_paths)

IMAGE = os.environ.get("MEGARL_SANDBOX_IMAGE", DEFAULT_IMAGE)


@pytest.fixture(scope="module")
def sandbox():
    sb = DockerSandbox(workers=2, image=IMAGE, limits=Limits(wall_s=5, cpu_s=5))
    yield sb
    sb.close()
    # This pool's own containers: other pools of the process (CodeVerifier's shared ones) may still hold theirs.
    assert sb.containers() == [], "the pool left containers behind"


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    listener = Listener()
    yield make_secret(tmp_path_factory.mktemp("host")), listener
    listener.close()


def test_basic_statuses(sandbox):
    r = sandbox.run(Job("print(input() + open('f').read())", stdin="a", files={"f": "b"}))
    assert (r.status, r.stdout) == ("ok", "ab\n")
    assert sandbox.run(Job("raise SystemExit(4)")).exit_code == 4
    assert sandbox.run(Job("import time\ntime.sleep(9)", limits=Limits(wall_s=0.5))).status == "timeout"


@pytest.mark.parametrize("index", range(11))
def test_containment_suite(sandbox, host, index):
    secret, listener = host
    token = uuid.uuid4().hex
    attack = attacks(secret, listener.port, token)[index]
    check_attack(sandbox, attack, target_paths(secret, token), listener)
    # Nothing of the attack is left in the container that ran it, nor in the other one: each job is pid 1 of a
    # namespace of its own (nothing else runs there), with fresh /tmp (its cwd /tmp/w) and /dev/shm.
    for _ in range(2):
        r = sandbox.run(Job("import json, os\nchild = os.fork()\nif child == 0:\n    os._exit(0)\n"
                            "os.waitpid(child, 0)\n"
                            "print(json.dumps([os.getpid(), child, os.listdir('/tmp'), os.listdir('.'), "
                            "os.listdir('/dev/shm')]))"))
        pid, child, tmp, cwd, shm = json.loads(r.stdout)
        assert (pid, child, tmp, cwd, shm) == (1, 2, ["w"], [], []), r.stdout


def test_recycles_after_timeouts_and_n_jobs():
    sb = DockerSandbox(workers=1, image=IMAGE, jobs_per_container=3, limits=Limits(wall_s=1, cpu_s=1))
    try:
        for _ in range(4):
            assert sb.run(Job("print(1)")).stdout == "1\n"
        assert sb.recycled == 1
        assert sb.run(Job("while True: pass")).status == "timeout"
        assert sb.recycled == 2 and sb.run(Job("print(2)")).stdout == "2\n"
    finally:
        sb.close()


def test_humaneval_subset_through_docker():
    verifier = CodeVerifier(backend="docker", image=IMAGE, workers=2, time_s=3.0)
    problems = humaneval_problems()[3::16]
    gold = [{"test": p["test"], "entry_point": p["entry_point"]} for p in problems]
    good = verifier.verify_many([(p["prompt"] + p["canonical_solution"], g) for p, g in zip(problems, gold)])
    assert [r.outcome for r in good] == ["correct"] * len(problems), [r.normalized for r in good]
    bad = verifier.verify_many([(p["prompt"] + "    return None\n", g) for p, g in zip(problems, gold)])
    assert all(r.score == 0.0 for r in bad)
    assert all(r.score == 0.0 for r in verifier.verify_many([(h, gold[0]) for h in humaneval_hacks(problems[0])]))
    verifier.sandbox.close()


def test_the_tests_cannot_be_read_through_docker():
    """The harness job execs a fresh interpreter: the runner's fork holds the job, tests included."""
    verifier = CodeVerifier(backend="docker", image=IMAGE, workers=1, time_s=3.0)
    try:
        assert verifier.verify(KEY_HUNT_FUNCTION, SECRET_ADD).score == 0.0
        assert verifier.verify(KEY_HUNT_IO, SECRET_IO).score == 0.0
        assert verifier.verify("def add(a, b):\n    return a + b\n", SECRET_ADD).score == 1.0
    finally:
        verifier.sandbox.close()


def test_persistent_harness_containers():
    """Code cases go to containers whose pid 1 is the persistent harness: a hung case is a timeout and its
    container is replaced; what a case leaves in /tmp or /dev/shm is gone for the next; attacks stay contained."""
    verifier = CodeVerifier(backend="docker", image=IMAGE, workers=1, time_s=1.0)
    sb = verifier.sandbox
    add = {"test": "def check(candidate):\n    assert candidate(2, 3) == 5\n", "entry_point": "add"}
    good = "def add(a, b):\n    return a + b\n"
    try:
        assert sb.harness_server and verifier.verify(good, add).score == 1.0
        started = sb.started
        writer = "open('/dev/shm/n', 'w').write('x')\nopen('/tmp/n', 'w').write('x')\n" + good
        assert verifier.verify(writer, add).score == 1.0
        reader = ("import os\ndef add(a, b):\n    return a + b + 100 * (os.path.exists('/dev/shm/n') "
                  "or os.path.exists('/tmp/n'))\n")
        assert verifier.verify(reader, add).score == 1.0, "a file of the last case was still there"
        leaver = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n" + good
        bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
        assert [r.score for r in verifier.verify_many([(leaver, add), (bomb, add), (good, add)])] == [1.0, 0.0, 1.0]
        assert sb.started == started, "the harness container was restarted without a timeout"
        hang = {"test": "def check(candidate):\n    while True:\n        pass\n", "entry_point": "add",
                "time_s": 0.5}
        r = verifier.verify(good, hang)
        assert (r.score, r.outcome) == (0.0, "timeout"), r
        assert verifier.verify(good, add).score == 1.0 and sb.started == started + 1
    finally:
        sb.close()
