"""--lora-weight-sync adapter against SGLang's CPU engine (checks_lora.py, run in the SGLang environment): the base
weights once, then each version's adapters, verified against transformers with the adapters merged."""


def test_lora_adapter_sync(worker_for, starter, sglang_python):
    w = worker_for("checks_lora", timeout_s=300)
    w.call("launch", model_dir=str(starter))
    assert [v["version"] for v in w.call("adapter_sync")["versions"]] == [1, 2]
