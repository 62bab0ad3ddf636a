"""`python -m megarl.cli.serve_tokens`: an HF checkpoint in megarl's built-in engine, served as a token endpoint.

    python -m megarl.cli.serve_tokens --hf-checkpoint DIR [--host 127.0.0.1] [--port 8000] [--max-tokens 512]
                                      [--batch-window 0.02] [--model-name megarl] [--request-timeout 600]

`POST /inference/v1/generate`, `POST /inference/v1/abort` and `GET /v1/models` as `megarl.rollout.token_server`
says: token ids in, the engine's sampled ids and log-probs out, concurrent requests batched. What a program that
samples from a policy by token ids (verifiers' training client, `TrainClientConfig(base_url=http://HOST:PORT/v1)`)
talks to outside a training run; inside one, `--rollout-function verifiers` starts the same server over the run's
engine. `--port 0` takes a free port, and the first line on stdout says which:
`megarl.cli.serve_tokens: listening on http://HOST:PORT/`. Stops on SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megarl.cli.serve_tokens", description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-checkpoint", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 = a free one (printed at start)")
    p.add_argument("--max-tokens", type=int, default=512, help="most new tokens a request may ask for")
    p.add_argument("--batch-window", type=float, default=0.02, help="seconds to wait for more requests to batch")
    p.add_argument("--model-name", default="megarl", help="the model id /v1/models lists and requests name")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may wait (then 504)")
    p.add_argument("--device", default="cpu", help="torch device of the engine (cpu, cuda, cuda:1 ...)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from megarl.errors import ConfigError
    from megarl.rollout.builtin import BuiltinEngine
    from megarl.rollout.token_server import TokenServer

    config = Path(args.hf_checkpoint) / "config.json"
    if not config.is_file():
        raise ConfigError(f"--hf-checkpoint {args.hf_checkpoint}: no config.json there")
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    hf = json.loads(config.read_text())
    engine = BuiltinEngine.from_pretrained(args.hf_checkpoint, device=args.device)
    server = TokenServer(engine, vocab_size=int(hf["vocab_size"]), max_tokens_cap=args.max_tokens,
                         model_name=args.model_name, host=args.host, port=args.port,
                         batch_window=args.batch_window, request_timeout=args.request_timeout,
                         max_model_len=hf.get("max_position_embeddings"))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"megarl.cli.serve_tokens: listening on {server.url}/", flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


if __name__ == "__main__":
    main()
