"""A token endpoint: any rollout engine served over HTTP, token ids in, token ids and log-probs out.

    POST /inference/v1/generate   {model, token_ids, sampling_params: {...}, cache_salt?, priority?}
                                  header X-Session-ID (kept with the request), X-Request-ID (optional: the id an
                                  abort names; the server makes one otherwise)
                               -> {request_id, model, weight_version, prompt_token_ids,
                                   choices: [{index, token_ids, finish_reason, weight_version,
                                              logprobs: {content: [{token: "token_id:<id>", logprob}]}}]}
    POST /inference/v1/abort      {request_id} or {session_id} -> {aborted: <requests>}
    GET  /v1/models               {object: "list", data: [{id, object: "model", owned_by, max_model_len}]}

The shapes are those of vLLM's token generate endpoint as the `renderers` client of verifiers 0.4.0 reads them
(every log-prob entry's `token` is `token_id:<id>`, one per sampled token). No text goes in or out: a program that
renders chat turns sends the ids it rendered and gets the engine's sampled ids verbatim, so a trajectory's training
tokens are the sampled ones (never re-encoded).

Batching: requests that arrive within `batch_window` seconds of the first waiting one, up to `max_batch`, go to
the engine together, one `generate` call per distinct set of sampling parameters (the engine protocol takes one
`SamplingParams` per call). With a seed, a request's samples depend on what it was batched with (one generator
per call, as in `RolloutEngine.generate`); `engine_calls` counts the calls and `batches` records their sizes.

Aborts: a request aborted (an abort call, or its client gone) before its batch starts never reaches the engine; one
aborted while its batch runs is answered at once with finish reason "abort" and no tokens, and the engine's result
for it is dropped (the engine protocol cannot stop one row of a running call). Each request waits at most
`request_timeout` seconds (504 after that). The engine is called from one thread only.

What it does not do: text (chat/completions), streaming, top-k alternatives (`logprobs` above 1), multimodal
features, authentication (it binds 127.0.0.1 by default: whoever reaches the port can sample from the policy).
"""

from __future__ import annotations

import itertools
import json
import math
import queue
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from megarl.rollout.base import Completion, RolloutEngine, SamplingParams

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort"
MODELS_PATH = "/v1/models"
MAX_BODY_BYTES = 64 << 20

# sampling_params keys that change nothing here, accepted at these values only (a client's defaults): anything
# else is a 400 naming the key, never silently ignored.
_NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0,
            "min_p": 0.0}
# Keys about text or bookkeeping that a token endpoint has no use for, accepted with any value.
_IGNORED = {"skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "detokenize",
            "routed_experts_prompt_start", "reasoning_effort"}
_TOP_LEVEL = {"model", "token_ids", "sampling_params", "cache_salt", "priority"}


class BadRequest(ValueError):
    """A request the endpoint refuses, with the field it names (answered 400)."""


@dataclass
class _Request:
    request_id: str
    session_id: str | None
    prompt: list[int]
    params: SamplingParams
    done: threading.Event = field(default_factory=threading.Event)
    aborted: bool = False
    started: bool = False  # handed to the engine
    completions: list[Completion] | None = None
    error: str | None = None


def _number(sp: dict, key: str, default: float, kind: type = float) -> Any:
    value = sp.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise BadRequest(f"sampling_params.{key} must be {'an integer' if kind is int else 'a number'}, "
                         f"got {value!r}")
    if not math.isfinite(value):
        raise BadRequest(f"sampling_params.{key} must be finite, got {value!r}")
    return kind(value)


def parse_request(body: Any, vocab_size: int, max_tokens_cap: int, default_max_tokens: int,
                  model_name: str) -> tuple[list[int], SamplingParams]:
    """The prompt ids and `SamplingParams` of a generate body; `BadRequest` naming the field otherwise."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    if unknown := sorted(set(body) - _TOP_LEVEL):
        raise BadRequest(f"unknown field {unknown[0]!r}; allowed: {', '.join(sorted(_TOP_LEVEL))}")
    if body.get("model", model_name) != model_name:
        raise BadRequest(f"model {body['model']!r} is not served here; GET {MODELS_PATH} lists {model_name!r}")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("token_ids must be a non-empty list of token ids")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise BadRequest(f"token_ids[{i}] = {t!r} is not a token id in [0, {vocab_size})")
    sp = body.get("sampling_params", {})
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object")
    for key in sp:
        if key in _NEUTRAL and sp[key] is not None and sp[key] != _NEUTRAL[key]:
            raise BadRequest(f"sampling_params.{key} = {sp[key]!r} is not supported (only {_NEUTRAL[key]!r})")
    allowed = {"temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "logprobs", "seed", "n", "stop",
               *_NEUTRAL, *_IGNORED}
    if unknown := sorted(set(sp) - allowed):
        raise BadRequest(f"unknown sampling_params key {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}")
    logprobs = sp.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs
                                 <= 1):
        raise BadRequest(f"sampling_params.logprobs must be 0 or 1 (the sampled token's log-prob is always "
                         f"returned; no alternatives), got {logprobs!r}")
    max_tokens = _number(sp, "max_tokens", default_max_tokens, int)
    if not 1 <= max_tokens <= max_tokens_cap:
        raise BadRequest(f"sampling_params.max_tokens must be in [1, {max_tokens_cap}], got {max_tokens}")
    stops = sp.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                                              for t in stops):
        raise BadRequest(f"sampling_params.stop_token_ids must be a list of token ids in [0, {vocab_size})")
    stop = sp.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("sampling_params.stop must be a string or a list of non-empty strings")
    seed = sp.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"sampling_params.seed must be an integer, got {seed!r}")
    try:
        params = SamplingParams(n=_number(sp, "n", 1, int), temperature=_number(sp, "temperature", 1.0),
                                top_p=_number(sp, "top_p", 1.0), top_k=_number(sp, "top_k", -1, int),
                                max_new_tokens=max_tokens, stop_token_ids=tuple(stops), seed=seed, stop=tuple(stop))
    except ValueError as e:  # SamplingParams names the field in its own terms
        raise BadRequest(str(e).replace("SamplingParams.", "sampling_params.")) from None
    if params.n > 16:
        raise BadRequest(f"sampling_params.n must be in [1, 16], got {params.n}")
    return list(ids), params


def answer(request_id: str, model: str, prompt: list[int], completions: list[Completion]) -> dict:
    """The generate answer for `completions` of `prompt`."""
    return {
        "request_id": request_id,
        "model": model,
        "prompt_token_ids": prompt,
        "weight_version": max((c.weight_version for c in completions), default=0),
        "choices": [{"index": i, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                     "weight_version": c.weight_version,
                     "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": float(lp)}
                                              for t, lp in zip(c.token_ids, c.logprobs)]}}
                    for i, c in enumerate(completions)],
    }


class TokenServer:
    """`engine` behind `POST /inference/v1/generate` on a thread of this process (see the module docstring).

    `vocab_size`: token ids at or above it are refused; `max_tokens_cap`: the most new tokens a request may ask for
    (its default when the request names none: `default_max_tokens`, else the cap); `model_name`: the id `GET
    /v1/models` lists and a request must name (or leave out); `max_model_len` is listed there for clients that
    check prompt lengths before sending."""

    def __init__(self, engine: RolloutEngine, *, vocab_size: int, max_tokens_cap: int,
                 default_max_tokens: int | None = None, model_name: str = "megarl", host: str = "127.0.0.1",
                 port: int = 0, batch_window: float = 0.02, max_batch: int = 64, request_timeout: float = 600.0,
                 max_model_len: int | None = None):
        if batch_window < 0 or max_batch < 1 or request_timeout <= 0:
            raise ValueError("TokenServer needs batch_window >= 0, max_batch >= 1 and request_timeout > 0")
        self.engine, self.vocab_size, self.model_name = engine, vocab_size, model_name
        self.max_tokens_cap = max_tokens_cap
        self.default_max_tokens = default_max_tokens or max_tokens_cap
        self.batch_window, self.max_batch, self.request_timeout = batch_window, max_batch, request_timeout
        self.max_model_len = max_model_len
        self.engine_calls = 0
        self.batches: list[int] = []  # requests per engine call, in order
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._live: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._httpd = ThreadingHTTPServer((host, port), _handler(self))
        self._httpd.daemon_threads = True
        self._threads = [threading.Thread(target=self._httpd.serve_forever, name="token-server-http", daemon=True),
                         threading.Thread(target=self._engine_loop, name="token-server-engine", daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        """Stop serving: waiting requests are answered 503, the threads end."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._queue.put(None)
        self._threads[1].join(timeout=self.request_timeout)
        with self._lock:
            for req in self._live.values():
                req.error = req.error or "the token server closed"
                req.done.set()

    def __enter__(self) -> TokenServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, session_id: str | None = None,
               request_id: str | None = None) -> _Request:
        req = _Request(request_id or f"megarl-{next(self._ids)}-{uuid.uuid4().hex[:8]}", session_id, prompt, params)
        with self._lock:
            if req.request_id in self._live:
                raise BadRequest(f"X-Request-ID {req.request_id!r} is already in flight")
            self._live[req.request_id] = req
        self._queue.put(req)
        return req

    def finish(self, req: _Request) -> None:
        with self._lock:
            self._live.pop(req.request_id, None)

    def abort(self, request_id: str | None = None, session_id: str | None = None) -> int:
        """Abort the live requests with this id, or of this session; how many there were."""
        with self._lock:
            hits = [r for r in self._live.values()
                    if (request_id is not None and r.request_id == request_id)
                    or (session_id is not None and r.session_id == session_id)]
            for r in hits:
                r.aborted = True
                r.done.set()
        return len(hits)

    def _engine_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, deadline = [first], time.monotonic() + self.batch_window
            while len(batch) < self.max_batch and (left := deadline - time.monotonic()) > 0:
                try:
                    nxt = self._queue.get(timeout=left)
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
            by_params: dict[SamplingParams, list[_Request]] = {}
            for req in batch:
                by_params.setdefault(req.params, []).append(req)
            for params, reqs in by_params.items():
                self._run(params, reqs)

    def _run(self, params: SamplingParams, reqs: list[_Request]) -> None:
        with self._lock:
            reqs = [r for r in reqs if not r.aborted]
            for r in reqs:
                r.started = True
        if not reqs:
            return
        self.engine_calls += 1
        self.batches.append(len(reqs))
        try:
            groups = self.engine.generate([r.prompt for r in reqs], params)
        except Exception as e:  # noqa: BLE001 - each waiting request is told, the server goes on
            for r in reqs:
                r.error = f"the engine failed: {type(e).__name__}: {e}"
                r.done.set()
            return
        for r, completions in zip(reqs, groups):
            r.completions = completions
            r.done.set()


def _client_gone(sock: socket.socket) -> bool:
    """Whether the peer closed its end (a readable socket with nothing to read)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _handler(server: TokenServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 60  # seconds a connection may take to send a request

        def log_message(self, format: str, *args) -> None:  # the trainer's log is not an access log
            pass

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            kind = {400: "BadRequestError", 404: "NotFoundError", 504: "Timeout"}.get(status, "ServerError")
            self._send(status, {"error": {"message": message, "type": kind, "code": status}})

        def _body(self) -> Any:
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise BadRequest("a body with a Content-Length header is required")
            if int(length) > MAX_BODY_BYTES:
                raise BadRequest(f"the body is over {MAX_BODY_BYTES} bytes")
            try:
                return json.loads(self.rfile.read(int(length)) or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadRequest(f"the body is not JSON: {e}") from None

        def do_GET(self) -> None:
            if self.path.rstrip("/") in (MODELS_PATH, "/models"):
                card = {"id": server.model_name, "object": "model", "owned_by": "megarl",
                        "weight_version": server.engine.weight_version}
                if server.max_model_len:
                    card["max_model_len"] = server.max_model_len
                self._send(200, {"object": "list", "data": [card]})
            else:
                self._error(404, f"no GET {self.path}; GET {MODELS_PATH}, POST {GENERATE_PATH} or {ABORT_PATH}")

        def do_POST(self) -> None:
            try:
                body = self._body()
                if self.path == GENERATE_PATH:
                    self._generate(body)
                elif self.path == ABORT_PATH:
                    self._abort(body)
                else:
                    self._error(404, f"no POST {self.path}; POST {GENERATE_PATH} or {ABORT_PATH}")
            except BadRequest as e:
                self._error(400, str(e))

        def _abort(self, body: Any) -> None:
            if not isinstance(body, dict) or not ({"request_id", "session_id"} & set(body)):
                raise BadRequest("an abort body names request_id or session_id")
            self._send(200, {"aborted": server.abort(body.get("request_id"), body.get("session_id"))})

        def _generate(self, body: Any) -> None:
            prompt, params = parse_request(body, server.vocab_size, server.max_tokens_cap,
                                           server.default_max_tokens, server.model_name)
            req = server.submit(prompt, params, self.headers.get("X-Session-ID"), self.headers.get("X-Request-ID"))
            deadline = time.monotonic() + server.request_timeout
            try:
                while not req.done.wait(0.05):
                    if _client_gone(self.connection):
                        server.abort(request_id=req.request_id)
                        self.close_connection = True
                        return
                    if time.monotonic() > deadline:
                        server.abort(request_id=req.request_id)
                        self._error(504, f"no answer within {server.request_timeout:g} s (request {req.request_id})")
                        return
            finally:
                server.finish(req)
            if req.aborted:
                self._send(200, answer(req.request_id, server.model_name, prompt,
                                       [Completion([], [], "abort", server.engine.weight_version)] * params.n))
            elif req.error is not None:
                self._error(503, req.error)
            else:
                self._send(200, answer(req.request_id, server.model_name, prompt, req.completions or []))

    return Handler
