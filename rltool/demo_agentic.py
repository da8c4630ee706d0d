"""The agentic demo (`python -m rltool.demo_agentic --device cuda`): multi-turn GRPO that teaches a
random-init model to multiply 3-6 digit numbers with the `calculator` environment's tool.

The model cannot multiply; it can copy. An episode: the user asks `multiply A by B`; a turn that
ends with `<calc>EXPR</calc>` is a tool call (the engine stops on `</calc>`, the environment
answers with EXPR's value in a `tool` message); a turn without a call is the final answer,
reward 1 when its number is A*B (exact match), else 0.

1. a random-init model (`rltool init-model`; the Qwen2.5-0.5B shapes on cuda, `tiny` on cpu) with
   the task tokenizer's vocabulary;
2. prompt sets: RL prompts, held-out eval prompts, and warm-start prompts none of which is an RL
   or eval prompt;
3. a supervised warm start on whole episodes of a noisy demonstrator, written as a rollout shard
   (schema 1.2: the tool's tokens masked out of the loss, exactly as the rollout renders them):
   the demonstrator calls the tool on a fraction `--call-rate` of the prompts, copying both
   operands whole with probability `--call-exact` (each digit otherwise replaced), then answers
   with the tool's value; on the other prompts it answers a made-up number of the product's
   length. A policy that has learnt it seldom calls the tool correctly;
4. `rltool loop` with `[rollout] env = "calculator"` and turn-level GRPO (`turn_grpo`), colocated
   (engine and trainer in one process), until the held-out exact match reaches 0.8 or the time
   budget (`--time-budget-s`) is spent. Every step prints its reward, eval exact match and tool
   call rate (the share of episodes with a tool call); the summary JSON (DIR/summary.json,
   `--out-json`) holds the same table, and `rltool report` plots the run (DIR/run/report).

`--device cpu` runs the same recipe with the tiny shapes and 1-2 digit operands (docs/agentic.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rltool.demo_common import TARGET, Clock, device_name, finish, fresh, summarize, window_mean
from rltool.errors import BadInputError, RltoolError

ENV = "calculator"
OPEN, CLOSE = "<calc>", "</calc>"


@dataclass(frozen=True)
class AgenticRecipe:
    """The demo's settings; `GPU` and `CPU` below are the defaults of `--device cuda|cpu`."""

    preset: str
    min_digits: int  # digits of each operand
    max_digits: int
    sft_steps: int
    sft_batch: int
    sft_lr: float
    rl_lr: float
    rl_global_batch: int  # samples per optimizer step
    rollout_batch_size: int = 64  # prompts per RL step
    n_samples_per_prompt: int = 8
    eval_prompts: int = 256
    sft_prompts: int = 20000
    call_rate: float = 0.3  # how often the demonstrator calls the tool
    call_exact: float = 0.5  # how often a call copies both operands whole
    max_turns: int = 3
    max_tokens_per_turn: int = 32  # `<calc>` + 6 + `*` + 6 digits + `</calc>` is 26 tokens
    max_response_len: int = 112  # two turns and the tool message between them
    eval_interval: int = 5
    time_budget_s: float = 480.0

    def __post_init__(self) -> None:  # before the demo writes anything
        for flag, value in (("--call-rate", self.call_rate), ("--call-exact", self.call_exact)):
            if not 0.0 <= value <= 1.0:
                raise BadInputError(f"{flag} must be in [0, 1], got {value:g}")
        # one-digit operands make 100 prompts, all of them RL prompts: no warm-start prompt left
        if not (1 <= self.min_digits <= self.max_digits <= 6 and self.max_digits >= 2):
            raise BadInputError(f"--min-digits/--max-digits must satisfy 1 <= min <= max <= 6 "
                                f"and max >= 2, got {self.min_digits} and {self.max_digits}")
        if not self.rl_lr > 0:
            raise BadInputError(f"--rl-lr must be > 0, got {self.rl_lr:g}")


GPU = AgenticRecipe(preset="qwen2.5-0.5b", min_digits=3, max_digits=6, sft_steps=400,
                    sft_batch=256, sft_lr=3e-4, rl_lr=4e-5, rl_global_batch=256)
# The tiny model on a CPU budget (docs/agentic.md has its runs): after 400 warm-start steps it
# learnt to call the tool but not to copy the operands whole (eval 0.125 after 60 RL steps);
# after 1000 it copies now and then, and GRPO takes the eval to 0.8.
CPU = AgenticRecipe(preset="tiny", min_digits=1, max_digits=2, sft_steps=1000, sft_batch=32,
                    sft_lr=3e-3, rl_lr=3e-4, rl_global_batch=64, rollout_batch_size=16,
                    eval_prompts=64, sft_prompts=4096, call_rate=0.5, max_tokens_per_turn=20,
                    max_response_len=72, time_budget_s=3600.0)


def make_rows(num: int, *, seed: int, recipe: AgenticRecipe) -> list[dict[str, Any]]:
    """`num` prompt rows `multiply A by B` (operands of min..max digits), label A*B."""
    rng = random.Random(seed)

    def operand() -> int:
        digits = rng.randint(recipe.min_digits, recipe.max_digits)
        return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1)

    rows = []
    for i in range(num):
        a, b = operand(), operand()
        rows.append({"prompt_id": f"mul-{seed}-{i}", "prompt": f"multiply {a} by {b}",
                     "label": str(a * b), "metadata": {"a": a, "b": b}})
    return rows


def make_data(root: Path, clock: Clock, recipe: AgenticRecipe) -> list[dict[str, Any]]:
    """Write the RL and eval prompt files; returns the warm-start rows (disjoint from both)."""
    from rltool.data.tasks import write_prompts

    rl = make_rows(4096, seed=1, recipe=recipe)
    held_out = make_rows(recipe.eval_prompts, seed=3, recipe=recipe)
    taken = {r["prompt"] for r in rl + held_out}
    sft = [r for r in make_rows(recipe.sft_prompts, seed=2, recipe=recipe)
           if r["prompt"] not in taken]
    write_prompts(rl, root / "rl.jsonl")
    write_prompts(held_out, root / "eval.jsonl")
    clock.say(f"multiplication prompts, operands of {recipe.min_digits}-{recipe.max_digits} "
              f"digits: {len(rl)} RL (seed 1), {len(held_out)} eval (seed 3), {len(sft)} "
              "warm-start (seed 2) none of which is an RL or eval prompt")
    return sft


def demonstrations(rows: list[dict[str, Any]], *, tokenizer: Any, call_rate: float,
                   call_exact: float, seed: int) -> list[dict[str, Any]]:
    """Shard rows of the noisy demonstrator's episodes (module docstring, step 3), tokenized as
    rltool.rollout.episode renders an episode: model tokens loss mask 1, the tool message (and
    the turn's closing) loss mask 0, a reward per turn."""
    from rltool.data.shards import make_row
    from rltool.demo_gpu import noisy_demonstrations
    from rltool.env.arith import evaluate
    from rltool.env.builtins import answer_reward
    from rltool.rollout.episode import ChatRenderer

    renderer = ChatRenderer(tokenizer)
    eos = tokenizer.eos_token_id
    rng = random.Random(seed)
    out = []
    for i, row in enumerate(rows):
        a, b, label = row["metadata"]["a"], row["metadata"]["b"], row["label"]
        prompt_ids = renderer.prompt_ids([{"role": "user", "content": row["prompt"]}])
        if rng.random() < call_rate:
            (noisy,) = noisy_demonstrations([{"label": f"{a}*{b}"}], teacher_exact=call_exact,
                                            seed=rng.randrange(1 << 30))
            # a digit replaced by a leading 0 is dropped: Python's syntax, hence the tool's,
            # refuses `012`
            expr = "*".join(str(int(x)) for x in noisy["label"].split("*"))
            call, value = f"{OPEN}{expr}{CLOSE}", evaluate(expr)
            observation = renderer.observation_ids(call, [{"role": "tool", "content": value}])
            turns = [renderer.encode(call), renderer.encode(value) + [eos]]
            answer = value
        else:
            answer = str(rng.randint(10 ** (len(label) - 1), 10 ** len(label) - 1))
            turns, observation = [renderer.encode(answer) + [eos]], []
        response = turns[0] + observation + (turns[1] if len(turns) > 1 else [])
        mask = [1] * len(turns[0]) + [0] * len(observation) + [1] * (len(response) - len(
            turns[0]) - len(observation))
        reward = answer_reward(answer, label)
        starts = [0] if len(turns) == 1 else [0, len(turns[0]) + len(observation)]
        out.append(make_row(
            uid=f"demo-{i}", prompt_id=row["prompt_id"], group_id=i, sample_index=0,
            prompt=row["prompt"], prompt_token_ids=prompt_ids,
            response=tokenizer.decode(response), response_token_ids=response,
            rollout_logprobs=[0.0] * len(response), loss_mask=mask,
            weight_versions=[-1 if m == 0 else 0 for m in mask], reward=reward,
            rewards={"env_turns": float(len(turns))}, status="completed",
            finish_reason="stop", label=label, metadata={"demonstration": True},
            turn_rewards=[0.0] * (len(turns) - 1) + [reward], turn_starts=starts))
    return out


def warm_start(root: Path, model: Path, rows: list[dict[str, Any]], *, seed: int, device: str,
               recipe: AgenticRecipe, clock: Clock) -> Path:
    """The demonstrations as a shard, `recipe.sft_steps` SFT steps on it; returns the weights."""
    from transformers import AutoTokenizer

    from rltool.data.shards import ShardMeta, write_shard
    from rltool.data.tokenizer import tokenizer_hash
    from rltool.train import run as run_train
    from rltool.train.config import TrainConfig

    demos = demonstrations(rows, tokenizer=AutoTokenizer.from_pretrained(str(model)),
                           call_rate=recipe.call_rate, call_exact=recipe.call_exact, seed=seed)
    shard = root / "sft" / "demonstrations"
    write_shard(shard, demos, ShardMeta(tokenizer_hash=tokenizer_hash(model), step=0,
                                        producer="rltool.demo_agentic",
                                        sampling={"temperature": 1.0},
                                        extra={"env": ENV, "max_turns": recipe.max_turns}))
    calls = sum(len(r["turn_starts"]) > 1 for r in demos) / len(demos)
    exact = sum(r["reward"] for r in demos) / len(demos)
    clock.say(f"{len(demos)} demonstrated episodes ({shard}): tool calls in {calls:.2f} of "
              f"them, right answers in {exact:.2f}")
    batch = min(recipe.sft_batch, len(demos))
    result = run_train(TrainConfig(
        loss="sft", rollouts=[str(shard)], load=str(model), save=str(root / "sft" / "ckpt"),
        publish=str(root / "sft" / "weights"), metrics=str(root / "sft" / "train.jsonl"),
        lr=recipe.sft_lr, lr_warmup_steps=min(20, recipe.sft_steps), global_batch_size=batch,
        num_steps=recipe.sft_steps, seed=seed, device=device,
        dtype="bf16" if device == "cuda" else "fp32"))
    losses = [m["train/sft_loss"] for m in result.metrics if "train/sft_loss" in m]
    clock.say(f"rltool train --loss sft --rollouts {shard} --num-steps {recipe.sft_steps} "
              f"--global-batch-size {batch} --lr {recipe.sft_lr:g}: mean token loss of the last "
              f"10 steps {window_mean(losses, 10):.3f}")
    assert result.published is not None
    return Path(result.published)


def loop_tables(root: Path, *, model: Path, steps: int, seed: int, device: str,
                recipe: AgenticRecipe) -> dict[str, Any]:
    """The loop config: calculator episodes, turn-level GRPO, colocated on `device`."""
    rollouts = recipe.rollout_batch_size * recipe.n_samples_per_prompt
    episode = {"env": ENV, "max_turns": recipe.max_turns,
               "max_tokens_per_turn": recipe.max_tokens_per_turn,
               "max_response_len": recipe.max_response_len}
    engine_args = ["--max-running-requests", str(rollouts)]
    if device == "cuda":
        engine_args += ["--cuda-graph-max-bs", str(rollouts), "--max-total-tokens", "131072"]
    return {
        "model": {"path": str(model)},
        "rollout": {"prompts": str(root / "rl.jsonl"), **episode,
                    "n_samples_per_prompt": recipe.n_samples_per_prompt,
                    "rollout_batch_size": recipe.rollout_batch_size, "temperature": 1.0,
                    "seed": seed, "concurrency": rollouts},
        "train": {"lr": recipe.rl_lr, "lr_warmup_steps": 2,
                  "global_batch_size": min(recipe.rl_global_batch, rollouts),
                  "advantage_estimator": "turn_grpo"},
        "sync": {"sync": "auto"},
        "eval": {"prompts": str(root / "eval.jsonl"), "n_samples_per_prompt": 1, **episode},
        "loop": {"num_steps": steps, "placement": "colocated", "num_engines": 1, "seed": seed,
                 "engine": "inprocess", "device": device, "eval_interval": recipe.eval_interval,
                 "save_interval": max(steps, 1), "offload": "none",
                 "engine_args": engine_args},
    }


def tool_use(shard_dir: Path) -> dict[str, float]:
    """Of a step's episodes: the share with a tool call, the share whose first call was A*B
    exactly (the operands copied whole), and the mean number of model turns."""
    from rltool.data.shards import open_shard

    rows = open_shard(shard_dir).rows()
    calls = [r for r in rows if r["turn_starts"] and len(r["turn_starts"]) > 1]
    right = 0
    for r in calls:
        meta = json.loads(r["metadata"])
        first = r["response"][:r["response"].find(CLOSE)]
        a, b = meta.get("a"), meta.get("b")
        right += first.endswith(f"{OPEN}{a}*{b}") or first.endswith(f"{OPEN}{b}*{a}")
    n = max(len(rows), 1)
    return {"tool_call_rate": len(calls) / n, "right_call_rate": right / n,
            "turns": sum(len(r["turn_starts"] or [1]) for r in rows) / n}


HEADER = (f"  {'step':>4s}  {'reward':>6s}  {'eval':>6s}  {'calls':>6s}  {'right':>6s}  "
          f"{'turns':>5s}  {'time_s':>6s}")


def _cell(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def run(root: Path, *, steps: int, seed: int, device: str,
        recipe: AgenticRecipe) -> dict[str, Any]:
    """The whole demo (module docstring); returns the summary written to DIR/summary.json."""
    import tomli_w

    from rltool import atomic
    from rltool.data.models import init_model
    from rltool.loop import runner
    from rltool.loop.config import LoopSettings
    from rltool.rundir import RunDir

    fresh(root)
    clock = Clock()
    model = init_model(root / "model", arch="qwen2", preset=recipe.preset, seed=seed,
                       fit_vocab=True)
    clock.say(f"rltool init-model --preset {recipe.preset} --seed {seed}: random-init model "
              f"{model}")
    sft_rows = make_data(root, clock, recipe)
    policy = warm_start(root, model, sft_rows, seed=seed, device=device, recipe=recipe,
                        clock=clock)
    tables = loop_tables(root, model=policy, steps=steps, seed=seed, device=device,
                         recipe=recipe)
    atomic.write_text(root / "run.toml", tomli_w.dumps(tables))
    deadline = clock.t0 + recipe.time_budget_s
    clock.say(f"rltool loop --config {root / 'run.toml'} --run-dir {root / 'run'}: at most "
              f"{steps} steps of {recipe.rollout_batch_size} prompts x "
              f"{recipe.n_samples_per_prompt} {ENV} episodes, turn-level GRPO on {device}; stops "
              f"once the eval exact match reaches {TARGET} or at {recipe.time_budget_s:.0f}s")
    print(HEADER)
    table: list[dict[str, Any]] = []
    run_dir = RunDir(root / "run")

    def on_step(row: dict[str, Any]) -> None:
        entry = {"step": row["step"], "reward": row.get("rollout/raw_reward"),
                 "eval_exact": row.get("eval/mean_reward"),
                 "seconds": row["time"] - clock.t0_wall if "time" in row else None,
                 **tool_use(run_dir.rollout_step(row["step"]))}
        table.append(entry)
        print(f"  {entry['step']:>4d}  {_cell(entry['reward'], '.3f'):>6s}  "
              f"{_cell(entry['eval_exact'], '.3f'):>6s}  {entry['tool_call_rate']:>6.3f}  "
              f"{entry['right_call_rate']:>6.3f}  {entry['turns']:>5.2f}  "
              f"{_cell(row.get('perf/loop/step_time'), '.1f'):>6s}", flush=True)

    def stop(rows: list[dict[str, Any]]) -> bool:
        return rows[-1].get("eval/mean_reward", 0.0) >= TARGET or time.perf_counter() > deadline

    runner.start(LoopSettings.from_tables(tables), root / "run", on_step=on_step,
                 stop_when=stop)
    finish(root, clock)
    evals = [r for r in table if r["eval_exact"] is not None]
    hit = next((r for r in evals if r["eval_exact"] >= TARGET), None)
    extra = {"env": ENV, "device": device, "preset": recipe.preset,
             "device_name": device_name(device), "recipe": asdict(recipe),
             "target_eval_exact": TARGET, "eval_step_reaching_target": hit["step"] if hit else None,
             "seconds_to_target": hit["seconds"] if hit else None,  # since the demo began
             "final_eval_exact": evals[-1]["eval_exact"] if evals else None, "steps": table}
    summary = summarize(root, root / "run", sft_steps=recipe.sft_steps, seed=seed,
                        started=clock.t0, task="multiply-with-calculator", extra=extra)
    print(f"\ntool calls {table[0]['tool_call_rate']:.2f} -> {table[-1]['tool_call_rate']:.2f} "
          f"of episodes; eval exact match "
          + (f"reached {TARGET} at step {hit['step']} after {hit['seconds']:.0f}s" if hit
             else f"NOT at {TARGET} (last {extra['final_eval_exact']})")
          + f"; total {summary['total_s']:.0f}s on {extra['device_name']}")
    return summary


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="python -m rltool.demo_agentic",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("dir", nargs="?", default="demo-agentic",
                        help="Demo directory (recreated).")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the 0.5B shapes and 3-6 digit operands; cpu: tiny shapes, "
                        "1-2 digits.")
    parser.add_argument("--steps", type=int, default=200, help="Most RL loop steps.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the model init, the "
                        "demonstrator, the trainers and the engine's sampling.")
    for name in ("preset", "min_digits", "max_digits", "sft_steps", "sft_lr", "rl_lr",
                 "rollout_batch_size", "n_samples_per_prompt", "eval_prompts", "sft_prompts",
                 "call_rate", "call_exact", "time_budget_s"):
        kind = type(getattr(GPU, name))
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                            help=f"Overrides the recipe's {name} (cuda {getattr(GPU, name)}, "
                            f"cpu {getattr(CPU, name)}).")
    parser.add_argument("--out-json", default=None, help="Also write the summary JSON here.")
    parser.add_argument("-q", "--quiet", action="store_true", help="No progress lines.")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from rltool.logs import setup_logging

    setup_logging(verbosity=-1)
    if not args.quiet:
        logging.getLogger("rltool.progress").setLevel(logging.INFO)
    try:
        from rltool.data.models import parse_device

        parse_device(args.device)  # before the demo directory is recreated
        if args.steps < 1:
            raise BadInputError(f"--steps must be >= 1 (RL loop steps), got {args.steps}")
        base = GPU if args.device == "cuda" else CPU
        recipe = replace(base, **{k: v for k, v in vars(args).items()
                                  if k in base.__dataclass_fields__ and v is not None})
        summary = run(Path(args.dir), steps=args.steps, seed=args.seed, device=args.device,
                      recipe=recipe)
    except RltoolError as e:
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    if args.out_json:
        from rltool import atomic

        atomic.write_json(Path(args.out_json), summary)


if __name__ == "__main__":
    main()
