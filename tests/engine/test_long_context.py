"""Long contexts in the builtin engine on CPU (fp32): prompts of thousands of tokens prefilled in
chunks that split pages, over thousands of KV pages, against transformers' teacher-forced
logprobs; seeded sampling under retraction against an unconstrained run; RoPE scaling (yarn,
linear) against transformers; the one-line refusal of a request the pool can never hold."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rltool.data.models import build_config
from rltool.data.tokenizer import build_tokenizer
from rltool.engine import api
from rltool.engine.config import ServeConfig
from rltool.engine.model_spec import read_spec
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.rope import read_rope_scaling, rope_frequencies
from rltool.engine.sampling import SamplingParams, make_generator
from rltool.errors import BadInputError, CheckpointError
from tests.helpers.engines import serve_app
from tests.helpers.scheduling import run_all

CONTEXT = 8192


def _write_model(out, arch: str, *, seed: int, max_positions: int, rope: dict | None = None):
    """A tiny random-init model of `arch` serving `max_positions` positions; `rope`: a
    `rope_scaling` entry written into config.json as Qwen's checkpoints spell it."""
    build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    config = build_config(arch, "tiny", vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    config.max_position_embeddings = max_positions
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    if rope is not None:
        path = out / "config.json"
        cfg = json.loads(path.read_text())
        cfg.pop("rope_parameters", None)
        cfg.update(rope_theta=10000.0, rope_scaling=rope)
        path.write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """A tiny qwen2 with 8192 positions."""
    return _write_model(tmp_path_factory.mktemp("models") / "long", "qwen2", seed=5,
                        max_positions=CONTEXT)


def _hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' teacher-forced log-softmax over `ids` (fp32, one pass): [len(ids), vocab]."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)


def _prompt(n: int, *, seed: int, vocab: int = 60) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _run(sched: PagedScheduler, reqs: list[Request], *, timeout_s: float = 120) -> None:
    run_all(sched, reqs, wait=timeout_s)
    assert all(r.finish_reason["type"] == "length" for r in reqs), [r.finish_reason for r in reqs]


def test_long_prompt_in_page_splitting_chunks_matches_transformers(long_model_dir):
    """A 6,500-token prompt prefilled in chunks of 998 tokens (each chunk boundary inside a page
    of 4) into ~1,650 pages, then greedy decode to 6,524 tokens: every token is transformers'
    argmax and every logprob its teacher-forced one within 1e-5."""
    prompt, new = _prompt(6500, seed=1), 24
    runner = PagedRunner(long_model_dir, device="cpu", dtype="fp32", max_running=2, page_size=4,
                         max_total_tokens=CONTEXT)
    assert runner.context_length == CONTEXT
    sched = PagedScheduler(runner, max_running=2, max_prefill_tokens=998, chunked_prefill_size=998)
    req = Request(rid="long", prompt_ids=prompt, return_logprob=True,
                  params=SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
    _run(sched, [req])
    ref = _hf_logprobs(long_model_dir, prompt + req.output_ids[:-1])[len(prompt) - 1:]
    assert req.output_ids == ref.argmax(-1).tolist()
    want = ref.gather(1, torch.tensor(req.output_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(req.output_logprobs), want, atol=1e-5, rtol=0)
    assert sched.counters.num_prefill_forwards == 7  # ceil(6500 / 998) chunks
    assert not runner.table.entries


@pytest.mark.slow
def test_32k_context_over_two_thousand_pages_matches_transformers(tmp_path):
    """A model of 32,768 positions filled to the last one: a 32,760-token prompt in chunks of
    4,000 into 2,048 pages of 16, then greedy decode to 32,768 tokens; tokens and logprobs as
    transformers' teacher-forced pass (1e-5)."""
    model_dir = _write_model(tmp_path / "m32k", "qwen2", seed=5, max_positions=32768)
    prompt, new = _prompt(32760, seed=2), 8
    runner = PagedRunner(model_dir, device="cpu", dtype="fp32", max_running=1, page_size=16,
                         max_total_tokens=32768 + 16)
    assert runner.table.allocator.num_pages - 1 == 2048
    sched = PagedScheduler(runner, max_running=1, max_prefill_tokens=4000,
                           chunked_prefill_size=4000)
    req = Request(rid="32k", prompt_ids=prompt, return_logprob=True,
                  params=SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
    _run(sched, [req], timeout_s=300)
    ref = _hf_logprobs(model_dir, prompt + req.output_ids[:-1])[len(prompt) - 1:]
    assert req.output_ids == ref.argmax(-1).tolist()
    want = ref.gather(1, torch.tensor(req.output_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(req.output_logprobs), want, atol=1e-5, rtol=0)


def _seeded(prompts: list[list[int]], new: int) -> list[Request]:
    return [Request(rid=f"s{i}", prompt_ids=p, return_logprob=True, generator=make_generator(40 + i),
                    params=SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True))
            for i, p in enumerate(prompts)]


def test_retraction_mid_output_keeps_seeded_tokens(long_model_dir):
    """Three 2,420-token prompts and 64 sampled tokens each in a pool of 7,424 tokens: all three
    prompts fit, their outputs do not, so decode retracts the newest request and resumes it
    later. Each request's tokens equal those of a run with room for all (same seeds), and its
    logprobs are transformers' teacher-forced ones within 1e-5."""
    prompts, new = [_prompt(2420, seed=10 + i) for i in range(3)], 64
    outs = {}
    for pool in (16384, 7424):
        runner = PagedRunner(long_model_dir, device="cpu", dtype="fp32", max_running=3,
                             page_size=16, max_total_tokens=pool)
        sched = PagedScheduler(runner, max_running=3, max_prefill_tokens=2048,
                               chunked_prefill_size=1024)
        reqs = _seeded(prompts, new)
        _run(sched, reqs)
        outs[pool] = reqs
        retractions = sched.stats()["num_retractions"]
        assert (retractions > 0) == (pool == 7424), retractions
        assert runner.table.free_pages == runner.table.allocator.num_pages - 1
    for big, small, prompt in zip(outs[16384], outs[7424], prompts):
        assert small.output_ids == big.output_ids, small.rid
        ref = _hf_logprobs(long_model_dir, prompt + small.output_ids[:-1])[len(prompt) - 1:]
        want = ref.gather(1, torch.tensor(small.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(small.output_logprobs), want, atol=1e-5, rtol=0)


def test_a_request_the_pool_can_never_hold_is_refused_in_one_line(long_model_dir):
    """prompt + max_new_tokens over the pool: refused at submit (nothing queued), naming both
    sizing flags; exactly the pool's size is served."""
    runner = PagedRunner(long_model_dir, device="cpu", dtype="fp32", max_running=2, page_size=16,
                         max_total_tokens=1024)
    pool = runner.max_total_num_tokens
    assert pool == 1008  # 64 pages, the scratch page excluded
    sched = PagedScheduler(runner, max_running=2, max_prefill_tokens=512)
    prompt = _prompt(1000, seed=3)
    too_big = Request(rid="big", prompt_ids=prompt,
                      params=SamplingParams(max_new_tokens=pool - 999, ignore_eos=True))
    ok = Request(rid="ok", prompt_ids=prompt,
                 params=SamplingParams(max_new_tokens=pool - 1000, temperature=0.0,
                                       ignore_eos=True))
    with pytest.raises(BadInputError, match="--max-total-tokens or --mem-fraction-static") as e:
        sched.submit([ok, too_big])  # all or none
    assert "\n" not in str(e.value) and "1009 tokens" in str(e.value)
    assert sched.stats()["num_waiting_reqs"] == 0
    _run(sched, [Request(rid="ok", prompt_ids=prompt, params=ok.params)])


def test_over_http_the_refusal_is_a_400_and_a_chat_default_fits_the_pool(long_model_dir):
    """/generate answers 400 with the one-line reason (nothing generated); a chat completion
    without a token limit gets at most what the pool holds (its context is 8,192) and runs."""
    cfg = ServeConfig(model=long_model_dir, device="cpu", max_running_requests=2,
                      max_total_tokens=64, max_prefill_tokens=64)
    with serve_app(cfg) as (client, runner):
        assert client.get(api.SERVER_INFO).json()["kv_pool_tokens"] == 48
        refused = client.post(api.GENERATE, json={
            "input_ids": list(range(3, 43)), "sampling_params": {"max_new_tokens": 9}})
        stats = client.get(api.SERVER_INFO).json()["internal_states"][0]
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "abc"}], "temperature": 0,
            "ignore_eos": True})
    assert refused.status_code == 400
    assert "--max-total-tokens or --mem-fraction-static" in refused.text
    assert stats["total_output_tokens"] == stats["num_waiting_reqs"] == 0
    assert chat.status_code == 200, chat.text
    usage = chat.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 48


@pytest.mark.parametrize("rope_type,extra", [
    ("default", {}), ("linear", {}), ("yarn", {}),
    ("yarn", {"beta_fast": 16, "beta_slow": 2, "truncate": False}),
    ("yarn", {"mscale": 0.8, "mscale_all_dim": 0.5}), ("yarn", {"attention_factor": 1.3})])
def test_rope_frequencies_equal_transformers(rope_type, extra):
    """inv_freq and the attention factor bit for bit against transformers' own functions."""
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": rope_type, "rope_theta": 1e6, **extra}
    if rope_type != "default":
        rope["factor"] = 4.0
    if rope_type == "yarn":
        rope["original_max_position_embeddings"] = 4096
    cfg = Qwen2Config(hidden_size=256, num_attention_heads=2, max_position_embeddings=32768,
                      rope_parameters=dict(rope))
    if rope_type == "default":  # transformers' default lives in each model's rotary class
        want = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128)), 1.0
    else:
        want = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    scaling = read_rope_scaling({"rope_scaling": rope, "max_position_embeddings": 32768},
                                where="config.json")
    got = rope_frequencies(scaling, dim=128, theta=1e6)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    # Served positions for a config.json of 4096: yarn's 4 x 4096 pretraining positions.
    assert scaling.context_length(4096) == (4096 if rope_type == "default" else 16384)


@pytest.mark.parametrize("arch,rope", [
    ("qwen3", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}),
    ("llama", {"rope_type": "linear", "factor": 4.0})])
def test_scaled_rope_matches_transformers_past_the_pretraining_context(tmp_path, arch, rope):
    """A config.json with yarn (Qwen's spelling: 2048 pretraining positions x 4) or linear
    scaling: the engine serves 8192 positions, and 3,000 tokens (past the pretraining 2048)
    give transformers' teacher-forced logprobs within 1e-5, in one pass and through a chunked
    paged prefill with decode steps after it."""
    model_dir = _write_model(tmp_path / arch, arch, seed=7, max_positions=2048, rope=rope)
    spec = read_spec(model_dir)
    assert spec.rope.rope_type == rope.get("type", rope.get("rope_type"))
    assert spec.max_position_embeddings == CONTEXT
    ids = _prompt(3000, seed=4)
    ref = _hf_logprobs(model_dir, ids)
    runner = PagedRunner(model_dir, device="cpu", dtype="fp32", max_running=1, page_size=16,
                         max_total_tokens=4096)
    full = torch.log_softmax(runner.full_pass_logits(ids, start=1), -1)
    assert torch.allclose(full, ref[:-1], atol=1e-5, rtol=0)
    prefix = 2990
    for start in range(0, prefix, 1000):
        got = runner.prefill([("a", ids[start:min(start + 1000, prefix)], start)],
                             want=[start + 1000 >= prefix])
    assert torch.allclose(torch.log_softmax(got[0], -1), ref[prefix - 1], atol=1e-5, rtol=0)
    for t in range(prefix, len(ids) - 1):
        step = runner.decode(["a"], [ids[t]])
        assert torch.allclose(torch.log_softmax(step[0], -1), ref[t], atol=1e-5, rtol=0)


@pytest.mark.parametrize("rope,words", [({"rope_type": "dynamic", "factor": 2.0}, "dynamic"),
                                        ({"rope_type": "llama3", "factor": 8.0}, "llama3"),
                                        ({"rope_type": "longrope"}, "longrope"),
                                        ({"rope_type": "linear", "factor": 0.5}, "factor >= 1")])
def test_unsupported_rope_scaling_is_refused_in_one_line(tmp_path, rope, words):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 60,
           "rope_scaling": rope}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=words) as e:
        read_spec(tmp_path)
    assert "\n" not in str(e.value)
    assert words == "factor >= 1" or "--engine sglang" in str(e.value)
