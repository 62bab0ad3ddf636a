"""The old home of the planner, kept so that `from megarl.plan import ...` still works: the library is now
`megarl.planner` (the command, `megarl-plan`, is `megarl.cli.plan`). Removed in megarl 0.3: import
`megarl.planner` instead."""

from megarl.planner import *  # noqa: F403 - the planner's public names, unchanged
