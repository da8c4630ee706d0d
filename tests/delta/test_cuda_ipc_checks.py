"""CUDA IPC messages: the fields torch trusts are checked before a handle is opened. On CPU: the
request model's checks of the reference counter's name and slot and of the event handle, the
counter file's checks, the range arithmetic. On a GPU (the `gpu` tests, skipped without CUDA): a
storage range past the sender's real allocation is refused before any byte is read."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from rltool.delta import cuda_ipc, shm_read, tensor_sync
from rltool.engine import api
from rltool.errors import BadInputError

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def handle(**fields) -> dict:
    return {"device_uuid": "GPU-0", "handle": b64(b"\1" * 66), "storage_bytes": 64,
            "storage_offset": 0, "ref_counter_handle": b64(b"/torch_4242_123456789_0"),
            "ref_counter_offset": 0, "event_handle": b64(bytes(64)), **fields}


def test_a_handle_as_torch_exports_it_is_accepted():
    h = api.CudaIpcHandle.model_validate(handle(ref_counter_offset=9999))
    assert h.ref_counter_offset == 9999


@pytest.mark.parametrize("name", [b"/dev/shm/x", b"/torch_1_2", b"/torch_1_2_3/../x",
                                  b"torch_1_2_3", b"/torch_1_2_3\0", b"/rltool-x", b""])
def test_a_ref_counter_that_is_not_torchs_is_refused(name):
    """Any ref_counter_handle was passed on to torch, which opens that shared-memory object
    read-write on release (and grows and writes it); only torch's own names are accepted."""
    with pytest.raises(ValidationError, match="reference-counter file"):
        api.CudaIpcHandle.model_validate(handle(ref_counter_handle=b64(name)))


@pytest.mark.parametrize("offset", [api.CUDA_IPC_REF_COUNTER_SLOTS, 10**12, -1])
def test_a_ref_counter_slot_outside_torchs_file_is_refused(offset):
    """torch decremented the int64 at any ref_counter_offset, however far past its counter
    file; only its slots are accepted."""
    with pytest.raises(ValidationError, match="ref_counter_offset"):
        api.CudaIpcHandle.model_validate(handle(ref_counter_offset=offset))


def test_event_and_memory_handles_are_bounded():
    """torch read a 64-byte event handle from whatever bytes it was given."""
    with pytest.raises(ValidationError, match="event_handle must hold 64 bytes"):
        api.CudaIpcHandle.model_validate(handle(event_handle=b64(b"\1" * 8)))
    with pytest.raises(ValidationError, match="needs event_handle"):
        api.CudaIpcHandle.model_validate(handle(event_handle=None, event_sync_required=True))
    with pytest.raises(ValidationError, match="handle exceeds"):
        api.CudaIpcHandle.model_validate(
            handle(handle=b64(bytes(api.MAX_CUDA_IPC_HANDLE_BYTES + 1))))
    with pytest.raises(ValidationError, match="not base64"):
        api.CudaIpcHandle.model_validate(handle(ref_counter_handle="!!"))


def counter_file(tmp_path, name: str, size: int) -> Path:
    path = tmp_path / name.lstrip("/")
    path.write_bytes(bytes(size))
    return path


def test_the_ref_counter_file_must_be_torchs_own_size_and_this_users(tmp_path, monkeypatch):
    """torch grows a shorter counter object to its size; one that is not a regular file of the
    engine's user, or is shorter than torch's, is refused before the handle is opened."""
    name = "/torch_1_2_3"
    counter_file(tmp_path, name, cuda_ipc.REF_COUNTER_FILE_BYTES)
    cuda_ipc.check_ref_counter(name, shm_dir=tmp_path)
    counter_file(tmp_path, "/torch_1_2_4", 8 * 16)
    with pytest.raises(BadInputError, match="holds 128 bytes"):
        cuda_ipc.check_ref_counter("/torch_1_2_4", shm_dir=tmp_path)
    os.symlink(tmp_path / "torch_1_2_3", tmp_path / "torch_1_2_5")
    with pytest.raises(BadInputError, match="symbolic link"):
        cuda_ipc.check_ref_counter("/torch_1_2_5", shm_dir=tmp_path)
    with pytest.raises(BadInputError, match="No such file"):
        cuda_ipc.check_ref_counter("/torch_1_2_6", shm_dir=tmp_path)
    monkeypatch.setattr(shm_read, "engine_uid", lambda: os.geteuid() + 1)
    with pytest.raises(BadInputError, match="belongs to uid"):
        cuda_ipc.check_ref_counter(name, shm_dir=tmp_path)


@pytest.mark.parametrize("offset,nbytes,ok", [(0, 4096, True), (1024, 3072, True),
                                              (1024, 3073, False), (4096, 1, False),
                                              (1 << 40, 64, False)])
def test_the_storage_range_must_lie_inside_the_allocation(offset, nbytes, ok):
    """storage_offset and storage_bytes were taken as given: a copy read whatever lay past the
    sender's allocation."""
    allocation = (0x7000_0000, 4096)
    if ok:
        cuda_ipc.check_range(0x7000_0000, offset, nbytes, allocation)
    else:
        with pytest.raises(BadInputError, match="outside the shared allocation"):
            cuda_ipc.check_range(0x7000_0000, offset, nbytes, allocation)


def export(nbytes: int) -> None:
    """The sender process: one CudaIpcBuffer export on stdout, kept until stdin closes."""
    named = [("w", torch.arange(nbytes // 4, dtype=torch.float32, device="cuda"))]
    with tensor_sync.CudaIpcBuffer(nbytes, device="cuda") as buf:
        print(json.dumps(buf.write(named)), flush=True)
        sys.stdin.read()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_a_storage_range_past_the_real_allocation_is_refused_on_the_gpu(alloc_conf):
    """A message claiming more bytes (or a later offset) than the sender's allocation holds was
    opened and read past it; the range is checked against the driver's view of the mapping before
    any read, and the export as sent still opens and reads back the sender's bytes (with either
    of the sender's allocators)."""
    nbytes = 1 << 16
    proc = subprocess.Popen(
        [sys.executable, "-c", f"from tests.delta.test_cuda_ipc_checks import export; "
                               f"export({nbytes})"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": alloc_conf})
    try:
        message = api.TensorMessage.model_validate_json(proc.stdout.readline())
        ref = base64.b64decode(message.cuda_ipc.ref_counter_handle).decode()
        assert os.stat(shm_read.SHM_DIR / ref.lstrip("/")).st_size == \
            cuda_ipc.REF_COUNTER_FILE_BYTES  # torch's counter file is the size checked
        with tensor_sync.open_message(message, device="cuda") as named:
            assert named[0][1].equal(torch.arange(nbytes // 4, dtype=torch.float32,
                                                  device="cuda"))
        for bad in ({"storage_bytes": 1 << 40}, {"storage_offset": 1 << 40}):
            h = message.cuda_ipc.model_copy(update=bad)
            with pytest.raises(BadInputError, match="outside the shared allocation"):
                with cuda_ipc.open_cuda_ipc(h):
                    pytest.fail("the buffer opened")
    finally:
        proc.stdin.close()
        proc.wait(60)
