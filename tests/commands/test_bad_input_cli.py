"""Bad input on the stage commands: a one-line error naming the problem and the fix, exit 2, and
nothing written on disk."""

from __future__ import annotations

import json

from click.testing import CliRunner

from rltool.cli import main


def invoke(args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_bad_input(result, *words):
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.output.splitlines() if " WARNING " not in line]  # logs
    err = "\n".join(lines).strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err


def eval_args(tmp_path, tiny_model_dir, prompts, *extra):
    """`rltool eval` with every required flag (the engine URL answers nothing)."""
    return ["eval", "--prompts", prompts, "--tokenizer", tiny_model_dir, "--out", tmp_path / "e",
            "--engines", "http://127.0.0.1:9", "--reward", "reverse", "--max-response-len", "4",
            *extra]


def prompts_file(path, n=2):
    path.write_text("".join(json.dumps({"prompt": f"reverse {i}1", "label": f"1{i}"}) + "\n"
                            for i in range(n)))
    return path


def test_inf_and_nan_floats_are_refused(tmp_path, tiny_model_dir):
    prompts = prompts_file(tmp_path / "p.jsonl")
    result = invoke(["train", "--loss", "sft", "--prompts", prompts, "--load", tiny_model_dir,
                     "--save", tmp_path / "ckpt", "--publish", tmp_path / "w", "--lr", "inf"])
    assert_bad_input(result, "--lr", "finite")
    result = invoke(eval_args(tmp_path, tiny_model_dir, prompts, "--pass-threshold", "nan"))
    assert_bad_input(result, "--pass-threshold", "finite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


def test_non_utf8_config_and_prompt_files_are_refused(tmp_path, tiny_model_dir):
    config = tmp_path / "c.toml"
    config.write_bytes(b"lr = 1\n# \xff\xfe\n")
    result = invoke(["train", "--config", config, "--loss", "sft", "--load", tiny_model_dir])
    assert_bad_input(result, str(config), "UTF-8")
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "reverse 12", "label": "21"}\n{"prompt": "\xff"}\n')
    result = invoke(eval_args(tmp_path, tiny_model_dir, prompts))
    assert_bad_input(result, "line 2", "UTF-8")
    assert not (tmp_path / "e").exists()


def test_unusable_metrics_and_out_paths_are_refused_before_anything_is_written(
        tmp_path, tiny_model_dir):
    prompts = prompts_file(tmp_path / "p.jsonl")
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("keep")
    result = invoke(eval_args(tmp_path, tiny_model_dir, prompts, "--metrics", tmp_path / "adir"))
    assert_bad_input(result, "--metrics", "is a directory")
    result = invoke(eval_args(tmp_path, tiny_model_dir, prompts, "--metrics",
                              tmp_path / "afile" / "m.jsonl"))
    assert_bad_input(result, "--metrics", "is a file, not a directory")
    result = invoke(["rollout", *eval_args(tmp_path, tiny_model_dir, prompts)[1:],
                     "--rollout-batch-size", "1", "--out", tmp_path / "afile" / "s0"])
    assert_bad_input(result, "--out", "is a file, not a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile", "p.jsonl"]
    assert not list((tmp_path / "adir").iterdir())


def test_train_outputs_at_or_under_a_file_are_refused_up_front(tmp_path, tiny_model_dir):
    prompts = prompts_file(tmp_path / "p.jsonl")
    (tmp_path / "afile").write_text("keep")
    base = ["train", "--loss", "sft", "--prompts", prompts, "--load", tiny_model_dir,
            "--lr", "1e-3"]
    result = invoke([*base, "--save", tmp_path / "run" / "ckpt", "--publish", tmp_path / "afile"])
    assert_bad_input(result, "--publish", "is a file")
    result = invoke([*base, "--save", tmp_path / "afile" / "ckpt", "--publish", tmp_path / "w"])
    assert_bad_input(result, "--save", "is a file, not a directory")
    result = invoke([*base, "--save", tmp_path / "run" / "ckpt", "--publish", tmp_path / "w",
                     "--metrics", tmp_path / "afile" / "train.jsonl"])
    assert_bad_input(result, "--metrics", "is a file, not a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "p.jsonl"]


def test_failed_publish_leaves_no_parent_directories(tmp_path):
    result = invoke(["init-model", "--arch", "bogus", "--out", tmp_path / "w" / "a" / "b" / "c"])
    assert result.exit_code == 2, result.output
    assert not list(tmp_path.iterdir())


def test_failed_stage_leaves_no_trace_directory_it_created(tmp_path):
    from rltool import trace

    trace_dir = tmp_path / "r" / "trace"
    try:
        with trace.scope(trace_dir, role="rollout"):
            trace.writer().complete("step", cat="stage", start_us=0.0, dur_us=1.0)
            trace.flush()
            assert trace_dir.is_dir()
            raise RuntimeError("the stage failed")
    except RuntimeError:
        pass
    assert not list(tmp_path.iterdir())
    (tmp_path / "keep" / "trace").mkdir(parents=True)
    with trace.scope(tmp_path / "keep" / "trace", role="rollout"):
        trace.writer().complete("step", cat="stage", start_us=0.0, dur_us=1.0)
    assert [p.name for p in (tmp_path / "keep" / "trace").iterdir()] == [
        f"rollout-{__import__('os').getpid()}.jsonl"]


def test_align_gate_report_at_a_directory_names_the_flag(tmp_path):
    (tmp_path / "adir").mkdir()
    result = invoke(["align-gate", "--rollouts", tmp_path / "none", "--weights", tmp_path / "w",
                     "--report", tmp_path / "adir"])
    assert_bad_input(result, "--report", "is a directory")


def test_engine_urls_are_checked_up_front(tmp_path, tiny_model_dir):
    prompts = prompts_file(tmp_path / "p.jsonl")
    rollout = ["rollout", *eval_args(tmp_path, tiny_model_dir, prompts)[1:],
               "--rollout-batch-size", "1"]
    for url in ("http://[::1", "notaurl", "ftp://x", "http://h:port"):
        assert_bad_input(invoke([*rollout, "--engines", url]), "--engines", "http://HOST:PORT")
    assert_bad_input(invoke([*rollout, "--opd-teacher", "t=notaurl"]), "--opd-teacher",
                     "http://HOST:PORT")
    assert_bad_input(invoke(["align-gate", "--rollouts", tmp_path / "none", "--weights",
                             tmp_path / "w", "--layerwise", "--engine", "ftp://x"]),
                     "--engine", "http://HOST:PORT")
    assert_bad_input(invoke(["plan", "--check-engine", "http://[::1"]), "--check-engine",
                     "http://HOST:PORT")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


def test_plan_names_the_flag_of_a_bad_value():
    assert_bad_input(invoke(["plan", "--model", "config.json", "--gpus", "0"]),
                     "--gpus: Input should be greater than or equal to 1")
    assert_bad_input(invoke(["plan", "--model", "config.json", "--t-book-s", "nan"]),
                     "--t-book-s: Input should be a finite number")


def test_corrupt_weights_are_refused_without_a_traceback(tmp_path, tiny_model_dir):
    import shutil

    prompts = prompts_file(tmp_path / "p.jsonl")
    for name, keep in (("garbage", 1000), ("truncated", None)):
        weights = tmp_path / name
        shutil.copytree(tiny_model_dir, weights)
        data = (weights / "model.safetensors").read_bytes()
        (weights / "model.safetensors").write_bytes(data[:keep or len(data) // 2])
        result = invoke(["train", "--loss", "sft", "--prompts", prompts, "--load", weights,
                         "--lr", "1e-3", "--save", tmp_path / "run" / "ckpt", "--publish",
                         tmp_path / "run" / "w"])
        assert_bad_input(result, "--load", "model.safetensors")
        assert not (tmp_path / "run").exists()


def test_torch_backend_names_a_corrupt_weights_file(tmp_path, tiny_model_dir):
    import shutil

    import pytest

    from rltool.errors import CheckpointError
    from rltool.train.config import TrainConfig
    from rltool.train.torch_backend import TorchBackend

    weights = tmp_path / "w"
    shutil.copytree(tiny_model_dir, weights)
    (weights / "model.safetensors").write_bytes(b"not a safetensors file")
    options = TrainConfig(loss="sft", prompts="p.jsonl", load=str(weights), lr=1e-3)
    with pytest.raises(CheckpointError, match="cannot load the model"):
        TorchBackend(weights, options=options, trainable=False)


def test_unloadable_tokenizer_is_one_line(tmp_path):
    prompts = prompts_file(tmp_path / "p.jsonl")
    (tmp_path / "empty").mkdir()
    result = invoke(eval_args(tmp_path, tmp_path / "empty", prompts))
    assert_bad_input(result, "--tokenizer", "cannot load a tokenizer")
    assert not (tmp_path / "e").exists()


def test_nproc_per_node_must_be_positive(tmp_path, tiny_model_dir):
    for n in ("0", "-2"):
        result = invoke(["train", "--loss", "sft", "--prompts", tmp_path / "p.jsonl", "--load",
                         tiny_model_dir, "--lr", "1e-3", "--nproc-per-node", n])
        assert result.exit_code == 2 and "--nproc-per-node" in result.output, result.output


def test_existing_outputs_are_never_replaced(tmp_path):
    keep = tmp_path / "keep.jsonl"
    keep.write_text("keep")
    result = invoke(["data", "make", "--task", "reverse", "--num", "3", "--out", keep])
    assert_bad_input(result, "--out", "already exists")
    (tmp_path / "run" / "trace").mkdir(parents=True)
    result = invoke(["profile", tmp_path / "run", "--out", keep])
    assert_bad_input(result, "--out", "already exists")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "index.html").write_text("keep")
    result = invoke(["report", tmp_path / "run", "--out", tmp_path / "site"])
    assert_bad_input(result, "--out", "already holds a report")
    assert keep.read_text() == "keep" and (tmp_path / "site" / "index.html").read_text() == "keep"
    assert [p.name for p in (tmp_path / "site").iterdir()] == ["index.html"]


def test_convert_checks_its_inputs_before_importing_megatron(tmp_path, tiny_model_dir):
    import subprocess
    import sys

    (tmp_path / "exists").mkdir()
    for args in (["hf-to-dist", "--hf", tiny_model_dir, "--out", tmp_path / "exists"],
                 ["dist-to-hf", "--dist", tmp_path / "none", "--hf-config", tiny_model_dir,
                  "--out", tmp_path / "new"]):
        proc = subprocess.run([sys.executable, "-m", "rltool", "convert", *map(str, args)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().startswith("Error:") and len(proc.stderr.splitlines()) == 1, \
            proc.stderr
