"""Runs in the SGLang CPU environment (tests/sglang_cpu/conftest.py starts it): imports a module of checks, then
runs the checks the test process names, one at a time, all against the objects the module keeps (one engine per
test module: an SGLang start costs ~30 s here).

Protocol: the test process writes a check's name and its keyword arguments as one JSON line to the fd given as
argv[2]; the answer, `{"ok": true, "result": ...}` or `{"ok": false, "error": traceback}`, comes back as one JSON
line on the fd argv[3]. SGLang's own output goes to this process's stdout and stderr (a log file the fixture
shows when a check fails). A check is a function `check_<name>(**kwargs)` of the module; `close()`, if defined,
runs at the end.
"""

import importlib
import json
import os
import sys
import traceback


def main() -> None:
    module = importlib.import_module(sys.argv[1])
    commands = os.fdopen(int(sys.argv[2]), "r")
    answers = os.fdopen(int(sys.argv[3]), "w")
    try:
        for line in commands:
            request = json.loads(line)
            try:
                result = getattr(module, f"check_{request['name']}")(**request.get("kwargs", {}))
                answer = {"ok": True, "result": result}
            except BaseException:  # noqa: BLE001 - sent to the test, which fails with it
                answer = {"ok": False, "error": traceback.format_exc()}
            print(f"== worker: check {request['name']} done (ok={answer['ok']})", flush=True)
            answers.write(json.dumps(answer, default=str) + "\n")
            answers.flush()
    finally:
        close = getattr(module, "close", None)
        if close is not None:
            close()


if __name__ == "__main__":
    main()
