"""Your own dataset, end to end: write a small math prompt set in verl's layout (a chat `prompt`
list, the answer under `reward_model.ground_truth`), then run one RL step on it with the
`rltool` commands: serve a tiny model, roll out with the `math` reward, train and publish.

    python examples/math_dataset.py --out runs/math [--model YOUR_HF_CHECKPOINT]

Each command is printed before it runs; the flags that read the dataset are slime's
`--input-key`, `--label-key` and `--metadata-key` (dotted keys reach nested fields). The model is
a tiny random-init one unless `--model` names a checkpoint, so few samples earn a reward: the
point is the plumbing, not the score. A real run points `--model` at its own checkpoint and
`--prompts` at its own file (JSONL, Parquet, or a directory saved by HF `datasets`).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

RLTOOL = [sys.executable, "-m", "rltool"]


def write_dataset(path: Path, *, num: int, seed: int) -> Path:
    """verl-style rows: one-digit sums (`what is 3+4?`, ground truth "7"), as Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    rows = []
    for i in range(num):
        a, b = rng.randrange(10), rng.randrange(10)
        rows.append({"data_source": "arith", "ability": "math",
                     "prompt": [{"role": "user", "content": f"what is {a}+{b}?"}],
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"index": i, "a": a, "b": b}})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def rltool(*args: str) -> None:
    print("+ rltool " + " ".join(shlex.quote(a) for a in args), flush=True)
    subprocess.run([*RLTOOL, *args], check=True)


def start_engine(model: Path, ready_file: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    args = ["serve", "--model", str(model), "--port", "0", "--ready-file", str(ready_file)]
    print("+ rltool " + " ".join(args) + " &", flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*RLTOOL, *args], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not ready_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"rltool serve did not become ready; see {log_path}")
        time.sleep(0.5)
    return proc, json.loads(ready_file.read_text())["url"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="new directory for the run")
    parser.add_argument("--model", type=Path, help="HF checkpoint to start from (default: a "
                        "tiny random-init qwen2 made with `rltool init-model`)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.out.exists():
        sys.exit(f"--out {args.out} already exists; choose a new directory")
    args.out.mkdir(parents=True)
    model = args.model
    if model is None:
        model = args.out / "weights" / "weight_v000000"
        rltool("init-model", "--arch", "qwen2", "--preset", "tiny", "--task", "add",
               "--out", str(model))
    data = write_dataset(args.out / "math.parquet", num=args.num_prompts, seed=args.seed)
    print(f"wrote {args.num_prompts} prompts to {data}", flush=True)
    engine, url = start_engine(model, args.out / "engine.json", args.out / "engine.log")
    try:
        rltool("rollout", "--engines", url, "--prompts", str(data),
               "--input-key", "prompt", "--label-key", "reward_model.ground_truth",
               "--metadata-key", "extra_info", "--apply-chat-template",
               "--reward", "math", "--n-samples-per-prompt", "8", "--rollout-batch-size", "4",
               "--max-response-len", "4", "--seed", str(args.seed),
               "--out", str(args.out / "rollouts" / "step-000000"))
    finally:
        engine.terminate()
        engine.wait(timeout=60)
    rltool("train", "--rollouts", str(args.out / "rollouts" / "step-000000"),
           "--load", str(model), "--save", str(args.out / "train" / "ckpt"),
           "--publish", str(args.out / "weights"), "--global-batch-size", "32")
    newest = max((args.out / "weights").glob("weight_v*"))
    print(f"done: the policy trained on {data} is {newest}", flush=True)


if __name__ == "__main__":
    main()
