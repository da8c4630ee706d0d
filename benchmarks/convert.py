"""Checkpoint conversion throughput and memory (issue 10, part 5).

Builds a random bf16 HF checkpoint with Qwen2.5-0.5B's shapes (preset `qwen2.5-0.5b`, untied
lm_head: ~630M parameters, ~1.26 GB in one safetensors file, tensors written directly), then runs,
each in a fresh subprocess so peak RSS is per operation:

- reference: safetensors `load_file` of every tensor + `save_file` of the same bytes (same run);
- fp8: `rltool.convert.fp8.quantize_checkpoint` (block 128x128, --workers threads);
- hf-to-dist: `rltool.convert.torch_dist.hf_to_dist` (one process, tp=1).

Wall time is measured inside the subprocess around the operation (interpreter start-up and imports
excluded); GB/s is input bytes / wall time; peak RSS is the subprocess's VmHWM, shown as a multiple
of the model's bytes, which here is also the one (largest) input shard (hf-to-dist target ~1.3x,
fp8 target < 1.5x); "added" subtracts the RSS before the operation (interpreter, torch).
Target: fp8 within 2x the reference's wall time.

Usage: .venv/bin/python benchmarks/convert.py [--workers 2] [--out FILE.json]
Prints a table and, last, one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

OPERATIONS = ("reference", "fp8", "hf-to-dist")


def make_checkpoint(out: Path) -> dict:
    """Random bf16 tensors with qwen2.5-0.5b's names and shapes, plus its config.json."""
    import torch
    from safetensors.torch import save_file

    from rltool.convert.name_map import expected_hf_shapes
    from rltool.data.models import build_config

    config = build_config("qwen2", "qwen2.5-0.5b", vocab_size=151936, eos_token_id=2,
                          pad_token_id=0).to_dict()
    config["dtype"] = "bfloat16"
    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
               for name, shape in expected_hf_shapes(config).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return {"parameters": sum(t.numel() for t in tensors.values()),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def _status_bytes(field: str) -> int:
    """VmRSS / VmHWM of this process (ru_maxrss would include the parent's peak: it survives exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _cpu_seconds() -> float:
    """User + system CPU of this process and its reaped children: less sensitive than wall time
    to the other processes sharing the machine."""
    import resource

    own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                       resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_one(op: str, src: Path, out: Path, workers: int) -> dict:
    """Body of one measurement subprocess."""
    from safetensors.torch import load_file, save_file

    from rltool.convert import fp8, torch_dist

    if op == "hf-to-dist":
        import megatron.core  # noqa: F401  (its import is start-up, not conversion)
    before = _status_bytes("VmRSS")
    cpu_before = _cpu_seconds()
    start = time.perf_counter()
    if op == "reference":
        tensors = load_file(str(src / "model.safetensors"))
        out.mkdir()
        save_file(tensors, str(out / "model.safetensors"))
        del tensors
    elif op == "fp8":
        fp8.quantize_checkpoint(fp8.Fp8Config(hf=src, out=out, workers=workers))
    else:
        torch_dist.hf_to_dist(torch_dist.HfToDistConfig(hf=src, out=out))
    seconds = time.perf_counter() - start
    cpu = _cpu_seconds() - cpu_before
    return {"seconds": seconds, "cpu_seconds": cpu, "peak_rss_bytes": _status_bytes("VmHWM"),
            "rss_before_bytes": before}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=None, help="Result JSON file.")
    parser.add_argument("--_child", nargs=3, metavar=("OP", "SRC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        op, src, out = args._child
        print(json.dumps(run_one(op, Path(src), Path(out), args.workers)))
        return

    with tempfile.TemporaryDirectory(prefix="rltool-bench-convert-") as tmp:
        src = Path(tmp) / "src"
        model = make_checkpoint(src)
        rows = {}
        for op in OPERATIONS:
            proc = subprocess.run(
                [sys.executable, __file__, "--workers", str(args.workers), "--_child", op,
                 str(src), str(Path(tmp) / op)], capture_output=True, text=True, check=False,
                env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if proc.returncode != 0:
                raise SystemExit(f"{op} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["gb_per_s"] = model["bytes"] / r["seconds"] / 1e9
            r["peak_rss_x_model"] = r["peak_rss_bytes"] / model["bytes"]
            r["added_rss_x_model"] = (r["peak_rss_bytes"] - r["rss_before_bytes"]) / model["bytes"]
            rows[op] = r
    result = {
        "benchmark": "convert", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, no GPU",
        "load_note": "2-core machine shared with other helpers' tests and benchmarks",
        "model": {"preset": "qwen2.5-0.5b", "dtype": "bfloat16", **model, "files": 1},
        "workers": args.workers, "results": rows,
        "fp8_time_vs_reference": rows["fp8"]["seconds"] / rows["reference"]["seconds"],
        "fp8_cpu_vs_reference": rows["fp8"]["cpu_seconds"] / rows["reference"]["cpu_seconds"],
        "hf_to_dist_time_vs_reference": rows["hf-to-dist"]["seconds"]
        / rows["reference"]["seconds"],
    }
    print(f"{'operation':<12}{'wall s':>9}{'CPU s':>8}{'GB/s':>8}{'peak RSS GB':>13}"
          f"{'x model':>9}{'added x model':>15}")
    for op, r in rows.items():
        print(f"{op:<12}{r['seconds']:>9.2f}{r['cpu_seconds']:>8.2f}{r['gb_per_s']:>8.2f}"
              f"{r['peak_rss_bytes'] / 1e9:>13.2f}{r['peak_rss_x_model']:>9.2f}"
              f"{r['added_rss_x_model']:>15.2f}")
    print(f"fp8 / reference: wall {result['fp8_time_vs_reference']:.2f}x (target <= 2x), "
          f"CPU {result['fp8_cpu_vs_reference']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
