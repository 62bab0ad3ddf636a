"""The disaggregated weight-update group formed under torchrun (finding 3 of the GPU-path reading): torchrun sets
TORCHELASTIC_USE_AGENT_STORE=True, and torch 2.13's `rendezvous("tcp://...")` then makes every rank a client of
a store nobody hosts, so trainer and SGLang both waited for the timeout. The trainer now hosts the store."""

from __future__ import annotations

import pytest
from helpers import free_port, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_weights_update_group_forms_under_torchrun():
    port = free_port()
    proc = torchrun(2, "tests/distributed/weights_group_worker.py", "--port", port, "--timeout", 20, timeout=150)
    assert "rank 0: joined megarl_weights" in proc.stdout and "rank 1: joined megarl_weights" in proc.stdout
