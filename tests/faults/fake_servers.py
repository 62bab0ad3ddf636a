"""Fake rollout servers in the test's process (stdlib http.server) answering the endpoints megarl's clients call,
for the server-failure tests: SGLang's (`/generate`, `/health`, `/server_info`) and vLLM's (`/inference/v1/generate`,
`/health`). A sample depends on the prompt and the request's seed only, as a seeded server's does, so a request
sent again to another server gets the same answer. `crash_next` (the next generate request drops its connection
unanswered, then the server is gone: connection refused) and `hang` (generate and /health wait until `resume`)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _ids(prompt: list[int], seed: int | None, n: int) -> list[int]:
    return [(sum(prompt) + (seed or 0) + k) % 50 for k in range(n)]


class FakeServer:
    generate_path = ""

    def __init__(self):
        self.generated = 0  # samples answered
        self.crash_next = False
        self.awake = threading.Event()
        self.awake.set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, payload) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path != outer.generate_path:
                    return self._answer({"success": True, "message": "ok"})
                if outer.crash_next:  # the process dies mid-request: the connection closes, nothing answered
                    outer.crash_next = False
                    self.close_connection = True
                    threading.Thread(target=outer.stop, daemon=True).start()
                    return
                outer.awake.wait()
                answer, samples = outer.generate(body)
                outer.generated += samples
                self._answer(answer)

            def do_GET(self):
                outer.awake.wait()
                if self.path == "/health":
                    return self._answer({})
                if self.path == "/server_info":
                    return self._answer({"tp_size": 1, "enable_deterministic_inference": True})
                self.send_error(404)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.handle_error = lambda *a: None  # a client that gave up on a hung answer: a broken pipe here
        self.url = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def generate(self, body: dict) -> tuple[object, int]:
        """The answer to a generate request, and how many samples it holds."""
        raise NotImplementedError

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def hang(self) -> None:
        self.awake.clear()

    def resume(self) -> None:
        self.awake.set()


class FakeSGLang(FakeServer):
    """SGLang's `/generate`: a batch of prompts, one sampling-params dict (and seed) each."""

    generate_path = "/generate"

    def generate(self, body: dict) -> tuple[list, int]:
        out = []
        for prompt, sampling in zip(body["input_ids"], body["sampling_params"]):
            ids = _ids(prompt, sampling.get("sampling_seed"), sampling["max_new_tokens"])
            out.append({"output_ids": ids, "meta_info": {
                "output_token_logprobs": [[-0.1 * k, t] for k, t in enumerate(ids)],
                "finish_reason": {"type": "length"}}})
        return out, len(out)


class FakeVLLM(FakeServer):
    """vLLM's tokens endpoint (`--enable-scale-out`): one sample per request."""

    generate_path = "/inference/v1/generate"

    def generate(self, body: dict) -> tuple[dict, int]:
        sampling = body["sampling_params"]
        ids = _ids(body["token_ids"], sampling.get("seed"), sampling["max_tokens"])
        content = [{"token_id": t, "logprob": -0.1 * k} for k, t in enumerate(ids)]
        return {"choices": [{"token_ids": ids, "logprobs": {"content": content}, "finish_reason": "length"}]}, 1
