"""The disk tier (G3) on real files, through real NIXL POSIX where it loads: restart survival,
checksums, truncation, a full disk, bad directories, foreign formats, crashes mid-write."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.block_format import BlockFormat
from kvstore.movers.disk_index import DiskTierError
from kvstore.movers.disk_pool import DiskConfig, DiskError, DiskPool
from kvstore.events import BlockStored, Tier
from kvstore.movers.file_io import OsFileIo
from kvstore.movers.host_pool import HostPool
from kvstore.movers.transfer import nixl_available
from tests.unit.kvstore._disk_tier_child import (
    FMT,
    open_pool,
    read_blocks,
    write_blocks,
)

ROOT = Path(__file__).resolve().parents[3]
CHILD = [sys.executable, str(Path(__file__).with_name("_disk_tier_child.py"))]


def child(*args: str, timeout: float = 60, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*(prefix or []), *CHILD, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


def last_json(p: subprocess.CompletedProcess):
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture
def pool(tmp_path):
    host, disk = open_pool(str(tmp_path), 16)
    yield host, disk
    disk.close()
    host.close()


def test_blocks_round_trip_through_nixl_posix_and_announce_the_disk_tier(pool):
    host, disk = pool
    assert disk.file_io.name.startswith("nixl") == nixl_available()
    assert write_blocks(host, disk, [11, 12, 13]) == [None] * 3
    events = disk.slots.take_events()
    assert events == [BlockStored((11,), None, Tier.DISK), BlockStored((12,), None, Tier.DISK),
                      BlockStored((13,), None, Tier.DISK)] or sum(len(e.block_hashes) for e in events) == 3
    assert all(e.tier == Tier.DISK for e in events)
    assert read_blocks(host, disk, [11, 12, 13, 14]) == {11: "ok", 12: "ok", 13: "ok", 14: "absent"}


def test_the_index_survives_a_restart_in_a_new_pool_and_a_new_process(tmp_path):
    host, disk = open_pool(str(tmp_path), 16)
    write_blocks(host, disk, [1, 2, 3, 4, 5])
    disk.close()
    host2, disk2 = open_pool(str(tmp_path), 16)
    assert sorted(disk2.slots.snapshot()) == [1, 2, 3, 4, 5]
    assert sum(len(e.block_hashes) for e in disk2.slots.take_events()) == 5     # the router relearns them
    assert set(read_blocks(host2, disk2, [1, 2, 3, 4, 5]).values()) == {"ok"}
    disk2.close()
    out = last_json(child("reopen", tmp_path, 16, "1,2,3,4,5,6"))
    assert out == {"1": "ok", "2": "ok", "3": "ok", "4": "ok", "5": "ok", "6": "absent"}


def test_a_restart_keeps_the_lru_order_of_writes(tmp_path):
    host, disk = open_pool(str(tmp_path), 4)
    write_blocks(host, disk, [1, 2, 3, 4])
    disk.close()
    host, disk = open_pool(str(tmp_path), 4)
    write_blocks(host, disk, [5])                  # the oldest write goes first
    assert read_blocks(host, disk, [1, 2, 5]) == {1: "absent", 2: "ok", 5: "ok"}
    disk.close()


def test_flipped_bytes_are_a_miss_counted_logged_and_dropped(pool, caplog):
    host, disk = pool
    write_blocks(host, disk, [21, 22, 23])
    slot = disk.slots.find(22)
    slab, off = disk._where(slot)
    with open(disk._slab_path(slab), "r+b") as f:   # bit rot, behind the tier's back
        f.seek(off + 1000)
        b = f.read(1)
        f.seek(off + 1000)
        f.write(bytes([b[0] ^ 0xFF]))
    assert read_blocks(host, disk, [21, 22, 23]) == {21: "ok", 22: "checksum", 23: "ok"}
    assert disk.errors[DiskError.CHECKSUM] == 1
    assert "read back bad" in caplog.text
    assert disk.slots.find(22) is None and 22 not in {r.block_hash for r in disk.index.rows()}


def test_a_block_read_from_the_wrong_slot_fails_its_checksum(pool):
    host, disk = pool
    write_blocks(host, disk, [31, 32])
    a, b = disk.slots.find(31), disk.slots.find(32)
    (sa, oa), (_, ob) = disk._where(a), disk._where(b)
    with open(disk._slab_path(sa), "r+b") as f:     # a misdirected write: 32's bytes in 31's slot
        f.seek(ob)
        other = f.read(FMT.block_bytes)
        f.seek(oa)
        f.write(other)
    assert read_blocks(host, disk, [31]) == {31: "checksum"}


def test_a_truncated_slab_turns_its_tail_into_misses_now_and_after_a_restart(tmp_path):
    host, disk = open_pool(str(tmp_path), 8, slab_slots=8)
    write_blocks(host, disk, [1, 2, 3, 4, 5, 6])
    os.truncate(disk._slab_path(0), int(2.5 * FMT.block_bytes))
    got = read_blocks(host, disk, [1, 2, 3, 4])
    assert got == {1: "ok", 2: "ok", 3: "truncated", 4: "truncated"}
    assert disk.errors[DiskError.TRUNCATED] == 2
    disk.close()
    host, disk = open_pool(str(tmp_path), 8, slab_slots=8)   # rows past the end are dropped at start-up
    assert sorted(disk.slots.snapshot()) == [1, 2]
    assert disk.errors[DiskError.TRUNCATED] == 2             # 5 and 6
    assert write_blocks(host, disk, [7, 8, 9, 10, 11, 12]) == [None] * 6   # the slab grew back
    assert set(read_blocks(host, disk, [1, 2, 7, 12]).values()) == {"ok"}
    disk.close()


def test_a_missing_or_non_directory_path_is_a_clear_start_up_error(tmp_path):
    with pytest.raises(DiskTierError, match="does not exist"):
        open_pool(str(tmp_path / "nope"), 4)
    (tmp_path / "file").write_text("x")
    with pytest.raises(DiskTierError, match="not a directory"):
        open_pool(str(tmp_path / "file"), 4)


def test_a_directory_too_small_is_a_clear_start_up_error(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(DiskTierError, match="too small"):
        open_pool(str(tmp_path), free // FMT.block_bytes + 1000)
    with pytest.raises(DiskTierError, match="less than one"):
        DiskPool(FMT, DiskConfig(str(tmp_path), FMT.block_bytes - 1), HostPool(FMT, FMT.block_bytes))


def _unshare_ok() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True).returncode == 0


def in_tmpfs(d: Path, opts: str) -> list[str]:
    """Run the child in a private mount namespace where ``d`` is a tmpfs mounted with ``opts``."""
    return ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o {opts} tmpfs "{d}" && exec "$@"', "sh"]


def test_an_unwritable_directory_is_a_clear_start_up_error(tmp_path):
    if os.geteuid() != 0:
        tmp_path.chmod(0o500)
        with pytest.raises(DiskTierError, match="not writable"):
            open_pool(str(tmp_path), 4)
        return
    if not _unshare_ok():                  # root writes anywhere: needs a read-only filesystem
        pytest.skip("needs unshare for a read-only mount")
    out = last_json(child("open", tmp_path, 4, prefix=in_tmpfs(tmp_path, "ro,size=1m")))
    assert "not writable" in out["error"]


def test_a_full_disk_stops_offloading_without_failing_anything(tmp_path):
    if not _unshare_ok():
        pytest.skip("needs unshare for a small tmpfs")
    out = last_json(child("full", tmp_path, prefix=in_tmpfs(tmp_path, "size=2m")))
    res = out["results"]
    assert res[:4] == [[None] * 4] * 4                # slab 0 filled
    assert res[4] == ["disk_full"] * 4                # slab 1 could not be created: nothing raised
    assert res[5:] == [[None] * 4] * 3                # LRU reuse inside the slab it has goes on
    assert out["full"] and out["usable"] == 16
    assert out["last"] == ["disk_full"] * 4           # not even the index can grow: still no exception
    assert out["again"] == [None] * 4                 # space freed: the index takes rows again
    assert out["errors"] == {"disk_full": 8}
    read = out["read"]
    assert set(read.values()) == {"ok", "absent"}
    ok = [h for h, v in read.items() if v == "ok"]
    assert "300" in ok and "200" not in ok and len(ok) == 16      # one slab's worth, LRU


def test_another_models_or_layouts_directory_is_refused(tmp_path):
    host, disk = open_pool(str(tmp_path), 4)
    write_blocks(host, disk, [1])
    disk.close()
    for other in (BlockFormat("other-model", 4, 4096, 16, "torch.float32"),
                  BlockFormat("tiny-test", 4, 4096, 16, "torch.bfloat16"),
                  BlockFormat("tiny-test", 8, 2048, 16, "torch.float32")):    # same block bytes
        with pytest.raises(DiskTierError, match="another model or layout"):
            DiskPool(other, DiskConfig(str(tmp_path), 4 * other.block_bytes), host)
    (tmp_path / "index.sqlite").unlink()
    with pytest.raises(DiskTierError, match="no index"):     # slabs without an index: not ours
        open_pool(str(tmp_path), 4)


def test_a_directory_in_use_by_another_worker_is_refused(pool, tmp_path):
    with pytest.raises(DiskTierError, match="in use"):
        open_pool(str(tmp_path), 16)


def test_os_file_io_is_a_drop_in_for_nixl(tmp_path):
    host, disk = open_pool(str(tmp_path), 8)
    disk.file_io.close()
    disk.file_io = OsFileIo()
    write_blocks(host, disk, [1, 2, 3])
    assert set(read_blocks(host, disk, [1, 2, 3]).values()) == {"ok"}
    disk.close()


# ---- crashes ------------------------------------------------------------------------------------
def test_a_crash_after_the_data_write_but_before_the_index_commit_trusts_nothing_stale(tmp_path):
    p = child("crash_before_index", tmp_path)
    assert p.returncode == 9
    out = last_json(child("reopen", tmp_path, 4, "1,2,3,4,5,6,7,8"))
    assert set(out.values()) == {"absent"}            # old rows removed first, new never added


def test_a_torn_write_leaves_no_block_the_index_would_trust(tmp_path):
    p = child("torn_write", tmp_path)
    assert p.returncode == 9
    out = last_json(child("reopen", tmp_path, 4, "1,2,3,4,5,6,7,8"))
    assert set(out.values()) == {"absent"}


def test_a_writer_killed_at_random_moments_never_leaves_a_bad_indexed_block(tmp_path):
    rnd = random.Random(0)
    for round_ in range(3):
        proc = subprocess.Popen([*CHILD, "loop", str(tmp_path), str(10**6 * (round_ + 1))], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        while (line := proc.stdout.readline()) and line.strip() != "ready":
            pass                          # NIXL's Python logger prints INFO lines on stdout
        assert line.strip() == "ready"
        time.sleep(rnd.uniform(0.0, 0.2))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        host, disk = open_pool(str(tmp_path), 16)
        held = disk.slots.snapshot()
        assert held, "the writer committed at least one batch before the kill"
        got = read_blocks(host, disk, held)
        assert set(got.values()) == {"ok"}, got
        disk.close()
        host.close()


def _flip(path: Path, offsets) -> None:
    with open(path, "r+b") as f:
        for off in offsets:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))


def _damage_header(d: Path) -> None:
    _flip(d / "index.sqlite", range(0, 16))                 # "SQLite format 3": not a database


def _damage_pages(d: Path) -> None:
    size = (d / "index.sqlite").stat().st_size
    _flip(d / "index.sqlite", range(4096, size, 97))        # every page after the first: malformed


def _damage_format_rows(d: Path) -> None:
    import sqlite3
    db = sqlite3.connect(d / "index.sqlite")                # a changed byte in a value, the file still valid
    db.execute("UPDATE meta SET value = 'tiny-tesT' WHERE key = 'model'")
    db.commit()
    db.close()


def _damage_everything(d: Path) -> None:
    rng = random.Random(7)
    for p in [d / "index.sqlite", *d.glob("slab-*.kv")]:
        size = p.stat().st_size
        _flip(p, sorted({rng.randrange(size) for _ in range(64)} | set(range(0, 16))))


@pytest.mark.parametrize("damage", [_damage_header, _damage_pages, _damage_format_rows, _damage_everything])
def test_a_damaged_index_is_set_aside_counted_logged_once_and_the_tier_starts_empty(tmp_path, damage, caplog):
    host, disk = open_pool(str(tmp_path), 16, slab_slots=8)
    for batch in (range(1, 7), range(7, 13)):                     # two slabs' worth
        assert write_blocks(host, disk, list(batch)) == [None] * 6
    disk.close()
    host.close()
    damage(tmp_path)
    host, disk = open_pool(str(tmp_path), 16, slab_slots=8)          # no exception: the worker comes up
    try:
        assert disk.errors[DiskError.INDEX_DAMAGED] == 1
        assert disk.slots.snapshot() == [] and disk.index.rows() == []
        [aside] = tmp_path.glob("damaged-*")
        assert {p.name for p in aside.iterdir()} >= {"index.sqlite", "slab-000000.kv", "slab-000001.kv"}
        assert not list(tmp_path.glob("slab-*.kv"))
        warnings = [r for r in caplog.records if r.levelname == "WARNING" and "set it aside" in r.getMessage()]
        assert len(warnings) == 1 and str(aside) in warnings[0].getMessage()
        assert write_blocks(host, disk, [101, 102]) == [None, None]          # an empty, working tier
        assert read_blocks(host, disk, [101, 102, 1]) == {101: "ok", 102: "ok", 1: "absent"}
    finally:
        disk.close()
        host.close()
    host, disk = open_pool(str(tmp_path), 16, slab_slots=8)           # and a clean one on the next start
    assert sorted(disk.slots.snapshot()) == [101, 102] and disk.errors[DiskError.INDEX_DAMAGED] == 0
    disk.close()
    host.close()


def test_a_second_damage_replaces_the_first_set_aside(tmp_path):
    for _ in range(2):
        host, disk = open_pool(str(tmp_path), 16, slab_slots=8)
        write_blocks(host, disk, [1, 2])
        disk.close()
        host.close()
        _damage_header(tmp_path)
        time.sleep(1.01)                 # the set's name carries the second
    host, disk = open_pool(str(tmp_path), 16, slab_slots=8)
    disk.close()
    host.close()
    assert len(list(tmp_path.glob("damaged-*"))) == 1
