"""The old name of launch/nemo_run_launcher.py: run as a script, it says so on stderr and runs that launcher with
the same arguments.

A script's directory comes first on sys.path, so while this file exists, `import nemo_run` in a script of launch/
finds it instead of the nemo_run package. Imported under that name, it therefore puts the package in its own place
(looked up on sys.path without this directory; sys.path itself is left as it is). Removed in megarl 0.3, and that
with it: run launch/nemo_run_launcher.py.
"""

import importlib.machinery
import importlib.util
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    print("note: launch/nemo_run.py is now launch/nemo_run_launcher.py; running it", file=sys.stderr)
    sys.argv[0] = str(HERE / "nemo_run_launcher.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
elif __name__ == "nemo_run":  # shadowing the package: load the real one in this module's place
    _elsewhere = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _elsewhere)
    if _spec is None:
        raise ModuleNotFoundError("No module named 'nemo_run'", name="nemo_run")
    _package = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _package
    _spec.loader.exec_module(_package)
