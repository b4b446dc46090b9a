"""The data-parallel routing rule (engine/dp_client.py), on counts: least loaded, prefix affinity unless much
busier, n > 1 siblings together, dead engines skipped; and the per-engine thread split."""

from __future__ import annotations

import os

from tokenspout.config import EngineConfig
from tokenspout.engine.dp_client import AFFINITY_SLACK, AFFINITY_TOKENS, EngineRouter, engine_configs

A = list(range(100, 200))
B = list(range(300, 400))


def test_least_loaded_then_lowest_index():
    r = EngineRouter(3)
    picks = [r.pick(f"r{i}", [i] * 70, [0, 1, 2]) for i in range(6)]  # distinct prefixes
    assert picks == [0, 1, 2, 0, 1, 2] and r.load == [2, 2, 2]
    r.finished(1)
    assert r.pick("x", [999] * 70, [0, 1, 2]) == 1


def test_prefix_affinity_holds_until_the_engine_is_much_busier():
    r = EngineRouter(2)
    first = r.pick("a0", A, [0, 1])
    assert first == 0
    r.pick("b0", B, [0, 1])  # engine 1
    # Same first AFFINITY_TOKENS tokens (different tails): back to engine 0 while within the slack.
    same = [r.pick(f"a{i}", A[:AFFINITY_TOKENS] + [i], [0, 1]) for i in range(1, 2 + AFFINITY_SLACK)]
    assert same == [0] * (1 + AFFINITY_SLACK) and r.load == [2 + AFFINITY_SLACK, 1]
    # Now engine 0 holds more than min load + slack: the prefix moves to the idle engine, and stays there.
    assert r.pick("a-next", A, [0, 1]) == 1
    assert r.pick("a-after", A, [0, 1]) == 1


def test_siblings_of_an_n_request_stay_together():
    r = EngineRouter(2)
    r.pick("busy", B, [0, 1])  # engine 0 busier
    ids = [r.pick(f"{i}_req", A, [0, 1]) for i in range(4)]  # children 0_req .. 3_req, added in a row
    assert len(set(ids)) == 1
    # A lone id that merely looks like a child, or a gap in the indices, is routed on its own merits.
    assert r.pick("7_req", [5] * 70, [0, 1]) == 0


def test_dead_engines_are_skipped():
    r = EngineRouter(3)
    assert {r.pick(f"r{i}", [i] * 70, [0, 2]) for i in range(5)} == {0, 2}
    r.engine_lost(2)
    assert r.load[2] == 0


def test_threads_are_divided_among_the_engines():
    cores = len(os.sched_getaffinity(0))
    configs = engine_configs(EngineConfig(data_parallel_size=2))
    assert len(configs) == 2 and all(c.num_threads == max(1, cores // 2) and c.data_parallel_size == 1
                                     for c in configs)
    assert all(c.num_threads == 3 for c in engine_configs(EngineConfig(data_parallel_size=2, num_threads=3)))
