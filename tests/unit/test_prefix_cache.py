"""Prefix caching in the KV cache manager (no model): the hash chain, reference counts, LRU eviction, no sharing of
partial blocks, all-or-nothing allocation; and the scheduler starting requests from cached blocks."""

from __future__ import annotations

import hashlib
from array import array

import pytest

from tokenspout.config import SchedulerConfig
from tokenspout.core.block_hash import ROOT, extend_block_hashes, hash_block
from tokenspout.core.block_pool import BlockPool
from tokenspout.core.kv_cache_manager import BlockAsk, KVCacheManager
from tokenspout.core.request import Request
from tokenspout.core.scheduler import Scheduler
from tokenspout.engine.messages import EngineCoreRequest
from tokenspout.sampling_params import SamplingParams
from tokenspout.step_io import ModelRunnerOutput

BS = 4


def req(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(EngineCoreRequest(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                   seed=0, max_model_len=1024)


def run_prefill(kv: KVCacheManager, r: Request) -> list[int]:
    """Admits r the way the scheduler does, pretends its whole prompt was computed, records its blocks."""
    hit = kv.find_cached(r)
    r.num_computed_tokens = len(hit) * BS
    assert kv.allocate(r.request_id, r.num_tokens, hit) is not None
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)
    return hit


def test_hash_chain_is_sha256_of_parent_and_tokens():
    toks = list(range(10))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, toks, 2, BS)
    h0 = hashlib.sha256(ROOT + array("q", toks[:4]).tobytes()).digest()
    assert hashes == [h0, hashlib.sha256(h0 + array("q", toks[4:8]).tobytes()).digest()]
    # a block's hash depends on everything before it, not only on its own tokens
    other: list[bytes] = []
    extend_block_hashes(other, [99] + toks[1:], 2, BS)
    assert other[0] != hashes[0] and other[1] != hashes[1]
    assert hash_block(ROOT, [1, 2]) != hash_block(ROOT, [2, 1])
    extend_block_hashes(hashes, toks, 2, BS)  # idempotent: never recomputed
    assert len(hashes) == 2
    with pytest.raises(ValueError, match="exceed"):
        extend_block_hashes(hashes, toks, 3, BS)  # 12 tokens of blocks from 10 tokens: the last is not full


def test_common_prefix_is_shared_and_ref_counted():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = req("a", list(range(10)))  # blocks [0..3] [4..7] and a partial one
    assert run_prefill(kv, a) == []
    b = req("b", list(range(8)) + [50, 51, 52])
    hit = run_prefill(kv, b)
    assert hit == kv.blocks_of("a")[:2]
    assert kv.blocks_of("b")[:2] == hit and kv.blocks_of("b")[2] != kv.blocks_of("a")[2]
    assert [kv.pool.ref_count[x] for x in hit] == [2, 2]
    kv.free("a")
    assert [kv.pool.ref_count[x] for x in hit] == [1, 1]
    kv.free("b")
    assert kv.num_free_blocks == 16 and kv.pool.num_cached == 2  # freed, still findable
    c = req("c", list(range(8)) + [7])
    assert kv.find_cached(c) == hit


def test_partial_and_last_blocks_are_never_shared():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = req("a", list(range(6)))  # one full block, one partial
    run_prefill(kv, a)
    assert kv.pool.num_cached == 1  # the partial block is not recorded
    # Same 6 tokens: only the full block is reused, the last tokens are computed again.
    assert kv.find_cached(req("b", list(range(6)))) == kv.blocks_of("a")[:1]
    # Exactly one full block of prompt: its last token must be computed to sample, so no hit at all.
    c = req("c", list(range(4)))
    assert kv.find_cached(c) == []
    # As the sequence grows, its second block becomes full and is recorded then.
    a.token_ids += [6, 7, 8]
    a.num_computed_tokens = 8
    assert kv.allocate("a", 9) is not None
    kv.cache_full_blocks(a)
    assert kv.pool.num_cached == 2
    assert kv.find_cached(req("d", list(range(9)))) == kv.blocks_of("a")[:2]


def test_uncomputed_tokens_are_not_cached():
    """Only blocks whose every position is computed (num_computed_tokens) are recorded: drafts in flight and
    scheduled-but-not-run tokens never are."""
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = req("a", list(range(12)))
    assert kv.allocate("a", 12) is not None
    a.num_computed_tokens = 7
    kv.cache_full_blocks(a)
    assert kv.pool.num_cached == 1
    a.num_computed_tokens = 12
    kv.cache_full_blocks(a)
    assert kv.pool.num_cached == 3


def test_lru_eviction_only_when_a_fresh_block_is_needed():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = req("a", list(range(9)))  # 2 full blocks + 1
    b = req("b", list(range(100, 109)))
    run_prefill(kv, a)
    run_prefill(kv, b)
    a_blocks, b_blocks = kv.blocks_of("a"), kv.blocks_of("b")
    kv.free("a")
    kv.free("b")
    assert kv.pool.num_cached == 4 and kv.num_free_blocks == 6
    # The two partial (unhashed) blocks are reused first; the cache is intact after taking them.
    assert kv.allocate("x", 8) is not None
    assert set(kv.blocks_of("x")) == {a_blocks[2], b_blocks[2]}
    assert kv.pool.num_cached == 4
    # The next fresh block evicts a's tail (freed first, and a tail before its head), then a's head.
    assert kv.allocate("y", 4) == [a_blocks[1]]
    assert kv.find_cached(req("a2", list(range(9)))) == a_blocks[:1]
    assert kv.allocate("z", 4) == [a_blocks[0]]
    assert kv.find_cached(req("a3", list(range(9)))) == []
    assert kv.find_cached(req("b2", list(range(100, 109)))) == b_blocks[:2]


def test_touching_a_free_cached_block_protects_it_from_eviction():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(9)))
    run_prefill(kv, a)  # 3 blocks
    kv.free("a")
    b = req("b", list(range(8)) + [42])
    hit = kv.find_cached(b)
    assert len(hit) == 2
    # 9 tokens = 3 blocks: 2 hits (free, so they count against the free queue) + 1 fresh = 3 <= 4
    assert kv.allocate("b", 9, hit) is not None
    assert kv.blocks_of("b")[:2] == hit and kv.blocks_of("b")[2] not in hit
    assert kv.num_free_blocks == 1
    # Hits that are free count as taken: a request needing 2 hits + 3 fresh blocks does not fit in 4.
    kv.free("b")
    c = req("c", list(range(8)) + list(range(60, 71)))
    hit = kv.find_cached(c)
    assert len(hit) == 2
    assert kv.allocate("c", 19, hit) is None
    assert kv.num_free_blocks == 4 and kv.blocks_of("c") == [] and kv.pool.num_cached == 2


def test_pair_allocation_is_all_or_nothing_and_hits_survive_fresh_takes():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    a = req("a", list(range(9)))
    run_prefill(kv, a)
    kv.free("a")
    hit = kv.find_cached(req("p", list(range(8)) + [1]))
    # The request reuses 2 cached blocks and needs 1 fresh; its companion needs 3 fresh: 6 > 5, nothing happens.
    assert not kv.allocate_all([BlockAsk("p", 9, hit), BlockAsk("p#cfg", 12)])
    assert kv.num_free_blocks == 5 and kv.blocks_of("p") == [] and kv.blocks_of("p#cfg") == []
    # With 2 fresh for the companion it fits exactly, and no fresh block is one of the hits (evicted under them).
    assert kv.allocate_all([BlockAsk("p", 9, hit), BlockAsk("p#cfg", 8)])
    assert kv.blocks_of("p")[:2] == hit
    assert not set(kv.blocks_of("p#cfg")) & set(kv.blocks_of("p"))
    assert kv.num_free_blocks == 0


def test_disabled_prefix_caching_shares_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = req("a", list(range(9)))
    run_prefill(kv, a)
    kv.free("a")
    assert kv.pool.num_cached == 0 and kv.find_cached(req("b", list(range(9)))) == []


def test_block_pool_refuses_double_release():
    pool = BlockPool(2)
    blocks = pool.take(1)
    pool.release(blocks)
    with pytest.raises(RuntimeError, match="released"):
        pool.release(blocks)


def test_scheduler_starts_from_cache_and_counts_hits():
    """Two requests with a common 3-block prefix: the second starts with 12 computed tokens and schedules 2;
    a preempted request resumes from its own cached blocks."""
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, max_model_len=1024)
    prefix = list(range(12))
    sched.add_request(req("a", prefix + [90, 91]))
    out = sched.schedule()
    assert [e.num_new_tokens for e in out.scheduled] == [14]
    sched.update_from_output(out, ModelRunnerOutput(sampled={"a": [5]}))
    sched.add_request(req("b", prefix + [80, 81]))
    out = sched.schedule()
    news = {e.request.request_id: e.num_new_tokens for e in out.scheduled}
    assert news == {"a": 1, "b": 2}
    b = sched.requests["b"]
    assert b.num_computed_tokens == 12 and kv.blocks_of("b")[:3] == kv.blocks_of("a")[:3]
    outs = sched.update_from_output(out, ModelRunnerOutput(sampled={"a": [6], "b": [7]}))
    assert {o.request_id: o.num_cached_tokens for o in outs} == {"a": 0, "b": 12}
    st = sched.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (28, 12)
    # Preempt b: it resumes from the cached blocks holding its prompt and first output (not the partial block).
    sched._preempt(b)
    assert b.num_computed_tokens == 0 and kv.blocks_of("b") == []
    out = sched.schedule()
    news = {e.request.request_id: e.num_new_tokens for e in out.scheduled}
    assert b.num_computed_tokens == 12 and news["b"] == b.num_tokens - 12 == 3
