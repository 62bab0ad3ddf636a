"""`megarl-serve-rm`: serve an HF reward model (`hf_rm`) over HTTP, the model loaded once and kept resident.

    megarl-serve-rm --reward-model DIR [--host 127.0.0.1] [--port 8000] [--batch-size 16] [--normalize]

POST JSON `{"prompt", "response", "label"}` -> `{"score": s}`; `{"rows": [{...}, ...]}` -> `{"scores": [...]}`
(what `remote_rm` and `hf_rm` send; a prompt may be text or a list of chat messages; the label is not used).
GET any path -> `{"model": DIR}`, for a health check. A malformed request gets HTTP 400 with the reason. Requests
are scored one at a time (one model, one lock); `--port 0` takes a free port, and the first line on stdout says
which: `megarl-serve-rm: listening on http://HOST:PORT/`. Stops on SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megarl-serve-rm", description=__doc__.split("\n\n")[0])
    p.add_argument("--reward-model", required=True, help="HF sequence-classification checkpoint directory (1 label)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 = a free one (printed at start)")
    p.add_argument("--batch-size", type=int, default=16, help="rows per forward pass")
    p.add_argument("--normalize", action="store_true", help="(score - reward_mean) / reward_std from config.json")
    p.add_argument("--device", default="cpu", help="torch device of the model (cpu, cuda, cuda:1 ...)")
    p.add_argument("--exit-with-parent", action="store_true", help="exit when the process that started this one "
                   "does (how a trainer's own reward server never outlives it, even killed with SIGKILL)")
    return p


def _rows(body) -> tuple[list[tuple], bool]:
    """(rows, batched) from a request body; ValueError naming what is wrong."""
    batched = isinstance(body, dict) and "rows" in body
    items = body["rows"] if batched else [body]
    if not isinstance(items, list):
        raise ValueError("'rows' must be a list of {prompt, response, label} objects")
    rows = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "prompt" not in item or "response" not in item:
            raise ValueError(f"row {i}: expected an object with 'prompt' and 'response'")
        if not isinstance(item["response"], str) or not isinstance(item["prompt"], (str, list)):
            raise ValueError(f"row {i}: 'response' must be text and 'prompt' text or a list of chat messages")
        rows.append((item["prompt"], item["response"], item.get("label")))
    return rows, batched


def make_server(model, host: str, port: int) -> ThreadingHTTPServer:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - the http.server API
            self._send(200, {"model": model.path})

        def do_POST(self):  # noqa: N802
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                rows, batched = _rows(body)
            except (ValueError, json.JSONDecodeError) as e:
                self._send(400, {"error": str(e)})
                return
            try:
                with lock:
                    scores = model.score(rows)
            except Exception as e:  # noqa: BLE001 - the client gets the reason, the server goes on
                self._send(500, {"error": f"{type(e).__name__}: {e}"})
                return
            self._send(200, {"scores": scores} if batched else {"score": scores[0]})

        def log_message(self, *args):  # one line per request is noise at training rates
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch_size < 1:
        print("megarl-serve-rm: error: --batch-size must be >= 1", file=sys.stderr)
        return 2
    from megarl.reward_model import HFRewardModel

    try:
        model = HFRewardModel(args.reward_model, batch_size=args.batch_size, normalize=args.normalize,
                              device=args.device)
    except ValueError as e:
        print(f"megarl-serve-rm: error: {e}", file=sys.stderr)
        return 2
    server = make_server(model, args.host, args.port)
    if args.exit_with_parent:
        threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    host, port = server.server_address[:2]
    print(f"megarl-serve-rm: listening on http://{host}:{port}/", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
