"""The old spelling of `megarl-train-reward-model` (`python -m megarl.cli.train_reward_model`): it says so on stderr,
then runs that command with the same arguments. Removed in megarl 0.3: run `megarl-train-reward-model`."""

import sys

if __name__ == "__main__":
    print("note: tools/train_reward_model.py is now megarl-train-reward-model "
          "(python -m megarl.cli.train_reward_model); running it", file=sys.stderr)
    from megarl.cli.train_reward_model import main
    sys.exit(main())
