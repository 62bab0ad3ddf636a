"""The Docker pool's replacement of a dead container gives up with a message when the engine is gone, instead of
retrying forever (no Docker engine needed: starting a container is made to fail)."""

import pytest

from megarl.sandbox import docker


class _Old:
    removed = False

    def remove(self):
        self.removed = True


def test_recycle_gives_up_naming_the_engine_when_no_container_starts(monkeypatch):
    box = docker.DockerSandbox(workers=1)
    tries = []

    def no_engine(harness=False):
        tries.append(harness)
        raise OSError("Cannot connect to the Docker daemon")

    monkeypatch.setattr(box, "_new_container", no_engine)
    monkeypatch.setattr(docker.time, "sleep", lambda s: None)
    monkeypatch.setenv("DOCKER_HOST", "unix:///tmp/gone.sock")
    old = _Old()
    with pytest.raises(RuntimeError, match=r"no fresh container after 30 tries .*DOCKER_HOST=unix:///tmp/gone\.sock"
                                           r".*Cannot connect to the Docker daemon"):
        box._recycle(old)
    assert len(tries) == docker.RECYCLE_TRIES and box.recycled == 1


def test_recycle_returns_the_first_container_that_starts(monkeypatch):
    box = docker.DockerSandbox(workers=1)
    outcomes = [OSError("hiccup"), OSError("hiccup"), "fresh"]

    def flaky(harness=False):
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(box, "_new_container", flaky)
    monkeypatch.setattr(docker.time, "sleep", lambda s: None)
    assert box._recycle(_Old()) == "fresh" and not outcomes
