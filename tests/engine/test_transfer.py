"""In-memory weight updates on CPU: /update_weights_from_tensor through shared memory and
/update_weights_from_distributed over gloo leave the engine's parameters bit-equal to the sender's
tensors (checked against the sender's own state dict), bump the weight version, and refuse a
wrong name, shape or dtype with 400 while the old weights keep serving."""

from __future__ import annotations

import base64
import json
import os
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient

from rltool.delta import sync_group, tensor_sync
from rltool.delta.sync_limits import MAX_SYNC_WORLD_SIZE
from rltool.engine import api
from rltool.engine.app import EngineState, build_app
from rltool.engine.config import ServeConfig
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.errors import BadInputError
from rltool.supervisor import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def engine(tiny_model_dir, request):
    """A CPU engine; indirect parameters are ServeConfig fields."""
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32")
    sched = PagedScheduler(runner, max_running=2)
    cfg = ServeConfig(model=tiny_model_dir, **getattr(request, "param", {}))
    sched.start()
    app = build_app(EngineState(cfg=cfg, runner=runner, scheduler=sched, started=time.monotonic()))
    with TestClient(app) as client:
        yield client, runner
    sched.stop()


def new_state(runner: PagedRunner, *, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Other weights for every parameter of the served model (the sender's state), by HF name."""
    gen = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(t.shape, generator=gen, dtype=t.dtype))
            for name, t in served(runner).items()]


def served(runner: PagedRunner) -> dict[str, torch.Tensor]:
    """The served weights by HF name: copies of their slices of the fused layout."""
    return {name: dest[at:at + rows].clone()
            for name, (dest, at, rows) in runner.model._targets().items()}


def post_tensor(client, message: dict, **extra) -> object:
    body = {"serialized_named_tensors": [json.dumps(message)], "load_format": api.SHM_FORMAT,
            **extra}
    return client.post(api.UPDATE_WEIGHTS_FROM_TENSOR, json=body)


def test_shared_memory_update_is_bit_equal_and_bucketed(engine):
    client, runner = engine
    named = new_state(runner, seed=1)
    bucket_bytes = 4096  # many buckets: the segment holds one bucket, not the model
    groups = tensor_sync.buckets(named, bucket_bytes=bucket_bytes)
    size = tensor_sync.segment_bytes(named, bucket_bytes=bucket_bytes)
    total = sum(t.numel() * t.element_size() for _, t in named)
    assert len(groups) > 3 and size < total
    with tensor_sync.ShmSegment(size) as seg:
        for i, bucket in enumerate(groups):
            last = i == len(groups) - 1
            r = post_tensor(client, seg.write(bucket), weight_version="7" if last else None)
            assert r.status_code == 200, r.text
            assert r.json()["success"] is True
        path = seg.path
    assert not path.exists()  # the sender's segment is gone afterwards
    now = served(runner)
    assert all(now[n].equal(t) for n, t in named)
    assert client.get(api.WEIGHT_VERSION).json()["weight_version"] == "7"
    r = client.post(api.GENERATE, json={"input_ids": [3, 4, 5],
                                        "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["weight_version"] == "7"


@pytest.mark.parametrize("fault", ["name", "shape", "dtype"])
def test_wrong_name_shape_or_dtype_is_refused_and_old_weights_serve(engine, fault):
    client, runner = engine
    named = new_state(runner, seed=2)
    name, t = named[-1]
    bad = {"name": (name + ".nope", t), "shape": (name, t.reshape(-1)[:-1]),
           "dtype": (name, t.to(torch.bfloat16))}[fault]
    before = served(runner)
    with tensor_sync.ShmSegment(tensor_sync.segment_bytes(named, bucket_bytes=1 << 30)) as seg:
        r = post_tensor(client, seg.write(named[:-1] + [bad]), weight_version="9")
    assert r.status_code == 400, r.text
    expected = {"name": "not a parameter", "shape": "shape", "dtype": "dtype"}[fault]
    assert r.json()["success"] is False and expected in r.json()["message"]
    after = served(runner)
    assert all(after[n].equal(before[n]) for n in before)  # nothing of the bucket was applied
    assert client.get(api.WEIGHT_VERSION).json()["weight_version"] == "default"


def test_pickled_formats_and_foreign_segments_are_refused(engine, tmp_path):
    client, _ = engine
    r = client.post(api.UPDATE_WEIGHTS_FROM_TENSOR,
                    json={"serialized_named_tensors": ["gASV"], "load_format": "direct"})
    assert r.status_code == 400 and "pickle" in r.json()["message"]
    for segment in ("../etc/passwd", "other-name"):
        r = post_tensor(client, {"segment": segment, "nbytes": 4, "tensors": []})
        assert r.status_code == 400 and "segment" in r.json()["message"]
    r = post_tensor(client, {"segment": "rltool-absent-xyz", "nbytes": 4, "tensors": []})
    assert r.status_code == 400 and "rltool-absent-xyz" in r.json()["message"]


def test_cuda_ipc_messages_are_checked_and_refused_on_a_cpu_engine(engine):
    """A CUDA IPC message is plain JSON (no pickle), validated field by field; a CPU engine
    refuses it in one line, as it refuses a transport that does not match the load_format."""
    client, runner = engine
    before = served(runner)
    ipc = {"device_uuid": "GPU-0", "handle": "AAAA", "storage_bytes": 64, "storage_offset": 0,
           "ref_counter_handle": base64.b64encode(b"/torch_123_456_0").decode(),
           "ref_counter_offset": 0}
    message = {"transport": "cuda_ipc", "cuda_ipc": ipc, "nbytes": 64,
               "tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [16],
                            "offset": 0}]}
    r = post_tensor(client, message, load_format=api.CUDA_IPC_FORMAT)
    assert r.status_code == 400 and "needs an engine serving on CUDA" in r.json()["message"]
    r = post_tensor(client, message)  # load_format rltool_shm
    assert r.status_code == 400 and "does not match" in r.json()["message"]
    for broken in ({**message, "segment": "rltool-x"}, {**message, "cuda_ipc": None},
                   {**message, "cuda_ipc": {**ipc, "pickle": "gASV"}}):
        r = post_tensor(client, broken, load_format=api.CUDA_IPC_FORMAT)
        assert r.status_code == 400 and "tensor message" in r.json()["message"], broken
    after = served(runner)
    assert all(after[n].equal(before[n]) for n in before)


def test_distributed_update_over_gloo_is_bit_equal(engine):
    client, runner = engine
    named = new_state(runner, seed=3)
    port = free_port()
    answers: dict[str, object] = {}

    def post(key: str, path: str, body: dict) -> None:
        answers[key] = client.post(path, json=body)

    t = threading.Thread(target=post, args=("init", api.INIT_WEIGHTS_UPDATE_GROUP, {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "backend": "gloo"}))
    t.start()
    group = sync_group.join_group(master_address="127.0.0.1", master_port=port, rank=0,
                                   world_size=2, timeout_s=60)
    t.join(60)
    assert answers["init"].status_code == 200, answers["init"].text
    for version, batch in (("5", named[: len(named) // 2]), ("6", named[len(named) // 2:])):
        t = threading.Thread(target=post, args=("update", api.UPDATE_WEIGHTS_FROM_DISTRIBUTED, {
            **tensor_sync.describe(batch), "weight_version": version}))
        t.start()
        tensor_sync.broadcast(group, [x for _, x in batch])
        t.join(60)
        assert answers["update"].status_code == 200, answers["update"].text
    now = served(runner)
    assert all(now[n].equal(x) for n, x in named)
    assert client.get(api.WEIGHT_VERSION).json()["weight_version"] == "6"
    # A wrong shape still completes the broadcast, then is refused; the weights stay.
    name, x = named[0]
    wrong = [(name, x.reshape(-1))]
    t = threading.Thread(target=post, args=("bad", api.UPDATE_WEIGHTS_FROM_DISTRIBUTED, {
        **tensor_sync.describe(wrong), "weight_version": "8"}))
    t.start()
    tensor_sync.broadcast(group, [wrong[0][1]])
    t.join(60)
    assert answers["bad"].status_code == 400 and "shape" in answers["bad"].json()["message"]
    assert served(runner)[name].equal(x)
    assert client.get(api.WEIGHT_VERSION).json()["weight_version"] == "6"


def fused_tensors(runner) -> list[torch.Tensor]:
    m = runner.model
    return [m.embed, m.norm, m.lm_head] + [t for L in m.layers for _, t in sorted(L.items())]


def test_paged_runner_takes_named_tensors_like_a_checkpoint(tiny_model_dir, tiny_model_factory):
    """The paged engine's fused layout: HF-named tensors (as a trainer sends them) land where a
    load of the same checkpoint from disk puts them; a wrong shape or dtype changes nothing."""
    from safetensors.torch import load_file

    other = tiny_model_factory("qwen2", 1)
    kwargs = dict(device="cpu", dtype="fp32", max_running=2, page_size=4, max_total_tokens=64)
    runner = PagedRunner(tiny_model_dir, **kwargs)
    reference = PagedRunner(other, **kwargs)
    named = sorted(load_file(str(other / "model.safetensors")).items())
    before = [t.clone() for t in fused_tensors(runner)]
    name, t = named[1]
    for bad in ((name, t.reshape(-1)), (name, t.to(torch.bfloat16)), (name + ".x", t)):
        with pytest.raises(BadInputError):
            runner.load_named_tensors(named[:1] + [bad])
    assert all(a.equal(b) for a, b in zip(before, fused_tensors(runner)))
    half = len(named) // 2
    runner.load_named_tensors(named[:half])  # buckets: any subset, in any number of calls
    runner.load_named_tensors(named[half:])
    assert all(a.equal(b) for a, b in zip(fused_tensors(runner), fused_tensors(reference)))


def test_join_group_refuses_nccl_without_cuda_and_unknown_backends(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for backend, words in (("nccl", "needs CUDA"), ("mpi", "not served")):
        with pytest.raises(BadInputError, match=words):
            sync_group.join_group(master_address="127.0.0.1", master_port=1, rank=0,
                                   world_size=2, backend=backend)


def test_block_fp8_update_over_the_route(engine):
    """A bucket of block-FP8 weights (`weight_block_size`, each e4m3 weight with its scales) is
    dequantized into the fp32 engine exactly as `rltool convert dequant` would; scales of another
    block size are refused with 400 and the old weights keep serving."""
    from rltool.convert.fp8 import SCALE_SUFFIX, dequantize_blocks

    client, runner = engine
    named = tensor_sync.quantize_named(new_state(runner, seed=4), dtype=torch.float32,
                                       block=(16, 16))
    assert any(t.dtype == torch.float8_e4m3fn for _, t in named)
    before = served(runner)
    with tensor_sync.ShmSegment(tensor_sync.segment_bytes(named, bucket_bytes=1 << 30)) as seg:
        r = post_tensor(client, seg.write(named) | {"weight_block_size": [32, 32]})
        assert r.status_code == 400 and "weight_block_size [32, 32]" in r.json()["message"]
        assert all(served(runner)[n].equal(t) for n, t in before.items())
        r = post_tensor(client, seg.write(named) | {"weight_block_size": [16, 16]},
                        weight_version="8")
    assert r.status_code == 200, r.text
    state, now = dict(named), served(runner)
    for name, t in state.items():
        if t.dtype == torch.float8_e4m3fn:
            t = dequantize_blocks(t, state[name + SCALE_SUFFIX], (16, 16), dtype=torch.float32)
        if not name.endswith(SCALE_SUFFIX):
            assert now[name].equal(t), name


def generates(client) -> bool:
    r = client.post(api.GENERATE, json={"input_ids": [3, 4, 5],
                                        "sampling_params": {"max_new_tokens": 2}})
    return r.status_code == 200


@pytest.fixture
def planted():
    """Paths planted in /dev/shm under segment names, removed afterwards."""
    paths = []

    def plant(kind: str):
        path = tensor_sync.SHM_DIR / f"rltool-test-{kind}-{os.getpid()}-{len(paths)}"
        paths.append(path)
        return path

    yield plant
    for path in paths:
        path.unlink(missing_ok=True)


def test_a_fifo_segment_is_refused_and_generation_goes_on(engine, planted):
    """A FIFO named like a segment blocked the scheduler thread in open() until something opened
    it for writing (generation stalled while /health answered 200); now it is a 400 and the
    engine keeps generating. Nothing here ever opens the FIFO for writing."""
    client, runner = engine
    fifo = planted("fifo")
    os.mkfifo(fifo)
    r = post_tensor(client, {"segment": fifo.name, "nbytes": 64, "tensors": []})
    assert r.status_code == 400 and "not a regular file" in r.json()["message"]
    assert generates(client)


def test_a_symlinked_or_short_segment_is_refused(engine, planted, tmp_path):
    """A segment name was followed through a symlink, and a file shorter than the message was
    mapped; both are 400s naming the segment."""
    client, runner = engine
    target = tmp_path / "weights"
    target.write_bytes(b"\0" * 4096)
    link = planted("link")
    os.symlink(target, link)
    r = post_tensor(client, {"segment": link.name, "nbytes": 64, "tensors": []})
    assert r.status_code == 400 and "symbolic link" in r.json()["message"]
    short = planted("short")
    short.write_bytes(b"\0" * 100)
    r = post_tensor(client, {"segment": short.name, "nbytes": 4096, "tensors": []})
    assert r.status_code == 400 and "holds 100 bytes" in r.json()["message"]
    assert generates(client)


def test_a_segment_truncated_during_the_copy_is_a_400_and_the_engine_lives(engine, monkeypatch):
    """A sender truncating its segment while the engine copied from a mapping of it killed the
    engine with SIGBUS (exit 135, no log line). The truncation is placed right after the engine's
    size check; the copy comes back short, the update is refused and the old weights serve."""
    client, runner = engine
    named = new_state(runner, seed=6)
    before = served(runner)
    with tensor_sync.ShmSegment(tensor_sync.segment_bytes(named, bucket_bytes=1 << 30)) as seg:
        message = seg.write(named)
        real_fstat = os.fstat

        def fstat(fd):
            st = real_fstat(fd)
            if isinstance(fd, int) and os.path.realpath(f"/proc/self/fd/{fd}") == str(seg.path):
                os.truncate(seg.path, 4096)
            return st

        monkeypatch.setattr(os, "fstat", fstat)
        r = post_tensor(client, message, weight_version="9")
        monkeypatch.undo()
    assert r.status_code == 400 and "ended after 4096" in r.json()["message"], r.text
    after = served(runner)
    assert all(after[n].equal(before[n]) for n in before)
    assert generates(client)


def init_group(client, **fields):
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
            "world_size": 2, "backend": "gloo", **fields}
    return client.post(api.INIT_WEIGHTS_UPDATE_GROUP, json=body)


def test_a_huge_world_size_is_refused_naming_the_limit(engine):
    """world_size 10**7 made the engine allocate gloo state per rank (MemoryError, a 500, after
    minutes of retries); it is refused before connecting, naming the limit."""
    client, _ = engine
    r = init_group(client, world_size=10**7)
    assert r.status_code == 400
    assert f"limit of {MAX_SYNC_WORLD_SIZE} ranks" in r.json()["message"]
    r = init_group(client, rank_offset=2, world_size=2)
    assert r.status_code == 400 and "outside world_size" in r.json()["message"]


def test_an_unreachable_master_is_a_504_within_the_requests_timeout(engine):
    """Joining a master that never answers retried for minutes past any stated bound; it is a 504
    once the request's timeout_s has passed. Nothing listens on the port."""
    client, _ = engine
    r = init_group(client, timeout_s=1)
    assert r.status_code == 504, r.text
    assert "within 1 s" in r.json()["message"] and r.json()["success"] is False
    assert generates(client)


@pytest.mark.parametrize("engine", [{"allowed_sync_hosts": ["10.0.0.0/8", "trainer-0"]}],
                         indirect=True)
def test_a_master_outside_allowed_sync_hosts_is_refused(engine):
    """The engine connected to any master_address it was sent; with --allowed-sync-hosts it joins
    only those (403 for others, before connecting)."""
    client, _ = engine
    r = init_group(client)
    assert r.status_code == 403, r.text
    assert "--allowed-sync-hosts" in r.json()["message"]
