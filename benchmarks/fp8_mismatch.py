"""Train/rollout logprob mismatch of FP8 rollout: BF16 vs FP8 weights, BF16 vs FP8 attention KV.

One trainer (the torch backend, `--dtype bf16`: bf16 compute over fp32 master weights) holds a
model: a random-init preset (`rltool.data.models.init_model`, seed 0) or `--model DIR`. Its
weights are published twice, as the loop publishes version 0 (`rltool.delta.publish`): in bf16,
and with `[sync] precision = "fp8"` (block-quantized exactly as `rltool convert fp8` would). For
each of four engine configs, an in-process builtin engine (`InProcessEngine`, `--dtype bf16`)
samples the same seeded prompts:
  bf16/bf16  bf16 weights, bf16 KV          fp8/bf16  FP8 weights, bf16 KV
  bf16/fp8   bf16 weights, --kv-cache-dtype fp8_e4m3     fp8/fp8  FP8 weights, FP8 KV
and the trainer recomputes the logprobs of the sampled tokens the way the loop does before a
train step (`rltool.train.step.compute_logprobs`: the DP micro-batch schedule, temperature 1).
Per config: the loop's metrics (rltool.train.algo.mismatch) of engine vs trainer over all
response tokens: train_rollout_logprob_abs_diff (per-sample mean |diff|, then the mean over
samples), the max |diff|, and the mismatch KL(pi_rollout || pi_trainer) estimated with k1 and
k3. The floor row: the bf16/bf16 engine's samples against an fp32 trainer.

Prompts: `--prompts` x `--samples` requests of `--prompt-len` random token ids (seeded), each
sample its own `sampling_seed`, `--new-tokens` tokens (EOS ignored), temperature 1; by default
64 x 4, 128 + 128 tokens on cuda, 16 x 4, 64 + 32 tokens on cpu. `--prompt-file FILE` takes the
first `--prompts` prompts of a prompt file instead (the rollout stage's format and chat
template; responses end at EOS or `--new-tokens`). A random-init model's next-token distribution
is near uniform, so its logprob differences say little about a trained model's: pass `--model
DIR` (any HF checkpoint, e.g. the GPU demo's warm-started policy) for representative figures.

Usage: python -m benchmarks.fp8_mismatch [--presets tiny,qwen2.5-0.5b,...]
       [--model DIR [--model-name NAME]] [--device cpu|cuda] [--prompts N] [--samples N]
       [--prompt-len N] [--new-tokens N] [--prompt-file FILE.jsonl] [--seed 0]
       [--out-dir benchmarks/results]
Prints a table and, last, one JSON line on stdout; with --out-dir also writes
fp8_mismatch-DATE-DEVICE.json there (a later run the same day adds its models' rows to it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rltool.data.models import PRESETS, check_preset, init_model
from rltool.delta.config import SyncConfig
from rltool.delta.publish import publish_version
from rltool.engine.config import ServeConfig
from rltool.engine.inprocess import InProcessEngine
from rltool.errors import BadInputError
from rltool.rollout.prompts import load_prompts, load_tokenizer, prompt_at, render_prompt
from rltool.train.algo.mismatch import mismatch_kl, train_rollout_logprob_abs_diff
from rltool.train.config import BackendConfig, TrainConfig
from rltool.train.samples import Sample
from rltool.train.step import compute_logprobs
from rltool.train.torch_backend import TorchBackend

from benchmarks import harness

# The CPU defaults keep a tiny check under a minute; the GPU ones are the documented table's.
DEFAULTS = {"cuda": {"prompts": 64, "samples": 4, "prompt_len": 128, "new_tokens": 128},
            "cpu": {"prompts": 16, "samples": 4, "prompt_len": 64, "new_tokens": 32}}
CONFIGS = (("bf16", "auto"), ("fp8", "auto"), ("bf16", "fp8_e4m3"), ("fp8", "fp8_e4m3"))


def prompt_ids(vocab: int, *, prompts: int, prompt_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (prompts, prompt_len), generator=g).tolist()


def file_prompt_ids(path: Path, model: Path, *, prompts: int) -> list[list[int]]:
    """The first `prompts` rows of a prompt file (cycling), chat-templated and tokenized as the
    rollout stage does by default."""
    rows, tokenizer = load_prompts(path), load_tokenizer(model)
    return [render_prompt(tokenizer, prompt_at(rows, i)) for i in range(prompts)]


def sample(model: Path, prompts: list[list[int]], *, weights: str, kv: str, device: str,
           samples: int, new_tokens: int, seed: int, ignore_eos: bool,
           **serve: Any) -> tuple[list[Sample], float]:
    """Every prompt `samples` times from an in-process engine serving `model` (`serve`: more
    ServeConfig fields); (samples, s)."""
    n = len(prompts) * samples
    cfg = ServeConfig(model=model, device=device, dtype="bf16", kv_cache_dtype=kv,
                      max_running_requests=n, cuda_graph_max_bs=n,
                      max_total_tokens=n * (max(map(len, prompts)) + new_tokens + 16), **serve)
    engine = InProcessEngine(cfg, name=f"{weights}-{kv}")
    ids = [p for p in prompts for _ in range(samples)]
    payload = {"input_ids": ids, "return_logprob": True,
               "sampling_params": [{"max_new_tokens": new_tokens, "temperature": 1.0,
                                    "ignore_eos": ignore_eos, "sampling_seed": seed * 1_000_003 + i}
                                   for i in range(n)]}
    try:
        t0 = time.perf_counter()
        outs = asyncio.run(engine.generate(payload))
        seconds = time.perf_counter() - t0
    finally:
        engine.stop()
    assert isinstance(outs, list)
    rows = []
    for i, (p, out) in enumerate(zip(ids, outs)):
        triples = out["meta_info"]["output_token_logprobs"]
        response = [int(t) for t in out["output_ids"]]
        rows.append(Sample(uid=str(i), prompt_ids=p, response_ids=response,
                           loss_mask=[1] * len(response),
                           rollout_logprobs=[float(t[0]) for t in triples], reward=0.0,
                           group=i // samples))
    return rows, seconds


def recompute(trainer: TorchBackend, samples: list[Sample]) -> list[torch.Tensor]:
    """The trainer's logprobs of the sampled tokens, as the loop's old-logprob recompute."""
    return compute_logprobs(trainer, samples, [list(range(len(samples)))], temperature=1.0,
                            max_tokens_per_microbatch=TrainConfig.model_fields[
                                "max_tokens_per_microbatch"].default)["logprobs"]


def padded(rows: list[list[float]] | list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] float32 values (0 beyond each row) and the [B, T] bool mask of real entries."""
    width = max(len(r) for r in rows)
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=torch.float32)
        mask[i, :len(r)] = True
    return out, mask


def mismatch(samples: list[Sample], trainer_logprobs: list[torch.Tensor]) -> dict[str, float]:
    """The loop's mismatch metrics of the engine's logprobs against the trainer's."""
    rollout, mask = padded([s.rollout_logprobs for s in samples])
    old, _ = padded(trainer_logprobs)
    diff = (old - rollout).abs().masked_fill(~mask, 0.0)
    return {"abs_diff": float(train_rollout_logprob_abs_diff(old, rollout, mask)),
            "max_abs_diff": float(diff.max()),
            "kl_k1": float(mismatch_kl(old, rollout, mask, estimator="k1")),
            "kl_k3": float(mismatch_kl(old, rollout, mask, estimator="k3")),
            "tokens": int(mask.sum()), "mean_rollout_logprob": float(rollout[mask].mean())}


def bench(name: str, model: Path, *, device: str, args: argparse.Namespace,
          root: Path) -> list[dict[str, Any]]:
    trainer = TorchBackend(model, options=BackendConfig(dtype="bf16", device=device),
                           trainable=False)
    state = trainer.export_hf_state_dict()
    published = {}
    for weights in ("bf16", "fp8"):
        sync = SyncConfig(sync="full", precision="fp8" if weights == "fp8" else None)
        out = root / "published" / weights  # one model at a time (emptied below)
        publish_version(state, sync, publish_dir=out, version=0, source_model_dir=model,
                        dtype="bf16")
        published[weights] = out / "weight_v000000"
    del state
    if args.prompt_file is not None:
        prompts = file_prompt_ids(args.prompt_file, model, prompts=args.prompts)
    else:
        prompts = prompt_ids(int(trainer.config.vocab_size), prompts=args.prompts,
                             prompt_len=args.prompt_len, seed=args.seed)
    rows, floor_samples = [], None
    for weights, kv in CONFIGS:
        samples, seconds = sample(published[weights], prompts, weights=weights, kv=kv,
                                  device=device, samples=args.samples,
                                  new_tokens=args.new_tokens, seed=args.seed,
                                  ignore_eos=args.prompt_file is None)
        floor_samples = floor_samples or samples
        rows.append({"model": name, "weights": weights,
                     "kv": "fp8_e4m3" if kv == "fp8_e4m3" else "bf16", "trainer": "bf16",
                     "engine_s": seconds, **mismatch(samples, recompute(trainer, samples))})
    del trainer
    shutil.rmtree(root / "published")
    fp32 = TorchBackend(model, options=BackendConfig(dtype="fp32", device=device),
                        trainable=False)
    assert floor_samples is not None
    rows.append({"model": name, "weights": "bf16", "kv": "bf16", "trainer": "fp32",
                 "engine_s": rows[0]["engine_s"],
                 **mismatch(floor_samples, recompute(fp32, floor_samples))})
    return rows


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="tiny", help="Comma-separated random-init presets "
                   f"({', '.join(PRESETS)}); empty with --model.")
    p.add_argument("--model", type=Path, help="Also measure this HF checkpoint directory.")
    p.add_argument("--model-name", help="The --model's name in the table (default its path).")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    for flag, help_ in (("--prompts", "Prompts"), ("--samples", "Samples per prompt"),
                        ("--prompt-len", "Prompt tokens"), ("--new-tokens", "Response tokens")):
        key = flag[2:].replace("-", "_")
        p.add_argument(flag, type=int, help=f"{help_} (default {DEFAULTS['cuda'][key]} on cuda, "
                       f"{DEFAULTS['cpu'][key]} on cpu).")
    p.add_argument("--prompt-file", type=Path, help="Prompts from this prompt file (JSONL, "
                   "the rollout stage's format; chat-templated) instead of random token ids; "
                   "responses then end at EOS.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, help="Write fp8_mismatch-DATE-DEVICE.json here.")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.preset_list = [x for x in args.presets.split(",") if x]
    for preset in args.preset_list:
        check_preset(preset)
    if args.model is not None and not (args.model / "config.json").is_file():
        raise BadInputError(f"--model {args.model} has no config.json; pass a HF checkpoint "
                            "directory")
    if args.prompt_file is not None and not args.prompt_file.exists():
        raise BadInputError(f"--prompt-file {args.prompt_file} does not exist; pass a prompt "
                            "file (JSONL)")
    if not args.preset_list and args.model is None:
        raise BadInputError("nothing to measure; pass --presets or --model")
    harness.require_positive(args, "--prompts", "--samples", "--prompt-len", "--new-tokens")
    harness.require_device(args.device)
    return args


def main(argv: list[str] | None = None) -> int:
    args = harness.parse_or_report(parse, argv)
    if args is None:
        return 2
    run = harness.Run("fp8_mismatch", device=args.device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for preset in args.preset_list:
            model = init_model(root / preset, preset=preset, dtype="bf16", seed=0)
            rows += bench(preset, model, device=args.device, args=args, root=root)
        if args.model is not None:
            rows += bench(args.model_name or str(args.model), args.model, device=args.device,
                          args=args, root=root)
    print(f"{'model':24} {'weights':7} {'kv':8} {'trainer':7} {'|dlogp| mean':>12} "
          f"{'max':>9} {'KL k1':>10} {'KL k3':>10} {'mean logp':>9} {'engine s':>8}")
    for r in rows:
        print(f"{r['model'][-24:]:24} {r['weights']:7} {r['kv']:8} {r['trainer']:7} "
              f"{r['abs_diff']:12.3e} {r['max_abs_diff']:9.2e} {r['kl_k1']:10.2e} "
              f"{r['kl_k3']:10.2e} {r['mean_rollout_logprob']:9.3f} {r['engine_s']:8.1f}")
    settings = {"prompts": args.prompts, "samples": args.samples, "seed": args.seed,
                "prompt_len": None if args.prompt_file else args.prompt_len,
                "new_tokens": args.new_tokens, "temperature": 1.0,
                "prompt_file": str(args.prompt_file) if args.prompt_file else None}
    rows = [{**r, **settings} for r in rows]
    if args.out_dir is not None and run.path(args.out_dir).exists():
        # a later run of the same day adds its models' rows (or replaces them)
        mine = {r["model"] for r in rows}
        earlier = json.loads(run.path(args.out_dir).read_text())["rows"]
        rows = [r for r in earlier if r["model"] not in mine] + rows
    run.finish({"rows": rows}, out=args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
