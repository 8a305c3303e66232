"""Errors of the checkpoint converter (one base class, so callers can catch them together)."""

from __future__ import annotations

from changecap_jax.errors import UserError


class ConversionError(UserError, RuntimeError):
    """A checkpoint that cannot be converted for the given config."""


class TorchUnavailableError(ConversionError, ImportError):
    """PyTorch, an optional dependency, is not installed."""


class CheckpointFormatError(ConversionError):
    """The file is unreadable, truncated, or not the expected kind of torch file."""


class WrongModelError(ConversionError):
    """The snapshot is of another model or decoder variant than the config builds."""


class KeyMismatchError(ConversionError):
    """Missing, unexpected or mis-shaped keys; ``problems`` lists one line per key."""

    def __init__(self, message: str, problems: list[str]):
        super().__init__(message)
        self.problems = problems
