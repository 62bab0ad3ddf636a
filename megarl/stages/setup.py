"""Moved: a run's construction, checkpoints and end are `megarl.trainer` (`build`, `checkpoints`, `log`). This
module keeps the old names importable for old imports and is removed in megarl 0.3. They are looked up on use, so
that the stages do not import the trainer (which imports them)."""

_MOVED = {"Checked": "build", "Models": "build", "TrainingRun": "build", "build_models": "build",
          "check_before_start": "build", "close": "build", "launch_engine_first": "build", "optim_config": "build",
          "start": "build", "save": "checkpoints", "_resume": "checkpoints", "open_log": "log"}


def __getattr__(name: str):
    if name in _MOVED:
        import importlib

        module = importlib.import_module(f"megarl.trainer.{_MOVED[name]}")
        return getattr(module, "resume" if name == "_resume" else name)
    raise AttributeError(f"module 'megarl.stages.setup' has no attribute {name!r}")
