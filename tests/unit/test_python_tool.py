"""The `python` tool in the local sandbox: a cell's value and output, every way a call can fail as an error
observation (never an exception), the per-call limits from its settings, and the calls of a batch running
concurrently through the sandbox's workers."""

from __future__ import annotations

import pytest

from megarl.sandbox import Limits, RunResult
from megarl.tool_calls import Observation, ToolCall, ToolSettings, build_tool, TOOLS
from megarl.tool_calls.python import observation


@pytest.fixture(scope="module")
def python_tool():
    tool = build_tool("python", ToolSettings(timeout_s=2.0, memory_mb=128, output_bytes=1000, workers=2))
    yield tool
    tool.close()


def _run(tool, *codes):
    return tool.run_many([ToolCall("python", {"code": c}) for c in codes])


def test_a_cell_prints_and_shows_its_last_value(python_tool):
    a, b, c = _run(python_tool, "123*456", "x = 7\nprint('x is', x)\nx * 6", "y = 1")
    assert (a.text, a.status) == (str(123 * 456), "ok")
    assert (b.text, b.status) == ("x is 7\n42", "ok")
    assert (c.text, c.status) == ("", "ok")  # an assignment shows nothing
    assert all(o.seconds > 0 for o in (a, b, c))


def test_failures_are_observations(python_tool):
    err, syntax, loop, bomb, flood, bad = python_tool.run_many(
        [ToolCall("python", {"code": "print('before')\n1/0"}), ToolCall("python", {"code": "def f(:"}),
         ToolCall("python", {"code": "while True:\n    pass"}),
         ToolCall("python", {"code": "b = bytearray(1 << 30)\nlen(b)"}),
         ToolCall("python", {"code": "print('a' * 5000)"}), ToolCall("python", {"code": 12})])
    assert (err.text, err.status) == ("before\nerror: ZeroDivisionError: division by zero", "error")
    assert syntax.status == "error" and syntax.text.startswith("error: SyntaxError")
    assert (loop.text, loop.status) == ("error: timed out after 2 s", "timeout")
    assert bomb.status == "error" and ("MemoryError" in bomb.text or "memory limit of 128 MB" in bomb.text)
    assert flood.status == "error" and flood.text.endswith("error: output cut at 1000 bytes")
    assert len(flood.text) <= 1000 + len("\nerror: output cut at 1000 bytes")
    assert (bad.text, bad.status) == ('error: the python tool takes one argument, "code": a string of Python',
                                      "error")


def test_a_batch_of_calls_runs_concurrently(python_tool):
    """Two workers: of four calls that each sleep 0.6 s, at least two run at the same time (their intervals,
    taken inside the sandbox, overlap), whatever the machine's load."""
    code = "import time\na = time.time()\ntime.sleep(0.6)\nprint(a, time.time())"
    spans = [tuple(map(float, o.text.split())) for o in _run(python_tool, *[code] * 4)]
    overlapping = sum(1 for i, (a, b) in enumerate(spans) for (c, d) in spans[i + 1 :] if a < d and c < b)
    assert overlapping >= 1, spans


def test_observation_of_each_sandbox_status():
    lim = Limits(wall_s=3, memory_mb=64, output_bytes=10)
    cases = [
        (RunResult("ok", 0, stdout="4\n"), "4", "ok"),
        (RunResult("nonzero_exit", 1, stdout="so far\n", stderr="Traceback...\nValueError: x\n"),
         "so far\nerror: ValueError: x", "error"),
        (RunResult("nonzero_exit", 3), "error: exit status 3", "error"),
        (RunResult("timeout"), "error: timed out after 3 s", "timeout"),
        (RunResult("memory_limit"), "error: memory limit of 64 MB exceeded", "error"),
        (RunResult("output_limit", stdout="aaaaaaaaaa"), "aaaaaaaaaa\nerror: output cut at 10 bytes", "error"),
        (RunResult("killed", signal=9), "error: killed (signal 9)", "error"),
        (RunResult.error("worker failed"), "error: the sandbox failed (worker failed)", "error"),
    ]
    for result, text, status in cases:
        assert observation(result, lim, 1.0) == Observation(text, status, 1.0)


def test_tool_contract():
    """Every registered tool: built from settings, a name, and a call with bad arguments is an observation."""
    for name in TOOLS.names():
        tool = build_tool(name, ToolSettings(timeout_s=2.0))
        try:
            (obs,) = tool.run_many([ToolCall(name, {"no such argument": [1, 2]})])
            assert tool.name == name and isinstance(obs, Observation) and obs.status in ("ok", "error", "timeout")
            assert tool.run_many([]) == []
        finally:
            tool.close()


def test_one_sandbox_however_many_calls_start_it_at_once(monkeypatch):
    """The first calls of a batch ask for the sandbox from several threads at once: one is built (a second would
    leak its workers)."""
    import threading
    import time as _time

    from megarl.tool_calls import python as python_tool_module

    built = []

    class SlowSandbox:
        def __init__(self, **kw):
            _time.sleep(0.2)  # building takes a while: every thread gets here before the first is done
            built.append(self)

        def run(self, job):
            return RunResult("ok", 0, stdout="1\n")

        def close(self):
            pass

    monkeypatch.setattr(python_tool_module, "make_sandbox", lambda backend, **kw: SlowSandbox(**kw))
    tool = build_tool("python", ToolSettings(workers=4))
    barrier = threading.Barrier(4)
    tool.sandbox  # noqa: B018 - nothing yet: the property builds on first use
    built.clear()
    tool._sandbox = None
    threads = [threading.Thread(target=lambda: (barrier.wait(), tool.run_many([ToolCall("python", {"code": "1"})])))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(built) == 1
