"""Run untrusted Python programs (model-written code) under limits, fast enough for RL rewards.

A `Sandbox` runs a `Job` (source, stdin, files, `Limits`) and returns a `RunResult` whose status is one of
`ok`, `nonzero_exit`, `timeout`, `memory_limit`, `output_limit`, `killed`, `sandbox_error`. Two backends:

local (the default, `LocalSandbox`): pre-forked workers that fork a confined child per job (~ms per job). For
  the code verifier (`Job.harness`), each worker also keeps a persistent trusted harness, confined exactly like a
  job and pid 1 of its own pid namespace, that runs case after case (see `code_harness.serve`); the Docker
  backend runs the same harness as pid 1 of dedicated containers. Either way every program is forked from a
  zygote made before the harness held any test, so no program finds the tests in the memory it inherits.
  Protects against, where the host allows it (detected at start, `describe()` says what is in force, and every
  missing piece is a RuntimeWarning, never silent):
  - network: a network namespace per worker (no interface but a down loopback), Landlock's TCP bind/connect
    rule (ABI >= 4) and a seccomp filter refusing every socket but AF_UNIX;
  - processes: a pid namespace per job, so everything the job spawned - detached, daemonized, SIGTERM-proof -
    dies with it; fork bombs by RLIMIT_NPROC on a per-worker unprivileged uid (as root) or in the worker's own
    user namespace (non-root, Linux >= 5.14); a SIGKILL of the job's process group at the wall-clock deadline;
    Landlock's signal scoping (ABI >= 6). As non-root the job keeps the user's uid but no capability;
  - files: Landlock lets the job write only in its fresh working directory (and /dev/null) and read only the
    Python install, the system libraries and that directory: not /etc, /home, /root, /proc, other jobs' dirs, the
    host's temp dirs; RLIMIT_FSIZE bounds every file;
  - resources: RLIMIT_AS (memory the job adds to the forked interpreter), RLIMIT_CPU, a wall-clock deadline,
    a cap on stdout/stderr bytes read, RLIMIT_NOFILE;
  - the kernel: seccomp refuses ptrace, process_vm_*, namespaces, mounts, keyrings, bpf, perf, module loading,
    handle-based opens and io_uring; no_new_privs; no capabilities (one exception: where the Python install is
    not world-readable, e.g. under /root, the job keeps CAP_DAC_READ_SEARCH, and Landlock confines it to the
    read-only roots above).
  Does NOT protect against: kernel exploits through the syscalls left open (it shares the host kernel); memory
  accounting beyond the address-space limit (no cgroup: a program may still make the host swap); CPU contention
  with the host; side channels; hosts without user namespaces / Landlock / seccomp (degraded, with warnings):
  there, only rlimits, uid drop (as root) and process-group kill remain.

docker (production, `DockerSandbox`): a pool of warm containers (`--network none --read-only --tmpfs /tmp
  --memory --pids-limit --cpus --cap-drop ALL --security-opt no-new-privileges --user 65534 --log-driver none`),
  each running `jobexec.main` as pid 1, which forks per job and afterwards SIGKILLs every other process in the
  container; a container is recycled after a timeout, an out-of-memory kill or N jobs.
  Protects against everything above through Docker's namespaces, cgroups (a real memory and pids limit) and its
  default seccomp profile, plus: nothing of the host's filesystem is visible, and a memory bomb is OOM-killed
  inside the container's cgroup. Does NOT protect against: kernel exploits (a container is not a VM); one job
  reading what an earlier job in the same container left in memory-backed tmpfs is prevented only by the
  runner deleting the job directory; a job can consume the container's whole memory/pids budget, and the pool
  then recycles it.

Neither backend trusts the program's exit code for grading: see `megarl/sandbox/code_harness.py`.
"""

from megarl.sandbox.base import STATUSES, Job, Limits, RunResult, Sandbox, Status

__all__ = ["STATUSES", "Job", "Limits", "RunResult", "Sandbox", "Status", "make_sandbox"]


def make_sandbox(backend: str = "local", **kwargs) -> Sandbox:
    """A sandbox by backend name (`local` or `docker`); keyword arguments go to its constructor."""
    if backend == "local":
        from megarl.sandbox.local import LocalSandbox

        return LocalSandbox(**kwargs)
    if backend == "docker":
        from megarl.sandbox.docker import DockerSandbox

        return DockerSandbox(**kwargs)
    raise ValueError(f"unknown sandbox backend {backend!r}; valid names: docker, local")
