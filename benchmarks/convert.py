"""Checkpoint conversion throughput and memory.

Builds a random bf16 HF checkpoint with Qwen2.5-0.5B's shapes (preset `qwen2.5-0.5b`, untied
lm_head: ~630M parameters, ~1.26 GB in one safetensors file, tensors written directly), then runs,
each in a fresh subprocess so peak RSS is per operation:

- reference: safetensors `load_file` of every tensor + `save_file` of the same bytes + fsync
  (safetensors' own buffered write through the page cache);
- reference-direct: the same load, then the same bytes written the way the fp8 conversion writes
  them (`write_streaming`: sequential O_DIRECT through an aligned staging buffer) + fsync. This is
  the fair baseline: both sides write the same way and both fsync;
- fp8: `rltool.convert.fp8.quantize_checkpoint` (block 128x128, --workers threads) with the
  native kernel (csrc/fp8.c; the run fails if it is not built);
- fp8-torch: the same with RLTOOL_NATIVE=0, the torch fallback (same output bits);
- hf-to-dist: `rltool.convert.torch_dist.hf_to_dist` (one process, tp=1).

Each operation runs --repeat times (hf-to-dist --dist-repeat times), round-robin; the table shows
the median wall time and its spread, the median CPU seconds and the largest peak RSS.

Wall time is measured inside the subprocess around the operation (interpreter start-up and imports
excluded); GB/s is input bytes / wall time; peak RSS is the subprocess's VmHWM, shown as a multiple
of the model's bytes, which here is also the one (largest) input shard (hf-to-dist target ~1.3x,
fp8 target < 1.5x); "added" subtracts the RSS before the operation (interpreter, torch).
Target: fp8 within 2x the reference's wall time (against reference-direct; the buffered
reference is reported beside it).

Usage: python -m benchmarks.convert [--workers 2] [--repeat 3] [--dist-repeat 1]
       [--ops reference fp8 ...]
       [--out DIR_OR_FILE.json]
Prints a table and, last, one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rltool import native

from benchmarks import harness

OPERATIONS = ("reference", "reference-direct", "fp8", "fp8-torch", "hf-to-dist")


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


def _cpu_seconds() -> tuple[float, float]:
    """(user, system) CPU seconds of this process and its reaped children: less sensitive than
    wall time to the other processes sharing the machine."""
    import resource

    own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                       resource.RUSAGE_CHILDREN))
    return own.ru_utime + children.ru_utime, own.ru_stime + children.ru_stime


def run_one(op: str, src: Path, out: Path, workers: int) -> dict:
    """Body of one measurement subprocess."""
    from safetensors.torch import load_file, save_file

    from rltool.convert import fp8, fp8_native, torch_dist
    from rltool.io.header import dtype_code
    from rltool.io.writer import write_streaming

    if op == "hf-to-dist":
        import megatron.core  # noqa: F401  (its import is start-up, not conversion)
    before = _status_bytes("VmRSS")
    cpu_before = _cpu_seconds()
    start = time.perf_counter()
    if op in ("reference", "reference-direct"):
        tensors = load_file(str(src / "model.safetensors"))
        out.mkdir()
        path = out / "model.safetensors"
        if op == "reference":
            save_file(tensors, str(path))
        else:
            entries = [(name, dtype_code(t.dtype), tuple(t.shape)) for name, t in tensors.items()]
            write_streaming(path, entries, iter(tensors.items()))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # the conversions publish through atomic_path, which fsyncs
        finally:
            os.close(fd)
        del tensors
    elif op in ("fp8", "fp8-torch"):
        if fp8_native.available() != (op == "fp8"):
            raise SystemExit(f"{op}: the native kernel is {'not ' * (op == 'fp8')}loaded; "
                             "build it with `pip install -e .`")
        fp8.quantize_checkpoint(fp8.Fp8Config(hf=src, out=out, workers=workers))
    else:
        torch_dist.hf_to_dist(torch_dist.HfToDistConfig(hf=src, out=out))
    seconds = time.perf_counter() - start
    user, system = (after - b for after, b in zip(_cpu_seconds(), cpu_before, strict=True))
    return {"seconds": seconds, "cpu_seconds": user + system, "user_seconds": user,
            "system_seconds": system, "peak_rss_bytes": _status_bytes("VmHWM"),
            "rss_before_bytes": before}


def _child(op: str, src: Path, out: Path, workers: int) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if op == "fp8-torch":
        env[native.DISABLE_ENV] = "0"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.convert", "--workers", str(workers), "--_child", op,
                           str(src), str(out)], capture_output=True, text=True, check=False,
                          env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{op} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _summary(runs: list[dict], model_bytes: int) -> dict:
    """The median run by wall time, with the spread of all runs."""
    seconds = [r["seconds"] for r in runs]
    r = dict(sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2])
    r.update(seconds=statistics.median(seconds), seconds_min=min(seconds),
             seconds_max=max(seconds),
             cpu_seconds=statistics.median(r["cpu_seconds"] for r in runs),
             system_seconds=statistics.median(r["system_seconds"] for r in runs),
             peak_rss_bytes=max(r["peak_rss_bytes"] for r in runs))
    r["gb_per_s"] = model_bytes / r["seconds"] / 1e9
    r["peak_rss_x_model"] = r["peak_rss_bytes"] / model_bytes
    r["added_rss_x_model"] = (r["peak_rss_bytes"] - r["rss_before_bytes"]) / model_bytes
    return r


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="Runs of each operation (median).")
    parser.add_argument("--dist-repeat", type=int, default=1,
                        help="Runs of hf-to-dist (~10x slower than the others; not the target).")
    parser.add_argument("--out", default=None, help="Result JSON file.")
    parser.add_argument("--ops", nargs="+", choices=OPERATIONS, default=list(OPERATIONS),
                        help="Operations to run (reference and fp8 are always compared).")
    parser.add_argument("--_child", nargs=3, metavar=("OP", "SRC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        op, src, out = args._child
        print(json.dumps(run_one(op, Path(src), Path(out), args.workers)))
        return
    run = harness.Run("convert")
    with tempfile.TemporaryDirectory(prefix="rltool-bench-convert-") as tmp:
        src = Path(tmp) / "src"
        model = make_checkpoint(src)
        runs: dict[str, list[dict]] = {op: [] for op in args.ops}
        # Round-robin so that a change of the machine's load hits every operation alike.
        for i in range(args.repeat):
            for op in args.ops:
                if op == "hf-to-dist" and i >= args.dist_repeat:
                    continue
                out = Path(tmp) / f"{op}-{i}"
                runs[op].append(_child(op, src, out, args.workers))
                shutil.rmtree(out)
    rows = {op: _summary(r, model["bytes"]) for op, r in runs.items()}
    result = {
        "model": {"preset": "qwen2.5-0.5b", "dtype": "bfloat16", **model, "files": 1},
        "workers": args.workers, "repeat": args.repeat, "dist_repeat": args.dist_repeat,
        "omp_num_threads":
        os.environ.get("OMP_NUM_THREADS"), "results": rows,
    }
    for ref_op in ("reference", "reference-direct"):
        ref = rows.get(ref_op)
        for op in args.ops:
            if ref and not op.startswith("reference"):
                key = op.replace("-", "_") + ("_direct" if ref_op == "reference-direct" else "")
                result[f"{key}_time_vs_reference"] = rows[op]["seconds"] / ref["seconds"]
                result[f"{key}_cpu_vs_reference"] = rows[op]["cpu_seconds"] / ref["cpu_seconds"]
    print(f"median of {args.repeat} runs ({args.dist_repeat} of hf-to-dist); load average "
          f"{run.load_before[0]:.2f} before, {harness.load_average()[0]:.2f} after")
    print(f"{'operation':<16}{'wall s':>9}{'(min-max)':>13}{'CPU s':>8}{'sys s':>7}{'GB/s':>7}"
          f"{'peak RSS GB':>13}{'x model':>9}{'added x model':>15}")
    for op, r in rows.items():
        print(f"{op:<16}{r['seconds']:>9.2f}{r['seconds_min']:>7.2f}-{r['seconds_max']:<5.2f}"
              f"{r['cpu_seconds']:>8.2f}{r['system_seconds']:>7.2f}{r['gb_per_s']:>7.2f}"
              f"{r['peak_rss_bytes'] / 1e9:>13.2f}"
              f"{r['peak_rss_x_model']:>9.2f}{r['added_rss_x_model']:>15.2f}")
    for key, name in (("fp8", "reference (buffered)"), ("fp8_direct", "reference-direct")):
        if f"{key}_time_vs_reference" in result:
            print(f"fp8 / {name}: wall {result[f'{key}_time_vs_reference']:.2f}x, "
                  f"CPU {result[f'{key}_cpu_vs_reference']:.2f}x")
    run.finish(result, out=args.out, detail={"runs": runs})


if __name__ == "__main__":
    main()
