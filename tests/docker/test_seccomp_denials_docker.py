"""The program filter's refusals, counted by the kernel, on the Docker backend (the local twin and what it checks:
`tests/sandbox/test_seccomp_denials.py`). In a container only the refusals the container's own seccomp profile
lets through to the program filter are counted: the engine's filter answers ERRNO for the rest (`ptrace` here),
which takes precedence over USER_NOTIF (see `megarl/sandbox/guest/isolation.py`); the program sees EPERM either
way."""

from __future__ import annotations

import os
import platform

import pytest

from megarl.sandbox import Job, Limits
from megarl.sandbox.docker import DEFAULT_IMAGE, DockerSandbox
from megarl.verifiers.code import CodeVerifier

IMAGE = os.environ.get("MEGARL_SANDBOX_IMAGE", DEFAULT_IMAGE)
pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the programs call x86_64 syscall numbers")

GOLD = {"test": "assert f(1) == 2\nassert f(2) == 3\n", "entry_point": "f"}
# unshare(CLONE_NEWUSER) twice, socket(AF_INET) once and ptrace once, by number; f is right only if each was
# refused with EPERM
BY_NUMBER = """m = __import__('ct' + 'ypes')
libc = m.CDLL(None, use_errno=True)
ERRNOS = []
for nr, args in ((272, (0x10000000,)), (272, (0x10000000,)), (41, (2, 1, 0)), (101, (16, 1, 0, 0))):
    ERRNOS.append((libc.syscall(nr, *args), m.get_errno()))
def f(x):
    return x + 1 if ERRNOS == [(-1, 1)] * 4 else x
"""


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent harness", "harness as a job"])
def test_the_kernel_counts_what_the_container_lets_through_and_no_verdict_changes(persistent):
    on = CodeVerifier(backend="docker", image=IMAGE, workers=1, persistent_harness=persistent)
    off = CodeVerifier(backend="docker", image=IMAGE, workers=1, persistent_harness=persistent, signals=False)
    try:
        a, b = on.verify(BY_NUMBER, GOLD), off.verify(BY_NUMBER, GOLD)
        assert a.signals == {"sandbox_refusal": "seccomp denied: unshare(NEWUSER) x2, socket(AF_INET) x1"}
        assert (a.score, a.outcome) == (b.score, b.outcome) == (1.0, "correct")
        honest = on.verify("def f(x):\n    return x + 1\n", GOLD)
        assert (honest.score, honest.signals) == (1.0, {})
    finally:
        on.sandbox.close()


def test_a_plain_job_gets_the_counts():
    sandbox = DockerSandbox(workers=1, image=IMAGE, limits=Limits(wall_s=10, cpu_s=5))
    try:
        r = sandbox.run(Job("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                            "print(libc.unshare(0x40000000), ctypes.get_errno())\n"))
        assert (r.status, r.stdout, r.seccomp_denied) == ("ok", "-1 1\n", {"unshare(NEWNET)": 1})
        assert sandbox.run(Job("print(1)")).seccomp_denied == {}
    finally:
        sandbox.close()
