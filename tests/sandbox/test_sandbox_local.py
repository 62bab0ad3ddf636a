"""The local sandbox backend: statuses, limits, the containment suite, nothing left behind, root and non-root."""

import json
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from megarl.procs import running
from megarl.sandbox import Job, Limits, RunResult, Sandbox, make_sandbox
from megarl.sandbox.local import LocalSandbox
from sandbox_cases import Listener, attacks, check_attack, make_secret, target_paths

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sandbox():
    sb = LocalSandbox(workers=2, limits=Limits(wall_s=5, cpu_s=5))
    yield sb
    sb.close()


def _job_processes(sandbox) -> list[int]:
    """Host pids running as one of the sandbox's job uids."""
    uids, found = set(sandbox.uids()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
        except FileNotFoundError:
            continue
        if uid in uids:
            found.append(int(pid))
    return found


def test_protocol_and_basic_statuses(sandbox):
    assert isinstance(sandbox, Sandbox)
    r = sandbox.run(Job("import sys\nname = open('data.txt').read()\nprint(input() + name)\n"
                        "print('e', file=sys.stderr)",
                        stdin="hello ", files={"data.txt": "world"}))
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("ok", 0, "hello world\n", "e\n")
    assert r.wall_s > 0 and r.peak_mb > 0
    r = sandbox.run(Job("raise SystemExit(3)"))
    assert (r.status, r.exit_code) == ("nonzero_exit", 3)
    r = sandbox.run(Job("1/0"))
    assert r.status == "nonzero_exit" and "ZeroDivisionError" in r.stderr and "jobexec" not in r.stderr
    r = sandbox.run(Job("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)"))
    assert (r.status, r.signal) == ("killed", 11)


def test_limits_per_job(sandbox):
    r = sandbox.run(Job("import time\ntime.sleep(5)", limits=Limits(wall_s=0.5)))
    assert r.status == "timeout" and r.wall_s < 2
    r = sandbox.run(Job("print('x' * 5000)", limits=Limits(output_bytes=1000)))
    assert r.status == "output_limit" and len(r.stdout) == 1000
    r = sandbox.run(Job("open('big', 'w').write('x' * (3 << 20))", limits=Limits(file_mb=1)))
    assert r.status in ("output_limit", "nonzero_exit")  # SIGXFSZ, or EFBIG where the signal is ignored
    r = sandbox.run(Job("x = bytearray(300 << 20)", limits=Limits(memory_mb=200)))
    assert r.status == "memory_limit"
    r = sandbox.run(Job("x = bytearray(100 << 20)\nprint(len(x))", limits=Limits(memory_mb=200)))
    assert r.status == "ok"


def test_jobs_are_independent(sandbox):
    sandbox.run(Job("open('left-behind', 'w').write('x')"))
    r = sandbox.run(Job("import os\nprint(sorted(os.listdir('.')))"))
    assert r.stdout == "[]\n"
    draws = {sandbox.run(Job("import random\nprint(random.random())")).stdout for _ in range(4)}
    assert len(draws) == 4  # each fork reseeds


def test_isolation_is_detected_and_reported(sandbox):
    text = sandbox.describe()
    iso = sandbox.isolation
    assert "rlimits" in text
    if os.geteuid() == 0:
        assert iso.net_ns and iso.pid_ns and iso.uid is not None
    if iso.landlock_abi:
        assert f"Landlock ABI {iso.landlock_abi}" in text
    # Whatever is missing is a warning, never silent.
    if not (iso.net_ns and iso.pid_ns and iso.landlock_abi and iso.seccomp):
        assert iso.warnings


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("host")
    listener = Listener()
    yield make_secret(tmp), listener
    listener.close()


@pytest.mark.parametrize("index", range(11))
def test_containment_suite(sandbox, host, index):
    secret, listener = host
    token = uuid.uuid4().hex
    suite = attacks(secret, listener.port, token)
    attack = suite[index]
    check_attack(sandbox, attack, target_paths(secret, token), listener)
    assert _job_processes(sandbox) == [], f"{attack.name} left processes behind"


def test_nothing_left_after_close():
    sb = LocalSandbox(workers=1)
    sb.run(Job("print(1)"))
    root, pids = sb._root, [w.proc.pid for w in sb._all]
    sb.close()
    assert not os.path.exists(root)
    for pid in pids:
        assert not running(pid)


def test_pickles_and_restarts_a_dead_worker():
    import pickle

    sb = LocalSandbox(workers=1)
    sb.run(Job("print(1)"))
    clone = pickle.loads(pickle.dumps(sb))
    assert clone._idle is None and clone.workers == 1
    sb._all[0].proc.kill()
    assert sb.run(Job("print(1)")).status == "sandbox_error"
    assert sb.run(Job("print(2)")).stdout == "2\n"  # the replacement works
    sb.close()


def test_make_sandbox_names_the_backends():
    with pytest.raises(ValueError, match="docker, local"):
        make_sandbox("nope")


def test_result_from_wire_ignores_unknown_fields():
    assert RunResult.from_wire({"status": "ok", "extra": 1}).status == "ok"


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
                    reason="needs root (to become an unprivileged user), setpriv and /usr/bin/python3")
def test_works_as_a_non_root_user():
    """As uid 65534: a user namespace gives the net/pid namespaces; attacks stay contained."""
    if any(not os.stat(p).st_mode & 0o005 for p in [REPO, *REPO.parents] if str(p) != "/"):
        pytest.skip("the checkout is not world-readable")
    tmp_path = Path(tempfile.mkdtemp(prefix="megarl-nonroot-"))  # pytest's tmp dirs are private to root
    try:
        _run_as_nobody(tmp_path)
    finally:
        shutil.rmtree(tmp_path)


def _run_as_nobody(tmp_path):
    script = tmp_path / "nonroot.py"
    script.write_text(
        "import json\n"
        "from megarl.sandbox.local import LocalSandbox\n"
        "from megarl.sandbox import Job, Limits\n"
        "sb = LocalSandbox(workers=1, limits=Limits(wall_s=2, cpu_s=2))\n"
        "out = {'describe': sb.describe(), 'warnings': sb.isolation.warnings, 'root': sb._root}\n"
        "out['ok'] = sb.run(Job('print(6 * 7)')).stdout\n"
        "out['loop'] = sb.run(Job('while True: pass')).status\n"
        "out['fork_bomb'] = sb.run(Job('import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n"
        "        pass\\n')).status\n"
        "out['tcp'] = sb.run(Job('import socket\\ntry:\\n    socket.create_connection((\"127.0.0.1\", 22), 1)\\n"
        "    print(\"CONNECTED\")\\nexcept OSError:\\n    print(\"refused\")')).stdout\n"
        "out['detached'] = sb.run(Job('import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    time.sleep(30)\\n"
        "print(1)')).status\n"
        "spec = {'mode': 'function', 'test': 'def check(candidate):\\n    assert candidate(2, 3) == 5\\n',"
        " 'entry_point': 'add', 'time_s': 2.0, 'early_stop': False}\n"
        "leaver = 'import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    time.sleep(30)\\n'\n"
        "out['harness'] = [sb.harness_server] + [sb.run(Job('', stdin='s3', harness={'code': code + 'def add(a, b):"
        "\\n    return a + b\\n', 'spec': spec})).stdout for code in ('', leaver)]\n"
        "sb.close()\n"
        "print(json.dumps(out))\n")
    script.chmod(0o644)
    tmp_path.chmod(0o755)
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                           str(script)], capture_output=True, text=True, timeout=120, cwd="/",
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok"] == "42\n" and out["loop"] == "timeout" and out["tcp"] == "refused\n"
    assert out["detached"] == "ok" and out["fork_bomb"] == "timeout"
    assert "net ns per worker" in out["describe"] or out["warnings"]
    if out["harness"][0]:  # the persistent code harness runs in a user namespace too
        done = '@@megarl-code-done s3 {"results": [{"ok": true}]}'
        assert all(v.strip().startswith(done) for v in out["harness"][1:])
    # what the jobs left would still carry their worker's or harness's command line, which names this sandbox's
    # directory (and only this sandbox's: other uid-65534 processes, e.g. Docker sandboxes', are not ours)
    leftover = subprocess.run(["pgrep", "-u", "65534", "-f", out["root"]], capture_output=True, text=True).stdout
    assert leftover.strip() == ""


@pytest.mark.slow
def test_mixed_stream_with_attacks_loses_nothing():
    """300 jobs, one in ten an attack, through 2 workers: every job gets its own result, none hangs
    (the 10,000-job run: `tools/bench/sandbox.py --stress 10000`)."""
    import random

    rng = random.Random(1)
    bad = ["while True:\n    pass\n", "x = []\nwhile True:\n    x.append(bytearray(10 ** 7))\n",
           "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n",
           "import sys\nsys.stdout.write('x' * (8 << 20))\n", "import os\nos.kill(os.getppid(), 9)\n"]
    jobs = [Job(rng.choice(bad), limits=Limits(wall_s=0.5, cpu_s=0.5, memory_mb=128)) if i % 10 == 3
            else Job(f"print({i} * 3)") for i in range(300)]
    sb = LocalSandbox(workers=2)
    try:
        results = sb.run_many(jobs)
    finally:
        sb.close()
    assert len(results) == 300
    assert all(r.stdout == f"{i * 3}\n" for i, r in enumerate(results) if i % 10 != 3)
    assert all(r.status != "sandbox_error" and r.wall_s < 5 for r in results)


def test_remove_tree_never_touches_what_holds_the_tree(tmp_path):
    """A tree already gone (a worker removed it first) leaves its parent's mode alone: /tmp stays 1777."""
    from megarl.sandbox.guest.jobexec import remove_tree

    os.chmod(tmp_path, 0o1777)
    remove_tree(str(tmp_path / "gone"))
    assert os.stat(tmp_path).st_mode & 0o7777 == 0o1777
    (tmp_path / "t" / "d").mkdir(parents=True)
    (tmp_path / "t" / "d" / "f").write_text("x")
    os.chmod(tmp_path / "t" / "d", 0o500)
    remove_tree(str(tmp_path / "t"))
    assert not (tmp_path / "t").exists() and os.stat(tmp_path).st_mode & 0o7777 == 0o1777
