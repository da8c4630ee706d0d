"""Weight backuper: switch times per tier against reloading the checkpoint, and how much of a
prefetched switch a train step hides.

For each preset (random-init Qwen2.5 shapes, fp32 weights as the trainer's masters) it times, on
one device:
  backup        live -> host (pinned on CUDA)              `backup(tag)`, host buffer reused
  restore_host  host -> live                               `restore(tag)`
  restore_staged  device staging -> live (CUDA)            `prefetch(tag)` done, then `restore`
  spill         host -> SSD file (write, checksum, fsync)  `spill(tag)`
  ssd_to_host   SSD -> host (verify checksum)              `prefetch(tag)` without device staging
  ssd_to_device SSD -> live (verify checksum)              `restore(tag)` of a spilled tag
  reload_*      the baselines: `from_pretrained` of the checkpoint (+ .to(device)), and
                reading its safetensors into the live model (`load_file` + copy)
SSD reads are timed cold (the file's pages evicted with posix_fadvise DONTNEED) and warm.
`h2d_peak` / `d2h_peak` are one large pinned copy each way: the bandwidth the tiers are held to.

Overlap (the 0.5B shapes unless --overlap-presets): a torch-backend train step (policy-gradient
loss, AdamW, micro-batches of 4 samples of <= 1,024 tokens) with a second tag ("teacher")
prefetched at its start from the host tier and from the SSD tier; exposed fraction = the restore
after the step / the same switch without prefetch, and "incl. slowdown" = (step with prefetch +
restore after it - step alone) / that switch, steps alone interleaved with prefetched ones. On CPU the step is cut to --cpu-train-tokens (default
256, fp32) tokens; on CUDA it has 16k tokens (bf16 autocast, fp32 masters).

Usage: python -m benchmarks.backuper [--device cpu|cuda] [--presets qwen2.5-0.5b,qwen2.5-3b]
           [--repeats 3] [--out DIR]
Defaults: cpu -> the 0.5B shapes; cuda -> 0.5B and 3B. Prints a table and, last, one JSON line;
with --out, also writes DIR/backuper-DATE-DEVICE.json (runs of other presets on the
same day merge into it, so `--presets qwen2.5-0.5b` then `--presets qwen2.5-3b --repeats 1`
splits the work under a time limit). Disk: one checkpoint and two snapshots at a time (41 GB
for the 3B shapes in fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rltool.data.models import init_model
from rltool.train.backend import MicroBatch
from rltool.train.backuper import WeightBackuper, module_tensors
from rltool.train.config import BackendConfig
from rltool.train.torch_backend import TorchBackend

from benchmarks import harness


def timed(fn, device: torch.device, repeats: int, *, before=None) -> float:
    """Median seconds of `fn()` (each run ends with a device sync); `before()` runs untimed."""
    return harness.median_s(fn, repeats=repeats, device=device, before=before)


def evict(path: Path) -> None:
    """Drop a file's pages from the page cache, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def peak_copy_gbps(device: torch.device, nbytes: int, repeats: int) -> tuple[float, float]:
    if device.type != "cuda":
        return float("nan"), float("nan")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = timed(lambda: dev.copy_(host, non_blocking=True), device, repeats)
    d2h = timed(lambda: host.copy_(dev, non_blocking=True), device, repeats)
    return nbytes / h2d / 1e9, nbytes / d2h / 1e9


def bench_tiers(model_dir: Path, device: torch.device, ssd: Path, repeats: int) -> dict:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rltool.io.checkpoint import open_checkpoint

    def from_pretrained():
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model = model.to(device)
        if device.type == "cpu":  # weights may still be lazy file mappings: read every byte
            for p in model.parameters():
                p.detach().sum()
        return model

    def checkpoint_files() -> list[Path]:
        return [model_dir / name for name in open_checkpoint(model_dir).files]

    def evict_checkpoint():
        for f in checkpoint_files():
            evict(f)

    r: dict = {}
    r["reload_from_pretrained_cold_s"] = timed(from_pretrained, device, 1, before=evict_checkpoint)
    model = from_pretrained()
    live = module_tensors(model)

    def reload_into_live():
        for f in checkpoint_files():
            for name, tensor in load_file(str(f)).items():
                if name in live:
                    live[name].copy_(tensor)

    r["reload_into_live_cold_s"] = timed(reload_into_live, device, repeats, before=evict_checkpoint)
    r["reload_into_live_warm_s"] = timed(reload_into_live, device, repeats)
    b = WeightBackuper(live, ssd_dir=ssd, stage_on_device=device.type == "cuda")
    r["snapshot_gb"] = b.snapshot_bytes / 1e9
    r["h2d_peak_gbps"], r["d2h_peak_gbps"] = peak_copy_gbps(device, min(b.snapshot_bytes, 1 << 30),
                                                          repeats)
    b.backup("a")
    b.backup("b")
    r["backup_s"] = timed(lambda: b.backup("a"), device, repeats)
    r["restore_host_s"] = timed(lambda: b.restore("a"), device, repeats)
    if b.stage_on_device:
        def stage_a():
            b.restore("b")  # "a" is not live, so its prefetch stages it on the device
            b.prefetch("a").result()

        r["restore_staged_s"] = timed(lambda: b.restore("a"), device, repeats, before=stage_a)
    r["spill_s"] = timed(lambda: b.spill("b"), device, repeats, before=lambda: b.backup("b"))
    path = ssd / "b.safetensors"
    r["restore_ssd_cold_s"] = timed(lambda: b.restore("b"), device, repeats,
                                    before=lambda: evict(path))
    r["restore_ssd_warm_s"] = timed(lambda: b.restore("b"), device, repeats)
    b.close()
    host_only = WeightBackuper(live, ssd_dir=ssd, stage_on_device=False)
    host_only.backup("c")
    host_only.spill("c")
    path = ssd / "c.safetensors"

    def drop_host():
        host_only.spill("c")  # the file is current: frees the host copy only
        evict(path)

    r["ssd_to_host_cold_s"] = timed(lambda: host_only.prefetch("c").result(), device, repeats,
                                    before=drop_host)
    host_only.close()
    gb = r["snapshot_gb"]
    for key in [k for k in r if k.endswith("_s") and not k.startswith("reload_from")]:
        r[key.removesuffix("_s") + "_gbps"] = gb / r[key]
    r["reload_from_pretrained_cold_gbps"] = gb / r["reload_from_pretrained_cold_s"]
    return r  # the model and its snapshots are freed with this frame


def bench_overlap(model_dir: Path, device: torch.device, ssd: Path, *, tokens: int,
                  repeats: int) -> dict:
    dtype = "bf16" if device.type == "cuda" else "fp32"
    backend = TorchBackend(model_dir, options=BackendConfig(dtype=dtype, lr=1e-6,
                                                            device=device.type))
    vocab = int(backend.config.vocab_size)
    per_sample = min(tokens, 1024)
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(4, vocab, (per_sample,), generator=g).tolist()
               for _ in range(max(1, tokens // per_sample))]
    per_mb = 4  # micro-batches of <= 4k tokens: the full-vocabulary logits stay a few GB
    mbs = [MicroBatch(indices=list(range(i, min(i + per_mb, len(samples)))),
                      tokens=samples[i:i + per_mb],
                      response_starts=[per_sample // 4] * len(samples[i:i + per_mb]))
           for i in range(0, len(samples), per_mb)]
    advantages = torch.randn(len(samples))

    def loss_fn(out, batch):
        loss = sum(-(a * torch.exp(lp - lp.detach())).mean() for a, lp in
                   zip(advantages[batch.indices].tolist(), out.logprobs)) / len(samples)
        return loss, {"train/loss": loss.detach()}

    def step():
        backend.train_step(mbs, loss_fn, temperature=1.0)

    r: dict = {"train_tokens": len(samples) * per_sample, "train_dtype": dtype}
    step()  # warm-up: optimizer state, allocator, kernels
    b = WeightBackuper(module_tensors(backend.inner), ssd_dir=ssd,
                       stage_on_device=device.type == "cuda")
    b.backup("teacher")  # the same bytes as any teacher: only the switch time matters here
    for tier in ("host", "ssd"):
        path = ssd / "teacher.safetensors"

        def place():
            if tier == "ssd":
                b.spill("teacher")
                evict(path)

        switch = timed(lambda: b.restore("teacher"), device, repeats, before=place)
        alone, with_prefetch, exposed = [], [], []
        for _ in range(repeats):
            # Steps alone interleaved with prefetched ones: the box drifts between minutes.
            alone.append(timed(step, device, 1))
            place()
            harness.sync(device)
            start = time.perf_counter()
            b.prefetch("teacher")
            step()
            harness.sync(device)
            mid = time.perf_counter()
            b.restore("teacher")
            harness.sync(device)
            end = time.perf_counter()
            with_prefetch.append(mid - start)
            exposed.append(end - mid)
        step_pf, wait = statistics.median(with_prefetch), statistics.median(exposed)
        r[f"{tier}_step_alone_s"] = step_alone = statistics.median(alone)
        r[f"{tier}_switch_s"] = switch
        r[f"{tier}_step_with_prefetch_s"] = step_pf
        r[f"{tier}_restore_after_prefetch_s"] = wait
        # What the step still waits for after it, and (noisier: two step times) that plus what
        # the prefetch slowed the step down.
        r[f"{tier}_exposed_fraction"] = wait / switch
        r[f"{tier}_exposed_fraction_incl_slowdown"] = max(0.0, step_pf + wait - step_alone) / switch
    b.close()
    r["step_s"] = statistics.median([r["host_step_alone_s"], r["ssd_step_alone_s"]])
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--presets", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu-train-tokens", type=int, default=256)
    parser.add_argument("--overlap-presets", default="qwen2.5-0.5b",
                        help="Presets whose prefetch overlap in a train step is measured "
                        "(comma-separated; 'none' for none).")
    parser.add_argument("--out", default=None, help="Directory for the raw results JSON.")
    parser.add_argument("--work-dir", default=None,
                        help="Where checkpoints and SSD snapshots go (default: a temp dir).")
    args = parser.parse_args()
    device = torch.device(args.device)
    presets = (args.presets.split(",") if args.presets else
               ["qwen2.5-0.5b", "qwen2.5-3b"] if device.type == "cuda" else ["qwen2.5-0.5b"])
    if device.type == "cpu":
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    tokens = 16384 if device.type == "cuda" else args.cpu_train_tokens
    run = harness.Run("backuper", device=device.type)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        for preset in presets:
            model_dir = init_model(Path(tmp) / preset, preset=preset, seed=0,
                                   device=device.type)
            row = {"preset": preset, **bench_tiers(model_dir, device, Path(tmp) / "ssd",
                                                   args.repeats)}
            if preset in args.overlap_presets.split(","):
                row.update(bench_overlap(model_dir, device, Path(tmp) / "ssd-train",
                                         tokens=tokens, repeats=args.repeats))
            rows.append(row)
            harness.progress(json.dumps(row))
            shutil.rmtree(model_dir)  # the 3B checkpoint is 13.6 GB: one on disk at a time
    print(f"\n{'preset':13s} {'GB':>5s} {'backup':>7s} {'rest.host':>9s} {'staged':>7s} "
          f"{'spill':>6s} {'ssd->host':>9s} {'ssd->live':>9s} {'reload':>7s} {'pretrained':>10s}"
          f"   (seconds; SSD and reload reads cold)")
    for r in rows:
        print(f"{r['preset']:13s} {r['snapshot_gb']:5.2f} {r['backup_s']:7.3f} "
              f"{r['restore_host_s']:9.3f} {r.get('restore_staged_s', float('nan')):7.4f} "
              f"{r['spill_s']:6.2f} {r['ssd_to_host_cold_s']:9.2f} {r['restore_ssd_cold_s']:9.2f} "
              f"{r['reload_into_live_cold_s']:7.2f} {r['reload_from_pretrained_cold_s']:10.2f}")
    if device.type == "cuda":
        for r in rows:
            print(f"{r['preset']}: backup {r['backup_gbps']:.1f} GB/s vs d2h peak "
                  f"{r['d2h_peak_gbps']:.1f}; restore {r['restore_host_gbps']:.1f} GB/s vs h2d "
                  f"peak {r['h2d_peak_gbps']:.1f}")
    for r in rows:
        if "step_s" in r:
            print(f"{r['preset']}: train step {r['step_s']:.2f} s ({r['train_tokens']} tokens, "
                  f"{r['train_dtype']}); exposed fraction of a prefetched switch (incl. step "
                  f"slowdown): host {r['host_exposed_fraction']:.2f} "
                  f"({r['host_exposed_fraction_incl_slowdown']:.2f}) of {r['host_switch_s']:.3f} s"
                  f", ssd {r['ssd_exposed_fraction']:.2f} "
                  f"({r['ssd_exposed_fraction_incl_slowdown']:.2f}) of {r['ssd_switch_s']:.3f} s")
    if args.out and run.path(args.out).exists():  # one preset per invocation adds up to one file
        mine = {r["preset"] for r in rows}
        rows = [r for r in json.loads(run.path(args.out).read_text())["results"]
                if r["preset"] not in mine] + rows
    run.finish({"repeats": args.repeats,
                "timing": "median of repeats, each ending with a device sync; SSD reads cold "
                          "(posix_fadvise DONTNEED) unless named warm", "results": rows},
               out=args.out)


if __name__ == "__main__":
    main()
