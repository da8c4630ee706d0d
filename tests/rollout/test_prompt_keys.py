"""Users' own prompt files: --input-key/--label-key/--metadata-key (dotted keys reach nested
fields), --no-apply-chat-template, verl-style Parquet and directories saved by HF datasets (read
with pyarrow alone)."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rltool.errors import BadInputError
from rltool.rollout.prompts import PromptKeys, load_prompts, render_prompt

VERL_ROWS = [
    {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "What is 2+3?"}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "5"},
     "extra_info": {"split": "train", "index": 0}},
    {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "What is 4*4?"}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "16"},
     "extra_info": {"split": "train", "index": 1}},
]


def test_verl_parquet_with_dotted_label_key(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), path)
    first, second = load_prompts(path, PromptKeys(label="reward_model.ground_truth",
                                                  metadata="extra_info"))
    assert first.messages == [{"role": "user", "content": "What is 2+3?"}]
    assert (first.label, second.label) == ("5", "16")
    assert first.metadata == {"split": "train", "index": 0}
    with pytest.raises(BadInputError, match="'question'.*--input-key"):
        load_prompts(path, PromptKeys(input="question"))
    # an absent label is null (the reward's label check then names the flag's file)
    assert load_prompts(path, PromptKeys(label="reward_model.missing"))[0].label is None


def test_jsonl_custom_keys_and_no_chat_template(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    path = tmp_path / "p.jsonl"
    rows = [{"input": "reverse 123", "answer": {"value": "321"}, "meta": {"task": "reverse"}},
            {"input": "reverse 45", "answer": {"value": 54}, "meta": None}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = load_prompts(path, PromptKeys(input="input", label="answer.value", metadata="meta"))
    assert (a.prompt, a.label, b.label, a.metadata, b.metadata) == ("reverse 123", "321", "54",
                                                           {"task": "reverse"}, {})
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    raw = render_prompt(tok, a, apply_chat_template=False)
    assert tok.decode(raw) == "reverse 123"
    templated = render_prompt(tok, a)
    assert len(templated) > len(raw) and "assistant" in tok.decode(templated)
    chat = load_prompts(tmp_path / "p.jsonl", PromptKeys(input="input"))[0]
    chat = type(chat)(prompt_id="c", prompt=[{"role": "user", "content": "x"}], label=None)
    with pytest.raises(BadInputError, match="--apply-chat-template"):
        render_prompt(tok, chat, apply_chat_template=False)


def test_hf_datasets_directory_read_without_datasets(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(VERL_ROWS * 3)
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)
    assert len(list((tmp_path / "ds").glob("*.arrow"))) > 1  # several shards, read in order
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    # Read in a process where `datasets` cannot be imported: pyarrow alone must do.
    code = (
        "import sys, json; sys.modules['datasets'] = None\n"
        "from rltool.rollout.prompts import PromptKeys, load_prompts\n"
        f"ps = load_prompts({str(tmp_path / 'ds')!r}, PromptKeys(label='reward_model.ground_truth'))\n"
        "print(json.dumps([[p.prompt_id, p.messages[0]['content'], p.label] for p in ps]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    assert [g[2] for g in got] == ["5", "16"] * 3
    assert [g[0] for g in got] == [str(i) for i in range(6)]
    with pytest.raises(BadInputError, match="DatasetDict with splits test, train; pass one"):
        load_prompts(tmp_path / "dd")
    with pytest.raises(BadInputError, match="without state.json"):
        load_prompts(tmp_path)
