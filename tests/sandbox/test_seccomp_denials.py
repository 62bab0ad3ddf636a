"""The program filter's refusals, counted by the kernel (`isolation.DenialCounter`): a syscall made by number
through ctypes, which no reading of the program sees, is named and counted in the code verifier's
`sandbox_refusal` evidence; the program sees EPERM as before, so no verdict changes; an honest program carries
nothing; nothing of the supervisor is left after the jobs; without user notification the filter is the plain one.
The Docker twin: `tests/docker/test_seccomp_denials_docker.py`."""

from __future__ import annotations

import os
import platform
import struct

import pytest

from megarl import procs
from megarl.sandbox import Job, Limits
from megarl.sandbox.guest import isolation as iso_mod
from megarl.sandbox.local import LocalSandbox, probe_and_enter
from megarl.verifiers.code import CodeVerifier
from megarl.verifiers.signals import code_signals, scan_program

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the programs call x86_64 syscall numbers")

GOLD = {"test": "assert f(1) == 2\nassert f(2) == 3\n", "entry_point": "f"}
HONEST = "def f(x):\n    return x + 1\n"
# ptrace(PTRACE_ATTACH, 1) three times and socket(AF_INET) once, by number, ctypes reached without an import
# statement; f is right only if every call was refused with EPERM (errno 1), as without a supervisor.
BY_NUMBER = """m = __import__('ct' + 'ypes')
libc = m.CDLL(None, use_errno=True)
ERRNOS = []
for nr, args in ((101, (16, 1, 0, 0)), (101, (16, 1, 0, 0)), (101, (16, 1, 0, 0)), (41, (2, 1, 0))):
    ERRNOS.append((libc.syscall(nr, *args), m.get_errno()))
def f(x):
    return x + 1 if ERRNOS == [(-1, 1)] * 4 else x
"""
EVIDENCE = "seccomp denied: ptrace x3, socket(AF_INET) x1"


def _supervised(sandbox: LocalSandbox) -> bool:
    sandbox.start()
    return sandbox.isolation.seccomp_notify


@pytest.fixture(scope="module")
def verifiers():
    """Code verifiers with the worker's persistent harness and with the harness as a job, signals on and off."""
    made = {(p, s): CodeVerifier(workers=1, persistent_harness=p, signals=s) for p in (True, False) for s in
            (True, False)}
    if not _supervised(made[True, True].sandbox):
        pytest.skip(f"no seccomp user notification here: {iso_mod.why_no_seccomp_notify()}")
    yield made
    made[True, True].sandbox.close()


def test_a_syscall_by_number_is_invisible_without_the_kernel():
    """What the signals saw before the supervisor: nothing, from the program's text or from what its run reports."""
    assert scan_program(BY_NUMBER) == {}
    assert code_signals(BY_NUMBER, [], "ok") == {}


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent harness", "harness as a job"])
def test_the_kernel_names_and_counts_the_refusal_and_no_verdict_changes(verifiers, persistent):
    on, off = verifiers[persistent, True], verifiers[persistent, False]
    a, b = on.verify(BY_NUMBER, GOLD), off.verify(BY_NUMBER, GOLD)
    assert a.signals == {"sandbox_refusal": EVIDENCE}
    # EPERM every time, as the filter answers without a supervisor: the tests pass, as they did before
    assert (a.score, a.outcome, a.normalized) == (b.score, b.outcome, b.normalized) == (1.0, "correct",
                                                                                         "2/2 tests passed")
    assert b.signals == {}


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent harness", "harness as a job"])
def test_an_honest_program_carries_nothing(verifiers, persistent):
    result = verifiers[persistent, True].verify(HONEST, GOLD)
    assert (result.score, result.signals) == (1.0, {})
    case = verifiers[persistent, True].sandbox.run_tests(
        [verifiers[persistent, True]._prepare(HONEST, GOLD)[0]], persistent=persistent)[0]
    assert case.run.seccomp_denied == {}


def test_a_plain_job_gets_the_counts_and_the_same_errnos():
    sandbox = LocalSandbox(workers=1, limits=Limits(wall_s=5, cpu_s=5))
    try:
        if not _supervised(sandbox):
            pytest.skip(f"no seccomp user notification here: {iso_mod.why_no_seccomp_notify()}")
        r = sandbox.run(Job("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                            "print(libc.unshare(0x10000000 | 0x40000000), ctypes.get_errno())\n"
                            "print(libc.syscall(435, 0, 0), ctypes.get_errno())\n"  # clone3: ENOSYS, silent
                            "import threading\nt = threading.Thread(target=print)\nt.start()\nt.join()\n"))
        assert (r.status, r.stdout) == ("ok", "-1 1\n-1 38\n\n")
        assert r.seccomp_denied == {"unshare(NEWUSER|NEWNET)": 1}
        assert sandbox.run(Job("print(1)")).seccomp_denied == {}
        assert "seccomp (refusals counted)" in sandbox.describe()
    finally:
        sandbox.close()


def test_the_report_is_bounded_whatever_the_program_names(verifiers):
    """socket() of 200 made-up families: 200 kinds a count could keep; the report keeps DENIED_KINDS, the rest
    counted as "other", and the case is judged as usual."""
    program = ("m = __import__('ct' + 'ypes')\nlibc = m.CDLL(None)\nfor family in range(1000, 1200):\n"
               "    libc.syscall(41, family, 1, 0)\n" + HONEST)
    result = verifiers[True, True].verify(program, GOLD)
    assert (result.score, result.outcome) == (1.0, "correct")
    case = verifiers[True, True].sandbox.run_tests([verifiers[True, True]._prepare(program, GOLD)[0]])[0]
    denied = case.run.seccomp_denied
    assert len(denied) == iso_mod.DENIED_KINDS and sum(denied.values()) == 200
    assert denied["other"] == 200 - (iso_mod.DENIED_KINDS - 1) and denied["socket(family 1000)"] == 1


def _held(pid: int) -> tuple[int, int, int]:
    """(fds, seccomp listeners among them, threads) of the worker and every process below it (its harness and the
    harness's spawner, between cases)."""
    fds = listeners = threads = 0
    for p in [pid, *procs.descendants(pid)]:
        try:
            names = os.listdir(f"/proc/{p}/fd")
            threads += len(os.listdir(f"/proc/{p}/task"))
        except OSError:
            continue
        for fd in names:
            try:
                target = os.readlink(f"/proc/{p}/fd/{fd}")
            except OSError:
                continue
            fds += 1
            listeners += "seccomp" in target
    return fds, listeners, threads


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent harness", "harness as a job"])
def test_nothing_of_the_supervisor_is_left_after_50_jobs(verifiers, persistent):
    verifier = verifiers[persistent, True]
    verifier.verify(BY_NUMBER, GOLD)
    worker = verifier.sandbox._all[0].proc.pid
    before = _held(worker)
    assert before[1] == 0, "a listener held between cases"
    for _ in range(50):
        assert verifier.verify(BY_NUMBER, GOLD).signals == {"sandbox_refusal": EVIDENCE}
    assert _held(worker) == before


def test_without_user_notification_the_filter_is_the_plain_one_and_a_warning_says_so():
    """A filter with a listener already in force makes the kernel refuse another listener (EBUSY): the probe
    then reports the fallback, once, among the isolation warnings, and the sandbox keeps the RET_ERRNO filter."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            iso_mod.prctl(iso_mod.PR_SET_NO_NEW_PRIVS, 1)
            allow = struct.pack("HBBI", 0x06, 0, 0, 0x7FFF0000)  # BPF_RET | BPF_K: SECCOMP_RET_ALLOW
            iso_mod.seccomp_install_listener(iso_mod.sock_fprog(allow))
            iso = probe_and_enter(1_600_000_000 + os.getpid() % 1000)
            os.write(w, f"{iso.seccomp} {iso.seccomp_notify}\n{'|'.join(iso.warnings)}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    text = b""
    while chunk := os.read(r, 1 << 16):
        text += chunk
    os.close(r)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    flags, warnings = text.decode().split("\n", 1)
    assert flags == "True False"
    assert sum("no seccomp user notification" in w and "not counted" in w for w in warnings.split("|")) == 1
    assert iso_mod.HostIsolation(seccomp=True).describe().count("seccomp (refusals counted)") == 0


def test_the_python_tool_s_call_carries_the_kernel_s_count_and_the_model_sees_what_it_did():
    """A tool call that opens a socket by number and catches the EPERM ends well: its text and status say nothing,
    the kernel's count does (`Observation.refused`, the `tool_refusal` signal's evidence)."""
    from megarl.tool_calls import ToolCall, ToolSettings
    from megarl.tool_calls.python import PythonTool
    from megarl.verifiers.signals import tool_refusal

    tool = PythonTool(ToolSettings(workers=1))
    try:
        if not _supervised(tool.sandbox):
            pytest.skip(f"no seccomp user notification here: {iso_mod.why_no_seccomp_notify()}")
        code = ("m = __import__('ct' + 'ypes')\nlibc = m.CDLL(None, use_errno=True)\n"
                "(libc.syscall(41, 2, 1, 0), m.get_errno())")
        sneaky, honest = tool.run_many([ToolCall("python", {"code": code}), ToolCall("python", {"code": "6*7"})])
    finally:
        tool.close()
    assert (sneaky.text, sneaky.status, sneaky.refused) == ("(-1, 1)", "ok", "seccomp denied: socket(AF_INET) x1")
    assert tool_refusal(sneaky.text, sneaky.status, sneaky.refused) == "tool: seccomp denied: socket(AF_INET) x1"
    assert tool_refusal(sneaky.text, sneaky.status) == ""  # the text alone: what the signal saw before
    assert (honest.text, honest.status, honest.refused) == ("42", "ok", "")
