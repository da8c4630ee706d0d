"""The hybrid (Gated DeltaNet + attention) engine on one GPU: its GDN layers through the Triton
kernels (rltool.engine.gdn_kernels, gdn_prefill) against the torch reference path
(linear_attention), in the same run on the same runner.

Model: a random-init bf16 `rltool init-model --arch qwen3_5 --preset hybrid-0.7b` (18 GDN layers,
6 attention layers, ~0.67B parameters), drawn on the GPU. One paged runner (no prefix cache,
--mamba-ssm-dtype fp32, eager decode: the engine captures no CUDA graph for hybrids); each arm
flips `HybridLM.gdn_kernels`.

- Prefill: PREFILL_PROMPTS prompts of PREFILL_LEN tokens in one packed forward per arm (timed
  between device syncs, each arm once untimed first), tokens/s, and the largest difference of
  the two arms' last-token logits.
- Decode at each `--batches` B: B prompts of DECODE_PROMPT tokens prefilled (kernels), then per
  arm 2 untimed and DECODE_STEPS timed steps fed the sampled tokens (the GPU sampler,
  temperature 1; rltool.engine.batch_sampling): tokens/s, wall ms per step, GPU ms per step of
  the forwards (CUDA events), and the bytes roofline of a step beside them: the weights read once
  (the untied embedding table only for the B rows looked up, so left out), each request's KV
  read (its mean length over the steps) and one token's written, and each request's recurrent
  and conv states read and written once (`LinearSpec.state_bytes`, fp32 recurrent states),
  over the device copy bandwidth measured in the same run; `roofline_fraction` = roofline ms /
  GPU ms.

Usage: python -m benchmarks.engine_hybrid [--batches 64,256] [--out DIR]
       TRITON_INTERPRET=1 python -m benchmarks.engine_hybrid --device cpu --quick
(--quick: the tiny-4l preset in fp32, B = 2, prompts of 100 tokens, 4 decode steps, the Triton
kernels interpreted on the CPU; a smoke run of the code, no roofline.) Prints a table and, last,
one JSON line.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from rltool.engine.paged_runner import PagedRunner

from benchmarks import harness
from benchmarks.engine_common import copy_bandwidth, prompts_for
from benchmarks.engine_long import decode_steps

PRESET = "hybrid-0.7b"
PREFILL_PROMPTS, PREFILL_LEN = 4, 4096
DECODE_PROMPT, DECODE_STEPS, WARM_STEPS = 512, 64, 2
PREFILL_CHUNK = 8192  # tokens per packed forward while filling a decode batch
ARMS = ("kernels", "torch")
QUICK = {"preset": "tiny-4l", "batches": [2], "prefill_prompts": 2, "prefill_len": 100,
         "decode_prompt": 100, "steps": 4}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="64,256", help="Decode batch sizes, comma-separated.")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="The CPU smoke run (see above).")
    p.add_argument("--out", default=None, help="Directory (or .json file) for the record.")
    args = p.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        p.error(f"--batches {args.batches!r}: give comma-separated integers, e.g. 64,256")
    if not args.batches or min(args.batches) < 1:
        p.error("--batches: give at least one batch size >= 1")
    if args.device == "cpu" and not (args.quick and _interpreted()):
        p.error("--device cpu runs only --quick under TRITON_INTERPRET=1 (the kernels interpreted)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible; use --device cpu --quick")
    return args


def _interpreted() -> bool:
    from rltool.batch_invariant import INTERPRETED

    return INTERPRETED


def set_arm(runner: PagedRunner, arm: str) -> None:
    runner.model.gdn_kernels = arm == "kernels"


def timed_prefill(runner: PagedRunner, prompts: list[list[int]]) -> tuple[float, torch.Tensor]:
    """One packed forward over `prompts` (fresh requests, removed after): seconds and the
    last-token logits."""
    rids = [f"p{i}" for i in range(len(prompts))]
    chunks = [(rid, p, 0) for rid, p in zip(rids, prompts)]
    times, logits = harness.timed(lambda: runner.prefill(chunks, want=[True] * len(chunks)),
                                  repeats=1, device=runner.device)
    for rid in rids:
        runner.remove(rid)
    return times[0], logits


def prefill_rows(runner: PagedRunner, *, num_prompts: int, length: int) -> dict:
    """Each arm's prefill tokens/s over the same prompts (an untimed pass first) and the largest
    logit difference between the arms."""
    prompts = prompts_for(num_prompts, runner.vocab_size, 11, length=length)
    out: dict = {"prompts": num_prompts, "prompt_len": length}
    logits = {}
    for arm in ARMS:
        set_arm(runner, arm)
        timed_prefill(runner, prompts)
        seconds, logits[arm] = timed_prefill(runner, prompts)
        out[arm] = {"seconds": seconds, "tokens_per_s": num_prompts * length / seconds}
    out["kernels_vs_torch"] = out["kernels"]["tokens_per_s"] / out["torch"]["tokens_per_s"]
    out["logit_max_abs_diff"] = (logits["kernels"].float()
                                 - logits["torch"].float()).abs().max().item()
    return out


def roofline_s(runner: PagedRunner, batch: int, *, context: float, bw: float) -> float:
    """Seconds of a decode step at the bytes roofline (see the module docstring); `context`:
    the mean KV length over the timed steps."""
    spec = runner.spec
    table = 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size * 2
    weights = runner.model.nbytes() - table
    kv = batch * (context + 1) * runner.kv_bytes_per_token
    states = 2 * batch * runner.state_bytes_per_slot
    return (weights + kv + states) / bw


def decode_rows(runner: PagedRunner, batch: int, *, prompt_len: int, steps: int,
                bw: float | None) -> dict:
    """B requests prefilled (kernels) then each arm's decode steps; the requests removed."""
    prompts = prompts_for(batch, runner.vocab_size, 100 + batch, length=prompt_len)
    rids = [f"d{i}" for i in range(batch)]
    set_arm(runner, "kernels")
    per_call = max(1, PREFILL_CHUNK // prompt_len)
    first = []
    for i in range(0, batch, per_call):
        part = list(zip(rids[i:i + per_call], prompts[i:i + per_call]))
        logits = runner.prefill([(r, p, 0) for r, p in part], want=[True] * len(part))
        first += logits.argmax(-1).tolist()
    out: dict = {"batch": batch, "prompt_len": prompt_len, "steps": steps,
                 "state_bytes_per_slot": runner.state_bytes_per_slot,
                 "kv_bytes_per_token": runner.kv_bytes_per_token}
    tokens = first
    for arm in ARMS:
        set_arm(runner, arm)
        start = runner.table.entries[rids[0]].length
        tokens = decode_steps(runner, rids, tokens, WARM_STEPS, seed=batch)["tokens"]
        timed = decode_steps(runner, rids, tokens, steps, seed=batch + 1)
        tokens = timed["tokens"]
        gpu_ms = timed["gpu_s"] * 1e3 / steps if timed["gpu_s"] is not None else None
        roof = (roofline_s(runner, batch, context=start + WARM_STEPS + (steps - 1) / 2, bw=bw)
                * 1e3 if bw is not None else None)
        out[arm] = {"tokens_per_s": batch * steps / timed["wall_s"],
                    "ms_per_step": timed["wall_s"] * 1e3 / steps, "gpu_ms_per_step": gpu_ms,
                    "roofline_ms_per_step": roof,
                    "roofline_fraction": roof / gpu_ms if roof and gpu_ms else None}
    out["kernels_vs_torch"] = out["kernels"]["tokens_per_s"] / out["torch"]["tokens_per_s"]
    for rid in rids:
        runner.remove(rid)
    return out


def run(*, device: str, quick: bool, batches: list[int]) -> dict:
    from rltool.data.models import init_model

    preset = QUICK["preset"] if quick else PRESET
    batches = QUICK["batches"] if quick else batches
    n_pre, len_pre = ((QUICK["prefill_prompts"], QUICK["prefill_len"]) if quick
                      else (PREFILL_PROMPTS, PREFILL_LEN))
    prompt_len = QUICK["decode_prompt"] if quick else DECODE_PROMPT
    steps = QUICK["steps"] if quick else DECODE_STEPS
    dtype = "fp32" if quick else "bf16"
    bw = copy_bandwidth() if device == "cuda" else None
    harness.progress(f"engine_hybrid: {preset} checkpoint")
    model_dir = init_model(Path(tempfile.mkdtemp()) / preset, arch="qwen3_5", preset=preset,
                           dtype=dtype, device=device)
    page = 16
    max_running = max(max(batches), n_pre)
    tokens = max(max(batches) * (prompt_len + 2 * (WARM_STEPS + steps)), n_pre * len_pre)
    runner = PagedRunner(model_dir, device=device, dtype=dtype, max_running=max_running,
                         page_size=page, max_total_tokens=tokens + max_running * page,
                         prefix_cache=False, mamba_ssm_dtype="fp32")
    try:
        harness.progress(f"engine_hybrid: prefill {n_pre} x {len_pre} tokens")
        prefill = prefill_rows(runner, num_prompts=n_pre, length=len_pre)
        decode = []
        for b in batches:
            harness.progress(f"engine_hybrid: decode B={b}")
            decode.append(decode_rows(runner, b, prompt_len=prompt_len, steps=steps, bw=bw))
        model_bytes = runner.model.nbytes()
    finally:
        runner.release()
    harness.print_table(
        ["phase", "B", "arm", "tok/s", "ms/step", "GPU ms/step", "roofline ms", "fraction",
         "kernels/torch"],
        [("prefill", n_pre, arm, prefill[arm]["tokens_per_s"], prefill[arm]["seconds"] * 1e3,
          None, None, None, prefill["kernels_vs_torch"]) for arm in ARMS]
        + [("decode", r["batch"], arm, r[arm]["tokens_per_s"], r[arm]["ms_per_step"],
            r[arm]["gpu_ms_per_step"], r[arm]["roofline_ms_per_step"],
            r[arm]["roofline_fraction"], r["kernels_vs_torch"])
           for r in decode for arm in ARMS])
    return {"preset": preset, "dtype": dtype, "quick": quick, "weight_bytes": model_bytes,
            "copy_bandwidth_bytes_per_s": bw, "prefill": prefill, "decode": decode}


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    record = harness.Run("engine_hybrid", device=args.device)
    fields = run(device=args.device, quick=args.quick, batches=args.batches)
    return record.finish(fields, out=args.out)


if __name__ == "__main__":
    main()
