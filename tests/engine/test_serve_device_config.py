"""`rltool serve` device flags: defaults follow the device, the
per-step prefill budget and the chunk are separate settings (the chunk defaulting to the budget on
CPU, as before), and asking for CUDA without one is a one-line error with exit code 2."""

from __future__ import annotations

import threading

import torch
from click.testing import CliRunner

from rltool.engine.config import ServeConfig
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams
from rltool.engine.paged_scheduler import PagedScheduler

def test_cpu_defaults_and_separate_chunk(tiny_model_dir):
    cfg = ServeConfig(model=tiny_model_dir, device="cpu")
    assert (cfg.engine_device, cfg.dtype, cfg.max_prefill_tokens, cfg.chunked_prefill_size) == \
        ("cpu", "fp32", 512, 512)
    cfg = ServeConfig(model=tiny_model_dir, device="cpu", max_prefill_tokens=100)
    assert cfg.chunked_prefill_size == 100
    cfg = ServeConfig(model=tiny_model_dir, device="cpu", max_prefill_tokens=100,
                      chunked_prefill_size=4)
    assert (cfg.max_prefill_tokens, cfg.chunked_prefill_size) == (100, 4)


def test_the_decode_batch_defaults_to_the_device(tiny_model_dir, monkeypatch):
    """64 running requests on cpu (its KV pool is sized from them), 256 on cuda (the largest
    default CUDA-graph batch); a given value stays."""
    assert ServeConfig(model=tiny_model_dir, device="cpu").max_running_requests == 64
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = ServeConfig(model=tiny_model_dir, device="cuda")
    assert (cfg.dtype, cfg.max_running_requests, cfg.cuda_graph_max_bs) == ("bf16", 256, 256)
    assert ServeConfig(model=tiny_model_dir, device="cuda",
                       max_running_requests=32).max_running_requests == 32


def test_device_cuda_without_a_gpu_is_refused_in_one_line(tiny_model_dir, monkeypatch):
    from rltool.commands.serve import command

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(command, ["--device", "cuda", "--model", str(tiny_model_dir)])
    assert result.exit_code == 2
    assert "torch sees no CUDA GPU" in result.output and "--device cpu" in result.output


def test_cpu_scheduler_splits_prompts_into_chunks_within_the_budget(tiny_model_dir):
    """A 10-token prompt with chunk 4 and budget 12: three chunks, each at a multiple of 4."""
    sched = PagedScheduler(PagedRunner(tiny_model_dir, device="cpu", dtype="fp32"),
                           max_running=2, max_prefill_tokens=12, chunked_prefill_size=4)
    done = threading.Event()
    req = Request(rid="c", prompt_ids=list(range(3, 13)), on_finish=lambda r: done.set(),
                  params=SamplingParams(max_new_tokens=1, temperature=0.0))
    sched.start()
    try:
        sched.submit([req])
        assert done.wait(30)
    finally:
        sched.stop()
    assert sched.num_prefill_forwards == 3 and len(req.output_ids) == 1


def test_max_total_tokens_caps_the_kv_pool(tiny_model_dir):
    from rltool.engine.server import build_engine

    runner, _ = build_engine(ServeConfig(model=tiny_model_dir, device="cpu",
                                         max_total_tokens=256))
    assert runner.max_total_num_tokens == 256 - runner.page_size  # the first page is reserved
    assert runner.pool.nbytes() == 256 * runner.spec.kv_bytes_per_token * 4  # fp32
