"""INT4 quantize + tensor sync per loop step at full model sizes (the 7B's shapes on one GPU).

benchmarks/fp8_sync.py (`--precisions bf16 int4`) times every sync mode but keeps every step's
weights at once (5 copies of the model for 3 steps), which a 7B does not fit beside its engine on
one GPU. This keeps one: the trainer's bf16 weights (a random-init checkpoint of `--preset`,
drawn on `--device`, `rltool.data.models.init_model`, seed 0) change in place each step (every
entry of every tensor gets N(0, 1e-3) noise, untimed: one simulated optimizer step), and are
handed to a live engine as `[sync] precision = "int4"` hands them over in the loop's colocated
tensor sync: `rltool.delta.tensor_sync.quantize_named_int4` on the device the weights are on
(`rltool convert int4`'s default format: W4A16, groups of 32, symmetric, every linear but
lm_head), then `load_named_tensors`, what /update_weights_from_tensor runs (on cuda in process,
as a CUDA IPC receiver loads; on cpu through one shared-memory segment of 512 MiB buckets:
benchmarks/fp8_sync.py's `tensor_sync_into`). The engine (`PagedRunner`, `--dtype bf16`) serves
version 0 published INT4 (its linears stay INT4 on cuda). The baseline in the same run: the same
steps in bf16 into an engine serving the bf16 checkpoint.

Per precision: the median seconds per step over `--steps` steps after a first, untimed one, the
quantization's share, and a check that the engine after the last step computes what an engine
computes after loading the same weights from disk (`publish_version` of the final weights in that
precision, then `load_weights`): full-pass logits equal bit for bit. Each precision's published
versions are deleted before the next one runs.

Usage: python -m benchmarks.int4_sync [--preset qwen2.5-7b] [--device cuda|cpu] [--steps 3]
       [--out DIR_OR_FILE.json]
Prints a table and, last, one JSON line on stdout; exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from rltool.data.models import PRESETS, check_preset, init_model
from rltool.delta.config import SyncConfig
from rltool.delta.publish import publish_version
from rltool.engine.paged_runner import PagedRunner

from benchmarks import harness
from benchmarks.fp8_sync import SEQ, tensor_sync_into


def load_state(model: Path, device: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in bf16 on `device`, shard by shard."""
    state = {}
    for shard in sorted(model.glob("*.safetensors")):
        state.update({k: v.to(device=device, dtype=torch.bfloat16)
                      for k, v in load_file(str(shard)).items()})
    return state


@torch.no_grad()
def optimizer_step(state: dict[str, torch.Tensor], step: int) -> None:
    """One simulated optimizer step, in place: N(0, 1e-3) noise on every entry (seeded)."""
    g = torch.Generator(device=next(iter(state.values())).device).manual_seed(step)
    for t in state.values():
        t.add_(torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32)
               .mul_(1e-3).to(t.dtype))


def publish(state: dict[str, torch.Tensor], model: Path, precision: str | None, out: Path,
            version: int) -> Path:
    sync = SyncConfig(sync="full", precision=precision)
    publish_version(state, sync, publish_dir=out, version=version, source_model_dir=model,
                    dtype="bf16")
    return out / f"weight_v{version:06d}"


def run_precision(model: Path, precision: str | None, *, device: str, steps: int,
                  root: Path) -> dict:
    """`steps + 1` tensor syncs of `precision` (None: bf16) into a fresh engine; the row."""
    state = load_state(model, device)
    pub = root / (precision or "bf16")
    # bf16: the checkpoint itself is version 0 (no second copy of the weights on disk)
    first = model if precision is None else publish(state, model, precision, pub, 0)
    runner = PagedRunner(first, device=device, dtype="bf16", max_running=1, page_size=16,
                         max_total_tokens=256)
    times, quantize = [], []
    for step in range(steps + 1):
        optimizer_step(state, step + 1)
        harness.sync(device)
        t0 = time.perf_counter()
        quantize.append(tensor_sync_into(runner, state, precision=precision, device=device,
                                         model=model))
        harness.sync(device)
        times.append(time.perf_counter() - t0)
        harness.progress(f"{precision or 'bf16'} step {step}: {times[-1]:.3f} s "
                         f"(quantize {quantize[-1]:.3f} s)")
    synced = runner.full_pass_logits(SEQ, start=1)
    runner.load_weights(publish(state, model, precision, pub, 1))
    from_disk = runner.full_pass_logits(SEQ, start=1)
    row = {"precision": precision or "bf16", "weight_dtype": runner.weight_info["weight_dtype"],
           "bf16_bytes": sum(t.numel() * t.element_size() for t in state.values()),
           "step_s": statistics.median(times[1:]), "quantize_s": statistics.median(quantize[1:]),
           "first_step_s": times[0], "steps": steps,
           "equals_disk_load": bool(torch.equal(synced, from_disk))}
    runner.release()
    shutil.rmtree(pub)  # a 7B's published versions would not all fit the disk
    del runner, state
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-7b", help=f"One of {', '.join(PRESETS)}.")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--steps", type=int, default=3, help="Timed steps (after one untimed).")
    p.add_argument("--out", type=Path, help="Directory (or .json file) for the record.")
    args = p.parse_args(argv)
    check_preset(args.preset)
    harness.require_positive(args, "--steps")
    harness.require_device(args.device)
    return args


def main(argv: list[str] | None = None) -> int:
    args = harness.parse_or_report(parse, argv)
    if args is None:
        return 2
    run = harness.Run("int4_sync", device=args.device)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = init_model(root / "model", preset=args.preset, dtype="bf16", seed=0,
                           device=args.device)
        rows = [{"preset": args.preset, **run_precision(model, precision, device=args.device,
                                                        steps=args.steps, root=root)}
                for precision in (None, "int4")]
    rows[1]["vs_bf16"] = rows[1]["step_s"] / rows[0]["step_s"]
    print(f"{'preset':14} {'precision':9} {'engine':8} {'GB bf16':>8} {'s/step':>8} "
          f"{'quantize':>8} {'first':>7} disk-equal")
    for r in rows:
        print(f"{r['preset']:14} {r['precision']:9} {r['weight_dtype']:8} "
              f"{r['bf16_bytes'] / 1e9:8.2f} {r['step_s']:8.3f} {r['quantize_s']:8.3f} "
              f"{r['first_step_s']:7.3f} {r['equals_disk_load']}")
    run.finish({"rows": rows}, out=args.out)
    return 0 if all(r["equals_disk_load"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
