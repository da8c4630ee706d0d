"""/update_weights_from_tensor over CUDA IPC on one GPU: a sender process exports one bucket-sized
device buffer per bucket (JSON handle fields, no pickle); the engine's weights end bit-equal to
the sender's, a wrong shape is refused with the old weights serving, and the HTTP route bumps
`weight_version` and serves the new weights.

Every test skips only when `torch.cuda.is_available()` is false (the CI machines have none)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rltool.delta import tensor_sync
from rltool.engine import api
from rltool.engine.paged_runner import PagedRunner
from rltool.logprobs import logits_to_logprobs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
BUCKET_BYTES = 64 << 10
SEQ = [3, 9, 4, 17, 22, 5, 8, 30, 11, 2, 7, 19]


def sender_state(model_dir, seed: int) -> list[tuple[str, torch.Tensor]]:
    """New bf16 weights for every tensor of the checkpoint (names and shapes from its files)."""
    from safetensors import safe_open

    gen = torch.Generator().manual_seed(seed)
    named = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sorted(sf.keys()):
                shape = sf.get_slice(name).get_shape()
                named.append((name, (torch.randn(shape, generator=gen) * 0.05)
                              .to(torch.bfloat16)))
    return named


def send(model_dir: str, seed: int) -> None:
    """The sender process: one message per bucket on stdout, the next after an "ok" on stdin."""
    named = [(n, t.cuda()) for n, t in sender_state(model_dir, seed)]
    size = tensor_sync.segment_bytes(named, bucket_bytes=BUCKET_BYTES)
    with tensor_sync.CudaIpcBuffer(size, device="cuda") as buf:
        for bucket in tensor_sync.buckets(named, bucket_bytes=BUCKET_BYTES):
            print(json.dumps(buf.write(bucket)), flush=True)
            if sys.stdin.readline().strip() != "ok":
                raise SystemExit(1)
    print("done", flush=True)


def test_cuda_ipc_update_is_bit_equal_to_the_sender(tiny_model_dir):
    runner = PagedRunner(tiny_model_dir, device="cuda", dtype="bf16", max_running=4,
                         page_size=4, max_total_tokens=512, cuda_graph_max_bs=4)
    proc = subprocess.Popen(
        [sys.executable, "-c", f"from tests.gpu.test_gpu_cuda_ipc import send; "
                               f"send({str(tiny_model_dir)!r}, 5)"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    messages = 0
    try:
        while (line := proc.stdout.readline().strip()) != "done":
            assert line, "the sender exited early"
            message = api.TensorMessage.model_validate_json(line)
            assert message.transport == "cuda_ipc" and message.nbytes <= 2 * BUCKET_BYTES
            with tensor_sync.open_message(message, device=runner.device) as named:
                runner.load_named_tensors(named)
            messages += 1
            proc.stdin.write("ok\n")
            proc.stdin.flush()
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    expected = sender_state(tiny_model_dir, 5)
    total = sum(t.numel() * t.element_size() for _, t in expected)
    assert messages >= 3 and total > 2 * BUCKET_BYTES  # bucketed: one buffer, many messages
    targets = runner.model._targets()
    for name, t in expected:
        if name == "lm_head.weight" and runner.spec.tie_word_embeddings:
            continue
        dest, start, rows = targets[name]
        assert torch.equal(dest[start:start + rows].cpu(), t), name


def input_logprobs(runner: PagedRunner) -> list[float]:
    logits = runner.full_pass_logits(SEQ, start=1)
    return logits_to_logprobs(logits, torch.tensor(SEQ[1:], device=logits.device),
                              temperature=1.0).tolist()


def test_update_weights_from_tensor_route_over_cuda_ipc(tiny_model_dir, tmp_path):
    """Through `rltool serve --device cuda`: the update answers 200 with the new version, the
    engine's input logprobs then equal an in-process runner holding the sender's tensors; a
    bucket with a wrong shape answers 400 and changes nothing."""
    from rltool.errors import EngineError
    from rltool.rollout.client import EngineClient
    from rltool.rollout.launch import start_engine

    named = [(n, t.cuda()) for n, t in sender_state(tiny_model_dir, 6)]
    reference = PagedRunner(tiny_model_dir, device="cuda", dtype="bf16", max_running=4,
                            page_size=4, max_total_tokens=512, disable_cuda_graph=True)
    reference.load_named_tensors(named)
    want = input_logprobs(reference)
    proc = start_engine(["--engine", "builtin", "--model", str(tiny_model_dir), "--device",
                         "cuda", "--dtype", "bf16"], log_path=tmp_path / "engine.log",
                        ready_timeout_s=300.0)
    probe = {"input_ids": SEQ, "return_logprob": True, "logprob_start_len": 0,
             "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}

    async def go() -> tuple[list[float], list[float], str, int]:
        async with EngineClient(proc.url, timeout_s=120) as c:
            size = tensor_sync.segment_bytes(named, bucket_bytes=BUCKET_BYTES)
            with tensor_sync.CudaIpcBuffer(size, device="cuda") as buf:
                name, t = named[0]
                bad = json.dumps(buf.write([(name, t.reshape(-1)[:-1])]))
                status = 200
                try:
                    await c.update_weights_from_tensor([bad], load_format=api.CUDA_IPC_FORMAT)
                except EngineError as e:
                    status = e.status_code
                before = await c.generate(probe)
                groups = tensor_sync.buckets(named, bucket_bytes=BUCKET_BYTES)
                for i, bucket in enumerate(groups):
                    await c.update_weights_from_tensor(
                        [json.dumps(buf.write(bucket))], load_format=api.CUDA_IPC_FORMAT,
                        weight_version="3" if i == len(groups) - 1 else None)
            after = await c.generate(probe)
            return ([x[0] for x in before["meta_info"]["input_token_logprobs"][1:]],
                    [x[0] for x in after["meta_info"]["input_token_logprobs"][1:]],
                    after["meta_info"]["weight_version"], status)

    try:
        before, after, version, status = asyncio.run(go())
    finally:
        proc.stop()
    original = PagedRunner(tiny_model_dir, device="cuda", dtype="bf16", max_running=4,
                           page_size=4, max_total_tokens=512, disable_cuda_graph=True)
    assert status == 400
    assert before == input_logprobs(original)  # the refused bucket changed nothing
    assert version == "3" and after == want
