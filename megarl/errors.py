"""Errors shared across megarl's layers. A leaf: imports nothing of megarl, so any module may raise them."""


class ConfigError(ValueError):
    """A bad recipe, flag or value; the message names it (the flag, where it came from, the allowed values)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved (a full disk, an unwritable directory): the message names the path and the
    cause, and says which earlier checkpoint is intact. Raised on every rank alike."""
