"""The receiver's side of CUDA IPC: open a sender's device buffer from the JSON fields of its
`_share_cuda_` export (rltool.engine.api.CudaIpcHandle), after checking what torch itself
trusts.

torch's `_new_shared_cuda` maps the allocation the handle names and records the reference
counter it must decrement when the mapping is released: it opens the shared-memory object
`ref_counter_handle` read-write (growing it when it is shorter than torch's counter file) and
decrements the int64 at `ref_counter_offset`; `storage_offset` and `storage_bytes` are taken as
given. So, before a byte is read:

- the counter's name and slot are torch's own (checked by the request model), and the object is a
  regular file of the engine's user, already the size torch makes it (nothing is grown);
- once mapped, `storage_offset + storage_bytes` must lie inside the allocation the handle opened,
  as the driver reports it (`cuMemGetAddressRange`), so a copy never reads past it.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rltool.delta import shm_read
from rltool.delta.sync_limits import CUDA_IPC_HANDLE_BYTES, CUDA_IPC_REF_COUNTER_SLOTS
from rltool.errors import BadInputError

# torch's RefcountedMapAllocator puts a 64-byte header (map_alloc_alignment) before the slots.
REF_COUNTER_FILE_BYTES = 64 + 8 * CUDA_IPC_REF_COUNTER_SLOTS


def unb64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as e:
        raise BadInputError(f"cuda_ipc.{what} is not base64: {e}") from e


def check_ref_counter(name: str, *, shm_dir: Path = shm_read.SHM_DIR) -> None:
    """The reference-counter object `name` (/torch_...) is a regular file of this user, as large
    as torch's counter file; BadInputError otherwise."""
    fd = shm_read.open_checked(shm_dir / name.lstrip("/"), nbytes=REF_COUNTER_FILE_BYTES,
                               what=f"CUDA IPC reference counter {name!r}")
    os.close(fd)


def check_range(base: int, offset: int, nbytes: int, allocation: tuple[int, int]) -> None:
    """`nbytes` at `base + offset` lie inside `allocation` (its start and size); BadInputError
    otherwise. `base` is where the handle's allocation was mapped."""
    start, size = allocation
    if not (start <= base and base + offset + nbytes <= start + size):
        raise BadInputError(f"cuda_ipc storage_offset {offset} + storage_bytes {nbytes} lie "
                            f"outside the shared allocation of {size - (base - start)} bytes; "
                            "send the fields _share_cuda_ returned")


@functools.cache
def _address_range() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")  # already loaded by torch's CUDA runtime
    fn = lib.cuMemGetAddressRange_v2
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                   ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return fn


def allocation_range(ptr: int, device_index: int) -> tuple[int, int]:
    """(start, size) of the device allocation holding `ptr`, from the driver."""
    start, size = ctypes.c_uint64(), ctypes.c_size_t()
    with torch.cuda.device(device_index):  # the driver call needs the device's context current
        rc = _address_range()(ctypes.byref(start), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise BadInputError(f"the CUDA driver does not know the shared allocation (CUresult "
                            f"{rc}); send the fields _share_cuda_ returned")
    return int(start.value), int(size.value)


def device_index(uuid: str) -> int:
    index = next((i for i in range(torch.cuda.device_count())
                  if str(torch.cuda.get_device_properties(i).uuid) == uuid), None)
    if index is None:
        raise BadInputError(f"the sender's GPU {uuid} is not visible to this engine; CUDA IPC "
                            "needs both on the same GPU")
    return index


@contextmanager
def open_cuda_ipc(h: Any, *, shm_dir: Path = shm_read.SHM_DIR) -> Iterator[torch.Tensor]:
    """The sender's buffer as a uint8 tensor on the GPU whose UUID the handle names; the mapping
    is released when the block ends (the sender may then reuse or free its buffer)."""
    index = device_index(h.device_uuid)
    ref_name = unb64(h.ref_counter_handle, "ref_counter_handle")
    check_ref_counter(ref_name.decode("ascii"), shm_dir=shm_dir)
    event = unb64(h.event_handle, "event_handle") if h.event_handle else bytes(
        CUDA_IPC_HANDLE_BYTES)  # torch wants bytes even when it need not wait on the event
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index, unb64(h.handle, "handle"), h.storage_bytes, h.storage_offset, ref_name,
            h.ref_counter_offset, event, h.event_sync_required)
    except (RuntimeError, TypeError) as e:
        raise BadInputError(f"cannot open the CUDA IPC handle: {e}") from e
    try:
        base = storage.data_ptr() - h.storage_offset
        check_range(base, h.storage_offset, h.storage_bytes, allocation_range(base, index))
        buf = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
        buf.set_(storage, 0, (h.storage_bytes,), (1,))
        yield buf
    finally:
        torch.cuda.synchronize(index)  # every copy out of the buffer has run
        buf = storage = None  # the last reference: torch releases the mapping and the counter
