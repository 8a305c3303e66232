"""The errors a command ends on with one line instead of a traceback (see
:mod:`changecap_jax.cli`): the user's mistakes (exit status 2) and a diverged run (3)."""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user asked for: a flag or config field, a path that is not
    there, a dataset or model that is missing or does not fit, an unreadable input. Its
    message says what and names the thing; the command line prints it as one line and exits
    with status 2 (the traceback only with ``--verbose``). Other exceptions are bugs."""

    exit_status = 2


class TrainingDivergedError(FloatingPointError):
    """A training update gave a non-finite loss, gradient or parameter. The run stops before
    saving it (its checkpoints hold finite states only); the message names the step and the
    last checkpoint kept. Exit status 3, apart from the user's errors: the config may be
    right and the run unlucky (a learning rate too high for this seed, bad data)."""

    exit_status = 3


class WorkdirBusyError(UserError):
    """Another live run holds the workdir's lock (``changecap_jax.io.workdir_lock``)."""
