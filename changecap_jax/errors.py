"""The base class of the errors a user causes and can fix (see :mod:`changecap_jax.cli`)."""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user asked for: a flag or config field, a path that is not
    there, a dataset or model that is missing or does not fit, an unreadable input. Its
    message says what and names the thing; the command line prints it as one line and exits
    with status 2 (the traceback only with ``--verbose``). Other exceptions are bugs."""
