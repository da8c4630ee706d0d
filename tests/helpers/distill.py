"""On-policy distillation runs for tests: a student and a teacher trained further by supervised
steps on the `copy` task, and a small in-process loop (sample from the resident trainer's own
model, write the shard, train on it) that records the reverse KL and reward per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TASK = "copy"
SAMPLING_TEMPERATURE = 1.0


def prompt_rows(num: int, *, seed: int) -> list[dict[str, Any]]:
    from rltool.data.tasks import make_rows

    return make_rows(TASK, num=num, seed=seed, min_len=2, max_len=3)


def sft(model: Path, prompts: Path, out: Path, *, steps: int, seed: int = 0) -> Path:
    """`steps` supervised steps from `model`; returns the published weights directory."""
    from rltool.train.config import TrainConfig
    from rltool.train.stage import run

    result = run(TrainConfig(loss="sft", prompts=str(prompts), load=str(model),
                             save=str(out / "ckpt"), publish=str(out / "weights"),
                             metrics=str(out / "train.jsonl"), lr=3e-3, global_batch_size=32,
                             num_steps=steps, shuffle=True, seed=seed))
    assert result.published is not None
    return Path(result.published)


@torch.no_grad()
def sample_rows(model: Any, tokenizer: Any, rows: list[dict[str, Any]], *, n: int,
                max_new_tokens: int, generator: torch.Generator, step: int) -> list[dict]:
    """n samples per prompt from `model` at temperature 1 (whole vocabulary), as shard rows with
    their rewards (`copy` partial credit) and the sampling logprobs."""
    from rltool.data.shards import make_row
    from rltool.data.tasks import get_task

    task = get_task(TASK)
    model.eval()
    out = []
    for g, row in enumerate(rows):
        prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                    add_generation_prompt=True, tokenize=True,
                                                    return_dict=False))
        ids = torch.tensor([prompt] * n)
        logprobs: list[list[float]] = [[] for _ in range(n)]
        done = torch.zeros(n, dtype=torch.bool)
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()
            dist = torch.log_softmax(logits / SAMPLING_TEMPERATURE, dim=-1)
            nxt = torch.multinomial(dist.exp(), 1, generator=generator).squeeze(1)
            for i in range(n):
                if not done[i]:
                    logprobs[i].append(float(dist[i, nxt[i]]))
            ids = torch.cat([ids, nxt.unsqueeze(1)], dim=1)
            done |= nxt == tokenizer.eos_token_id
            if bool(done.all()):
                break
        for i in range(n):
            response = ids[i, len(prompt):len(prompt) + len(logprobs[i])].tolist()
            text = tokenizer.decode(response, skip_special_tokens=True)
            out.append(make_row(
                uid=f"s{step}-g{g}-{i}", prompt_id=str(row["prompt_id"]), group_id=g,
                sample_index=i, prompt=row["prompt"], prompt_token_ids=prompt, response=text,
                response_token_ids=response, rollout_logprobs=logprobs[i],
                loss_mask=[1] * len(response), weight_versions=[step] * len(response),
                reward=task.partial_reward(text, row["label"]), status="completed",
                finish_reason="stop", label=row["label"], metadata=row.get("metadata", {})))
    return out


@torch.no_grad()
def exact_reverse_kl(student: Any, teacher: Any, tokenizer: Any, rows: list[dict[str, Any]], *,
                     n: int, seed: int) -> float:
    """KL(student || teacher) per response token, exact over the vocabulary in float64, averaged
    over the tokens of n fresh student samples per prompt."""
    samples = sample_rows(student, tokenizer, rows, n=n, max_new_tokens=8,
                          generator=torch.Generator().manual_seed(seed), step=0)
    total, count = 0.0, 0
    for r in samples:
        ids = torch.tensor([r["prompt_token_ids"] + r["response_token_ids"]])
        start = len(r["prompt_token_ids"])
        p, q = (torch.log_softmax(m(input_ids=ids, use_cache=False).logits[0, start - 1:-1]
                                  .double() / SAMPLING_TEMPERATURE, dim=-1)
                for m in (student, teacher))
        total += float((p.exp() * (p - q)).sum())
        count += len(r["response_token_ids"])
    return total / max(count, 1)


def load_model(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(model_dir))


def mean_reward(model_dir: Path, rows: list[dict[str, Any]], *, n: int, seed: int) -> float:
    model, tokenizer = load_model(model_dir)
    samples = sample_rows(model, tokenizer, rows, n=n, max_new_tokens=8,
                          generator=torch.Generator().manual_seed(seed), step=0)
    return sum(r["reward"] for r in samples) / len(samples)


def distill(student: Path, root: Path, rows: list[dict[str, Any]], *, steps: int, seed: int,
            n: int = 4, until: Any = None, **train: Any) -> tuple[list[dict[str, float]], Any]:
    """`steps` rounds of: sample n per prompt from the resident trainer's model, write the
    shard, one optimizer step on it (TrainConfig keys in `train`); stops early once
    `until(history)` is true. Returns one dict per step (reward: mean over the step's samples,
    and the trainer's opd metrics) and the trained model."""
    from transformers import AutoTokenizer

    from rltool.data.shards import ShardMeta, write_shard
    from rltool.data.tokenizer import tokenizer_hash
    from rltool.train.config import TrainConfig
    from rltool.train.resident import ResidentTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(student))
    meta = dict(tokenizer_hash=tokenizer_hash(student), producer="test",
                sampling={"temperature": SAMPLING_TEMPERATURE, "top_p": 1.0, "top_k": -1})
    generator = torch.Generator().manual_seed(seed)
    trainer = None
    history = []
    for step in range(steps):
        shard = root / f"step-{step:06d}"
        cfg = TrainConfig(rollouts=[str(shard)], load=str(student), seed=seed, **train)
        if trainer is None:
            trainer = ResidentTrainer(cfg)
        rows_out = sample_rows(trainer.backend.inner, tokenizer, rows, n=n, max_new_tokens=8,
                               generator=generator, step=step)
        write_shard(shard, rows_out, ShardMeta(step=step, **meta))
        metrics = trainer.train(cfg, loop_step=step, log_metrics=False)[0]
        history.append({"reward": sum(r["reward"] for r in rows_out) / len(rows_out),
                        **{k: v for k, v in metrics.items() if "opd" in k}})
        if until is not None and until(history):
            break
    return history, trainer.backend.inner
