"""Tensor parallelism inside the model: which rows of a checkpoint tensor a rank holds (`Rows`, `Target`), the
collectives the sharded layers call, and the row-parallel and vocab-parallel layers (column-parallel ones are plain
`MergedLinear`s holding their rows, layers.py).

A collective runs over the process group of the phase that calls it: decode and prefill each have a group of their
own (set by the engine), so that while the two phases run at once on disjoint SM partitions their collectives never
share a communicator, and each runs on the caller's stream (its partition). A model of one rank is built from plain
torch layers and never calls anything here.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

PHASES = ("decode", "prefill")
ABORT_WAIT_S = 10.0  # how long an abort of the communicators is waited for (it goes on by itself past that)


@dataclass(frozen=True)
class Rows:
    """Rows [start, start + size) of a checkpoint tensor's dimension of `total` rows."""

    start: int
    size: int
    total: int

    @classmethod
    def whole(cls, total: int) -> "Rows":
        return cls(0, total, total)

    @classmethod
    def even(cls, total: int, rank: int, ranks: int) -> "Rows":
        """Rank `rank`'s share of `total` rows split evenly among `ranks` (the caller checked divisibility)."""
        per = total // ranks
        return cls(rank * per, per, total)


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: parameter `param`, or with `rows` only those rows of the tensor along `dim`,
    copied into the parameter from `offset` along the same dimension."""

    param: str
    dim: int = 0
    offset: int = 0
    rows: Rows | None = None


# ---- collectives ----------------------------------------------------------------------------------------------
_groups: dict[str, Any] = {}  # phase -> torch.distributed process group
_phase = "decode"


def set_groups(groups: dict[str, Any]) -> None:
    """The process group of each phase (`PHASES`); empty: no tensor parallelism in this process."""
    _groups.clear()
    _groups.update(groups)


def abort_groups(wait_s: float = ABORT_WAIT_S) -> None:
    """Abort this process's communicators (every phase's and the default group's): its collectives waiting on a rank
    that died return with an error, those inside replayed CUDA graphs too, which no timeout watches. The abort runs on
    a thread of its own, waited for at most `wait_s`: NCCL ends the collectives at once, but then waits until every
    CUDA graph that captured one of them is destroyed."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None or not dist.is_initialized():
        return

    def run() -> None:
        for group in [*_groups.values(), None]:
            try:
                abort(group)
            except Exception:  # noqa: BLE001 - a backend without abort (gloo) or a group already gone: nothing to do
                pass

    aborting = threading.Thread(target=run, name="muxd-abort", daemon=True)
    aborting.start()
    aborting.join(wait_s)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Collectives called inside this block use `name`'s process group (outside any block: decode's)."""
    global _phase
    previous, _phase = _phase, name
    try:
        yield
    finally:
        _phase = previous


def _group() -> Any:
    if not _groups:
        raise RuntimeError("a tensor-parallel layer ran without process groups; the engine sets them at start-up")
    return _groups[_phase]


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x, group=_group())  # synchronous: on the current stream (the phase's partition) in torch >= 2.8
    return x


@torch.library.custom_op("muxd::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor) -> torch.Tensor:
    # out of place for the compiler, whose graph must not see its input change
    return _all_reduce(x.clone())


@_all_reduce_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks (in place when eager: `x` is a fresh partial result nobody else holds)."""
    if torch.compiler.is_compiling():
        return _all_reduce_op(x)
    return _all_reduce(x.contiguous())


def share_from_first(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank, in place (on the current stream, like every collective here)."""
    dist.broadcast(x, src=0, group=_group())  # (every phase's group holds all the ranks: its rank 0 is rank 0)
    return x


_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name, where it exists


def gather_columns(x: torch.Tensor, columns: int) -> torch.Tensor:
    """Every rank's [rows, n] side by side -> [rows, columns] (the first `columns` of the ranks' n each)."""
    group = _group()
    ranks, rows, n = dist.get_world_size(group), x.shape[0], x.shape[1]
    out = torch.empty(ranks * rows, n, dtype=x.dtype, device=x.device)
    _gather(out, x.contiguous(), group=group)
    return out.view(ranks, rows, n).permute(1, 0, 2).reshape(rows, ranks * n)[:, :columns]


# ---- layers ---------------------------------------------------------------------------------------------------
class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split among the ranks: each multiplies its share, an all-reduce
    sums the partial products, and the bias (whole on every rank) is added once, after the sum."""

    def __init__(self, total_in: int, out_features: int, bias: bool, rank: int, ranks: int) -> None:
        super().__init__(total_in // ranks, out_features, bias=bias)
        self.rows = Rows.even(total_in, rank, ranks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def checkpoint_targets(self, name: str) -> dict[str, Target]:
        return {f"{name}.weight": Target(f"{name}.weight", 1, 0, self.rows)}


class VocabShard(nn.Module):
    """A rank's rows of a [vocab, hidden] matrix (the LM head): the vocabulary split evenly, the last rank's rows
    past the vocabulary zero."""

    def __init__(self, vocab: int, hidden: int, rank: int, ranks: int) -> None:
        super().__init__()
        per = -(-vocab // ranks)
        start = min(rank * per, vocab)
        self.rows = Rows(start, min(per, vocab - start), vocab)
        self.weight = nn.Parameter(torch.empty(per, hidden))

    def checkpoint_targets(self, name: str) -> dict[str, Target]:
        return {f"{name}.weight": Target(f"{name}.weight", 0, 0, self.rows)}


class VocabParallelEmbedding(VocabShard):
    """The embedding of a rank's vocabulary rows: tokens outside them embed to zero, an all-reduce sums the ranks."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.rows.start
        outside = (local < 0) | (local >= self.rows.size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits of the whole vocabulary on every rank from each rank's rows of the LM head."""
    return gather_columns(F.linear(hidden, weight), vocab)
