"""The ranks of a tensor-parallel engine, one process per GPU.

Rank 0 (the calling process: scheduler, planner, server) starts the others itself (torch.multiprocessing, spawn).
Every rank joins torch.distributed (NCCL on CUDA, gloo on CPU) through a store rank 0 opens on the loopback, and
makes one process group per phase (decode, prefill) for the model's collectives. Rank 0 sends each step to the others
over a pipe per rank (bytes, no pickling); the others block on it while the engine idles, so no collective waits out
an idle server. A watcher thread on rank 0 sees a rank exit at once (its error comes over the same pipe when it had
one) and a rank leaves as soon as rank 0 is gone. Every process muxd starts keeps NVLink multicast off.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from appliance.errors import RankError
from appliance.model_zoo.parallel import PHASES, abort_groups, set_groups

log = logging.getLogger("muxd.ranks")
# NVLink multicast (NVLS) can put a host's GPUs out of service; set in every process muxd starts
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FAILURE_GRACE_S = 5.0  # how long a failed send or collective waits for the watcher to name the rank that died
JOIN_TIMEOUT_S = 10.0  # how long rank 0 waits for a rank to leave the group, then to exit, before it forces either
SHUTDOWN = b""  # the message that ends a rank
RANK_LOG_LEVEL = "MUXD_RANK_LOG_LEVEL"  # rank 0's logging level, which the ranks it starts take


@dataclass(frozen=True)
class Rank:
    """This process's place among the ranks: its index, how many there are, its device."""

    index: int
    size: int
    device: str

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (a collective: every rank calls it at the same point)."""
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def rank_device(device: str, index: int, size: int) -> str:
    """Rank `index`'s device: cuda:index for a CUDA engine of several ranks, else the engine's device."""
    return f"cuda:{index}" if size > 1 and device.startswith("cuda") else device


def join(rank: Rank, store: Any, timeout_s: float) -> None:
    """Join the process group and make the phases' groups; their communicators are set up now, before any CUDA
    graph could capture a collective."""
    cuda = rank.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank.device)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank.index, world_size=rank.size,
                            timeout=timeout, device_id=torch.device(rank.device) if cuda else None)
    groups = {phase: dist.new_group(list(range(rank.size)), timeout=timeout) for phase in PHASES}
    for group in groups.values():
        dist.all_reduce(torch.zeros(1, device=rank.device), group=group)
    set_groups(groups)


def join_as(index: int, size: int, store_port: int, device: str, timeout_s: float) -> Rank:
    """Join the group rank 0 opened on `store_port` as rank `index` (ranks other than 0)."""
    rank = Rank(index, size, rank_device(device, index, size))
    store = dist.TCPStore("127.0.0.1", store_port, size, False, timeout=datetime.timedelta(seconds=timeout_s))
    join(rank, store, timeout_s)
    return rank


def leave(together: bool = False) -> None:
    """Leave the process group. `together`: every rank leaves at this point (rank 0's close says stop and leaves at
    once, the others as they read it): a barrier first, so that no rank tears down a communicator while another still
    needs it; on NCCL the teardown itself waits for every rank (the phases' groups share the default group's
    resources), so a rank that left late, or was killed first, would leave the others waiting for ever; and it waits
    until no CUDA graph holds a collective of the group (the executors destroy theirs first)."""
    set_groups({})
    if dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()


def _signal_name(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class RankGroup:
    """Rank 0's side: the other ranks' processes and pipes, the watcher, failure and shutdown."""

    def __init__(self, rank: Rank, procs: list, conns: list) -> None:
        self.rank, self.procs, self.conns = rank, procs, conns
        self.failure: str | None = None
        self._failed = threading.Event()
        self._callbacks: list[Callable[[BaseException], None]] = []
        self._before_leaving: list[Callable[[bool], None]] = []
        self._reports: dict[int, str] = {}
        self._closing = False
        self._wake_recv, self._wake_send = mp.Pipe(duplex=False)
        self._watcher = threading.Thread(target=self._watch, name="muxd-ranks", daemon=True)
        self._watcher.start()
        atexit.register(self.close)

    @classmethod
    def start(cls, size: int, device: str, timeout_s: float,
              target: Callable[[int, int, int, Any], None], *args: Any) -> "RankGroup":
        """Start ranks 1..size-1, each running `target(*args, index, size, store_port, conn)`, and join them as
        rank 0."""
        os.environ.update(MULTICAST_OFF)
        os.environ[RANK_LOG_LEVEL] = str(logging.getLogger().getEffectiveLevel())  # the other ranks log as this one
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for index in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(target, *args, index, size, store.port, theirs),
                               name=f"muxd-rank{index}")
            proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(ours)
        group = cls(Rank(0, size, rank_device(device, 0, size)), procs, conns)
        try:
            with group.guard():
                join(group.rank, store, timeout_s)
        except BaseException:
            group.close()
            raise
        log.info("tensor parallelism: %d ranks (%s), pids %s", size, "NCCL" if device.startswith("cuda") else "gloo",
                 ", ".join(str(p.pid) for p in procs))
        return group

    # ---- steps ------------------------------------------------------------------------------------------------
    def send(self, payload: bytes) -> None:
        """One message to every other rank."""
        self.check()
        for conn in self.conns:
            try:
                conn.send_bytes(payload)
            except OSError as exc:
                raise self._explain(exc) from exc

    def check(self) -> None:
        """Raise RankError if a rank has failed."""
        if self.failure is not None:
            raise RankError(self.failure)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run collectives: an error from one while a rank is dying becomes that rank's RankError."""
        self.check()
        try:
            yield
        except RankError:
            raise
        except Exception as exc:
            raise self._explain(exc) from exc

    def _explain(self, exc: Exception) -> Exception:
        if self._failed.wait(FAILURE_GRACE_S):
            return RankError(self.failure)
        return exc

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        self._callbacks.append(callback)

    # ---- failure and shutdown ---------------------------------------------------------------------------------
    def _watch(self) -> None:
        waiting: dict[Any, int] = {p.sentinel: i for i, p in enumerate(self.procs)}
        waiting.update({c: i for i, c in enumerate(self.conns)})
        while waiting:
            ready = multiprocessing.connection.wait([*waiting, self._wake_recv])
            if self._wake_recv in ready or self._closing:
                return
            for obj in ready:
                i = waiting[obj]
                if obj in self.conns:  # a rank's last words
                    try:
                        self._reports[i] = obj.recv_bytes().decode(errors="replace")
                    except (EOFError, OSError):
                        del waiting[obj]
                    continue
                del waiting[obj]
                conn = self.conns[i]
                with contextlib.suppress(EOFError, OSError):
                    while conn.poll():
                        self._reports[i] = conn.recv_bytes().decode(errors="replace")
                self._fail(i)
                return

    def _fail(self, i: int) -> None:
        proc = self.procs[i]
        proc.join(JOIN_TIMEOUT_S)  # its sentinel fired: this only reaps it, for its exit code
        report = self._reports.get(i)
        self.failure = (f"tensor-parallel rank {i + 1} (pid {proc.pid}) {_signal_name(proc.exitcode)}"
                        f"{': ' + report if report else ''}; the engine cannot continue")
        log.error(self.failure)
        self._failed.set()
        for other in self.procs:
            if other.is_alive():
                other.terminate()  # blocked in a collective with the dead rank: nothing left for it to do
        abort_groups()  # and so is this rank, maybe inside a replayed graph's collective, which no timeout watches
        for callback in self._callbacks:
            callback(RankError(self.failure))

    def before_leaving(self, callback: Callable[[bool], None]) -> None:
        """Have `callback(healthy)` called as the group closes, before this rank leaves the process group (at exit
        too); `healthy`: no rank has failed."""
        self._before_leaving.append(callback)

    def close(self) -> None:
        """Stop every other rank and leave the process group with them (politely; by force after a failure, or when
        a rank does not leave or exit in time)."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        for callback in self._before_leaving:
            try:
                callback(self.failure is None)
            except Exception:  # noqa: BLE001 - leaving matters more: the ranks must not wait for this one
                log.exception("before leaving the tensor-parallel ranks")
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(SHUTDOWN)
        self._leave(together=self.failure is None)  # the others leave as they read the word
        for proc in self.procs:
            proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_TIMEOUT_S)
        with contextlib.suppress(OSError):
            self._wake_send.send_bytes(b"x")
        self._watcher.join(JOIN_TIMEOUT_S)
        for conn in self.conns:
            conn.close()

    def _leave(self, together: bool) -> None:
        """Leave the process group within JOIN_TIMEOUT_S; past it (a rank that never reaches the barrier), abort this
        rank's communicators, which ends the wait. After a failure the communicators are aborted already."""
        def run() -> None:
            with contextlib.suppress(Exception):  # a group a dead rank left broken
                leave(together)

        leaving = threading.Thread(target=run, name="muxd-ranks-leave", daemon=True)
        leaving.start()
        leaving.join(JOIN_TIMEOUT_S)
        if leaving.is_alive():
            log.warning("the tensor-parallel ranks did not leave the process group together in %.0f s; aborting "
                        "rank 0's communicators", JOIN_TIMEOUT_S)
            abort_groups()
            leaving.join(JOIN_TIMEOUT_S)


def _rank_main(target: Callable[..., None], *args: Any) -> None:
    """A rank's process: multicast off, gone when rank 0 is, its error (if any) told to rank 0 before it exits."""
    os.environ.update(MULTICAST_OFF)
    level = os.environ.get(RANK_LOG_LEVEL, "")
    logging.basicConfig(level=int(level) if level.isdigit() else logging.WARNING,
                        format=f"%(asctime)s %(levelname)s rank {args[-4]} %(name)s: %(message)s")
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent.sentinel,), daemon=True).start()
    conn, code = args[-1], 0
    try:
        target(*args)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to rank 0 and ends the process
        code = 1
        log.exception("rank failed")
        with contextlib.suppress(OSError):
            conn.send_bytes(f"{type(exc).__name__}: {exc}".encode())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: a communicator a dead peer left behind could hang it


def _exit_with(sentinel: Any) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)
