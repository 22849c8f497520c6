"""SGLang's PD-multiplexing stream groups on muxd's SM partitions: the fixed list of (prefill, decode) splits made at
start-up (all-prefill, the divisions, all-decode), SGLang's default rule for the divisions, how each maps onto a
partition the executor creates, and the group a decode batch size picks (`choose_group`).

SGLang (python/sglang/srt/multiplex/pdmux_context.py) splits by prefill SMs, multiples of 8 on Hopper, decode takes
the rest; muxd's executor splits by decode SMs, multiples of --partition-granularity, prefill takes the rest. So a
division keeps SGLang's SM counts for the record and runs on the muxd partition whose decode SMs are nearest SGLang's
(ties: the larger), prefill on the rest of the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from appliance.errors import ConfigError

HOPPER_MIN_SMS = HOPPER_MULTIPLE = 8  # SGLang's green-context constraints for compute capability 9.x
MIN_DECODE_SMS = 16                   # SGLang keeps at least 16 SMs for the smaller (decode) side of a division


@dataclass(frozen=True)
class StreamGroup:
    """One stream group: the SMs SGLang gives each phase, and the muxd partition that carries it (decode on
    `decode_sms` SMs, prefill on `prefill_sms`). The all-prefill group has no decode SMs, the all-decode group no
    prefill SMs; `min_batch` is a manual division's decode-batch threshold."""

    sglang_prefill: int
    sglang_decode: int
    decode_sms: int
    prefill_sms: int
    min_batch: int | None = None

    def describe(self) -> str:
        if not self.sglang_decode:
            return f"all-prefill ({self.prefill_sms} SMs)"
        if not self.sglang_prefill:
            return f"all-decode ({self.decode_sms} SMs)"
        at = f", decode batch >= {self.min_batch}" if self.min_batch is not None else ""
        return f"{self.sglang_prefill}/{self.sglang_decode} -> {self.prefill_sms}/{self.decode_sms}{at}"


def sglang_divisions(total_sms: int, sm_group_num: int) -> list[tuple[int, int]]:
    """SGLang's `divide_sm` on Hopper: prefill gets x = 8, 16, ... SMs where x is at least half the GPU and the decode
    remainder at least 16; of more candidates than sm_group_num - 2 it keeps every (count // (groups - 2))-th, then the
    first groups - 2. (prefill, decode) pairs, the largest prefill first (132 SMs, 8 groups: 112/20, 104/28, 96/36,
    88/44, 80/52, 72/60)."""
    want = sm_group_num - 2
    values = [x for x in range(HOPPER_MIN_SMS, total_sms - HOPPER_MIN_SMS + 1, HOPPER_MULTIPLE)
              if x >= total_sms - x and total_sms - x >= MIN_DECODE_SMS]
    if not values:
        raise ConfigError(f"pdmux: SGLang's rule finds no division of a GPU of {total_sms} SMs")
    if len(values) >= want:
        values = values[::max(1, len(values) // want)][:want]
    return [(x, total_sms - x) for x in reversed(values)]


def nearest_partition(decode_sms: int, partitions: Sequence[int]) -> int:
    """The executor's decode partition nearest `decode_sms` (ties: the larger)."""
    return min(partitions, key=lambda d: (abs(d - decode_sms), -d))


def stream_groups(total_sms: int, partitions: Sequence[int], sm_group_num: int = 8,
                  divisions: Sequence[tuple[int, int, int]] = ()) -> list[StreamGroup]:
    """Every group, in SGLang's order: all-prefill, the divisions (given as (prefill, decode, min batch), else by
    SGLang's rule), all-decode. As in SGLang the count is 2 + the divisions found, which the rule may keep below
    sm_group_num."""
    if not partitions:
        raise ConfigError("pdmux needs the executor's decode partitions (none given)")
    if divisions:
        bad = [d for d in divisions if d[0] + d[1] != total_sms]
        if bad:
            raise ConfigError(f"--pdmux-divisions: prefill + decode SMs must make the GPU's {total_sms}; "
                              f"{', '.join(f'{p}:{d}' for p, d, _ in bad)} do not")
        splits: list[tuple[int, int, int | None]] = [tuple(d) for d in divisions]  # type: ignore[misc]
    else:
        splits = [(p, d, None) for p, d in sglang_divisions(total_sms, sm_group_num)]
    groups = [StreamGroup(total_sms, 0, 0, total_sms)]
    for prefill, decode, min_batch in splits:
        d = nearest_partition(decode, partitions)
        groups.append(StreamGroup(prefill, decode, d, total_sms - d, min_batch))
    groups.append(StreamGroup(0, total_sms, total_sms, 0))
    return groups


def choose_group(groups: Sequence[StreamGroup], decode_batch: int, prefilling: bool, divisor: int) -> int:
    """SGLang's `adjust_stream_groups`: with both a decode batch and a prefill batch, a division picked by the decode
    batch size alone (manual divisions: the last whose threshold it reaches; else max(1, min(n - 2,
    batch * (n - 2) // divisor)) of n groups); decode alone: all-decode; otherwise all-prefill."""
    last = len(groups) - 1
    if decode_batch and prefilling:
        if groups[1].min_batch is not None:
            # (SGLang leaves the index unset below the first threshold; its example's first threshold is 1)
            reached = [i for i in range(1, last) if decode_batch >= (groups[i].min_batch or 0)]
            return reached[-1] if reached else 1
        return max(1, min(last - 1, decode_batch * (last - 1) // divisor))
    return last if decode_batch else 0
