"""HF <-> torch_dist: name/layout maps, logits against transformers, TP/PP/EP with gloo processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from rltool.cli import main
from rltool.convert import name_map
from rltool.errors import CheckpointError
from tests.convert import megatron_rules

ARCHS = ("qwen2", "qwen3", "llama", "qwen3_moe")
WORKER = Path(__file__).with_name("dist_worker.py")


def _config(hf_dir):
    return json.loads((Path(hf_dir) / "config.json").read_text())


def _hf_tensors(hf_dir):
    from safetensors.torch import load_file

    return load_file(str(Path(hf_dir) / "model.safetensors"))


@pytest.mark.parametrize("arch", ARCHS)
def test_layout_round_trip_matches_reference_loops(arch, tiny_model_factory):
    """Fusing q/k/v per query group and gate/up into fc1, checked element by element."""
    hf_dir = tiny_model_factory(arch)
    cfg, tensors = _config(hf_dir), _hf_tensors(hf_dir)
    shapes = name_map.Shapes.from_hf(cfg)
    name_map.check_hf_tensors({n: tuple(t.shape) for n, t in tensors.items()}, cfg)
    q, k, v = (tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    fused = name_map.to_megatron("qkv", [q, k, v], shapes=shapes, padded_vocab=0)
    per_group, d = shapes.num_heads // shapes.num_groups, shapes.head_dim
    row = 0
    for g in range(shapes.num_groups):  # reference: walk the groups row by row
        for h in range(per_group):
            for i in range(d):
                assert torch.equal(fused[row], q[(g * per_group + h) * d + i])
                row += 1
        for src in (k, v):
            for i in range(d):
                assert torch.equal(fused[row], src[g * d + i])
                row += 1
    assert row == fused.shape[0]
    back = name_map.to_hf("qkv", fused, shapes=shapes)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))
    emb = tensors["model.embed_tokens.weight"]
    padded = name_map.to_megatron("vocab", [emb], shapes=shapes, padded_vocab=256)
    assert padded.shape[0] == 256 and torch.equal(padded[: emb.shape[0]], emb)
    assert not padded[emb.shape[0]:].any()
    assert torch.equal(name_map.to_hf("vocab", padded, shapes=shapes)[0], emb)


def test_checkpoint_shape_errors_name_the_tensor(tiny_model_factory):
    cfg = _config(tiny_model_factory("qwen2"))
    found = {n: s for n, s in name_map.expected_hf_shapes(cfg).items()}
    del found["model.layers.1.mlp.up_proj.weight"]
    found["model.layers.0.self_attn.k_proj.weight"] = (31, 64)
    with pytest.raises(CheckpointError, match="missing model.layers.1.mlp.up_proj.weight.*"
                                              "k_proj.weight is \\[31, 64\\]"):
        name_map.check_hf_tensors(found, cfg)


def _assert_megatron_loads(tmp_path, results, hf_dirs, sizes):
    """Every checkpoint the worker wrote passes Megatron-LM's loading rules for its layout."""
    for name, hf_dir, size in zip(sorted(results), hf_dirs, sizes, strict=True):
        tp, pp, ep = map(int, size.split(","))
        run = megatron_rules.slime_run_args(hf_dir, tp=tp, pp=pp, ep=ep)
        assert megatron_rules.load_problems(tmp_path / f"{name}-dist", run) == [], name


def _run_worker(tmp_path, hf_dirs, *, nproc=1, extra=()):
    result = tmp_path / "result.json"
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
              if nproc > 1 else [sys.executable])
    cmd = [*launch, str(WORKER), "--hf", *map(str, hf_dirs), "--work", str(tmp_path),
           "--result", str(result), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(result.read_text())


@pytest.mark.slow
def test_single_process_logits_and_bit_exact_round_trip(tmp_path, tiny_model_factory):
    """Every architecture: megatron GPTModel logits == transformers within 1e-5; HF->dist->HF exact."""
    hf_dirs = [tiny_model_factory(a) for a in ARCHS]
    results = _run_worker(tmp_path, hf_dirs)
    assert set(results) == {f"{i}-tiny-{a}-0" for i, a in enumerate(ARCHS)}
    _assert_megatron_loads(tmp_path, results, hf_dirs, ["1,1,1"] * len(ARCHS))
    for name, r in results.items():
        assert r["logits_error"] < 1e-5, (name, r)
        assert r["mismatched"] == [], (name, r)
        assert r["padded_vocab_size"] == 128


@pytest.mark.slow
def test_two_gloo_processes(tmp_path, tiny_model_factory):
    """Two ranks write and load: TP=2 (vocab padded to 256, q/k/v groups, fc1 halves and experts
    split), PP=2 (layers split, activations sent between stages) and EP=2 (experts split)."""
    layouts = [("qwen2", "2,1,1"), ("qwen3_moe", "2,1,1"), ("qwen3", "1,2,1"),
               ("qwen3_moe", "1,1,2")]
    hf_dirs = [tiny_model_factory(a) for a, _ in layouts]
    results = _run_worker(tmp_path, hf_dirs, nproc=2, extra=("--sizes", *[s for _, s in layouts]))
    assert len(results) == len(layouts)
    _assert_megatron_loads(tmp_path, results, hf_dirs, [s for _, s in layouts])
    for (name, r), (_, size) in zip(sorted(results.items()), layouts, strict=True):
        assert r["logits_error"] < 1e-5, (name, r)
        assert r["mismatched"] == [], (name, r)
        assert r["padded_vocab_size"] == (256 if size.startswith("2") else 128)


def _embedding_rows(release_dir, rows, width):
    import torch.distributed.checkpoint as dcp

    state = {"embedding.word_embeddings.weight": torch.full((rows, width), float("nan"))}
    dcp.load(state, checkpoint_id=str(release_dir))
    return state["embedding.word_embeddings.weight"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_cli_hf_to_dist_and_back(tmp_path, tiny_model_factory):
    """The release/ layout Megatron-LM loads (rules as reference data), zero padding rows, and
    dist -> HF back bit for bit."""
    hf_dir = tiny_model_factory("qwen3")
    runner = CliRunner()
    res = runner.invoke(main, ["convert", "hf-to-dist", "--hf", str(hf_dir), "--out",
                               str(tmp_path / "d"), "--tp", "2", "--json", "-q"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["padded_vocab_size"] == 256
    assert (tmp_path / "d" / "latest_checkpointed_iteration.txt").read_text() == "release"
    run = megatron_rules.slime_run_args(hf_dir, tp=2, pp=1, ep=1)
    assert megatron_rules.load_problems(tmp_path / "d", run) == []
    # a run at another TP, or one that forgot --qk-layernorm, is told so by the recorded args
    assert megatron_rules.load_problems(tmp_path / "d", {**run, "tensor_model_parallel_size": 1})
    assert megatron_rules.load_problems(tmp_path / "d", {**run, "qk_layernorm": False})
    vocab, width = _config(hf_dir)["vocab_size"], _config(hf_dir)["hidden_size"]
    emb = _embedding_rows(tmp_path / "d" / "release", 256, width)
    assert torch.equal(emb[:vocab], _hf_tensors(hf_dir)["model.embed_tokens.weight"])
    assert torch.equal(emb[vocab:], torch.zeros(256 - vocab, width))
    res = runner.invoke(main, ["convert", "dist-to-hf", "--dist", str(tmp_path / "d"),
                               "--hf-config", str(hf_dir), "--out", str(tmp_path / "b"), "-q"])
    assert res.exit_code == 0, res.output
    src, back = _hf_tensors(hf_dir), _hf_tensors(tmp_path / "b")
    assert src.keys() == back.keys() and all(torch.equal(src[k], back[k]) for k in src)
    assert (tmp_path / "b" / "tokenizer.json").exists()
    # a wrong --hf-config is refused before anything is written
    res = runner.invoke(main, ["convert", "dist-to-hf", "--dist", str(tmp_path / "d"),
                               "--hf-config", str(tiny_model_factory("qwen3_moe")),
                               "--out", str(tmp_path / "c")])
    assert res.exit_code == 2 and "torch_dist checkpoint lacks" in res.output
    assert not (tmp_path / "c").exists()


def test_older_and_trained_layouts_still_read(tmp_path, tiny_model_factory, caplog):
    """rltool reads an older conversion (iter_0000000, tracker 0) with a one-line notice, a
    trainer's iter_NNNNNNN (>= 1), and refuses trackers Megatron-LM refuses too."""
    from rltool.convert import megatron_layout
    from rltool.convert.torch_dist import iteration_dir

    hf_dir = tiny_model_factory("qwen2")
    res = CliRunner().invoke(main, ["convert", "hf-to-dist", "--hf", str(hf_dir), "--out",
                                    str(tmp_path / "d"), "--make-vocab-size-divisible-by", "32",
                                    "--tp", "2", "--json", "-q"])
    assert res.exit_code == 0, res.output
    vocab = _config(hf_dir)["vocab_size"]
    assert json.loads(res.stdout)["padded_vocab_size"] == -(-vocab // 64) * 64
    root, tracker = tmp_path / "d", tmp_path / "d" / "latest_checkpointed_iteration.txt"
    (root / "release").rename(root / "iter_0000000")
    tracker.write_text("0")
    with caplog.at_level("WARNING"):
        assert iteration_dir(root) == root / "iter_0000000"
    assert [r.message.count("\n") for r in caplog.records] == [0]
    assert "older rltool conversion" in caplog.text
    assert megatron_rules.load_problems(root, {}) == ["tracker holds '0': neither an iteration "
                                                      "> 0 nor 'release'"]
    (root / "iter_0000000").rename(root / megatron_layout.iteration_dir_name(12))
    tracker.write_text("12\n")
    assert iteration_dir(root) == root / "iter_0000012"
    for text in ("0", "-3", "latest"):
        tracker.write_text(text)
        with pytest.raises(CheckpointError, match="release` or an iteration >= 1"):
            iteration_dir(root)
    with pytest.raises(CheckpointError, match="iteration 0 cannot be saved"):
        megatron_layout.iteration_dir_name(0)
    res = CliRunner().invoke(main, ["convert", "dist-to-hf", "--dist", str(root), "--hf-config",
                                    str(hf_dir), "--out", str(tmp_path / "b"), "-q"])
    assert res.exit_code == 2 and "latest" in res.output
    assert not (tmp_path / "b").exists()


def test_cli_refuses_bad_checkpoint_without_output(tmp_path, tiny_model_factory):
    import shutil

    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_factory("llama"), bad)
    tensors = _hf_tensors(bad)
    del tensors["model.layers.0.mlp.gate_proj.weight"]
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(bad / "model.safetensors"))
    res = CliRunner().invoke(main, ["convert", "hf-to-dist", "--hf", str(bad), "--out",
                                    str(tmp_path / "out")])
    assert res.exit_code == 2
    assert "missing model.layers.0.mlp.gate_proj.weight" in res.output
    assert "model.norm.weight is [3], expected [64]" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_missing_megatron_fails_with_clear_error(tmp_path, tiny_model_factory, monkeypatch):
    """Without megatron-core the command exits 3 naming the install, and writes nothing."""
    for mod in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "megatron", None)  # makes `import megatron...` fail
    res = CliRunner().invoke(main, ["convert", "hf-to-dist", "--hf",
                                    str(tiny_model_factory("qwen2")), "--out", str(tmp_path / "o")])
    assert res.exit_code == 3
    assert "megatron-core is required" in res.output and "rltool[megatron]" in res.output
    assert not (tmp_path / "o").exists()


def test_cpu_rng_tracker_forks_like_megatrons():
    """The compat layer's tracker: a forked region draws from its own stream and leaves the
    default CPU stream exactly where it was (what megatron's dropout and init rely on)."""
    from megatron.core import tensor_parallel

    from rltool import megatron_compat

    with megatron_compat.distributed(seed=5):
        tracker = tensor_parallel.get_cuda_rng_tracker()
        state = torch.get_rng_state()
        expected_default = torch.rand(4)
        torch.set_rng_state(state)
        with tracker.fork():
            forked = torch.rand(4)
        assert torch.equal(torch.rand(4), expected_default)
        assert not torch.equal(forked, expected_default)
        with tracker.fork():
            assert not torch.equal(torch.rand(4), forked)  # the forked stream advanced
