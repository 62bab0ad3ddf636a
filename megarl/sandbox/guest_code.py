"""The guest code as the host ships it: the sources of `guest/` by file name, which of them each entry point needs,
and what each preimports. Shared by every backend (local execs the files in place, Docker sends them into its
containers on stdin, a job-run harness gets them as job files); backend-neutral, so no backend imports another."""

from __future__ import annotations

from pathlib import Path

GUEST_DIR = Path(__file__).resolve().parent / "guest"
# What a plain job's runner imports before it forks the job (the local backend's workers, Docker's runners).
PREIMPORTS = ("abc ast array bisect cmath collections contextlib copy ctypes dataclasses datetime decimal enum "
              "fractions functools hashlib heapq io itertools json math numbers operator pickle queue random re select "
              "signal statistics string struct textwrap time traceback typing unicodedata")
# What the persistent code harness imports for the programs it runs: few, since a fork costs ~0.07 ms per MB the
# forking process maps on the VMs measured (a bare interpreter forks in ~0.45 ms, the worker's PREIMPORTS in ~1.2).
HARNESS_PREIMPORTS = "bisect collections functools heapq itertools math re string typing"
HARNESS_PATH = str(GUEST_DIR / "harness.py")
# Read once: the code harness and its sibling modules (the Docker harness containers' bundle, a job-run harness's
# files), and the plain-job runner and its siblings (the Docker runner containers' bundle).
HARNESS_FILES = {name: (GUEST_DIR / name).read_text()
                 for name in ("harness.py", "rpc.py", "spawner.py", "isolation.py", "cgroups.py")}
RUNNER_FILES = {"jobexec.py": (GUEST_DIR / "jobexec.py").read_text(),
                **{name: HARNESS_FILES[name] for name in ("isolation.py", "spawner.py", "cgroups.py")}}
