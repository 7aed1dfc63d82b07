"""`splitserve serve` with the KV tiers, stopped and started again on the same --kv-disk-dir: the
restarted cluster serves a prompt the first one saw from disk (its merged /metrics count disk hits)
with identical tokens, and a tiny --num-blocks makes the first one offload and onboard."""

from __future__ import annotations


import httpx
import pytest

from .cluster import metric, start_cluster, until

pytestmark = pytest.mark.slow

PROMPT = " ".join(f"word{i}" for i in range(60))      # a few full KV blocks of the tiny model


def tiered(tmp_path, disk_dir):
    return start_cluster(tmp_path, "--model", "tiny", "--prefill-workers", "0", "--num-blocks", "16",
                         "--kv-host-gib", "0.002", "--kv-disk-gib", "0.02", "--kv-disk-dir", str(disk_dir),
                         "--kv-onboard", "always", "--kv-host-copy", "torch")


def complete(c) -> list[int]:
    r = httpx.post(f"{c.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 6,
                                                    "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_restarted_cluster_serves_a_prompt_seen_before_from_disk(tmp_path):
    disk = tmp_path / "kv"
    disk.mkdir()
    c = tiered(tmp_path / "one", disk)
    try:
        first = complete(c)
        assert complete(c) == first                       # a second use: worth a disk write
        until(lambda: metric(c.url, "splitserve_kv_tier_blocks", tier="disk") >= 3, 20, 0.2, "blocks written to disk")
    finally:
        assert c.stop() == 0, c.log()[-3000:]
    assert (disk / "aggregated-0" / "index.sqlite").exists()         # the worker's own subdirectory

    c = tiered(tmp_path / "two", disk)
    try:
        assert complete(c) == first
        until(lambda: metric(c.url, "splitserve_kv_hits_total", tier="disk") >= 3, 10, 0.2, "disk hits in /metrics")
        assert metric(c.url, "splitserve_kv_hits_total", tier="device") == 0
        # a prompt the workers' 16 blocks cannot hold: a 400 before any stream starts, not an
        # error inside a 200 stream
        for stream in (False, True):
            r = httpx.post(f"{c.url}/v1/completions", json={"model": "tiny", "prompt": [5] * 300, "max_tokens": 2,
                                                            "stream": stream}, timeout=30)
            assert r.status_code == 400 and "holds at most 256 tokens" in r.json()["error"]["message"], r.text
    finally:
        assert c.stop() == 0, c.log()[-3000:]
    assert "Traceback" not in c.log(), c.log()[-3000:]


def test_a_damaged_disk_tier_never_keeps_the_cluster_down(tmp_path):
    """Bytes flipped in every file under --kv-disk-dir, the index among them: the restarted cluster
    comes up and serves the same tokens (recomputed), the damaged files set aside and counted."""
    disk = tmp_path / "kv"
    disk.mkdir()
    c = tiered(tmp_path / "one", disk)
    try:
        first = complete(c)
        assert complete(c) == first
        until(lambda: metric(c.url, "splitserve_kv_tier_blocks", tier="disk") >= 3, 20, 0.2, "blocks written to disk")
    finally:
        assert c.stop() == 0, c.log()[-3000:]
    for p in (disk / "aggregated-0").iterdir():
        if p.is_file() and p.name != "lock":
            data = bytearray(p.read_bytes())
            for off in range(0, len(data), max(len(data) // 64, 1)):
                data[off] ^= 0xFF
            p.write_bytes(bytes(data))

    c = tiered(tmp_path / "two", disk)
    try:
        assert complete(c) == first
        until(lambda: metric(c.url, "splitserve_kv_tier_errors_total", reason="index_damaged") == 1, 10, 0.2,
              "the damaged index counted")
        assert metric(c.url, "splitserve_kv_hits_total", tier="disk") == 0
    finally:
        assert c.stop() == 0, c.log()[-3000:]
    assert list((disk / "aggregated-0").glob("damaged-*/index.sqlite"))
    assert c.log().count("set it aside with its slabs") == 1 and "Traceback" not in c.log(), c.log()[-3000:]
