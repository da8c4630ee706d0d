"""Seeded requests through a paged scheduler with sampling inside the decode forward or after it,
for the CPU and GPU tests of rltool.engine.decode_sample."""

from __future__ import annotations

from pathlib import Path

from rltool.engine.sampling import SamplingParams, make_generator
from tests.helpers.scheduling import run_all


def serve_seeded(model_dir: Path, params: list[SamplingParams], *, device: str,
                 graph_sampling: bool, steps: int, cuda_graph: bool = False):
    """Requests i = 0, 1, ... with `params[i]`, seed 40 + i, prompts of 2 + i tokens and
    6 + 2i output tokens (ignore_eos), submitted together, so the batch shrinks as they finish:
    ([(output ids, output logprobs)] per request, the scheduler)."""
    from rltool.engine.paged_runner import PagedRunner
    from rltool.engine.paged_scheduler import PagedScheduler
    from rltool.engine.request import Request

    runner = PagedRunner(model_dir, device=device, dtype="fp32", max_running=4, page_size=4,
                         max_total_tokens=256, disable_cuda_graph=not cuda_graph,
                         graph_sampling=graph_sampling)
    sched = PagedScheduler(runner, max_running=4, num_continuous_decode_steps=steps)
    reqs = [Request(rid=f"r{i}", prompt_ids=[5 + i, 9, 3, 12, 7, 1][:2 + i], return_logprob=True,
                    params=p.model_copy(update={"max_new_tokens": 6 + 2 * i, "ignore_eos": True}),
                    generator=make_generator(40 + i))
            for i, p in enumerate(params)]
    run_all(sched, reqs, wait=300)
    return [(r.output_ids, r.output_logprobs) for r in reqs], sched
