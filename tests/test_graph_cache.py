"""The CUDA-graph cache every graph user shares (decoders/graph_capture.py): its bound, its pool and its
failure rule. The bookkeeping needs no GPU: entries here are plain objects recorded into plain pools (the
graphs themselves are checked on the device: tests/test_fast_paths.py, tests/test_audio_decoder.py)."""

from __future__ import annotations

import itertools

import pytest

from decoders.graph_capture import GraphCache


def cache(max_graphs: int, on_full: str = "eager") -> GraphCache:
    pools = itertools.count()
    return GraphCache("test", max_graphs, on_full=on_full, new_pool=lambda: next(pools), capturing=lambda: False)


def test_a_full_eager_cache_captures_nothing_more_and_keeps_what_it_has():
    graphs = cache(2)
    assert graphs.capture("a", lambda pool: ("a", pool)) == ("a", 0)
    assert graphs.capture("b", lambda pool: ("b", pool)) == ("b", 0)  # one pool for every entry
    assert graphs.capture("c", lambda pool: ("c", pool)) is None  # full: the caller runs eagerly
    assert graphs.keys() == ("a", "b") and graphs.get("a") == ("a", 0) and graphs.enabled


def test_a_full_retiring_cache_drops_every_entry_and_its_pool_together():
    graphs = cache(2, on_full="retire")
    for key in ("a", "b"):
        graphs.capture(key, lambda pool, key=key: (key, pool))
    assert graphs.capture("c", lambda pool: ("c", pool)) == ("c", 1)  # a new pool: no old graph's memory reused
    assert graphs.keys() == ("c",) and graphs.retired_generations == 1 and graphs.pool == 1


def test_a_failed_capture_turns_the_cache_off_for_good():
    graphs = cache(4)
    graphs.capture("a", lambda pool: "a")

    def failing(pool):
        raise RuntimeError("an op a graph cannot hold")

    assert graphs.capture("b", failing) is None and not graphs.enabled
    assert graphs.capture("c", lambda pool: pytest.fail("a cache that is off records nothing")) is None
    graphs.clear()
    assert len(graphs) == 0 and graphs.pool is None


def test_nothing_is_captured_inside_another_capture():
    graphs = GraphCache("test", 2, new_pool=lambda: 0, capturing=lambda: True)
    assert graphs.capture("a", lambda pool: pytest.fail("nested capture")) is None and graphs.enabled
    with pytest.raises(ValueError, match="max_graphs"):
        GraphCache("test", 0)
