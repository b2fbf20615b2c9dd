"""The tensor-parallel driver's shared-memory channel (runtime/executors/shm_broadcast.py): every reader gets every
message, in order, none overwritten while unread, and a waiting side gives up when its peer is gone."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from trtopt.runtime.executors.shm_broadcast import DEFAULT_SPIN_S, ShmBroadcast


@pytest.mark.parametrize("spin_s", [DEFAULT_SPIN_S, 5e-3], ids=["default", "gpu-rank"])
def test_every_reader_gets_every_message_in_order(spin_s):
    """Readers that sleep after 50 µs (the default) or spin through 5 ms (a GPU rank's, tensor_parallel.py)."""
    writer = ShmBroadcast.create(num_readers=2, capacity=1 << 16)
    readers = [ShmBroadcast.attach(writer.path, num_readers=2, reader=r, capacity=1 << 16, spin_s=spin_s)
               for r in range(2)]
    got: list[list] = [[], []]

    def read(r: int) -> None:
        while (message := readers[r].receive())[0] != "stop":
            got[r].append(message)

    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    # Messages of varying size: a shorter one after a longer one must not show the longer one's tail.
    sent = [("step", {"ids": np.arange(n, dtype=np.int64)}) for n in (1000, 3, 500, 0, 7000)] * 40
    for message in sent:
        writer.publish(message)
    writer.publish(("stop", None))
    for t in threads:
        t.join(timeout=30)
    for r in range(2):
        assert len(got[r]) == len(sent)
        for (op, arg), (op2, arg2) in zip(got[r], sent):
            assert op == op2
            np.testing.assert_array_equal(arg["ids"], arg2["ids"])
    for channel in readers + [writer]:
        channel.close()
    assert not writer.path.exists()


def test_waiting_sides_give_up_when_the_peer_is_gone():
    writer = ShmBroadcast.create(num_readers=1, capacity=1 << 10)
    reader = ShmBroadcast.attach(writer.path, num_readers=1, reader=0, capacity=1 << 10, spin_s=5e-3)
    writer.publish("first")  # never read: the next publish must wait for the reader, then see it is gone

    class Gone(Exception):
        pass

    def gone() -> None:
        raise Gone

    with pytest.raises(Gone):
        writer.publish("second", alive=gone)
    assert reader.receive() == "first"
    with pytest.raises(Gone):  # nothing more was published: the reader waits, then sees the writer is gone
        reader.receive(alive=gone)
    with pytest.raises(AssertionError, match="capacity"):
        writer.publish(b"x" * 2000)
    reader.close()
    writer.close()
