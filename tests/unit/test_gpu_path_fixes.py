"""The GPU path held to what its upstream sources do, on CPU: SGLang's writes to the trainer's environment, a
half-installed Transformer Engine, megatron-core's MoE router without TE on a GPU machine, the order of the
run's end, the disaggregated launcher's health wait. Stand-ins replace what needs a GPU; each test fails with
the behaviour the fix removed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from megarl.mcore import cpu_compat, parallel
from megarl.rollout import sglang_engine
from megarl.rollout.sglang_engine import SGLangEngine, SGLangServers

REPO = Path(__file__).resolve().parents[2]

# What SGLang 0.5.23 writes into the process that builds `sglang.Engine` (the trainer, colocated): its argument
# resolution at TP > 1 with deterministic inference (NCCL_ALGO, the channel counts), `_set_envs_and_config` the rest.
SGLANG_WRITES = {"NCCL_ALGO": "allreduce:tree", "NCCL_MIN_NCHANNELS": "1", "NCCL_MAX_NCHANNELS": "1",
                 "NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "8"}


class _WritingEngine:
    """`sglang.Engine` as far as the trainer's environment is concerned."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        os.environ.update(SGLANG_WRITES)

    def release_memory_occupation(self, tags=None):
        return True, ""


def test_a_seeded_tp2_launch_leaves_the_trainers_environment_as_it_was(monkeypatch):
    """Only model-parallel leaders launch engines: whatever SGLang writes must not reach the communicators the
    trainer creates later, or leaders and their peers run different all-reduce algorithms (a hang)."""
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=_WritingEngine))
    monkeypatch.setattr(sglang_engine, "sglang_available", lambda: (True, ""))
    for key in SGLANG_WRITES:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")  # a site's own setting stays the site's
    before = dict(os.environ)
    engine = SGLangEngine.launch("/model", tp_size=2, seed=1234, device="cuda")
    assert engine.engine.kwargs["enable_deterministic_inference"] is True and engine.colocated
    assert dict(os.environ) == before


def _te_standin(root: Path) -> None:
    """transformer_engine as it is installed without its torch extension (`transformer_engine_torch`, an sdist
    that failed to build or was left out): the package imports (TE 2.11's `__init__` swallows the failure of
    `from . import pytorch`), `transformer_engine.pytorch` does not. (An extension built against another torch
    raises a plain ImportError there, which megatron-core 0.16.1's own imports do not survive.)"""
    pkg = root / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("try:\n    from . import pytorch\nexcept (ImportError, FileNotFoundError):\n"
                                     "    pass\n")
    (pkg / "pytorch" / "__init__.py").write_text("import transformer_engine_torch  # noqa: F401 - not installed\n")


@pytest.fixture
def broken_te(tmp_path, monkeypatch):
    # megatron-core first, as without TE: the stand-in has no package metadata for megatron's version checks
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401

    _te_standin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    yield
    for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
        del sys.modules[name]


def test_a_transformer_engine_without_its_torch_extension_gets_the_local_spec_and_says_why(broken_te):
    import transformer_engine  # noqa: F401 - the trap: the package itself imports

    with pytest.warns(RuntimeWarning, match=r"transformer_engine\.pytorch.*transformer_engine_torch.*local layer spec"):
        spec = parallel.layer_spec(None)
    qkv = spec.submodules.self_attention.submodules.linear_qkv
    assert not qkv.__name__.startswith("TE"), f"the TE spec was chosen ({qkv.__name__})"
    assert parallel.transformer_engine_available() is False
    with pytest.raises(RuntimeError, match=r"--transformer-impl transformer_engine.*transformer_engine_torch"):
        parallel.uses_transformer_engine(True)


def test_the_moe_router_gemm_is_patched_on_a_gpu_machine_without_transformer_engine(monkeypatch):
    """megatron-core 0.16.1's router names `te_general_gemm`, defined only when TE imports: without TE a GPU
    machine hits the NameError too, so the patch does not depend on CUDA being absent."""
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)  # as imported without TE
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cpu_compat.install()
    assert moe_utils.te_general_gemm is None
    x, w = torch.randn(5, 8), torch.randn(3, 8)
    out = moe_utils.RouterGatingLinearFunction.apply(x, w, None, torch.float32)
    assert torch.allclose(out, x @ w.t(), atol=1e-6)


def test_servers_update_weights_pushes_default_buckets():
    """The `RolloutEngine` call on servers elsewhere (it read an attribute only the colocated engine has). A
    data-parallel leader that does not push posts nothing and takes the version."""
    servers = SGLangServers(["127.0.0.1:1"], push=False)
    servers.update_weights([("w", torch.ones(4))], version=3)
    assert servers.weight_version == 3
    servers.update_weights(iter([("w", torch.ones(4))]))
    assert servers.weight_version == 4


def test_the_run_ends_with_megarls_children_first_and_the_engine_last(monkeypatch):
    """SGLang's `Engine.shutdown` SIGKILLs every child of the process (and raises if they are not reaped in
    60 s): the reward workers, the sandboxes and the asynchronous worker stop first, and the engine stops even
    when closing one of them fails."""
    from megarl.trainer import build

    log = []

    def part(name, method="close", fail=False):
        def call():
            log.append(name)
            if fail:
                raise OSError(f"{name} failed to close")
        return types.SimpleNamespace(**{method: call})

    monkeypatch.setattr(parallel, "destroy", lambda: log.append("process groups"))
    run = types.SimpleNamespace(pending=part("async worker", "stop"), engine=part("engine", "shutdown"),
                                rollout_fn=part("rollout function"), reward=part("reward"))
    build.close(run)
    assert log == ["async worker", "rollout function", "reward", "engine", "process groups"]
    log.clear()
    run.reward = part("reward", fail=True)
    with pytest.raises(OSError, match="reward failed"):
        build.close(run)
    assert log == ["async worker", "rollout function", "reward", "engine", "process groups"]


def test_the_reward_pool_stops_its_workers_when_the_reward_closes():
    from megarl.reward.functions import PoolReward
    from megarl.reward.pool import RewardPool

    pool = RewardPool(workers=1, timeout_s=30.0)
    try:
        reward = PoolReward(pool)
        assert reward.score([("arithmetic", "4", "4")])[0].score == 1.0
        worker = pool._guards[0]._proc
        assert worker.poll() is None
        reward.close()
        assert worker.poll() is not None, "the reward worker outlived the reward's close"
    finally:
        pool.close()


# -- the disaggregated launcher's health wait ---------------------------------------------------------------------


@pytest.fixture
def silent_port():
    """A port that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_the_health_wait_gives_up_at_its_deadline_on_a_server_that_never_answers(silent_port):
    """Each health request is bounded (`curl --max-time`): a server that accepts the connection and never
    answers cannot hold the wait past SGLANG_START_TIMEOUT."""
    script = (f'source "{REPO}/launch/slurm/common.sh"; sleep 600 & pid=$!; '
              f'megarl_wait_healthy 3 "$pid" 127.0.0.1:{silent_port}; rc=$?; kill "$pid"; exit "$rc"')
    start = time.monotonic()
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    assert f"127.0.0.1:{silent_port} not healthy after 3 s" in proc.stderr
    assert took < 15, f"the wait took {took:.0f} s past its 3 s deadline"
    healthy = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=healthy.serve_forever, daemon=True).start()
    try:
        ok = subprocess.run(["bash", "-c", script.replace(str(silent_port), str(healthy.server_address[1]))],
                            capture_output=True, text=True, timeout=60)
    finally:
        healthy.shutdown()
    assert ok.returncode == 0, ok.stderr
    sbatch = (REPO / "launch/slurm/disaggregated.sbatch").read_text()
    assert 'megarl_wait_healthy "${SGLANG_START_TIMEOUT:-1200}" "$SERVER_PID"' in sbatch


def test_the_launch_wait_names_leaders_that_never_started_or_are_still_launching():
    """Two data-parallel leaders: one still launching at the limit, one that never began (the distributed test,
    tests/distributed/test_engine_launch_wait.py, runs the wait under torchrun)."""
    from torch.distributed import HashStore

    from megarl.trainer.engine_launch import EngineLaunchError, LaunchWait

    wait = LaunchWait(HashStore(), dp_size=3, timeout_s=0.3, poll_s=0.05)
    wait.started(0, rank=0)
    wait.launched(0)
    wait.started(1, rank=4)
    with pytest.raises(EngineLaunchError, match=r"rank 2: the sglang engine did not finish launching within 0.3 s "
                       r"\(--engine-launch-timeout-seconds\): rank 4 \(the leader of DP rank 1\) has been launching "
                       r"for 0 s; the leader of DP rank 2 never started launching"):
        wait.wait(2, "sglang engine")
    wait.launched(1)
    wait.launched(2)
    wait.wait(2, "sglang engine")
    wait.failed(1, rank=4, error=MemoryError("KV cache"))
    with pytest.raises(EngineLaunchError, match=r"on rank 4 \(the model-parallel leader of DP rank 1\) failed to "
                       "launch: MemoryError: KV cache"):
        wait.wait(0, "sglang engine")
