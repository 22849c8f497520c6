"""The garbage collector while serving (engine/gc_pauses.py): collections timed per generation, start-up objects
frozen out of later collections and given back on unfreeze."""
from __future__ import annotations

import gc
import weakref

from appliance.engine import gc_pauses


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_collections_are_counted_and_timed_per_generation():
    rec = gc_pauses.recorder()
    assert gc_pauses.recorder() is rec  # one per process
    before = rec.snapshot()
    gc.collect(0)
    gc.collect(2)
    delta = gc_pauses.since(before, rec.snapshot())
    assert delta["collections"][0] >= 1 and delta["collections"][2] >= 1
    assert all(s >= 0 for s in delta["seconds"]) and delta["max_ms"][2] >= 0
    # the largest pause is that of the collections in between: none of a generation, none shown
    before = rec.snapshot()
    gc.collect(0)
    delta = gc_pauses.since(before, rec.snapshot())
    assert delta["collections"][2] == 0 and delta["max_ms"][2] == 0.0
    assert delta["max_ms"][0] * 1e-3 <= max(t for _, g, t in rec.recent if g == 0) + 1e-6


def test_the_collection_freeze_runs_is_not_counted_as_serving():
    rec = gc_pauses.recorder()
    before = rec.snapshot()
    try:
        gc_pauses.freeze()
    finally:
        gc_pauses.unfreeze()
    assert gc_pauses.since(before, rec.snapshot())["collections"][2] == 0


def test_frozen_objects_leave_the_collector_until_unfrozen():
    node = _Node()
    ref = weakref.ref(node)
    try:
        frozen = gc_pauses.freeze()
        assert frozen > 0 and gc_pauses.recorder().snapshot()["frozen"] == frozen
        del node
        gc.collect()
        assert ref() is not None  # a frozen cycle is not scanned, so not freed
    finally:
        gc_pauses.unfreeze()
    assert gc_pauses.recorder().snapshot()["frozen"] == 0
    gc.collect()
    assert ref() is None
