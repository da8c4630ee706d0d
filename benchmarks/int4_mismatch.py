"""Train/rollout logprob mismatch of INT4 rollout, without and with `--int4-qat` in the trainer.

A random-init preset (`rltool.data.models.init_model`, the `copy` task's tokenizer, seed 0) gets
a short supervised warm start (`rltool train --loss sft`, `--sft-steps` steps of 32 on 1-8 digit
copy prompts at `--lr`), so that its next-token distributions are peaked as a trained policy's
are, not the near-uniform ones of random init; a second warm start from the same init and data
runs with `--int4-qat`. Each policy is published as the loop publishes version 0 (`rltool.delta.publish`),
in bf16 and with `[sync] precision = "int4"` (`rltool convert int4`'s defaults: W4A16, groups of
32, symmetric, every linear but lm_head). An in-process builtin engine (`--dtype bf16`) samples
the same seeded copy prompts (held out from the warm start's) from each published version, and a
trainer (the torch backend, `--dtype bf16`) recomputes the sampled tokens' logprobs as the loop
does before a train step (`rltool.train.step.compute_logprobs`, temperature 1). Rows:
  policy    engine  trainer
  sft       bf16    bf16        the bf16 floor
  sft       int4    bf16        INT4 rollout without QAT
  sft       int4    bf16+qat    the same weights, the trainer's forward fake-quantized
  sft-qat   int4    bf16+qat    the policy trained with --int4-qat, as the loop runs it
Per row the loop's mismatch metrics over all response tokens (benchmarks/fp8_mismatch.py's
`mismatch`): train_rollout_logprob_abs_diff (per-sample mean |diff|, then the mean over samples),
the max |diff|, KL(pi_rollout || pi_trainer) by k1 and k3. `qat_reduction` is the no-QAT row's
abs_diff over each QAT row's.

Usage: python -m benchmarks.int4_mismatch [--preset small] [--device cpu|cuda]
       [--sft-steps 150] [--lr 3e-3] [--prompts 64] [--samples 4] [--new-tokens 16] [--seed 0]
       [--out-dir benchmarks/results]
Prints a table and, last, one JSON line on stdout; with --out-dir also writes
int4_mismatch-DATE-DEVICE.json there.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from rltool.data.models import PRESETS, check_preset, init_model
from rltool.data.tasks import make_rows, write_prompts
from rltool.delta.config import SyncConfig
from rltool.delta.publish import publish_version
from rltool.errors import BadInputError
from rltool.train.config import BackendConfig, TrainConfig
from rltool.train.torch_backend import TorchBackend

from benchmarks import harness
from benchmarks.fp8_mismatch import file_prompt_ids, mismatch, recompute, sample

TASK = "copy"
ARMS = (("sft", "bf16", False), ("sft", "int4", False), ("sft", "int4", True),
        ("sft-qat", "int4", True))


def warm_start(root: Path, model: Path, *, qat: bool, steps: int, lr: float, seed: int,
               device: str) -> tuple[Path, float]:
    """`steps` supervised steps from `model` (with --int4-qat when `qat`): the published
    weights and the mean sft loss of the last 10 steps."""
    from rltool.train import run as run_train

    name = "sft-qat" if qat else "sft"
    result = run_train(TrainConfig(
        loss="sft", prompts=str(root / "sft.jsonl"), load=str(model), save=str(root / name / "ckpt"),
        publish=str(root / name / "weights"), metrics=str(root / name / "train.jsonl"),
        lr=lr, global_batch_size=32, num_steps=steps, seed=seed, device=device,
        int4_qat=qat))
    losses = [m["train/sft_loss"] for m in result.metrics if "train/sft_loss" in m]
    assert result.published is not None
    return Path(result.published), sum(losses[-10:]) / len(losses[-10:])


def publish(state: dict[str, torch.Tensor], model: Path, precision: str, out: Path) -> Path:
    """`state` published as version 0 in `precision` (bf16 or int4), as the loop publishes it."""
    sync = SyncConfig(sync="full", precision=precision)
    publish_version(state, sync, publish_dir=out, version=0, source_model_dir=model,
                    dtype="bf16")
    return out / "weight_v000000"


def reductions(rows: list[dict[str, Any]]) -> None:
    """Adds `qat_reduction` to the QAT rows: the no-QAT INT4 row's abs_diff over theirs."""
    base = next(r["abs_diff"] for r in rows if r["engine"] == "int4" and r["trainer"] == "bf16")
    for r in rows:
        r["qat_reduction"] = base / r["abs_diff"] if r["trainer"] == "bf16+qat" else None


def bench(args: argparse.Namespace, root: Path) -> tuple[list[dict[str, Any]], dict[str, float]]:
    model = init_model(root / "model", preset=args.preset, task=TASK, seed=args.seed)
    taken = {r["label"] for r in make_rows(TASK, num=args.prompts, seed=3, min_len=4,
                                           max_len=8)}
    write_prompts([r for r in make_rows(TASK, num=4096, seed=2, min_len=1, max_len=8)
                   if r["label"] not in taken], root / "sft.jsonl")
    write_prompts(make_rows(TASK, num=args.prompts, seed=3, min_len=4, max_len=8),
                  root / "eval.jsonl")
    prompts = file_prompt_ids(root / "eval.jsonl", model, prompts=args.prompts)
    policies, losses = {}, {}
    for name, qat in (("sft", False), ("sft-qat", True)):
        policies[name], losses[name] = warm_start(root, model, qat=qat, steps=args.sft_steps,
                                                  lr=args.lr, seed=args.seed, device=args.device)
        harness.progress(f"{name}: {args.sft_steps} sft steps, loss of the last 10 "
                         f"{losses[name]:.3f}")
    rows = []
    for name, engine, qat in ARMS:
        trainer = TorchBackend(policies[name], options=BackendConfig(
            dtype="bf16", device=args.device, int4_qat=qat), trainable=False)
        served = publish(trainer.export_hf_state_dict(), policies[name], engine,
                         root / "published" / f"{name}-{engine}")
        samples, seconds = sample(served, prompts, weights=engine, kv="auto", device=args.device,
                                  samples=args.samples, new_tokens=args.new_tokens,
                                  seed=args.seed, ignore_eos=False)
        rows.append({"model": args.preset, "policy": name, "engine": engine,
                     "trainer": "bf16+qat" if qat else "bf16", "engine_s": seconds,
                     **mismatch(samples, recompute(trainer, samples))})
        harness.progress(f"{name} {engine} {rows[-1]['trainer']}: "
                         f"|dlogp| {rows[-1]['abs_diff']:.3e}")
        del trainer
        shutil.rmtree(root / "published")
    reductions(rows)
    return rows, losses


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help=f"Random-init preset ({', '.join(PRESETS)}).")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--sft-steps", type=int, default=150, help="Warm-start steps of each policy.")
    p.add_argument("--lr", type=float, default=3e-3, help="Warm-start learning rate (3e-4 "
                   "suits the 0.5B shapes, as the GPU demo's warm start).")
    p.add_argument("--prompts", type=int, default=64, help="Held-out copy prompts sampled.")
    p.add_argument("--samples", type=int, default=4, help="Samples per prompt.")
    p.add_argument("--new-tokens", type=int, default=16, help="Response tokens at most (the "
                   "responses end at EOS).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, help="Write int4_mismatch-DATE-DEVICE.json here.")
    args = p.parse_args(argv)
    check_preset(args.preset)
    if not args.lr > 0:
        raise BadInputError(f"--lr must be > 0, got {args.lr}")
    harness.require_positive(args, "--sft-steps", "--prompts", "--samples", "--new-tokens")
    harness.require_device(args.device)
    return args


def main(argv: list[str] | None = None) -> int:
    args = harness.parse_or_report(parse, argv)
    if args is None:
        return 2
    run = harness.Run("int4_mismatch", device=args.device)
    with tempfile.TemporaryDirectory() as tmp:
        rows, losses = bench(args, Path(tmp))
    print(f"{'model':14} {'policy':8} {'engine':6} {'trainer':9} {'|dlogp| mean':>12} "
          f"{'max':>9} {'KL k1':>10} {'KL k3':>10} {'mean logp':>9} {'tokens':>6} "
          f"{'QAT gain':>8}")
    for r in rows:
        gain = "" if r["qat_reduction"] is None else f"{r['qat_reduction']:.2f}x"
        print(f"{r['model']:14} {r['policy']:8} {r['engine']:6} {r['trainer']:9} "
              f"{r['abs_diff']:12.3e} {r['max_abs_diff']:9.2e} {r['kl_k1']:10.2e} "
              f"{r['kl_k3']:10.2e} {r['mean_rollout_logprob']:9.3f} {r['tokens']:>6} "
              f"{gain:>8}")
    settings = {"task": TASK, "sft_steps": args.sft_steps, "sft_lr": args.lr, "sft_final_loss": losses,
                "prompts": args.prompts, "samples": args.samples,
                "new_tokens": args.new_tokens, "seed": args.seed, "temperature": 1.0}
    run.finish({**settings, "rows": rows}, out=args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
