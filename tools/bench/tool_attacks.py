"""Tool-use trajectories whose tool calls attack the host, through `--rollout-function tool_use` and the real
`python` tool: every trajectory must finish, none be lost, and nothing be left on the host.

    python tools/bench/tool_attacks.py [--trajectories 1000] [--batch 100] [--timeout 2] [--workers 2]
                                       [--sandbox local|docker] [--json out.json]

A scripted engine (no model) writes, for prompt i, a python call holding attack i mod 12: the containment suite of
tools/bench/sandbox_cases.py (fork bomb, memory bomb, infinite loops, 100 MB of output, writes and reads outside the job
directory, a TCP connection to a listener on the host's loopback, a detached grandchild, killing the parent and
everything) and a harmless cell; then, after the tool's output, a final answer. Batches of `--batch` trajectories
go through the rollout function as training sends them (their calls together through the sandbox's workers).
Checked after every batch: as many samples as trajectories, each finished with one call answered, no forbidden
text in any output (a write, a read or a connection that succeeded), no file at the host paths the attacks aim
at, no connection accepted. Checked at the end, after the sandbox is closed: no process left of this one, none
under the sandbox's job uids, its directories and memory cgroup removed. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import string
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

from megarl.config import SandboxConfig, ToolConfig
from megarl.data import PromptRecord
from megarl.reward import InProcessReward
from megarl.rollout import Completion, SamplingParams
from megarl.rollout.tool_use import ToolUse
from megarl.tasks.arithmetic import build_tokenizer
from sandbox_cases import Attack, Listener, attacks, make_secret, target_paths  # tools/bench/sandbox_cases.py

EOS = 0
FINAL = "done"


class AttackEngine:
    """Turn 0 of prompt `i=`: a python block with attack i mod len(attacks); turn 1: the final answer."""

    weight_version = 0

    def __init__(self, tok, programs: list[Attack]):
        self.tok, self.programs = tok, programs

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            i = int(text.split("=", 1)[0])
            turn = (f"```python\n{self.programs[i % len(self.programs)].source}```\n" if "```output" not in text
                    else FINAL)
            ids = self.tok.encode(turn, add_special_tokens=False) + ([EOS] if turn == FINAL else [])
            ids = ids[: params.max_new_tokens]
            out.append([Completion(ids, [-1.0] * len(ids), "stop", 0) for _ in range(params.n)])
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trajectories", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=100, help="trajectories per rollout call (n = 4 per prompt)")
    ap.add_argument("--timeout", type=float, default=2.0, help="--tool-timeout: seconds per call")
    ap.add_argument("--workers", type=int, default=2, help="--tool-workers")
    ap.add_argument("--sandbox", choices=("local", "docker"), default="local")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.batch % 4 or args.trajectories % args.batch:
        ap.error("--batch must be a multiple of 4 and divide --trajectories")
    report = run(args.trajectories, args.batch, args.timeout, args.workers, args.sandbox)
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["failures"] == [] else 1


def run(trajectories: int, batch: int, timeout: float, workers: int, sandbox: str) -> dict:
    import psutil

    # processes this one had before (e.g. other sandboxes of a test session): not this run's to leave
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    tok = build_tokenizer(chars="".join(dict.fromkeys(string.printable)))
    tmp = Path(tempfile.mkdtemp(prefix="megarl-tool-attacks-"))
    secret, token, listener = make_secret(tmp), uuid.uuid4().hex[:12], Listener()
    programs = attacks(secret, listener.port, token) + [Attack("harmless", "6 * 7\n", {"ok"})]
    host_paths = target_paths(secret, token)
    tc = ToolConfig(tool_parser="python", tool_timeout=timeout, tool_memory_mb=256, tool_workers=workers,
                    max_tool_output_tokens=64)
    rollout = ToolUse(tc, SandboxConfig(sandbox=sandbox))
    engine, reward = AttackEngine(tok, programs), InProcessReward()
    params = SamplingParams(n=4, max_new_tokens=1024, stop_token_ids=(EOS,))
    failures: list[str] = []
    outcomes: dict[str, Counter] = defaultdict(Counter)
    latencies: list[float] = []
    finished = 0
    start = time.perf_counter()
    for first in range(0, trajectories // 4, batch // 4):
        prompts = [PromptRecord(i, f"{i}=", tok.encode(f"{i}=", add_special_tokens=False), FINAL, "arithmetic")
                   for i in range(first, first + batch // 4)]
        samples = rollout(engine, prompts, params, reward, tok)
        latencies += rollout._latencies
        if len(samples) != batch:
            failures.append(f"batch at prompt {first}: {len(samples)} samples for {batch} trajectories")
        for s in samples:
            attack = programs[s.prompt_index % len(programs)]
            output = tok.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m == 0])
            kind = "timeout" if s.metadata["tool_timeouts"] else "error" if s.metadata["tool_errors"] else "ok"
            outcomes[attack.name][kind] += 1
            if s.status is None or s.metadata["tool_calls"] != 1 or not s.response_text == FINAL:
                failures.append(f"{attack.name}: trajectory {s.prompt_index} did not finish ({s.status}, "
                                f"{s.metadata}, {s.response_text!r})")
            else:
                finished += 1
            for text in attack.forbidden_stdout:
                if text in output:
                    failures.append(f"{attack.name}: {text!r} in the tool's output: {output[-200:]!r}")
        for path in host_paths:
            if os.path.exists(path):
                failures.append(f"a call left {path} on the host")
        if listener.accepted():
            failures.append("a call reached the host's loopback listener")
    seconds = time.perf_counter() - start
    python = rollout.tools["python"]
    box = python._sandbox
    root, cgroup = getattr(box, "_root", None), getattr(getattr(box, "_cgroup", None), "path", None)
    uids = set(box.uids()) if hasattr(box, "uids") else set()
    rollout.close()
    time.sleep(0.5)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    if left:
        failures.append(f"{len(left)} processes of this one left: {[p.cmdline()[-2:] for p in left][:5]}")
    stray = [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real in uids]
    if stray:
        failures.append(f"{len(stray)} processes under the sandbox's job uids left: {stray[:5]}")
    for what, path in (("directory", root), ("memory cgroup", cgroup)):
        if path and os.path.exists(path):
            failures.append(f"the sandbox's {what} {path} is still there")
    listener.close()
    latencies.sort()
    return {"trajectories": trajectories, "finished": finished, "lost": trajectories - finished,
            "seconds": round(seconds, 1), "trajectories_per_s": round(trajectories / seconds, 2),
            "tool_latency_p50_s": round(latencies[len(latencies) // 2], 3) if latencies else None,
            "tool_latency_p99_s": round(latencies[int(0.99 * (len(latencies) - 1))], 3) if latencies else None,
            "sandbox": sandbox, "workers": workers, "timeout_s": timeout,
            "observations": {name: dict(c) for name, c in outcomes.items()}, "failures": failures[:20]}


if __name__ == "__main__":
    sys.exit(main())
