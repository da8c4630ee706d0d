"""The async core shared by rollout and eval: run groups of samples, reward them, filter, over-sample.

A group is the N samples of one prompt. Each sample runs the generate function through the router,
then its reward runs in a worker thread (never on the event loop, so a slow reward function or a
remote reward model does not stall generation; a reward marked `inline`, the label rewards' cheap
string comparison, is called on the loop). Every sample ends completed, truncated, aborted or
failed; a group is then kept for the shard, dropped by the dynamic filter (counted), or carried
over to a later call (partial rollout).

Dynamic sampling (DAPO, `--filter all-equal-reward`): groups whose rewards are all equal carry no
advantage signal and are dropped; more prompts are started as groups are dropped until the batch
holds `target` groups or the prompt budget is spent. Once the batch is full, groups still in
flight are stopped: with `--partial` they are aborted on their engines (`/abort_request`; they
return their partial tokens) and carried over; otherwise they are cancelled, counted and discarded.

Requests: with the default single-turn function (and engines, not a gateway) the groups that
start together go out as batched /generate bodies of up to `samples_per_request` samples
(rltool.rollout.batching); with the dynamic filter, one body per group, since each group's
rewards decide whether more prompts start and when the batch is full, and a body answers only
once its last sample has finished. A custom generate function, and any behind a gateway, send
one request per sample (smg takes one `sampling_params` object and one `rid` string per body).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rltool import trace
from rltool.errors import EngineError
from rltool.rollout.batching import DEFAULT_SAMPLES_PER_REQUEST, batch_body, pack
from rltool.rollout.generate import (GenerateContext, GenerateFn, Sample, SessionClient,
                                     apply_single_turn, generate_single_turn, single_turn_request)

log = logging.getLogger(__name__)
ABORT_GRACE_S = 10.0  # after /abort_request, how long aborted requests get to come back


@dataclass
class CollectResult:
    kept: list[list[Sample]]
    carry: list[list[Sample]]
    counts: dict[str, int]  # ... "reward_calls", "failed_rewards" (raised or timed out)
    output_tokens: int
    elapsed_s: float
    first_reward_failure: str | None = None  # the finish_reason of the first failed reward call


@dataclass
class _Group:
    samples: list[Sample]
    sessions: list[SessionClient] = field(default_factory=list)
    carried: bool = False

    @property
    def group_id(self) -> int:
        return self.samples[0].group_id


REWARD_FAILURES = ("reward_timeout:", "reward_error:")  # finish_reason of a failed reward call


def reward_counts(groups: list[list[Sample]], *, rewarded: bool) -> tuple[dict[str, int],
                                                                          str | None]:
    """The reward calls of `groups`' samples, read back from the samples ({"reward_calls",
    "failed_rewards"}, the first failure's finish_reason): every finished sample was scored
    once when `rewarded` (a reward function ran, not an environment)."""
    samples = [s for g in groups for s in g]
    failed = [s.finish_reason for s in samples
              if s.status == "failed" and s.finish_reason.startswith(REWARD_FAILURES)]
    scored = sum(s.status in ("completed", "truncated") for s in samples)
    calls = scored + len(failed) if rewarded else 0
    return {"reward_calls": calls, "failed_rewards": len(failed)}, next(iter(failed), None)


def check_generation(groups: list[list[Sample]], *, step: int) -> None:
    """EngineError (exit 3) when every sample failed at the engine (each refused, e.g. a
    --max-response-len past the model's context, or the engines gone): such a shard holds nothing
    to train or measure on. Called before anything is written."""
    samples = [s for g in groups for s in g]
    if samples and all(s.status == "failed" and s.finish_reason.startswith("engine_error")
                       for s in samples):
        raise EngineError(f"all {len(samples)} samples failed at the engine at step {step}; "
                          f"first: {samples[0].finish_reason}; nothing was written: fix what "
                          "the engine refused and re-run the step")


def _settle(group: _Group, samples: list[Sample]) -> None:
    """The group's finished samples, numbered in their order."""
    group.samples = samples
    for i, s in enumerate(samples):
        s.sample_index = i


class Collector:
    """Runs groups through a generate function, rewards and the dynamic filter."""

    def __init__(self, *, router: Any, tokenizer: Any, generate_fn: GenerateFn,
                 sampling: dict[str, Any], reward_fn: Callable[..., Any] | None,
                 reward_timeout_s: float,
                 reward_workers: int = 4, options: dict[str, Any] | None = None,
                 progress: Any = None, request_fields: dict[str, Any] | None = None,
                 samples_per_request: int = DEFAULT_SAMPLES_PER_REQUEST):
        """request_fields: added to every /generate body (e.g. return_routed_experts);
        reward_fn None: the generate function sets each sample's reward (--env episodes);
        samples_per_request: the most samples of one batched /generate body."""
        self.router = router
        self.tokenizer = tokenizer
        self.generate_fn = generate_fn
        self.sampling = sampling
        self.reward_fn = reward_fn
        self.reward_timeout_s = reward_timeout_s
        self.reward_workers = reward_workers
        self.options = options or {}
        self.request_fields = request_fields or {}
        self.progress = progress
        self.samples_per_request = samples_per_request
        # Batched bodies need the default function (one prompt per request, all known up front)
        # and engines that take per-prompt sampling_params (a gateway does not).
        self.batches = generate_fn is generate_single_turn and not router.via_gateway
        self.output_tokens = 0
        self.reward_calls = 0  # the calls that ended (a result, an error or a timeout)
        self._scoring: set[str] = set()  # uids of the samples whose reward call is running
        self.reward_failures: list[str] = []  # finish_reason of each failed call, in order
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, source: Iterator[list[Sample]], *, target_groups: int,
                  carried: list[list[Sample]] = (), dynamic_filter: bool = False,
                  over_sample_factor: float = 1.0, partial: bool = False) -> CollectResult:
        start = time.monotonic()
        self._pool = ThreadPoolExecutor(max_workers=self.reward_workers,
                                        thread_name_prefix="rltool-reward")
        try:
            return await self._run(source, target_groups=target_groups, carried=list(carried),
                                   dynamic_filter=dynamic_filter, partial=partial,
                                   over_sample_factor=over_sample_factor, start=start)
        finally:
            # Timed-out reward calls may still be running; do not wait for them.
            self._pool.shutdown(wait=False, cancel_futures=True)

    @contextlib.asynccontextmanager
    async def streaming(self) -> AsyncIterator["Collector"]:
        """Open the reward threads for `run_groups` calls of a continuous producer (the
        asynchronous loop), which has no batch to collect."""
        self._pool = ThreadPoolExecutor(max_workers=self.reward_workers,
                                        thread_name_prefix="rltool-reward")
        try:
            yield self
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def run_groups(self, groups: list[list[Sample]]) -> list[list[Sample]]:
        """Generate and reward groups that start together inside `streaming()`; each group's
        samples, each finished. With the default single-turn function they go to the engines as
        batched /generate bodies (see the module docstring), the others one request per sample.
        Members already finished (completed, truncated, failed) are kept as they are."""
        todo = [_Group(samples=samples) for samples in groups]
        await asyncio.gather(*(run for run, _ in self._launch(todo)))
        return [g.samples for g in todo]

    async def _run(self, source: Iterator[list[Sample]], *, target_groups: int,
                   carried: list[list[Sample]], dynamic_filter: bool, partial: bool,
                   over_sample_factor: float, start: float) -> CollectResult:
        pending: dict[asyncio.Task, list[_Group]] = {}  # a request's task -> its groups
        wave: list[_Group] = []  # groups to start together
        kept: list[_Group] = []
        carry: list[_Group] = []
        counts = {"fresh_groups": 0, "carried_in_groups": len(carried), "dropped_equal_reward": 0,
                  "aborted_extra_groups": 0, "over_sampled_groups": 0, "carried_out_groups": 0}

        def started() -> int:
            return sum(map(len, pending.values())) + len(wave)

        def submit_fresh() -> bool:
            samples = next(source, None)
            if samples is None:
                return False
            counts["fresh_groups"] += 1
            wave.append(_Group(samples=samples))
            return True

        def dispatch() -> None:
            for run, groups in self._launch(wave, one_per_group=dynamic_filter):
                pending[asyncio.create_task(run)] = groups
            wave.clear()

        wave.extend(_Group(samples=samples, carried=True) for samples in carried)
        first = target_groups if not dynamic_filter else math.ceil(target_groups * over_sample_factor)
        while started() < first and submit_fresh():
            pass
        dispatch()

        stopping = False
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED,
                                         timeout=ABORT_GRACE_S if stopping else None)
            if not done:  # aborted requests did not come back in time: cancel them locally
                await self._cancel(pending, rescore=partial)
                done = set(pending)
            for task in done:
                groups = pending.pop(task)
                if not task.cancelled():
                    task.result()
                for group in groups:
                    self._classify(group, kept=kept, carry=carry, counts=counts,
                                   stopping=stopping, dynamic_filter=dynamic_filter,
                                   partial=partial, target_groups=target_groups)
            if stopping:
                continue
            if len(kept) >= target_groups:
                if pending:
                    stopping = True
                    await self._stop_extra(pending, partial=partial)
                continue
            while len(kept) + started() < target_groups and submit_fresh():
                pass
            dispatch()
        counts["carried_out_groups"] = len(carry)
        counts["reward_calls"] = self.reward_calls
        counts["failed_rewards"] = len(self.reward_failures)
        kept.sort(key=lambda g: g.group_id)
        return CollectResult(kept=[g.samples for g in kept], carry=[g.samples for g in carry],
                             counts=counts, output_tokens=self.output_tokens,
                             elapsed_s=time.monotonic() - start,
                             first_reward_failure=next(iter(self.reward_failures), None))

    def _classify(self, group: _Group, *, kept: list[_Group], carry: list[_Group],
                  counts: dict[str, int], stopping: bool, dynamic_filter: bool, partial: bool,
                  target_groups: int) -> None:
        has_aborted = any(s.status == "aborted" for s in group.samples)
        rewards = {s.reward for s in group.samples}
        if partial and has_aborted:
            carry.append(group)
        elif len(kept) >= target_groups or stopping:  # beyond the batch
            if partial:
                carry.append(group)
            elif has_aborted:
                counts["aborted_extra_groups"] += 1
            else:
                counts["over_sampled_groups"] += 1
        elif dynamic_filter and len(group.samples) > 1 and len(rewards) == 1:
            counts["dropped_equal_reward"] += 1
        else:
            kept.append(group)
        if self.progress is not None:
            self.progress.group_done()

    async def _stop_extra(self, pending: dict[asyncio.Task, list[_Group]], *,
                          partial: bool) -> None:
        """The batch is full: stop the groups still in flight.

        With partial rollout their tokens are worth keeping, so the engines abort them
        (`/abort_request`) and they come back with their partial output. Otherwise they would be
        discarded anyway, so they are only cancelled here (the engine finishes them unobserved)."""
        groups = [g for gs in pending.values() for g in gs]
        sessions = [s for g in groups for s in g.sessions]
        for session in sessions:
            session.aborted = True
        if partial:
            rids = {rid for s in sessions for rid in s.rids}
            aborted = await self.router.abort(rids)
            log.info("batch full; aborted %d in-flight requests of %d extra groups", aborted,
                     len(groups))
        else:
            await self._cancel(pending)

    async def _cancel(self, pending: dict[asyncio.Task, list[_Group]], *,
                      rescore: bool = False) -> None:
        """Cancel the requests' tasks: unfinished samples end aborted. With `rescore` (their
        groups are carried) a sample whose generation had finished but whose reward call was
        cancelled is scored now, since a carried sample keeps what it holds."""
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        samples = [s for groups in pending.values() for g in groups for s in g.samples]
        for s in samples:
            if not s.finished:
                s.status, s.finish_reason = "aborted", "abort:cancelled"
        cut = [s for s in samples if s.uid in self._scoring]
        self._scoring.difference_update(s.uid for s in cut)
        if rescore:
            await asyncio.gather(*(self._reward(s) for s in cut))

    def _launch(self, groups: list[_Group], *, one_per_group: bool = False
                ) -> list[tuple[Coroutine[Any, Any, None], list[_Group]]]:
        """The requests that run `groups` started together, each with the groups it finishes:
        batched bodies (`samples_per_request`, or one per group) when the collector batches,
        else each group on its own, one request per sample. A batch's request ids and sessions
        are registered here, before anything is awaited, so an abort reaches every one."""
        if not self.batches:
            return [(self._run_group(g), [g]) for g in groups]
        limit = 1 if one_per_group else self.samples_per_request  # 1: a group per body
        requests = pack([len(g.samples) for g in groups], limit=limit,
                        engines=len(self.router.alive))
        return [(self._run_batch([groups[i] for i in r]), [groups[i] for i in r])
                for r in requests]

    async def _run_group(self, group: _Group) -> None:
        results = await asyncio.gather(*(self._run_sample(s, group) for s in group.samples))
        _settle(group, [s for batch in results for s in batch])

    def _context(self, session: SessionClient) -> GenerateContext:
        return GenerateContext(client=session, sampling=self.sampling, tokenizer=self.tokenizer,
                               options=self.options)

    def _run_batch(self, groups: list[_Group]) -> Coroutine[Any, Any, None]:
        """The groups' unfinished samples as one batched body (each from its own tokens, with
        what is left of its budget, as the default function would send it); a coroutine that
        sends it, applies the answers and rewards the samples. Members already finished are kept
        as they are; a sample whose budget is spent is truncated without a request."""
        todo: list[tuple[Sample, SessionClient, int]] = []
        items: list[dict[str, Any]] = []
        sent: list[tuple[Sample, SessionClient]] = []
        batch_rid = uuid.uuid4().hex  # one per body; its samples' request ids add their index
        for g in groups:
            for s in g.samples:
                if s.status in ("completed", "truncated", "failed"):
                    continue  # a finished member of a carried-over group
                session = SessionClient(self.router, session_id=s.uid,
                                        request_fields=self.request_fields)
                g.sessions.append(session)
                s.status, s.response = "pending", ""  # a resumed one's text is decoded anew
                todo.append((s, session, sum(s.loss_mask)))
                item = single_turn_request(s, self._context(session))
                if item is not None:
                    session.rids.append(f"{batch_rid}-{len(items)}")
                    items.append(item)
                    sent.append((s, session))
        payload = batch_body(items, rids=[c.rids[-1] for _, c in sent], fields=self.request_fields)
        return self._send_batch(groups, payload, sent=sent, todo=todo)

    async def _send_batch(self, groups: list[_Group], payload: dict[str, Any], *,
                          sent: list[tuple[Sample, SessionClient]],
                          todo: list[tuple[Sample, SessionClient, int]]) -> None:
        if sent:
            try:
                responses, url = await self.router.generate(payload)
                if not isinstance(responses, list) or len(responses) != len(sent):
                    count = len(responses) if isinstance(responses, list) else 1
                    raise EngineError(f"engine {url} returned {count} outputs for a batch of "
                                      f"{len(sent)}")
            except EngineError as e:
                if e.status_code == 400 and len(sent) > 1:  # an item refuses the whole body
                    await asyncio.gather(*(self._send_alone(payload, j, s, session)
                                           for j, (s, session) in enumerate(sent)))
                else:
                    for s, _ in sent:
                        s.fail(f"engine_error: {e}")
            else:
                for (s, session), response in zip(sent, responses):
                    session.engine_urls.append(url)
                    try:
                        apply_single_turn(s, response)
                    except EngineError as e:  # a malformed answer fails its own sample only
                        s.fail(f"engine_error: {e}")
        await asyncio.gather(*(self._finish_sample(s, [s], c, model_tokens_before=before)
                               for s, c, before in todo))
        for g in groups:
            _settle(g, list(g.samples))

    async def _send_alone(self, payload: dict[str, Any], j: int, sample: Sample,
                          session: SessionClient) -> None:
        """Item `j` of a body the engine refused as bad input (400: a prompt too long for the
        context, say) as a request of its own, so only the samples at fault fail."""
        item = {**payload, "input_ids": payload["input_ids"][j],
                "sampling_params": payload["sampling_params"][j], "rid": payload["rid"][j]}
        try:
            response, url = await self.router.generate(item)
            session.engine_urls.append(url)
            apply_single_turn(sample, response)
        except EngineError as e:
            sample.fail(f"engine_error: {e}")

    async def _run_sample(self, sample: Sample, group: _Group) -> list[Sample]:
        if sample.status in ("completed", "truncated", "failed"):
            return [sample]  # a finished member of a carried-over group
        session = SessionClient(self.router, session_id=sample.uid,
                                request_fields=self.request_fields)
        group.sessions.append(session)
        ctx = self._context(session)
        sample.status, sample.response = "pending", ""  # a resumed one's text is decoded anew
        model_tokens_before = sum(sample.loss_mask)
        try:
            out = await self.generate_fn(sample, ctx)
        except EngineError as e:
            out = sample.fail(f"engine_error: {e}")
        except Exception as e:  # a custom generate fn's bug must not lose the sample
            log.exception("generate function failed on sample %s", sample.uid)
            out = sample.fail(f"generate_error: {type(e).__name__}: {e}")
        return await self._finish_sample(sample, out if isinstance(out, list) else [out], session,
                                         model_tokens_before=model_tokens_before)

    async def _finish_sample(self, sample: Sample, samples: list[Sample], session: SessionClient,
                             *, model_tokens_before: int) -> list[Sample]:
        """What the generate function returned for `sample`: checked, decoded and rewarded."""
        for j, s in enumerate(samples):
            if s is not sample and s.uid == sample.uid:
                s.uid = f"{sample.uid}.{j}"
            if not s.finished:
                s.fail(f"generate_error: the generate function returned it as {s.status!r}")
            if not s.engine_urls:
                s.engine_urls = list(session.engine_urls)
            if s.response_token_ids and not s.response:
                s.response = self.tokenizer.decode(s.response_token_ids, skip_special_tokens=True)
        new_tokens = sum(sum(s.loss_mask) for s in samples) - model_tokens_before
        self.output_tokens += max(0, new_tokens)
        await asyncio.gather(*(self._reward(s) for s in samples))
        if self.progress is not None:
            self.progress.samples_done(len(samples), tokens=max(0, new_tokens))
        return samples

    async def _reward(self, s: Sample) -> None:
        """Score one sample. A reward call that raises (a custom function's exception, a remote
        reward model's error) or times out marks the sample failed with reward 0.0 and is
        counted; the stage decides whether the call as a whole is still usable."""
        if s.status not in ("completed", "truncated"):
            s.reward = 0.0
            return
        if self.reward_fn is None:  # --env: the environment rewarded the episode
            return
        args = (s.prompt, s.response, s.label, s.metadata)
        self._scoring.add(s.uid)  # until the call ends; a cancelled call stays here
        try:
            with trace.span("reward", cat="reward"):
                if getattr(self.reward_fn, "inline", False):  # cheap and bounded: no thread
                    result = self.reward_fn(*args)
                else:
                    call = asyncio.get_running_loop().run_in_executor(self._pool, self.reward_fn,
                                                                      *args)
                    result = await asyncio.wait_for(call, self.reward_timeout_s)
            reward = float(result.reward)
            if not math.isfinite(reward):
                raise ValueError(f"reward is {reward}")
        except asyncio.TimeoutError:
            failure = (f"{REWARD_FAILURES[0]} no reward after {self.reward_timeout_s:g}s "
                       f"(generation finished as {s.finish_reason})")
        except Exception as e:  # noqa: BLE001 - any reward failure becomes the sample's status
            failure = f"{REWARD_FAILURES[1]} {type(e).__name__}: {e}"
        else:
            failure = None
        self._scoring.discard(s.uid)
        self.reward_calls += 1
        if failure is not None:
            s.reward = 0.0
            s.fail(failure)
            self.reward_failures.append(s.finish_reason)
            return
        s.reward = reward
        components = {k: float(v) for k, v in (result.components or {}).items()}
        s.rewards = components or None
