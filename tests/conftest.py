"""Shared fixtures: tiny random-init models and tokenizers made in the test session (no network),
and engines serving them. Helper functions live in tests/helpers/."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import gc

import pytest

GPU_LEAK_BYTES = 256 << 20  # a gpu test may leave at most this much more CUDA memory allocated
_interrupted: list[bool] = []  # set on Ctrl-C / SIGINT: the test torn down then was cut short


def pytest_keyboard_interrupt(excinfo):
    _interrupted.append(True)


def pytest_configure(config):
    import torch

    torch.set_num_threads(1)


def pytest_collection_finish(session):
    # The test modules' imports leave ~600k objects that live for the whole session; frozen,
    # a full collection (the leak check after every gpu test, a CUDA engine's before it sizes
    # its KV pool) no longer walks them (0.33 s a collection on 2 CPU cores before, ~0 after).
    gc.freeze()


@pytest.fixture(autouse=True)
def gpu_test_releases_what_it_holds(request):
    """After every gpu test: no process group is left and the CUDA memory allocated is back within
    GPU_LEAK_BYTES of its level before the test (module and session fixtures are set up before
    that level is read). The whole gpu suite runs in one process, so what one test leaves
    (a group whose store is gone, a model still referenced) breaks the tests after it; a leak is
    cleaned up before it is reported, so only the test that leaked fails."""
    import torch
    import torch.distributed as dist

    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_available():
        yield
        return

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    yield
    problems = []
    if dist.is_available() and dist.is_initialized():
        from rltool.train.launch import destroy_process_groups

        problems.append("a process group is still initialized")
        destroy_process_groups()
    gc.collect()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    if grown > GPU_LEAK_BYTES:
        from tests.helpers.leaks import describe

        problems.append(f"{grown / 2**20:.0f} MiB more CUDA memory allocated than before the test; "
                        f"the largest CUDA tensors alive now:\n{describe('cuda', limit=10)}")
    torch.cuda.empty_cache()
    # A test cut short by an interrupt holds what it held; failing its teardown would end the
    # session before pytest prints the failures of the tests before it.
    assert not problems or _interrupted, ("the test did not release what it held: "
                                          + "; ".join(problems))


@pytest.fixture(scope="session")
def model_3b(tmp_path_factory):
    """The Qwen2.5-3B shapes, random init in bf16, drawn on the GPU: one checkpoint (~6 GB) for
    every memory-plan test of the session."""
    from rltool.data.models import init_model

    return init_model(tmp_path_factory.mktemp("m") / "qwen2.5-3b", preset="qwen2.5-3b",
                      dtype="bf16", device="cuda")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny qwen2 model + character tokenizer for the `reverse` task (version 0)."""
    from rltool.data.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", arch="qwen2",
                      preset="tiny", task="reverse", seed=0)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Build (and cache) tiny models per (arch, seed)."""
    from rltool.data.models import init_model

    cache = {}

    def make(arch: str = "qwen2", seed: int = 0):
        key = (arch, seed)
        if key not in cache:
            cache[key] = init_model(tmp_path_factory.mktemp("models") / f"tiny-{arch}-{seed}",
                                    arch=arch, preset="tiny", task="reverse", seed=seed)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def builtin_engine(tiny_model_dir, tmp_path_factory):
    """A live `rltool serve --engine builtin` over tiny_model_dir (an EngineProcess: .url, .pid).

    Shared by the whole session: do not change its weights or leave it paused.
    """
    from rltool.rollout.launch import start_engine

    log_path = tmp_path_factory.mktemp("engine-logs") / "builtin.log"
    proc = start_engine(["--engine", "builtin", "--model", str(tiny_model_dir)],
                        log_path=log_path, ready_timeout_s=120.0)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def det_engine(tiny_model_dir, tmp_path_factory):
    """A deterministic engine these tests may pause, re-weight and finally shut down (one per
    module; the session-wide `builtin_engine` stays untouched)."""
    from rltool.rollout.launch import start_engine

    log_path = tmp_path_factory.mktemp("engine-logs") / "det.log"
    proc = start_engine(["--engine", "builtin", "--model", str(tiny_model_dir), "--deterministic",
                         "--max-running-requests", "16", "--max-queued-requests", "64",
                         "--max-prefill-tokens", "8", "--weight-version", "0",
                         "--allowed-weight-root", str(tmp_path_factory.getbasetemp())],
                        log_path=log_path, ready_timeout_s=120.0)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def other_weights_dir(tiny_model_factory):
    """Same shapes as tiny_model_dir, different values (seed 1)."""
    return tiny_model_factory("qwen2", 1)
