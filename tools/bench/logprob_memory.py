"""Peak memory and time of log-probs plus entropy, forward and backward, today's full-logits head against the
chunked one (`--logprob-chunk-tokens`, `megarl/mcore/chunked_logprobs.py`), side by side.

    python tools/bench/logprob_memory.py                       # vocab 151936, hidden 64, 4k/16k/32k tokens, TP 1/2
    python tools/bench/logprob_memory.py --tokens 2048 --tp 1  # one point
    python tools/bench/logprob_memory.py --tokens 4096 --tp 2 --repeat 3 --clock cpu  # a timed point, shared machine

Each point (a fresh subprocess when it runs for real): hidden states [tokens, h] and one TP rank's output-weight
shard [v/tp, h] (fp32), then log p(label) and the entropy at temperature 0.7, and the backward pass of a loss that
uses both, as a training step with an entropy bonus runs it. Full: logits = hidden @ W.T, then
`actor.label_logprobs` and `actor.position_entropy`; chunked: `chunked_logprobs(chunk_tokens=--chunk)`.

Peak memory is measured by tracking every tensor storage that the point's aten operations allocate and free (a
TorchDispatchMode; the peak of live bytes, as `torch.cuda.max_memory_allocated` counts on a GPU), less what existed
before (the inputs): the *extra peak*. Points whose full path would not fit in `--real-limit-gib` of this machine's
memory run on the meta device (shapes only: the same operations and tensors, no data), so they have memory but no
time; real points also report the rise of the process's peak RSS as a check. `--repeat N` runs each real point N
times, the two paths interleaved (full, chunked, full, ...) so that a change in the machine's load falls on both,
and reports the median time (memory is the same every time: the first run's). `--clock cpu` times the process's
CPU seconds instead of wall-clock ones: the point runs on one thread, so on a machine shared with other jobs its CPU
time is its work, where its wall time is mostly waiting for a core. TP 2 is one rank: its vocabulary
shard, with the all-reduces over the TP group (tensors of [tokens], the same in both paths) skipped, so one process
measures it.

Beside each point: the floor (hidden states + weight shard + one chunk of fp32 logits) and the planner's prediction
(`megarl.planner.logprob_head_bytes`) with its error. The last line compares the two paths at 16k tokens, TP 1.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

MiB = 2**20
TEMPERATURE = 0.7


def _tracker():
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class PeakTracker(TorchDispatchMode):
        """Live bytes of the storages that operations under it return, and their peak."""

        def __init__(self):
            super().__init__()
            self.live: dict[int, tuple[StorageWeakRef, int]] = {}
            self.now = self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for key, (ref, nbytes) in list(self.live.items()):
                if ref.expired():
                    del self.live[key]
                    self.now -= nbytes
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    ref = StorageWeakRef(t.untyped_storage())
                    if ref.cdata not in self.live:
                        nbytes = t.untyped_storage().nbytes()
                        self.live[ref.cdata] = (ref, nbytes)
                        self.now += nbytes
            self.peak = max(self.peak, self.now)
            return out

    return PeakTracker()


def measure(path: str, tokens: int, tp: int, vocab: int, hidden: int, chunk: int, device: str) -> dict:
    """One point: the extra peak (bytes), the rise of peak RSS and the seconds (None on the meta device). Needs
    Megatron's model-parallel state with one TP rank, and its all-reduces skipped (`run_point` arranges both)."""
    import torch

    from megarl.mcore.actor import label_logprobs, position_entropy
    from megarl.mcore.chunked_logprobs import chunked_logprobs

    g = torch.Generator().manual_seed(0)
    local = vocab // tp
    make = (lambda *shape: torch.empty(*shape, device="meta")) if device == "meta" else \
        (lambda *shape: torch.randn(*shape, generator=g))
    h = make(tokens, hidden).requires_grad_()
    w = (make(local, hidden) * 0.05).detach().requires_grad_()
    labels = torch.randint(0, local, (tokens,), generator=g).to(device)
    a, b = make(tokens), make(tokens)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracker = _tracker()
    start, cpu_start = time.perf_counter(), time.process_time()
    with tracker:
        if path == "full":
            logits = h @ w.t()
            logp = label_logprobs(logits, labels, TEMPERATURE)
            ent = position_entropy(logits, TEMPERATURE)
            del logits
        else:
            logp, ent = chunked_logprobs(h, w, labels, temperature=TEMPERATURE, chunk_tokens=chunk, with_entropy=True)
        ((logp * a).sum() + (ent * b).sum()).backward()
        del logp, ent
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    return {"extra": tracker.peak, "seconds": seconds if device != "meta" else None,
            "cpu_seconds": cpu_seconds if device != "meta" else None, "rss": rss if device != "meta" else None}


def one_rank() -> None:
    """One rank's process group and model-parallel state, all-reduces skipped (one rank of TP `tp`, see the module
    docstring)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megarl.mcore import cpu_compat

    torch.set_num_threads(1)
    cpu_compat.install()
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    dist.all_reduce = lambda *args, **kwargs: None


def _point(args, path: str, tokens: int, tp: int, device: str) -> dict:
    if device == "meta":  # no memory, no time: in this process (`one_rank` done)
        return measure(path, tokens, tp, args.vocab, args.hidden, args.chunk, device)
    cmd = [sys.executable, __file__, "--point", path, "--tokens", str(tokens), "--tp", str(tp), "--vocab",
           str(args.vocab), "--hidden", str(args.hidden), "--chunk", str(args.chunk), "--device", device]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--vocab", type=int, default=151936, help="Qwen's vocabulary")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--chunk", type=int, default=1024, help="--logprob-chunk-tokens")
    p.add_argument("--real-limit-gib", type=float, default=6.0,
                   help="points whose full path the planner puts above this run on the meta device (no time)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each real point, the paths interleaved; the time reported is the median")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="the time reported: wall-clock seconds, or the process's CPU seconds (one thread; for a "
                        "shared machine)")
    p.add_argument("--point", choices=("full", "chunked"), help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    args = p.parse_args()
    one_rank()
    if args.point:
        print(json.dumps(measure(args.point, args.tokens[0], args.tp[0], args.vocab, args.hidden, args.chunk,
                                 args.device)))
        return
    from megarl.planner import logprob_head_bytes

    print(f"vocab {args.vocab}, hidden {args.hidden}, fp32, chunk {args.chunk} tokens; extra peak = measured live "
          "tensor bytes above the inputs; meta = shapes only (no time)")
    print(f"{'tokens':>6} {'TP':>2} {'path':>7} {'device':>6} {'extra MiB':>10} {'RSS rise':>9} {'floor MiB':>9} "
          f"{'planner':>8} {'err %':>6} {'time s':>7}")
    results, worst = {}, 0.0
    for tp in args.tp:
        for tokens in args.tokens:
            local = args.vocab // tp
            floor = 4 * (tokens * args.hidden + local * args.hidden + min(args.chunk, tokens) * local)
            full_predicted = logprob_head_bytes(tokens, args.vocab, args.hidden, tp=tp, chunk_tokens=0)
            device = "cpu" if full_predicted <= args.real_limit_gib * 2**30 else "meta"
            runs = {"full": [], "chunked": []}
            for _ in range(args.repeat if device != "meta" else 1):
                for path in runs:
                    runs[path].append(_point(args, path, tokens, tp, device))
            for path, rs in runs.items():
                clock = "seconds" if args.clock == "wall" else "cpu_seconds"
                r = {**rs[0], "seconds": statistics.median(x[clock] for x in rs) if device != "meta" else None}
                predicted = logprob_head_bytes(tokens, args.vocab, args.hidden, tp=tp,
                                               chunk_tokens=0 if path == "full" else args.chunk)
                err = 100 * abs(predicted - r["extra"]) / r["extra"]
                worst = max(worst, err)
                results[(tokens, tp, path)] = r
                rss = f"{r['rss'] / MiB:9.0f}" if r["rss"] is not None else f"{'-':>9}"
                secs = f"{r['seconds']:7.2f}" if r["seconds"] is not None else f"{'-':>7}"
                print(f"{tokens:>6} {tp:>2} {path:>7} {device:>6} {r['extra'] / MiB:10.0f} {rss} "
                      f"{floor / MiB:9.0f} {predicted / MiB:8.0f} {err:6.1f} {secs}", flush=True)
                if len(rs) > 1:
                    times = ", ".join(f"{x[clock]:.2f}" for x in rs)
                    wall = ", ".join(f"{x['seconds']:.2f}" for x in rs)
                    print(f"{'':>15} {path} {args.clock} s: {times} (median above); wall s: {wall}")
    timed = [k for k in results if k[2] == "full" and results[k]["seconds"] is not None
             and (k[0], k[1], "chunked") in results]
    key = (16384, 1)
    if (*key, "full") not in results:
        key = max(results)[:2]
    full, chunked = results[(*key, "full")], results[(*key, "chunked")]
    if timed:
        t_key = max(timed, key=lambda k: (k[1] == key[1], k[0]))
        ratio = results[(t_key[0], t_key[1], "chunked")]["seconds"] / results[t_key]["seconds"]
        print(f"time (chunked / full) measured at {t_key[0]} tokens, TP {t_key[1]}, the largest real point, "
              f"median of {args.repeat} interleaved run(s), {args.clock} clock (label the machine's load: `uptime`)")
    else:
        ratio = float("nan")
        print("time: no point ran for real on both paths (raise --real-limit-gib)")
    print(f"logprob memory at {key[0] // 1024}k tokens, vocab {args.vocab}, TP {key[1]}: chunked "
          f"{chunked['extra'] / MiB:.0f} MiB vs full {full['extra'] / MiB:.0f} MiB extra peak "
          f"({full['extra'] / chunked['extra']:.1f}x less); time {ratio:.2f}x; planner within {worst:.0f} %")


if __name__ == "__main__":
    main()
