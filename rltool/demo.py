"""`make demo`: what runs end to end on a CPU so far.

Builds a fresh run directory `demo-run/` with the initial weights (a tiny random-init qwen2 model
and its tokenizer) and a `reverse` prompt set, generates one answer with the untrained model and
scores it with the task reward. The full RL loop demo replaces this body once `rltool loop` exists.

Run: `python -m rltool.demo [DIR]` (default `demo-run`).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from rltool.errors import BadInputError, RltoolError

MARKER = ".rltool-demo"  # only a directory carrying this marker is ever deleted by the demo


def run(root: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rltool import atomic
    from rltool.data.models import init_model
    from rltool.data.tasks import make_rows, write_prompts
    from rltool.rollout.rewards import resolve_reward
    from rltool.rundir import RunDir

    if root.exists():
        if not (root / MARKER).exists():
            raise BadInputError(f"{root} exists and is not a demo directory; pass another DIR")
        shutil.rmtree(root)
    run_dir = RunDir(root).create()
    atomic.write_text(root / MARKER, "made by `python -m rltool.demo`; safe to delete\n")

    t0 = time.perf_counter()
    weights = init_model(run_dir.weight_version(0), arch="qwen2", preset="tiny", task="reverse")
    prompts = write_prompts(make_rows("reverse", num=64, seed=0), root / "prompts.jsonl")
    print(f"[{time.perf_counter() - t0:5.1f}s] initial weights  {weights}")
    print(f"[{time.perf_counter() - t0:5.1f}s] prompts          {prompts} (64 `reverse` prompts)")

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(weights))
    model = AutoModelForCausalLM.from_pretrained(str(weights))
    row = make_rows("reverse", num=1, seed=0)[0]
    text = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=True, temperature=1.0,
                         pad_token_id=tok.pad_token_id)
    response = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    reward = resolve_reward("reverse:partial")(row["prompt"], response, row["label"], {})
    print(f"[{time.perf_counter() - t0:5.1f}s] untrained sample {row['prompt']!r} -> {response!r} "
          f"(label {row['label']!r}, reward {reward.reward:.2f})")
    print("\nThe model is random, so the answer is noise; RL training is what will fix that.")
    print(f"Next: serve {weights}, roll out and train one step by hand (README.md, \"A step by "
          "hand\").")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    try:
        run(Path(args[0] if args else "demo-run"))
    except RltoolError as e:
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
