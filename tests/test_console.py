"""The console off a terminal: progress bars become plain log lines."""

from __future__ import annotations

import logging

from changecap_jax import console


def test_stacked_bars_off_a_terminal_log_no_cursor_codes(monkeypatch, caplog):
    # A training bar with an evaluation bar open below it, as the training loop has: tqdm moves
    # the cursor between them with ESC [ A, which a log file would show as a line of its own.
    monkeypatch.setattr(console, "is_terminal", lambda: False)
    monkeypatch.setattr(console, "LOG_PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="changecap_jax.progress"):
        with console.Progress(total=3, desc="train") as outer:
            for _ in range(3):
                with console.Progress(total=2, desc="eval", leave=False) as inner:
                    inner.update(2)
                outer.update(1)
    lines = [r.getMessage() for r in caplog.records if r.name == "changecap_jax.progress"]
    assert any(line.startswith("eval: 2/2") for line in lines), lines
    assert any(line.startswith("train: 3/3") for line in lines), lines
    assert not [line for line in lines if "\x1b" in line or not line.strip()], lines
