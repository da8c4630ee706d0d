"""The planner's cost models against hand-computed examples: a dense, a MoE and a hybrid
(Qwen3-Next-style) config written here, and every validation error."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rltool.cli import main as cli
from rltool.errors import BadInputError
from rltool.profile import caches, models
from rltool.profile.modelcfg import shape_from_config
from rltool.profile.plan import PlanInputs, run_models

DENSE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 60,
         "tie_word_embeddings": False}
MOE = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
       "intermediate_size": 64, "moe_intermediate_size": 16, "n_routed_experts": 8,
       "n_shared_experts": 1, "first_k_dense_replace": 1, "vocab_size": 100,
       "tie_word_embeddings": True}
HYBRID = {"hidden_size": 32, "num_hidden_layers": 4, "full_attention_interval": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "intermediate_size": 64, "vocab_size": 100, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
          "linear_conv_kernel_dim": 4}
GIB = 1024 ** 3


def test_dense_parameter_count():
    # embeddings 2*60*64 = 7680; attention 3*4096 = 12288; MLP 3*64*128 = 24576 per layer
    assert shape_from_config(DENSE).params() == {"dense": 7680 + 2 * (12288 + 24576),
                                                 "expert": 0}


def test_moe_parameter_count_and_memory():
    shape = shape_from_config(MOE)
    # tied embeddings 3200; attention 4*32*32 = 4096 x 4 layers; 1 dense MLP 3*32*64 = 6144;
    # 3 MoE layers of router 32*8 + shared expert 3*32*16 = 1792; experts 3*8*3*32*16
    assert shape.params() == {"dense": 3200 + 16384 + 6144 + 3 * 1792, "expert": 36864}
    mem = models.trainer_memory(shape, gpus=8, tp=2, pp=1, cp=1, ep=4, etp=1,
                                micro_batch_tokens=1000, recompute="full")
    per_gpu = 31104 / 2 + 36864 / 4  # dense over TP, experts over ETP*EP
    assert mem["weights"] == pytest.approx(2 * per_gpu)
    assert mem["gradients"] == pytest.approx(4 * per_gpu)
    # dense optimizer over DP = 8/2 = 4, experts over expert DP = 8/4 = 2
    assert mem["optimizer"] == pytest.approx(12 * (15552 / 4 + 9216 / 2))
    assert mem["activations"] == pytest.approx(1000 * 32 * 4 * 2 / 2)


def test_divisibility_names_each_violation():
    assert models.divisibility(gpus=8, gpus_per_node=8, tp=2, pp=1, cp=1, ep=4, etp=1,
                               experts=8) == []
    problems = models.divisibility(gpus=8, gpus_per_node=8, tp=3, pp=1, cp=1, ep=3, etp=1,
                                   experts=8)
    assert "TP*PP*CP=3 does not divide 8 GPUs" in problems
    assert "TP=3 must divide the 8 GPUs of a node" in problems
    assert "ETP*EP*PP=3 does not divide 8 GPUs" in problems
    assert "EP=3 does not divide 8 experts" in problems


def test_placement_says_when_a_layout_does_not_fit():
    shape = shape_from_config(DENSE)
    result = models.placement(shape, gpus=2, gpus_per_node=8, rollout_gpus=1, tp=1, pp=1, cp=1,
                              ep=1, etp=1, engine_tp=1, gpu_memory_gib=1e-6, mem_fraction=0.9,
                              micro_batch_tokens=10, recompute="none")
    assert [r["fits"] for r in result["rows"]] == [False, False]
    assert "trainer needs" in result["rows"][0]["problems"]
    assert result["inputs"]["params_dense"] == 81408


def test_weight_sync_times_and_delta_break_even():
    shape = shape_from_config(DENSE)
    result = models.weight_sync(shape, weight_bits=16, bandwidth_Bps={
        "tensor": 1e11, "distributed": 2.5e10, "full": 2e9}, decode_Bps=4e9, t0_s=0.5,
        density=0.1)
    rows = {r["mode"]: r for r in result["rows"]}
    size = 81408 * 2
    assert rows["full"]["t_W_s"] == pytest.approx(size / 2e9 + 0.5)
    assert rows["tensor"]["t_W_s"] == pytest.approx(size / 1e11 + 0.5)
    # 10% of the elements, each with a 32-bit index next to its 16 bits
    assert rows["delta"]["bytes"] == pytest.approx(0.1 * size * 3)
    assert rows["delta"]["t_W_s"] == pytest.approx(0.1 * size * 3 / 2e9 + size / 4e9 + 0.5)
    # (1 - B/B_decode) / (1 + 32/16) = 0.5 / 3
    assert rows["delta break-even density"]["t_W_s"] == pytest.approx(1 / 6)


def test_async_bound():
    row = models.async_bound(t_R_s=6, t_T_s=4, t_W_s=1)["rows"][0]
    assert (row["t_sync_s"], row["t_async_bound_s"]) == (11, 7)
    assert row["speedup_bound"] == pytest.approx(11 / 7)


def test_precision_says_what_halves():
    rows = {r["tensor"]: r for r in models.precision(shape_from_config(DENSE), kv_tokens=10,
                                                     rollout_bits=8, kv_bits=16)["rows"]}
    assert rows["engine weights"]["bytes_planned"] == 81408  # P * 8 / 8
    assert rows["engine weights"]["halves"] == "yes"
    assert rows["weight sync payload"]["halves"] == "yes"
    assert rows["gradients (fp32 main grads)"]["halves"] == "no"
    assert rows["KV cache"]["bytes_bf16"] == 10 * 2 * 2 * 2 * 16 * 2


def test_hybrid_cache_sizes_and_pool_split():
    shape = shape_from_config(HYBRID)
    assert (shape.attention_layers, shape.linear_layers) == (1, 3)
    # c_A = 2 * 1 layer * 2 heads * 16 * 2 bytes
    assert caches.kv_bytes_per_token(shape, kv_bits=16) == 128
    # per linear layer: state 4*8*8 fp32 = 1024 B, conv (4-1) * (2*2*8 + 4*8) bf16 = 384 B
    assert caches.state_bytes_per_sequence(shape, ssm_bits=32, conv_bits=16) == 3 * 1408
    row = caches.hybrid_cache(shape, tokens=1000, sequences=10, pool_gib=1.0, ratio=1.0,
                              kv_bits=16, ssm_bits=32, conv_bits=16)["rows"][0]
    assert row["B_cache_gib"] * GIB == pytest.approx(1000 * 128 + 10 * 4224)
    assert row["B_A_gib"] == row["B_R_gib"] == pytest.approx(0.5)
    assert row["max_tokens"] == GIB // 2 // 128
    assert row["max_sequences"] == GIB // 2 // 4224


def test_prefill_decode_split_and_bound():
    shape = shape_from_config(DENSE)
    assert caches.pd_split(4, mu_p=10, mu_d=5) == 1  # min(10,15)=10 ties min(20,10); fewer P
    assert caches.pd_split(5, mu_p=10, mu_d=5) == 2  # min(20, 15) = 15 beats min(10,20)=10
    result = caches.prefill_decode(shape, engines=4, mu_p=10, mu_d=5, prompt_tokens=100,
                                   kv_bits=16, kv_link_Bps=256000)
    assert result["inputs"]["S_KV_bytes"] == 100 * 256
    row = result["rows"][0]
    assert (row["n_P"], row["n_D"], row["kv_transfer_rps"]) == (1, 3, 10)
    assert row["lambda_max_rps"] == 10


def test_hicache_saving():
    shape = shape_from_config(DENSE)  # c_A = 256 B/token
    row = caches.hicache(shape, hit_rate=0.5, prompt_tokens=100, t_prefill_s=0.2,
                         io_Bps=1.28e6, t_book_s=0.001, kv_bits=16,
                         version_lifetime_s=30)["rows"][0]
    assert row["t_io_s"] == pytest.approx(0.01)
    assert row["saved_per_request_s"] == pytest.approx(0.1 - 0.01 - 0.001)
    assert row["worth_it"] and row["validity_window_s"] == 30


@pytest.mark.parametrize("call, message", [
    (lambda s: caches.prefill_decode(shape_from_config({**DENSE, "kv_lora_rank": 512}),
                                     engines=4, mu_p=1, mu_d=1, prompt_tokens=1, kv_bits=16,
                                     kv_link_Bps=1), "MLA/DSA"),
    (lambda s: caches.prefill_decode(s, engines=1, mu_p=1, mu_d=1, prompt_tokens=1, kv_bits=16,
                                     kv_link_Bps=1), "at least 2 engines"),
    (lambda s: caches.hybrid_cache(s, tokens=1, sequences=1, pool_gib=1, ratio=0, kv_bits=16,
                                   ssm_bits=32, conv_bits=16), "must be > 0"),
    (lambda s: caches.hicache(s, hit_rate=1.5, prompt_tokens=1, t_prefill_s=1, io_Bps=1,
                              t_book_s=0, kv_bits=16, version_lifetime_s=1), "within [0, 1]"),
    (lambda s: shape_from_config({"hidden_size": 8}), "num_hidden_layers"),
])
def test_validation_errors(call, message):
    with pytest.raises(BadInputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call(shape_from_config(DENSE))


def test_every_model_lists_its_inputs():
    out = run_models(shape_from_config(MOE), PlanInputs(gpus=8, tp=2, ep=4, pd_engines=4))
    assert [m["model"] for m in out] == ["placement", "weight_sync", "async", "precision",
                                         "hybrid_cache", "prefill_decode", "hicache"]
    assert all(m["inputs"] and m["rows"] for m in out)


def test_plan_command_json_and_errors(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(DENSE))
    ok = CliRunner().invoke(cli, ["plan", "--model", str(config), "--gpus", "2", "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["models"][0]["inputs"]["gpus"] == 2
    for args, message in ((["plan"], "needs --model"),
                          (["plan", "--model", str(tmp_path / "none.json")], "no such file"),
                          (["plan", "--model", str(config), "--density", "2"], "density"),
                          (["plan", "--model", str(config), "--recompute", "some"], "recompute")):
        bad = CliRunner().invoke(cli, args)
        assert bad.exit_code == 2 and message in bad.output, (args, bad.output)


def test_saturation_is_where_more_concurrency_stops_paying():
    from rltool.profile.recommend import saturation_concurrency

    assert saturation_concurrency({1: 100, 2: 190, 4: 300, 8: 310, 16: 312}) == 4
    assert saturation_concurrency({1: 100, 2: 200, 7: 700, 8: 800}) == 8  # still climbing
    assert saturation_concurrency({}) is None


def test_recommendations_cap_concurrency_by_kv_memory_and_size_chunks_by_p90():
    from rltool.profile.recommend import recommend

    # two requests of one engine, fully overlapping: 100 prompt + 28 completion tokens each
    events = [{"name": "generate", "cat": "request", "ph": "X", "ts": 0, "dur": 1e6, "pid": 1,
               "tid": 1, "_role": "loop", "args": {"engine": "e", "prompt_tokens": 100,
                                                   "completion_tokens": 28, "cached_tokens": 50}}
              for _ in range(2)]
    result = recommend(events, kv_pool_tokens=256)
    rows = {r["setting"]: r for r in result["rows"]}
    assert rows["concurrency per engine"]["value"] == 2  # min(256 // 128, saturation 2)
    assert recommend(events, kv_pool_tokens=128)["rows"][0]["value"] == 1  # memory-bound
    assert rows["chunked prefill size"]["value"] == 128  # p90 prompt 100 -> 128
    assert result["inputs"]["prefix_hit_rate"] == 0.5
    assert result["inputs"]["throughput_by_concurrency"] == {"2": 56.0}


def test_model_file_errors(tmp_path):
    from rltool.profile.modelcfg import load_shape

    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "hybrid.json").write_text(json.dumps(
        {k: v for k, v in HYBRID.items() if k != "linear_value_head_dim"}))
    for name, message in (("bad.json", "not valid JSON"), ("list.json", "not a JSON object"),
                          ("hybrid.json", "linear-attention layers without"),
                          ("none.json", "no such file")):
        with pytest.raises(BadInputError, match=message):
            load_shape(tmp_path / name)
