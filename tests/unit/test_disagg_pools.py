"""The router's worker pools as pure logic: registration, health, load-aware
and cache-aware choice, cache keys, LRU bounds. No network."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foveal.disagg.pools import (MediaAffinity, OwnerCache, PrefixAffinity, RouterPools, WorkerPool,
                                 media_keys, normalize_worker_url, prefix_keys)
from foveal.errors import ConfigError

A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


def healthy_pool(role: str, urls=(A, B), **options) -> WorkerPool:
    affinity = {"encode": MediaAffinity, "prefill": PrefixAffinity}.get(role)
    pool = WorkerPool(role, affinity=affinity(options.pop("capacity", 1000)) if affinity else None,
                      **options)
    for url in urls:
        pool.add(url, healthy=True)
    return pool


def image_chat(*urls: str, text: str = "what is this?") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"messages": [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]}


def test_registration_normalizes_urls_and_is_idempotent():
    pool = WorkerPool("decode")
    first = pool.add(A + "/")
    assert pool.add(A) is first and len(pool) == 1
    assert first.url == A and not first.healthy  # unknown until its first health check
    assert pool.remove(A) is first and len(pool) == 0
    assert pool.remove(A) is None


@pytest.mark.parametrize("url", ["10.0.0.1:8000", "ftp://host", "http://", None])
def test_bad_worker_url_is_a_config_error(url):
    with pytest.raises(ConfigError, match="http"):
        normalize_worker_url(url)


def test_unknown_role_is_a_config_error():
    with pytest.raises(ConfigError, match="encode, prefill, decode"):
        RouterPools()["vision"]


def test_unhealthy_and_excluded_workers_are_never_chosen():
    pool = healthy_pool("decode", (A, B, C))
    pool.mark_failed(pool.get(B))
    assert pool.get(B).failures == 1 and not pool.get(B).healthy
    chosen = {pool.choose(exclude=[A]).url for _ in range(6)}
    assert chosen == {C}
    pool.record_health(pool.get(C), False)
    assert pool.choose(exclude=[A]) is None


def test_good_health_check_brings_a_failed_worker_back():
    pool = healthy_pool("decode", (A,))
    pool.mark_failed(pool.get(A))
    assert pool.choose() is None
    pool.record_health(pool.get(A), True)
    assert pool.choose().url == A


def test_worker_down_past_remove_after_is_removed():
    pool = healthy_pool("decode", (A, B))
    pool.record_health(pool.get(A), False, now=100.0)
    assert pool.remove_expired(30.0, now=129.0) == []
    pool.record_health(pool.get(A), False, now=120.0)  # still counted from the first failure
    assert [worker.url for worker in pool.remove_expired(30.0, now=130.0)] == [A]
    assert [worker.url for worker in pool.workers] == [B]


def test_worker_never_healthy_is_kept_while_it_loads():
    pool = WorkerPool("decode", [A])
    pool.record_health(pool.get(A), False, now=0.0)
    assert pool.remove_expired(30.0, now=1000.0) == []


def test_recovery_resets_the_removal_clock():
    pool = healthy_pool("decode", (A,))
    pool.record_health(pool.get(A), False, now=0.0)
    pool.record_health(pool.get(A), True, now=20.0)
    pool.record_health(pool.get(A), False, now=25.0)
    assert pool.remove_expired(30.0, now=50.0) == []


def test_decode_picks_least_loaded_then_round_robin():
    pool = healthy_pool("decode", (A, B, C))
    pool.begin(pool.get(A))
    assert [pool.choose().url for _ in range(4)] == [B, C, B, C]
    pool.finish(pool.get(A))
    assert [pool.choose().url for _ in range(3)] == [A, B, C]


def test_same_image_goes_to_the_same_encode_worker():
    pool = healthy_pool("encode", (A, B, C))
    keys = media_keys(image_chat("data:image/png;base64,AAAA"))
    first = pool.choose(keys).url
    for _ in range(5):
        assert pool.choose(media_keys(image_chat("data:image/png;base64,AAAA", text="again"))).url == first


def test_encode_prefers_the_worker_holding_most_of_the_images():
    pool = healthy_pool("encode", (A, B))
    pool.affinity.record(media_keys(image_chat("u1")), A)
    pool.affinity.record(media_keys(image_chat("u2", "u3")), B)
    assert pool.choose(media_keys(image_chat("u1", "u2", "u3"))).url == B


def test_second_chat_turn_returns_to_the_first_turns_prefill_worker():
    pool = healthy_pool("prefill", (A, B, C))
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    other = [{"role": "user", "content": "unrelated"}]
    first = pool.choose(prefix_keys({"messages": turn1})).url
    assert pool.choose(prefix_keys({"messages": other})).url != first  # no cache: spread the load
    assert pool.choose(prefix_keys({"messages": turn2})).url == first


def test_prefill_prefers_the_longest_matching_prefix():
    pool = healthy_pool("prefill", (A, B))
    messages = [{"role": "user", "content": str(index)} for index in range(4)]
    pool.affinity.record(prefix_keys({"messages": messages[:1]}), A)
    pool.affinity.record(prefix_keys({"messages": messages[:3]}), B)
    pool.begin(pool.get(B))
    assert pool.choose(prefix_keys({"messages": messages})).url == B


def test_completion_prompts_share_prefix_keys_per_chunk():
    base = "x" * 600
    short, extended = prefix_keys({"prompt": base}), prefix_keys({"prompt": base + "more"})
    assert len(short) == 3 and short[:2] == extended[:2]  # two full 256-character chunks
    assert prefix_keys({}) == []


def test_busy_cache_holder_loses_to_an_idle_worker_past_the_slack():
    pool = healthy_pool("encode", (A, B), load_slack=2)
    keys = media_keys(image_chat("u1"))
    pool.affinity.record(keys, A)
    for _ in range(2):
        pool.begin(pool.get(A))
    assert pool.choose(keys).url == A  # 2 busier: within the slack
    pool.begin(pool.get(A))
    assert pool.choose(keys).url == B  # 3 busier: over it
    assert pool.affinity.owner(keys[0]) == B  # the keys now live with the choice


def test_media_keys_count_only_image_and_video_parts_once_each():
    body = image_chat("u1", "u1")
    body["messages"][0]["content"] += [{"type": "video_url", "video_url": {"url": "v1"}},
                                       {"type": "input_audio", "input_audio": {"data": "x"}}]
    body["messages"].append({"role": "assistant", "content": "plain text"})
    assert len(media_keys(body)) == 2
    assert media_keys({"prompt": "no media"}) == []


def test_owner_cache_evicts_least_recently_used():
    cache = OwnerCache(capacity=2)
    cache.record(["k1", "k2"], A)
    cache.record(["k1"], B)  # k1 is now the most recent
    cache.record(["k3"], A)
    assert cache.owner("k2") is None and cache.owner("k1") == B and len(cache) == 2


@settings(max_examples=50, deadline=None)
@given(capacity=st.integers(1, 20),
       batches=st.lists(st.tuples(st.lists(st.text(max_size=3), max_size=8), st.sampled_from([A, B]))))
def test_owner_cache_never_exceeds_capacity_and_keeps_the_latest(capacity, batches):
    cache = OwnerCache(capacity)
    for keys, url in batches:
        cache.record(keys, url)
        assert len(cache) <= capacity
        if keys:
            assert cache.owner(keys[-1]) == url


@settings(max_examples=100, deadline=None)
@given(loads=st.lists(st.tuples(st.integers(0, 12), st.booleans()), min_size=1, max_size=5),
       history=st.lists(st.tuples(st.lists(st.sampled_from("abcdef"), max_size=4), st.integers(0, 4))),
       request=st.lists(st.sampled_from("abcdef"), min_size=1, max_size=4),
       slack=st.integers(0, 5))
def test_choice_is_healthy_and_never_busier_than_the_slack_allows(loads, history, request, slack):
    urls = [f"http://10.0.0.{index}:8000" for index in range(len(loads))]
    pool = WorkerPool("encode", affinity=MediaAffinity(50), load_slack=slack)
    for url, (in_flight, healthy) in zip(urls, loads):
        pool.add(url, healthy=True).in_flight = in_flight
        pool.record_health(pool.get(url), healthy)
    for keys, owner in history:
        pool.affinity.record(keys, urls[owner % len(urls)])
    chosen = pool.choose(request)
    healthy = pool.healthy_workers()
    if not healthy:
        assert chosen is None
        return
    assert chosen.healthy
    assert chosen.in_flight <= min(worker.in_flight for worker in healthy) + slack
    assert all(pool.affinity.owner(key) == chosen.url for key in request)


def test_leaving_worker_drops_its_cache_entries():
    pools = RouterPools(cache_entries=100)
    for pool in (pools.encode, pools.prefill):
        pool.add(A, healthy=True)
        pool.add(B, healthy=True)
    keys = media_keys(image_chat("u1", "u2"))
    pools.encode.affinity.record(keys, A)
    pools.prefill.affinity.record(prefix_keys({"prompt": "p"}), A)
    pools.encode.affinity.record(["other"], B)
    pools.encode.remove(A)
    pools.prefill.remove(A)
    assert len(pools.encode.affinity) == 1 and len(pools.prefill.affinity) == 0
    assert all(pools.encode.affinity.owner(key) is None for key in keys)


def test_describe_lists_each_pool():
    pools = RouterPools(decode=[A])
    pools.decode.add(A, healthy=True)
    pools.decode.begin(pools.decode.get(A))
    assert pools.describe() == {"encode": [], "prefill": [], "decode": [
        {"url": A, "healthy": True, "in_flight": 1, "served": 0, "failures": 0}]}
