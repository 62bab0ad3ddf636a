"""`megarl-serve-rm`: serve an HF reward model (`hf_rm`) over HTTP, the model loaded once and kept resident.

    megarl-serve-rm --reward-model DIR [--host 127.0.0.1] [--port 8000] [--batch-size 16] [--normalize]
    megarl-serve-rm --judge-checkpoint DIR [--host ...] [--port ...]     # an LLM judge, OpenAI-compatible

POST JSON `{"prompt", "response", "label"}` -> `{"score": s}`; `{"rows": [{...}, ...]}` -> `{"scores": [...]}`
(what `remote_rm` and `hf_rm` send; a prompt may be text or a list of chat messages; the label is not used).
GET any path -> `{"model": DIR}`, for a health check. A malformed request gets HTTP 400 with the reason. Requests
are scored one at a time (one model, one lock); `--port 0` takes a free port, and the first line on stdout says
which: `megarl-serve-rm: listening on http://HOST:PORT/`. Stops on SIGTERM or Ctrl-C.

With `--judge-checkpoint DIR` (a Llama/Qwen2 causal LM) it serves the subset of OpenAI's chat-completions API
that `llm_judge` uses instead: POST `/v1/chat/completions` with `messages` (rendered through the checkpoint's chat
template when it has one, else their contents joined), `max_tokens` and `temperature` (0 = greedy), answered by
megarl's built-in engine as `{"choices": [{"message": {"role": "assistant", "content": ...}}]}`.
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
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--reward-model", help="HF sequence-classification checkpoint directory (1 label)")
    which.add_argument("--judge-checkpoint", help="HF causal LM to serve as an OpenAI-compatible judge instead")
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


class Judge:
    """A causal LM on the built-in engine answering chat completions (see the module docstring)."""

    def __init__(self, path: str, device: str = "cpu"):
        from transformers import AutoTokenizer

        from megarl.rollout.builtin import BuiltinEngine

        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.engine = BuiltinEngine.from_pretrained(path, device=device)
        self.calls = 0

    def complete(self, body) -> dict:
        from megarl.rollout import SamplingParams

        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
            raise ValueError("expected 'messages': a list of {role, content} objects")
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        else:
            ids = self.tokenizer("".join(str(m["content"]) for m in messages), add_special_tokens=False)["input_ids"]
        eos = self.tokenizer.eos_token_id
        params = SamplingParams(n=1, temperature=float(body.get("temperature", 0.0) or 0.0),
                                max_new_tokens=max(1, int(body.get("max_tokens", 32))),
                                stop_token_ids=(eos,) if eos is not None else (), seed=self.calls)
        self.calls += 1
        out = self.engine.generate([ids], params)[0][0]
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return {"object": "chat.completion", "choices": [{"index": 0, "finish_reason": str(out.finish_reason),
                                                          "message": {"role": "assistant", "content": text}}]}


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

        def do_GET(self):
            self._send(200, {"model": model.path})

        def do_POST(self):
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if isinstance(model, Judge):
                    if not self.path.rstrip("/").endswith("/chat/completions"):
                        raise ValueError(f"{self.path}: this judge serves POST /v1/chat/completions")
                else:
                    rows, batched = _rows(body)
            except (ValueError, json.JSONDecodeError) as e:
                self._send(400, {"error": str(e)})
                return
            try:
                with lock:
                    reply = model.complete(body) if isinstance(model, Judge) else None
                    scores = None if reply is not None else model.score(rows)
            except ValueError as e:
                self._send(400, {"error": str(e)})
                return
            except Exception as e:  # noqa: BLE001 - the client gets the reason, the server goes on
                self._send(500, {"error": f"{type(e).__name__}: {e}"})
                return
            if reply is not None:
                self._send(200, reply)
            else:
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
    from megarl.reward.hf_scorer import HFRewardModel

    try:
        if args.judge_checkpoint:
            model = Judge(args.judge_checkpoint, device=args.device)
        else:
            model = HFRewardModel(args.reward_model, batch_size=args.batch_size, normalize=args.normalize,
                                  device=args.device)
    except (ValueError, OSError) as e:
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
