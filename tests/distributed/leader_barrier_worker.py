"""Under torchrun, 2 CPU processes over gloo, each a data-parallel leader of a disaggregated run sharing one stub
SGLang server. Rank 0 pushes the weights; the stub is slow to confirm the push (`/end_weight_update` takes
END_S seconds) and only then serves the new weights, whose version it returns as the generated token. Rank 1
does not push: after its sync returns, what it generates must come from the new weights. Then the barrier's
errors: a leader that never arrives is named, and a pusher's failure reaches the other leader with its message."""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed as dist

from megarl.rollout.base import SamplingParams
from megarl.rollout.sglang_engine import LeaderBarrier, SGLangServers, init_weights_update_group
from megarl.rollout.weight_sync import WeightSyncError, pack_buckets

END_S = 1.5


def stub_server() -> str:
    held = {"version": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/end_weight_update":
                time.sleep(END_S)
                held["version"] += 1
            if self.path == "/generate":
                v = held["version"]
                answer = [{"output_ids": [v], "meta_info": {"finish_reason": {"type": "stop"},
                                                            "output_token_logprobs": [(-0.5, v, None)]}}
                          for _ in body["input_ids"]]
            else:
                answer = {"success": True, "message": ""}
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--no-barrier", action="store_true", help="the old behaviour, to see the race")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    box = [stub_server() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    barrier = None if args.no_barrier else LeaderBarrier.over_default_store(rank, 2, timeout_s=30)
    servers = SGLangServers([box[0]], tp_sizes=[1], push=rank == 0, barrier=barrier)
    if rank == 0:  # the weight-update group with the stub's one "TP rank" left out: a group of one
        servers.group = init_weights_update_group("gloo", "127.0.0.1", args.port, 0, 1, "megarl_weights", 30)
    dist.barrier()
    servers.load_weight_buckets(pack_buckets([("w", torch.ones(4))]), version=1)
    (completion,) = servers.generate([[1, 2]], SamplingParams(max_new_tokens=1))[0]
    print(f"rank {rank}: sync 1 returned, the server generated with weights v{completion.token_ids[0]}", flush=True)
    if args.no_barrier:
        return
    if rank == 1:  # rank 0 never arrives at version 99
        try:
            LeaderBarrier.over_default_store(1, 2, timeout_s=1.0).arrive(99)
        except WeightSyncError as e:
            print(f"rank 1: {e}", flush=True)
    servers.group = None  # rank 0's next push fails before sending anything
    try:
        servers.load_weight_buckets(pack_buckets([("w", torch.ones(4))]), version=2)
    except WeightSyncError as e:
        print(f"rank {rank} sync 2: {e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
