"""The engine's hybrid linear-attention model (qwen3_5: Gated DeltaNet + gated attention) against
transformers on CPU in fp32: logits of a full pass and of chunked, packed prefills of requests of
different lengths followed by batched decode steps; greedy tokens and logprobs through the
scheduler with a prefill chunk that splits prompts; the GDN math against a float64 loop; and the
recurrent-state pool's accounting (no slot held after finish, abort, retraction, release/resume
or a weight update)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rltool.engine.linear_attention import chunked_delta, recurrent_step
from rltool.engine.model_spec import read_spec
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams
from rltool.errors import BadInputError, CheckpointError
from tests.helpers.engines import serve_app
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.hybrid import make_hybrid, prefill_in_chunks
from tests.helpers.scheduling import submit_and_wait

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [10, 11, 3], [12, 13, 14, 15, 16, 17, 18],
           [3, 3, 3, 4, 9, 2]]
NEW = 6


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """`rltool init-model --arch qwen3_5 --preset tiny-4l` (3 GDN layers, 1 attention layer),
    its norms, A_log and dt_bias then moved off their init values (zero-centred norms init to 0,
    where a missing 1 + w or a swapped weight would not show)."""
    out = make_hybrid(tmp_path_factory.mktemp("hybrid") / "m", task=None)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text"
    return out


def hf_logits(model_dir, ids):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def runner_of(model_dir, **kw):
    args = dict(device="cpu", dtype="fp32", max_running=4, page_size=4, max_total_tokens=512,
                prefix_cache=False)
    return PagedRunner(model_dir, **(args | kw))


def test_spec_reads_the_layer_pattern_and_refuses_the_moe_hybrids(hybrid_dir, tmp_path):
    spec = read_spec(hybrid_dir)
    assert spec.arch == "qwen3_5" and spec.kv_layers == (3,)
    assert spec.linear.linear_layers == (0, 1, 2) and spec.linear.rotary_dim == 4
    cfg = json.loads((hybrid_dir / "config.json").read_text())
    for arch, words in [("Qwen3NextForCausalLM", "qwen3_next"),
                        ("KimiLinearForCausalLM", "kimi_linear")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": [arch]}))
        with pytest.raises(CheckpointError, match=words) as e:
            read_spec(tmp_path)
        assert "\n" not in str(e.value) and "--engine sglang" in str(e.value)


@pytest.mark.parametrize("arch,reason", [("qwen3_next", "in_proj_qkvz"),
                                         ("qwen3_5_moe", "shared expert"),
                                         ("kimi_linear", "each key channel")])
def test_init_model_refuses_the_hybrids_the_engine_does_not_implement(arch, reason, tmp_path):
    from click.testing import CliRunner

    from rltool.cli import main

    result = CliRunner().invoke(main, ["init-model", "--arch", arch, "--preset", "tiny",
                                       "--out", str(tmp_path / "m")])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and reason in result.output and "qwen3_5" in result.output
    assert not (tmp_path / "m").exists()


def test_gdn_chunks_and_steps_match_a_float64_loop():
    """The chunked prefill (chunks of 3 over 8 tokens, from a nonzero state) and the decode step
    against the delta rule written token by token in float64."""
    gen = torch.Generator().manual_seed(0)
    H, T, Dk, Dv = 2, 8, 4, 3
    q, k = (torch.nn.functional.normalize(torch.randn(H, T, Dk, generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(H, T, Dv, generator=gen)
    g = -torch.rand(H, T, generator=gen)
    beta = torch.rand(H, T, generator=gen)
    s0 = torch.randn(H, Dk, Dv, generator=gen)
    S, want = s0.double().clone(), torch.zeros(H, T, Dv, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            S[h] *= float(g[h, t].exp())
            u = float(beta[h, t]) * (v[h, t].double() - S[h].T @ k[h, t].double())
            S[h] += torch.outer(k[h, t].double(), u)
            want[h, t] = S[h].T @ q[h, t].double()
    out, state = chunked_delta(q, k, v, g, beta, s0, chunk=3)
    assert torch.allclose(out.double(), want, atol=1e-5) and torch.allclose(state.double(), S,
                                                                               atol=1e-5)
    S = s0.clone()
    for t in range(T):
        o, S = recurrent_step(q[:, t][None], k[:, t][None], v[:, t][None], g[:, t][None],
                              beta[:, t][None], S[None])
        S = S[0]
        assert torch.allclose(o[0].double(), want[:, t], atol=1e-5)


def test_logits_match_transformers_over_chunks_and_decode(hybrid_dir):
    """Three requests of different lengths: prefilled in chunks of at most 4 tokens (each chunk
    continuing a request's states, several requests per packed forward), then decoded together;
    every logit row equals transformers' on the whole sequence."""
    seqs = [[3, 9, 4, 17, 22, 5, 8, 30, 11, 2, 7, 19, 25, 6, 13, 1, 28],
            [4, 4, 9, 1, 2, 14, 20, 21, 5, 6, 7],
            [7, 3, 12, 30, 2, 2, 9, 18]]
    prompt = [11, 5, 3]  # prompt lengths; the rest is teacher-forced decode
    refs = [hf_logits(hybrid_dir, s) for s in seqs]
    runner = runner_of(hybrid_dir)
    full = runner.full_pass_logits(seqs[0], start=1)
    assert torch.allclose(full, refs[0][:-1], atol=1e-5, rtol=0)
    for i, row in enumerate(prefill_in_chunks(runner, seqs, prompt, chunk=4)):
        assert torch.allclose(row, refs[i][prompt[i] - 1], atol=1e-5, rtol=0), i
    assert runner.states.available == runner.states.num_slots - 3
    for t in range(5):  # the shortest sequence's last token is at prompt + 4
        logits = runner.decode(["r0", "r1", "r2"], [seqs[i][prompt[i] + t] for i in range(3)])
        for i in range(3):
            assert torch.allclose(logits[i], refs[i][prompt[i] + t], atol=1e-5, rtol=0), (i, t)
    for rid in ("r0", "r1", "r2"):
        runner.remove(rid)
    assert runner.states.available == runner.states.num_slots and not runner.states.held


def test_deterministic_full_pass_is_transformers_bit_for_bit(hybrid_dir):
    """The deterministic runner's pass beside the pool (recomputed and input logprobs, hidden
    states) runs the GDN layers with transformers' ops: every layer's output and every logit of
    a 150-token sequence (two full chunks of 64 and a padded one) equal transformers' exactly."""
    ids = [(7 * i * i + 3 * i) % 57 + 3 for i in range(150)]
    hf = AutoModelForCausalLM.from_pretrained(str(hybrid_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids]), output_hidden_states=True)
    runner = runner_of(hybrid_dir, deterministic=True)
    states, logits = runner.hidden_states(ids)
    assert len(states) == len(want.hidden_states)
    for i, (got, ref) in enumerate(zip(states, want.hidden_states)):
        assert torch.equal(got, ref[0]), i
    assert torch.equal(logits, want.logits[0])
    assert torch.equal(runner.full_pass_logits(ids, start=5), want.logits[0][4:-1])


def test_deterministic_full_pass_with_a_delta_rule_of_equal_head_counts(hybrid_dir, monkeypatch):
    """transformers releases differ in who repeats the key heads for the value heads: some
    layers repeat them before calling `torch_chunk_gated_delta_rule`, whose query and key must
    then have as many heads as the value (others repeat inside it). The engine repeats them
    itself, so its pass is the same under either contract."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    ids = [(5 * i * i + i) % 57 + 3 for i in range(70)]
    runner = runner_of(hybrid_dir, deterministic=True)
    want = runner.full_pass_logits(ids, start=3)
    plain = qwen3_5.torch_chunk_gated_delta_rule

    def equal_heads(query, key, value, **kw):
        assert query.shape[2] == key.shape[2] == value.shape[2], (query.shape, value.shape)
        return plain(query, key, value, **kw)

    monkeypatch.setattr(qwen3_5, "torch_chunk_gated_delta_rule", equal_heads)
    assert runner.spec.linear.num_k_heads < runner.spec.linear.num_v_heads
    assert torch.equal(runner.full_pass_logits(ids, start=3), want)


def greedy(rid, prompt, n=NEW):
    return Request(rid=rid, prompt_ids=prompt, return_logprob=True,
                   params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("ratio,max_total_tokens,deterministic",
                         [(None, 512, False), (0.25, 512, False), (None, 24, False),
                          (None, 512, True)])
def test_scheduler_greedy_matches_transformers_and_frees_every_slot(hybrid_dir, ratio,
                                                                    max_total_tokens,
                                                                    deterministic):
    """Prompts split by a 4-token prefill chunk, batched decode; with a memory ratio that leaves
    fewer state slots than --max-running-requests, requests wait for a slot; a 24-token KV pool
    forces retraction (the retracted request starts again from a zero state); deterministic
    mode runs each request alone."""
    runner = runner_of(hybrid_dir, mamba_full_memory_ratio=ratio,
                       max_total_tokens=max_total_tokens, deterministic=deterministic)
    if ratio is not None:
        assert 1 <= runner.states.num_slots < 4
    sched = PagedScheduler(runner, max_running=4, max_prefill_tokens=6, chunked_prefill_size=4,
                           deterministic=deterministic)
    reqs = [greedy(f"g{i}", p) for i, p in enumerate(PROMPTS)]
    sched.start()
    try:
        submit_and_wait(sched, reqs)
    finally:
        sched.stop()
    for req, prompt in zip(reqs, PROMPTS):
        want, lps = hf_greedy(hybrid_dir, prompt, NEW)
        assert req.output_ids == want, req.rid
        assert req.output_logprobs == pytest.approx(lps, abs=1e-5)
    assert not runner.states.held and runner.states.available == runner.states.num_slots
    if max_total_tokens == 24:
        assert sched.num_retractions > 0


def test_no_slot_is_held_after_abort_release_resume_and_a_weight_update(hybrid_dir):
    runner = runner_of(hybrid_dir)
    sched = PagedScheduler(runner, max_running=4, max_prefill_tokens=6, chunked_prefill_size=4)
    sched.start()
    try:
        long = [greedy(f"a{i}", p, n=400) for i, p in enumerate(PROMPTS[:3])]

        def abort_while_decoding():
            deadline = time.monotonic() + 60
            while not all(r.output_ids for r in long) and time.monotonic() < deadline:
                time.sleep(0.01)

            def abort():
                held = len(runner.states.held)
                sched.abort(abort_all=True)
                return held
            assert sched.call(abort).result(30) == 3  # each running request held a slot
        submit_and_wait(sched, long, while_running=abort_while_decoding)
        assert all(r.finish_reason["type"] == "abort" for r in long)
        assert sched.call(lambda: dict(runner.states.held)).result(30) == {}
        # release with requests in flight: retracted (slots freed), the pool rebuilt on resume,
        # then they run to the end from zero states
        reqs = [greedy(f"m{i}", p, n=30) for i, p in enumerate(PROMPTS[:2])]

        def release_and_resume():
            deadline = time.monotonic() + 60
            while not all(r.output_ids for r in reqs) and time.monotonic() < deadline:
                time.sleep(0.01)

            def release():
                before = len(runner.states.held)
                sched.retract_for_release()
                after = dict(runner.states.held)
                runner.release()
                return before, after
            assert sched.call(release).result(30) == (2, {})
            sched.call(runner.resume).result(60)
        submit_and_wait(sched, reqs, while_running=release_and_resume)
        for req, prompt in zip(reqs, PROMPTS):
            assert req.output_ids == hf_greedy(hybrid_dir, prompt, 30)[0]
        # a weight update from disk (the same checkpoint) between requests
        sched.update_weights(lambda: runner.load_weights(hybrid_dir), abort_all=False).result(60)
        again = [greedy("w0", PROMPTS[0])]
        submit_and_wait(sched, again)
        assert again[0].output_ids == reqs[0].output_ids[:NEW]
        assert sched.call(lambda: dict(runner.states.held)).result(30) == {}
    finally:
        sched.stop()
    assert runner.states.available == runner.states.num_slots


def test_state_dtype_and_cache_sizes(hybrid_dir):
    """c_R follows --mamba-ssm-dtype (bf16 halves the recurrent state, not the conv state); FP8
    KV changes c_A only; c_A counts the attention layer alone."""
    spec = read_spec(hybrid_dir)
    ls = spec.linear
    ssm = ls.num_v_heads * ls.k_dim * ls.v_dim
    conv = (ls.conv_kernel - 1) * ls.conv_dim
    r32 = runner_of(hybrid_dir, max_running=2)
    assert r32.cache_sizes() == {"c_A": 2 * 1 * spec.num_kv_heads * spec.head_dim * 4,
                                 "c_R": 3 * (ssm * 4 + conv * 4), "K": 2, "N": 508}
    r16 = runner_of(hybrid_dir, max_running=2, mamba_ssm_dtype="bf16", kv_cache_dtype="fp8_e4m3")
    assert r16.states.ssm.dtype == torch.bfloat16 and r16.states.conv.dtype == torch.float32
    assert r16.cache_sizes()["c_R"] == 3 * (ssm * 2 + conv * 4)
    assert r16.cache_sizes()["c_A"] == 2 * 1 * spec.num_kv_heads * (spec.head_dim + 4)


def test_cli_refuses_the_host_tier_and_bad_hybrid_flags(hybrid_dir, tiny_model_dir):
    from click.testing import CliRunner

    from rltool.cli import main

    cases = [(["--enable-hierarchical-cache"], "--enable-hierarchical-cache"),
             (["--disable-radix-cache", "--mamba-ssm-dtype", "fp16"], "mamba-ssm-dtype"),
             (["--disable-radix-cache", "--mamba-full-memory-ratio", "0"],
              "mamba-full-memory-ratio")]
    for extra, words in cases:
        result = CliRunner().invoke(main, ["serve", "--model", str(hybrid_dir), "--device", "cpu",
                                           "--port", "0", *extra])
        assert result.exit_code == 2, (extra, result.output)
        # one error line (click's usage errors come after its two usage lines)
        errors = [line for line in result.output.splitlines() if "rror" in line]
        assert len(errors) == 1 and words in errors[0], (extra, result.output)
    result = CliRunner().invoke(main, ["serve", "--model", str(tiny_model_dir), "--device", "cpu",
                                       "--port", "0", "--mamba-ssm-dtype", "bf16"])
    assert result.exit_code == 2 and "drop them" in result.output, result.output


GDN_TENSORS = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.conv1d.weight",
               "linear_attn.norm.weight", "linear_attn.in_proj_a.weight",
               "linear_attn.in_proj_qkv.weight", "input_layernorm.weight")


def test_weight_updates_reach_the_gdn_tensors(hybrid_dir, tmp_path):
    """An in-memory update of GDN tensors (decay, time-step bias, conv, gated norm, projections),
    and the same weights from disk, give transformers' logits of the updated checkpoint; a tensor
    of the wrong shape is refused before anything is copied."""
    seq = [3, 9, 4, 17, 22, 5, 8, 30, 11, 2, 7, 19]
    tensors = load_file(str(hybrid_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(11)
    changed = {n: t + 0.2 * torch.randn(t.shape, generator=gen) for n, t in tensors.items()
               if n.startswith("model.layers.1.") and n.endswith(GDN_TENSORS)}
    assert len(changed) == len(GDN_TENSORS)
    new_dir = tmp_path / "updated"
    new_dir.mkdir()
    for f in hybrid_dir.iterdir():
        if f.name != "model.safetensors":
            (new_dir / f.name).write_bytes(f.read_bytes())
    save_file(tensors | changed, str(new_dir / "model.safetensors"), metadata={"format": "pt"})
    ref = hf_logits(new_dir, seq)
    runner = runner_of(hybrid_dir)
    before = runner.full_pass_logits(seq, start=1)
    assert not torch.allclose(before, ref[:-1], atol=1e-3)
    bad = ("model.layers.1.linear_attn.A_log", torch.zeros(3))
    with pytest.raises(BadInputError, match="shape"):
        runner.load_named_tensors([*changed.items(), bad])
    assert torch.equal(runner.full_pass_logits(seq, start=1), before)
    assert runner.load_named_tensors(list(changed.items())) == len(changed)
    assert torch.allclose(runner.full_pass_logits(seq, start=1), ref[:-1], atol=1e-5, rtol=0)
    from_disk = runner_of(hybrid_dir)
    from_disk.load_weights(new_dir)
    assert torch.allclose(from_disk.full_pass_logits(seq, start=1), ref[:-1], atol=1e-5, rtol=0)


def test_block_fp8_keeps_the_recurrent_parameters_and_serves(hybrid_dir, tmp_path):
    """`rltool convert fp8` of a hybrid quantizes the GDN layer's large projections and keeps
    A_log, dt_bias, the conv, the gated norm and the small a/b projections in their dtype; the
    engine serves it as it serves its dequantized copy."""
    from safetensors import safe_open

    from rltool.convert.fp8 import (DequantConfig, Fp8Config, dequantize_checkpoint,
                                    quantize_checkpoint)

    fp8 = tmp_path / "fp8"
    quantize_checkpoint(Fp8Config(hf=hybrid_dir, out=fp8, block=(32, 32), workers=1))
    with safe_open(str(next(fp8.glob("*.safetensors"))), framework="pt") as f:
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}
    p = "model.layers.0.linear_attn."
    for name in ("A_log", "dt_bias", "conv1d.weight", "norm.weight", "in_proj_a.weight",
                 "in_proj_b.weight"):
        assert dtypes[p + name] == "F32", name
    for name in ("in_proj_qkv.weight", "in_proj_z.weight", "out_proj.weight"):
        assert dtypes[p + name] == "F8_E4M3", name
    plain = tmp_path / "dequant"
    dequantize_checkpoint(DequantConfig(hf=fp8, out=plain, dtype="fp32", workers=1))
    seq = [3, 9, 4, 17, 22, 5, 8, 30]
    got = runner_of(fp8).full_pass_logits(seq, start=1)
    assert torch.allclose(got, runner_of(plain).full_pass_logits(seq, start=1), atol=1e-5)
    assert torch.allclose(got, hf_logits(plain, seq)[:-1], atol=1e-5, rtol=0)


def test_http_routes_serve_the_hybrid_and_report_its_cache(hybrid_dir):
    """The app built from `rltool serve`'s config: /get_server_info's cache_sizes (c_A, c_R, K,
    N), /generate, and release/resume of memory through the routes, with no slot held after."""
    from rltool.engine.config import ServeConfig

    cfg = ServeConfig(model=hybrid_dir, device="cpu", disable_radix_cache=True,
                      max_running_requests=3, chunked_prefill_size=4)
    with serve_app(cfg) as (client, runner):
        info = client.get("/get_server_info").json()
        assert info["mamba_full_memory_ratio"] is None and info["mamba_ssm_dtype"] is None
        assert info["cache_sizes"] == runner.cache_sizes()
        assert info["cache_sizes"]["K"] == 3 and info["cache_sizes"]["c_R"] > 0
        body = {"input_ids": PROMPTS[0], "sampling_params": {
            "max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}}
        first = client.post("/generate", json=body).json()
        assert client.post("/release_memory_occupation", json={}).status_code == 200
        assert runner.released
        assert client.post("/resume_memory_occupation", json={}).status_code == 200
        again = client.post("/generate", json=body).json()
        assert again["output_ids"] == first["output_ids"]
        assert first["output_ids"] == hf_greedy(hybrid_dir, PROMPTS[0], NEW)[0]
    assert not runner.states.held


def test_the_warm_up_is_skipped_where_the_state_pool_lacks_its_slots(hybrid_dir, monkeypatch):
    """The engine's warm-up (PagedForward.warm_up, CUDA only) prefills two scratch requests,
    each holding a recurrent-state slot: with one slot (a small --mamba-full-memory-ratio) it is
    skipped, as where pages or rows are short, instead of failing the engine's start; nothing
    is left held. The forward is told it runs on CUDA: the skip happens before any device work."""
    runner = runner_of(hybrid_dir, mamba_full_memory_ratio=0.12)
    assert runner.states.num_slots == 1
    forward = runner._forward
    monkeypatch.setattr(forward, "device", torch.device("cuda"))
    forward.warm_up()
    assert runner.states.available == 1 and not runner.states.held
    assert not runner.table.entries
