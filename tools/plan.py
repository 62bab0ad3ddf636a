"""The old spelling of `megarl-plan` (`python -m megarl.cli.plan`): it says so on stderr, then runs that command
with the same arguments. Removed in megarl 0.3: run `megarl-plan`."""

import sys

if __name__ == "__main__":
    print("note: tools/plan.py is now megarl-plan (python -m megarl.cli.plan); running it", file=sys.stderr)
    from megarl.cli.plan import main
    sys.exit(main())
