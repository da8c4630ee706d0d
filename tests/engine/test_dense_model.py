"""The engine's own model definition and paged runner against transformers (CPU, fp32): teacher-
forced logits of one unpadded pass, and of a chunked paged prefill followed by paged decode steps,
for the qwen2, qwen3 and llama families (tied embeddings included)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rltool.engine.model_spec import read_spec
from rltool.engine.paged_runner import PagedRunner
from rltool.errors import CheckpointError

SEQ = [3, 9, 4, 17, 22, 5, 8, 30, 11, 2, 7, 19, 25, 6, 13, 1, 28, 12, 15, 20]


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    """A tiny qwen2 with tie_word_embeddings (Qwen2.5-0.5B ties its head to the embedding)."""
    from rltool.data.models import build_config
    from rltool.data.tokenizer import build_tokenizer
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("models") / "tied"
    build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    config = build_config("qwen2", "tiny", vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    config.tie_word_embeddings = True
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    return out


def hf_logits(model_dir, ids):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "tied"])
def test_logits_match_transformers(arch, tiny_model_factory, tied_model_dir):
    model_dir = tied_model_dir if arch == "tied" else tiny_model_factory(arch, 0)
    ref = hf_logits(model_dir, SEQ)
    runner = PagedRunner(model_dir, device="cpu", dtype="fp32", max_running=4, page_size=4,
                         max_total_tokens=256)
    assert runner.spec.tie_word_embeddings == (arch == "tied")
    # One unpadded pass (the trainer's layout).
    full = runner.full_pass_logits(SEQ, start=1)
    assert torch.allclose(full, ref[:-1], atol=1e-5, rtol=0)
    # Paged: prefill 7 + 5 tokens in two chunks (the second continues a cached prefix), together
    # with another request's fresh prompt in the same packed forward, then decode one at a time.
    other = [4, 4, 9, 1, 2]
    runner.prefill([("a", SEQ[:7], 0)], want=[False])
    got = runner.prefill([("b", other, 0), ("a", SEQ[7:12], 7)], want=[False, True])
    assert torch.allclose(got[0], ref[11], atol=1e-5, rtol=0)
    for t in range(12, len(SEQ)):
        logits = runner.decode(["a", "b"], [SEQ[t], other[-1] if t == 12 else 0])
        assert torch.allclose(logits[0], ref[t], atol=1e-5, rtol=0), t


def test_unsupported_configs_are_refused_in_one_line(tmp_path, tiny_model_factory):
    cfg = json.loads((tiny_model_factory("qwen2", 0) / "config.json").read_text())
    for change, words in [({"architectures": ["GPT2LMHeadModel"]}, "not supported"),
                          ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "dynamic"),
                          ({"hidden_act": "gelu"}, "gelu")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(CheckpointError, match=words) as e:
            read_spec(tmp_path)
        assert "\n" not in str(e.value)


def test_load_weights_refuses_a_mismatched_checkpoint(tiny_model_factory):
    runner = PagedRunner(tiny_model_factory("qwen2", 0), device="cpu", dtype="fp32",
                         max_running=2, page_size=4, max_total_tokens=64)
    before = runner.full_pass_logits(SEQ[:6], start=1)
    with pytest.raises(CheckpointError, match="not a parameter"):
        runner.load_weights(tiny_model_factory("qwen3", 0))  # qwen3 has q/k norms, no biases
    assert torch.equal(runner.full_pass_logits(SEQ[:6], start=1), before)
    runner.load_weights(tiny_model_factory("qwen2", 1))
    assert torch.allclose(runner.full_pass_logits(SEQ[:6], start=1),
                          hf_logits(tiny_model_factory("qwen2", 1), SEQ[:6])[:-1], atol=1e-5)


def test_qwen3_moe_logprobs_match_transformers(tiny_model_factory):
    """The MoE block (router softmax, top-2 of 4 experts renormalised, grouped expert GEMMs)
    through the paged runner: teacher-forced logprobs of a full pass, a chunked paged prefill
    and paged decode steps within 1e-5 of transformers' Qwen3MoeForCausalLM in fp32."""
    model_dir = tiny_model_factory("qwen3_moe", 0)
    ref = torch.log_softmax(hf_logits(model_dir, SEQ), dim=-1)
    runner = PagedRunner(model_dir, device="cpu", dtype="fp32", max_running=4, page_size=4,
                         max_total_tokens=256)
    assert runner.spec.moe is not None and runner.spec.moe.sparse_layers == {0, 1}
    lp = lambda logits: torch.log_softmax(logits, dim=-1)
    assert torch.allclose(lp(runner.full_pass_logits(SEQ, start=1)), ref[:-1], atol=1e-5, rtol=0)
    runner.prefill([("a", SEQ[:7], 0)], want=[False])
    got = runner.prefill([("b", [4, 4, 9, 1, 2], 0), ("a", SEQ[7:12], 7)], want=[False, True])
    assert torch.allclose(lp(got[0]), ref[11], atol=1e-5, rtol=0)
    for t in range(12, len(SEQ)):
        logits = runner.decode(["a", "b"], [SEQ[t], 2])
        assert torch.allclose(lp(logits[0]), ref[t], atol=1e-5, rtol=0), t


def test_qwen3_moe_dense_layers_and_weight_names(tmp_path, tiny_model_factory):
    """decoder_sparse_step / mlp_only_layers pick the dense layers; an update by HF name reaches
    one expert's slice of the stacked tensors and nothing else."""
    model_dir = tiny_model_factory("qwen3_moe", 0)
    cfg = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "decoder_sparse_step": 2,
                                                      "mlp_only_layers": [3],
                                                      "num_hidden_layers": 4}))
    assert read_spec(tmp_path).moe.sparse_layers == {1}
    runner = PagedRunner(model_dir, device="cpu", dtype="fp32", max_running=2, page_size=4,
                         max_total_tokens=64)
    layer = runner.model.layers[1]
    before = layer["experts_gate_up"].clone()
    new = torch.randn(64, 64)
    runner.load_named_tensors([("model.layers.1.mlp.experts.2.up_proj.weight", new)])
    assert torch.equal(layer["experts_gate_up"][2, 64:], new)
    before[2, 64:] = new
    assert torch.equal(layer["experts_gate_up"], before)
    with pytest.raises(Exception, match="not a parameter"):
        runner.load_named_tensors([("model.layers.1.mlp.experts.4.up_proj.weight", new)])
