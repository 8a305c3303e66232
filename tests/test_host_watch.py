"""changecap_jax/host_watch.py: the distributed service's fatal log of a lost process becomes one
line naming it; the child's other output passes through unchanged. (The four-process runs that
lose a host are tests/test_multihost.py.)"""

from __future__ import annotations

import io
import os

from changecap_jax import host_watch

# What jaxlib 0.10.2 printed (trimmed) when process 1 of 2 was killed: the coordinator's
# heartbeat check, then the fatal error and its stack dump in every other process.
LOST_PEER = b"""\
I1128 10:15:10.100000 140033055406016 metric_writer.py:46] [4] loss=5.2
E1128 10:15:17.717791   23609 coordination_service.cc:1549] [9078021432597594727] Use error \
polling to propagate the following error to all tasks: UNAVAILABLE: The following tasks are \
unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error.
E1128 10:15:17.718234   23620 coordination_service_agent.cc:289] Polled an error from \
coordination service (this can be an error from this or another task).
F1128 10:15:17.718384   23620 client.h:80] Terminating process because the JAX distributed \
service detected fatal errors. This most likely indicates that another task died
1
The tasks have crashed.
*** Check failure stack trace: ***
    @     0x7fba23240634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
    @     0x7fba2a8a71f5  (unknown)
"""
# ... and when the coordinator (process 0) was killed: its connection closes.
LOST_COORDINATOR = b"""\
W1128 10:17:32.348872   25170 preemption_sync_manager.cc:147] Failed to retrieve preemption \
notice from coordination service: UNAVAILABLE: Socket closed
E1128 10:17:32.348957   25170 coordination_service_agent.cc:289] Polled an error from \
coordination service (this can be an error from this or another task).
F1128 10:17:32.348962   25170 client.h:80] Terminating process because the JAX distributed \
service detected fatal errors. This most likely indicates that another task died
Traceback (most recent call last):
  File "worker.py", line 14, in <module>
"""


def test_the_lost_process_is_read_from_the_service_log():
    assert host_watch.lost_processes(LOST_PEER) == [1]
    assert host_watch.lost_processes(LOST_COORDINATOR) == [0]
    several = LOST_PEER.replace(b"heartbeats):\n1\n", b"heartbeats):\n1, 3\n")
    assert host_watch.lost_processes(several) == [1, 3]
    assert host_watch.lost_processes(b"E1128 coordination_service.cc:1] a warning\n") is None


def test_one_line_names_the_lost_process_and_what_to_do():
    line = host_watch.lost_line([2], 0, 4, 10)
    assert "\n" not in line
    assert line.startswith("error: lost process 2 of 4 (no heartbeat for 10 s)")
    assert "process 0 stopped too" in line and "resumes from the last checkpoint" in line
    coordinator = host_watch.lost_line([0], 3, 4, 10)
    assert coordinator.startswith("error: lost the connection to process 0, the coordinator")
    assert "process 3 stopped too" in coordinator


def _relay(text: bytes) -> tuple[bytes, host_watch._Relay]:
    read, write = os.pipe()
    with os.fdopen(write, "wb") as w:
        w.write(text)
    sink = io.BytesIO()
    relay = host_watch._Relay(os.fdopen(read, "rb"), sink)
    relay.thread.join(timeout=10)
    return sink.getvalue(), relay


def test_the_fatal_records_are_held_back_and_the_rest_passes():
    out, relay = _relay(LOST_PEER)
    assert out == LOST_PEER.splitlines(keepends=True)[0]  # the training's own line only
    relay.finish(drop_held=True)
    assert out == relay.sink.getvalue()
    assert host_watch.lost_processes(bytes(relay.log)) == [1]


def test_a_service_record_the_run_survives_is_shown():
    text = (b"W1128 10:48:12.023036   24136 preemption_notifier.cc:90] SIGTERM caught\n"
            b"I1128 10:48:13.000000 140186436758400 loop.py:1] next\n")
    out, relay = _relay(text)
    relay.finish(drop_held=False)
    assert relay.sink.getvalue() == text
