"""Rebuild a full checkpoint from a base and a chain of deltas, verifying every checksum.

One pass over the base: each worker thread takes one tensor and streams it in blocks of
`BLOCK_BYTES` through one reused buffer: copy the block from the base (read-only mmap), apply
every delta of the chain that touches the tensor, feed the hash of each declared checksum, and
write the block at the base layout's offset in the output file. A block stays in cache from the
copy to the write (whole-tensor passes went through memory four times), and memory per worker
is one block whatever the tensor's size. Checksums are compared once the tensor is through.
The output keeps the base's file layout byte for byte (same headers, same offsets); only tensor
bytes differ. Nothing is published unless every check passes: the output directory appears
whole (index last) or not at all.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xxhash

from rltool import atomic
from rltool.delta import codec
from rltool.delta.deltadir import DeltaDir
from rltool.delta.diff import default_workers
from rltool.errors import DeltaChainError
from rltool.io.checkpoint import Checkpoint
from rltool.io.header import INDEX_NAME, element_size
from rltool.io.writer import OutputFile, output_like
from rltool.progress import Progress

BLOCK_BYTES = 512 << 10


class _RltoolPatch:
    """rltool's chunked blob for one tensor, applied to consecutive byte ranges in order; each
    chunk's payload is decompressed when the first range reaches it."""

    def __init__(self, delta: DeltaDir, name: str, *, dtype: str, nbytes: int, what: str):
        record = delta.tensors[name].record
        if record.get("dtype") != dtype or not isinstance(record.get("chunks"), list):
            raise DeltaChainError(f"{what}: delta was made for dtype {record.get('dtype')!r}, "
                                  f"the base holds {dtype!r}")
        self.width = codec.element_width(element_size(dtype), nbytes)
        self.step = delta.chunk_elements * self.width
        self.records, self.nbytes, self.what = record["chunks"], nbytes, what
        if self.step <= 0 or len(self.records) != -(-nbytes // self.step):
            raise DeltaChainError(f"{what}: {len(self.records)} chunk records for a "
                                  f"{nbytes}-byte tensor")
        self.blob = memoryview(delta.read_blob(name))
        self.offsets = [0]
        for rec in self.records:
            size = int(rec[1]) if isinstance(rec, list) and len(rec) == 4 else -1
            if size < 0 or self.offsets[-1] + size > len(self.blob):
                raise DeltaChainError(f"{what}: chunk records overrun the blob")
            self.offsets.append(self.offsets[-1] + size)
        if self.offsets[-1] != len(self.blob):
            raise DeltaChainError(f"{what}: blob has {len(self.blob) - self.offsets[-1]} bytes "
                                  "past its chunk records")
        self.chunk: tuple[int, codec.ChunkPatch] | None = None

    def apply(self, buf: np.ndarray, start: int) -> None:
        pos, end = start, start + len(buf)
        while pos < end:
            i = pos // self.step
            if self.chunk is None or self.chunk[0] != i:
                size = min(self.step, self.nbytes - i * self.step)
                self.chunk = (i, codec.ChunkPatch(
                    self.records[i], self.blob[self.offsets[i]:self.offsets[i + 1]],
                    count=size // self.width, width=self.width, what=self.what))
            stop = min(end, (i + 1) * self.step)
            self.chunk[1].apply(buf[pos - start:stop - start], (pos - i * self.step) // self.width)
            pos = stop


def tensor_patch(delta: DeltaDir, name: str, *, dtype: str, nbytes: int):
    """`delta`'s entry for `name` as an object whose apply(buf, start) patches the tensor bytes
    [start, start + len(buf)) in place; call it on consecutive ranges from 0 in order."""
    what = f"{delta.root.name}:{name}"
    if delta.fmt == "rltool":
        return _RltoolPatch(delta, name, dtype=dtype, nbytes=nbytes, what=what)
    blob = memoryview(delta.read_blob(name))
    if delta.encoding == "overwrite":
        return codec.SlimeOverwritePatch(blob, nbytes=nbytes, what=what)
    return codec.SlimeXorPatch(blob, nbytes=nbytes, what=what)


def decode_tensor(delta: DeltaDir, name: str, buf: np.ndarray, *, dtype: str) -> np.ndarray:
    """Apply `delta`'s entry for `name` to the whole tensor bytes `buf` (in place); return it."""
    tensor_patch(delta, name, dtype=dtype, nbytes=buf.nbytes).apply(buf, 0)
    return buf


def check_links(deltas: list[DeltaDir], *, base_version: int | None) -> None:
    expected = base_version
    for d in deltas:
        if expected is not None and d.base_version != expected:
            raise DeltaChainError(f"{d.root} applies on version {d.base_version}, but the "
                                  f"checkpoint it would patch is version {expected} (wrong base)")
        expected = d.version


def _rebuild_tensor(name: str, base: Checkpoint, deltas: list[DeltaDir], *, buf: np.ndarray,
                    out: OutputFile | None) -> bool:
    """Stream tensor `name` from the base through the chain into `out` (None: verify only) in
    blocks of len(buf) bytes, then check every checksum the chain declares for it. Returns
    whether any delta touched it."""
    e = base.entry(name)
    # One step per delta: its patch (if it touches the tensor) and the hash to feed after it.
    # Deltas that leave the tensor alone share the hash of the state before them.
    steps: list[tuple[object | None, xxhash.xxh3_128 | None]] = []
    checks: list[tuple[xxhash.xxh3_128, DeltaDir, str]] = []
    hasher = None
    for d in deltas:
        patch = (tensor_patch(d, name, dtype=e.dtype, nbytes=e.nbytes) if name in d.tensors
                 else None)
        if patch is not None:
            want, hasher = d.tensors[name].checksum, None
        elif d.all_checksums is not None:
            want = d.all_checksums[name]
        else:
            continue
        fresh = hasher is None
        if fresh:
            hasher = xxhash.xxh3_128()
        steps.append((patch, hasher if fresh else None))
        checks.append((hasher, d, want))
    src = base.view(name)
    for start in range(0, e.nbytes, len(buf)):
        block = buf[:min(len(buf), e.nbytes - start)]
        np.copyto(block, src[start:start + len(block)])
        for patch, h in steps:
            if patch is not None:
                patch.apply(block, start)
            if h is not None:
                h.update(block)
        if out is not None:
            out.write(block, e.start + start)
    for h, d, want in checks:
        digest = h.hexdigest()
        if digest != want:
            raise DeltaChainError(f"checksum mismatch for tensor {name!r} after applying "
                                  f"{d.root} (got {digest}, expected {want}): the delta is "
                                  "corrupt or was made on another base (wrong base)")
    return any(patch is not None for patch, _ in steps)


def _extra_files(base: Checkpoint, deltas: list[DeltaDir]) -> dict[str, Path]:
    files = base.extra_paths()
    for d in deltas:
        for rel in d.removed_files:
            files.pop(rel, None)
        for rel, want in d.files.items():
            path = d.root / rel
            if not path.is_file():
                raise DeltaChainError(f"{d.root}: extra file {rel} is missing")
            if want is not None and codec.checksum(path.read_bytes()) != want:
                raise DeltaChainError(f"{d.root}: extra file {rel} fails its checksum")
            files[rel] = path
    return files


def apply_chain(base: Checkpoint, deltas: list[DeltaDir], out: str | os.PathLike | None, *,
                base_version: int | None, workers: int | None = None) -> dict:
    """Rebuild `base` + `deltas` into the new directory `out` (None: verify only, write nothing).

    Raises DeltaChainError on a wrong base, a broken link, an unknown tensor or a checksum
    mismatch; then `out` does not exist."""
    t0 = time.perf_counter()
    check_links(deltas, base_version=base_version)
    for d in deltas:
        unknown = sorted(set(d.tensors) - set(base.tensor_file))
        if unknown:
            raise DeltaChainError(f"{d.root} patches tensors the base lacks (e.g. {unknown[:3]}); "
                                  "wrong base")
        unchecked = sorted(set(base.tensor_file) - set(d.all_checksums)
                           if d.all_checksums is not None else ())
        if unchecked:
            raise DeltaChainError(f"{d.root} declares no checksum for tensors of its version "
                                  f"(e.g. {unchecked[:3]}); it cannot be verified")
    extras = _extra_files(base, deltas)
    workers = workers or default_workers()
    names = base.names()
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(atomic.publish_dir(out)) if out is not None else None
        outs = {}
        if tmp is not None:
            for fname, f in base.files.items():
                outs[fname] = stack.enter_context(output_like(tmp / fname, like=f))
        pool = stack.enter_context(ThreadPoolExecutor(workers))
        scratch = threading.local()  # one reused block buffer per worker

        def work(name: str) -> bool:
            if getattr(scratch, "buf", None) is None:
                scratch.buf = np.empty(BLOCK_BYTES, dtype=np.uint8)
            return _rebuild_tensor(name, base, deltas, buf=scratch.buf,
                                   out=outs.get(base.tensor_file[name]))

        progress = Progress("delta apply", total=len(names), unit="tensors")
        changed = sum(progress.track(pool.map(work, names)))
        if tmp is not None:
            for rel, src in extras.items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, tmp / rel)
            if (base.root / INDEX_NAME).is_file():
                shutil.copyfile(base.root / INDEX_NAME, tmp / INDEX_NAME)
    return {"tensors_total": len(names), "tensors_changed": int(changed),
            "versions_applied": [d.version for d in deltas],
            "version": deltas[-1].version if deltas else base_version,
            "bytes": sum(base.entry(n).nbytes for n in names), "decode_s": time.perf_counter() - t0,
            "workers": workers}
