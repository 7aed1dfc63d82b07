"""The disk tier's durable index: which slab slot holds which block, with its checksum.

An SQLite database (stdlib ``sqlite3``) in the tier's directory, ``index.sqlite``, in WAL mode
with ``synchronous=FULL``: a commit has reached the disk when the call returns, and a crash at any
point leaves the last committed state. Measured on the CPU machine: removing and adding 32 rows
(one batch) costs 0.5 ms in WAL mode, 2 ms with a rollback journal; a batch of 32 8B blocks is
~50 ms of disk time. Two tables:

- ``meta``: the directory's identity: format version, the BlockFormat (model, num_layers,
  layer_bytes, block_bytes, block_size, dtype), the slab geometry, and a checksum of those rows.
  Opening a directory written for another format raises DiskTierError, naming both: its blocks
  are not ours to read.
- ``blocks``: one row per trusted block: slot, hash, parent hash, checksum, and a sequence number
  (write order, the LRU order a restart starts from). Hashes and checksums are unsigned 64-bit
  and stored as signed 64-bit (SQLite's integer).

The index never trusts a slot whose bytes might be incomplete; the disk pool's write sequence
guarantees it (disk_pool.py): remove the slot's row (commit) -> write the bytes -> fdatasync ->
add the row with the checksum of what was written (commit). The checksum also catches what the
ordering cannot (bit rot, a file edited behind our back). Rows are deleted and added in batches,
one transaction each.

Damage (bytes flipped or lost in the file) raises DiskIndexDamaged when the index opens: SQLite
cannot read it, its `quick_check` fails, a row cannot be read, or the meta rows no longer match
their checksum. The disk pool then sets the index and its slabs aside and starts empty.

Pure stdlib and xxhash; knows nothing of slabs, I/O or threads (one thread uses it at a time).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvstore.block_format import BlockFormat
from runtime.errors import StartupError

FORMAT_VERSION = 1
_I64 = 1 << 63
_U64 = 1 << 64
_META_SUM = "meta_xxh64"


def _meta_sum(meta: dict[str, str]) -> str:
    return str(xxhash.xxh64_intdigest("\n".join(f"{k}={v}" for k, v in sorted(meta.items())).encode()))


class DiskTierError(StartupError):
    """The disk tier cannot start: a bad directory, too little space, or a foreign format."""


class DiskIndexDamaged(DiskTierError):
    """The index file is damaged: not ours to refuse, but to set aside (disk_pool.py)."""


@dataclass(frozen=True, slots=True)
class IndexRow:
    slot: int
    block_hash: int
    parent: int | None
    checksum: int
    seq: int


def _s64(u: int) -> int:
    return u - _U64 if u >= _I64 else u


def _u64(s: int) -> int:
    return s + _U64 if s < 0 else s


class DiskIndex:
    def __init__(self, path: Path, fmt: BlockFormat, slab_slots: int) -> None:
        """Open or create the index; a new one records ``fmt`` and ``slab_slots``, an existing one
        must match ``fmt`` (its own slab geometry wins: read it from ``slab_slots`` after)."""
        self.path = Path(path)
        self._db = None
        try:
            meta = self._open(fmt, slab_slots)
            self._seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM blocks").fetchone()[0]
        except sqlite3.DatabaseError as e:
            self.close()
            raise DiskIndexDamaged(f"{self.path} is damaged ({e})") from e
        expected = {"format_version": str(FORMAT_VERSION), **{k: str(v) for k, v in fmt.to_dict().items()}}
        theirs = {k: meta.get(k) for k in expected}
        if theirs != expected:
            diff = ", ".join(f"{k}: directory {theirs[k]!r} vs ours {expected[k]!r}"
                             for k in expected if theirs[k] != expected[k])
            self._db.close()
            raise DiskTierError(f"{self.path.parent} holds KV blocks of another model or layout ({diff}); "
                                "use another --kv-disk-dir or empty this one")
        self.slab_slots = int(meta["slab_slots"])

    def _open(self, fmt: BlockFormat, slab_slots: int) -> dict[str, str]:
        """Connect, check the file, create the tables of a new index; its meta rows, verified."""
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA wal_autocheckpoint=128")        # keep the WAL file ~0.5 MiB
        self._db.execute("PRAGMA journal_size_limit=1048576")
        check = self._db.execute("PRAGMA quick_check").fetchall()   # every page readable: O(rows), ~ms
        if check != [("ok",)]:
            raise sqlite3.DatabaseError("; ".join(str(r[0]) for r in check[:3]))
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        self._db.execute("CREATE TABLE IF NOT EXISTS blocks (slot INTEGER PRIMARY KEY, hash INTEGER NOT NULL,"
                         " parent INTEGER, checksum INTEGER NOT NULL, seq INTEGER NOT NULL)")
        meta = dict(self._db.execute("SELECT key, value FROM meta"))
        if not meta:
            rows = {"format_version": str(FORMAT_VERSION), **{k: str(v) for k, v in fmt.to_dict().items()},
                    "slab_slots": str(slab_slots)}
            with self._txn():
                self._db.executemany("INSERT INTO meta VALUES (?, ?)", [*rows.items(), (_META_SUM, _meta_sum(rows))])
            meta = dict(self._db.execute("SELECT key, value FROM meta"))
        given = meta.pop(_META_SUM, None)
        if given is not None and given != _meta_sum(meta):     # (indexes written before the sum have none)
            raise sqlite3.DatabaseError("its format rows do not match their checksum")
        if not str(meta.get("slab_slots", "")).isdigit():
            raise sqlite3.DatabaseError("its slab geometry is unreadable")
        return meta

    def rows(self) -> list[IndexRow]:
        """Every trusted block, oldest write first. DiskIndexDamaged if they cannot be read."""
        try:
            cur = self._db.execute("SELECT slot, hash, parent, checksum, seq FROM blocks ORDER BY seq")
            return [IndexRow(s, _u64(h), None if p is None else _u64(p), _u64(c), q) for s, h, p, c, q in cur]
        except (sqlite3.DatabaseError, TypeError) as e:       # TypeError: a value no longer an integer
            raise DiskIndexDamaged(f"{self.path} is damaged ({e})") from e

    def remove(self, slots: list[int]) -> None:
        """Durably forget the blocks in ``slots`` (before their bytes are rewritten, or once found bad)."""
        if slots:
            with self._txn():
                self._db.executemany("DELETE FROM blocks WHERE slot = ?", [(s,) for s in slots])

    def add(self, entries: list[tuple[int, int, int | None, int]]) -> None:
        """Durably trust (slot, hash, parent, checksum) blocks whose bytes are already synced."""
        if not entries:
            return
        rows = []
        for slot, h, parent, checksum in entries:
            self._seq += 1
            rows.append((slot, _s64(h), None if parent is None else _s64(parent), _s64(checksum), self._seq))
        with self._txn():
            self._db.executemany("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?, ?)", rows)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()

    def _txn(self):
        return _Txn(self._db)


class _Txn:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self._db.execute("COMMIT")
                return
            except sqlite3.Error:
                self._rollback()        # a failed COMMIT (disk full) may leave the transaction open
                raise
        self._rollback()

    def _rollback(self) -> None:
        if self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
