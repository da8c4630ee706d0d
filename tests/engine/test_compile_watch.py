"""The compile watch (rltool.engine.compile_watch): Triton's post-compile hook counts into every
live watch (called here as Triton calls it: no kernel compiles on CPU, and the interpreter never
fires the hook), the prefill's attention shapes count once each and restart at the warm-up mark,
and the engine's stats report the runner's watch."""

from __future__ import annotations

import pytest
import torch

from rltool.engine import compile_watch
from rltool.engine.compile_watch import CompileWatch
from rltool.engine.paged_forward import attention_shapes
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler


class _Info:
    """What Triton passes as `fn` (triton.runtime.jit.JitFunctionInfo)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name


def _compile(module: str, name: str) -> None:
    """Call the installed post-compile hook with the keywords Triton's JIT passes it."""
    from triton import knobs
    knobs.runtime.jit_post_compile_hook(key="k", repr="r", fn=_Info(module, name), compile={},
                                        is_manual_warmup=False, already_compiled=False)


def test_triton_hook_counts_per_kernel_into_every_watch_and_restarts_at_warmup():
    first, second = CompileWatch(), CompileWatch()
    assert first.hooked and second.hooked
    _compile("rltool.engine.fused", "_rope_store")
    first.mark_warm()
    _compile("rltool.engine.fused", "_rope_store")
    _compile("rltool.engine.fused", "_rope_store")
    _compile("rltool.engine.decode_attention", "_stage1")
    got = first.since_warmup()
    assert got["triton_kernels"] == {"rltool.engine.fused._rope_store": 2,
                                     "rltool.engine.decode_attention._stage1": 1}
    assert (got["triton"], got["total"], got["sdpa_shapes"], got["dynamo"]) == (3, 3, 0, 0)
    assert second.since_warmup()["triton"] == 4  # never marked: counts from its start


def test_hook_calls_the_hook_installed_before(monkeypatch):
    seen = []
    monkeypatch.setattr(compile_watch, "_chained", lambda **kw: seen.append(kw["fn"].name))
    watch = CompileWatch()
    _compile("m", "_kernel")
    assert seen == ["_kernel"] and watch.since_warmup()["triton"] == 1


def test_shapes_count_once_and_stay_known_past_the_mark():
    watch = CompileWatch()
    watch.note_shapes([("sdpa-causal", 2, 17), ("sdpa-causal", 1, 40)])
    watch.note_shapes([("sdpa-causal", 2, 17)])
    assert watch.since_warmup()["sdpa_shapes"] == 2
    watch.mark_warm()
    assert watch.since_warmup() == {"total": 0, "triton": 0, "dynamo": 0, "sdpa_shapes": 0,
                                    "triton_kernels": {}}
    watch.note_shapes([("sdpa-causal", 1, 40), ("sdpa-prefix", 80, 176)])
    watch.note_shapes([("sdpa-prefix", 80, 176)])
    assert watch.since_warmup()["sdpa_shapes"] == 1


def test_attention_shapes_of_a_grouped_step():
    """Fresh chunks by (count, length); a long continuation by (length, key length)."""
    groups = [(0, 2, 5), (10, 1, 7)]
    cont = [(17, 80, 96, list(range(176)))]
    assert attention_shapes(groups, cont, None) == [("sdpa-causal", 2, 5), ("sdpa-causal", 1, 7),
                                                    ("sdpa-prefix", 80, 176)]


@pytest.mark.parametrize("attention", ["grouped", "varlen"])
def test_engine_counts_new_prefill_shapes_and_reports_them(tiny_model_dir, attention):
    """A built runner starts at zero; a prefill of unseen lengths counts its attention calls'
    shapes (grouped: one per group; varlen on CPU: one masked call), the same lengths again count
    nothing, and the scheduler's stats carry the runner's counts."""
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_running=8,
                         page_size=4, max_total_tokens=2048, prefill_attention=attention)
    sched = PagedScheduler(runner, max_running=8)
    assert runner.compiles.since_warmup()["total"] == 0
    gen = torch.Generator().manual_seed(0)

    def prefill(tag: str, lengths: list[int]) -> None:
        chunks = [(f"{tag}{i}", torch.randint(3, 40, (n,), generator=gen).tolist(), 0)
                  for i, n in enumerate(lengths)]
        runner.prefill(chunks, want=[True] * len(chunks))
        for rid, *_ in chunks:
            runner.remove(rid)

    prefill("a", [5, 5, 9])
    expected = 2 if attention == "grouped" else 1
    assert runner.compiles.since_warmup()["sdpa_shapes"] == expected
    prefill("b", [9, 5, 5])  # same groups; varlen: the same mask shape
    assert runner.compiles.since_warmup()["sdpa_shapes"] == expected
    assert sched.stats()["compiles_since_warmup"] == runner.compiles.since_warmup()
    runner.release()
    runner.resume()  # a rebuild warms up again: the baseline restarts
    assert sched.stats()["compiles_since_warmup"]["total"] == 0


def test_varlen_step_is_one_attention_call_per_layer(tiny_model_dir, monkeypatch):
    """A step of fresh chunks of three lengths, a short continuation (decode rows under grouped)
    and a long one (a gathered prefix under grouped): with varlen every layer makes one
    attention call and none of the grouped path's."""
    from rltool.engine import paged_forward, varlen_attention

    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_running=8,
                         page_size=4, max_total_tokens=2048, prefill_attention="varlen")
    runner.prefill([("a", [5] * 30, 0), ("b", [6] * 20, 0)], want=[False, False])
    calls = {"varlen": 0, "grouped": 0}
    attend = varlen_attention.attend

    def counted(*args, **kw):
        calls["varlen"] += 1
        return attend(*args, **kw)

    def grouped(*args, **kw):
        calls["grouped"] += 1
        raise AssertionError("a grouped-path attention call in a varlen step")

    monkeypatch.setattr(varlen_attention, "attend", counted)
    monkeypatch.setattr(paged_forward, "sdpa", grouped)
    monkeypatch.setattr(paged_forward, "paged_attention", grouped)
    runner.prefill([("c", [7] * 9, 0), ("a", [8] * 3, 30), ("d", [9] * 9, 0),
                    ("b", [4] * (paged_forward.DECODE_QUERIES + 5), 20), ("e", [3] * 17, 0)],
                   want=[True] * 5)
    assert calls == {"varlen": runner.spec.num_layers, "grouped": 0}


def test_dynamo_graphs_count_past_the_mark():
    """A torch.compile'd function (eager backend: dynamo only) and its recompilation for a new
    shape count as two graphs since the mark."""
    watch = CompileWatch()
    watch.mark_warm()
    double = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    double(torch.ones(3))
    double(torch.ones(5))
    got = watch.since_warmup()
    assert got["dynamo"] == 2 and got["total"] == 2, got
