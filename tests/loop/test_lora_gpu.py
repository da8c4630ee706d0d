"""LoRA RL on one GPU (`[loop] device = "cuda"`, colocated, `--sync tensor`): the in-process
engine and a served one (CUDA IPC) take the adapter alone at every sync, as the trainer and the
engines take turns on the device, and in deterministic fp32 the engine's logprobs after each
adapter sync equal the trainer's within 1e-5 (the align gate).

Skips only when `torch.cuda.is_available()` is false."""

from __future__ import annotations

import pytest
import torch

from rltool.loop.config import LoopSettings
from rltool.loop.runner import start
from rltool.rundir import RunDir, read_metrics
from tests.loop.test_lora_sync import ADAPTER_FILES, ALIGN, _adapter_tensor_bytes, _tables

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("engine", ["inprocess", "serve"])
def test_colocated_cuda_loop_syncs_the_adapter_alone(tiny_model_dir, tmp_path, engine):
    tables = _tables(tiny_model_dir, tmp_path, sync="tensor", engine=engine)
    tables["train"]["dtype"] = "fp32"
    tables["loop"].update(device="cuda", num_steps=3,
                          engine_args=["--dtype", "fp32", "--mem-fraction-static", "0.3",
                                       "--max-running-requests", "32"])
    start(LoopSettings.from_tables(tables), tmp_path / "run")
    run = RunDir(tmp_path / "run")
    train = read_metrics(run.metrics_file("train"))
    assert sorted({r["rollout_step"] for r in train}) == [0, 1, 2]
    assert all(r[ALIGN] <= 1e-5 for r in train), [r[ALIGN] for r in train]
    names, nbytes = _adapter_tensor_bytes(run.ckpt_step(3) / "adapter")
    rows = read_metrics(run.metrics_file("loop"))
    assert [r["sync/mode"] for r in rows] == ["tensor"] * 3
    assert [r["perf/update_weights_wire_bytes"] for r in rows] == [nbytes] * 3
    assert {p.name for p in run.weight_version(3).iterdir()} == ADAPTER_FILES
