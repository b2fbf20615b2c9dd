"""One writer, several readers on one host: the tensor-parallel driver's per-step message to the workers of its
own node (tensor_parallel.py; ranks on other nodes read the same bytes over TCP, control_plane.py).

Why not ``dist.broadcast_object_list`` over gloo (what this replaced): it costs two TCP round trips plus pickling
of tensors per call, 2.5-3.7 ms per step measured on our CPU box, and on 2xH200 it made batch-1 decode at N = 2
(223 tok/s) 2.5x slower than N = 1 (552 tok/s), although the GPUs' work halves. vLLM solves the same problem with
a shared-memory ring (its ``shm_broadcast.MessageQueue``); this is the single-slot version of that idea, with
torch.distributed still owning every collective on tensors.

Layout of the mapped file (``/dev/shm``, or the temp dir where that does not exist)::

    int64 seq          number of messages published so far (written last: a reader that sees it sees the payload)
    int64 nbytes       payload size of message ``seq``
    int64 acks[R]      reader r has consumed messages up to acks[r]
    bytes payload[capacity]

The writer publishes message k+1 only when every reader acknowledged message k, so one slot suffices and nothing is
ever overwritten while read. Stores become visible in program order on x86-64 (TSO), which is what the
payload-before-seq rule relies on; on weaker memory models a fence would be needed (not a platform we serve).

Waiting spins for ``spin_s`` (yielding the core to any other runnable thread between checks), then sleeps in the
shortest timer sleeps until 5 ms, then in 0.5 ms naps, so an idle reader costs next to no CPU; ``alive`` callbacks
let either side give up when its peer is gone instead of waiting forever. A timer sleep is coarse: ``time.sleep(0)``
sleeps the thread's timer slack (50 µs by default on Linux; measured 60-76 µs a call), and a reader whose message
arrives during one sees it that much later. So a reader whose core has nothing else to do (a GPU rank: one step's
gap is ~1 ms) spins through the whole gap (tensor_parallel.py picks its ``spin_s``).
"""

from __future__ import annotations

import mmap
import os
import pickle
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np

DEFAULT_CAPACITY = 16 << 20  # the largest step (8192 tokens, 256 sequences x 128 blocks) pickles to ~0.3 MB
DEFAULT_SPIN_S = 50e-6  # a wait spins this long, then sleeps (module docstring)
_SLEEP_S, _NAP_S = 5e-3, 5e-4  # shortest timer sleeps until _SLEEP_S of waiting, then naps of _NAP_S


def _shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _wait(ready: Callable[[], bool], alive: Callable[[], None], spin_s: float) -> None:
    """Return once ``ready()``; ``alive()`` raises when the peer is gone (checked between naps)."""
    start = time.perf_counter()
    while not ready():
        waited = time.perf_counter() - start
        if waited < spin_s:
            os.sched_yield()  # returns at once when nothing else wants this core: no timer slack
            continue
        alive()
        time.sleep(0 if waited < _SLEEP_S else _NAP_S)


class ShmBroadcast:
    """The channel; the writer creates it (``ShmBroadcast.create``), readers attach by ``path`` (``attach``)."""

    def __init__(self, path: Path, num_readers: int, capacity: int, *, reader: int | None, owner: bool,
                 spin_s: float = DEFAULT_SPIN_S):
        self.path, self.num_readers, self.capacity = path, num_readers, capacity
        self._reader, self._owner = reader, owner
        self.spin_s = spin_s  # how long a wait spins before it sleeps (module docstring)
        self._header_bytes = 8 * (2 + num_readers)
        with open(path, "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), self._header_bytes + capacity)
        self._header = np.ndarray((2 + num_readers,), dtype=np.int64, buffer=self._mm)
        self._seq = int(self._header[0]) if reader is None else int(self._header[2 + reader])

    @classmethod
    def create(cls, num_readers: int, capacity: int = DEFAULT_CAPACITY) -> "ShmBroadcast":
        path = _shm_dir() / f"trtopt-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with open(path, "wb") as f:
            f.truncate(8 * (2 + num_readers) + capacity)  # zero-filled: seq 0, every ack 0
        return cls(path, num_readers, capacity, reader=None, owner=True)

    @classmethod
    def attach(cls, path: str | Path, num_readers: int, reader: int, capacity: int = DEFAULT_CAPACITY, *,
               spin_s: float = DEFAULT_SPIN_S) -> "ShmBroadcast":
        assert 0 <= reader < num_readers, (reader, num_readers)
        return cls(Path(path), num_readers, capacity, reader=reader, owner=False, spin_s=spin_s)

    # ---- writer ------------------------------------------------------------------------------------------------

    def publish(self, obj: Any, alive: Callable[[], None] = lambda: None) -> None:
        """Send ``obj`` (pickled) to every reader; waits until they all took the previous message."""
        self.publish_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), alive)

    def publish_bytes(self, payload: bytes, alive: Callable[[], None] = lambda: None) -> None:
        """publish() of an object the caller pickled (control_plane.DriverChannel pickles once for every path)."""
        assert self._reader is None, "only the writer publishes"
        assert len(payload) <= self.capacity, f"message of {len(payload)} bytes > channel capacity {self.capacity}"
        acks = self._header[2:]
        _wait(lambda: bool((acks >= self._seq).all()), alive, self.spin_s)
        start = self._header_bytes
        self._mm[start:start + len(payload)] = payload
        self._header[1] = len(payload)
        self._seq += 1
        self._header[0] = self._seq  # last: publishes the payload above

    # ---- reader ------------------------------------------------------------------------------------------------

    def receive(self, alive: Callable[[], None] = lambda: None) -> Any:
        """The next message (blocks until the writer publishes it)."""
        assert self._reader is not None, "the writer does not receive"
        want = self._seq + 1
        _wait(lambda: int(self._header[0]) >= want, alive, self.spin_s)
        start = self._header_bytes
        obj = pickle.loads(self._mm[start:start + int(self._header[1])])
        self._seq = want
        self._header[2 + self._reader] = want  # after the read: the writer may now overwrite the slot
        return obj

    def close(self) -> None:
        self._header = None  # the numpy view holds a buffer export; mmap.close() refuses while it exists
        self._mm.close()
        if self._owner:
            self.path.unlink(missing_ok=True)
