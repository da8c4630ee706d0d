"""On-policy distillation in the trainer: the estimators against float64 references, teacher
specs and routes, and `rltool train` with in-process and engine-mode teachers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rltool.data.teachers import TeacherSpec, assignments, parse_teacher_specs
from rltool.errors import BadInputError, ConfigError
from rltool.train.algo.opd import full_kl, shape_advantages, topk_kl
from rltool.train.config import TrainConfig
from rltool.train.stage import recompute_logprobs, run
from tests.helpers.shards import REWARDS, make_shard, shard_rows
from tests.helpers.weights import other_tokenizer_copy


def _reference_kl(logits: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    p = torch.log_softmax(logits.double() / temperature, dim=-1)
    q = teacher.double()
    return (p.exp() * (p - q)).sum(-1)


def test_full_kl_equals_float64_reference_over_chunks():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 37, generator=gen) * 3
    teacher = torch.log_softmax(torch.randn(7, 37, generator=gen) * 3, dim=-1)
    expected = _reference_kl(logits, teacher, 0.7)
    for chunk in (1, 8, 37, 4096):
        got = full_kl(logits, teacher, temperature=0.7, chunk=chunk)
        assert torch.allclose(got.double(), expected, atol=1e-5), chunk
    assert (expected > 0).all()


def test_topk_with_the_whole_vocabulary_equals_full():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 23, generator=gen) * 2
    teacher = torch.log_softmax(torch.randn(5, 23, generator=gen), dim=-1)
    ids = logits.topk(23, dim=-1).indices
    got = topk_kl(logits, ids, teacher.gather(-1, ids), temperature=1.3)
    assert torch.allclose(got, full_kl(logits, teacher, temperature=1.3), atol=1e-6)


def test_topk_renormalises_both_sides_over_the_set():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 30, generator=gen)
    teacher = torch.log_softmax(torch.randn(4, 30, generator=gen), dim=-1)
    ids = logits.topk(5, dim=-1).indices
    p = torch.log_softmax(logits.double(), dim=-1).gather(-1, ids)
    q = teacher.double().gather(-1, ids)
    p, q = p - p.logsumexp(-1, keepdim=True), q - q.logsumexp(-1, keepdim=True)
    expected = (p.exp() * (p - q)).sum(-1)
    got = topk_kl(logits, ids, teacher.gather(-1, ids), temperature=1.0)
    assert torch.allclose(got.double(), expected, atol=1e-6)
    assert not torch.allclose(got, full_kl(logits, teacher, temperature=1.0), atol=1e-3)


def test_a_weighted_mix_is_the_weighted_sum_of_kls():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 11, generator=gen)
    teachers = [torch.log_softmax(torch.randn(6, 11, generator=gen), dim=-1) for _ in range(2)]
    mixed = full_kl(logits, 0.75 * teachers[0] + 0.25 * teachers[1], temperature=1.0)
    separate = [full_kl(logits, t, temperature=1.0) for t in teachers]
    assert torch.allclose(mixed, 0.75 * separate[0] + 0.25 * separate[1], atol=1e-6)


def test_shape_advantages_subtracts_the_sampled_log_ratio():
    out = shape_advantages([torch.tensor([1.0, 0.0])], [torch.tensor([-1.0, -2.0])],
                           [torch.tensor([-1.5, -1.0])], kl_coef=2.0)
    assert torch.equal(out[0], torch.tensor([0.0, 2.0]))


def test_teacher_specs_names_weights_and_routes():
    specs = parse_teacher_specs(["http://127.0.0.1:3000", ])
    assert specs == [TeacherSpec("teacher", "http://127.0.0.1:3000", 1.0)]
    a, b = parse_teacher_specs(["math=http://h:1@3", "code=/w/teacher@1.5"])
    assert (a.name, a.location, a.weight) == ("math", "http://h:1", 3.0)
    assert (b.name, b.location, b.weight) == ("code", "/w/teacher", 1.5)
    assert [(t.name, w) for t, w in assignments([a, b], None, {}, uid="u")] == [
        ("math", 3 / 4.5), ("code", 1.5 / 4.5)]
    assert assignments([a, b], "task", {"task": "code"}, uid="u") == [(b, 1.0)]
    with pytest.raises(BadInputError, match="metadata task='poetry' names no teacher"):
        assignments([a, b], "task", {"task": "poetry"}, uid="u")
    assert [t.name for t in parse_teacher_specs(["/a", "/b"])] == ["teacher0", "teacher1"]
    with pytest.raises(ConfigError, match="repeat"):
        parse_teacher_specs(["a=/a", "a=/b"])
    with pytest.raises(ConfigError, match="WEIGHT > 0"):
        parse_teacher_specs(["x=/a@0"])


def test_config_checks():
    base = dict(rollouts=["r"], load="m")
    with pytest.raises(ConfigError, match="needs --opd-teacher"):
        TrainConfig(**base, opd_type="inprocess")
    assert TrainConfig(**base, opd_teacher=["/t"]).opd_type == "inprocess"
    assert TrainConfig(**base).opd_type == "off"
    with pytest.raises(ConfigError, match="need --opd-type"):
        TrainConfig(**base, opd_type="off", opd_teacher=["/t"])
    with pytest.raises(ConfigError, match="inprocess for --opd-mode topk/full"):
        TrainConfig(**base, opd_type="engine", opd_mode="full")
    with pytest.raises(ConfigError, match="leaves no signal"):
        TrainConfig(**base, advantage_estimator="none")
    assert TrainConfig(**base, opd_teacher=["/t"], opd_mode="full").micro_batch_layout == "padded"
    with pytest.raises(ConfigError, match="engine-mode distillation"):
        TrainConfig(**base, backend="megatron", opd_teacher=["/t"])
    assert TrainConfig(**base, backend="megatron", opd_type="engine").opd_type == "engine"
    with pytest.raises(ConfigError, match="--micro-batch-layout padded"):
        TrainConfig(**base, opd_teacher=["/t"], opd_mode="topk", micro_batch_layout="packed")


@pytest.fixture(scope="module")
def teacher_dir(other_weights_dir):
    return other_weights_dir


def _masked_mean(diffs: list[list[float]], masks: list[list[int]]) -> float:
    total = sum(d * m for ds, ms in zip(diffs, masks) for d, m in zip(ds, ms))
    return total / sum(m for ms in masks for m in ms)


def _train(tmp_path: Path, shard: Path, model: Path, name: str, **kw) -> dict:
    cfg = TrainConfig(rollouts=[str(shard)], load=str(model), save=str(tmp_path / name / "ckpt"),
                      lr=1e-3, **kw)
    return run(cfg).metrics[0]


def test_inprocess_sampled_penalises_the_sampled_log_ratio(tmp_path, tiny_model_dir, teacher_dir,
                                                          train_shard):
    rows = shard_rows(REWARDS)
    masks = [r["loss_mask"] for r in rows]
    student = recompute_logprobs(tiny_model_dir, [train_shard], max_tokens_per_microbatch=4096,
                                 deterministic=True)
    teacher = recompute_logprobs(teacher_dir, [train_shard], max_tokens_per_microbatch=4096,
                                 deterministic=True)
    expected = _masked_mean([[s - t for s, t in zip(ss, ts)] for ss, ts in zip(student, teacher)],
                            masks)
    m = _train(tmp_path, train_shard, tiny_model_dir, "sampled", opd_type="inprocess",
               opd_teacher=[str(teacher_dir)], advantage_estimator="none", deterministic=True)
    assert m["opd/reverse_kl"] == pytest.approx(expected, abs=1e-5)
    assert m["opd/reverse_kl/teacher"] == pytest.approx(expected, abs=1e-5)
    # A = -(log pi_s - log pi_T), ratio 1 on the first step: pg_loss is the token mean of the KL
    assert m["train/pg_loss"] == pytest.approx(expected, abs=1e-5)
    assert "train/opd_kl" not in m


def test_topk_with_k_equal_to_the_vocabulary_trains_like_full(tmp_path, tiny_model_dir,
                                                             teacher_dir, train_shard):
    common = dict(opd_type="inprocess", opd_teacher=[str(teacher_dir)], num_steps=2,
                  deterministic=True)
    full = _train(tmp_path, train_shard, tiny_model_dir, "full", opd_mode="full", **common)
    topk = _train(tmp_path, train_shard, tiny_model_dir, "topk", opd_mode="topk", opd_topk=60,
                  **common)
    assert full["train/opd_kl"] > 0
    for key in ("train/opd_kl", "train/loss", "train/grad_norm"):
        assert topk[key] == pytest.approx(full[key], rel=1e-5, abs=1e-7), key
    small = _train(tmp_path, train_shard, tiny_model_dir, "topk4", opd_mode="topk", opd_topk=4,
                   **common)
    assert small["train/opd_kl"] != pytest.approx(full["train/opd_kl"], rel=1e-3)


def _with_task(rows: list[dict], tasks: list[str]) -> list[dict]:
    for r in rows:
        r["metadata"] = json.dumps({"task": tasks[r["group_id"]]})
    return rows


def test_routed_and_mixed_teachers(tmp_path, tiny_model_dir, teacher_dir, tiny_model_factory,
                                   train_shard):
    rows = _with_task(shard_rows(REWARDS), ["a", "b", "a"])
    shard = make_shard(tmp_path / "routed" / "step-000001", tiny_model_dir, rows, temperature=0.8)
    other = tiny_model_factory("qwen2", 2)
    kl = {}
    for name, model in (("a", teacher_dir), ("b", other)):
        lps = recompute_logprobs(model, [shard], max_tokens_per_microbatch=4096,
                                 deterministic=True)
        kl[name] = lps
    student = recompute_logprobs(tiny_model_dir, [shard], max_tokens_per_microbatch=4096,
                                 deterministic=True)
    masks = [r["loss_mask"] for r in rows]

    def mean_over(name: str, keep) -> float:
        idx = [i for i, r in enumerate(rows) if keep(r)]
        return _masked_mean([[s - t for s, t in zip(student[i], kl[name][i])] for i in idx],
                            [masks[i] for i in idx])

    specs = [f"a={teacher_dir}", f"b={other}@3"]
    routed = _train(tmp_path, shard, tiny_model_dir, "routed", opd_type="inprocess",
                    opd_teacher=specs, opd_teacher_route="task", deterministic=True)
    in_a = lambda r: json.loads(r["metadata"])["task"] == "a"
    assert routed["opd/reverse_kl/a"] == pytest.approx(mean_over("a", in_a), abs=1e-5)
    assert routed["opd/reverse_kl/b"] == pytest.approx(
        mean_over("b", lambda r: not in_a(r)), abs=1e-5)
    mixed = _train(tmp_path, shard, tiny_model_dir, "mixed", opd_type="inprocess",
                   opd_teacher=specs, deterministic=True)
    every = lambda r: True
    assert mixed["opd/reverse_kl/a"] == pytest.approx(mean_over("a", every), abs=1e-5)
    assert mixed["opd/reverse_kl"] == pytest.approx(
        0.25 * mean_over("a", every) + 0.75 * mean_over("b", every), abs=1e-5)
    bad = make_shard(tmp_path / "bad" / "step-000001", tiny_model_dir,
                     _with_task(shard_rows(REWARDS), ["a", "c", "a"]), temperature=0.8)
    with pytest.raises(BadInputError, match="task='c' names no teacher"):
        _train(tmp_path, bad, tiny_model_dir, "bad", opd_type="inprocess", opd_teacher=specs,
               opd_teacher_route="task")
    assert not (tmp_path / "bad" / "ckpt").exists()


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path, tiny_model_dir, teacher_dir,
                                                    train_shard):
    other = other_tokenizer_copy(teacher_dir, tmp_path / "other-tok")
    with pytest.raises(ConfigError, match="tokenizer differs from the student's"):
        _train(tmp_path, train_shard, tiny_model_dir, "tok", opd_type="inprocess",
               opd_teacher=[str(other)])
    assert not (tmp_path / "tok").exists()


def test_engine_mode_reads_the_shards_teacher_logprobs(tmp_path, tiny_model_dir, train_shard):
    rows = shard_rows(REWARDS)
    for k, r in enumerate(rows):
        r["teacher_logprobs"] = [-0.1 * (k % 5) - j * 0.05 for j in
                                 range(len(r["response_token_ids"]))]
    shard = make_shard(tmp_path / "eng" / "step-000001", tiny_model_dir, rows, temperature=0.8)
    student = recompute_logprobs(tiny_model_dir, [shard], max_tokens_per_microbatch=4096,
                                 deterministic=True)
    expected = _masked_mean([[s - t for s, t in zip(ss, r["teacher_logprobs"])]
                             for ss, r in zip(student, rows)], [r["loss_mask"] for r in rows])
    m = _train(tmp_path, shard, tiny_model_dir, "engine", opd_type="engine", opd_kl_coef=0.5,
               advantage_estimator="none", deterministic=True)
    assert m["opd/reverse_kl"] == pytest.approx(expected, abs=1e-5)
    assert m["train/pg_loss"] == pytest.approx(0.5 * expected, abs=1e-5)
    with pytest.raises(BadInputError, match="has no teacher_logprobs"):
        _train(tmp_path, train_shard, tiny_model_dir, "missing", opd_type="engine")


def test_topk_resume_is_bit_identical(tmp_path, tiny_model_dir, teacher_dir, train_shard):
    from safetensors.torch import load_file

    cfg = dict(rollouts=[str(train_shard)], opd_teacher=[str(teacher_dir)], opd_mode="topk",
               opd_topk=5, global_batch_size=6, num_steps=4, save_interval=1, lr=1e-3,
               deterministic=True)
    full = run(TrainConfig(load=str(tiny_model_dir), save=str(tmp_path / "a"), **cfg))
    resumed = run(TrainConfig(load=str(tmp_path / "a" / "step-000002"), save=str(tmp_path / "b"),
                              **cfg))
    assert resumed.optimizer_steps == 2
    for name in ("model/model.safetensors", "data.safetensors"):
        a = load_file(tmp_path / "a" / "step-000004" / name)
        b = load_file(tmp_path / "b" / "step-000004" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert {"opd_ids", "opd_teacher", "teacher_logprobs"} <= set(a)
    for x, y in zip(full.metrics[2:], resumed.metrics):
        assert x["train/opd_kl"] == y["train/opd_kl"] and x["train/loss"] == y["train/loss"]
