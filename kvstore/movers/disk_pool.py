"""The disk tier (G3): block slots in slab files under one directory, an index that survives a
restart, a checksum on every block, and a clear refusal of anything it cannot trust.

Layout of ``--kv-disk-dir``::

    lock              flock'ed while a worker uses the directory (two workers would corrupt it)
    index.sqlite      the durable index (disk_index.py): format, and slot -> (hash, parent, checksum)
    slab-000000.kv    slots 0 .. slab_slots-1, block_bytes each, block-major like the host tier
    slab-000001.kv    ...  (created on first use, fully preallocated with posix_fallocate)

Capacity is ``--kv-disk-gib`` rounded down to whole blocks. Start-up checks, each a DiskTierError
with the reason: the directory exists, is a directory and is writable; no other worker holds it;
its index (if any) was written for this BlockFormat; the filesystem has room for the capacity
(free space plus our existing slabs). Slab files without an index are refused (not ours).

A damaged index (disk_index.py: SQLite cannot read it, its pages or its format rows fail their
checks) never keeps a worker down: it and its slabs are set aside, renamed into
``damaged-<unix time>/`` in the directory (the one such set kept: an older one is removed), logged
once, counted (reason ``index_damaged``), and the tier starts empty. Damaged slabs under an intact
index are misses block by block, as below.

Writing a batch (``write``), in this order, so that a crash at any point leaves no indexed block
whose bytes are not the ones its checksum was taken from:
  1. remove the rows of slots about to be overwritten (one transaction, committed);
  2. create missing slabs (posix_fallocate: a full disk fails here, not half-way through a block);
  3. checksum each block in host memory: xxh3-64 seeded with the block's hash, so a block read
     from the wrong slot fails too (while step 4's I/O is in flight; the host slots are pinned);
  4. write the bytes (file_io.py: NIXL POSIX), then fdatasync each slab touched;
  5. add the rows (one transaction, committed).
Reading a batch (``read``) verifies every block against its row; a block that fails (checksum
mismatch, a short read of a truncated file, an I/O error) is a miss for the caller, counted by
reason in ``errors``, logged, and removed from the index. At start-up, rows pointing past the end
of their slab file (truncated) or past the capacity are dropped the same way.

A full disk: creating a slab fails with ENOSPC (or a write fails and the filesystem has less than
a block free): the batch's blocks are not written, ``full`` is set, and the slots that would have
needed new storage are retired from the table; existing slabs keep serving and being reused in
LRU order, and with none there is simply no disk tier. Nothing fails upward.

Threads: the constructor runs at start-up; then ``slots`` (the SlotTable: lookups, reservations,
pins) belongs to the engine's step loop, and ``write``/``read``/``probe`` (blocking I/O, the index,
the slabs) to the tier's I/O thread (kvstore/tiers.py). They share nothing else.

Admission (which blocks are worth a write) is the caller's (kvstore/pools/admission.py).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import sqlite3
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import xxhash

from kvstore.block_format import BlockFormat
from kvstore.movers.disk_index import DiskIndex, DiskIndexDamaged, DiskTierError, IndexRow
from kvstore.events import Tier
from kvstore.movers.file_io import FileIo, FileIoError, make_file_io
from kvstore.movers.host_pool import PAGE_BYTES, HostPool
from kvstore.pools.slot_table import SlotTable

log = logging.getLogger(__name__)

_U64 = (1 << 64) - 1
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
INDEX_HEADROOM_BYTES = 1 << 20   # room the start-up check keeps for the index (its WAL, ~64 B a row)


class DiskError(Enum):
    """Why a disk block was not served or not stored (the ``reason`` label of the error counter)."""
    CHECKSUM = "checksum"        # bytes differ from what was written
    TRUNCATED = "truncated"      # the slab file ends before the block does
    READ_ERROR = "read_error"
    WRITE_ERROR = "write_error"
    DISK_FULL = "disk_full"
    MISSING = "missing"          # the index no longer has it (dropped meanwhile)
    INDEX_DAMAGED = "index_damaged"   # the index could not be read at start-up: set aside with its slabs


@dataclass(frozen=True, slots=True)
class DiskConfig:
    directory: str
    capacity_bytes: int
    slab_bytes: int = 1 << 30        # slots per slab file = slab_bytes // block_bytes (at least 1)
    direct_io: bool = True           # O_DIRECT where the filesystem and the block size allow
    file_io: str = "auto"            # auto | nixl | nixl-uring | os (file_io.make_file_io)
    checksum_threads: int = 4        # threads hashing a batch's blocks (1: the I/O thread alone)


@dataclass(frozen=True, slots=True)
class WriteItem:
    slot: int            # disk slot, reserved (FILLING) by the caller
    block_hash: int
    parent: int | None
    host_slot: int       # where the bytes are (pinned by the caller until the write returns)


@dataclass(frozen=True, slots=True)
class ReadItem:
    slot: int            # disk slot, READY and pinned by the caller
    block_hash: int
    host_slot: int       # destination, FILLING in the host tier


class DiskPool:
    def __init__(self, fmt: BlockFormat, cfg: DiskConfig, host: HostPool, emit_events: bool = True) -> None:
        self.fmt = fmt
        self.cfg = cfg
        self.host = host
        self.dir = Path(cfg.directory)
        self.block_bytes = fmt.block_bytes
        self.num_slots = cfg.capacity_bytes // fmt.block_bytes
        if self.num_slots < 1:
            raise DiskTierError(f"--kv-disk-gib gives {cfg.capacity_bytes} bytes, less than one "
                                f"KV block ({fmt.block_bytes} bytes)")
        self.errors: Counter[DiskError] = Counter()
        self.full = False
        self._lock_fd = _check_and_lock(self.dir)
        self._fds: dict[int, int] = {}          # slab index -> fd
        self._hash_pool = ThreadPoolExecutor(cfg.checksum_threads, "kv-disk-xxh") if cfg.checksum_threads > 1 else None
        try:
            self._open(fmt, emit_events)
        except BaseException:
            self.close()
            raise

    # ---- start-up --------------------------------------------------------------------------
    def _open(self, fmt: BlockFormat, emit_events: bool) -> None:
        index_path = self.dir / "index.sqlite"
        if not index_path.exists() and any(self.dir.glob("slab-*.kv")):
            raise DiskTierError(f"{self.dir} has slab files but no index.sqlite: not a directory this "
                                "worker wrote; use another --kv-disk-dir or empty this one")
        slab_slots = max(1, self.cfg.slab_bytes // self.block_bytes)
        try:
            self.index = DiskIndex(index_path, fmt, slab_slots)
            self.index.rows()                     # every row readable, before any slab is trusted
        except DiskIndexDamaged as e:
            self._set_aside(e)
            self.index = DiskIndex(index_path, fmt, slab_slots)
        self.slab_slots = self.index.slab_slots
        self.num_slabs = -(-self.num_slots // self.slab_slots)
        self.direct = self.cfg.direct_io and self.block_bytes % PAGE_BYTES == 0
        self._remove_slabs_beyond(self.num_slabs)
        self._check_space()
        self.file_io: FileIo = make_file_io(self.cfg.file_io, host_addr=self.host.base_addr,
                                            host_nbytes=self.host.capacity_bytes)
        sizes = self._existing_slabs()
        rows = self._load_rows(sizes)
        for i in sizes:
            self._open_slab(i, create=False)    # a short (truncated) slab is extended again
        self._rows: dict[int, IndexRow] = {r.slot: r for r in rows}
        self.slots = SlotTable(self.num_slots, Tier.DISK, emit_events)
        self.slots.restore([(r.slot, r.block_hash, r.parent) for r in rows])
        log.info("disk KV tier at %s: %d slots of %d bytes in %d slabs (%s I/O, %s), %d blocks restored",
                 self.dir, self.num_slots, self.block_bytes, self.num_slabs,
                 "direct" if self.direct else "buffered", self.file_io.name, len(rows))

    def _set_aside(self, why: DiskIndexDamaged) -> None:
        """Move the damaged index and its slabs into damaged-<time>/ (replacing an older such set)."""
        if getattr(self, "index", None) is not None:
            self.index.close()
            self.index = None  # type: ignore[assignment]
        for old in self.dir.glob("damaged-*"):
            shutil.rmtree(old, ignore_errors=True)
        aside = self.dir / f"damaged-{int(time.time())}"
        aside.mkdir()
        moved = [p for p in self.dir.iterdir() if p.name.startswith("index.sqlite") or p.match("slab-*.kv")]
        for p in moved:
            p.rename(aside / p.name)
        self.errors[DiskError.INDEX_DAMAGED] += 1
        log.warning("disk KV tier %s: %s; set it aside with its slabs in %s (%d files, safe to delete) and "
                    "starting with an empty tier", self.dir, why, aside, len(moved))

    def _check_space(self) -> None:
        ours = sum(self._existing_slabs().values())
        need = self.num_slots * self.block_bytes - ours + INDEX_HEADROOM_BYTES + 64 * self.num_slots
        st = os.statvfs(self.dir)
        free = st.f_bavail * st.f_frsize
        aside = list(self.dir.glob("damaged-*"))
        if need > free and aside:          # a damaged set kept for inspection never costs the tier its room
            for d in aside:
                shutil.rmtree(d, ignore_errors=True)
            log.warning("disk KV tier %s: removed the damaged files set aside (%s) to make room", self.dir,
                        ", ".join(d.name for d in aside))
            st = os.statvfs(self.dir)
            free = st.f_bavail * st.f_frsize
        if need > free:
            raise DiskTierError(f"{self.dir} is too small for the disk KV tier: "
                                f"{_size(self.num_slots * self.block_bytes)} asked, {_size(free + ours)} "
                                "available; lower --kv-disk-gib")

    def _load_rows(self, sizes: dict[int, int]) -> list[IndexRow]:
        """The index's rows whose slot is within capacity and whose bytes exist in full."""
        rows, bad = [], []
        for r in self.index.rows():
            slab, off = self._where(r.slot) if r.slot < self.num_slots else (-1, 0)
            if slab < 0 or sizes.get(slab, 0) < off + self.block_bytes:
                bad.append(r.slot)
                if slab >= 0:
                    self.errors[DiskError.TRUNCATED] += 1
            else:
                rows.append(r)
        if bad:
            log.warning("disk KV tier %s: %d indexed blocks dropped at start-up (slab truncated or beyond "
                        "capacity)", self.dir, len(bad))
            self.index.remove(bad)
        return rows

    def _existing_slabs(self) -> dict[int, int]:
        """Slab index -> file size, for the slab files in the directory."""
        out = {}
        for p in self.dir.glob("slab-*.kv"):
            try:
                out[int(p.stem.split("-")[1])] = p.stat().st_size
            except (IndexError, ValueError):
                continue
        return out

    def _remove_slabs_beyond(self, num_slabs: int) -> None:
        for i in self._existing_slabs():
            if i >= num_slabs:
                self._slab_path(i).unlink()

    # ---- I/O thread ---------------------------------------------------------------------------
    def write(self, items: Sequence[WriteItem]) -> list[DiskError | None]:
        """Store blocks from the host tier into their reserved slots; per item None (indexed) or
        why not. Blocking: the I/O thread's."""
        out: list[DiskError | None] = [None] * len(items)
        stale = [it.slot for it in items if it.slot in self._rows]
        try:
            self.index.remove(stale)        # 1: before a byte of theirs changes
        except sqlite3.Error as e:
            return self._write_failed(items, list(range(len(items))), out, e)
        for s in stale:
            del self._rows[s]
        todo = []
        for i, it in enumerate(items):
            if not self._ensure_slab(self._where(it.slot)[0]):     # 2
                out[i] = DiskError.DISK_FULL
                self.errors[DiskError.DISK_FULL] += 1
            else:
                todo.append(i)
        if not todo:
            return out
        checksums: list[int] = []

        def checksum() -> None:                                       # 3, while the bytes go out
            checksums.extend(self._checksums([items[i] for i in todo]))
        try:
            self._io(self.file_io.write, [items[i] for i in todo], during=checksum)    # 4
            for slab in {self._where(items[i].slot)[0] for i in todo}:
                os.fdatasync(self._fds[slab])
            self.index.add([(items[i].slot, items[i].block_hash, items[i].parent, c)
                            for i, c in zip(todo, checksums)])        # 5
        except (FileIoError, OSError, sqlite3.Error) as e:
            return self._write_failed(items, todo, out, e)
        for i, c in zip(todo, checksums):
            it = items[i]
            self._rows[it.slot] = IndexRow(it.slot, it.block_hash, it.parent, c, 0)
        return out

    def _write_failed(self, items, failed: list[int], out: list, e: Exception) -> list[DiskError | None]:
        """Nothing of ``failed`` was indexed: their slots hold no trusted block."""
        if isinstance(e, sqlite3.Error):
            no_space = "full" in str(e) or self._no_space(OSError(0, str(e)))
        else:
            no_space = self._no_space(e)
        reason = DiskError.DISK_FULL if no_space else DiskError.WRITE_ERROR
        if no_space:
            self._set_full()
        self.errors[reason] += len(failed)
        log.warning("disk KV tier %s: write of %d blocks failed (%s): %s", self.dir, len(failed), reason.value, e)
        for i in failed:
            out[i] = reason
        return out

    def read(self, items: Sequence[ReadItem]) -> list[DiskError | None]:
        """Load blocks into their host slots and verify them; per item None (the bytes are good)
        or why not (the block is then gone from the index). Blocking: the I/O thread's."""
        out: list[DiskError | None] = [None] * len(items)
        todo = []
        for i, it in enumerate(items):
            row = self._rows.get(it.slot)
            if row is None or row.block_hash != it.block_hash:
                out[i] = DiskError.MISSING
            else:
                todo.append(i)
        try:
            self._io(self.file_io.read, [items[i] for i in todo])
        except FileIoError:     # find which blocks failed: one at a time
            for i in todo:
                try:
                    self._io(self.file_io.read, [items[i]])
                except FileIoError:
                    out[i] = DiskError.TRUNCATED if self._is_truncated(items[i].slot) else DiskError.READ_ERROR
        landed = [i for i in todo if out[i] is None]
        for i, c in zip(landed, self._checksums([items[i] for i in landed])):
            if c != self._rows[items[i].slot].checksum:
                out[i] = DiskError.CHECKSUM
        bad = [items[i].slot for i in todo if out[i] is not None]
        if bad:
            try:
                self.index.remove(bad)
            except sqlite3.Error as e:   # still dropped from memory; a restart re-checks them
                log.warning("disk KV tier %s: could not drop bad blocks from the index: %s", self.dir, e)
            for i in todo:
                if out[i] is not None:
                    del self._rows[items[i].slot]
                    self.errors[out[i]] += 1
            log.warning("disk KV tier %s: %d of %d blocks read back bad and were dropped (%s)", self.dir,
                        len(bad), len(items), ", ".join(sorted({out[i].value for i in todo if out[i]})))
        return out

    def probe(self, slots: Sequence[int], host_slots: Sequence[int]) -> tuple[float, float]:
        """Seconds to write (synced) and to read back these blocks, for the cost model. ``slots``
        are reserved (FILLING) by the caller and stay unindexed: the caller aborts them after."""
        items = [WriteItem(s, 0, None, h) for s, h in zip(slots, host_slots)]
        stale = [s for s in slots if s in self._rows]
        self.index.remove(stale)
        for s in stale:
            del self._rows[s]
        if not all(self._ensure_slab(self._where(s)[0]) for s in slots):
            raise FileIoError(errno.ENOSPC, "no room for the probe")
        t0 = time.perf_counter()
        self._io(self.file_io.write, items)
        for slab in {self._where(s)[0] for s in slots}:
            os.fdatasync(self._fds[slab])
            if not self.direct:       # read from the disk, not from the page cache we just filled
                os.posix_fadvise(self._fds[slab], 0, 0, os.POSIX_FADV_DONTNEED)
        t1 = time.perf_counter()
        self._io(self.file_io.read, items)
        return t1 - t0, time.perf_counter() - t1

    # ---- shared helpers ---------------------------------------------------------------------------
    def close(self) -> None:
        io = getattr(self, "file_io", None)
        if io is not None:
            io.close()
            self.file_io = None  # type: ignore[assignment]
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if getattr(self, "index", None) is not None:
            self.index.close()
            self.index = None  # type: ignore[assignment]
        if self._lock_fd is not None:
            os.close(self._lock_fd)     # releases the flock
            self._lock_fd = None
        if getattr(self, "_hash_pool", None) is not None:
            self._hash_pool.shutdown()
            self._hash_pool = None

    def _where(self, slot: int) -> tuple[int, int]:
        """(slab index, byte offset in the slab) of a slot."""
        slab, i = divmod(slot, self.slab_slots)
        return slab, i * self.block_bytes

    def _slab_path(self, i: int) -> Path:
        return self.dir / f"slab-{i:06d}.kv"

    def _slab_len(self, i: int) -> int:
        return min(self.slab_slots, self.num_slots - i * self.slab_slots) * self.block_bytes

    def _io(self, op, items, **kw) -> None:
        if not items:
            return
        addrs, fds, offsets = [], [], []
        for it in items:
            slab, off = self._where(it.slot)
            addrs.append(self.host.slot_addr(it.host_slot))
            fds.append(self._fds[slab])
            offsets.append(off)
        op(addrs, fds, offsets, self.block_bytes, **kw)

    def _checksums(self, items) -> list[int]:
        """xxh3-64 of each item's host slot seeded with its hash, on a few threads (xxhash releases
        the GIL; one core hashes ~7-9 GB/s here, so a batch of 2 MiB blocks needs several)."""
        data = self.host.data

        def one(it) -> int:
            return xxhash.xxh3_64_intdigest(data[it.host_slot], seed=it.block_hash & _U64)
        if len(items) < 4 or self._hash_pool is None:
            return [one(it) for it in items]
        return list(self._hash_pool.map(one, items))

    def _ensure_slab(self, i: int) -> bool:
        """The slab exists at full length (created now if need be); False when the disk is full."""
        fd = self._fds.get(i)
        if fd is not None and os.fstat(fd).st_size >= self._slab_len(i):
            return True
        if self.full:                    # no new storage once the disk has been found full
            return False
        try:
            self._open_slab(i, create=True)
        except OSError as e:
            if not self._no_space(e):
                raise
            self._set_full()
            return False
        return True

    def _open_slab(self, i: int, create: bool) -> None:
        path = self._slab_path(i)
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = -1
        if self.direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                log.info("disk KV tier %s: O_DIRECT not supported here, using the page cache", self.dir)
                self.direct = False
        if fd < 0:
            fd = os.open(path, flags, 0o644)
        try:
            if os.fstat(fd).st_size < self._slab_len(i):
                os.posix_fallocate(fd, 0, self._slab_len(i))
        except OSError:
            os.close(fd)
            if create:
                path.unlink(missing_ok=True)
            raise
        old = self._fds.pop(i, None)
        if old is not None:
            self.file_io.remove_file(old)
            os.close(old)
        self._fds[i] = fd
        self.file_io.add_file(fd, self._slab_len(i))

    def _set_full(self) -> None:
        """No new slab from now on; slots of slabs that do not exist are retired by the step loop."""
        if not self.full:
            log.warning("disk KV tier %s: the disk is full; no new slabs, writes pause (the %d slabs "
                        "there keep serving)", self.dir, len(self._fds))
        self.full = True
        first_missing = 0
        while first_missing in self._fds:
            first_missing += 1
        if first_missing < self.num_slabs:
            self.full_from_slot = first_missing * self.slab_slots

    full_from_slot: int | None = None    # slots from here have no storage (read by the step loop)

    def _no_space(self, e: OSError) -> bool:
        if e.errno in _NO_SPACE:
            return True
        st = os.statvfs(self.dir)
        return st.f_bavail * st.f_frsize < self.block_bytes

    def _is_truncated(self, slot: int) -> bool:
        slab, off = self._where(slot)
        return os.fstat(self._fds[slab]).st_size < off + self.block_bytes


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _check_and_lock(d: Path) -> int:
    """Start-up checks of the directory itself; returns the fd holding its lock."""
    if not d.exists():
        raise DiskTierError(f"--kv-disk-dir {d} does not exist; create it first")
    if not d.is_dir():
        raise DiskTierError(f"--kv-disk-dir {d} is not a directory")
    probe = d / ".write-test"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, b"x")
        os.close(fd)
        probe.unlink()
    except OSError as e:
        raise DiskTierError(f"--kv-disk-dir {d} is not writable: {e.strerror}") from e
    fd = os.open(d / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise DiskTierError(f"--kv-disk-dir {d} is in use by another worker") from None
    return fd
