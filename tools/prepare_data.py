"""The old spelling of `megarl-prepare-data` (`python -m megarl.cli.prepare_data`): it says so on stderr,
then runs that command with the same arguments. Removed in megarl 0.3: run `megarl-prepare-data`."""

import sys

if __name__ == "__main__":
    print("note: tools/prepare_data.py is now megarl-prepare-data (python -m megarl.cli.prepare_data); running it",
          file=sys.stderr)
    from megarl.cli.prepare_data import main
    sys.exit(main())
