"""Train/rollout logprob mismatch of a hybrid (Gated DeltaNet + attention) model: the engine's
recurrent state in fp32 vs bf16 (`--mamba-ssm-dtype`), its attention KV in bf16 vs FP8
(`--kv-cache-dtype fp8_e4m3`).

One trainer (the torch backend, `--dtype bf16`: bf16 compute over fp32 master weights; its GDN
layers are transformers' torch chunked path) holds a random-init `--arch qwen3_5` preset
(`rltool.data.models.init_model`, bf16, seed 0, drawn on `--device`) or `--model DIR`. For each
of four engine configs an in-process builtin engine (`InProcessEngine`, `--dtype bf16`, on cuda
the Triton GDN kernels, on cpu the torch reference) serving those same weights samples the same
seeded prompts:
  fp32/bf16  fp32 recurrent state, bf16 KV (the engine's default)
  bf16/bf16  --mamba-ssm-dtype bf16
  fp32/fp8   --kv-cache-dtype fp8_e4m3 (the KV of the attention layers only: the recurrent state
             keeps its dtype)
  bf16/fp8   both
and the trainer recomputes the logprobs of each engine's sampled tokens the way the loop does
before a train step (benchmarks.fp8_mismatch: `compute_logprobs`, temperature 1). Per config:
mean |dlogp| (train_rollout_logprob_abs_diff), its max, the mismatch KL(pi_rollout ||
pi_trainer) by k1 and k3, the ratio of mean |dlogp| to the fp32/bf16 row's, and the share of
sampled tokens equal to the fp32/bf16 engine's at the same position (the samples share their
seeds). The floor row: the fp32/bf16 engine's samples against an fp32 trainer.

Prompts: `--prompts` x `--samples` requests of `--prompt-len` random token ids (seeded), each
sample its own `sampling_seed`, `--new-tokens` tokens (EOS ignored), temperature 1: by default
64 x 4, 128 + 128 tokens on hybrid-0.7b on cuda (about 2 minutes on one H100); 16 x 4, 64 + 32
on tiny-4l on cpu; `--quick` 4 x 2, 16 + 8 on tiny-4l (the CPU smoke run). A random-init
model's next-token distribution is near uniform: `--model DIR` (e.g. the hybrid GPU demo's
warm-started policy, `demo-run/sft/weights/weight_v000200`) gives a trained model's figures.

Usage: python -m benchmarks.hybrid_mismatch [--device cuda|cpu] [--quick] [--preset P]
       [--model DIR] [--prompts N] [--samples N] [--prompt-len N] [--new-tokens N] [--seed 0]
       [--out-dir benchmarks/results]
Prints a table and, last, one JSON line on stdout; with --out-dir also writes
hybrid_mismatch-DATE-DEVICE.json there.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from rltool.data.models import check_preset, init_model
from rltool.errors import BadInputError
from rltool.train.config import BackendConfig
from rltool.train.packed import has_linear_attention
from rltool.train.samples import Sample
from rltool.train.torch_backend import TorchBackend

from benchmarks import harness
from benchmarks.fp8_mismatch import mismatch, prompt_ids, recompute, sample

DEFAULTS = {"cuda": {"preset": "hybrid-0.7b", "prompts": 64, "samples": 4, "prompt_len": 128,
                     "new_tokens": 128},
            "cpu": {"preset": "tiny-4l", "prompts": 16, "samples": 4, "prompt_len": 64,
                    "new_tokens": 32}}
QUICK = {"preset": "tiny-4l", "prompts": 4, "samples": 2, "prompt_len": 16, "new_tokens": 8}
CONFIGS = (("fp32", "auto"), ("bf16", "auto"), ("fp32", "fp8_e4m3"), ("bf16", "fp8_e4m3"))


def same_tokens(samples: list[Sample], reference: list[Sample]) -> float:
    """The share of sampled tokens equal to the reference samples' at the same position."""
    pairs = [(a, b) for s, r in zip(samples, reference)
             for a, b in zip(s.response_ids, r.response_ids)]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


def bench(name: str, model: Path, *, device: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    trainer = TorchBackend(model, options=BackendConfig(dtype="bf16", device=device),
                           trainable=False)
    prompts = prompt_ids(int(trainer.config.vocab_size), prompts=args.prompts,
                         prompt_len=args.prompt_len, seed=args.seed)
    rows: list[dict[str, Any]] = []
    reference: list[Sample] = []
    for ssm, kv in CONFIGS:
        harness.progress(f"{name}: engine with {ssm} recurrent state, {kv} KV")
        samples, seconds = sample(model, prompts, weights=f"ssm-{ssm}", kv=kv, device=device,
                                  samples=args.samples, new_tokens=args.new_tokens,
                                  seed=args.seed, ignore_eos=True, mamba_ssm_dtype=ssm)
        reference = reference or samples
        rows.append({"model": name, "ssm": ssm, "kv": "fp8_e4m3" if kv == "fp8_e4m3" else "bf16",
                     "trainer": "bf16", "engine_s": seconds,
                     "same_tokens": same_tokens(samples, reference),
                     **mismatch(samples, recompute(trainer, samples))})
    del trainer
    fp32 = TorchBackend(model, options=BackendConfig(dtype="fp32", device=device),
                        trainable=False)
    rows.append({**rows[0], "trainer": "fp32", **mismatch(reference, recompute(fp32, reference))})
    base = rows[0]["abs_diff"]
    return [{**r, "abs_diff_vs_default": r["abs_diff"] / base if base else None} for r in rows]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--quick", action="store_true", help="The CPU smoke sizes (see above).")
    p.add_argument("--preset", help="Random-init --arch qwen3_5 preset (default hybrid-0.7b on "
                   "cuda, tiny-4l on cpu); ignored with --model.")
    p.add_argument("--model", type=Path, help="Measure this hybrid HF checkpoint instead.")
    for flag, help_ in (("--prompts", "Prompts"), ("--samples", "Samples per prompt"),
                        ("--prompt-len", "Prompt tokens"), ("--new-tokens", "Response tokens")):
        key = flag[2:].replace("-", "_")
        p.add_argument(flag, type=int, help=f"{help_} (default {DEFAULTS['cuda'][key]} on cuda, "
                       f"{DEFAULTS['cpu'][key]} on cpu, {QUICK[key]} with --quick).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, help="Write hybrid_mismatch-DATE-DEVICE.json here.")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS[args.device]).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    check_preset(args.preset)
    if args.model is not None and not has_linear_attention(args.model):
        raise BadInputError(f"--model {args.model} is not a hybrid (its config.json names no "
                            "linear_attention layer); pass an --arch qwen3_5 checkpoint")
    harness.require_positive(args, "--prompts", "--samples", "--prompt-len", "--new-tokens")
    harness.require_device(args.device)
    return args


def main(argv: list[str] | None = None) -> int:
    args = harness.parse_or_report(parse, argv)
    if args is None:
        return 2
    run = harness.Run("hybrid_mismatch", device=args.device)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is not None:
            name, model = str(args.model), args.model
        else:
            name = args.preset
            model = init_model(Path(tmp) / args.preset, arch="qwen3_5", preset=args.preset,
                               dtype="bf16", seed=args.seed, device=args.device)
        rows = bench(name, model, device=args.device, args=args)
    harness.print_table(
        ("model", "ssm", "kv", "trainer", "|dlogp| mean", "x default", "max", "KL k1", "KL k3",
         "same tokens", "engine s"),
        [(r["model"][-24:], r["ssm"], r["kv"], r["trainer"], r["abs_diff"],
          r["abs_diff_vs_default"], r["max_abs_diff"], r["kl_k1"], r["kl_k3"],
          r["same_tokens"], r["engine_s"]) for r in rows])
    settings = {"prompts": args.prompts, "samples": args.samples, "seed": args.seed,
                "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                "temperature": 1.0, "quick": args.quick}
    run.finish({"rows": rows, **settings}, out=args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
