"""In-memory weight sync, both ends: named tensors handed to an engine on the same host without a
checkpoint on disk, and the process group a trainer rank broadcasts over.

Shared memory (CPU). The sender owns one segment, a file `/dev/shm/rltool-<id>` created with
O_EXCL, sized to one bucket (at least the largest tensor). For each bucket it copies the tensors in
at 64-byte aligned offsets and sends their description (name, dtype, shape, offset: a JSON
`rltool.engine.api.TensorMessage`, never a pickle) in `/update_weights_from_tensor`; the engine
checks the segment (a regular file of its own user, not a link or a FIFO) and copies it into a
private buffer off the scheduler thread (rltool.delta.shm_read), checks every entry, copies into
its parameters and answers; only then is the segment reused for the next bucket. Extra memory on
either side is one bucket. Block-FP8 weights (`quantize_named`) travel as e4m3 tensors, each with
its float32 scales in the same bucket, the message naming their `weight_block_size`.

CUDA IPC (a sender and a CUDA engine on the same GPU). The same message with transport
"cuda_ipc": the sender owns one device buffer of a bucket, copies each bucket in, waits for the
copies, and exports the buffer as a CUDA IPC handle (torch's `_share_cuda_` fields, bytes in
base64, in place of `segment`; what torch.multiprocessing would pickle, written out as JSON). The
engine checks the fields torch trusts, opens the handle on the GPU with that UUID, checks the
range against the real allocation (rltool.delta.cuda_ipc), copies into its parameters, waits,
releases the mapping and answers; the offsets index the buffer. Extra device memory: one bucket
on the sender.

Process group (`/init_weights_update_group`): rltool.delta.sync_group.
"""

from __future__ import annotations

import base64
import mmap
import os
import secrets
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rltool.convert import int4
from rltool.convert.fp8 import SCALE_SUFFIX, quantize_state
from rltool.delta.cuda_ipc import open_cuda_ipc
from rltool.delta.shm_read import SHM_DIR, read_segment
from rltool.errors import BadInputError

ALIGN = 64
DEFAULT_BUCKET_BYTES = 512 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn, "int32": torch.int32, "int64": torch.int64}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_of(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise BadInputError(f"dtype {name!r} is not one of {sorted(DTYPES)}") from None


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def buckets(named: list[tuple[str, torch.Tensor]], *, bucket_bytes: int
            ) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most `bucket_bytes` (aligned) each; a tensor larger
    than a bucket travels alone, and an FP8 weight's scales (an INT4 weight's scale, zero point
    and shape) travel with the weight before them."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, t in named:
        n = _aligned(t.numel() * t.element_size())
        pairs = bool(out and out[-1]) and _companion(name, out[-1][-1][0])
        if not out or (size + n > bucket_bytes and out[-1] and not pairs):
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return out


def _companion(name: str, previous: str) -> bool:
    """Whether tensor `name` belongs with the tensor `previous` sent just before it."""
    if name.endswith(SCALE_SUFFIX):
        return previous == name.removesuffix(SCALE_SUFFIX)
    base, _, suffix = name.rpartition(".")
    return (suffix in (int4.SCALE, int4.ZERO_POINT, int4.SHAPE)
            and previous.rpartition(".")[0] == base)


class ShmSegment:
    """The sender's segment: created on enter, unlinked on exit (also after an error)."""

    def __init__(self, nbytes: int, *, shm_dir: Path = SHM_DIR):
        self.name = f"rltool-{os.getpid()}-{secrets.token_hex(6)}"
        self.path = shm_dir / self.name
        self.nbytes = max(int(nbytes), 1)
        self._mm: mmap.mmap | None = None

    def __enter__(self) -> "ShmSegment":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
            self._mm = mmap.mmap(fd, self.nbytes)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mm is not None:
            _close(self._mm)
            self._mm = None
        self.path.unlink(missing_ok=True)

    def write(self, bucket: list[tuple[str, torch.Tensor]], *,
              dtype: torch.dtype | None = None) -> dict[str, Any]:
        """Copy `bucket` in (cast to `dtype` when given: the receiver's dtype, so the cast costs
        no memory beyond the segment) and return its message (a `TensorMessage` as a dict)."""
        assert self._mm is not None, "use ShmSegment as a context manager"
        view = torch.frombuffer(self._mm, dtype=torch.uint8)
        entries = _pack(view, bucket, dtype)
        del view
        return {"transport": "shm", "segment": self.name, "nbytes": self.nbytes,
                "tensors": entries}


class CudaIpcBuffer:
    """The sender's device buffer for CUDA IPC: allocated on enter, dropped on exit (torch keeps
    the memory until every receiver has released its mapping)."""

    def __init__(self, nbytes: int, *, device: torch.device | str):
        self.nbytes = max(int(nbytes), 1)
        self.device = torch.device(device)
        self._buf: torch.Tensor | None = None

    def __enter__(self) -> "CudaIpcBuffer":
        self._buf = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        self._buf = None

    def write(self, bucket: list[tuple[str, torch.Tensor]], *,
              dtype: torch.dtype | None = None) -> dict[str, Any]:
        """Copy `bucket` in (cast to `dtype` when given), wait for the copies, and return its
        message with a fresh export of the buffer (a `TensorMessage` as a dict)."""
        assert self._buf is not None, "use CudaIpcBuffer as a context manager"
        entries = _pack(self._buf, bucket, dtype)
        torch.cuda.synchronize(self.device)
        (device, handle, size, offset, ref_handle, ref_offset, event_handle,
         event_sync) = self._buf.untyped_storage()._share_cuda_()
        ipc = {"device_uuid": str(torch.cuda.get_device_properties(device).uuid),
               "handle": _b64(handle), "storage_bytes": int(size), "storage_offset": int(offset),
               "ref_counter_handle": _b64(ref_handle), "ref_counter_offset": int(ref_offset),
               "event_handle": _b64(event_handle) if event_handle else None,
               "event_sync_required": bool(event_sync)}
        return {"transport": "cuda_ipc", "cuda_ipc": ipc, "nbytes": self.nbytes,
                "tensors": entries}


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _pack(dst: torch.Tensor, bucket: list[tuple[str, torch.Tensor]],
          dtype: torch.dtype | None) -> list[dict[str, Any]]:
    """Copy the bucket's tensors into the uint8 buffer `dst` at aligned offsets; their entries."""
    entries, offset = [], 0
    for name, t in bucket:
        t = t.detach()
        # cast floating tensors only: INT4 codes and shapes travel as they are
        out_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if out_dtype not in DTYPE_NAMES:
            raise BadInputError(f"tensor {name!r}: dtype {out_dtype} cannot be synced; use "
                                f"one of {sorted(DTYPES)}")
        n = t.numel() * torch.empty((), dtype=out_dtype).element_size()
        if offset + n > dst.numel():
            raise BadInputError(f"bucket of {offset + n} bytes exceeds the buffer's "
                                f"{dst.numel()}")
        dst[offset:offset + n].view(out_dtype).view(t.shape).copy_(t)
        entries.append({"name": name, "dtype": DTYPE_NAMES[out_dtype],
                        "shape": list(t.shape), "offset": offset})
        offset = _aligned(offset + n)
    return entries


def unpack(src: torch.Tensor, message: Any) -> list[tuple[str, torch.Tensor]]:
    """Views of the uint8 buffer `src` for the message's entries, each checked to fit."""
    size = src.numel()
    named: list[tuple[str, torch.Tensor]] = []
    for e in message.tensors:
        dtype = dtype_of(e.dtype)
        if any(d < 0 for d in e.shape):
            raise BadInputError(f"tensor {e.name!r}: negative dimension in {e.shape}")
        count = 1
        for d in e.shape:
            count *= d
        n = count * torch.empty((), dtype=dtype).element_size()
        if e.offset % ALIGN or e.offset + n > size:
            raise BadInputError(f"tensor {e.name!r}: {n} bytes at offset {e.offset} do not "
                                f"fit the {size}-byte buffer (offsets are {ALIGN}-aligned)")
        named.append((e.name, src[e.offset:e.offset + n].view(dtype).view(e.shape)))
    return named


def quantize_named(named: list[tuple[str, torch.Tensor]], *, dtype: torch.dtype,
                   block: tuple[int, int]) -> list[tuple[str, torch.Tensor]]:
    """The block-FP8 version of `named` cast to `dtype` (what `rltool convert fp8` stores for a
    checkpoint of them): each quantized weight followed by its `<name>_scale_inv`, on the device
    the tensors are on (a GPU quantizes its own tensors in a few kernels per weight; CPU tensors
    go through the native kernel, one per thread)."""
    state = {n: t.detach().to(dtype=dtype).contiguous() for n, t in named}
    on_cpu = all(t.device.type == "cpu" for t in state.values())
    return list(quantize_state(state, block, workers=None if on_cpu else 1)[0].items())


def quantize_named_int4(named: list[tuple[str, torch.Tensor]], *, dtype: torch.dtype,
                        fmt: int4.Int4Format) -> list[tuple[str, torch.Tensor]]:
    """The INT4 version of `named` cast to `dtype` (what `rltool convert int4` stores for a
    checkpoint of them, in `fmt`), quantized on the device the tensors are on: each INT4 weight
    as its `weight_packed`, followed by its scale, zero point (asymmetric) and shape."""
    state = {n: t.detach().to(dtype=dtype).contiguous() for n, t in named}
    return list(int4.quantize_state(state, fmt)[0].items())


def segment_bytes(named: list[tuple[str, torch.Tensor]], *, bucket_bytes: int) -> int:
    """The segment size the buckets of `named` need: the largest bucket."""
    return max((sum(_aligned(t.numel() * t.element_size()) for _, t in b)
                for b in buckets(named, bucket_bytes=bucket_bytes)), default=ALIGN)


@contextmanager
def open_message(message: Any, *, device: torch.device | str = "cpu", shm_dir: Path = SHM_DIR
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The receiver's side: the named tensors of a `TensorMessage`, as views of a private copy of
    the segment (`read_segment`: callers that must not block run it first, off their
    thread, and `unpack` its result), or of the sender's device buffer (transport cuda_ipc, a CUDA
    receiver `device` only). Views are valid inside the block only. Raises BadInputError for a
    message that does not fit its buffer or cannot be opened."""
    device = torch.device(device)
    if message.transport == "cuda_ipc":
        if device.type != "cuda":
            raise BadInputError("transport \"cuda_ipc\" needs an engine serving on CUDA; send "
                                "transport \"shm\" (load_format \"rltool_shm\") to this one")
        with open_cuda_ipc(message.cuda_ipc, shm_dir=shm_dir) as buf:
            if buf.numel() < message.nbytes:
                raise BadInputError(f"the CUDA IPC buffer holds {buf.numel()} bytes, the "
                                    f"message says {message.nbytes}")
            named = unpack(buf, message)
            try:
                yield named
            finally:
                named.clear()
        return
    named = unpack(read_segment(message.segment, message.nbytes, shm_dir=shm_dir), message)
    try:
        yield named
    finally:
        named.clear()


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a view outlived its block; the mapping goes with the last view
        pass


def broadcast(group: Any, tensors: Iterable[torch.Tensor]) -> None:
    """Rank 0 sends, every other rank receives into `tensors` (same order, shapes and dtypes).
    Returns once the tensors are usable from any thread and stream."""
    tensors = list(tensors)
    for t in tensors:
        group.broadcast(t, 0).wait()
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()


def describe(named: list[tuple[str, torch.Tensor]]) -> dict[str, list[Any]]:
    """The names/dtypes/shapes of `/update_weights_from_distributed` for `named`."""
    return {"names": [n for n, _ in named],
            "dtypes": [DTYPE_NAMES[t.dtype] for _, t in named],
            "shapes": [list(t.shape) for _, t in named]}
