"""`--rollout-servers`: megarl's HTTP client of SGLang servers (`SGLangServers`) against SGLang 0.5.23's own server
on CPU, launched as launch/slurm/disaggregated.sbatch launches it (checks_servers.py, run in the SGLang
environment; one server for the module). The disaggregated weight path runs over a gloo group."""

import pytest


@pytest.fixture(scope="module")
def server(worker_for, starter, sglang_python, tmp_path_factory):
    w = worker_for("checks_servers", timeout_s=300)
    w.call("start", model_dir=str(starter), log=str(tmp_path_factory.mktemp("sglang-server") / "server.log"))
    return w


def test_generate_over_http(server):
    result = server.call("generate")
    assert result["max_abs_diff"] < 1e-3
    assert result["seed_warned"], "a seeded request to a non-deterministic server should warn"


def test_weight_sync_over_gloo_group(server):
    assert [r["version"] for r in server.call("weights_over_gloo")["rounds"]] == [1, 2, 3]


def test_weights_from_disk(server, tmp_path):
    assert server.call("weights_from_disk", tmp=str(tmp_path / "ckpt"))["sync_probe_absdiff_max"] < 1e-3


def test_refusal_carries_sglangs_message(server, tmp_path):
    message = server.call("refusal_named", tmp=str(tmp_path / "no-weights"))
    assert "update_weights_from_disk refused by http://127.0.0.1" in message and "weights" in message, message
