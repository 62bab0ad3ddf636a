"""Moved: a run's construction, checkpoints and end are `megarl.trainer` (`build`, `checkpoints`, `log`). This
module re-exports the old names for old imports and is removed in megarl 0.3."""

from megarl.trainer.build import (Checked, Models, TrainingRun, build_models, check_before_start, close,
                                  launch_engine_first, optim_config, start)
from megarl.trainer.checkpoints import resume as _resume
from megarl.trainer.checkpoints import save
from megarl.trainer.log import open_log

__all__ = ["Checked", "Models", "TrainingRun", "build_models", "check_before_start", "close", "launch_engine_first",
           "open_log", "optim_config", "save", "start", "_resume"]
