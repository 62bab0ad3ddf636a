"""`--rollout-servers` (`SGLangServers`) against SGLang 0.5.23's own HTTP server on CPU, started the way
launch/slurm/disaggregated.sbatch starts it (`python -m sglang.launch_server --model-path ... --host --port
--tp-size --mem-fraction-static`, SGLANG_DETERMINISTIC=0, the CPU settings as SGLANG_ARGS). Run by worker.py in the
SGLang environment; one server for the module. Weights go over a gloo group (`init_weights_update_group` with
backend "gloo", then `update_weights_from_distributed` per flattened bucket) and from a checkpoint directory
(`update_weights_from_disk`); the reference is the same checkpoint in transformers."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings

import torch

from megarl import procs
from megarl.rollout import weight_sync
from megarl.rollout.base import SamplingParams
from megarl.rollout.sglang_engine import SGLangServers

STATE: dict = {}
# launch/slurm/disaggregated.sbatch's SGLANG_ARGS for a CPU server (the adapter's CPU_ENGINE_ARGS as flags)
CPU_SGLANG_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
                   "--max-total-tokens", "4096", "--max-running-requests", "16", "--dtype", "float32"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_start(model_dir: str, log: str, timeout_s: float = 240.0) -> dict:
    start = time.perf_counter()
    for _ in range(3):  # the server binds its port ~20 s after it was found free: another job may take it first
        url = _launch(model_dir, log, timeout_s)
        if url:
            break
    else:
        raise AssertionError(f"the SGLang server's port was taken before it bound it, 3 times; its log:\n"
                             f"{open(log).read()[-3000:]}")
    STATE.update(url=url, model_dir=model_dir)
    return {"seconds": time.perf_counter() - start}


def _launch(model_dir: str, log: str, timeout_s: float) -> str:
    """The healthy server's URL, or "" when its port was taken before it bound it (the server stopped)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--tp-size", "1", "--mem-fraction-static", "0.05", *CPU_SGLANG_ARGS]
    STATE["proc"] = proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                            env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:  # the sbatch's readiness test
        try:
            with urllib.request.urlopen(url + "/health_generate", timeout=10) as r:
                if r.status == 200:
                    return url
        except OSError:
            pass
        if "address already in use" in open(log).read():
            for pid in [*procs.descendants(proc.pid), proc.pid]:  # its scheduler and detokenizer too
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(timeout=60)
            return ""
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the SGLang server did not become healthy; its log:\n{open(log).read()[-3000:]}")
        time.sleep(1.0)


def _reference():
    if "reference" not in STATE:
        from transformers import AutoModelForCausalLM

        STATE["reference"] = AutoModelForCausalLM.from_pretrained(STATE["model_dir"], dtype=torch.float32).eval()
    return STATE["reference"]


@torch.no_grad()
def _ref_token_logp(tokens: list[int]) -> torch.Tensor:
    logits = _reference()(torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def _probe_check(servers: SGLangServers, seed: int) -> dict:
    probe = weight_sync.probe_sequence(80, length=32, seed=seed)
    engine_logp = torch.tensor(servers.score([probe], [1], temperature=1.0)[0])
    return weight_sync.check_probe(_ref_token_logp(probe), engine_logp, tolerance=1e-3)


def check_generate() -> dict:
    """Generation with log-probs over HTTP, the seeded-sampling warning (no deterministic inference on CPU), and
    the server's TP size from /server_info."""
    servers = SGLangServers([STATE["url"]])
    STATE["servers"] = servers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups = servers.generate([[3, 4, 5], [6, 7]], SamplingParams(n=2, max_new_tokens=6, seed=1))
    assert [len(g) for g in groups] == [2, 2]
    worst = 0.0
    for prompt, group in zip([[3, 4, 5], [6, 7]], groups):
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) > 0
            ref = _ref_token_logp(prompt + c.token_ids)[len(prompt) - 1:]
            worst = max(worst, float((ref - torch.tensor(c.logprobs)).abs().max()))
    assert worst < 1e-3, worst
    seed_warned = any("enable-deterministic-inference" in str(w.message) for w in caught)
    return {"max_abs_diff": worst, "seed_warned": seed_warned, "probe": _probe_check(servers, 0)}


def _scaled(scale: float) -> list[tuple[str, torch.Tensor]]:
    with torch.no_grad():
        for name, p in _reference().named_parameters():
            if "norm" not in name:
                p.mul_(scale)
    return [(n, p.detach().clone()) for n, p in _reference().state_dict().items()]


def check_weights_over_gloo(rounds: int = 2) -> dict:
    """connect (a gloo weight-update group: the trainer rank 0, the server's TP rank 1), then bucketed pushes
    (several buckets each), each verified by the probe against transformers; weight versions stamped."""
    servers = STATE["servers"]
    servers.connect("127.0.0.1", _free_port(), backend="gloo")
    out = []
    for r in range(rounds):
        version = servers.weight_version + 1
        servers.load_weight_buckets(weight_sync.pack_buckets(_scaled(1.05 if r % 2 == 0 else 1 / 1.05), 256 << 10),
                                    version)
        assert servers.weight_version == version
        c = servers.generate([[3, 4]], SamplingParams(max_new_tokens=3))[0][0]
        assert c.weight_version == version
        out.append({"version": version, **_probe_check(servers, version)})
    servers.update_weights(iter(_scaled(1.0)))  # the RolloutEngine call, default buckets (it read a missing .ipc)
    out.append({"version": servers.weight_version, **_probe_check(servers, 77)})
    return {"rounds": out}


def check_weights_from_disk(tmp: str) -> dict:
    """update_weights_from_disk (a checkpoint directory the server can read), then flush; verified by the probe."""
    servers = STATE["servers"]
    _scaled(1.02)
    _reference().save_pretrained(tmp)
    servers.update_weights_from_disk(tmp, servers.weight_version + 1)
    return _probe_check(servers, 99)


def check_refusal_named(tmp: str) -> str:
    """A control call the server refuses raises WeightSyncError with SGLang's own message (here: a checkpoint
    directory with a config and no weights)."""
    import shutil

    servers = STATE["servers"]
    os.makedirs(tmp)
    shutil.copy(os.path.join(STATE["model_dir"], "config.json"), tmp)
    try:
        servers.update_weights_from_disk(tmp, 100)
    except weight_sync.WeightSyncError as e:
        return str(e)
    raise AssertionError("update_weights_from_disk of a missing directory was not refused")


def close() -> None:
    proc = STATE.pop("proc", None)
    if proc is not None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
