"""`megarl-verify`: score responses with the verifiers from the command line (placeholder until issue #3)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Say that the command is not implemented yet; exit status 2 so that scripts cannot mistake it for a run."""
    print("megarl-verify: not implemented yet (see issue #3)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
