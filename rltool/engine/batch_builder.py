"""What one scheduler step runs on the paged runner (rltool.engine.paged_runner): prefill chunks of
several requests in one packed forward, up to `max_prefill_tokens` tokens in all, each chunk at
most `chunked_prefill_size` tokens and starting at a fixed multiple of it inside its prompt; then
one decode forward over every running request, and one batched sampling call on the device with a
single transfer back. KV pages are reserved before a forward: a prompt waits while its pages
(plus one per running request for the next token) are not free, and a decode step that would run
out of pages first retracts the most recently admitted requests (recomputed later).

Deterministic mode (no prefix cache) keeps tokens and logprobs independent of what else is
running: with the runner's batch-invariant kernels (CUDA) in batched forwards, without them (CPU)
by running every prefill chunk and decode step of a request in a forward of its own and sampling
it alone with its own seeded generator. Requests, their tokens and their ends are the request
queue's (rltool.engine.request_queue).
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import torch

from rltool import trace
from rltool.engine.batch_sampling import sample_batch
from rltool.engine.decode_overlap import SEED_MODULUS, DecodeOverlap
from rltool.engine.hybrid_prefix import snapshot_point
from rltool.engine.request import Request
from rltool.engine.request_queue import RequestQueue
from rltool.errors import BadInputError
from rltool.logprobs import effective_temperature


class BatchBuilder:
    def __init__(self, runner: Any, queue: RequestQueue, *, max_running: int,
                 max_prefill_tokens: int = 512, chunked_prefill_size: int | None = None,
                 deterministic: bool = False, overlap: bool = True,
                 num_continuous_decode_steps: int = 1, enable_mixed_chunk: bool = False):
        if num_continuous_decode_steps < 1:
            raise BadInputError(f"--num-continuous-decode-steps {num_continuous_decode_steps}: "
                                "must be at least 1")
        self.runner = runner
        self.queue = queue
        self.counters = queue.counters
        self.max_prefill_tokens = max_prefill_tokens  # prompt tokens per step
        self.chunked_prefill_size = chunked_prefill_size or max_prefill_tokens  # one chunk
        self.num_continuous_decode_steps = num_continuous_decode_steps
        if enable_mixed_chunk and deterministic:
            raise BadInputError("--enable-mixed-chunk would run decode rows with prefill's "
                                "attention, which --deterministic keeps apart; drop one of them")
        self.mixed_chunk = enable_mixed_chunk  # running requests decode in the prefill forward
        self._shared_generator = torch.Generator(device=runner.device)
        self._shared_generator.seed()
        self._seed_rng = random.Random()  # base seeds of requests without a generator
        # The Triton sampler: compiled on CUDA, interpreted on CPU under TRITON_INTERPRET=1.
        self._use_kernel = runner.triton_kernels
        self._overlap = self._use_kernel and overlap
        # Deterministic without the batch-invariant kernels (CPU): every forward holds one request.
        self._alone = deterministic and not runner.invariant_kernels
        self._sampler_args: tuple | None = None
        self._lora_on = getattr(runner, "lora", None) is not None  # --enable-lora
        self._prefill_lora: str | None = None  # the adapters of this step's forwards
        self._decode_lora: str | None = None
        self.blocks = DecodeOverlap(runner, queue, consts=self._sampling_consts,
                                    max_running=max_running,
                                    steps_per_block=num_continuous_decode_steps,
                                    enabled=self._overlap)

    # ----- the step ------------------------------------------------------------------------

    def can_step(self) -> bool:
        return self.blocks.inflight is not None or self.queue.can_step()

    def step(self) -> None:
        """Admit, prefill, one decode step (or block) of every running request."""
        queue, runner = self.queue, self.runner
        if self.blocks.inflight is not None and (queue.paused is not None or runner.released
                                                 or not queue.running):
            self.blocks.drain()
        if queue.paused is None and not runner.released:
            with runner.invariant():  # deterministic: one kernel registration per step
                queue.admit()
                self._pick_adapters()
                if not self.prefill() and queue.running:
                    counters = self.counters
                    with trace.span("decode.step", cat="engine",
                                    batch=len(queue.running)) as span:
                        forwards = counters.num_decode_forwards
                        self.decode()
                        span["steps"] = counters.num_decode_forwards - forwards

    def prefill(self) -> bool:
        """Prefill prompt chunks of `prefilling` requests; a request whose prompt is done samples
        its first token and joins `running`. With --enable-mixed-chunk the running requests
        decode one token in the same forward, each a one-token chunk over its own KV; returns
        whether they did (the step's decode is then done)."""
        runner, queue = self.runner, self.queue
        budget = self.max_prefill_tokens
        chunk = self.chunked_prefill_size
        reserved = len(queue.running)  # a page per running request's next token
        ps = runner.page_size
        # A hybrid's prefix cache snapshots each prompt's states at one point, where its chunk
        # ends (rltool.engine.hybrid_prefix)
        hybrid = runner.prefix_cache and runner.states is not None
        snaps: list[tuple[Request, int]] = []  # (request, snapshot point) of chunks ending there
        # By length: prompt prefixes ending with the first uncached full page a request of this
        # step writes; a new request whose prompt starts with one waits a step to reuse it.
        filling: dict[int, set[tuple[int, ...]]] = {}
        chunks: list[tuple[str, list[int], int]] = []
        want: list[bool] = []
        reqs: list[Request] = []
        done: list[Request] = []
        for req in queue.prefill_order():
            if req.lora != self._prefill_lora:
                continue  # --enable-lora: one adapter per forward
            target = req.prefill_target
            if req.num_cached == 0:
                if any(tuple(req.prompt_ids[:n]) in keys for n, keys in filling.items()):
                    continue  # an earlier request is writing this prefix: reuse it next step
                req.num_cached = runner.reuse_prefix(req.rid, req.all_ids(),
                                                     max_tokens=target - 1, spare=reserved,
                                                     lora=req.lora)
                if not req.output_ids:
                    req.cached_tokens = req.num_cached
            start = req.num_cached
            point = snapshot_point(len(req.prompt_ids), ps) if hybrid else 0
            # It writes full pages of its prompt that are not cached yet (a GRPO sample after
            # the group's first writes only its partial last page: nobody waits for that); a
            # hybrid's snapshot inside its last page reaches the cache with that page's end.
            if runner.prefix_cache and (
                    start < min(target - 1, len(req.prompt_ids) // ps * ps)
                    or (start == point and point % ps and not req.output_ids
                        and req.cached_tokens < point)):
                n = (start // ps + 1) * ps
                filling.setdefault(n, set()).add(tuple(req.prompt_ids[:n]))
            end = min(target, (start // chunk + 1) * chunk)
            if start < point < end:
                end = point
            if chunks and end - start > budget:
                break
            if not runner.claim_state(req.rid):
                break  # a hybrid model's recurrent-state slots are all held: wait for one
            need = runner.extra_pages(req.rid, end)
            if not runner.has_free_pages(need + reserved):
                break
            reserved += need
            chunks.append((req.rid, req.all_ids()[start:end], start))
            want.append(end == target and not req.output_ids)
            reqs.append(req)
            req.num_cached = end
            if end == point:
                snaps.append((req, point))
            budget -= end - start
            if end == target:
                done.append(req)
            if budget <= 0:
                break
        if chunks:
            self.blocks.drain()  # the prefill changes the batch; a queued block's tokens first
        else:
            if queue.prefilling and not queue.running:
                req = next(r for r in queue.prefilling if r.lora == self._prefill_lora)
                queue.finish(req, {"type": "abort", "status_code": 400, "err_type": "BadRequest",
                                   "message": f"the prompt needs {req.prefill_target} tokens of "
                                              "KV cache, more than the pool holds; raise "
                                              "--mem-fraction-static or shorten it"})
            return False
        counters = self.counters
        counters.num_prefill_tokens += sum(len(c[1]) for c in chunks)
        # Their pages were reserved above (a page per running request).
        # running requests of the prefill's adapter (then the decode's as well: _pick_adapters)
        decoding = (self._decoding() if self.mixed_chunk
                    and self._decode_lora == self._prefill_lora else [])
        if self._lora_on:
            runner.use_lora(self._prefill_lora)
        chunks += [(r.rid, [r.output_ids[-1]], _kv_length(r, 0)) for r in decoding]
        want += [True] * len(decoding)
        if self._alone:
            rows = [runner.prefill([c], want=[w]) for c, w in zip(chunks, want)]
            counters.num_prefill_forwards += len(rows)
            logits = torch.cat([r for r in rows if r is not None]) if any(want) else None
        else:
            logits = runner.prefill(chunks, want=want)
            if decoding:
                counters.num_mixed_forwards += 1
                counters.num_decode_rows += len(decoding)
            else:
                counters.num_prefill_forwards += 1
        for req, point in snaps:  # before any later forward changes the states
            if point % ps == 0:  # its node is cached now, the snapshot with it
                runner.cache_prefix(req.rid, req.prompt_ids[:point], lora=req.lora)
            runner.table.snapshot(req.rid)
        for req in done:  # running before their first token: a failing sampler ends them too
            queue.prefilling.remove(req)
            runner.cache_prefix(req.rid, req.prompt_ids, lora=req.lora)
            queue.running[req.rid] = req
        fresh = [r for r, w in zip(reqs, want) if w] + decoding
        if fresh:
            self._sample_and_accept(fresh, logits)
        return bool(decoding)

    def decode(self) -> None:
        """One decode step (a block of them when overlapping) for every running request: sample,
        record, retire the finished."""
        runner, queue, blocks, counters = self.runner, self.queue, self.blocks, self.counters
        prev = blocks.inflight
        reqs = self._decoding()
        # A batch that was all plain stays so (a request's plainness never changes).
        overlap = self._overlap and (blocks.same_batch(reqs) or all(self._plain(r) for r in reqs))
        if prev is not None and overlap and reqs != prev.reqs:
            rows = prev.rows()
            overlap = all(id(r) in rows for r in reqs)  # a newcomer has no token on the device
        if prev is not None and not overlap:
            blocks.drain()
            prev = None
        ahead = prev.steps if prev is not None else 0  # tokens of the queued block
        if not runner.has_free_pages(len(reqs)):  # at most one new page each; count exactly
            reqs.sort(key=lambda r: r.seq)
            need = sum(runner.extra_pages(r.rid, _kv_length(r, ahead + 1)) for r in reqs)
            # --enable-lora: requests that hold pages and make no progress this step go back to
            # the queue first, newest first: other adapters' running requests, and prefilling
            # ones holding claimed or written pages (a retracted request admitted again)
            decoding = {id(r) for r in reqs}
            idle = sorted((r for r in itertools.chain(queue.running.values(), queue.prefilling)
                           if id(r) not in decoding and (r.rid in queue.running or r.num_cached)),
                          key=_seq) if self._lora_on else []
            while need > runner.free_pages() and idle:
                victim = idle.pop()
                if victim.rid not in queue.running:
                    queue.prefilling.remove(victim)
                queue.retract(victim)
            while need > runner.free_pages() and len(reqs) > 1:
                victim = reqs.pop()
                need -= runner.extra_pages(victim.rid, _kv_length(victim, ahead + 1))
                queue.retract(victim)
        steps = 1
        if overlap and self.num_continuous_decode_steps > 1:
            steps = self._block_steps(reqs, ahead)
            if steps < 1:  # a request ends inside the queued block, at the end of its context
                blocks.drain()
                if queue.running:
                    self.decode()
                return
        rids = [r.rid for r in reqs]
        if self._lora_on:
            runner.use_lora(self._decode_lora)
        if self._alone:
            counters.num_decode_forwards += 1
            counters.num_decode_rows += len(reqs)
            counters.max_decode_batch = max(counters.max_decode_batch, len(reqs))
            for req in reqs:
                self._sample_and_accept([req], runner.decode([req.rid], [req.output_ids[-1]]))
            return
        blocks.prepare(reqs if overlap else [], ahead=ahead)  # the step may sample in its graph
        if prev is not None:
            src_rows = None  # the previous step's rows, in the same order
            if reqs != prev.reqs:  # some finished or were retracted
                rows = prev.rows()
                src_rows = [rows[id(r)] for r in reqs]
            logits = runner.decode(rids, None, prev_tokens=prev.tokens, src_rows=src_rows,
                                   steps=steps)
        else:
            logits = runner.decode(rids, [r.output_ids[-1] for r in reqs], steps=steps)
        counters.num_decode_forwards += steps
        counters.num_decode_rows += steps * len(reqs)
        counters.max_decode_batch = max(counters.max_decode_batch, len(reqs))
        if not overlap:
            self._sample_and_accept(reqs, logits)
            return
        blocks.launch(reqs, logits, ahead=ahead, steps=steps)

    def _pick_adapters(self) -> None:
        """--enable-lora: a forward runs one adapter. Prefill takes the requests of the oldest
        in-flight request's adapter; decode those too, or, while none of them is running yet,
        the oldest running request's (running requests always progress and free their pages).
        A prefilling request whose adapter was unloaded meanwhile ends with 400. Without LoRA
        every request has adapter None and runs in every forward."""
        queue = self.queue
        if not self._lora_on:
            return
        for req in [r for r in queue.prefilling if not self.runner.lora.has(r.lora)]:
            queue.finish(req, {"type": "abort", "status_code": 400, "err_type": "BadRequest",
                               "message": f"LoRA adapter {req.lora!r} was unloaded before the "
                                          "request ran; load it again and resend"})
        running = queue.running.values()
        oldest = min(itertools.chain(running, queue.prefilling), key=_seq, default=None)
        self._prefill_lora = self._decode_lora = oldest.lora if oldest is not None else None
        if running and not any(r.lora == self._prefill_lora for r in running):
            self._decode_lora = min(running, key=_seq).lora

    def _decoding(self) -> list[Request]:
        """The running requests of this step's decode adapter."""
        if not self._lora_on:
            return list(self.queue.running.values())
        lora = self._decode_lora
        return [r for r in self.queue.running.values() if r.lora == lora]

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

    # ----- sampling ------------------------------------------------------------------------

    def _sampling_consts(self, req: Request) -> tuple[float, bool, int, bool, int]:
        """Per-request constants of the sampling step, computed once (the per-token host work
        bounds the step at large batches): (temperature, greedy, base seed, plain, min tokens)."""
        consts = req.sampling_consts
        if consts is None:
            p = req.params
            base = (req.generator.initial_seed() if req.generator is not None
                    else self._seed_rng.getrandbits(62))
            plain = not (req.top_logprobs_num or req.token_ids_logprob)
            consts = req.sampling_consts = (effective_temperature(p.temperature), p.greedy, base,
                                            plain, p.min_new_tokens)
        return consts

    def _plain(self, req: Request) -> bool:
        """Whether an overlapped block can sample the request (it reads back tokens and their
        logprobs only: no top logprobs, no logprobs of given ids)."""
        return self._sampling_consts(req)[3]

    def _sample_and_accept(self, reqs: list[Request], logits: torch.Tensor) -> None:
        queue = self.queue
        args = self._sampler_args
        if args is None or args[0] != reqs:  # per-request arguments, kept while the batch is
            args = self._sampler_args = (  # the same
                reqs, [r.params for r in reqs], [r.generator for r in reqs],
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
            queue.accept(reqs, drawn.tokens, drawn.logprobs)
            return
        version = self.runner.weight_version
        for i, req in enumerate(reqs):
            req.record_token(drawn.tokens[i], drawn.logprobs[i], version=version,
                             top=drawn.top[i], ids_lp=drawn.ids_logprobs[i])
            queue.after_token(req, drawn.tokens[i])
        queue.count_tokens(len(reqs), time.monotonic())

    def _step_seed(self, req: Request) -> int:
        """The kernel's seed for the request's next draw."""
        base = self._sampling_consts(req)[2]
        return (base * 1_000_003 + len(req.output_ids)) % SEED_MODULUS


def _seq(req: Request) -> int:
    return req.seq


def _kv_length(req: Request, steps: int) -> int:
    """Tokens in the request's KV after `steps` more decode steps (the last sampled token is not
    in it yet)."""
    return len(req.prompt_ids) + len(req.output_ids) - 1 + steps
