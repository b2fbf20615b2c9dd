"""The tensor-parallel control plane across hosts (docs/architecture.md §7b): how the driver's per-step message
reaches every worker rank, and how each side learns that the other is gone.

A group of ``size`` ranks spans ``nnodes`` nodes of ``size // nnodes`` ranks each, torchrun's layout: node n holds
ranks n*local .. (n+1)*local - 1, and the driver (rank 0) runs on node 0. Ranks on the driver's node read each
message from shared memory (shm_broadcast.py: the fast path, no network hop); ranks on other nodes read it from a
TCP connection to the driver (TcpBroadcast / TcpReader here). The driver pickles a message once and hands the same
bytes to both (DriverChannel). Tensors never travel here: torch.distributed (gloo, NCCL) owns every collective.

Rendezvous goes through the group's torch.distributed TCPStore at MASTER_ADDR:MASTER_PORT, which the driver hosts:

    trtopt/launch  the driver's Launch record (JSON): group size, nodes, device, ... and its control port
    trtopt/ready   set by the driver once every remote rank has connected; every rank joins the group after it
    trtopt/abort   set by a node that cannot take part (another size, another device): the driver fails at once

Liveness: each connection carries a heartbeat both ways every HEARTBEAT_S. A process that dies closes its
connections (the kernel does, SIGKILL included), so its peer sees EOF at once. A host that dies or drops off the
network closes nothing: its peer gives up after ``timeout_s`` of silence, the bound a collective on a silent peer
has too.

Wire format, driver to reader: an 8-byte big-endian length, then that many bytes of pickle (length 0: a heartbeat).
Reader to driver: a hello (MAGIC, then its rank as 8 bytes) once, then one byte per heartbeat; the driver never
unpickles what it receives. Readers do unpickle what the driver sends: like torch.distributed and NCCL, the control
plane trusts its network, so run a multi-node group on a private one.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, Sequence

from trtopt.runtime.executors.shm_broadcast import ShmBroadcast

LAUNCH_KEY, READY_KEY, ABORT_KEY = "trtopt/launch", "trtopt/ready", "trtopt/abort"
MAGIC = b"trtopt-tp-1"
HEARTBEAT_S = 1.0
_LEN = struct.Struct("!Q")
_HELLO_S = 10.0  # a connection that does not say who it is within this long is dropped


class PeerGone(ConnectionError):
    """The other end of a control connection closed it, or was silent for longer than the timeout."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the driver publishes at LAUNCH_KEY for the other nodes: they take device, graphs and timeout from it,
    so a node started with other flags than node 0 fails with a clear error instead of a hung collective."""

    size: int  # ranks in the group
    nnodes: int
    device: str  # "cpu" or "cuda"
    cuda_graphs: bool
    timeout_s: float  # a collective (or a control connection) silent for longer fails
    control_port: int  # the driver's TcpBroadcast, at MASTER_ADDR

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Launch:
        return cls(**json.loads(text))

    def mismatch(self, *, size: int, nnodes: int, device: str) -> str | None:
        """Why a node launched with these flags cannot join this group; None when it can."""
        if (size, nnodes) != (self.size, self.nnodes):
            return (f"this node was started with tensor_parallel_size={size}, nnodes={nnodes} but the driver (node 0) "
                    f"with tensor_parallel_size={self.size}, nnodes={self.nnodes}; start every node with the same "
                    "flags (only --node-rank differs).")
        if str(device).startswith("cuda") != self.device.startswith("cuda"):
            return (f"this node was started with device={device!r} but the driver (node 0) with "
                    f"device={self.device!r}; every node runs the same device type.")
        return None


def _hello(rank: int) -> bytes:
    return MAGIC + _LEN.pack(rank)


def _no_delay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one small message per step: no Nagle delay
    return sock


class TcpBroadcast:
    """The driver's side of the network path: a listening socket, then one connection per remote rank.

    ``accept`` waits for every remote rank's hello; after it, a pump thread reads the readers' heartbeats (EOF or
    silence marks a rank lost, see ``lost``) and sends the driver's when the channel is idle."""

    def __init__(self, ranks: Sequence[int], *, timeout_s: float):
        # Every interface, like the TCPStore server beside it: the remote nodes reach node 0 at MASTER_ADDR.
        self._listener = socket.create_server(("", 0))
        self.port: int = self._listener.getsockname()[1]
        self.ranks = tuple(ranks)
        self._timeout_s = timeout_s
        self._conns: dict[int, socket.socket] = {}
        self.peers: dict[int, str] = {}  # rank -> the address it connected from
        self._last_heard: dict[int, float] = {}
        self._lost: tuple[int, str] | None = None  # the first rank found gone, and how
        self._send_lock = threading.Lock()  # publish (the engine's thread) and heartbeats (the pump) both send
        self._closed = threading.Event()
        self._pump: threading.Thread | None = None

    def accept(self, timeout_s: float, alive: Callable[[], None] = lambda: None) -> None:
        """Return once every remote rank has connected; TimeoutError after ``timeout_s``; ``alive()`` raises to
        give up early (a local worker died, a node aborted the launch)."""
        deadline = time.monotonic() + timeout_s
        self._listener.settimeout(0.5)
        while len(self._conns) < len(self.ranks):
            alive()
            if time.monotonic() > deadline:
                missing = sorted(set(self.ranks) - set(self._conns))
                raise TimeoutError(f"tensor-parallel ranks {missing} did not connect within {timeout_s:.0f} s")
            try:
                conn, addr = self._listener.accept()
            except socket.timeout:
                continue
            rank = self._read_hello(conn)
            if rank is None:  # not one of ours (a port scan, a stray client)
                conn.close()
                continue
            if rank in self._conns:
                conn.close()
                raise ConnectionError(f"two processes claim tensor-parallel rank {rank} ({self.peers[rank]} and "
                                      f"{addr[0]}): two nodes were started with the same --node-rank.")
            conn.settimeout(self._timeout_s)  # a send to a peer that stopped reading fails after this long
            self._conns[rank], self.peers[rank] = _no_delay(conn), addr[0]
            self._last_heard[rank] = time.monotonic()
        self._listener.close()
        self._pump = threading.Thread(target=self._pump_loop, name="trtopt-tp-control", daemon=True)
        self._pump.start()

    def _read_hello(self, conn: socket.socket) -> int | None:
        conn.settimeout(_HELLO_S)
        want = len(MAGIC) + _LEN.size
        data = b""
        try:
            while len(data) < want:
                chunk = conn.recv(want - len(data))
                if not chunk:
                    return None
                data += chunk
        except OSError:
            return None
        rank = _LEN.unpack(data[len(MAGIC):])[0]
        return rank if data.startswith(MAGIC) and rank in self.ranks else None

    def publish(self, payload: bytes) -> None:
        """Send one pickled message to every remote rank; raises OSError when one cannot take it."""
        frame = _LEN.pack(len(payload)) + payload
        with self._send_lock:
            for conn in self._conns.values():
                conn.sendall(frame)

    def lost(self) -> tuple[int, str] | None:
        """(rank, what happened) for the first remote rank found gone; None while all are heard from."""
        return self._lost

    def _mark_lost(self, rank: int, how: str) -> None:
        if self._lost is None and not self._closed.is_set():
            self._lost = (rank, how)

    def _pump_loop(self) -> None:
        by_fd = {conn.fileno(): rank for rank, conn in self._conns.items()}
        last_sent = time.monotonic()
        while not self._closed.is_set() and self._lost is None:
            try:
                readable, _, _ = select.select(list(self._conns.values()), [], [], HEARTBEAT_S / 4)
            except (OSError, ValueError):  # closed under us by close()
                return
            now = time.monotonic()
            for conn in readable:
                rank = by_fd[conn.fileno()]
                try:
                    data = conn.recv(4096)
                except OSError as e:
                    data, how = b"", f"broke its control connection ({e})"
                else:
                    how = "closed its control connection (its process or host is gone)"
                if not data:
                    self._mark_lost(rank, how)
                else:
                    self._last_heard[rank] = now
            for rank, heard in self._last_heard.items():
                if now - heard > self._timeout_s:
                    self._mark_lost(rank, f"sent no heartbeat for {now - heard:.0f} s (its host is down or "
                                          "unreachable)")
            if now - last_sent >= HEARTBEAT_S and self._send_lock.acquire(blocking=False):
                try:  # busy lock: a message is going out, which tells the readers as much
                    for rank, conn in self._conns.items():
                        try:
                            conn.sendall(_LEN.pack(0))
                        except OSError as e:
                            self._mark_lost(rank, f"could not be sent a heartbeat ({e})")
                finally:
                    self._send_lock.release()
                last_sent = now

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        if self._pump is not None:
            self._pump.join(timeout=2 * HEARTBEAT_S)
        for conn in self._conns.values():
            try:
                conn.close()
            except OSError:
                pass


class TcpReader:
    """A remote rank's side: receive() the driver's messages in order, send heartbeats from a thread."""

    def __init__(self, sock: socket.socket, peer: str, *, timeout_s: float):
        self._sock, self.peer, self._timeout_s = _no_delay(sock), peer, timeout_s
        self._sock.settimeout(HEARTBEAT_S)  # receive() wakes this often to check alive() and the driver's silence
        self._buf = bytearray()
        self._last_heard = time.monotonic()
        self._closed = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="trtopt-tp-heartbeat", daemon=True)
        self._beat.start()

    @classmethod
    def connect(cls, host: str, port: int, rank: int, *, timeout_s: float) -> TcpReader:
        sock = socket.create_connection((host, port), timeout=timeout_s)
        sock.sendall(_hello(rank))
        return cls(sock, f"{host}:{port}", timeout_s=timeout_s)

    def receive(self, alive: Callable[[], None] = lambda: None) -> Any:
        """The next message; PeerGone when the driver closed the connection or fell silent."""
        while True:
            (length,) = _LEN.unpack(self._take(_LEN.size, alive))
            if length:
                return pickle.loads(self._take(length, alive))

    def _take(self, n: int, alive: Callable[[], None]) -> bytes:
        while len(self._buf) < n:
            try:
                chunk = self._sock.recv(max(n - len(self._buf), 1 << 16))
            except socket.timeout:
                alive()
                silent = time.monotonic() - self._last_heard
                if silent > self._timeout_s:
                    raise PeerGone(f"the driver at {self.peer} sent nothing for {silent:.0f} s (its host is down or "
                                   "unreachable)") from None
                continue
            except OSError as e:
                raise PeerGone(f"the connection to the driver at {self.peer} broke ({e})") from e
            if not chunk:
                raise PeerGone(f"the driver at {self.peer} closed the connection (it stopped or died)")
            self._last_heard = time.monotonic()
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def _heartbeat(self) -> None:
        while not self._closed.wait(HEARTBEAT_S):
            try:
                self._sock.sendall(b"\0")
            except OSError:  # the driver is gone: receive() says so
                return

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.close()
        except OSError:
            pass


class DriverChannel:
    """The driver's one door to every worker: ranks of its node over shared memory, the others over TCP."""

    def __init__(self, local: ShmBroadcast, remote: TcpBroadcast | None):
        self.local, self.remote = local, remote

    def publish(self, obj: Any, alive: Callable[[], None] = lambda: None) -> None:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if self.remote is not None:  # first: the network hop overlaps the local readers' pickup
            self.remote.publish(payload)
        self.local.publish_bytes(payload, alive)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        self.local.close()
