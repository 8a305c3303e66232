"""The command lines as a user meets them (changecap_jax.cli, changecap_jax.console): a user
error is one line on stderr and exit status 2, a bug keeps its traceback; log lines are not
glued to a progress bar, the training ETA ignores stalls, SPICE's note comes once, and a run
ends with a line naming its outputs.

Each case of the first test is one subprocess that fails before any dataset build or compile.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from absl import flags
from tqdm import tqdm

from changecap_jax import cli, console
from changecap_jax.cpu import allocator
from changecap_jax.errors import UserError
from changecap_jax.evaluators import captions as ev
from changecap_jax.evaluators import results

REPO = Path(__file__).resolve().parents[1]
MAIN = ["changecap_jax.main", "--config=configs/dirl.py"]

# (command and flags, what the one line must name); {tmp} is the test's folder, where nothing
# of the named paths exists.
CASES = {
    "unknown config field": ([*MAIN, "--config.batchsize=1", "--workdir={tmp}/w"],
                             ["--config.batchsize", "'batch_size'"]),
    "unknown preset": (["changecap_jax.main", "--config=configs/dirl.py:nope"],
                       ["'nope'", "synthetic_extreme"]),
    "bad flag value": ([*MAIN, "--mode=foo"], ["--mode=foo", "train|eval"]),
    "missing config file": (["changecap_jax.main", "--config={tmp}/nope.py"], ["{tmp}/nope.py"]),
    "missing data_dir": ([*MAIN, "--config.dataset.data_dir={tmp}/data",
                          "--config.dataset.build_if_missing=False", "--workdir={tmp}/w"],
                         ["{tmp}/data"]),
    "unknown dataset variant": ([*MAIN, "--config.dataset.data_dir={tmp}",
                                 "--config.dataset.variant=nope", "--workdir={tmp}/w"],
                                ["variant 'nope'"]),
    "eval of a missing model": (["changecap_jax.main", "--mode=eval", "--model={tmp}/model",
                                 "--workdir={tmp}/w"], ["{tmp}/model"]),
    "eval without checkpoints": ([*MAIN, "--mode=eval", "--workdir={tmp}/w"],
                                 ["{tmp}/w/checkpoints"]),
    "export of a missing workdir": (["changecap_jax", "export", "--workdir={tmp}/w",
                                     "--out={tmp}/out"], ["{tmp}/w"]),
    "report of a missing workdir": (["changecap_jax", "report", "--workdir={tmp}/w"], ["{tmp}/w"]),
    "batch size 0": ([*MAIN, "--config.batch_size=0", "--workdir={tmp}/w",
                      "--config.dataset.data_dir={tmp}/data"],
                     ["config.batch_size is 0", "positive multiple of the number of devices"]),
    "config.json not JSON": (["changecap_jax", "report", "--workdir={tmp}/broken"],
                             ["{tmp}/broken/config.json is not valid JSON"]),
    "predict: not an image": (["changecap_jax", "predict", "--model={tmp}/model",
                               "--before={tmp}/text.png", "--after={tmp}/text.png"],
                              ["cannot read image {tmp}/text.png"]),
}


def _run(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", CHANGECAP_COMPILATION_CACHE="0", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", *(a.format(tmp=tmp) for a in args)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("case", list(CASES))
def test_user_error_is_one_line_and_status_2(case, tmp_path):
    args, names = CASES[case]
    (tmp_path / "text.png").write_text("not an image")
    # An evaluated run whose config.json was cut short.
    record = ev.PairCaption("0.png", "a cube moved", ["a cube moved"], "move")
    results.write_results(tmp_path / "broken", "test", 3, [record], {"CIDEr": 1.0})
    (tmp_path / "broken" / "config.json").write_text('{"model": ')
    done = _run(args, tmp_path)
    lines = _lines(done.stderr)
    assert done.returncode == cli.EXIT_USER_ERROR, done.stderr[-3000:]
    # At most the command's own log line (e.g. main's "workdir ...") before the error.
    assert 1 <= len(lines) <= 3 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith("error: ") and "\\n" not in lines[-1], lines[-1]
    for name in names:
        assert name.format(tmp=tmp_path) in lines[-1], lines[-1]


def test_verbose_shows_the_traceback(tmp_path):
    done = _run([*MAIN, "--config.batchsize=1", "--verbose"], tmp_path)
    assert done.returncode == cli.EXIT_USER_ERROR
    assert "Traceback (most recent call last)" in done.stderr
    assert _lines(done.stderr)[-1].startswith("error: --config.batchsize")


# -- in this process ------------------------------------------------------------------------


@pytest.fixture
def in_process(monkeypatch):
    """cli.run here: absl's app.run changes the root logger, JAX's level and the flags; put
    them back. The test process is not restarted under another host allocator."""
    monkeypatch.setenv(allocator.CHOICE_VARIABLE, "default")
    root, jax_logger, absl_logger = (logging.getLogger(n) for n in ("", "jax", "absl"))
    saved = (root.handlers[:], root.level, jax_logger.level, absl_logger.level)
    yield
    root.handlers, _, _, _ = saved
    root.setLevel(saved[1])
    jax_logger.setLevel(saved[2])
    absl_logger.setLevel(saved[3])
    flags.FLAGS.unparse_flags()


def test_internal_error_keeps_its_traceback(in_process):
    def main(argv: list[str]) -> None:
        raise RuntimeError("a bug")

    # Re-raised as it is (not SystemExit(2)): Python prints its traceback and exits 1.
    with pytest.raises(RuntimeError, match="a bug"):
        cli.run(main, argv=["prog"])


@pytest.mark.parametrize("error, line", [
    (UserError("dataset x is not built\nbuild it with: y"),
     "error: dataset x is not built; build it with: y"),
    (FileNotFoundError(2, "No such file or directory", "/nowhere"),
     "error: [Errno 2] No such file or directory: '/nowhere'"),
    (SystemExit("error: already a line"), "error: already a line"),
])
def test_user_error_in_process(in_process, capsys, error, line):
    handlers = []

    def main(argv: list[str]) -> None:
        handlers.extend(logging.getLogger().handlers)
        raise error

    console_handler = logging.StreamHandler(sys.stderr)
    logging.getLogger().addHandler(console_handler)  # as absl's (added by the first app.run)
    with pytest.raises(SystemExit) as exit_:
        cli.run(main, argv=["prog"])
    assert exit_.value.code == cli.EXIT_USER_ERROR
    assert capsys.readouterr().err == line + "\n"
    # The command's console handlers write through tqdm (console.setup).
    assert console_handler not in handlers
    assert any(isinstance(h, console.BarSafeHandler) and h.handler is console_handler
               for h in handlers)


# -- the console ----------------------------------------------------------------------------


def test_log_line_is_not_glued_to_an_open_bar(capsys):
    logger = logging.getLogger("test_cli_errors.bar")
    logger.propagate, logger.level = False, logging.INFO
    logger.handlers = [logging.StreamHandler(sys.stderr)]
    console.install_bar_safe_logging(logger)
    bar = tqdm(total=10, desc="train", file=sys.stderr, mininterval=0)
    bar.update(3)
    logger.info("a log line")
    bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    before, after = err.split("a log line\n")
    # The bar's line was cleared (ends in \r, not in the bar's text), then redrawn.
    assert "3/10" in before and before.endswith("\r"), repr(before[-80:])
    assert "3/10" in after and "4/10" in after


def test_training_bar_eta_ignores_compile_and_evaluation(capsys, monkeypatch):
    monkeypatch.setattr(console, "is_terminal", lambda: True)  # a bar, not log lines
    bar = console.StepBar(1000, 0, "train")
    time.sleep(0.4)  # the first step's compile
    for step in range(1, 21):
        time.sleep(0.01)
        if step == 1:
            bar.unpause()  # as the trainer: the bar starts paused until the first step is done
        bar.update(1)
        if step == 1:
            assert bar.format_dict["rate"] > 10  # not the compile's 1 / 0.4 s
        if step == 10:
            bar.pause()
            time.sleep(0.6)  # an evaluation
            bar.unpause()
    info = bar.format_dict
    bar.close()
    assert info["elapsed"] > 1.0  # the wall clock's
    # Counting the stalls a step would take (0.4 + 0.6) / 20 + 0.01 = 0.06 s: an ETA 4x too
    # long; tqdm's default moving average swings further after each stall.
    assert 1 / info["rate"] < 0.035, 1 / info["rate"]
    assert "train:" in capsys.readouterr().err


def test_spice_note_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(ev, "spice_missing_files", lambda: [Path("/nowhere/spice-1.0.jar")])
    monkeypatch.setattr(ev, "_SPICE_NOTES_LOGGED", set())
    with caplog.at_level(logging.WARNING, logger=ev.logger.name):
        for _ in range(2):  # two evaluations
            assert ev._resolve_spice("auto") is False
    notes = [r for r in caplog.records if "SPICE skipped" in r.getMessage()]
    assert len(notes) == 1 and "/nowhere/spice-1.0.jar" in notes[0].getMessage()


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_run_ends_with_its_outputs_and_the_report_command(monkeypatch, tmp_path, capsys, mode):
    from changecap_jax import main as entry
    from changecap_jax.io import run_config
    from changecap_jax.trainers import captioning

    workdir = tmp_path / "run dir"  # a space: the printed command quotes the path
    (workdir / "checkpoints" / "3").mkdir(parents=True)

    def outputs(config, *_args) -> None:  # what a run writes, without training
        run_config.save_config(workdir, config)
        record = ev.PairCaption("0.png", "a cube moved", ["a cube moved"], "move")
        results.write_results(workdir, "val", 3, [record], {"CIDEr": 1.0})

    class Trainer:
        def __init__(self, config, workdir):
            self.config = config

        def train(self) -> None:
            outputs(self.config)

    monkeypatch.setattr(captioning, "Trainer", Trainer)
    monkeypatch.setattr(captioning, "evaluate_checkpoint", outputs)
    argv = ["main", "--config=configs/dirl.py", f"--workdir={workdir}", f"--mode={mode}"]
    monkeypatch.setattr(sys, "argv", argv)  # config_flags reads its overrides from sys.argv
    monkeypatch.chdir(REPO)
    flags.FLAGS(argv)
    try:
        entry.main(["main"])
    finally:
        flags.FLAGS.unparse_flags()
    last = capsys.readouterr().out.splitlines()[-1]
    quoted = f"'{workdir}'"
    assert last == (f"done: metrics {workdir}/metrics, captions {workdir}/captions, checkpoints "
                    f"{workdir}/checkpoints; HTML report: python -m changecap_jax report "
                    f"--workdir={quoted} --split=val")


def test_off_a_terminal_a_bar_is_a_few_whole_log_lines(monkeypatch, caplog, capsys):
    monkeypatch.setattr(console, "is_terminal", lambda: False)
    with caplog.at_level(logging.INFO, logger="changecap_jax.progress"):
        bar = console.StepBar(100, 0, "train")
        bar.unpause()
        for step in range(1, 101):
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{1 / step:.3f}")  # as the loop does at every log
        bar.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "changecap_jax.progress"]
    # The start and the end: redraws wait LOG_PROGRESS_EVERY_S, a new postfix does not force one.
    assert len(lines) == 2, lines
    assert lines[0].startswith("train: 0/100 [") and lines[-1].startswith("train: 100/100 [")
    assert "loss=0.010" in lines[-1]
    assert capsys.readouterr().err == ""  # nothing written around the log lines
