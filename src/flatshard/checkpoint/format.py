"""The bytes of a checkpoint: safetensors files written one tensor at a time, read by byte range.

A safetensors file is 8 bytes (little-endian header length n), n bytes of JSON header
(``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``), then the
raw tensor bytes. flatshard writes and reads that layout itself so that it can stream: a writer
takes tensors one after another (peak memory: one tensor), and a reader fetches exactly the byte
range of the elements a rank needs (``os.pread``; no mmap, no full read). Nothing here unpickles.

[Note: checksums]
Each file gets a SHA-256 over all its bytes (``flatshard inspect`` verifies it) and, per tensor, a
CRC-32 of every ``BLOCK``-byte block of its data. A reader that needs bytes [a, b) of a tensor reads
the blocks that cover them (at most one block extra at each end) and checks their CRCs: a load
verifies every byte it uses without reading bytes it does not use.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from typing import Optional

import torch

from flatshard.api import CheckpointError

MANIFEST = "manifest.json"
FORMAT, FORMAT_VERSION = "flatshard-checkpoint", 1
BLOCK = 1 << 22  # 4 MiB
DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
BY_NAME = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 1 << 28


def shard_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().reshape(-1).contiguous().cpu()
    return t.view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


class ShardWriter:
    """Write one safetensors file tensor by tensor, in the order of ``specs``; checksums as it goes."""

    def __init__(self, path: str, specs: list[tuple[str, torch.dtype, list[int]]], metadata: Optional[dict] = None):
        header, offset = {}, 0
        self._sizes = {}
        for key, dtype, shape in specs:
            if dtype not in DTYPES:
                raise CheckpointError(f"tensor {key!r} has dtype {dtype}, which safetensors cannot store")
            n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            header[key] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._sizes[key] = n
            offset += n
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.path, self._order, self._next = path, [k for k, _, _ in specs], 0
        self._file = open(path, "wb")
        self._sha = hashlib.sha256()
        self.blocks: dict[str, list[int]] = {}
        self._put(struct.pack("<Q", len(blob)) + blob)

    def _put(self, data) -> None:
        self._file.write(data)
        self._sha.update(data)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order) or self._order[self._next] != key:
            raise CheckpointError(f"internal: {self.path}: tensor {key!r} written out of order")
        data = raw_bytes(tensor)
        if len(data) != self._sizes[key]:
            raise CheckpointError(
                f"internal: {self.path}: tensor {key!r} has {len(data)} bytes, {self._sizes[key]} declared"
            )
        crcs = []
        for lo in range(0, len(data), BLOCK):
            chunk = data[lo : lo + BLOCK]
            crcs.append(zlib.crc32(chunk))
            self._put(chunk)
        self.blocks[key] = crcs
        self._next += 1

    def close(self) -> dict:
        """Flush to stable storage; returns the file's record for the manifest."""
        if self._next != len(self._order):
            raise CheckpointError(f"internal: {self.path}: {len(self._order) - self._next} tensors never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        size = self._file.tell()
        self._file.close()
        return {"bytes": size, "sha256": self._sha.hexdigest(), "block_bytes": BLOCK, "blocks": self.blocks}


class ShardReader:
    """Read byte ranges of tensors from one safetensors file, checking sizes, header and block CRCs
    against the manifest's ``record`` for the file (None: no checks beyond the header)."""

    def __init__(self, path: str, record: Optional[dict] = None):
        self.path, self.record, self.label = path, record, path
        if not os.path.exists(path):
            raise CheckpointError(
                f"shard file {self.label} is missing: the checkpoint is incomplete; restore the file or load an "
                "earlier checkpoint"
            )
        size = os.path.getsize(path)
        if record is not None and size != record["bytes"]:
            raise CheckpointError(
                f"shard file {self.label} is truncated or altered: {size} bytes on disk, the manifest records "
                f"{record['bytes']}; restore the file or load an earlier checkpoint"
            )
        self._fd = os.open(path, os.O_RDONLY)
        self.header, self.data_start = self._header(size)

    def _header(self, size: int) -> tuple[dict, int]:
        bad = (
            f"shard file {self.label} is not a safetensors file (its header is unreadable); flatshard reads only "
            "safetensors and JSON, never pickle. Restore the file or load an earlier checkpoint"
        )
        first = os.pread(self._fd, 8, 0)
        if len(first) < 8:
            raise CheckpointError(bad)
        (n,) = struct.unpack("<Q", first)
        if n > min(size - 8, _MAX_HEADER):
            raise CheckpointError(bad)
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except ValueError:
            raise CheckpointError(bad) from None
        if not isinstance(header, dict):
            raise CheckpointError(bad)
        end = max([v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"], default=0)
        if 8 + n + end > size:
            raise CheckpointError(
                f"shard file {self.label} is truncated: its header describes {8 + n + end} bytes, "
                f"the file has {size}; restore the file or load an earlier checkpoint"
            )
        return header, 8 + n

    @property
    def metadata(self) -> dict:
        return self.header.get("__metadata__", {})

    def entry(self, key: str) -> dict:
        if key not in self.header:
            raise CheckpointError(
                f"shard file {self.label} has no tensor {key!r}, which the manifest places there; "
                "the file does not belong to this checkpoint"
            )
        return self.header[key]

    def read(self, key: str, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """Elements [start, end) of tensor ``key``, flattened. The result may view a buffer up to one
        checksum block longer at each end: callers copy it where they keep it."""
        e = self.entry(key)
        dtype = BY_NAME[e["dtype"]]
        item = torch.empty((), dtype=dtype).element_size()
        begin, stop = e["data_offsets"]
        numel = (stop - begin) // item
        end = numel if end is None else end
        a, b = begin + start * item, begin + end * item  # wanted bytes, from the start of the data section
        if b <= a:
            return torch.empty(0, dtype=dtype)
        lo, hi = (a, b) if self.record is None else self._block_range(begin, stop, a, b)
        buf = bytearray(hi - lo)
        if os.preadv(self._fd, [buf], self.data_start + lo) != hi - lo:
            raise CheckpointError(f"shard file {self.label} ended early while reading {key!r}; the file is truncated")
        if self.record is not None:
            self._verify(key, begin, lo, buf)
        return torch.frombuffer(buf, dtype=dtype, count=(b - a) // item, offset=a - lo)

    def read_into(self, key: str, start: int, out: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``out`` with elements [start, start + out.numel()) of ``key``.
        When those bytes are whole checksum blocks (a whole piece, as consolidation and same-layout
        loads read) they land in ``out`` directly and are verified there: no intermediate buffer."""
        e = self.entry(key)
        item = out.element_size()
        begin, stop = e["data_offsets"]
        a, b = begin + start * item, begin + (start + out.numel()) * item
        if b <= a:
            return
        exact = self.record is None or self._block_range(begin, stop, a, b) == (a, b)
        if not exact or BY_NAME[e["dtype"]] != out.dtype or not out.is_contiguous() or out.device.type != "cpu":
            out.copy_(self.read(key, start, start + out.numel()))
            return
        buf = out.view(torch.uint8).numpy().data
        if os.preadv(self._fd, [buf], self.data_start + a) != b - a:
            raise CheckpointError(f"shard file {self.label} ended early while reading {key!r}; the file is truncated")
        if self.record is not None:
            self._verify(key, begin, a, buf)

    def _block_range(self, begin: int, stop: int, a: int, b: int) -> tuple[int, int]:
        assert self.record is not None  # called only for a file with checksums
        block = self.record["block_bytes"]
        first, last = (a - begin) // block, (b - begin - 1) // block
        return begin + first * block, min(stop, begin + (last + 1) * block)

    def _verify(self, key: str, begin: int, lo: int, buf) -> None:
        assert self.record is not None  # called only for a file with checksums
        crcs = self.record["blocks"].get(key)
        block = self.record["block_bytes"]
        first = (lo - begin) // block
        view = memoryview(buf)
        for j in range(0, len(buf), block):
            i = first + j // block
            chunk = view[j : j + block]
            if crcs is None or i >= len(crcs) or zlib.crc32(chunk) != crcs[i]:
                raise CheckpointError(
                    f"checksum mismatch in shard file {self.label}, tensor {key!r} (bytes {begin + i * block}–"
                    f"{begin + i * block + len(chunk)} of its data): the file is corrupt; restore it or load an "
                    "earlier checkpoint"
                )

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sha256_of(path: str, chunk: int = BLOCK) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(chunk):
            h.update(data)
    return h.hexdigest()


def write_json_atomic(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
