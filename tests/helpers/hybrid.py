"""The tiny qwen3_5 hybrid (3 Gated DeltaNet layers, 1 gated attention layer) for the train and
align tests: `rltool init-model --arch qwen3_5 --preset tiny-4l --task reverse`, with its zero-centred norms,
A_log and dt_bias moved off their init values (a norm initialised to 0 would hide a missing
1 + w or a swapped tensor)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

GDN_KEYS = ("A_log", "dt_bias", "conv1d.weight", "in_proj_qkv", "in_proj_z", "in_proj_a",
            "in_proj_b", "linear_attn.norm", "out_proj")


def make_hybrid(out: Path, task: str | None = "reverse") -> Path:
    """`task`: the init-model --task (None: none given)."""
    from click.testing import CliRunner

    from rltool.cli import main

    task_args = ["--task", task] if task is not None else []
    result = CliRunner().invoke(main, ["init-model", "--arch", "qwen3_5", "--preset", "tiny-4l",
                                       *task_args, "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if "norm" in name or "A_log" in name or "dt_bias" in name:
            tensors[name] = t + 0.3 * torch.randn(t.shape, generator=gen)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return out


def engine_logprobs(runner, tokens: list[int], start: int, *, temperature: float) -> torch.Tensor:
    """The engine's logprobs of tokens[start:] from its own model (one unpadded pass)."""
    from rltool.logprobs import logits_to_logprobs

    logits = runner.full_pass_logits(tokens, start=start)
    return logits_to_logprobs(logits, torch.tensor(tokens[start:]), temperature=temperature)


def prefill_in_chunks(runner, seqs: list[list[int]], prompt_lens: list[int], *,
                      chunk: int) -> list[torch.Tensor]:
    """Prefill request `r{i}` with seqs[i][:prompt_lens[i]] in chunks of at most `chunk` tokens,
    several requests per packed pass, each chunk continuing its request's states; the logits row
    of each request's last prompt token, in request order."""
    done = [0] * len(seqs)
    last: list[torch.Tensor | None] = [None] * len(seqs)
    while any(d < n for d, n in zip(done, prompt_lens)):
        pending = [i for i, (d, n) in enumerate(zip(done, prompt_lens)) if d < n]
        chunks = [(f"r{i}", seqs[i][done[i]:min(done[i] + chunk, prompt_lens[i])], done[i])
                  for i in pending]
        want = [start + len(toks) == prompt_lens[i]
                for i, (_, toks, start) in zip(pending, chunks)]
        logits = runner.prefill(chunks, want=want)
        got = iter(logits) if logits is not None else iter(())
        for i, (_, toks, start), w in zip(pending, chunks, want):
            done[i] = start + len(toks)
            if w:
                last[i] = next(got)
    return last
