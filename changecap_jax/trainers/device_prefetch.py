"""Device prefetch: the next batches moved to the devices while the current step runs.

A background thread takes host batches from an iterator, turns each into global arrays
(``transfer``, e.g. ``pipeline.to_global``) and keeps up to ``depth`` of them in a queue, as
flax's and big_vision's ``prefetch_to_device`` do. The batches and their order are the
iterator's, so the losses are those without prefetch. The checkpointed state is the wrapped
iterator's with ``next_batch`` set to the batches CONSUMED, not those read ahead, so a resume
neither skips nor repeats a batch.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

_END = object()


def _fill(source: Iterator, transfer: Callable[[Any], Any], out: queue.Queue,
          stop: threading.Event) -> None:
    """The thread: holds no reference to the wrapper, so dropping it stops the thread."""
    try:
        for batch in source:
            item = transfer(batch)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if stop.is_set():
                return
    except BaseException as e:  # re-raised in the consumer, at the batch it failed on
        out.put(e)
        return
    out.put(_END)


class DevicePrefetch(Iterator[Any]):
    """Iterates ``transfer(batch)`` of ``source``'s batches, ``depth`` of them ahead.

    ``source`` is a checkpointable iterator (``get_state`` / ``set_state`` with a JSON state
    holding ``next_batch``, as ``pipeline.TrainIterator``); ``grain.checkpoint`` saves this
    wrapper as it saves that one.
    """

    def __init__(self, source: Any, transfer: Callable[[Any], Any], depth: int = 2):
        if depth < 1:
            raise ValueError(f"device prefetch depth must be >= 1, got {depth}")
        self._source, self._transfer, self._depth = source, transfer, depth
        self._consumed = json.loads(source.get_state())["next_batch"]
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()

    def __iter__(self) -> DevicePrefetch:
        return self

    def __next__(self) -> Any:
        if self._thread is None:
            self._start()
        item = self._queue.get()
        if item is _END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        self._consumed += 1
        return item

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self._depth)
        self._thread = threading.Thread(
            target=_fill, args=(self._source, self._transfer, self._queue, self._stop),
            name="device_prefetch", daemon=True)
        self._thread.start()

    def start_prefetch(self) -> None:
        """Starts the thread now (``grain.checkpoint`` calls it after a restore)."""
        if self._thread is None:
            self._start()

    def get_state(self) -> bytes:
        state = json.loads(self._source.get_state())
        state["next_batch"] = self._consumed
        return json.dumps(state).encode()

    def set_state(self, state: bytes | str) -> None:
        self.close()  # what was read ahead from the old position is dropped
        self._source.set_state(state)
        self._consumed = json.loads(self._source.get_state())["next_batch"]

    def close(self) -> None:
        """Stops the thread (the next ``next`` starts it again at the consumed position)."""
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():  # unblock a thread waiting for the source or a slot
            try:
                self._queue.get(timeout=0.1)
            except queue.Empty:
                pass
        self._thread = None
        # The source read ahead of what was consumed: rewind it to the consumed position.
        state = json.loads(self._source.get_state())
        state["next_batch"] = self._consumed
        self._source.set_state(json.dumps(state).encode())

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (at interpreter exit the source may be gone)
            pass
