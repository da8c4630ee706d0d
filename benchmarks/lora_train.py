"""LoRA on the torch backend against full fine-tuning and against PEFT, in the same run.

1. Learning rate: a random-init model of --preset learns to reproduce --num-samples fixed token
   sequences (cross-entropy on their last half) for --steps full-batch AdamW steps, full
   fine-tuning and LoRA (rank --rank on every attention and MLP linear, alpha 2 x rank) each at
   three learning rates; the table gives the mean loss over the last five steps.
2. Cost: one optimizer step (forward + backward + AdamW over the same micro-batches), median of
   --repeats, and the trainer's parameters that train and their AdamW state, full vs LoRA.
3. The adapters against PEFT: forward + backward of the HF model with rltool's LoRA hooks
   (rltool.train.lora) and of the same model wrapped by `peft.get_peft_model` with the same
   adapter values, median of --repeats, and the largest |logit difference|.

--device cuda runs under --dtype bf16 autocast (the backend's fp32 parameters); cpu in fp32.

Usage: python -m benchmarks.lora_train [--preset small] [--device cpu] [--steps 40]
       [--rank 16] [--repeats 5] [--out DIR_OR_FILE.json]
Prints the tables and, last, one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from rltool.data.models import init_model
from rltool.train import lora
from rltool.train.config import LORA_DEFAULT_TARGETS, BackendConfig
from rltool.train.torch_backend import TorchBackend

from benchmarks import harness
from benchmarks.workloads import make_samples, micro_batches

FULL_LRS = (1e-5, 1e-4, 1e-3)
LORA_LRS = (1e-4, 1e-3, 1e-2)


def _backend(model_dir: Path, args: argparse.Namespace, *, lr: float, rank: int) -> TorchBackend:
    options = BackendConfig(device=args.device, lr=lr, lora_rank=rank, micro_batch_layout="padded",
                            dtype="bf16" if args.device == "cuda" else "fp32")
    return TorchBackend(model_dir, options=options)


def _loss_fn(num_tokens: int):
    def loss_fn(out, mb):
        loss = -sum(lp.sum() for lp in out.logprobs) / num_tokens
        return loss, {"train/loss": loss.detach()}
    return loss_fn


def learning_rates(model_dir: Path, args: argparse.Namespace, samples, mbs) -> list[dict]:
    num_tokens = sum(len(s) - len(s) // 2 for s in samples)
    rows = []
    for mode, lrs in (("full", FULL_LRS), ("lora", LORA_LRS)):
        for lr in lrs:
            backend = _backend(model_dir, args, lr=lr, rank=args.rank if mode == "lora" else 0)
            losses = [backend.train_step(mbs, _loss_fn(num_tokens), temperature=1.0)["train/loss"]
                      for _ in range(args.steps)]
            rows.append({"mode": mode, "lr": lr, "first_loss": losses[0],
                         "last5_loss": statistics.mean(losses[-5:])})
            harness.progress(f"{mode} lr {lr:g}: {rows[-1]['last5_loss']:.4f}")
    return rows


def step_cost(model_dir: Path, args: argparse.Namespace, samples, mbs) -> list[dict]:
    num_tokens = sum(len(s) - len(s) // 2 for s in samples)
    rows = []
    for mode in ("full", "lora"):
        backend = _backend(model_dir, args, lr=1e-4, rank=args.rank if mode == "lora" else 0)
        step_s = harness.median_s(lambda: backend.train_step(mbs, _loss_fn(num_tokens),
                                                             temperature=1.0),
                                  repeats=args.repeats, device=backend.device)
        trained = [p for p in backend.inner.parameters() if p.requires_grad]
        state = sum(t.numel() * t.element_size() for s in backend.optimizer.state.values()
                    for t in s.values() if t.dim() > 0)
        rows.append({"mode": mode, "step_ms": step_s * 1e3,
                     "trained_params": sum(p.numel() for p in trained),
                     "optimizer_state_mb": state / 1e6})
    return rows


def against_peft(model_dir: Path, args: argparse.Namespace, samples) -> dict:
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    ids = torch.tensor([s[:min(map(len, samples))] for s in samples[:8]], device=device)
    ours = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    adapters = lora.LoRA(ours, rank=args.rank, alpha=2.0 * args.rank, dropout=0.0,
                         targets=list(LORA_DEFAULT_TARGETS), seed=0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(".lora_B.weight"):
                p.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                           target_modules=list(LORA_DEFAULT_TARGETS)))
    set_peft_model_state_dict(peft, lora.peft_tensors(ours.state_dict()))
    out: dict = {"adapted_modules": len(adapters.paths)}
    logits = {}
    for name, model in (("rltool", ours.to(device)), ("peft", peft.to(device))):
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

        def step():
            model.zero_grad(set_to_none=True)
            with autocast:
                result = model(input_ids=ids, use_cache=False).logits
            result.float().sum().backward()
            return result.detach().float()

        times, logits[name] = harness.timed(step, repeats=args.repeats, device=device)
        out[f"fwd_bwd_ms_{name}"] = statistics.median(times) * 1e3
    out["ratio_rltool_over_peft"] = out["fwd_bwd_ms_rltool"] / out["fwd_bwd_ms_peft"]
    out["max_abs_logit_diff"] = float((logits["rltool"] - logits["peft"]).abs().max())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    run = harness.Run("lora_train", device=args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_model(Path(tmp) / args.preset, preset=args.preset, seed=0)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        samples = make_samples(vocab, num=args.num_samples, lengths=(32, 96), seed=0)
        mbs = micro_batches(samples, cap=4096, response_starts=[len(s) // 2 for s in samples])
        lrs = learning_rates(model_dir, args, samples, mbs)
        cost = step_cost(model_dir, args, samples, mbs)
        peft = against_peft(model_dir, args, samples)
    harness.print_table(["mode", "lr", "first loss", "mean loss, last 5 steps"],
                        [[r["mode"], r["lr"], r["first_loss"], r["last5_loss"]] for r in lrs])
    print()
    harness.print_table(["mode", "step ms", "trained params", "AdamW state MB"],
                        [[r["mode"], r["step_ms"], r["trained_params"], r["optimizer_state_mb"]]
                         for r in cost])
    print()
    harness.print_table(["fwd+bwd ms rltool", "fwd+bwd ms peft", "ratio", "max |logit diff|"],
                        [[peft["fwd_bwd_ms_rltool"], peft["fwd_bwd_ms_peft"],
                          peft["ratio_rltool_over_peft"], peft["max_abs_logit_diff"]]])
    run.finish({"preset": args.preset, "steps": args.steps, "rank": args.rank,
                "num_samples": args.num_samples, "repeats": args.repeats,
                "learning_rates": lrs, "step_cost": cost, "against_peft": peft}, out=args.out)


if __name__ == "__main__":
    main()
