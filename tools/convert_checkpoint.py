"""The old spelling of `megarl-convert-checkpoint` (`python -m megarl.cli.convert_checkpoint`): it says so on stderr,
then runs that command with the same arguments. Removed in megarl 0.3: run `megarl-convert-checkpoint`."""

import os
import sys

if __name__ == "__main__":
    if os.environ.get("RANK", "0") == "0":  # once, not once per torchrun process
        print("note: tools/convert_checkpoint.py is now megarl-convert-checkpoint "
              "(python -m megarl.cli.convert_checkpoint); running it", file=sys.stderr)
    from megarl.cli.convert_checkpoint import main
    sys.exit(main())
