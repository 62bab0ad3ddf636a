"""Under torchrun, 2 CPU processes over gloo: `megarl.trainer.checkpoints.agreed_resume` given what each rank's
preflight found under --load (`--seen` holds one path a rank, "" for none). Each rank writes `--out`/rank<R>.json:
the path it resumes from, or the error it stops with."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist

from megarl.errors import ConfigError
from megarl.trainer.checkpoints import agreed_resume


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--load", required=True)
    ap.add_argument("--seen", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mine = args.seen[rank]
    try:
        out = {"path": str(agreed_resume(args.load, Path(mine) if mine else None))}
    except ConfigError as e:
        out = {"error": str(e)}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"rank": rank, **out}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
