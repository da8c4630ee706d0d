"""Seconds and bytes of a LoRA run's weight sync (the adapter alone) against a full sync of the
same model, as the loop hands each to an engine.

A random-init bf16 checkpoint of `--preset` is the base every engine serves. The trainer's
adapter is a random rank-R adapter on every linear (q/k/v/o/gate/up/down, alpha 2 x R:
benchmarks.engine_lora.random_adapter), held as fp32 tensors on --device (the trainer's
parameters). One engine (`PagedRunner`, bf16) takes per step:
  full-tensor   the full bf16 weights (the trainer's tensors on --device) handed over as
                /update_weights_from_tensor does (benchmarks.fp8_sync.tensor_sync_into: one
                shared-memory segment on cpu, the engine's load in process on cuda)
  lora-tensor   the adapter under PEFT's names, exported to host memory as the loop's resident
                trainer does (fp32), cast to the engine's bf16 and handed over the same way: the
                engine replaces its policy adapter (`load_named_tensors` -> LoRA sync)
  full-disk     publish_version --sync full of the bf16 weights + load_weights
  lora-disk     the adapter directory written (rltool.train.lora.write_adapter, bf16) and copied
                as a version (publish_version --sync full) + load_weights (the policy adapter)
Bytes: what each sync moves (the tensors in the engine's dtype, or the version's files). Each
figure is the median over --steps steps (step 0, which warms caches, not counted). The engine's
logits after lora-tensor and lora-disk are checked bit-identical (the same adapter, by tensors
or from disk), and different from the base's.

Usage: python -m benchmarks.lora_sync [--preset tiny|qwen2.5-0.5b|qwen2.5-7b ...]
       [--device cpu|cuda] [--ranks 32] [--modes full-tensor lora-tensor full-disk lora-disk]
       [--steps 3] [--out DIR_OR_FILE.json]
Prints a table and, last, one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from rltool.delta.config import SyncConfig
from rltool.delta.publish import publish_version
from rltool.engine.paged_runner import PagedRunner
from rltool.train.lora import PEFT_PREFIX, model_tensors, write_adapter

from benchmarks import harness
from benchmarks.engine_common import random_checkpoint
from benchmarks.engine_lora import random_adapter
from benchmarks.fp8_sync import SEQ, tensor_sync_into

MODES = ("full-tensor", "lora-tensor", "full-disk", "lora-disk")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def sync_once(mode: str, runner: PagedRunner, *, full: dict[str, torch.Tensor],
              adapter: dict[str, torch.Tensor], config: dict, model: Path, pub: Path,
              version: int, device: str) -> int:
    """One sync of `mode` into `runner`; returns the bytes it moved."""
    if mode == "full-tensor":
        tensor_sync_into(runner, full, precision=None, device=device, model=model)
        return sum(t.numel() * t.element_size() for t in full.values())
    if mode == "lora-tensor":  # the resident trainer's export: host fp32 under PEFT's names
        named = {PEFT_PREFIX + k: v.to("cpu", torch.float32).to(torch.bfloat16)
                 for k, v in adapter.items()}
        tensor_sync_into(runner, named, precision=None, device=device, model=model)
        return sum(t.numel() * t.element_size() for t in named.values())
    sync = SyncConfig(sync="full")
    if mode == "full-disk":
        publish_version({k: v.cpu() for k, v in full.items()}, sync, publish_dir=pub,
                        version=version, source_model_dir=model, dtype="bf16")
    else:
        stage = pub / f".stage-{version}"
        stage.mkdir(parents=True)
        write_adapter(stage, tensors=adapter, config=config, dtype=torch.bfloat16)
        publish_version(stage, sync, publish_dir=pub, version=version)
    path = pub / f"weight_v{version:06d}"
    runner.load_weights(path)
    return dir_bytes(path)


def bench(preset: str, *, rank: int, device: str, steps: int, modes: list[str]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = random_checkpoint(root / "model", preset, device=device)
        src = random_adapter(model, root / "adapter", rank=rank, seed=1)
        config = json.loads((src / "adapter_config.json").read_text())
        adapter = {k: v.to(device) for k, v in
                   model_tensors(load_file(str(src / "adapter_model.safetensors"))).items()}
        full = {k: v.to(device) for k, v in load_file(str(model / "model.safetensors")).items()}
        runner = PagedRunner(model, device=device, dtype="bf16", max_running=1, page_size=16,
                             max_total_tokens=256, enable_lora=True, max_lora_rank=rank)
        base_logits = runner.full_pass_logits(SEQ, start=1).cpu()
        logits = {}
        for mode in modes:
            times, moved = [], 0
            for step in range(steps + 1):
                harness.sync(device)
                t0 = time.perf_counter()
                moved = sync_once(mode, runner, full=full, adapter=adapter, config=config,
                                  model=model, pub=root / mode, version=step + 1, device=device)
                harness.sync(device)
                times.append(time.perf_counter() - t0)
            logits[mode] = runner.full_pass_logits(SEQ, start=1).cpu()
            rows.append({"preset": preset, "rank": rank, "mode": mode, "bytes": moved,
                         "step_s": statistics.median(times[1:]), "steps": steps})
            harness.progress(json.dumps(rows[-1]))
        del full
    lora = [m for m in ("lora-tensor", "lora-disk") if m in logits]
    agree = all(torch.equal(logits[lora[0]], logits[m]) for m in lora)
    moves = all(not torch.equal(logits[m], base_logits) for m in lora)
    for row in rows:
        row["lora_modes_agree"], row["adapter_changes_logits"] = agree, moves
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", nargs="+", default=["tiny"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--ranks", nargs="+", type=int, default=[32])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    run = harness.Run("lora_sync", device=args.device)
    rows = [r for preset in args.preset for rank in args.ranks
            for r in bench(preset, rank=rank, device=args.device, steps=args.steps,
                           modes=args.modes)]
    full = {(r["preset"], r["mode"].split("-")[1]): r for r in rows if r["mode"].startswith("full")}
    for r in rows:  # each adapter sync against the full sync of the same transport
        ref = full.get((r["preset"], r["mode"].split("-")[1]))
        r["bytes_vs_full"] = r["bytes"] / ref["bytes"] if ref else None
        r["time_vs_full"] = r["step_s"] / ref["step_s"] if ref else None
    harness.print_table(["preset", "rank", "mode", "MB", "s/sync", "bytes/full", "time/full"],
                        [[r["preset"], r["rank"], r["mode"], r["bytes"] / 1e6, r["step_s"],
                          r["bytes_vs_full"], r["time_vs_full"]] for r in rows])
    run.finish({"rows": rows}, out=args.out)
    sys.exit(0 if all(r["lora_modes_agree"] and r["adapter_changes_logits"] for r in rows)
             else 1)


if __name__ == "__main__":
    main()
