"""`make demo` (python -m rltool.demo): a shortened run learns, and the demo only ever deletes its
own directory."""

from __future__ import annotations

import json

import pytest

from rltool import demo
from rltool.errors import BadInputError


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_shortened_demo_learns_for_every_seed(tmp_path, capsys, seed):
    """The warm start, then at most 20 RL steps, seeds 0-4 (model init, trainers and the engine's
    sampling): the first RL step's reward is still low (<= 0.45) and each seed either reaches the
    demo's target or raises its reward, as the mean of its last 3 steps, by at least 0.2 (the
    full demo reaches a 5-step mean of 0.8 at steps 18-42 for seeds 0-4; at step 20 the rise
    is 0.30-0.46 where the target is not reached yet)."""
    root = tmp_path / "demo-run"
    demo.main([str(root), "--steps", "20", "--seed", str(seed), "--json"])
    out = capsys.readouterr().out
    assert "rltool loop" in out and "reward vs step" in out
    summary = json.loads((root / "summary.json").read_text())
    rewards = summary["rewards"]
    assert summary["sft_steps"] >= 60 and summary["seed"] == seed
    assert rewards[0] <= 0.45, "the warm start must leave the RL prompts at a low reward"
    assert (summary["first_step_mean5_reaching_target"] is not None
            or sum(rewards[-3:]) / 3 >= rewards[0] + 0.2), rewards
    png = (root / "run" / "report" / "reward.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    if seed == demo.SEED:
        # Prompts are disjoint: no SFT string appears among the RL or eval prompts.
        labels = {f: {json.loads(l)["label"] for l in (root / f).read_text().splitlines()}
                  for f in ("rl.jsonl", "eval.jsonl", "sft.jsonl")}
        assert not labels["sft.jsonl"] & (labels["rl.jsonl"] | labels["eval.jsonl"])


def test_demo_refuses_a_foreign_directory(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    with pytest.raises(SystemExit) as e:
        demo.main([str(tmp_path / "mine")])
    assert e.value.code == 2 and "not a demo directory" in capsys.readouterr().err
    assert (tmp_path / "mine" / "keep.txt").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("task", "precision"), [("add", "bf16"), ("reverse", "fp8")])
def test_gpu_recipes_run_on_cpu(tmp_path, capsys, task, precision):
    """The GPU demo's recipes (`--device cuda` defaults to reverse) with the tiny shapes, two RL
    steps: the model's vocabulary is the tokenizer's, the SFT prompts are disjoint from the RL
    and eval prompts, every step prints its phase times, and the summary JSON carries the phase
    means, the eval reward and where it was measured. With FP8 rollouts the engine serves
    block-FP8 weights from every sync and the trainer applies TIS."""
    root, out = tmp_path / "demo-run", tmp_path / "result.json"
    demo.main([str(root), "--task", task, "--preset", "tiny", "--steps", "2", "--sft-steps",
               "2", "--rollout-batch-size", "4", "--eval-prompts", "8",
               "--sft-prompts", "64", "--rollout-precision", precision, "--out-json", str(out),
               "-q"])
    printed = capsys.readouterr().out
    assert "rollout    train  publish     sync     eval" in printed
    assert "rltool report" in printed and "perf/loop/rollout_time" in printed
    summary = json.loads(out.read_text())
    assert summary == json.loads((root / "summary.json").read_text())
    assert summary["task"] == task and summary["device"] == "cpu" and summary["rl_steps"] == 2
    assert summary["sft_steps"] == 2 and summary["final_eval_reward"] is not None
    # one warm-start call: its checkpoint and weights
    assert [d.name for d in (root / "sft" / "ckpt").iterdir()] == ["step-000002"]
    assert [d.name for d in (root / "sft" / "weights").iterdir()] == ["weight_v000002"]
    assert summary["phase_means"]["perf/loop/rollout_time"] > 0
    assert summary["rollout_precision"] == precision
    mismatch = summary["mismatch_means"]
    assert mismatch["train/train_rollout_logprob_abs_diff"] > 0
    assert ("train/tis_clipfrac" in mismatch) == (precision == "fp8")
    rows = [json.loads(line) for line in
            (root / "run" / "metrics" / "loop.jsonl").read_text().splitlines()]
    assert ({r["sync/precision"] for r in rows} == {"fp8"}) == (precision == "fp8")
    prompts = {f: {json.loads(line)["prompt"] for line in (root / f).read_text().splitlines()}
               for f in ("rl.jsonl", "eval.jsonl", "sft.jsonl")}
    assert not prompts["sft.jsonl"] & (prompts["rl.jsonl"] | prompts["eval.jsonl"])
    if task == "reverse":  # 8-12 digit strings
        assert {len(p.split()[-1]) for p in prompts["rl.jsonl"]} <= set(range(8, 13))
    from transformers import AutoTokenizer

    config = json.loads((root / "model" / "config.json").read_text())
    assert config["vocab_size"] == len(AutoTokenizer.from_pretrained(str(root / "model")))


def test_copy_demo_refuses_fp8_rollouts(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main([str(tmp_path / "d"), "--rollout-precision", "fp8"])
    assert e.value.code == 2 and "--task copy is the CPU demo" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_copy_demo_refuses_the_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main([str(tmp_path / "d"), "--device", "cuda", "--task", "copy"])
    assert e.value.code == 2 and "--task copy is the CPU demo" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_noisy_demonstrator_is_right_as_often_as_asked_at_every_length():
    """The GPU recipes' warm-start labels: each stays whole with probability teacher_exact
    whatever its length, a changed digit is always another digit, non-digits and lengths are
    kept, and the prompts are untouched."""
    from rltool.data.tasks import make_rows
    from rltool.demo_gpu import noisy_demonstrations

    rows = make_rows("reverse", num=20000, seed=2, min_len=2, max_len=12)
    noisy = noisy_demonstrations(rows, teacher_exact=0.25, seed=2)
    assert [r["prompt"] for r in noisy] == [r["prompt"] for r in rows]
    for short in (False, True):  # 2-6 digits and 8-12 digits: the same chance of a whole label
        pairs = [(r["label"], n["label"]) for r, n in zip(rows, noisy)
                 if (len(r["label"]) <= 6) == short]
        whole = sum(a == b for a, b in pairs) / len(pairs)
        assert abs(whole - 0.25) < 0.02, (short, whole)
    assert all(len(a) == len(b) and b.isdigit() for a, b in
               ((r["label"], n["label"]) for r, n in zip(rows, noisy)))
    add = make_rows("add", num=50, seed=2)
    assert noisy_demonstrations(add, teacher_exact=1.0, seed=2) == add
    with pytest.raises(BadInputError, match="--teacher-exact"):
        noisy_demonstrations(add, teacher_exact=0.0, seed=2)


def test_gpu_demo_without_a_gpu_exits_2_before_writing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        demo.main([str(tmp_path / "d"), "--device", "cuda", "--arch", "qwen3_5"])
    assert e.value.code == 2 and "torch sees no CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_gpu_recipe_refuses_a_bad_learning_rate_before_writing(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main([str(tmp_path / "d"), "--task", "reverse", "--preset", "tiny", "--rl-lr", "0"])
    assert e.value.code != 0 and "--rl-lr must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_hybrid_recipe_runs_on_cpu(tmp_path, capsys):
    """`--arch qwen3_5` on CPU: the reversal recipe on the tiny-4l hybrid (3 Gated DeltaNet
    layers, 1 attention layer), two RL steps with bf16 recurrent states in the engine; the
    summary records the arch, preset and state dtype, and the loop's engine got the flag."""
    root, out = tmp_path / "demo-run", tmp_path / "result.json"
    demo.main([str(root), "--task", "reverse", "--arch", "qwen3_5", "--mamba-ssm-dtype", "bf16",
               "--steps", "2", "--sft-steps", "2", "--rollout-batch-size", "2",
               "--n-samples-per-prompt", "4", "--eval-prompts", "4", "--sft-prompts", "32",
               "--out-json", str(out), "-q"])
    assert "rltool init-model --arch qwen3_5 --preset tiny-4l" in capsys.readouterr().out
    summary = json.loads(out.read_text())
    assert (summary["arch"], summary["preset"], summary["mamba_ssm_dtype"]) == (
        "qwen3_5", "tiny-4l", "bf16")
    assert summary["rl_steps"] == 2 and summary["final_eval_reward"] is not None
    config = json.loads((root / "model" / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    import tomllib

    engine_args = tomllib.loads((root / "run.toml").read_text())["loop"]["engine_args"]
    assert engine_args[engine_args.index("--mamba-ssm-dtype") + 1] == "bf16"
    # engine (bf16 states) and trainer (fp32) sample the same policy: a small, nonzero gap
    assert 0 < summary["mismatch_means"]["train/train_rollout_logprob_abs_diff"] < 0.05


def test_hybrid_recipe_choices_and_refusals(tmp_path, capsys):
    """The hybrid's recipe is the dense one on hybrid-0.7b with fp32 recurrent states; the copy
    demo (tuned to the tiny qwen2) refuses --arch qwen3_5, --mamba-ssm-dtype without the hybrid
    is refused, and so is LoRA on the hybrid (the engine serves no adapter on it), each before
    anything is written."""
    from dataclasses import replace

    from rltool.demo_gpu import RECIPES, recipe_for

    hybrid = recipe_for("qwen3_5")
    assert (hybrid.arch, hybrid.preset, hybrid.mamba_ssm_dtype) == (
        "qwen3_5", "hybrid-0.7b", "fp32")
    assert replace(hybrid, arch="qwen2", preset="qwen2.5-0.5b", mamba_ssm_dtype=None) \
        == RECIPES["qwen2"]
    assert recipe_for("qwen3_5", rl_lr=1e-4, preset=None).rl_lr == 1e-4
    with pytest.raises(BadInputError, match="unknown --arch 'llama'"):
        recipe_for("llama")
    for argv, message in (
            (["--arch", "qwen3_5"], "--task copy is the CPU demo (tiny qwen2 model"),
            (["--task", "reverse", "--mamba-ssm-dtype", "bf16"],
             "--mamba-ssm-dtype (fp32 or bf16) is the hybrid's recurrent state"),
            (["--task", "reverse", "--arch", "qwen3_5", "--lora-rank", "8"],
             "the engine serves no LoRA adapter on a hybrid")):
        with pytest.raises(SystemExit) as e:
            demo.main([str(tmp_path / "d"), *argv])
        assert e.value.code == 2 and message in capsys.readouterr().err
        assert not (tmp_path / "d").exists()
