"""Prompt files (JSONL and Parquet, chat lists, defaults) and the partial-rollout
carry files (newest earlier step wins, tokenizer check, pruning)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rltool.data.shards import ShardMeta
from rltool.errors import TokenizerMismatchError
from rltool.rollout import partial
from rltool.rollout.generate import Sample
from rltool.rollout.prompts import load_prompts, render_prompt


def test_parquet_chat_prompts_and_defaults(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    path = tmp_path / "p.parquet"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "copy 12"}]
    pq.write_table(pa.table({"prompt": ["reverse 123", "sort 31"], "label": ["321", None],
                             "metadata": [json.dumps({"task": "reverse"}), None]}), path)
    first, second = load_prompts(path)
    assert first.prompt_id == "0" and first.label == "321" and first.metadata == {"task": "reverse"}
    assert second.prompt_id == "1" and second.label is None and second.metadata == {}

    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text(json.dumps({"prompt": chat, "label": 12, "prompt_id": "c"}) + "\n")
    (p,) = load_prompts(jsonl)
    assert p.messages == chat and p.label == "12" and p.text == "system: be brief\nuser: copy 12"
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = render_prompt(tok, p)
    assert tok.decode(ids) == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\ncopy 12"
                               "<|im_end|>\n<|im_start|>assistant\n")


def carried_group(gid: int, *, status: str = "aborted") -> list[Sample]:
    return [Sample(uid=f"u{gid}-{i}", prompt_id=f"p{gid}", group_id=gid, sample_index=i,
                   prompt="x", prompt_token_ids=[1, 2], response="ab", response_token_ids=[5, 6],
                   rollout_logprobs=[-0.5, -0.25], loss_mask=[1, 0], weight_versions=[3, -1],
                   status=status, finish_reason="abort", rewards={"a": 1.0}) for i in range(2)]


def test_carry_files_round_trip_newest_earlier_step_and_pruning(tmp_path):
    meta = ShardMeta(tokenizer_hash="h1", step=0, producer="test", sampling={})
    d = partial.partial_dir(tmp_path / "rollouts" / "step-000003")
    assert d == tmp_path / "rollouts" / "partial"
    assert partial.load_carry(d, step=3, tokenizer_hash="h1") == ([], None)
    partial.save_carry(d, step=1, groups=[carried_group(7)], meta=meta)
    partial.save_carry(d, step=2, groups=[carried_group(8), carried_group(9, status="completed")],
                       meta=meta)
    groups, path = partial.load_carry(d, step=3, tokenizer_hash="h1")
    assert path.name == "step-000002.parquet"
    assert [[s.group_id for s in g] for g in groups] == [[8, 8], [9, 9]]
    s = groups[0][1]
    assert (s.uid, s.sample_index, s.status, s.loss_mask, s.weight_versions, s.rewards) == (
        "u8-1", 1, "aborted", [1, 0], [3, -1], {"a": 1.0})
    assert s.rollout_logprobs == pytest.approx([-0.5, -0.25])
    # A re-run of step 2 reads step 1's file again, not its own.
    assert partial.load_carry(d, step=2, tokenizer_hash="h1")[1].name == "step-000001.parquet"
    # Step 4 resumes step 2's file (no step 3 call used --partial); older ones go, that one stays
    # so that a re-run of step 4 finds it again.
    partial.save_carry(d, step=4, groups=[], meta=meta)
    assert sorted(p.name for p in d.iterdir()) == ["step-000002.parquet", "step-000004.parquet"]
    with pytest.raises(TokenizerMismatchError, match="delete the file"):
        partial.load_carry(d, step=3, tokenizer_hash="other")


def test_cached_prompts_reload_when_the_file_changes(tmp_path):
    import os

    from rltool.data.tasks import make_rows, write_prompts
    from rltool.rollout.prompts import PromptKeys
    from rltool.rollout.prompts import cached_prompts

    path = tmp_path / "p.jsonl"
    write_prompts(make_rows("copy", num=3, seed=1), path)
    first, rendered = cached_prompts(path, PromptKeys())
    rendered.setdefault(("tok", True), {})[0] = [1, 2]
    again, rendered_again = cached_prompts(path, PromptKeys())
    assert again is first and rendered_again[("tok", True)] == {0: [1, 2]}
    assert cached_prompts(path, PromptKeys(label="other"))[0] is not first  # keys are part of it
    write_prompts(make_rows("copy", num=4, seed=2), path)
    os.utime(path, ns=(1, 1))  # a new mtime even on a coarse clock
    changed, fresh = cached_prompts(path, PromptKeys())
    assert len(changed) == 4 and fresh == {}
