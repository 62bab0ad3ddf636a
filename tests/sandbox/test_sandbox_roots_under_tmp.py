"""A sandbox whose interpreter files live under /tmp (a checkout and its virtualenv cloned there): each job's and
each case's fresh /tmp must not hide them. Before the fix, every code case failed (the spawner could not open its
read roots: `sandbox_error`) and every harness-as-a-job case ended `nonzero_exit`.

The read root here is a `*-packages` directory under /tmp on the PYTHONPATH of a fresh interpreter (and so of its
sandbox workers), which is how `isolation.read_roots()` finds a virtualenv's site-packages; programs read a file
in it and list /tmp.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    root = sys.argv[1]
    from megarl.sandbox import Job
    from megarl.sandbox.local import LocalSandbox
    from megarl.verifiers.code import CodeVerifier
    from megarl.sandbox.guest.isolation import read_roots
    assert root in read_roots(), read_roots()
    program = "import os\\nprint(open(%r).read().strip(), sorted(os.listdir('/tmp')))\\n" % (root + "/probe.txt")
    # what a job's /tmp holds: its work dir, and the top directories of the read roots beneath /tmp (this one;
    # the checkout's venv too when the checkout itself is under /tmp)
    listing = sorted({"w"} | {p.split("/")[2] for p in read_roots() if p.startswith("/tmp/")})
    out = {"listing": repr(listing)}
    def mounts(sandbox):  # the most mounts the harness (a job uid) or its children (the spawner, root) see
        status, counts = {}, [0]
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                status[pid] = (int(fields["Uid"].split()[0]), fields["PPid"].strip())
            except (OSError, KeyError, ValueError):
                pass
        harnesses = {pid for pid, (uid, _) in status.items() if uid in sandbox.uids()}
        for pid, (_, ppid) in status.items():
            if pid in harnesses or ppid in harnesses:
                try:
                    with open(f"/proc/{pid}/mountinfo") as f:
                        counts.append(sum(1 for _ in f))
                except OSError:
                    pass
        return max(counts)
    def settled_mounts(sandbox):  # the spawner replaces a case's tmpfs mounts just after its answer: read twice
        last = None
        for _ in range(50):
            time.sleep(0.05)
            now = mounts(sandbox)
            if now == last:
                return now
            last = now
        return last
    for persistent in (True, False):
        v = CodeVerifier(workers=1, persistent_harness=persistent)
        gold = {"inputs": [""], "outputs": ["seen " + repr(listing)]}
        r = v.verify(program, gold)
        out["persistent" if persistent else "job"] = [r.score, r.outcome, r.normalized]
        if persistent and os.geteuid() == 0:  # case after case, the harness's mounts stay as many
            before = settled_mounts(v.sandbox)
            for _ in range(6):
                v.verify(program, gold)
            out["mounts"] = [before, settled_mounts(v.sandbox)]
    sandbox = LocalSandbox(workers=1)
    try:
        r = sandbox.run(Job(source=program))
        out["plain"] = [str(r.status), r.stdout.strip(), r.stderr[-300:]]
        w = sandbox.run(Job(source="open(%r, 'w').write('x')\\n" % (root + "/probe.txt")))
        out["write"] = [str(w.status), w.stderr.strip().splitlines()[-1:]]
    finally:
        sandbox.close()
    print(json.dumps(out))
""")


@pytest.mark.skipif(sys.platform != "linux", reason="the local sandbox is Linux-only")
def test_interpreter_files_under_tmp_stay_visible_and_read_only():
    base = Path(tempfile.mkdtemp(prefix="megarl-roots-", dir="/tmp"))
    try:
        root = base / "site-packages"
        inner = root / "inner-packages"  # a read root inside another, as a virtualenv's _vendor is
        inner.mkdir(parents=True)
        (root / "probe.txt").write_text("seen\n")
        for p in (base, root, inner):
            p.chmod(0o755)
        (root / "probe.txt").chmod(0o644)
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(root)], capture_output=True, text=True, cwd=REPO,
                              timeout=300, env={**os.environ, "PYTHONPATH": f"{REPO}:{root}:{inner}"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        listing = out["listing"]
        assert base.name in listing and "'w'" in listing
        # the code verifier, both ways its harness runs: the program read the file and saw only its own /tmp
        assert out["persistent"][:2] == [1.0, "correct"], out
        assert out["job"][:2] == [1.0, "correct"], out
        # a plain job: the same (its cwd /tmp/w is beside the bound root); the root stays read-only
        assert out["plain"][:2] == ["ok", f"seen {listing}"], out
        assert out["write"][0] == "nonzero_exit" and "Read-only file system" in out["write"][1][0], out
        assert (root / "probe.txt").read_text() == "seen\n"
        if "mounts" in out:  # nested roots were bound recursively each case: the mounts grew case after case
            assert out["mounts"][0] == out["mounts"][1] > 0, out["mounts"]
    finally:
        shutil.rmtree(base, ignore_errors=True)
