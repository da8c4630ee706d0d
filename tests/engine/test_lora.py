"""LoRA adapters in the builtin engine (--enable-lora), CPU fp32: the adapter compute against
PEFT's PeftModel on the same tiny model, scheduling one adapter per forward, the prefix cache
kept apart per adapter, weight syncs of the policy adapter, and the HTTP routes."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams
from rltool.errors import BadInputError
from tests.helpers.lora_adapters import ALL_TARGETS as ALL, make_adapter
from tests.helpers.scheduling import generate_once, greedy_requests, run_all

PROMPTS = [[5, 9, 13, 2, 7, 11, 3, 4, 8, 6], [12, 4, 4, 9, 1, 2, 3]]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir):
    """Two adapters beside the model (under its weight root): rank 4 on every linear, and rank
    2 on q/v only (padded to the engine's rank 8, parts of the fused linears untouched)."""
    root = tiny_model_dir.parent
    full = make_adapter(tiny_model_dir, root / "lora-full", r=4, alpha=8, targets=ALL, seed=1)
    qv = make_adapter(tiny_model_dir, root / "lora-qv", r=2, alpha=6,
                      targets=["q_proj", "v_proj"], seed=2)
    return {"full": full, "qv": qv}


def runner_of(model_dir, **kw):
    kw.setdefault("max_total_tokens", 512)
    return PagedRunner(model_dir, device="cpu", dtype="fp32", max_running=8, page_size=4,
                       enable_lora=True, max_lora_rank=8, **kw)


def greedy(runner, prompts, loras, *, new=6):
    """Greedy continuations of `prompts` under adapters `loras` (None: the policy adapter),
    submitted together to a scheduler over `runner`; the finished requests, in order."""
    reqs = generate_once(runner, prompts, loras, new=new, max_prefill_tokens=64)
    assert all(r.finish_reason["type"] == "length" for r in reqs), [r.finish_reason for r in reqs]
    return reqs


def peft_logits(peft_model, ids):
    with torch.no_grad():
        return peft_model(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("which", ["full", "qv"])
def test_full_pass_logits_match_peft(tiny_model_dir, adapters, which):
    peft_model, path = adapters[which]
    runner = runner_of(tiny_model_dir)
    runner.lora.load(which, path)
    runner.use_lora(which)
    ids = PROMPTS[0]
    got = runner.full_pass_logits(ids, start=1)
    want = peft_logits(peft_model, ids)[:-1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with peft_model.disable_adapter():
        base = peft_logits(peft_model, ids)[:-1]
    assert (want - base).abs().max() > 1e-2  # the adapter changes the logits


@pytest.mark.parametrize("which", ["full", "qv"])
def test_deterministic_full_pass_equals_peft_bitwise(tiny_model_dir, adapters, which):
    """Deterministic fp32: each module's update computed apart, as the trainer's hook does,
    gives PeftModel's logits bit for bit (the default mode's stacked lora_A does not promise
    that); the stacked and split paths agree to rounding."""
    peft_model, path = adapters[which]
    exact, fast = runner_of(tiny_model_dir, deterministic=True), runner_of(tiny_model_dir)
    for runner in (exact, fast):
        runner.load_weights(path)
    assert exact.lora.layers.exact and not fast.lora.layers.exact
    ids = PROMPTS[0]
    got = exact.full_pass_logits(ids, start=1)
    assert torch.equal(got, peft_logits(peft_model, ids)[:-1])
    torch.testing.assert_close(got, fast.full_pass_logits(ids, start=1), atol=1e-5, rtol=0)


def test_moe_model_attention_adapter_matches_peft(tiny_model_factory, tmp_path):
    """qwen3_moe: an adapter on the attention projections (and the dense layers' MLP, where
    there are any) matches PeftModel; one on a sparse layer's experts is refused by name."""
    model_dir = tiny_model_factory("qwen3_moe", 0)
    peft_model, path = make_adapter(model_dir, model_dir.parent / "moe-lora", r=4, alpha=8,
                                    targets=["q_proj", "k_proj", "v_proj", "o_proj"], seed=4)
    runner = runner_of(model_dir)
    runner.load_weights(path)
    ids = PROMPTS[0]
    torch.testing.assert_close(runner.full_pass_logits(ids, start=1),
                               peft_logits(peft_model, ids)[:-1], atol=1e-5, rtol=0)
    sparse = min(runner.spec.moe.sparse_layers)
    name = f"base_model.model.model.layers.{sparse}.mlp.gate_proj.lora_A.weight"
    with pytest.raises(BadInputError, match="sparse MoE layer"):
        runner.load_named_tensors([(name, torch.ones(2, runner.spec.hidden_size))])


def test_paged_decode_matches_peft_and_differs_from_base(tiny_model_dir, adapters):
    """Prefill and decode over the paged pool, a batch of two prompts under one adapter: the
    sampled tokens' logprobs equal PeftModel's full pass over the same tokens."""
    peft_model, path = adapters["full"]
    runner = runner_of(tiny_model_dir)
    runner.lora.load("full", path)
    reqs = greedy(runner, PROMPTS, ["full", "full"])
    for req in reqs:
        ids = req.prompt_ids + req.output_ids
        logits = peft_logits(peft_model, ids)[len(req.prompt_ids) - 1:-1]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(req.output_ids)[:, None])
        assert req.output_ids == logits.argmax(-1).tolist()
        torch.testing.assert_close(torch.tensor(req.output_logprobs), want[:, 0], atol=1e-5,
                                   rtol=0)
    base = greedy(runner, PROMPTS, [None, None])
    assert [r.output_ids for r in base] != [r.output_ids for r in reqs]


def test_base_requests_and_unloading_give_base_outputs_exactly(tiny_model_dir, adapters):
    """Requests without an adapter, before any load, mixed with adapter requests, and after the
    unload: tokens and logprobs bit for bit those of an engine without --enable-lora."""
    plain = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_running=8, page_size=4,
                        max_total_tokens=512)
    want = greedy(plain, PROMPTS, [None, None])
    runner = runner_of(tiny_model_dir)
    runner.lora.load("full", adapters["full"][1])
    mixed = greedy(runner, PROMPTS * 2, [None, "full", "full", None])
    runner.lora.unload("full")
    after = greedy(runner, PROMPTS, [None, None])  # their prompts' KV cached by then, both
    cached = greedy(plain, PROMPTS, [None, None])
    for got, ref in (([mixed[0], mixed[3]], want), (after, cached)):
        assert [r.cached_tokens for r in got] == [r.cached_tokens for r in ref]
        assert [r.output_ids for r in got] == [r.output_ids for r in ref]
        assert [r.output_logprobs for r in got] == [r.output_logprobs for r in ref]
    alone = greedy(runner_of(tiny_model_dir), [PROMPTS[1]], [None])
    runner2 = runner_of(tiny_model_dir)
    runner2.lora.load("full", adapters["full"][1])
    assert mixed[1].output_ids == greedy(runner2, [PROMPTS[1]], ["full"])[0].output_ids
    assert alone[0].output_ids == want[1].output_ids


def test_prefix_cache_is_kept_apart_per_adapter(tiny_model_dir, adapters):
    """A prompt cached under one adapter is a miss for another adapter and for the base, and a
    hit for the same adapter; outputs stay those of a fresh engine."""
    runner = runner_of(tiny_model_dir)
    assert runner.prefix_cache
    runner.lora.load("full", adapters["full"][1])
    runner.lora.load("qv", adapters["qv"][1])
    prompt = PROMPTS[0]
    first = greedy(runner, [prompt], ["full"])[0]
    other = greedy(runner, [prompt], ["qv"])[0]
    base = greedy(runner, [prompt], [None])[0]
    again = greedy(runner, [prompt], ["full"])[0]
    assert (first.cached_tokens, other.cached_tokens, base.cached_tokens) == (0, 0, 0)
    assert again.cached_tokens > 0
    assert again.output_ids == first.output_ids
    fresh = runner_of(tiny_model_dir)
    fresh.lora.load("qv", adapters["qv"][1])
    assert greedy(fresh, [prompt], ["qv"])[0].output_ids == other.output_ids


def test_tensor_sync_equals_disk_sync_bitwise(tiny_model_dir, tmp_path):
    """The policy adapter from PEFT-named tensors (lora_alpha 2 x rank, the scale a tensor sync
    assumes) and from the adapter directory: the same buffers and logits, bit for bit; a
    request without lora_path runs it."""
    from safetensors.torch import load_file

    peft_model, path = make_adapter(tiny_model_dir, tiny_model_dir.parent / "lora-policy", r=4,
                                    alpha=8, targets=ALL, seed=3)
    disk, tensor = runner_of(tiny_model_dir), runner_of(tiny_model_dir)
    disk.load_weights(path)
    named = sorted(load_file(str(path / "adapter_model.safetensors")).items())
    half = len(named) // 2  # in two buckets, as a bucketed sync sends them
    assert tensor.load_named_tensors(named[:half]) + tensor.load_named_tensors(named[half:]) \
        == len(named)
    for key, (a, b) in disk.lora.policy.weights.items():
        assert torch.equal(a, tensor.lora.policy.weights[key][0])
        assert torch.equal(b, tensor.lora.policy.weights[key][1])
    ids = PROMPTS[1]
    got = disk.full_pass_logits(ids, start=1)
    assert torch.equal(got, tensor.full_pass_logits(ids, start=1))
    torch.testing.assert_close(got, peft_logits(peft_model, ids)[:-1], atol=1e-5, rtol=0)
    assert disk.model_path == tiny_model_dir  # the base weights stay


@pytest.mark.parametrize("deterministic", [False, True])
def test_bucketed_tensor_sync_uploads_what_it_touches(tiny_model_dir, adapters, deterministic):
    """A bucket uploads only the fused linears it touched into the buffers holding the policy
    (the rest of it is there); one arriving while another adapter is in the buffers makes the
    whole policy current. Either way the buffers and logits end up the disk sync's, bit for
    bit."""
    from safetensors.torch import load_file

    path = adapters["full"][1]
    named = sorted(load_file(str(path / "adapter_model.safetensors")).items())
    disk = runner_of(tiny_model_dir, deterministic=deterministic)
    tensor = runner_of(tiny_model_dir, deterministic=deterministic)
    disk.load_weights(path)
    layers, uploads = tensor.lora.layers, []
    update = layers.update
    layers.update = lambda adapter, keys: (uploads.append(keys), update(adapter, keys))[1]
    q = [(n, t) for n, t in named if ".q_proj." in n]
    tensor.load_named_tensors(q)
    assert uploads == [{(i, "qkv") for i in range(tensor.spec.num_layers)}]
    assert not any(b.any() for key, (a, b) in layers.weights.items() if key[1] != "qkv")
    tensor.lora.load("qv", adapters["qv"][1])
    tensor.use_lora("qv")
    tensor.load_named_tensors([(n, t) for n, t in named if ".q_proj." not in n])
    assert len(uploads) == 1 and layers.tag == tensor.lora.policy.tag
    for key, (a, b) in disk.lora.layers.weights.items():
        assert torch.equal(a, layers.weights[key][0]) and torch.equal(b, layers.weights[key][1])
    ids = PROMPTS[1]
    assert torch.equal(disk.full_pass_logits(ids, start=1), tensor.full_pass_logits(ids, start=1))
    tensor.load_named_tensors(named[:2])  # held again: a bucket's upload
    assert uploads[-1] == {(0, "down")} and layers.tag == tensor.lora.policy.tag


def test_full_weight_load_from_disk_drops_the_policy_adapter(tiny_model_dir, adapters):
    """Base weights loaded from disk (the loop's version 0 on an engine that served an earlier
    run's policy): requests without lora_path run the new base bit for bit, named adapters
    stay."""
    from safetensors.torch import load_file

    runner, base = runner_of(tiny_model_dir), runner_of(tiny_model_dir)
    runner.lora.load("qv", adapters["qv"][1])
    runner.load_named_tensors(sorted(load_file(
        str(adapters["full"][1] / "adapter_model.safetensors")).items()))
    ids = PROMPTS[1]
    want = base.full_pass_logits(ids, start=1)
    assert not torch.equal(runner.full_pass_logits(ids, start=1), want)
    runner.load_weights(tiny_model_dir)
    assert runner.lora.policy is None
    assert [a["name"] for a in runner.lora.describe()] == ["qv"]
    assert torch.equal(runner.full_pass_logits(ids, start=1), want)
    runner.use_lora("qv")
    assert not torch.equal(runner.full_pass_logits(ids, start=1), want)


def test_tensor_sync_with_lora_config_takes_its_scale(tiny_model_dir, tmp_path):
    """lora_config with the tensors (lora_alpha 6, rank 4: scale 1.5, not the default 2): the
    disk sync's logits bit for bit; a config refused (a rank other than the tensors', DoRA, with
    base tensors) changes nothing."""
    from safetensors.torch import load_file

    _, path = make_adapter(tiny_model_dir, tiny_model_dir.parent / "lora-alpha6", r=4, alpha=6,
                           targets=ALL, seed=5)
    disk, tensor = runner_of(tiny_model_dir), runner_of(tiny_model_dir)
    disk.load_weights(path)
    named = sorted(load_file(str(path / "adapter_model.safetensors")).items())
    config = json.loads((path / "adapter_config.json").read_text())
    for bad, match in [({**config, "r": 8}, "lora_config's rank r 8"),
                       ({**config, "use_dora": True}, "use_dora")]:
        with pytest.raises(BadInputError, match=match):
            tensor.load_named_tensors(named, lora_config=bad)
    with pytest.raises(BadInputError, match="lora_config comes with LoRA tensors"):
        tensor.load_named_tensors([("model.norm.weight", torch.ones(64))], lora_config=config)
    assert tensor.lora.policy is None
    tensor.load_named_tensors(named, lora_config={"r": 4, "lora_alpha": 6})
    assert tensor.lora.policy.scaling == disk.lora.policy.scaling == 1.5
    ids = PROMPTS[1]
    assert torch.equal(disk.full_pass_logits(ids, start=1), tensor.full_pass_logits(ids, start=1))


def test_bad_adapters_and_syncs_are_refused(tiny_model_dir, adapters, tmp_path):
    runner = runner_of(tiny_model_dir)
    with pytest.raises(BadInputError, match="above --max-lora-rank"):
        PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_total_tokens=512,
                    enable_lora=True, max_lora_rank=2).lora.load("full", adapters["full"][1])
    with pytest.raises(BadInputError, match="only LoRA tensors"):
        runner.load_named_tensors([("model.norm.weight", torch.ones(64)),
                                   ("base_model.model.model.layers.0.self_attn.q_proj."
                                    "lora_A.weight", torch.ones(2, 64))])
    with pytest.raises(BadInputError, match="shape"):
        runner.load_named_tensors([("base_model.model.model.layers.0.self_attn.q_proj."
                                    "lora_A.weight", torch.ones(2, 3))])
    assert runner.lora.policy is None  # nothing half-installed
    plain = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_total_tokens=512)
    with pytest.raises(BadInputError, match="--enable-lora"):
        plain.load_weights(adapters["full"][1])
    runner.lora.load("full", adapters["full"][1])
    with pytest.raises(BadInputError, match="already loaded"):
        runner.lora.load("full", adapters["full"][1])
    with pytest.raises(BadInputError, match=r"loaded: full"):
        runner.lora.check_name("nope")
    torn = tmp_path / "torn"  # a truncated weights file: one line, not a 500
    shutil.copytree(adapters["full"][1], torn)
    weights = torn / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(BadInputError, match="unreadable adapter weights"):
        runner.lora.load("torn", torn)


def test_serve_config_lora_flags(tiny_model_dir):
    from rltool.engine.config import ServeConfig

    cfg = ServeConfig(model=tiny_model_dir, device="cpu", enable_lora=True,
                      lora_paths=[f"a={tiny_model_dir}"])
    assert cfg.lora_adapters() == {"a": tiny_model_dir}
    with pytest.raises(ValueError, match="--lora-paths and --max-lora-rank need --enable-lora"):
        ServeConfig(model=tiny_model_dir, device="cpu", lora_paths=[f"a={tiny_model_dir}"])
    with pytest.raises(ValueError, match="need --enable-lora"):
        ServeConfig(model=tiny_model_dir, device="cpu", max_lora_rank=32)
    assert ServeConfig(model=tiny_model_dir, device="cpu", enable_lora=True,
                       lora_paths=["/x/a"]).lora_adapters() == {"/x/a": Path("/x/a")}
    with pytest.raises(ValueError, match="NAME=DIR"):
        ServeConfig(model=tiny_model_dir, device="cpu", enable_lora=True,
                    lora_paths=["a=/x", "a=/y"])


def test_http_routes(tiny_model_dir, adapters, tmp_path):
    from rltool.engine.config import ServeConfig
    from tests.helpers.engines import serve_app

    admin = {"Authorization": "Bearer sekret"}
    cfg = ServeConfig(model=tiny_model_dir, device="cpu", enable_lora=True, max_lora_rank=8,
                      admin_api_key="sekret", lora_paths=[f"qv={adapters['qv'][1]}"])
    path = str(adapters["full"][1])
    with serve_app(cfg) as (client, runner):
        body = {"lora_name": "full", "lora_path": path}
        assert client.post("/load_lora_adapter", json=body).status_code == 401
        outside = client.post("/load_lora_adapter", headers=admin,
                              json={"lora_name": "x", "lora_path": str(tmp_path)})
        assert outside.status_code == 403 and "allowed weight roots" in outside.json()[
            "error_message"]
        r = client.post("/load_lora_adapter", headers=admin, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["loaded_adapters"] == {"qv": str(adapters["qv"][1]), "full": path}
        info = client.get("/get_server_info").json()["lora_adapters"]
        assert [(a["name"], a["rank"]) for a in info] == [("qv", 2), ("full", 4)]

        gen = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 4,
                                                            "temperature": 0}}
        unknown = client.post("/generate", json={**gen, "lora_path": "nope"})
        assert unknown.status_code == 400 and "loaded: full, qv" in unknown.text
        out = client.post("/generate", json={**gen, "lora_path": "full"}).json()
        want = greedy(runner_with(tiny_model_dir, "full", adapters["full"][1]), [PROMPTS[0]],
                      ["full"], new=4)
        assert out["output_ids"] == want[0].output_ids
        chat = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4,
                                                    "temperature": 0, "lora_path": "full"})
        assert chat.status_code == 200, chat.text

        # An adapter a waiting request names stays (409) until the request has run.
        assert client.post("/pause_generation", headers=admin,
                           json={"mode": "in_place"}).status_code == 200
        waiting = runner_request(client, gen, "full")
        busy = client.post("/unload_lora_adapter", headers=admin, json={"lora_name": "full"})
        assert busy.status_code == 409 and "in use" in busy.json()["error_message"]
        assert client.post("/continue_generation", headers=admin, json={}).status_code == 200
        waiting.join(60)
        gone = client.post("/unload_lora_adapter", headers=admin, json={"lora_name": "full"})
        assert gone.status_code == 200 and gone.json()["loaded_adapters"] == {
            "qv": str(adapters["qv"][1])}
        again = client.post("/unload_lora_adapter", headers=admin, json={"lora_name": "full"})
        assert again.status_code == 400 and "nothing to unload" in again.json()["error_message"]

        # A LoRA weight sync from disk: the policy adapter, run by requests without lora_path.
        sync = client.post("/update_weights_from_disk", headers=admin,
                           json={"model_path": path, "weight_version": "7"})
        assert sync.status_code == 200, sync.text
        info = client.get("/get_server_info").json()
        assert info["weight_version"] == "7" and info["lora_adapters"][0]["name"] == "policy"
        assert info["model_path"] == str(tiny_model_dir)  # the base stays
        out = client.post("/generate", json=gen).json()
        assert out["output_ids"] == want[0].output_ids
        assert out["meta_info"]["weight_version"] == "7"

        # An in-memory LoRA sync with the adapter's config: its scale lora_alpha / r.
        from safetensors.torch import load_file

        from rltool.delta import tensor_sync

        named = sorted(load_file(str(adapters["full"][1] / "adapter_model.safetensors")).items())
        with tensor_sync.ShmSegment(tensor_sync.segment_bytes(named, bucket_bytes=1 << 30)) as buf:
            message = json.dumps(buf.write(named, dtype=None))
            sync = client.post("/update_weights_from_tensor", headers=admin, json={
                "serialized_named_tensors": [message], "load_format": "rltool_shm",
                "lora_config": {"r": 4, "lora_alpha": 3}})
        assert sync.status_code == 200, sync.text
        assert client.get("/get_server_info").json()["lora_adapters"][0]["scaling"] == 0.75

        # Base weights from disk drop the policy adapter.
        base = client.post("/update_weights_from_disk", headers=admin,
                           json={"model_path": str(tiny_model_dir)})
        assert base.status_code == 200, base.text
        assert [a["name"] for a in client.get("/get_server_info").json()["lora_adapters"]] \
            == ["qv"]


def runner_with(model_dir, name, path):
    runner = runner_of(model_dir)
    runner.lora.load(name, path)
    return runner


def runner_request(client, gen, lora):
    """A /generate call with `lora_path` on a thread (it waits while generation is paused),
    started once the scheduler holds it."""
    import time

    sched = client.app.state.engine.scheduler
    before = len(sched.waiting)
    t = threading.Thread(target=client.post, args=("/generate",),
                         kwargs={"json": {**gen, "lora_path": lora}})
    t.start()
    deadline = time.monotonic() + 30
    while len(sched.waiting) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(sched.waiting) > before
    return t


def test_lora_is_refused_where_the_engine_does_not_compute_it(tiny_model_dir, tmp_path):
    """A hybrid linear-attention model and a block-FP8 checkpoint: one line naming the flag."""
    import json
    import shutil

    from tests.helpers.hybrid import make_hybrid

    with pytest.raises(BadInputError, match="drop --enable-lora"):
        runner_of(make_hybrid(tmp_path / "hybrid"), prefix_cache=False)
    fp8 = shutil.copytree(tiny_model_dir, tmp_path / "fp8")
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [32, 32]}
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInputError, match="drop --enable-lora"):
        runner_of(fp8)
    from click.testing import CliRunner

    from rltool.cli import main

    result = CliRunner().invoke(main, ["serve", "--device", "cpu", "--model", str(fp8),
                                       "--enable-lora", "--port", "0"])
    assert result.exit_code == 2 and "drop --enable-lora" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_request_of_an_adapter_unloaded_before_it_ran_ends_with_400(tiny_model_dir, adapters):
    """An adapter unloaded between a request's check and its prefill: the request ends with
    status 400 (never runs on another adapter); the base request beside it completes."""
    runner = runner_of(tiny_model_dir)
    runner.lora.load("full", adapters["full"][1])
    sched = PagedScheduler(runner, max_running=8, max_prefill_tokens=64)
    done = threading.Event()
    finished = []

    def on_finish(req):
        finished.append(req)
        if len(finished) == 2:
            done.set()

    reqs = [Request(rid=f"u{i}", prompt_ids=PROMPTS[i], lora=lora, on_finish=on_finish,
                    params=SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
            for i, lora in enumerate(["full", None])]
    sched.submit(reqs)
    runner.lora.unload("full")
    sched.start()
    try:
        assert done.wait(60)
    finally:
        sched.stop()
    assert reqs[0].finish_reason["status_code"] == 400
    assert "unloaded" in reqs[0].finish_reason["message"] and not reqs[0].output_ids
    assert reqs[1].finish_reason["type"] == "length" and len(reqs[1].output_ids) == 3


def test_tensor_sync_over_http_installs_the_policy_adapter(tiny_model_dir, adapters):
    """/update_weights_from_tensor (shared memory, in several buckets) with PEFT-named adapter
    tensors: the policy adapter a disk sync of the same directory installs, bit for bit, under
    the new weight version; the base weights are untouched."""
    import json

    from safetensors.torch import load_file

    from rltool.delta import tensor_sync
    from rltool.engine import api
    from rltool.engine.config import ServeConfig
    from tests.helpers.engines import serve_app

    path = adapters["full"][1]  # lora_alpha 2 x rank: the scale a first tensor sync takes
    named = sorted(load_file(str(path / "adapter_model.safetensors")).items())
    cfg = ServeConfig(model=tiny_model_dir, device="cpu", enable_lora=True, max_lora_rank=8)
    disk = runner_of(tiny_model_dir)
    disk.load_weights(path)
    with serve_app(cfg) as (client, runner):
        embed = runner.model.embed.clone()
        groups = tensor_sync.buckets(named, bucket_bytes=8192)
        assert len(groups) > 2
        with tensor_sync.ShmSegment(tensor_sync.segment_bytes(named, bucket_bytes=8192)) as seg:
            for i, bucket in enumerate(groups):
                body = {"serialized_named_tensors": [json.dumps(seg.write(bucket))],
                        "load_format": api.SHM_FORMAT,
                        "weight_version": "3" if i == len(groups) - 1 else None}
                r = client.post(api.UPDATE_WEIGHTS_FROM_TENSOR, json=body)
                assert r.status_code == 200, r.text
        assert client.get(api.WEIGHT_VERSION).json()["weight_version"] == "3"
        for key, (a, b) in disk.lora.policy.weights.items():
            assert torch.equal(a, runner.lora.policy.weights[key][0])
            assert torch.equal(b, runner.lora.policy.weights[key][1])
        assert torch.equal(runner.model.embed, embed)


def test_two_adapters_under_kv_pressure_retract_instead_of_failing(tiny_model_dir, adapters):
    """A pool too small for every request at once, requests of two adapters interleaved, the
    oldest one short: once it ends, the oldest in flight is the other adapter's, whose requests
    then decode while the first adapter's running ones wait holding pages (and retracted ones,
    admitted again, claim cached pages while they wait to prefill). The page shortage of such a
    step sends those idle requests back to the queue (newest first), so every request finishes
    with the tokens it gets alone instead of the step running out of pages (500 for all)."""
    prompts = [[(7 * i + 3 * j) % 50 + 1 for j in range(10)] for i in range(6)]  # no shared prefix
    loras = ["full", "qv"] * 3
    runner = runner_of(tiny_model_dir, max_total_tokens=64)
    for name in ("full", "qv"):
        runner.lora.load(name, adapters[name][1])
    reqs = greedy_requests(prompts, "r", new=40, loras=loras)
    reqs[0].params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    sched = PagedScheduler(runner, max_running=8, max_prefill_tokens=64)
    run_all(sched, reqs)
    assert all(r.finish_reason["type"] == "length" for r in reqs), [r.finish_reason for r in reqs]
    assert sched.stats()["num_retractions"] > 0
    for req, prompt, lora in zip(reqs, prompts, loras):
        alone = runner_of(tiny_model_dir)
        alone.lora.load(lora, adapters[lora][1])
        new = req.params.max_new_tokens
        assert req.output_ids == greedy(alone, [prompt], [lora], new=new)[0].output_ids
