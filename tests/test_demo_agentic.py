"""The agentic demo (python -m rltool.demo_agentic): the demonstrations are episodes as the rollout
renders them, and a shortened CPU run goes through the whole pipeline (episodes with tool calls,
masked tool tokens, rewards, a train step that changes the weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rltool import demo_agentic
from rltool.data.shards import open_shard
from rltool.errors import BadInputError


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from rltool.data.tokenizer import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


def test_demonstrations_are_the_chat_of_the_episode(tokenizer):
    """Prompt + response of each demonstrated episode is the chat template's rendering of the
    conversation (user, assistant call, tool value, assistant answer); exactly the tool message
    is masked; the reward is 1 only for the product, and the demonstrator calls and copies as
    often as asked."""
    rows = demo_agentic.make_rows(2000, seed=5, recipe=demo_agentic.GPU)
    demos = demo_agentic.demonstrations(rows, tokenizer=tokenizer, call_rate=0.3,
                                        call_exact=0.5, seed=7)
    calls = 0
    for row, demo in zip(rows, demos):
        ids = demo["prompt_token_ids"] + demo["response_token_ids"]
        text = tokenizer.decode(demo["response_token_ids"])
        messages = [{"role": "user", "content": row["prompt"]}]
        if len(demo["turn_starts"]) == 2:
            calls += 1
            call, _, rest = text.partition("</calc>")
            value = rest.split("tool\n")[1].split("<|im_end|>")[0]
            expr = call.removeprefix("<calc>")
            a, b = (int(x) for x in expr.split("*"))
            assert value == str(a * b)
            messages += [{"role": "assistant", "content": call + "</calc>"},
                         {"role": "tool", "content": value},
                         {"role": "assistant", "content": value}]
            masked = [t for t, m in zip(demo["response_token_ids"], demo["loss_mask"]) if m == 0]
            assert tokenizer.decode(masked) == (f"<|im_end|>\n<|im_start|>tool\n{value}"
                                                "<|im_end|>\n<|im_start|>assistant\n")
            assert demo["response_token_ids"][demo["turn_starts"][1] - 1] == tokenizer.encode(
                "\n")[0] and demo["loss_mask"][demo["turn_starts"][1]] == 1
            answer = value
        else:
            answer = text.removesuffix("<|im_end|>")
            messages.append({"role": "assistant", "content": answer})
            assert set(demo["loss_mask"]) == {1}
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        assert tokenizer.decode(ids) + "\n" == rendered
        assert demo["reward"] == float(answer == row["label"])
        assert demo["turn_rewards"][-1] == demo["reward"]
    rate = calls / len(rows)
    exact = sum(d["reward"] for d in demos) / len(demos)
    assert 0.26 <= rate <= 0.34, rate
    assert 0.12 <= exact <= 0.18, exact  # 0.3 x 0.5; a made-up answer is seldom the product


def test_recipe_refuses_bad_values_before_writing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        demo_agentic.main([str(tmp_path / "d"), "--call-rate", "1.5"])
    assert e.value.code == 2 and "--call-rate must be in [0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        demo_agentic.main([str(tmp_path / "d"), "--steps", "0"])
    assert e.value.code == 2 and "--steps must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
    with pytest.raises(SystemExit) as e:
        demo_agentic.main([str(tmp_path / "d"), "--device", "cuda"])
    assert e.value.code == 2 and "torch sees no CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
    with pytest.raises(BadInputError, match="--min-digits"):
        demo_agentic.AgenticRecipe(preset="tiny", min_digits=4, max_digits=2, sft_steps=1,
                                   sft_batch=1, sft_lr=1e-3, rl_lr=1e-3, rl_global_batch=1)


@pytest.mark.timeout(300)
def test_cpu_smoke_runs_the_pipeline(tmp_path, capsys):
    """Tiny shapes, 1-2 digit operands, a warm start on clean demonstrations that always call the
    tool (300 steps: the tiny model copies operands and values by then), two RL steps:
    the rollout's episodes call the calculator (two model turns, the tool's tokens masked), each
    reward is the sum of its turn rewards, the first RL step changes the weights, and the summary
    JSON holds the per-step table of tool-call rate and reward."""
    from safetensors.torch import load_file

    root, out = tmp_path / "run", tmp_path / "summary.json"
    demo_agentic.main([str(root), "--steps", "2", "--sft-steps", "300", "--call-rate", "1",
                       "--call-exact", "1", "--max-digits", "2", "--rollout-batch-size", "4",
                       "--eval-prompts", "8", "--sft-prompts", "1024", "--out-json", str(out),
                       "-q"])
    printed = capsys.readouterr().out
    assert "calls" in printed and "rltool loop" in printed
    summary = json.loads(out.read_text())
    assert [r["step"] for r in summary["steps"]] == [0, 1]
    assert summary["steps"][0]["tool_call_rate"] > 0.5
    assert summary["env"] == "calculator" and summary["final_eval_exact"] is not None
    assert all(r["seconds"] > 0 for r in summary["steps"])
    rows = open_shard(root / "run" / "rollouts" / "step-000000").rows()
    called = [r for r in rows if len(r["turn_starts"]) > 1]
    assert called
    for r in called:
        start = r["turn_starts"][1]
        mask = r["loss_mask"]
        assert mask[0] == 1 and mask[start] == 1 and 0 in mask[:start]
        assert "tool\n" in r["response"] and "<calc>" in r["response"]
        zeros = [v for v, m in zip(r["weight_versions"], mask) if m == 0]
        assert set(zeros) == {-1}
    for r in rows:
        assert r["reward"] == pytest.approx(sum(r["turn_rewards"]), abs=1e-6)
        assert r["reward"] in (0.0, 1.0)
    weights = sorted((root / "run" / "weights").glob("weight_v*"))
    assert len(weights) >= 2

    def tensors(d: Path) -> dict:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    first, last = tensors(weights[0]), tensors(weights[-1])
    assert any(not first[k].equal(last[k]) for k in first)
