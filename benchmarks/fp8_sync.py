"""Quantize + sync time per step of `[sync] precision = "fp8"` and `"int4"` against the model's
own dtype.

A random-init checkpoint of a preset (`rltool.data.models.init_model`, bf16) is the trainer's
version 0; each step changes a third of its entries (one simulated optimizer step). One engine
(`PagedRunner` on --device) serves version 0 as published in the precision under test, then per
step and per sync mode it takes the new weights the way the loop hands them over:
  tensor  quantize the trainer's tensors (rltool.delta.tensor_sync.quantize_named for fp8,
          quantize_named_int4 for int4: the loop's calls), copy them bucket by bucket into one
          shared-memory segment and load each bucket into the engine (`load_named_tensors`,
          what /update_weights_from_tensor runs)
  full    publish_version --sync full (write the version, fp8: block-quantized, int4: W4A16 in
          `rltool convert int4`'s default format) + load_weights
  delta   publish_version --sync delta (encode on the cached base) + pull_weights + load_weights
On cuda the tensor mode starts from the trainer's tensors on the GPU (a colocated trainer's),
so FP8 and INT4 quantize there, and the engine loads the buckets in-process: what a CUDA IPC
receiver loads, without the bucket copy (an INT4 engine on cuda keeps the linears INT4; on cpu
it dequantizes them at load). `quantize_s` is the quantization's share of a tensor step. Each
figure is the median over --steps steps (step 0, which warms caches, not counted). The engine's
logprobs after the last step are checked bit-identical across the modes run for one precision
(they all hand over the same weights). Each row is printed as it is measured.

Usage: python -m benchmarks.fp8_sync [--preset tiny|qwen2.5-0.5b|qwen2.5-3b ...]
       [--device cpu|cuda] [--modes tensor full delta] [--precisions bf16 fp8 int4]
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

from rltool.data.models import init_model
from rltool.delta import tensor_sync
from rltool.delta.config import SyncConfig
from rltool.delta.publish import FP8_BLOCK, int4_format, publish_version
from rltool.delta.pull import pull_weights
from rltool.engine.api import TensorMessage
from rltool.engine.paged_runner import PagedRunner

from benchmarks import harness

MODES = ("tensor", "full", "delta")
PRECISIONS = ("bf16", "fp8", "int4")
SEQ = list(range(3, 35))


def trajectory(base: dict[str, torch.Tensor], steps: int,
               device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    """Version 0 and `steps + 1` simulated optimizer steps on `device`: each adds one update (a
    third of the entries, std 1e-3; drawn once per tensor, rotated by one element per step)."""
    base = {k: v.to(device) for k, v in base.items()}
    g = torch.Generator(device=device).manual_seed(1)
    update = {k: ((torch.rand(v.shape, generator=g, device=device) < 0.3)
                  * torch.randn(v.shape, generator=g, device=device) * 1e-3).flatten()
              for k, v in base.items()}
    states = [base]
    for s in range(steps + 1):
        states.append({k: (v.float() + update[k].roll(s).view(v.shape)).to(v.dtype)
                       for k, v in states[-1].items()})
    return states


def tensor_sync_into(runner: PagedRunner, state: dict[str, torch.Tensor], *,
                     precision: str | None, device: str, model: Path) -> float:
    """Hand `state` to `runner` as /update_weights_from_tensor would, in `precision` (None:
    bf16); returns the seconds spent quantizing (0 for bf16)."""
    named = list(state.items())
    fp8 = precision == "fp8"
    block = FP8_BLOCK if fp8 else None
    t0 = time.perf_counter()
    if fp8:
        named = tensor_sync.quantize_named(named, dtype=torch.bfloat16, block=FP8_BLOCK)
    elif precision == "int4":
        named = tensor_sync.quantize_named_int4(named, dtype=torch.bfloat16,
                                                fmt=int4_format(model))
    harness.sync(device)
    quantized = precision is not None
    quantize_s = time.perf_counter() - t0 if quantized else 0.0
    if device == "cuda":
        runner.load_named_tensors(named, block=block)
        return quantize_s
    bucket_bytes = 512 << 20
    with tensor_sync.ShmSegment(tensor_sync.segment_bytes(named, bucket_bytes=bucket_bytes)) as seg:
        for bucket in tensor_sync.buckets(named, bucket_bytes=bucket_bytes):
            message = seg.write(bucket, dtype=None if quantized else torch.bfloat16)
            if fp8:
                message["weight_block_size"] = list(FP8_BLOCK)
            with tensor_sync.open_message(TensorMessage.model_validate(message)) as got:
                runner.load_named_tensors(got, block=block)
    return quantize_s


def run_precision(model: Path, states: list[dict[str, torch.Tensor]], precision: str | None,
                  mode: str, *, device: str, root: Path
                  ) -> tuple[list[float], list[float], torch.Tensor]:
    pub = root / f"{precision}-{mode}"
    sync = SyncConfig(sync="delta" if mode == "delta" else "full", precision=precision)
    publish_version({k: v.cpu() for k, v in states[0].items()}, sync, publish_dir=pub,
                    version=0, source_model_dir=model, dtype="bf16")
    runner = PagedRunner(pub / "weight_v000000", device=device, dtype="bf16", max_running=1,
                         page_size=16, max_total_tokens=256)
    times, quantize = [], []
    for v, state in enumerate(states[1:], start=1):
        if mode == "tensor":
            state = {k: t.to(device) for k, t in state.items()}
            harness.sync(device)
        t0 = time.perf_counter()
        if mode == "tensor":
            quantize.append(tensor_sync_into(runner, state, precision=precision,
                                             device=device, model=model))
        else:
            publish_version(state, sync, publish_dir=pub, version=v, source_model_dir=model,
                            dtype="bf16")
            path = pub / f"weight_v{v:06d}"
            if mode == "delta":
                path = root / f"{precision}-local"
                pull_weights(local_checkpoint_dir=path, source_dir=pub, target_version=v)
            runner.load_weights(path)
        harness.sync(device)
        times.append(time.perf_counter() - t0)
        del state
    return times, quantize, runner.full_pass_logits(SEQ, start=1).cpu()


def bench(preset: str, *, device: str, steps: int, modes: list[str],
          precisions: list[str]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = init_model(root / "model", preset=preset, dtype="bf16", seed=0)
        base = {k: v.to(torch.bfloat16)
                for k, v in load_file(str(model / "model.safetensors")).items()}
        # on the GPU for the tensor mode alone (the trainer's weights live there); the file
        # modes publish from the host
        states = trajectory(base, steps, device if modes == ["tensor"] else "cpu")
        nbytes = sum(t.numel() * t.element_size() for t in base.values())
        for precision in [None if p == "bf16" else p for p in precisions]:
            logits = {}
            for mode in modes:
                times, quantize, logits[mode] = run_precision(model, states, precision, mode,
                                                              device=device, root=root)
                rows.append({"preset": preset, "precision": precision or "bf16", "mode": mode,
                             "bf16_bytes": nbytes, "step_s": statistics.median(times[1:]),
                             "quantize_s": statistics.median(quantize[1:]) if quantize else None,
                             "steps": len(times) - 1})
                harness.progress(json.dumps(rows[-1]))
            same = all(torch.equal(logits[modes[0]], logits[m]) for m in modes)
            for row in rows[-len(modes):]:
                row["modes_agree"] = same
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", nargs="+", default=["tiny"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=["bf16", "fp8"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    run = harness.Run("fp8_sync", device=args.device)
    rows = [r for preset in args.preset for r in bench(preset, device=args.device,
                                                        steps=args.steps, modes=args.modes,
                                                        precisions=args.precisions)]
    print(f"{'preset':14} {'precision':9} {'mode':6} {'MB bf16':>8} {'s/step':>8} "
          f"{'quantize':>8} agree")
    for r in rows:
        q = "" if r["quantize_s"] is None else f"{r['quantize_s']:.3f}"
        print(f"{r['preset']:14} {r['precision']:9} {r['mode']:6} {r['bf16_bytes'] / 1e6:8.1f} "
              f"{r['step_s']:8.3f} {q:>8} {r['modes_agree']}")
    run.finish({"rows": rows}, out=args.out)
    sys.exit(0 if all(r["modes_agree"] for r in rows) else 1)


if __name__ == "__main__":
    main()
