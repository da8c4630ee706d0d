"""Cost of the trainer's deterministic layout (one unpadded forward per sample, the layout of
rltool.logprobs.sequence_logprobs) against padded micro-batches, in the same run.

For each model preset (tiny, small) and 64 samples (30-260 tokens, the last quarter the response,
seeded) it times, on one CPU process in fp32:
  recompute  - forward_logprobs over the DP schedule's micro-batches (cap 4096 tokens), no grad
  train_step - one optimizer step over the same micro-batches (forward + backward + AdamW)
for `padded` and `deterministic`, median of --repeats, and reports the ratio and the largest
|padded - deterministic| logprob difference.

Usage: python -m benchmarks.train_forward [--repeats 3] [--out DIR_OR_FILE.json]
Prints a table and, last, one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from rltool.data.models import init_model
from rltool.train.config import BackendConfig
from rltool.train.torch_backend import TorchBackend

from benchmarks import harness
from benchmarks.workloads import make_samples, micro_batches

CAP = 4096
NUM_SAMPLES = 64


def bench_preset(preset: str, root: Path, *, repeats: int) -> dict:
    model_dir = init_model(root / preset, preset=preset, seed=0)
    results: dict = {"preset": preset}
    logprobs = {}
    for mode in ("padded", "deterministic"):
        options = BackendConfig(deterministic=mode == "deterministic", lr=1e-4)
        backend = TorchBackend(model_dir, options=options)
        samples = make_samples(int(backend.config.vocab_size), num=NUM_SAMPLES,
                               lengths=(30, 260), seed=0)
        mbs = micro_batches(samples, cap=CAP,
                            response_starts=[len(s) - len(s) // 4 for s in samples])

        def recompute():
            out = {}
            for mb in mbs:
                out.update(zip(mb.indices, backend.forward_logprobs(mb, temperature=1.0).logprobs))
            return out

        def loss_fn(out, mb):
            loss = -sum(lp.sum() for lp in out.logprobs) / 1e4
            return loss, {"train/loss": loss}

        times, logprobs[mode] = harness.timed(recompute, repeats=repeats)
        results[f"recompute_ms_{mode}"] = statistics.median(times) * 1e3
        results[f"train_step_ms_{mode}"] = harness.median_s(
            lambda: backend.train_step(mbs, loss_fn, temperature=1.0), repeats=repeats) * 1e3
        results["micro_batches"] = len(mbs)
        results["tokens"] = sum(len(t) for t in samples)
    results["recompute_ratio"] = results["recompute_ms_deterministic"] / results["recompute_ms_padded"]
    results["train_step_ratio"] = (results["train_step_ms_deterministic"]
                                   / results["train_step_ms_padded"])
    results["max_abs_logprob_diff"] = max(
        float((logprobs["padded"][i] - logprobs["deterministic"][i]).abs().max())
        for i in logprobs["padded"])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    run = harness.Run("train_forward")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [bench_preset(p, Path(tmp), repeats=args.repeats) for p in ("tiny", "small")]
    print(f"{'preset':8s} {'mbs':>4s} {'tokens':>7s} {'recompute pad ms':>17s} "
          f"{'recompute det ms':>17s} {'ratio':>6s} {'step pad ms':>12s} {'step det ms':>12s} "
          f"{'ratio':>6s} {'max |diff|':>10s}")
    for r in rows:
        print(f"{r['preset']:8s} {r['micro_batches']:4d} {r['tokens']:7d} "
              f"{r['recompute_ms_padded']:17.1f} {r['recompute_ms_deterministic']:17.1f} "
              f"{r['recompute_ratio']:6.2f} {r['train_step_ms_padded']:12.1f} "
              f"{r['train_step_ms_deterministic']:12.1f} {r['train_step_ratio']:6.2f} "
              f"{r['max_abs_logprob_diff']:10.2e}")
    run.finish({"threads": 1, "repeats": args.repeats, "results": rows}, out=args.out)


if __name__ == "__main__":
    main()
