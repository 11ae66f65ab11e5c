"""The disk tier store (radix.disk_store) and the fingerprint/block format (radix.disk_format), on real files.

A block's content is a pseudo-random function of its hash (``block_kv``), so any process can check that what
it read is exactly what was written for that hash — a torn, stale or foreign read shows up as a mismatch.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import time
from array import array
from pathlib import Path
from typing import Any

import pytest
import torch

from radix.disk_format import KVFingerprint, canonical_json, tokenizer_digest, weights_digest
from radix.disk_store import DiskKVStore, DiskTierError
from radix.events import chain_hashes, root_hash

SHAPE = (2, 2, 4, 2, 8)  # [layers, k/v, page_size, kv_heads, head_dim]


def fingerprint(**overrides: object) -> KVFingerprint:
    fields: dict[str, object] = dict(
        weights="w" * 32, kv_dtype="float32", page_size=4, num_layers=2, kv_heads=2, head_dim=8,
        tokenizer="t" * 32, rope_theta=10000.0, rope_scaling=canonical_json({"type": "linear", "factor": 2.0}),
        max_positions=2048,
    )
    fields.update(overrides)
    return KVFingerprint(**fields)  # type: ignore[arg-type]


def block_kv(h: int, shape: tuple[int, ...] = SHAPE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(h % (2**63))
    return torch.randn(shape, generator=g).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def block_file(store: DiskKVStore, h: int) -> Path:
    (path,) = store.directory.rglob(f"{h:016x}.kv")
    return path


def temp_files(store: DiskKVStore) -> list[Path]:
    return list(store.directory.rglob("*.tmp"))


def chain(tokens: list[int], page: int = 4, namespace: str | None = None) -> list[int]:
    return list(chain_hashes(root_hash(namespace), array("i", tokens).tobytes(), 4 * page))


# ------------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_round_trip_is_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    store = DiskKVStore(tmp_path, fingerprint(kv_dtype=str(dtype).removeprefix("torch.")))
    kv = block_kv(1, dtype=dtype) if dtype.is_floating_point else torch.randint(-128, 127, SHAPE, dtype=dtype)
    if dtype.is_floating_point:  # special values must survive bit for bit
        kv.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")]).to(dtype)
    assert store.put(7, kv)
    out = store.get(7)
    assert out is not None and out.dtype == dtype and out.shape == kv.shape
    assert torch.equal(bits(out), bits(kv))


def test_non_contiguous_and_odd_shapes(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, fingerprint())
    base = block_kv(3, (8, 6))
    for h, kv in enumerate([base.t(), base[:, ::2], torch.tensor(2.5), torch.empty(0, 3)], start=1):
        assert store.put(h, kv)
        out = store.get(h)
        assert out is not None and out.shape == kv.shape and torch.equal(out, kv)


def test_reopen_finds_blocks_and_prefixes(tmp_path: Path) -> None:
    fp = fingerprint()
    hashes = chain(list(range(40)))  # 10 chained blocks
    store = DiskKVStore(tmp_path, fp)
    for h in hashes[:6]:
        assert store.put(h, block_kv(h))
    assert store.longest_prefix(hashes) == 6
    del store

    again = DiskKVStore(tmp_path, fp)  # as after a restart
    assert len(again) == 6 and again.bytes_used > 0
    assert again.longest_prefix(hashes) == 6
    assert again.longest_prefix(hashes[1:]) == 5 and again.longest_prefix(hashes[6:]) == 0
    for h in hashes[:6]:
        out = again.get(h)
        assert out is not None and torch.equal(out, block_kv(h))
    assert again.get(hashes[7]) is None
    s = again.stats()
    assert (s.hits, s.misses, s.blocks_read, s.corrupted) == (6, 1, 6, 0)
    assert s.bytes_read == again.bytes_used and s.load_seconds > 0 and s.mean_load_ms > 0
    # another namespace's chain of the same tokens names other blocks
    assert again.longest_prefix(chain(list(range(40)), namespace="tenant-b")) == 0


def test_put_of_present_block_writes_nothing(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, fingerprint())
    assert store.put(5, block_kv(5)) and store.put(5, block_kv(5))
    assert store.stats().blocks_written == 1 and len(store) == 1


# ------------------------------------------------------------------------------------------- fingerprints
def test_fingerprint_digest_covers_every_field() -> None:
    base = fingerprint()
    changes: dict[str, object] = dict(
        weights="x" * 32, kv_dtype="bfloat16", page_size=8, num_layers=3, kv_heads=4, head_dim=16,
        tokenizer="u" * 32, rope_theta=500000.0, rope_scaling="", max_positions=4096, attention="sliding:4096",
        tp_size=2, namespace="other", format_version=99,
    )
    variants = [{name: value} for name, value in changes.items()] + [{"tp_size": 2, "tp_rank": 1}]
    digests = {base.digest()} | {fingerprint(**v).digest() for v in variants}
    assert len(digests) == len(variants) + 1
    assert KVFingerprint.from_dict(base.to_dict()) == base and fingerprint().digest() == base.digest()
    with pytest.raises(ValueError):
        fingerprint(kv_dtype="float33")
    with pytest.raises(ValueError):
        fingerprint(tp_rank=2, tp_size=2)


def test_fingerprint_mismatch_ignores_old_blocks_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = DiskKVStore(tmp_path, fingerprint())
    other = DiskKVStore(tmp_path, fingerprint(namespace="other"))
    for h in (1, 2, 3):
        old.put(h, block_kv(h))
        other.put(h, block_kv(h))
    assert json.loads((old.directory / "fingerprint.json").read_text()) == fingerprint().to_dict()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="radix.disk_store"):
        new = DiskKVStore(tmp_path, fingerprint(weights="new-weights"))
    warnings = [r for r in caplog.records if "other KV fingerprints" in r.getMessage()]
    assert len(warnings) == 1 and old.directory.name in warnings[0].getMessage()
    assert len(new) == 0 and new.longest_prefix([1, 2, 3]) == 0 and new.get(1) is None
    assert new.put(1, block_kv(1, dtype=torch.bfloat16))
    out = old.get(1)  # the old fingerprint's blocks are untouched
    assert out is not None and torch.equal(out, block_kv(1))


def test_block_in_another_fingerprints_directory_is_rejected(tmp_path: Path) -> None:
    a = DiskKVStore(tmp_path, fingerprint())
    b = DiskKVStore(tmp_path, fingerprint(namespace="b"))
    a.put(9, block_kv(9))
    dest = b.directory / "blocks" / "00" / f"{9:016x}.kv"
    os.replace(block_file(a, 9), dest)  # a file moved by hand into the wrong directory
    assert b.get(9) is None and not dest.exists() and b.stats().corrupted == 1


def test_weights_digest_hashes_contents(tmp_path: Path) -> None:
    cache = tmp_path / "digests.json"
    model = tmp_path / "model"
    model.mkdir()
    w = model / "model.safetensors"
    w.write_bytes(b"a" * 100_000)
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text('{"vocab": 1}')
    st = os.stat(w)
    d1 = weights_digest([model], cache_file=cache)
    assert weights_digest([w], cache_file=cache) == d1 and cache.exists()

    # same size, same mtime, other contents: size+mtime would accept it, the digest must not
    w.write_bytes(b"a" * 99_999 + b"b")
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    d2 = weights_digest([model], cache_file=cache)
    assert d2 != d1
    assert weights_digest([model], cache_file=tmp_path / "fresh.json") == d2
    (model / "config.json").write_text('{"x": 1}')  # not a weight file
    assert weights_digest([model], cache_file=cache) == d2
    t1 = tokenizer_digest(model, cache_file=cache)
    (model / "tokenizer.json").write_text('{"vocab": 2}')
    assert tokenizer_digest(model, cache_file=cache) != t1
    with pytest.raises(FileNotFoundError):
        weights_digest([tmp_path / "missing"], cache_file=cache)


# ------------------------------------------------------------------------------------------- corruption
def test_truncated_file_is_a_miss_and_removed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DiskKVStore(tmp_path, fingerprint())
    store.put(11, block_kv(11))
    path = block_file(store, 11)
    size = path.stat().st_size
    for keep in (size - 1, 40, 0):  # payload cut, header cut, empty
        with open(path, "r+b") as f:
            f.truncate(keep)
        with caplog.at_level(logging.WARNING, logger="radix.disk_store"):
            assert store.get(11) is None
        assert not path.exists() and not store.contains(11)
        store.put(11, block_kv(11))
    assert store.stats().corrupted == 3
    assert sum("corrupt" in r.getMessage() for r in caplog.records) == 3


HEADER_OFFSETS = {  # in the 128-byte header of a 5-d block (radix.disk_format's layout)
    "magic": 0, "version": 8, "hash": 20, "payload-len": 26, "fingerprint": 33, "dtype": 42, "checksum": 60,
    "shape": 84, "header-sum": 115, "padding": 124, "payload-first": 128, "payload-last": -1,
}


@pytest.mark.parametrize("where", list(HEADER_OFFSETS))
def test_flipped_byte_is_a_miss_and_removed(tmp_path: Path, where: str) -> None:
    store = DiskKVStore(tmp_path, fingerprint())
    store.put(12, block_kv(12))
    path = block_file(store, 12)
    data = bytearray(path.read_bytes())
    data[HEADER_OFFSETS[where]] ^= 0x01
    path.write_bytes(bytes(data))
    assert store.get(12) is None
    assert not path.exists() and store.stats().corrupted == 1
    assert DiskKVStore(tmp_path, fingerprint()).get(12) is None  # a restart does not resurrect it


def test_file_under_another_hash_is_rejected(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, fingerprint())
    store.put(0x1111, block_kv(0x1111))
    wrong = block_file(store, 0x1111).with_name(f"{0x2222:016x}.kv")
    os.replace(block_file(store, 0x1111), wrong)
    store.rescan()
    assert store.contains(0x2222) and store.get(0x2222) is None and not wrong.exists()


# ------------------------------------------------------------------------------------------- capacity
def test_capacity_evicts_least_recently_used_across_restart(tmp_path: Path) -> None:
    probe = DiskKVStore(tmp_path / "probe", fingerprint())
    probe.put(1, block_kv(1))
    block = probe.bytes_used
    store = DiskKVStore(tmp_path, fingerprint(), capacity_bytes=3 * block)
    for h in (1, 2, 3):
        assert store.put(h, block_kv(h))
    assert store.get(1) is not None  # 2 is now the least recently used
    assert store.put(4, block_kv(4))
    assert [store.contains(h) for h in (1, 2, 3, 4)] == [True, False, True, True]
    assert store.bytes_used == 3 * block and store.stats().evicted_blocks == 1
    assert len(list(store.directory.rglob("*.kv"))) == 3

    again = DiskKVStore(tmp_path, fingerprint(), capacity_bytes=3 * block)  # LRU order survives (mtimes)
    assert again.put(5, block_kv(5))
    assert [again.contains(h) for h in (1, 3, 4, 5)] == [True, False, True, True]
    smaller = DiskKVStore(tmp_path, fingerprint(), capacity_bytes=block)  # a smaller cap trims at open
    assert len(smaller) == 1 and smaller.contains(5)
    assert not smaller.put(99, block_kv(99, (4, 64, 64)))  # bigger than the whole capacity: not stored
    with pytest.raises(ValueError):
        DiskKVStore(tmp_path, fingerprint(), capacity_bytes=0)


# ------------------------------------------------------------------------------------------- faults
def test_missing_parents_are_created(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path / "a" / "b" / "c", fingerprint())
    assert store.put(1, block_kv(1)) and (tmp_path / "a" / "b" / "c").is_dir()


def test_root_under_a_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(DiskTierError, match="disk KV tier unusable"):
        DiskKVStore(tmp_path / "file" / "cache", fingerprint())


def _permissions_enforced(d: Path) -> bool:
    """False for root (with CAP_DAC_OVERRIDE), which writes into a 0o555 directory anyway."""
    if os.geteuid() != 0:
        return True
    try:
        (d / "probe").write_text("x")
    except PermissionError:
        return True
    return False


def test_read_only_directory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if not _permissions_enforced(ro):
        ro.chmod(0o755)
        pytest.skip("running as root: directory permissions are not enforced")
    try:
        with pytest.raises(DiskTierError):
            DiskKVStore(ro / "cache", fingerprint())
        with pytest.raises(DiskTierError):
            DiskKVStore(ro, fingerprint())
    finally:
        ro.chmod(0o755)
    # writable at open, read-only later: one warning, put returns False, reads still work
    store = DiskKVStore(tmp_path / "rw", fingerprint())
    store.put(1, block_kv(1))
    dirs = [d for d in store.directory.rglob("*") if d.is_dir()]
    for d in dirs:
        d.chmod(0o555)
    try:
        with caplog.at_level(logging.WARNING, logger="radix.disk_store"):
            assert not store.put(2, block_kv(2)) and not store.put(3, block_kv(3))
        assert sum("read-only" in r.getMessage() for r in caplog.records) == 1
        assert not store.writable and store.get(1) is not None
    finally:
        for d in dirs:
            d.chmod(0o755)


def _write_past_file_size_limit(root: str, q: mp.Queue) -> None:
    """Child: a file size limit makes writes fail with EFBIG (a stand-in for a full disk that needs no root)."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    store = DiskKVStore(root, fingerprint())
    store.put(1, block_kv(1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
    big = store.put(2, block_kv(2, (64, 64)))  # 16 KiB payload: over the limit
    q.put((big, store.writable, store.read_only_reason, store.put(3, block_kv(3)), store.get(1) is not None,
           store.stats().write_errors, [p.name for p in Path(root).rglob("*.tmp")]))


def test_write_failure_degrades_to_read_only(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_write_past_file_size_limit, args=(str(tmp_path), q))
    p.start()
    big, writable, reason, small, read_ok, errors, temps = q.get(timeout=120)
    p.join(30)
    assert p.exitcode == 0
    assert (big, writable, small, read_ok, errors, temps) == (False, False, False, True, 1, [])
    assert reason is not None and "EFBIG" in reason
    assert DiskKVStore(tmp_path, fingerprint()).contains(1)


# ------------------------------------------------------------------------------------------- two processes
N_SHARED = 300


def _share_worker(root: str, seed: int, capacity: int, q: mp.Queue) -> None:
    """Child: put the shared blocks (in the same order as the other child, so both often write the same block
    at once) while reading random ones; count wrong reads."""
    import random

    rng = random.Random(seed)
    store = DiskKVStore(root, fingerprint(), capacity_bytes=capacity)
    order = list(range(1, N_SHARED + 1))
    random.Random(0).shuffle(order)
    wrong = hits = 0
    for h in order:
        store.put(h, block_kv(h, (2, 2, 16, 4, 16)))
        for r in rng.sample(range(1, N_SHARED + 1), 3):
            out = store.get(r)
            if out is not None:
                hits += 1
                wrong += not torch.equal(out, block_kv(r, (2, 2, 16, 4, 16)))
    q.put((wrong, hits, store.stats().corrupted))


def test_two_processes_share_a_directory(tmp_path: Path) -> None:
    block = DiskKVStore(tmp_path / "probe", fingerprint())
    block.put(1, block_kv(1, (2, 2, 16, 4, 16)))
    capacity = 100 * block.bytes_used  # a third of the blocks: both processes evict while the other reads
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_share_worker, args=(str(tmp_path / "shared"), s, capacity, q)) for s in (1, 2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert [r[0] for r in results] == [0, 0]  # no torn or wrong reads
    assert [r[2] for r in results] == [0, 0]  # and no file ever failed verification
    assert all(r[1] > 50 for r in results)
    assert not list((tmp_path / "shared").rglob("*.tmp"))


CHASE_SHAPE = (4, 2, 32, 8, 32)  # 128 KiB blocks


def _chaser(root: str, n: int, q: mp.Queue, ready: Any) -> None:
    """Child: read blocks 1..n as the parent writes them, each as soon as its file appears."""
    store = DiskKVStore(root, fingerprint())
    ready.set()
    wrong = 0
    for h in range(1, n + 1):
        deadline = time.monotonic() + 30
        while (out := store.get(h)) is None and time.monotonic() < deadline:
            pass
        wrong += out is None or not torch.equal(out, block_kv(h, CHASE_SHAPE))
    q.put((wrong, store.stats().corrupted))


def test_reader_chasing_a_writer_never_sees_a_partial_file(tmp_path: Path) -> None:
    n = 150
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ready = ctx.Event()
    store = DiskKVStore(tmp_path, fingerprint())
    p = ctx.Process(target=_chaser, args=(str(tmp_path), n, q, ready))
    p.start()
    assert ready.wait(120)  # the child polls for block 1 from now on
    for h in range(1, n + 1):
        assert store.put(h, block_kv(h, CHASE_SHAPE))
    assert q.get(timeout=120) == (0, 0)
    p.join(30)


# ------------------------------------------------------------------------------------------- SIGKILL
KILLED_SHAPE = (8, 2, 64, 8, 64)  # 2 MiB blocks


def _endless_writer(root: str) -> None:
    store = DiskKVStore(root, fingerprint())
    kv = block_kv(0, KILLED_SHAPE)  # one payload made once: the loop spends its time in put(), mostly mid-write
    h = 1
    while True:
        store.put(h, kv)
        h += 1


def test_sigkilled_writer_leaves_a_usable_directory(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    stale: list[Path] = []
    for _ in range(20):  # until the kill lands mid-write (almost always the first time)
        p = ctx.Process(target=_endless_writer, args=(str(tmp_path),))
        p.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(list(tmp_path.rglob("*.kv"))) < 3:
            time.sleep(0.01)
        while time.monotonic() < deadline and not list(tmp_path.rglob("*.tmp")):
            pass
        assert p.pid is not None
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        stale = list(tmp_path.rglob("*.tmp"))
        if stale:
            break
    assert stale, "the writer was never killed mid-write"
    store = DiskKVStore(tmp_path, fingerprint())
    assert not any(s.exists() for s in stale)  # its writer is dead: removed
    assert len(store) >= 3
    for f in store.directory.rglob("*.kv"):
        h = int(f.stem, 16)
        out = store.get(h)
        assert out is not None and torch.equal(out, block_kv(0, KILLED_SHAPE)), h
    assert store.stats().corrupted == 0


def test_temp_files_of_live_or_unknown_writers_are_kept_until_old(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, fingerprint())
    sub = store.directory / "blocks" / "00"
    live = sub / f".{1:016x}.{'0' * 8}.{os.getpid()}.abcd.tmp"  # another host's writer (or pid): unknown
    old = sub / f".{2:016x}.{'0' * 8}.{os.getpid()}.abcd.tmp"
    for f in (live, old):
        f.write_bytes(b"partial")
    os.utime(old, (time.time() - 2 * 3600,) * 2)
    again = DiskKVStore(tmp_path, fingerprint())
    assert live.exists() and not old.exists() and len(again) == 0
