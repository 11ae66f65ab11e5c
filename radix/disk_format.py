"""KVFingerprint: everything that makes stored KV valid, and cheap-but-safe digests of model files.

The disk tier (``radix.disk_store``) addresses blocks by the chained block hash of ``radix.events``: a hash
names a token prefix, not the KV computed from it. The same prefix gives different KV under other weights,
another KV dtype or page size, another tokenizer (the ids mean other text), another RoPE configuration, or
numerics that change the KV bits. The fingerprint names all of these; the store keeps its blocks in a
directory named by ``digest()``, so KV made under one fingerprint is never read under another.

Blocks hold every KV head (a tensor-parallel server gathers its ranks' heads before writing), so the
tensor-parallel size is not part of the layout: a directory written at tp 2 is read at tp 1 or 3. A
row-parallel layer sums in tp pieces, which changes KV only by float rounding, the way batch composition
does; ``tp_size`` is set only where the KV bits are promised (deterministic mode) or the model differs
with the split (int8 scales per shard).

Weight digests hash the files' *contents*: size and mtime alone would accept a file rewritten in place
(a re-download of another revision can keep both). Hashing a multi-GB checkpoint still takes a while (xxh3
runs at several GB/s, from the page cache), so the digest is cached in a small JSON file keyed by the file's path, size,
mtime_ns, ctime_ns and inode. ctime cannot be set from user space (``touch`` and ``os.utime`` change only
atime/mtime), so any write to the file after it was hashed invalidates the cache entry.

A block file (one KV page, ``radix.disk_store``) is a header, 64-byte aligned, then the tensor's raw bytes
in C order (little-endian fields)::

    magic "RSXKVBLK" | version u16 | ndim u16 | header_len u32 | block hash u64 | payload_len u64 |
    fingerprint digest 8 B | dtype name 16 B (zero-padded ascii) | payload xxh3-128 16 B |
    shape ndim x u64 | header xxh3-64 8 B | zero padding to header_len

The header carries the block's hash and fingerprint digest as well as its name and directory do, so a
file copied or renamed to the wrong place fails verification instead of serving another prefix's KV.

Checksums and digests are xxh3 (the ``xxhash`` package): they guard against torn, truncated and corrupted
files and against stale weights, in a directory the server's owner controls — not against someone crafting
collisions — and a warm start reads every block it serves through one, so speed matters: xxh3-128 checks
40 MB of KV in about 2 ms where blake2b took about 65 ms on the same host.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import xxhash

FORMAT_VERSION = 2  # bump when the block file layout or the meaning of a field changes
DIGEST_HEX_CHARS = 16  # 64 bits: the directory name of one fingerprint's blocks
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)
_CHUNK = 8 << 20

MAGIC = b"RSXKVBLK"
BLOCK_VERSION = 2  # 2: xxh3 checksums (1 had blake2b)
DIGEST_ALGORITHM = "xxh3_128"  # of files; a cached digest made otherwise is recomputed
_FIXED = struct.Struct("<8sHHIQQ8s16s16s")
_HEADER_SUM = 8
_ALIGN = 64


def canonical_json(obj: Any) -> str:
    """A stable text form of a config value (e.g. a ``rope_scaling`` dict) for a fingerprint field."""
    if obj is None:
        return ""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the form fingerprints and block headers store)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The inverse of ``dtype_name``; ValueError for anything that is not a torch dtype."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dt


@dataclass(frozen=True)
class KVFingerprint:
    """What must be equal for a stored KV block to be reusable (see the module docstring)."""

    weights: str  # weights_digest() of the weight files
    kv_dtype: str  # dtype_name() of the KV pool, e.g. "bfloat16"
    page_size: int
    num_layers: int
    kv_heads: int  # every KV head of the model (blocks hold all of them, whatever the tensor-parallel size)
    head_dim: int
    tokenizer: str  # tokenizer_digest() (a GGUF file's tokenizer is covered by `weights`; pass "gguf")
    rope_theta: float
    rope_scaling: str = ""  # canonical_json(config.rope_scaling); "" for none
    max_positions: int = 0
    attention: str = ""  # anything else about attention that changes KV (sliding window, KV layout, ...)
    tp_size: int = 1  # 1 unless the KV depends on the tensor-parallel size beyond rounding (module docstring)
    tp_rank: int = 0  # always 0 for blocks of every head; kept so that older fingerprints keep their digest
    namespace: str = "default"  # separates caches that must never share blocks (tenants, experiments)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        dtype_from_name(self.kv_dtype)
        for name in ("page_size", "num_layers", "kv_heads", "head_dim", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVFingerprint.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if not self.weights:
            raise ValueError("KVFingerprint.weights must name the weights (use weights_digest())")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVFingerprint:
        """Inverse of ``to_dict``; KeyError/TypeError/ValueError for a dict that is not one."""
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown fingerprint fields: {sorted(unknown)}")
        return cls(**dict(data))

    def digest(self) -> str:
        """Short hex name of this fingerprint (equal fields <=> equal digest, up to 64-bit collisions)."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_64_hexdigest(text.encode())


def file_digest(path: Path) -> str:
    """xxh3-128 of a file's contents, read in chunks into one reused buffer."""
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def default_digest_cache() -> Path:
    base = os.environ.get("RADIXSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "radixserve"
    )
    return Path(base) / "file-digests.json"


def _stat_key(path: Path) -> str:
    st = os.stat(path)
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_dev}:{st.st_ino}"


def _load_cache(cache_file: Path) -> dict[str, Any]:
    try:
        data = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_cache(cache_file: Path, data: dict[str, Any]) -> None:
    """Best effort (a read-only home only costs a re-hash next time); atomic so readers never see half."""
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_file.parent, prefix=".digests-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, cache_file)
    except OSError:
        pass


def _expand(paths: Iterable[str | os.PathLike[str]], suffixes: tuple[str, ...] | None) -> list[tuple[str, Path]]:
    """(name, file) pairs: a directory stands for its files with ``suffixes`` (recursively), named relative
    to it; a file stands for itself, named by its base name."""
    out: list[tuple[str, Path]] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and (suffixes is None or f.name.endswith(suffixes)))
            out.extend((f.relative_to(p).as_posix(), f) for f in found)
        elif p.is_file():
            out.append((p.name, p))
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    return sorted(out)


def files_digest(
    paths: Iterable[str | os.PathLike[str]],
    *,
    suffixes: tuple[str, ...] | None = None,
    cache_file: Path | None = None,
) -> str:
    """One digest over the contents (and names) of files; per-file digests are cached in ``cache_file``
    (default ``default_digest_cache()``) keyed by path, size, mtime_ns, ctime_ns and inode."""
    files = _expand(paths, suffixes)
    if not files:
        raise FileNotFoundError(f"no files to digest in {list(map(str, paths))}")
    cache_file = cache_file or default_digest_cache()
    cache = _load_cache(cache_file)
    changed = False
    h = xxhash.xxh3_128()
    for name, f in files:
        real = os.path.realpath(f)
        key = _stat_key(f)
        entry = cache.get(real)
        if (isinstance(entry, dict) and entry.get("stat") == key and entry.get("algorithm") == DIGEST_ALGORITHM
                and isinstance(entry.get("digest"), str)):
            d = entry["digest"]
        else:
            d = file_digest(f)
            # the file may have changed while it was read: cache only a digest whose stat held throughout
            if _stat_key(f) == key:
                cache[real] = {"stat": key, "algorithm": DIGEST_ALGORITHM, "digest": d}
                changed = True
        h.update(f"{name}\0{d}\n".encode())
    if changed:
        _save_cache(cache_file, cache)
    return h.hexdigest()


def weights_digest(paths: Iterable[str | os.PathLike[str]], *, cache_file: Path | None = None) -> str:
    """Digest of model weights: files (any name) or directories (their *.safetensors/*.gguf/*.bin/*.pt)."""
    return files_digest(paths, suffixes=WEIGHT_SUFFIXES, cache_file=cache_file)


def tokenizer_digest(model_dir: str | os.PathLike[str], *, cache_file: Path | None = None) -> str:
    """Digest of the tokenizer files present in a model directory (tokenizer.json, vocab, merges, ...)."""
    d = Path(model_dir)
    present = [d / n for n in TOKENIZER_FILES if (d / n).is_file()]
    if not present:
        raise FileNotFoundError(f"no tokenizer files in {d}")
    return files_digest(present, cache_file=cache_file)


# ---------------------------------------------------------------- block files
class BlockCorrupt(Exception):
    """A block file failed verification (the message says how)."""


def header_length(ndim: int) -> int:
    """Bytes before the payload in the file of a block with ``ndim`` dimensions (padding included)."""
    return -(-(_FIXED.size + 8 * ndim + _HEADER_SUM) // _ALIGN) * _ALIGN


def encode_header(
    block_hash: int, fingerprint_digest: bytes, dtype: torch.dtype, shape: Sequence[int], payload: memoryview
) -> bytes:
    """The header of a block file holding ``payload`` (see the module docstring for the layout)."""
    name = dtype_name(dtype).encode()
    if len(name) > 16:
        raise ValueError(f"dtype name too long for the block header: {dtype}")
    ndim = len(shape)
    header_len = header_length(ndim)
    checksum = xxhash.xxh3_128_digest(payload)
    body = _FIXED.pack(
        MAGIC, BLOCK_VERSION, ndim, header_len, block_hash, payload.nbytes, fingerprint_digest, name.ljust(16, b"\0"),
        checksum,
    ) + struct.pack(f"<{ndim}Q", *shape)
    body += xxhash.xxh3_64_digest(body)
    return body.ljust(header_len, b"\0")


def decode_block(buf: bytearray | memoryview, block_hash: int, fingerprint_digest: bytes) -> torch.Tensor:
    """The tensor a complete block file ``buf`` (writable) holds; ``BlockCorrupt`` if any check fails. Shares
    ``buf``."""
    if len(buf) < _FIXED.size:
        raise BlockCorrupt(f"file too short ({len(buf)} bytes)")
    magic, version, ndim, header_len, h, payload_len, fp, raw_dtype, checksum = _FIXED.unpack_from(buf)
    if magic != MAGIC:
        raise BlockCorrupt("bad magic")
    if version != BLOCK_VERSION:
        raise BlockCorrupt(f"format version {version}, expected {BLOCK_VERSION}")
    used = _FIXED.size + 8 * ndim + _HEADER_SUM
    if header_len < used or len(buf) < used:
        raise BlockCorrupt("header truncated")
    view = memoryview(buf)
    if xxhash.xxh3_64_digest(view[: used - _HEADER_SUM]) != view[used - _HEADER_SUM : used]:
        raise BlockCorrupt("header checksum mismatch")
    if h != block_hash or fp != fingerprint_digest:
        raise BlockCorrupt("block hash or fingerprint differs from the file's name and directory")
    if any(view[used:header_len]):
        raise BlockCorrupt("header padding is not zero")
    if len(buf) != header_len + payload_len:
        raise BlockCorrupt(f"length {len(buf)}, header says {header_len + payload_len}")
    try:
        dtype = dtype_from_name(raw_dtype.rstrip(b"\0").decode("ascii"))
    except (UnicodeDecodeError, ValueError) as e:
        raise BlockCorrupt(str(e)) from None
    shape = struct.unpack_from(f"<{ndim}Q", buf, _FIXED.size)
    numel = 1
    for d in shape:
        numel *= d
    if numel * dtype.itemsize != payload_len:
        raise BlockCorrupt("payload length does not match shape and dtype")
    payload = view[header_len:]
    if xxhash.xxh3_128_digest(payload) != checksum:
        raise BlockCorrupt("payload checksum mismatch")
    if payload_len == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8, offset=header_len).view(dtype).reshape(shape)


def payload_bytes(kv: torch.Tensor) -> memoryview:
    """The bytes of ``kv`` in C order (copied to the CPU if it lives elsewhere)."""
    t = kv.detach().to("cpu").contiguous().reshape(-1)
    arr: Any = t.view(torch.uint8).numpy()
    return memoryview(arr).cast("B")
