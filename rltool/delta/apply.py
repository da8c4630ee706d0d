"""Rebuild a full checkpoint from a base and a chain of deltas, verifying every checksum.

One pass over the base: each worker thread reads one tensor, applies every delta of the chain that
touches it in order (checking the declared checksum after each) in a reused buffer, and writes
the result at the base layout's offset in the output file. The output keeps the base's file layout byte for byte
(same headers, same offsets); only tensor bytes differ. Nothing is published unless every check
passes: the output directory appears whole (index last) or not at all.
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

from rltool import atomic
from rltool.delta import codec
from rltool.delta.checkpoint import INDEX_NAME, Checkpoint
from rltool.delta.deltadir import DeltaDir
from rltool.delta.diff import default_workers
from rltool.delta.safetensors_io import DTYPE_SIZES, output_like
from rltool.errors import DeltaChainError


def decode_tensor(delta: DeltaDir, name: str, buf: np.ndarray, *, dtype: str) -> np.ndarray:
    """Apply `delta`'s entry for `name` to the tensor bytes `buf` (in place) and return it."""
    what = f"{delta.root.name}:{name}"
    blob = memoryview(delta.read_blob(name))
    if delta.fmt == "slime":
        if delta.encoding == "overwrite":
            return codec.decode_overwrite(blob, buf, what=what)
        read = codec.slime_xor_reader(blob, nbytes=buf.nbytes, what=what)
        step = codec.CHUNK_ELEMENTS * 2
        for off in range(0, buf.nbytes, step):
            part = buf[off:off + step]
            part ^= read(len(part))
        return buf
    record = delta.tensors[name].record
    if record.get("dtype") != dtype or not isinstance(record.get("chunks"), list):
        raise DeltaChainError(f"{what}: delta was made for dtype {record.get('dtype')!r}, "
                              f"the base holds {dtype!r}")
    width = codec.element_width(DTYPE_SIZES.get(dtype, 1), buf.nbytes)
    step = delta.chunk_elements * width
    chunks = record["chunks"]
    if step <= 0 or len(chunks) != -(-buf.nbytes // step):
        raise DeltaChainError(f"{what}: {len(chunks)} chunk records for a {buf.nbytes}-byte tensor")
    pos = 0
    for i, rec in enumerate(chunks):
        size = int(rec[1]) if isinstance(rec, list) and len(rec) == 4 else -1
        if size < 0 or pos + size > len(blob):
            raise DeltaChainError(f"{what}: chunk records overrun the blob")
        codec.decode_chunk(rec, blob[pos:pos + size], buf[i * step:(i + 1) * step], width=width,
                           what=what)
        pos += size
    if pos != len(blob):
        raise DeltaChainError(f"{what}: blob has {len(blob) - pos} bytes past its chunk records")
    return buf


def check_links(deltas: list[DeltaDir], *, base_version: int | None) -> None:
    expected = base_version
    for d in deltas:
        if expected is not None and d.base_version != expected:
            raise DeltaChainError(f"{d.root} applies on version {d.base_version}, but the "
                                  f"checkpoint it would patch is version {expected} (wrong base)")
        expected = d.version


def _rebuild_tensor(name: str, buf: np.ndarray, base: Checkpoint, deltas: list[DeltaDir]) -> bool:
    """Apply the chain to the tensor bytes `buf` (the base's, patched in place); checks every
    checksum the chain declares for `name`. Returns whether any delta touched it."""
    dtype = base.entry(name).dtype
    digest: str | None = None
    changed = False
    for d in deltas:
        if name in d.tensors:
            decode_tensor(d, name, buf, dtype=dtype)
            digest, changed = codec.checksum(buf), True
            want = d.tensors[name].checksum
        elif d.all_checksums is not None:
            digest = digest or codec.checksum(buf)
            want = d.all_checksums.get(name, "")
        else:
            continue
        if digest != want:
            raise DeltaChainError(f"checksum mismatch for tensor {name!r} after applying "
                                  f"{d.root} (got {digest}, expected {want}): the delta is "
                                  "corrupt or was made on another base (wrong base)")
    return changed


def _extra_files(base: Checkpoint, deltas: list[DeltaDir]) -> dict[str, Path]:
    files = base.extra_paths()
    for d in deltas:
        for rel in d.removed_files:
            files.pop(rel, None)
        for rel, want in d.files.items():
            path = d.root / rel
            if not path.is_file():
                raise DeltaChainError(f"{d.root}: extra file {rel} is missing")
            if want and codec.checksum(path.read_bytes()) != want:
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
        scratch = threading.local()  # one reused buffer per worker: no page faults per tensor

        def work(name: str) -> bool:
            e = base.entry(name)
            if getattr(scratch, "buf", None) is None or scratch.buf.nbytes < e.nbytes:
                scratch.buf = np.empty(e.nbytes, dtype=np.uint8)
            buf = base.read(name, out=scratch.buf[:e.nbytes])
            changed = _rebuild_tensor(name, buf, base, deltas)
            if outs:
                outs[base.tensor_file[name]].write(buf, e.start)
            return changed

        changed = sum(pool.map(work, names))
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
