"""Admission on CPU with the tiny model, the scheduler's steps driven by hand (no thread): every
waiting request starts in one pass as far as --max-prefill-tokens allows, and
--schedule-policy orders them (fcfs: arrival; lpm: longest cached prefix first)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from rltool.engine.config import ServeConfig
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams
from rltool.errors import BadInputError

PAGE = 4
SHARED = [7, 8, 9, 10, 11, 12, 13, 14]  # two full pages, cached by a first request


def _req(rid: str, prompt: list[int], new: int = 4) -> Request:
    return Request(rid=rid, prompt_ids=prompt, params=SamplingParams(
        max_new_tokens=new, temperature=0.0, ignore_eos=True))


def _engine(model_dir, *, policy: str, max_running: int = 8, budget: int = 64):
    runner = PagedRunner(model_dir, device="cpu", dtype="fp32", max_running=max_running,
                         page_size=PAGE, max_total_tokens=1024)
    return PagedScheduler(runner, max_running=max_running, max_prefill_tokens=budget,
                          chunked_prefill_size=budget, schedule_policy=policy)


def _submit(sched: PagedScheduler, reqs: list[Request]) -> None:
    sched.queue.submit(reqs)
    sched.queue.wait_for_work(sched.batch.can_step)  # arrivals -> waiting


def _run_to_end(sched: PagedScheduler, reqs: list[Request]) -> list[list[str]]:
    """Step until every request finished; the ids that got their first token, per step."""
    seen: set[str] = set()
    firsts = []
    for _ in range(200):
        if all(r.finished for r in reqs):
            return firsts
        sched.batch.step()
        new = [r.rid for r in reqs if r.output_ids and r.rid not in seen]
        seen.update(new)
        firsts.append(new)
    raise AssertionError("requests did not finish in 200 steps")


def _warm_cache(sched: PagedScheduler) -> None:
    """A first request whose prompt leaves SHARED's two pages in the prefix cache."""
    first = _req("warm", SHARED + [1, 2, 3, 4], new=1)
    _submit(sched, [first])
    _run_to_end(sched, [first])
    assert sched.runner.cached_prefix_length(SHARED + [30]) == len(SHARED)


def test_every_waiting_request_starts_in_one_prefill(tiny_model_dir):
    """Five requests that arrived before a step are prefilled together in that step's one
    forward; with a budget smaller than their prompts, the ones it holds start and the rest
    start in the next step."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16, 17, 18, 19]]
    sched = _engine(tiny_model_dir, policy="fcfs", budget=64)
    reqs = [_req(f"r{i}", p) for i, p in enumerate(prompts)]
    _submit(sched, reqs)
    sched.batch.step()
    assert sched.counters.num_prefill_forwards == 1
    assert all(len(r.output_ids) >= 1 for r in reqs)

    sched = _engine(tiny_model_dir, policy="fcfs", budget=9)  # 3 + 2 + 4 tokens fit
    reqs = [_req(f"r{i}", p) for i, p in enumerate(prompts)]
    _submit(sched, reqs)
    assert _run_to_end(sched, reqs)[:2] == [["r0", "r1", "r2"], ["r3", "r4"]]
    assert sched.counters.num_prefill_forwards == 2


@pytest.mark.parametrize("policy, first", [("fcfs", ["a", "b", "c"]), ("lpm", ["b", "c", "a"])])
def test_admission_order_under_each_policy(tiny_model_dir, policy, first):
    """`a` arrives first with no cached prefix, `b` shares two cached pages, `c` one. With one
    request in flight at a time, fcfs starts them in arrival order, lpm by cached length."""
    sched = _engine(tiny_model_dir, policy=policy, max_running=1)
    _warm_cache(sched)
    reqs = [_req("a", [40, 41, 42, 43, 44, 45, 46, 47, 48]),
            _req("b", SHARED + [50]), _req("c", SHARED[:PAGE] + [51, 52, 53, 54, 55])]
    _submit(sched, reqs)
    starts = [ids for ids in _run_to_end(sched, reqs) if ids]
    assert starts == [[rid] for rid in first]


@pytest.mark.parametrize("policy, first", [("fcfs", ["a"]), ("lpm", ["b"])])
def test_prefill_budget_goes_by_policy(tiny_model_dir, policy, first):
    """All three requests are admitted at once, but the budget holds one prompt per step: the
    policy decides whose chunk the step prefills (b's four uncached tokens under lpm)."""
    sched = _engine(tiny_model_dir, policy=policy, budget=4)
    _warm_cache(sched)
    reqs = [_req("a", [40, 41, 42, 43]), _req("b", SHARED + [50, 51, 52, 53]),
            _req("c", [60, 61, 62, 63])]
    _submit(sched, reqs)
    sched.batch.step()
    assert [r.rid for r in reqs if r.output_ids] == first
    assert sched.counters.num_prefill_tokens == 12 + 4  # the warm-up prompt, one chunk of four


def test_unknown_policy_is_refused(tiny_model_dir):
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_running=2,
                         page_size=PAGE, max_total_tokens=256)
    with pytest.raises(BadInputError, match="--schedule-policy 'sjf'; choose fcfs or lpm"):
        PagedScheduler(runner, schedule_policy="sjf")


def test_schedule_policy_flag(tiny_model_dir):
    """The flag reaches ServeConfig; a bad value is refused in one line naming the choices."""
    from rltool.cli import main

    cfg = ServeConfig(model=tiny_model_dir, device="cpu", schedule_policy="lpm")
    assert cfg.schedule_policy == "lpm" and ServeConfig(model=tiny_model_dir).schedule_policy \
        == "fcfs"
    result = CliRunner().invoke(main, ["serve", "--model", str(tiny_model_dir),
                                       "--schedule-policy", "sjf"])
    assert result.exit_code == 2
    assert "'sjf' is not one of 'fcfs', 'lpm'" in result.output
