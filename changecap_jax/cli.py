"""The runner of every ``python -m`` command: a user error is one line and exit status 2.

Each entry point ends with ``cli.run(main)`` in place of ``absl.app.run(main)``. A user error
ends the command with ``error: <message>`` on one line of stderr and exit status 2:

* :class:`~changecap_jax.errors.UserError` and the package's error classes derived from it
  (datasets, export, predict, report, the converter, ...);
* a bad flag or ``--config.FIELD`` override, an unknown preset, a config file that does not
  load, ``app.UsageError``;
* a missing file or directory, or one that cannot be used (``FileNotFoundError`` and its
  kin: their message names the path);
* ``sys.exit("error: ...")``: a message the command already made for the user.

A diverged training run (:class:`~changecap_jax.errors.TrainingDivergedError`: a non-finite
update, stopped before it was saved) also ends on one ``error:`` line, with exit status 3.

``--verbose`` (or ``--debug``) prints the traceback before that line. Any other exception is
a bug and keeps Python's traceback (exit status 1).
"""

from __future__ import annotations

import functools
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from absl import app, flags

from changecap_jax import console, cpu
from changecap_jax.cpu import allocator, platforms
from changecap_jax.errors import TrainingDivergedError, UserError

EXIT_USER_ERROR = UserError.exit_status

flags.DEFINE_bool("verbose", False, "On a user error (bad flag, missing file, ...), print its "
                  "traceback before the one-line message; also log the whole config and the "
                  "libraries' INFO lines.")
flags.DEFINE_alias("debug", "verbose")

# Raised on a user's input by code this package does not own (absl, Python's file system
# calls); the message names the flag or the path.
FOREIGN_USER_ERRORS: tuple[type[BaseException], ...] = (
    app.UsageError, flags.Error, FileNotFoundError, NotADirectoryError, IsADirectoryError,
    FileExistsError, PermissionError)


class FlagError(UserError):
    """A flag or ``--config.FIELD`` override that cannot be parsed."""


class UsageError(UserError):
    """``app.UsageError`` raised by a command's main (app.run would print the whole module
    docstring and flag list for it)."""


def is_user_error(error: BaseException) -> bool:
    """Whether ``error`` is the user's to fix (module docstring), not a bug."""
    return isinstance(error, (UserError, *FOREIGN_USER_ERRORS))


def exit_status(error: BaseException) -> int | None:
    """The exit status of an error that ends a command on one line, else None (a bug)."""
    if isinstance(error, TrainingDivergedError):
        return TrainingDivergedError.exit_status
    return EXIT_USER_ERROR if is_user_error(error) else None


def one_line(text: str) -> str:
    """``text`` on one line: its lines joined with "; " (a space after a line ending in ":")."""
    out = ""
    for line in (s.strip() for s in text.splitlines()):
        if line:
            out += ("" if not out else " " if out.endswith(":") else "; ") + line
    return out


def describe(error: BaseException) -> str:
    """The one-line message of a user error."""
    # str() of a KeyError is the repr of its message (quotes, and \n for a newline).
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    text = one_line(text) or type(error).__name__
    if isinstance(error, (UsageError, app.UsageError)):
        text += " (--help lists the flags)"
    return text


def _flag_message(text: str) -> str:
    """absl's message for a flag that does not parse, on one line."""
    if "Traceback (most recent call last)" in text:
        # ml_collections puts the traceback of the config file's get_config() (e.g. an unknown
        # preset) into the message: its first line names the flag, its last the reason.
        lines = [s.strip() for s in text.splitlines() if s.strip()]
        head = lines[0].replace(" Error whilst parsing config file:", "")
        reason = re.sub(r"^[\w.]+(Error|Exception): ", "", lines[-1])
        return f"{head} {reason}"
    # A required flag: "flag --out=None: Flag --out must have a value other than None."
    text = re.sub(r"flag --(\w+)=None: Flag --\1 must have a value other than None\.",
                  r"--\1 is required", text)
    return one_line(text)


def _unknown_field(error: AttributeError | KeyError, argv: Sequence[str]) -> str | None:
    """The message for ``--config.FIELD=...`` naming a field the config lacks (ml_collections
    raises a KeyError wrapped in an AttributeError, its hint after a newline), or None when
    no override on ``argv`` names the field (then it is not the user's)."""
    inner = error.args[0] if error.args and isinstance(error.args[0], BaseException) else error
    text = str(inner.args[0]) if isinstance(inner, KeyError) and inner.args else str(inner)
    first, _, hint = text.partition("\n")
    field = first.strip().strip("'\"")
    for arg in argv[1:]:
        name = arg.lstrip("-").partition("=")[0]
        parts = name.split(".")
        if arg.startswith("--") and len(parts) > 1 and field in parts[1:]:
            suggestion = re.search(r'Did you mean "([^"]+)"', hint)
            return (f"--{name}: the config has no field {field!r}"
                    + (f"; did you mean {suggestion.group(1)!r}?" if suggestion else ""))
    return None


def parse_flags(argv: list[str]) -> list[str]:
    """``flags.FLAGS(argv)`` with every way a flag can be wrong raised as a one-line
    :class:`FlagError` (absl prints its own two lines and exits 1; ml_collections raises
    AttributeError for an unknown config field and defers a config file that did not load)."""
    values = flags.FLAGS
    try:
        rest = values(argv)
    except flags.Error as e:
        raise FlagError(_flag_message(str(e))) from e
    except (AttributeError, KeyError) as e:
        message = _unknown_field(e, argv)
        if message is None:
            raise
        raise FlagError(message) from e
    except OSError as e:  # --config.FIELD overrides of a config file that did not load
        raise FlagError(f"cannot load the config file: {_last_line(e.__cause__ or e)}") from e
    for name in list(values):
        flag = values[name]
        if type(flag.value).__name__ == "_ErrorConfig":
            # ml_collections keeps a config file that did not load as a value that raises on
            # first use, deep inside main: report it with the flags instead.
            cause = vars(flag.value).get("_error")
            raise FlagError(f"--{name}: cannot load {getattr(flag, 'config_filename', '?')}: "
                            f"{_last_line(cause)}") from cause
    return rest


def _last_line(error: BaseException | None) -> str:
    """The reason of ml_collections' multi-line config loading errors (their last line)."""
    lines = [s.strip() for s in str(error).splitlines() if s.strip()]
    return lines[-1] if lines else repr(error)


def _verbose(argv: Sequence[str]) -> bool:
    """Whether the command line asks for tracebacks (``--verbose``, ``--debug``)."""
    if flags.FLAGS.is_parsed():
        return bool(flags.FLAGS.verbose)
    on = False  # the flags did not parse: read argv
    for arg in argv[1:]:
        name, has_value, value = arg.partition("=")
        if name in ("--verbose", "--debug"):
            on = not has_value or value.lower() in ("1", "true", "t", "yes", "y")
        elif name in ("--noverbose", "--nodebug"):
            on = False
    return on


def _guarded(main: Callable[[list[str]], Any]) -> Callable[[list[str]], Any]:
    @functools.wraps(main)
    def guarded(argv: list[str]) -> Any:
        console.setup(verbose=flags.FLAGS.verbose)
        try:
            return main(argv)
        except app.UsageError as e:  # app.run would print every flag's help for it
            raise UsageError(str(e)) from e

    return guarded


def run(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None) -> NoReturn:
    """``absl.app.run(main)`` with user errors as one line and exit status 2 (see the module
    docstring); ``argv`` defaults to ``sys.argv``."""
    argv = list(sys.argv if argv is None else argv)
    # Before JAX starts: no accelerator here, no accelerator plugins' start-up noise.
    platforms.default_to_cpu()
    allocator.restart_with_chosen_allocator()  # a setting the process must start with
    cpu.enable()  # the compile-time CPU tunings; each is off on accelerators
    try:
        app.run(_guarded(main), argv=argv, flags_parser=parse_flags)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        # sys.exit("error: ..."): the command's own one-line message for the user.
        if _verbose(argv) and e.__context__ is not None:
            traceback.print_exception(e.__context__)
        print(one_line(e.code), file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except Exception as e:
        status = exit_status(e)
        if status is None:
            raise
        if _verbose(argv):
            traceback.print_exc()
        print(f"error: {describe(e)}", file=sys.stderr)
        sys.exit(status)
    sys.exit(0)  # app.run always exits; this keeps NoReturn honest
