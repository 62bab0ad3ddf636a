"""Run untrusted Python programs (model-written code) under limits, fast enough for RL rewards.

A `Sandbox` (`base.py`, the whole interface) runs a `Job` (source, stdin, files, `Limits`) and returns a
`RunResult` whose status is one of `ok`, `nonzero_exit`, `timeout`, `memory_limit`, `output_limit`, `killed`,
`sandbox_error`; `run_tests` runs the code verifier's `CodeCase`s through the trusted harness and returns what it
proved (`CaseResult`, a `TestResult` per test). The harness's protocol, host side, is `harness_protocol.py`,
shared by every backend: a backend that inherits its `HarnessBackend` writes only `run`, `run_many`, `describe`
and `close`, and declares its capabilities (`harness_server`: a persistent harness of its own, `guest/harness.py`'s
`serve`).
`guest_code.py` holds what the backends ship into the guest. Backends register by name (`register_sandbox`).
The threat model, and what each backend does and does not protect, is SECURITY.md at the repository's root; in
short:

local (the default, `LocalSandbox`): pre-forked workers, each in a network namespace of its own (with a user
  namespace first when not root). What the host allows is detected at start; `describe()` says what is in force
  and every missing piece is a RuntimeWarning, never silent.
  - Plain jobs: per job a pid, IPC and mount namespace with fresh tmpfs /tmp (the cwd is /tmp/w, holding the
    job's files) and /dev/shm, gone with the job; the worker's `job` memory cgroup; the job uid (root hosts) or
    no capabilities; Landlock (reads: the Python install and system libraries; writes: /tmp, /dev/shm,
    /dev/null; no TCP; no signal or abstract socket outside the job); the program seccomp filter
    (`isolation.seccomp_program`: no socket() but socketpair, no SysV IPC or message queues, no namespaces or
    mounts, no ptrace, ...); rlimits; the whole pid namespace killed at the wall-clock deadline.
  - Code-verifier cases: each worker keeps a harness (pid 1 of its own pid namespace, in the worker's
    `harness` cgroup, confined with no write access at all) that runs the tests; its spawner, forked before
    any test was read, forks every program process into a fresh pid namespace, with a minimal root (only the
    Python install, libraries and device files exist), fresh tmpfs mounts per case, the `case` memory cgroup
    and the same Landlock and seccomp confinement, and replaces everything after the case.
  Memory is counted per job or case by a cgroup (v2 where delegated, else v1 as root): heap, memfds, tmpfs files
  and child processes together. Without one: RLIMIT_AS per process, tmpfs sizes, memfds refused.
  Does NOT protect against: kernel exploits through the syscalls left open; CPU contention; side channels;
  plain jobs stat()-ing host paths (metadata only: reading is refused).

docker (production, `DockerSandbox`): a pool of warm containers (`--network none --read-only --tmpfs /tmp
  --memory --pids-limit --cpus --cap-drop ALL --security-opt no-new-privileges --user 65534 --log-driver none`,
  and megarl's seccomp profile: Docker's own would refuse the user namespace below). Plain jobs go to containers
  running `jobexec.main` as pid 1, code-verifier cases to containers running the harness as pid 1; either makes a
  user namespace once and gives each job (each program process) what the local backend gives it: a pid
  namespace of its own, a minimal root, fresh tmpfs mounts, Landlock, the program seccomp filter. A container's
  memory follows its job's (`docker update`), so its cgroup counts the job's memory as a whole; a container is
  recycled after a timeout, an out-of-memory kill or N jobs. The code (runner or harness, and their sibling
  modules) goes in on stdin; the image needs only `python3`. Where the engine allows no user namespace, the
  pid-1 process kills everything and empties /tmp and /dev/shm after each job instead, and says so.
  Does NOT protect against: kernel exploits (a container is not a VM).

Neither backend trusts the program's exit code for grading: see `megarl/sandbox/guest/harness.py`.
"""

from megarl.sandbox.base import (SANDBOXES, STATUSES, CaseResult, CodeCase, Job, Limits, RunResult, Sandbox, Status,
                                 TestResult, register_sandbox)

__all__ = ["SANDBOXES", "STATUSES", "CaseResult", "CodeCase", "Job", "Limits", "RunResult", "Sandbox", "Status",
           "TestResult", "make_sandbox", "register_sandbox"]


def make_sandbox(backend: str = "local", **kwargs) -> Sandbox:
    """A sandbox by backend name (`local`, `docker`, or one a plugin registered with `register_sandbox`); keyword
    arguments go to its constructor."""
    return SANDBOXES.build(backend, **kwargs)
