"""LoRA RL in the loop with adapter-only syncs (rltool.loop.lora_sync): in each sync mode a
2-step deterministic fp32 run on the tiny model gives engine logprobs equal to the trainer's
bit for bit after the adapter sync, moves the adapter's bytes and nothing of the base, and a
delta version materialises the published adapter bit for bit."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest
import tomli_w
from safetensors import safe_open

from rltool.data.tasks import make_rows, write_prompts
from rltool.delta.pull import pull_weights
from rltool.errors import BadInputError, ConfigError
from rltool.io.checkpoint import is_delta_dir
from rltool.loop import lora_sync
from rltool.loop.config import LoopSettings
from rltool.rundir import RunDir, read_metrics
from rltool.train.lora import read_adapter, write_adapter
from tests.loop.test_loop_live import loop_cli

RANK = 4
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors", "rltool_version.json"}
ALIGN = "train/train_rollout_logprob_abs_diff"


def _tables(model: Path, root: Path, *, sync: str, engine: str = "serve",
            alpha: float | None = None) -> dict:
    write_prompts(make_rows("reverse", num=8, seed=1), root / "rl.jsonl")
    return {
        "model": {"path": str(model)},
        "rollout": {"prompts": str(root / "rl.jsonl"), "reward": "reverse:partial",
                    "n_samples_per_prompt": 2, "rollout_batch_size": 2, "max_response_len": 6},
        # entropy: a gradient at every step, so every version's adapter differs from the last
        "train": {"lr": 5e-2, "global_batch_size": 4, "lora_rank": RANK, "entropy_coef": 0.01,
                  **({"lora_alpha": alpha} if alpha is not None else {})},
        "sync": {"sync": sync, "full_every": 10},
        "loop": {"num_steps": 2, "deterministic": True, "seed": 3, "engine": engine,
                 "align_gate": 1e-5},
    }


def _adapter_tensor_bytes(path: Path) -> tuple[set[str], int]:
    with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        return names, sum(f.get_tensor(k).numel() * 4 for k in names)  # fp32 on the engines


def _run(tmp_path: Path, tables: dict) -> RunDir:
    (tmp_path / "run.toml").write_text(tomli_w.dumps(tables))
    proc = loop_cli("--config", str(tmp_path / "run.toml"), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return RunDir(tmp_path / "run")


def _check_aligned(run: RunDir) -> None:
    rows = read_metrics(run.metrics_file("train"))
    assert sorted({r["rollout_step"] for r in rows if ALIGN in r}) == [0, 1]
    # step 1 rolled out on the engines after the first adapter sync: the deterministic engine
    # computes each module's adapter update as the trainer does, bit for bit
    assert all(r[ALIGN] == 0.0 for r in rows), [r[ALIGN] for r in rows]


@pytest.mark.slow
def test_disk_and_delta_syncs_move_the_adapter_only(tiny_model_dir, tmp_path):
    """--sync full, delta and tensor (builtin engines as children): every version after 0 is the
    adapter directory (or a delta of adapter tensors) or the adapter's tensors in shared memory,
    the align gate holds, and a delta version pulled on a fresh local directory is the trainer's
    adapter byte for byte."""
    base_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    for sync in ("full", "delta", "tensor"):
        run = _run(tmp_path / sync, _tables(tiny_model_dir, tmp_path / sync, sync=sync))
        _check_aligned(run)
        v1, v2 = run.weight_version(1), run.weight_version(2)
        names, nbytes = _adapter_tensor_bytes(run.ckpt_step(2) / "adapter")
        loop_rows = read_metrics(run.metrics_file("loop"))
        if sync == "tensor":  # shared memory; only the last step's checkpoint version is written
            assert [r["perf/update_weights_wire_bytes"] for r in loop_rows] == [nbytes, nbytes]
            assert not v1.exists() and {p.name for p in v2.iterdir()} == ADAPTER_FILES
            continue
        assert {p.name for p in v1.iterdir()} == ADAPTER_FILES
        assert [r["sync/mode"] for r in loop_rows] == ["full", "full" if sync == "full"
                                                       else "delta"]
        wire = [r["perf/update_weights_wire_bytes"] for r in loop_rows]
        if sync == "full":
            assert wire == [sum(p.stat().st_size for p in v.iterdir()) for v in (v1, v2)]
            assert max(wire) < base_bytes / 4
            continue
        assert is_delta_dir(v2)
        assert wire[1] < base_bytes / 4
        local = tmp_path / "local"
        pull_weights(local_checkpoint_dir=local, source_dir=run.weights, target_version=2)
        want = tmp_path / "want"
        want.mkdir()
        # the adapter the trainer had at version 2, written in full for comparison
        config, tensors = read_adapter(run.ckpt_step(2) / "adapter")
        write_adapter(want, tensors=tensors, config=config)
        assert filecmp.cmp(local / "adapter_model.safetensors",
                           want / "adapter_model.safetensors", shallow=False)
        assert _adapter_tensor_bytes(local)[0] == names


def test_tensor_sync_moves_the_adapter_only(tiny_model_dir, tmp_path, monkeypatch):
    """--sync tensor into the in-process engine, lora_alpha 6 with rank 4 (scale 1.5): each sync
    hands over exactly the adapter's tensors (PEFT names, their bytes, no base weight) with the
    adapter's config, the engine's logprobs equal the trainer's after it (at the config's
    scale), and only the last step's checkpoint version is written (an adapter)."""
    from rltool.engine.inprocess import InProcessEngine
    from rltool.loop.runner import start

    sent: list[list[tuple[str, int]]] = []
    configs = []
    load = InProcessEngine.load_tensors

    def counting(self, named, **kwargs):
        sent.append([(n, t.numel() * t.element_size()) for n, t in named])
        configs.append(kwargs.get("lora_config"))
        return load(self, named, **kwargs)

    monkeypatch.setattr(InProcessEngine, "load_tensors", counting)
    settings = LoopSettings.from_tables(_tables(tiny_model_dir, tmp_path, sync="tensor",
                                                engine="inprocess", alpha=6.0))
    start(settings, tmp_path / "run")
    run = RunDir(tmp_path / "run")
    _check_aligned(run)
    names, nbytes = _adapter_tensor_bytes(run.ckpt_step(2) / "adapter")
    assert len(sent) == 2
    assert configs == [{"r": RANK, "lora_alpha": 6, "target_modules": list(
        settings.train.lora_target_modules)}] * 2
    for bucket in sent:
        assert {n for n, _ in bucket} == names
        assert sum(b for _, b in bucket) == nbytes
    rows = read_metrics(run.metrics_file("loop"))
    assert [r["perf/update_weights_wire_bytes"] for r in rows] == [nbytes, nbytes]
    assert not run.weight_version(1).exists()
    assert {p.name for p in run.weight_version(2).iterdir()} == ADAPTER_FILES


def test_adapter_runs_serve_lora_and_refuse_what_cannot_work(tiny_model_dir, tmp_path):
    tables = _tables(tiny_model_dir, tmp_path, sync="full")
    settings = LoopSettings.from_tables(tables)
    args = settings.engine_args()
    assert args[-3:] == ["--enable-lora", "--max-lora-rank", str(RANK)]
    merged = LoopSettings.from_tables({**tables, "train": {**tables["train"],
                                                           "lora_merge_on_publish": True}})
    assert "--enable-lora" not in merged.engine_args()
    low = {**tables, "loop": {**tables["loop"], "engine_args": ["--max-lora-rank", "2"]}}
    with pytest.raises(ConfigError, match="--max-lora-rank 2 is below"):
        LoopSettings.from_tables(low)
    low["loop"]["engine_args"] = ["--max-lora-rank=2"]
    with pytest.raises(ConfigError, match="--max-lora-rank 2 is below"):
        LoopSettings.from_tables(low)
    low["loop"]["engine_args"] = ["--max-lora-rank", "x"]
    with pytest.raises(ConfigError, match="'x' is not an integer"):
        LoopSettings.from_tables(low)
    wide = {**tables, "loop": {**tables["loop"], "engine_args": ["--max-lora-rank=16"]}}
    args = LoopSettings.from_tables(wide).engine_args()
    assert "--max-lora-rank=16" in args and "--max-lora-rank" not in args  # not added twice
    alpha = {**tables, "train": {**tables["train"], "lora_alpha": 2.5},
             "sync": {"sync": "tensor"}}  # the config travels with the tensors
    assert lora_sync.tensor_config(LoopSettings.from_tables(alpha))["lora_alpha"] == 2.5
    assert lora_sync.tensor_config(merged) is None
    fp8 = {**tables, "sync": {"sync": "full", "precision": "fp8"}}
    with pytest.raises(ConfigError, match="precision fp8"):
        LoopSettings.from_tables(fp8)
    builtin = {"engine": "builtin"}
    with pytest.raises(BadInputError, match="not rltool's builtin engine"):
        lora_sync.check_server_info("http://e", {"enable_lora": True, "max_lora_rank": 8},
                                    rank=RANK)  # SGLang takes no adapter by a weight sync
    with pytest.raises(BadInputError, match="--enable-lora --max-lora-rank 4"):
        lora_sync.check_server_info("http://e", {**builtin, "enable_lora": False}, rank=RANK)
    with pytest.raises(BadInputError, match="--max-lora-rank 4"):
        lora_sync.check_server_info("http://e", {**builtin, "enable_lora": True,
                                                 "max_lora_rank": 2}, rank=RANK)
    lora_sync.check_server_info("http://e", {**builtin, "enable_lora": True, "max_lora_rank": 8},
                                rank=RANK)
