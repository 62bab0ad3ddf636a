"""The wall-clock budget helper (`megarl.verifiers.budget.Guard`): values, errors, timeouts and a dead helper, from
several threads at once. The targets are standard-library functions, so the helper imports nothing of ours."""

from __future__ import annotations

import threading
import time

import pytest

from megarl.verifiers.budget import BudgetExceeded, Guard, HelperFailed


@pytest.fixture(scope="module")
def guard():
    g = Guard(memory_mib=0)
    yield g
    g.close()


def test_value_and_error_come_back(guard):
    assert guard.call("math:sqrt", (16.0,), timeout=5) == 4.0
    with pytest.raises(ValueError, match="math domain error"):
        guard.call("math:sqrt", (-1.0,), timeout=5)
    assert guard.call("operator:add", (2, 3), timeout=5) == 5  # the helper survived the error


def test_timeout_kills_and_replaces_the_helper(guard):
    guard.call("math:sqrt", (1.0,), timeout=5)  # a started helper
    start = time.monotonic()
    with pytest.raises(BudgetExceeded):
        guard.call("time:sleep", (60,), timeout=0.3)
    assert time.monotonic() - start < 0.3 + 1.0
    assert guard.call("math:sqrt", (9.0,), timeout=30) == 3.0


def test_a_dying_helper_is_replaced(guard):
    with pytest.raises(HelperFailed):
        guard.call("os:_exit", (3,), timeout=5)
    assert guard.call("math:sqrt", (4.0,), timeout=30) == 2.0


def test_threads_share_one_guard(guard):
    got: dict[int, float] = {}

    def work(k: int) -> None:
        for i in range(10):
            got[k * 100 + i] = guard.call("operator:mul", (k, i), timeout=30)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == {k * 100 + i: k * i for k in range(4) for i in range(10)}
