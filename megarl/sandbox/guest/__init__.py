"""Code that runs inside the sandbox's isolation boundary: the guest side of `megarl.sandbox`.

- `harness.py`: the code verifier's trusted test harness (persistent, or as a job); `rpc.py`: its wire to the
  program processes; `spawner.py`: forks every program process and gives each case a fresh start;
- `jobexec.py`: runs a plain job in a fork (the local backend's workers; pid 1 of a Docker runner container);
- `isolation.py`: namespaces, Landlock, seccomp, rlimits; `cgroups.py`: memory cgroups.

The rule: a file here imports only the standard library and its siblings, nothing else of megarl and nothing
from outside the standard library (`tests/unit/test_layout.py` checks it; the harness may import numpy at run time
for a program that did, where it is installed, never as a dependency of its own). They run where megarl is not
installed: the local backend starts `harness.py` by path (`python -I .../guest/harness.py --serve`), the Docker
backend sends their sources into a container on stdin, and the code verifier's harness-as-a-job gets them as job
files. So a sibling is loaded by file (`harness._load`) or found registered under `_megarl_sandbox_<name>` (the
Docker bundle), never imported through the `megarl` package. The host side (`local.py`, `docker.py`,
`megarl/verifiers/code.py`) imports them as `megarl.sandbox.guest.<name>`.
"""
