"""The scheduler over a paged runner (rltool.engine.paged_runner): same loop, same control
operations (pause modes, weight updates, abort, memory), same request accounting as `Scheduler`;
what differs is how a step touches the KV cache and samples.

A step: admit while fewer than `max_running` are in flight; prefill chunks of several requests in
one packed forward, up to `max_prefill_tokens` tokens in all, each chunk at most
`chunked_prefill_size` tokens and starting at a fixed multiple of it inside its prompt; then one
decode forward over every running request, and one batched sampling call on the device with a
single transfer back. KV pages are reserved before a forward: a prompt waits while its pages
(plus one per running request for the next token) are not free, and a decode step that would run
out of pages first retracts the most recently admitted requests (recomputed later).

Deterministic mode (no prefix cache) returns logprobs recomputed by one unpadded pass over
prompt + response (the trainer's layout), and keeps tokens and logprobs independent of what else
is running: with the runner's batch-invariant kernels (CUDA) in batched forwards, without them
(CPU) by running every prefill chunk and decode step of a request in a forward of its own and
sampling it alone with its own seeded generator.
"""

from __future__ import annotations

import bisect
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rltool.engine.batch_sampling import sample_batch
from rltool.engine.request import Request
from rltool.engine.scheduler import Scheduler
from rltool.errors import BadInputError
from rltool.logprobs import effective_temperature


SEED_MODULUS = 2**31 - 1  # the sampling kernel's Philox seeds are 31-bit here


@dataclass
class _Buffers:
    """Host memory one overlapped block of decode steps reads its sampling parameters from
    (int32: B temperatures as float32 bits, B greedy flags, then B seeds per step, contiguous so
    one asynchronous copy takes them) and writes its tokens to (step-major), and the event that
    marks its copies done (two sets, used alternately). Pinned on CUDA."""

    params: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    event: Any

    @staticmethod
    def make(n: int, steps: int, cuda: bool) -> "_Buffers":
        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            t = torch.empty(*shape, dtype=dtype, device="cpu")
            return t.pin_memory() if cuda else t

        return _Buffers(host((2 + steps) * n, dtype=torch.int32),
                        host(steps * n, dtype=torch.int64), host(steps * n, dtype=torch.float32),
                        torch.cuda.Event() if cuda else _Done())


class _Done:
    """The event of a buffer on CPU, where every copy is done when it returns."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


@dataclass
class _Inflight:
    reqs: list[Request]
    tokens: torch.Tensor  # the last step's, on the device
    buf: _Buffers
    removals: int  # the scheduler's count of requests leaving `running`, at launch
    steps: int

    def rows(self) -> dict[int, int]:
        """Row of each request in this block's batch, by id(request)."""
        return {id(r): i for i, r in enumerate(self.reqs)}


@dataclass
class _BatchConsts:
    """Per-row sampling constants of a decode batch, kept while the batch stays the same."""

    reqs: list[Request]
    temps: np.ndarray  # float32
    seeds: np.ndarray  # int64: base seed x 1_000_003 mod SEED_MODULUS
    greedy: np.ndarray  # int32


class PagedScheduler(Scheduler):
    def __init__(self, runner: Any, *, overlap: bool = True, num_continuous_decode_steps: int = 1,
                 **kwargs: Any):
        super().__init__(runner, **kwargs)
        if num_continuous_decode_steps < 1:
            raise BadInputError(f"--num-continuous-decode-steps {num_continuous_decode_steps}: "
                                "must be at least 1")
        self.num_continuous_decode_steps = num_continuous_decode_steps
        self.num_retractions = 0
        self._shared_generator = torch.Generator(device=runner.device)
        self._shared_generator.seed()
        self._generators: dict[str, torch.Generator] = {}
        # Per request (see `_info`); the kernel's base seed is its own (sampling_seed) or drawn.
        self._infos: dict[str, tuple[float, bool, int, bool, int]] = {}
        self._seed_rng = random.Random()
        # The Triton sampler: compiled on CUDA, interpreted on CPU under TRITON_INTERPRET=1.
        self._use_kernel = runner.triton_kernels
        self._overlap = self._use_kernel and overlap
        # Deterministic without the batch-invariant kernels (CPU): every forward holds one request.
        self._alone = self.deterministic and not runner.invariant_kernels
        self._inflight: _Inflight | None = None
        self._consts: _BatchConsts | None = None
        self._removals = 0  # requests that left `running` (finished or retracted), ever
        self._sampler_args: tuple | None = None
        self._launches = 0
        cuda = runner.device.type == "cuda"
        self._buffers = ([_Buffers.make(self.max_running, num_continuous_decode_steps, cuda)
                          for _ in range(2)] if self._overlap else [])

    # ----- steps ---------------------------------------------------------------------------

    def _prefill_step(self) -> None:
        runner = self.runner
        budget = self.max_prefill_tokens
        chunk = self.chunked_prefill_size
        reserved = len(self.running)  # a page per running request's next token
        ps = runner.page_size
        # By length: prompt prefixes ending with the first uncached full page a request of this
        # step writes; a new request whose prompt starts with one waits a step to reuse it.
        filling: dict[int, set[tuple[int, ...]]] = {}
        chunks: list[tuple[str, list[int], int]] = []
        want: list[bool] = []
        reqs: list[Request] = []
        done: list[Request] = []
        for req in list(self.prefilling):
            target = req.prefill_target
            if req.num_cached == 0:
                if any(tuple(req.prompt_ids[:n]) in keys for n, keys in filling.items()):
                    continue  # an earlier request is writing this prefix: reuse it next step
                req.num_cached = runner.reuse_prefix(req.rid, req.all_ids(),
                                                     max_tokens=target - 1, spare=reserved)
                if not req.output_ids:
                    req.cached_tokens = req.num_cached
            start = req.num_cached
            # It writes full pages of its prompt that are not cached yet (a GRPO sample after
            # the group's first writes only its partial last page: nobody waits for that).
            if runner.prefix_cache and start < min(target - 1, len(req.prompt_ids) // ps * ps):
                n = (start // ps + 1) * ps
                filling.setdefault(n, set()).add(tuple(req.prompt_ids[:n]))
            end = min(target, (start // chunk + 1) * chunk)
            if chunks and end - start > budget:
                break
            need = runner.extra_pages(req.rid, end)
            if not runner.has_free_pages(need + reserved):
                break
            reserved += need
            chunks.append((req.rid, req.all_ids()[start:end], start))
            want.append(end == target and not req.output_ids)
            reqs.append(req)
            req.num_cached = end
            budget -= end - start
            if end == target:
                done.append(req)
            if budget <= 0:
                break
        if chunks:
            self._drain()  # the prefill changes the batch; results of a queued step come first
        if not chunks:
            if self.prefilling and not self.running:
                req = self.prefilling[0]
                self._finish(req, {"type": "abort", "status_code": 400, "err_type": "BadRequest",
                                   "message": f"the prompt needs {req.prefill_target} tokens of "
                                              "KV cache, more than the pool holds; raise "
                                              "--mem-fraction-static or shorten it"})
            return
        self.num_prefill_tokens += sum(len(c[1]) for c in chunks)
        if self._alone:
            rows = [runner.prefill([c], want=[w]) for c, w in zip(chunks, want)]
            self.num_prefill_forwards += len(rows)
            logits = torch.cat([r for r in rows if r is not None]) if any(want) else None
        else:
            logits = runner.prefill(chunks, want=want)
            self.num_prefill_forwards += 1
        for req in done:
            self.prefilling.remove(req)
            runner.cache_prefix(req.rid, req.prompt_ids)
        fresh = [r for r, w in zip(reqs, want) if w]
        if fresh:
            self._sample_and_accept(fresh, logits)
        for req in done:
            if not req.finished:
                self.running[req.rid] = req

    def _decode_step(self) -> None:
        runner = self.runner
        prev = self._inflight
        reqs = list(self.running.values())
        # A batch that was all plain stays so (its requests only grow past min_new_tokens).
        overlap = self._overlap and ((self._consts is not None and reqs == self._consts.reqs)
                                     or all(self._plain(r) for r in reqs))
        if prev is not None and overlap and reqs != prev.reqs:
            rows = prev.rows()
            overlap = all(id(r) in rows for r in reqs)  # a newcomer has no token on the device
        if prev is not None and not overlap:
            self._drain()
            prev = None
        ahead = prev.steps if prev is not None else 0  # tokens of the queued block
        if not runner.has_free_pages(len(reqs)):  # at most one new page each; count exactly
            reqs.sort(key=lambda r: r.seq)
            need = sum(runner.extra_pages(r.rid, _kv_length(r, ahead + 1)) for r in reqs)
            while need > runner.free_pages() and len(reqs) > 1:
                victim = reqs.pop()
                need -= runner.extra_pages(victim.rid, _kv_length(victim, ahead + 1))
                self._retract(victim)
        steps = 1
        if overlap and self.num_continuous_decode_steps > 1:
            steps = self._block_steps(reqs, ahead)
            if steps < 1:  # a request ends inside the queued block, at the end of its context
                self._drain()
                if self.running:
                    self._decode_step()
                return
        rids = [r.rid for r in reqs]
        if self._alone:
            self.num_decode_forwards += 1
            self.max_decode_batch = max(self.max_decode_batch, len(reqs))
            self.decode_log.append(rids)
            for req in reqs:
                self._sample_and_accept([req], runner.decode([req.rid], [req.output_ids[-1]]))
            return
        if prev is not None:
            src_rows = None  # the previous step's rows, in the same order
            if reqs != prev.reqs:  # some finished or were retracted
                rows = prev.rows()
                src_rows = [rows[id(r)] for r in reqs]
            logits = runner.decode(rids, None, prev_tokens=prev.tokens, src_rows=src_rows,
                                   steps=steps)
        else:
            logits = runner.decode(rids, [r.output_ids[-1] for r in reqs], steps=steps)
        self.num_decode_forwards += steps
        self.max_decode_batch = max(self.max_decode_batch, len(reqs))
        self.decode_log.extend([rids] * steps)
        if not overlap:
            self._sample_and_accept(reqs, logits)
            return
        self._inflight = self._launch_block(reqs, logits, ahead=ahead, steps=steps)
        if prev is not None:
            self._accept_inflight(prev)

    def _block_steps(self, reqs: list[Request], ahead: int) -> int:
        """Decode steps of the next block: --num-continuous-decode-steps, fewer where a request
        would pass its context length or the pool lacks the pages (then 1: the step's pages are
        free). Below 1 when a request ends inside the queued block at the end of its context."""
        runner = self.runner
        longest = max(len(r.prompt_ids) + len(r.output_ids) for r in reqs)
        steps = min(self.num_continuous_decode_steps,
                    runner.context_length - (longest - 1 + ahead))
        if steps > 1 and not runner.has_free_pages(len(reqs) * (-(-steps // runner.page_size)
                                                                + 1)):
            need = sum(runner.extra_pages(r.rid, _kv_length(r, ahead + steps)) for r in reqs)
            if need > runner.free_pages():
                return 1
        return steps

    # ----- overlapped decoding -------------------------------------------------------------
    # Step N + 1 is queued on the device, fed straight from step N's sampled tokens, before the
    # host reads step N's tokens back; the host's per-request work then runs while the device
    # computes. A request that stops at step N has computed one extra token, which is dropped.
    # Prefill, control operations and batches that need the torch sampler drain first.

    def _info(self, req: Request) -> tuple[float, bool, int, bool, int]:
        """Per-request constants of the sampling step, computed once (the per-token host work
        bounds the step at large batches): (temperature, greedy, base seed, plain, min tokens)."""
        info = self._infos.get(req.rid)
        if info is None:
            p = req.params
            base = (req.generator.initial_seed() if req.generator is not None
                    else self._seed_rng.getrandbits(62))
            plain = not (p.needs_filter or p.logit_bias or req.top_logprobs_num
                         or req.token_ids_logprob)
            info = (effective_temperature(p.temperature), p.greedy, base, plain,
                    p.min_new_tokens)
            self._infos[req.rid] = info
        return info

    def _plain(self, req: Request) -> bool:
        info = self._info(req)
        return info[3] and len(req.output_ids) >= info[4]

    def _launch_block(self, reqs: list[Request], logits: torch.Tensor, *, ahead: int,
                      steps: int) -> "_Inflight":
        """Sample the first step's logits, then run the rest of the block, each step fed the
        last one's samples on the device; queue one copy of all the block's tokens back."""
        from rltool.engine.sampling_kernel import sample_rows

        B = len(reqs)
        consts = self._consts
        if consts is None or consts.reqs != reqs:
            infos = [self._info(r) for r in reqs]
            consts = self._consts = _BatchConsts(
                reqs=reqs, temps=np.array([i[0] for i in infos], dtype=np.float32),
                seeds=np.array([i[2] * 1_000_003 % SEED_MODULUS for i in infos], dtype=np.int64),
                greedy=np.array([i[1] for i in infos], dtype=np.int32))
        drawn = np.array([len(r.output_ids) for r in reqs], dtype=np.int64)
        self._launches += 1
        buf = self._buffers[self._launches % 2]
        buf.event.synchronize()  # the copies of the block that last used this buffer are done
        host = buf.params.numpy()
        host[:B] = consts.temps.view(np.int32)
        host[B:2 * B] = consts.greedy
        # A draw is keyed by (seed, token index): step i of the block draws token drawn + ahead + i.
        first = consts.seeds + drawn + ahead
        host[2 * B:(2 + steps) * B].reshape(steps, B)[:] = (
            (first + np.arange(steps)[:, None]) % SEED_MODULUS)
        dev = buf.params[:(2 + steps) * B].to(logits.device, non_blocking=True)
        temps, greedy = dev[:B].view(torch.float32), dev[B:2 * B]
        tokens, logprobs = [], []
        for i in range(steps):
            if i:
                logits = self.runner.decode_next(tokens[-1])
            tok, lp = sample_rows(logits, temps, dev[(2 + i) * B:(3 + i) * B], greedy)
            tokens.append(tok)
            logprobs.append(lp)
        last = tokens[-1]
        if steps > 1:
            tokens, logprobs = [torch.stack(tokens)], [torch.stack(logprobs)]
        buf.tokens[:steps * B].copy_(tokens[0].view(-1), non_blocking=True)
        buf.logprobs[:steps * B].copy_(logprobs[0].view(-1), non_blocking=True)
        buf.event.record()
        return _Inflight(reqs=reqs, tokens=last, buf=buf, removals=self._removals, steps=steps)

    def _accept_inflight(self, block: "_Inflight") -> None:
        """Record a block's tokens step by step; a request's tokens after the one that stops it
        are dropped (its pages, the block's extra KV included, were freed when it finished)."""
        block.buf.event.synchronize()
        reqs, B, steps = block.reqs, len(block.reqs), block.steps
        tokens = block.buf.tokens[:steps * B].tolist()
        logprobs = block.buf.logprobs[:steps * B].tolist()
        if block.removals == self._removals:  # every request of the block is still running
            live = range(B)
        else:
            running = self.running
            live = [i for i, r in enumerate(reqs) if running.get(r.rid) is r]
        for step in range(steps):
            if step:
                live = [i for i in live if not reqs[i].finished]
            at = step * B
            if len(live) == B:
                self._accept(reqs, tokens[at:at + B], logprobs[at:at + B])
            elif live:
                self._accept([reqs[i] for i in live], [tokens[at + i] for i in live],
                             [logprobs[at + i] for i in live])

    def _drain(self) -> None:
        step, self._inflight = self._inflight, None
        if step is not None:
            self._accept_inflight(step)

    def _quiesce(self) -> None:
        self._drain()

    def _can_step(self) -> bool:
        return self._inflight is not None or super()._can_step()

    def _step(self) -> None:
        if self._inflight is not None and (self.paused is not None or self.runner.released
                                           or not self.running):
            self._drain()
        if self.paused is None and not self.runner.released:
            with self.runner.invariant():  # deterministic: one kernel registration per step
                super()._step()

    def _final_logprobs(self, req: Request) -> None:
        with self.runner.invariant():  # the log-softmax too, as the trainer computes it
            super()._final_logprobs(req)

    def _sample_and_accept(self, reqs: list[Request], logits: torch.Tensor) -> None:
        args = self._sampler_args
        if args is None or args[0] != reqs:  # per-request arguments, kept while the batch is
            args = self._sampler_args = (  # the same
                reqs, [r.params for r in reqs], [self._generator(r) for r in reqs],
                [r.top_logprobs_num if r.return_logprob else 0 for r in reqs],
                [r.token_ids_logprob if r.return_logprob else None for r in reqs],
                max(r.params.min_new_tokens for r in reqs))
        _, params, generators, top_n, token_ids, min_new = args
        suppressed = [[]] * len(reqs)
        if min_new and any(len(r.output_ids) < r.params.min_new_tokens for r in reqs):
            eos = self.runner.eos_token_ids
            suppressed = [sorted(eos | set(r.params.stop_token_ids))
                          if len(r.output_ids) < r.params.min_new_tokens else [] for r in reqs]
        drawn = sample_batch(
            logits, params, generators=generators, suppressed=suppressed, top_n=top_n,
            token_ids=token_ids, shared_generator=self._shared_generator,
            seeds=[self._step_seed(r) for r in reqs] if self._use_kernel else None,
            use_kernel=self._use_kernel)
        extra = [i for i in range(len(reqs)) if drawn.top[i] is not None
                 or drawn.ids_logprobs[i] is not None]
        if not extra:
            self._accept(reqs, drawn.tokens, drawn.logprobs)
            return
        version = self.runner.weight_version
        for i, req in enumerate(reqs):
            req.record_token(drawn.tokens[i], drawn.logprobs[i], version=version,
                             top=drawn.top[i], ids_lp=drawn.ids_logprobs[i])
            self._after_token(req, drawn.tokens[i])
        self._count_tokens(len(reqs), time.monotonic())

    def _step_seed(self, req: Request, *, ahead: int = 0) -> int:
        """The kernel's seed for the request's next draw (`ahead` draws not yet recorded)."""
        base = self._info(req)[2]
        return (base * 1_000_003 + len(req.output_ids) + ahead) % SEED_MODULUS

    def _generator(self, req: Request) -> torch.Generator | None:
        """The request's own generator on the runner's device (seeded like its CPU one)."""
        if req.generator is None or self.runner.device.type == "cpu":
            return req.generator
        gen = self._generators.get(req.rid)
        if gen is None:
            gen = torch.Generator(device=self.runner.device)
            gen.manual_seed(req.generator.initial_seed())
            self._generators[req.rid] = gen
        return gen

    # ----- KV ownership --------------------------------------------------------------------

    def update_weights(self, apply: Any, *, abort_all: bool) -> Any:
        def apply_and_invalidate() -> Any:
            try:
                return apply()
            finally:  # KV computed under the old weights must never be reused
                self.runner.flush_prefix_cache()

        return super().update_weights(apply_and_invalidate, abort_all=abort_all)

    def flush_cache(self) -> None:
        self.runner.flush_prefix_cache()

    def _retract(self, req: Request) -> None:
        self._removals += 1
        self.runner.remove(req.rid)
        self.running.pop(req.rid, None)
        req.reset_cache()
        bisect.insort(self.waiting, req, key=lambda r: r.seq)
        self.num_retractions += 1

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        if not req.finished:
            routed = getattr(self.runner.pool, "routed", None)  # an MoE model's, while loaded
            if req.return_routed_experts and routed is not None:
                # every token whose KV was computed (all but the last sampled), as SGLang does
                req.routed_experts = routed.read(self.runner.table, req.rid, req.prefill_target)
            self._removals += 1
            self.runner.remove(req.rid)
            self._generators.pop(req.rid, None)
            self._infos.pop(req.rid, None)
        super()._finish(req, reason)

    def _retract_all(self) -> None:
        self._removals += 1
        self.runner.clear()
        super()._retract_all()


def _kv_length(req: Request, steps: int) -> int:
    """Tokens in the request's KV after `steps` more decode steps (the last sampled token is not
    in it yet)."""
    return len(req.prompt_ids) + len(req.output_ids) - 1 + steps
