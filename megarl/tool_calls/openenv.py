"""OpenEnv environments inside `--rollout-function tool_use`: one environment per trajectory, a step per tool call.

    --openenv pkg.module:Class      an OpenEnv `Environment` subclass, run in this process, one instance a trajectory
    --openenv-url http://127.0.0.1:PORT   an OpenEnv server (`create_app` under uvicorn), one WebSocket session a
                                    trajectory, through the package's own client (`GenericEnvClient`)

A rollout call opens one session per trajectory (`EnvSessions.open`: all at once, so as many as the batch has
trajectories; an OpenEnv server must allow that many, `max_concurrent_envs`), resets it with the row's label (a
JSON object of keyword arguments, or null for none), steps it once per call of the tool named `--openenv-tool`
(the call's arguments are the action's fields), and closes every session when the call returns. No state is
shared between trajectories: each has its own `Environment` instance or WebSocket session, and none outlives the
rollout call. Both transports give the same results: in-process steps are run as OpenEnv's server runs them
(reset arguments filtered to the signature, the action validated by `deserialize_action`, the observation
serialised by `serialize_observation`), so a step's (observation, reward, done) is the same dictionary either way.

What the model sees of a step: the observation's fields (less reward, done and metadata) as JSON, or the text of
the only field when there is one; an action the environment refuses, or an error it raises, is an error
observation and the trajectory goes on. A step or reset that times out (`--openenv-timeout`), or a session whose
connection breaks, ends its trajectory as `failed`. The step rewards add up into the sample's `env_reward`
(metadata), which the `env_reward` verifier reads (`megarl.verifiers.env_reward`); an episode the environment ends
(`done`) ends its trajectory after that observation.

Isolation: none. The environment is code the user chose, run in the trainer's rollout process or in the server's;
what the model controls is the action's field values, validated against the environment's pydantic `Action`.

`python -m megarl.tool_calls.openenv pkg.module:Class --port N --max-sessions M` serves a class on 127.0.0.1.
The `openenv-core` package (`pip install megarl[openenv]`) is imported only here, and only when an environment is
asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import threading
import typing
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from megarl.errors import ConfigError


def _openenv():
    try:
        from openenv.core import env_server
    except ImportError as e:
        raise ConfigError("--openenv / --openenv-url need the openenv-core package: pip install 'megarl[openenv]' "
                          f"({type(e).__name__}: {e})") from None
    return env_server


def load_environment(spec: str) -> type:
    """The `Environment` subclass that `--openenv pkg.module:Class` names; a `ConfigError` saying why not."""
    env_server = _openenv()
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--openenv {spec!r}: expected 'pkg.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure to import the user's module is the flag's error
        raise ConfigError(f"--openenv {spec!r}: cannot import {module_name!r} ({type(e).__name__}: {e})") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ConfigError(f"--openenv {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, env_server.Environment)):
        raise ConfigError(f"--openenv {spec!r}: {attr} is not a subclass of openenv's Environment")
    return cls


def action_and_observation_types(cls: type) -> tuple[type, type]:
    """The environment's `Action` and `Observation` classes, read from its `step` annotations (what OpenEnv's
    `create_app` is told explicitly)."""
    env_server = _openenv()
    try:
        hints = typing.get_type_hints(cls.step)
    except Exception as e:  # noqa: BLE001 - an annotation that does not resolve
        raise ConfigError(f"--openenv: cannot read {cls.__name__}.step's annotations ({e})") from None
    action, observation = hints.get("action"), hints.get("return")
    if not (isinstance(action, type) and issubclass(action, env_server.Action)
            and isinstance(observation, type) and issubclass(observation, env_server.Observation)):
        raise ConfigError(f"--openenv: {cls.__name__}.step must be annotated `def step(self, action: MyAction, ...) "
                          "-> MyObservation` with openenv Action and Observation subclasses")
    return action, observation


def check_server(url: str, timeout: float) -> None:
    """A `ConfigError` naming the URL and the timeout when the server's /health does not answer in time."""
    http = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/")
    try:
        with urllib.request.urlopen(f"{http}/health", timeout=timeout) as response:
            if response.status != 200:
                raise OSError(f"HTTP {response.status}")
    except (OSError, urllib.error.URLError) as e:
        raise ConfigError(f"--openenv-url {url}: the OpenEnv server is unreachable within --openenv-timeout "
                          f"{timeout:g} s ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class Step:
    """What a reset or a step gave back: the serialised observation (less reward, done, metadata), the reward and
    whether the episode ended; `error` instead when the environment refused the action or raised."""

    observation: dict
    reward: float | None = None
    done: bool = False
    error: str = ""

    @property
    def text(self) -> str:
        """What the model sees."""
        if self.error:
            return f"error: {self.error}"
        values = list(self.observation.values())
        if len(values) == 1 and isinstance(values[0], str):
            return values[0]
        return json.dumps(self.observation, ensure_ascii=False, sort_keys=True, default=str)


class SessionLost(Exception):
    """The session cannot go on (a timeout, a broken connection): its trajectory fails."""


class _InProcess:
    """One `Environment` instance, stepped as OpenEnv's server steps a WebSocket session's."""

    def __init__(self, cls: type, action_cls: type, executor: ThreadPoolExecutor):
        self.cls, self.action_cls, self.executor, self.env = cls, action_cls, executor, None

    async def _call(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self.executor, lambda: fn(*args, **kwargs))

    async def reset(self, kwargs: dict) -> Step:
        env_server = _openenv()
        self.env = await self._call(self.cls)
        is_async = self.env.reset_async.__func__ is not env_server.Environment.reset_async
        fn = self.env.reset_async if is_async else self.env.reset
        params = inspect.signature(fn).parameters
        if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        obs = await fn(**kwargs) if is_async else await self._call(fn, **kwargs)
        return _step(env_server.serialize_observation(obs))

    async def step(self, arguments: dict) -> Step:
        from pydantic import ValidationError

        env_server = _openenv()
        try:
            action = env_server.deserialize_action(arguments, self.action_cls)
        except ValidationError as e:
            return Step({}, error=f"invalid action for {self.action_cls.__name__}: {_errors(e)}")
        is_async = self.env.step_async.__func__ is not env_server.Environment.step_async
        try:
            obs = await self.env.step_async(action) if is_async else await self._call(self.env.step, action)
        except Exception as e:  # noqa: BLE001 - the environment's error is the model's observation, as over the wire
            return Step({}, error=f"{type(e).__name__}: {e}")
        return _step(env_server.serialize_observation(obs))

    async def close(self) -> None:
        if self.env is not None:
            await self._call(self.env.close)


class _Remote:
    """One WebSocket session of an OpenEnv server, through the package's `GenericEnvClient`."""

    def __init__(self, url: str, timeout: float):
        from openenv.core.generic_client import GenericEnvClient

        self.url = url
        self.client = GenericEnvClient(base_url=url, connect_timeout_s=timeout, message_timeout_s=timeout)

    async def reset(self, kwargs: dict) -> Step:
        try:
            result = await self.client.reset(**kwargs)
        except ConnectionError as e:
            raise ConnectionError(f"--openenv-url {self.url}: the OpenEnv server is unreachable within "
                                  f"--openenv-timeout {self.client._connect_timeout:g} s ({e})") from None
        except Exception as e:  # noqa: BLE001 - the server's error, or a session it closed: nothing to train on
            raise RuntimeError(f"--openenv-url {self.url}: reset failed ({type(e).__name__}: {e}); a server at its "
                               "session limit refuses or closes new sessions: it must allow as many as the ranks' "
                               "trajectories of a rollout") from None
        return Step(dict(result.observation), result.reward, bool(result.done))

    async def step(self, arguments: dict) -> Step:
        try:
            result = await self.client.step(arguments)
        except RuntimeError as e:  # an error the server answered (the session goes on)
            return Step({}, error=str(e).removeprefix("Server error: "))
        except Exception as e:  # noqa: BLE001 - the connection is gone
            raise SessionLost(f"{type(e).__name__}: {e}") from None
        return Step(dict(result.observation), result.reward, bool(result.done))

    async def close(self) -> None:
        await self.client.close()


def _step(payload: dict) -> Step:
    return Step(dict(payload["observation"]), payload.get("reward"), bool(payload.get("done", False)))


def _errors(e) -> str:
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'action'}: {err['msg']}" for err in e.errors())[:300]


def reset_arguments(record) -> dict:
    """A row's reset arguments: its label, a JSON object (null: none)."""
    if record.label is None:
        return {}
    if not isinstance(record.label, dict):
        raise ValueError(f"--openenv: row {record.source or record.index}: the label must be a JSON object of the "
                         f"environment's reset arguments (or null), got {type(record.label).__name__}")
    return dict(record.label)


class EnvSessions:
    """The environment sessions of one rollout call, one per trajectory, stepped concurrently on an event loop of
    their own (in-process environments in a thread each). `with EnvSessions(...) as s:` closes them all."""

    def __init__(self, env_cls: type | None, url: str, timeout: float, count: int):
        self.timeout, self._loop = timeout, asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="megarl-openenv", daemon=True)
        self._thread.start()
        self._executor = ThreadPoolExecutor(max(1, count), thread_name_prefix="megarl-openenv-env")
        if env_cls is not None:
            action_cls, _ = action_and_observation_types(env_cls)
            self.sessions: list[Any] = [_InProcess(env_cls, action_cls, self._executor) for _ in range(count)]
        else:
            self.sessions = [_Remote(url, timeout) for _ in range(count)]
        self.lost = [False] * count
        self.url = url

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _all(self, calls: list[tuple[int, Any]]) -> list[Step | BaseException]:
        async def bounded(i, coro):
            try:
                return await asyncio.wait_for(coro, self.timeout)
            except (asyncio.TimeoutError, TimeoutError):
                self.lost[i] = True
                return SessionLost(f"no answer within --openenv-timeout {self.timeout:g} s")
            except SessionLost as e:
                self.lost[i] = True
                return e

        async def gather():
            return await asyncio.gather(*(bounded(i, c) for i, c in calls), return_exceptions=True)

        return self._run(gather())

    def reset(self, arguments: Sequence[dict]) -> list[Step]:
        """Every session reset with its trajectory's arguments; an error that leaves no episode to train on
        (server unreachable, a refused reset, a timeout) raises, naming the URL or the class."""
        results = self._all([(i, s.reset(kw)) for i, (s, kw) in enumerate(zip(self.sessions, arguments))])
        for r in results:
            if isinstance(r, SessionLost):
                where = f"--openenv-url {self.url}" if self.url else "--openenv"
                raise RuntimeError(f"{where}: an environment did not reset within --openenv-timeout "
                                   f"{self.timeout:g} s ({r})")
            if isinstance(r, BaseException):
                raise r
        return results  # type: ignore[return-value]

    def step(self, calls: Sequence[tuple[int, dict]]) -> list[Step | SessionLost]:
        """One step per (session, action fields), concurrently; a session that cannot go on gives `SessionLost`
        (and every later step of it too)."""
        gone = [self.lost[i] for i, _ in calls]
        out = iter(self._all([(i, self.sessions[i].step(args)) for (i, args), g in zip(calls, gone) if not g]))
        return [SessionLost("the session was lost earlier") if g else next(out) for g in gone]

    def close(self) -> None:
        try:
            self._all([(i, s.close()) for i, s in enumerate(self.sessions)])
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> EnvSessions:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(spec: str, port: int, max_sessions: int, host: str = "127.0.0.1") -> None:
    """Serve `--openenv`'s class with OpenEnv's `create_app` under uvicorn, on the loopback by default."""
    import uvicorn

    env_server = _openenv()
    cls = load_environment(spec)
    action, observation = action_and_observation_types(cls)
    app = env_server.create_app(cls, action, observation, max_concurrent_envs=max_sessions)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m megarl.tool_calls.openenv",
                                description="Serve an OpenEnv Environment subclass over OpenEnv's HTTP/WebSocket "
                                            "API (create_app under uvicorn), for --openenv-url.")
    p.add_argument("environment", help="pkg.module:Class, an openenv Environment subclass")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--max-sessions", type=int, required=True,
                   help="concurrent WebSocket sessions: at least the trajectories of a rollout call, summed over "
                        "the ranks that roll out (rollout batch x samples per prompt)")
    a = p.parse_args(argv)
    serve(a.environment, a.port, a.max_sessions, a.host)


if __name__ == "__main__":
    main()
