"""The local backend's persistent code harness: one trusted process per worker runs case after case, the program
of each in fresh children; nothing a case does reaches the next case or outlives it."""

import os
import socket

import pytest

from megarl.verifiers.code import CodeVerifier

ADD = {"test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
       "entry_point": "add"}
GOOD = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def verifier():
    v = CodeVerifier(workers=1, time_s=1.0)
    if not v.sandbox.harness_server:
        pytest.skip("no pid namespace on this host: the code verifier runs its harness as ordinary jobs there")
    assert v.verify(GOOD, ADD).score == 1.0
    yield v
    v.sandbox.close()


def uid_processes(sandbox) -> list[int]:
    """Pids running as the sandbox's job uids (root hosts): its persistent harness (its spawner keeps root), and
    whatever a case left."""
    uids = {str(u) for u in sandbox.uids()}
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = next(line.split()[1] for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if uid in uids:
            found.append(int(pid))
    return sorted(found)


def only_the_harness(verifier) -> list[int]:
    if os.geteuid() != 0:
        return []  # non-root: jobs keep the user's uid, nothing to tell them apart by
    pids = uid_processes(verifier.sandbox)
    assert len(pids) == 1, f"expected the worker's harness, nothing else; found {pids}"
    return pids


def test_cases_share_one_harness_and_nothing_else_runs(verifier):
    before = only_the_harness(verifier)
    for _ in range(3):
        assert verifier.verify(GOOD, ADD).score == 1.0
    assert only_the_harness(verifier) == before


def test_nothing_a_case_starts_outlives_it(verifier):
    leaver = ("import os, time\n"
              "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)\n"
              "def add(a, b):\n    return a + b\n")
    assert verifier.verify(leaver, ADD).score == 1.0  # it passes, and its daemon is gone right after
    only_the_harness(verifier)


def test_files_do_not_carry_over_and_stay_inside(verifier, tmp_path):
    writer = "open('note.txt', 'w').write('x')\ndef add(a, b):\n    return a + b\n"
    assert verifier.verify(writer, ADD).score == 1.0
    reader = "import os\ndef add(a, b):\n    return a + b + (100 if os.path.exists('note.txt') else 0)\n"
    assert verifier.verify(reader, ADD).score == 1.0, "the last case's file was still in the work directory"
    target = tmp_path / "escaped.txt"
    os.chmod(tmp_path, 0o777)
    outside = f"open({str(target)!r}, 'w').write('x')\ndef add(a, b):\n    return a + b\n"
    assert verifier.verify(outside, ADD).outcome == "incorrect"
    assert not target.exists()


def test_no_network(verifier):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    caller = (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
              "def add(a, b):\n    return a + b\n")
    try:
        assert verifier.verify(caller, ADD).score == 0.0
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


@pytest.mark.parametrize("body", [
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "x = []\nwhile True:\n    x.append(bytearray(10 ** 7))\n",
    "while True:\n    pass\n",
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ndef add(a, b):\n    time.sleep(60)\n",
], ids=["fork bomb", "memory bomb", "loop at import", "sleeping call ignoring SIGTERM"])
def test_attacks_fail_and_the_harness_keeps_serving(verifier, body):
    before = only_the_harness(verifier)
    r = verifier.verify(body + "\ndef add(a, b):\n    return 0\n" if "def add" not in body else body, ADD)
    assert r.score == 0.0, r
    assert verifier.verify(GOOD, ADD).score == 1.0
    assert only_the_harness(verifier) == before  # contained by the harness itself: not restarted


def test_a_hung_harness_is_replaced(verifier):
    """Test code that never ends (the tests are trusted, but may be wrong): the worker's deadline kills the
    harness, pid 1 of its namespace, and the next case gets a new one."""
    before = only_the_harness(verifier)
    hang = {"test": "def check(candidate):\n    while True:\n        pass\n", "entry_point": "add", "time_s": 0.5}
    r = verifier.verify(GOOD, hang)
    assert (r.score, r.outcome) == (0.0, "timeout"), r
    assert verifier.verify(GOOD, ADD).score == 1.0
    after = only_the_harness(verifier)
    assert os.geteuid() != 0 or after != before
