"""Errors shared across megarl's layers. A leaf: imports nothing of megarl, so any module may raise them."""


class ConfigError(ValueError):
    """A bad recipe, flag or value; the message names it (the flag, where it came from, the allowed values)."""
