"""Runs verifiers 0.4.0 episodes against megarl's token endpoint; the `verifiers` rollout function's other process.

Run by the verifiers environment's interpreter (`make verifiers-env`), never imported by megarl: it imports nothing
of megarl, and megarl imports nothing of verifiers (openai>=2.54 and transformers 5.25 there; SGLang pins openai
2.8.0 in megarl's). Reads one JSON request on stdin:

    {taskset: <id>, taskset_args: {...}, tasks: [<task idx>, ...], n: <episodes per task>,
     base_url: <token endpoint>, model: <name>, tokenizer: <dir>, sampling: {temperature, top_p, max_tokens},
     max_turns: <int or null>, concurrency: <episodes at once>, answer_path: <file>}

and writes one JSON answer to `answer_path`: `{episodes: [...]}`, task by task, `n` a task, each `{task, reward,
ok, errors, rewards, truncated, branches: [{token_ids, sampled_mask, logprobs}]}`, where a branch is what
`Trace.branches` gives (an exact token prefix that the trace could prove; a new branch starts where it could
not). The harness is `null` (the model's reply is the episode) in the `subprocess` runtime; the client is
verifiers' `TrainClientConfig` (it renders the chat with the tokenizer's template and posts token ids to
`{base_url}/inference/v1/generate`).
"""

import asyncio
import json
import sys


def _harness_scripts_run_here() -> None:
    """The null harness's chat program is a PEP 723 script that verifiers prepares with `uv sync` (which would
    install uv and download the script's packages on first use); every package it names is in this environment,
    so it is registered as prepared, to run with this interpreter: no uv, no network. verifiers 0.4.0 keeps the
    prepared scripts in `SubprocessRuntime._interpreters`, keyed by their path under `scripts_dir`."""
    import hashlib
    from pathlib import Path

    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    SubprocessRuntime._interpreters[str(path)] = sys.executable


async def run(request: dict) -> dict:
    import verifiers.v1 as vf
    from verifiers.v1.env import RunSlot
    from verifiers.v1.utils.loaders import load_environment

    agent = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
    if request.get("max_turns"):
        agent["max_turns"] = request["max_turns"]
    config = vf.SingleAgentEnvConfig.model_validate(
        {"taskset": {"id": request["taskset"], **request.get("taskset_args", {})}, "agent": agent})
    env = load_environment(config)
    _harness_scripts_run_here()
    tasks = list(env.taskset)
    wanted = request["tasks"]
    if bad := [i for i in wanted if not 0 <= i < len(tasks)]:
        raise SystemExit(f"taskset {request['taskset']!r} has {len(tasks)} tasks; asked for task {bad[0]} (the row "
                         "of --prompt-data is the task's index in the taskset)")
    client = vf.TrainClientConfig(base_url=request["base_url"].rstrip("/") + "/v1", api_key_var="MEGARL_NO_KEY",
                                  renderer_model_name=request["tokenizer"])
    sampling = vf.SamplingConfig(**{k: v for k, v in request["sampling"].items() if v is not None})
    ctx = vf.ModelContext(model=request["model"], client=client, sampling=sampling)
    semaphore = asyncio.Semaphore(max(1, request.get("concurrency", 16)))
    slots = [RunSlot(tasks[i]) for i in wanted for _ in range(request["n"])]
    async with env.serving():
        episodes = await asyncio.gather(*(env.run_slot(slot, ctx, semaphore) for slot in slots))
    out = []
    for task, episode in zip((i for i in wanted for _ in range(request["n"])), episodes):
        traces = list(episode.traces)
        branches = [{"token_ids": list(b.token_ids), "sampled_mask": [bool(m) for m in b.sampled_mask],
                     "logprobs": [float(x) for x in b.logprobs]} for t in traces for b in t.branches]
        rewards = {name: (r.value if r is not None else None) for t in traces for name, r in t.rewards.items()}
        errors = [f"{e.type}: {e.message}" for e in episode.errors]
        errors += [f"{t.last_error.type}: {t.last_error.message}" for t in traces if t.last_error is not None]
        out.append({"task": task, "reward": sum(t.reward for t in traces), "ok": bool(episode.ok),
                    "errors": errors, "rewards": rewards, "branches": branches,
                    "truncated": any(t.is_truncated for t in traces)})
    return {"episodes": out}


def main() -> None:
    request = json.load(sys.stdin)
    answer = asyncio.run(run(request))
    with open(request["answer_path"], "w") as f:  # not stdout: nothing verifiers prints can corrupt it
        json.dump(answer, f)


if __name__ == "__main__":
    main()
