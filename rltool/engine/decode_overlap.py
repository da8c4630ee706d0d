"""Overlapped decoding (CUDA, the Triton sampler): step N + 1 is queued on the device, fed straight
from step N's sampled tokens, before the host reads step N's tokens back; the host's per-request
work then runs while the device computes. A block may hold several decode steps
(--num-continuous-decode-steps), each fed the last one's samples on the device, its tokens and
logprobs copied into pinned memory as each step is queued and read once per block. A request that stops at step N has computed one extra token, which is
dropped. Top-k / top-p / min-p, logit_bias and min_new_tokens are sampled inside a block: the
batch's DrawParams are built once, and each step's logits become the race's draw logits on the
device, stop ids masked while a row's token index is below its min_new_tokens. Prefill, control
operations and requests asking for top logprobs or the logprobs of given ids drain first (the
batch builder, rltool.engine.batch_builder, decides).

Where the runner samples inside its forward (`graph_sampling`), `prepare` hands it the batch's
sampling rows before the block's first step, so each step's CUDA graph draws the tokens and
advances the next step's inputs (rltool.engine.decode_sample): the host queues a replay and the
copies of its tokens and logprobs per step. logit_bias and stop ids still masked go with them (the draw rows) up to
decode_sample's limits; a batch with top-k / top-p / min-p, or past those limits, samples after
the forward as above; the counters say how many steps took each path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rltool.engine.batch_sampling import DrawParams, draw_lists, draw_logits
from rltool.engine.decode_sample import SEED_MODULUS, draw_rows_of, sample_rows_of
from rltool.engine.request import Request
from rltool.engine.request_queue import RequestQueue


@dataclass
class _Buffers:
    """Host memory one overlapped block of decode steps reads its sampling parameters from
    (int32: B temperatures as float32 bits, B greedy flags, B seeds per step, then B stop-id
    mask flags per step, contiguous so one asynchronous copy takes them) and writes its tokens to
    (step-major), and the event that marks its copies done (two sets, used alternately). Pinned
    on CUDA."""

    params: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    event: Any

    @staticmethod
    def make(n: int, steps: int, cuda: bool) -> "_Buffers":
        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            t = torch.empty(*shape, dtype=dtype, device="cpu")
            return t.pin_memory() if cuda else t

        return _Buffers(host((2 + 2 * steps) * n, dtype=torch.int32),
                        host(steps * n, dtype=torch.int64), host(steps * n, dtype=torch.float32),
                        torch.cuda.Event() if cuda else _Done())


class _Done:
    """The event of a buffer on CPU, where every copy is done when it returns."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


@dataclass
class Block:
    """A block of decode steps queued on the device, its tokens not yet recorded."""

    reqs: list[Request]
    tokens: torch.Tensor  # the last step's, on the device
    buf: _Buffers
    removals: int  # the queue's count of requests leaving `running`, at launch
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
    min_new: np.ndarray  # int64: min_new_tokens
    draw: DrawParams | None  # None: the plain race
    rows: np.ndarray  # the sampling rows of a step that samples in its forward
    draw_rows: np.ndarray | None  # the same with the draw rows (None: they do not fit)


class DecodeOverlap:
    """The block in flight (`inflight`), launching the next one and recording a finished one.
    `consts(req)` gives a request's (temperature, greedy, base seed, plain, min new tokens)."""

    def __init__(self, runner: Any, queue: RequestQueue, *,
                 consts: Callable[[Request], tuple[float, bool, int, bool, int]],
                 max_running: int, steps_per_block: int, enabled: bool):
        self.runner = runner
        self.queue = queue
        self._request_consts = consts
        self.inflight: Block | None = None
        self._consts: _BatchConsts | None = None
        self.launches = 0  # blocks launched
        self.draw_launches = 0  # of them, blocks that sampled with DrawParams
        self.forward_sampled_steps = 0  # decode steps whose forward drew the tokens
        self.graph_sampled_steps = 0  # of them, those replayed from a CUDA graph
        self.eager_sampled_steps = 0  # the others (and those sampled after their forward)
        cuda = runner.device.type == "cuda"
        self._buffers = ([_Buffers.make(max_running, steps_per_block, cuda) for _ in range(2)]
                         if enabled else [])

    def stats(self) -> dict[str, int]:
        """The engine stats' counts of overlapped decode steps whose tokens a CUDA graph drew
        and of the others (no graph for the batch, or the sampler launched after the forward)."""
        return {"num_graph_sampled_steps": self.graph_sampled_steps,
                "num_eager_sampled_steps": self.eager_sampled_steps}

    def same_batch(self, reqs: list[Request]) -> bool:
        """Whether `reqs` is the batch of the last launched block, in order."""
        return self._consts is not None and reqs == self._consts.reqs

    def prepare(self, reqs: list[Request], *, ahead: int) -> None:
        """Before the decode step of an overlapped block over `reqs` (none: a step that is not
        overlapped): have the runner sample inside the step's forward when the batch races
        plainly or over draw logits that fit the draw rows (logit_bias, stop ids masked before
        min_new_tokens; no top-k / top-p / min-p)."""
        runner = self.runner
        rows = None
        if reqs and runner.graph_sampling:
            consts = self._consts_for(reqs, vocab=runner.vocab_size, device=runner.device)
            draw = consts.draw
            if draw is not None:  # stop ids to mask only while a row is below its minimum
                drawn = np.array([len(r.output_ids) for r in reqs], dtype=np.int64)
                draw = self._draw(consts, drawn + ahead)
            rows = consts.rows if draw is None else (
                consts.draw_rows if draw.filtered is None else None)
        runner.sample_next(rows)

    def launch(self, reqs: list[Request], logits: torch.Tensor | None, *, ahead: int,
               steps: int) -> None:
        """Queue the next block from the first step's logits (None: its forward sampled), then
        record the block in flight (its tokens are on the host by now or soon)."""
        prev = self.inflight
        self.inflight = self._launch_block(reqs, logits, ahead=ahead, steps=steps)
        if prev is not None:
            self._accept_block(prev)

    def drain(self) -> None:
        """Record the block in flight, if any."""
        block, self.inflight = self.inflight, None
        if block is not None:
            self._accept_block(block)

    def _launch_block(self, reqs: list[Request], logits: torch.Tensor | None, *, ahead: int,
                      steps: int) -> Block:
        """Sample the first step's logits (unless its forward sampled them), then run the rest of
        the block, each step fed the last one's samples on the device; queue one copy of each
        step's tokens and logprobs back."""
        B = len(reqs)
        runner = self.runner
        consts = self._consts_for(reqs, vocab=runner.vocab_size, device=runner.device)
        self.launches += 1
        buf = self._buffers[self.launches % 2]
        buf.event.synchronize()  # the copies of the block that last used this buffer are done
        sample = None if logits is None else self._sampler(
            consts, np.array([len(r.output_ids) for r in reqs], dtype=np.int64) + ahead,
            buf, steps=steps, device=runner.device)
        tok = None
        for i in range(steps):
            if i:
                logits = runner.decode_next(tok)
            sampled = runner.sampled()
            if sampled is None:
                tok, lp = sample(logits, i)
                self.eager_sampled_steps += 1
            else:
                tok, lp, graphed = sampled
                self.forward_sampled_steps += 1
                self.graph_sampled_steps += graphed
                self.eager_sampled_steps += not graphed
            buf.tokens[i * B:(i + 1) * B].copy_(tok, non_blocking=True)
            buf.logprobs[i * B:(i + 1) * B].copy_(lp, non_blocking=True)
        buf.event.record()
        return Block(reqs=reqs, tokens=tok, buf=buf, removals=self.queue.removals, steps=steps)

    def _sampler(self, consts: _BatchConsts, index: np.ndarray, buf: _Buffers, *, steps: int,
                 device: torch.device) -> Callable[[torch.Tensor, int], tuple]:
        """Step i's sampling after its forward, as `sample(logits, i)`: the batch's temperatures,
        greedy flags, each step's seeds and stop-id masks in one asynchronous copy (`index`: the
        token index each row draws at the block's first step)."""
        from rltool.engine.sampling_kernel import sample_rows

        B = len(consts.reqs)
        host = buf.params.numpy()
        host[:B] = consts.temps.view(np.int32)
        host[B:2 * B] = consts.greedy
        # A draw is keyed by (seed, token index): step i of the block draws token index + i.
        index = index + np.arange(steps)[:, None]
        host[2 * B:(2 + steps) * B].reshape(steps, B)[:] = (consts.seeds + index) % SEED_MODULUS
        host[(2 + steps) * B:(2 + 2 * steps) * B].reshape(steps, B)[:] = index < consts.min_new
        draw = self._draw(consts, index[0])
        self.draw_launches += draw is not None
        dev = buf.params[:(2 + 2 * steps) * B].to(device, non_blocking=True)
        temps, greedy = dev[:B].view(torch.float32), dev[B:2 * B]

        def sample(logits: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            race = None
            if draw is not None:
                masked = dev[(2 + steps + i) * B:(3 + steps + i) * B] != 0
                race = draw_logits(logits, draw, masked)
            return sample_rows(logits, temps, dev[(2 + i) * B:(3 + i) * B], greedy, draw=race)

        return sample

    @staticmethod
    def _draw(consts: _BatchConsts, index: np.ndarray) -> DrawParams | None:
        """The batch's draw parameters for a block whose first step draws token `index` of each
        row; None when the plain race suffices (only stop ids to mask, every row past its
        min_new_tokens)."""
        draw = consts.draw
        if draw is not None and draw.filtered is None and draw.bias_ids is None and (
                index >= consts.min_new).all():
            return None
        return draw

    def _consts_for(self, reqs: list[Request], *, vocab: int,
                    device: torch.device) -> _BatchConsts:
        consts = self._consts
        if consts is None or consts.reqs != reqs:
            consts = self._consts = self._batch_consts(reqs, vocab=vocab, device=device)
        return consts

    def _batch_consts(self, reqs: list[Request], *, vocab: int,
                      device: torch.device) -> _BatchConsts:
        infos = [self._request_consts(r) for r in reqs]
        eos = self.runner.eos_token_ids
        stops = [sorted(eos | set(r.params.stop_token_ids)) if i[4] > 0 else []
                 for r, i in zip(reqs, infos)]
        temps = np.array([i[0] for i in infos], dtype=np.float32)
        seeds = np.array([i[2] * 1_000_003 % SEED_MODULUS for i in infos], dtype=np.int64)
        greedy = np.array([i[1] for i in infos], dtype=np.int32)
        min_new = np.array([i[4] for i in infos], dtype=np.int64)
        params = [r.params for r in reqs]
        rows = sample_rows_of(temps, greedy, seeds,
                              np.array([len(r.prompt_ids) for r in reqs], dtype=np.int64))
        draw_rows = None
        if not any(p.needs_filter for p in params):
            biases, in_vocab = draw_lists(params, stop_ids=stops, vocab=vocab)
            extra = draw_rows_of(min_new, in_vocab, biases)
            draw_rows = None if extra is None else np.concatenate([rows, extra])
        return _BatchConsts(
            reqs=reqs, temps=temps, seeds=seeds, greedy=greedy, min_new=min_new,
            draw=DrawParams.build(params, temps=temps.tolist(), stop_ids=stops, vocab=vocab,
                                  device=device),
            rows=rows, draw_rows=draw_rows)

    def _accept_block(self, block: Block) -> None:
        """Record a block's tokens step by step; a request's tokens after the one that stops it
        are dropped (its pages, the block's extra KV included, were freed when it finished)."""
        block.buf.event.synchronize()
        queue = self.queue
        reqs, B, steps = block.reqs, len(block.reqs), block.steps
        tokens = block.buf.tokens[:steps * B].tolist()
        logprobs = block.buf.logprobs[:steps * B].tolist()
        if block.removals == queue.removals:  # every request of the block is still running
            live = range(B)
        else:
            running = queue.running
            live = [i for i, r in enumerate(reqs) if running.get(r.rid) is r]
        for step in range(steps):
            if step:
                live = [i for i in live if not reqs[i].finished]
            at = step * B
            if len(live) == B:
                queue.accept(reqs, tokens[at:at + B], logprobs[at:at + B])
            elif live:
                queue.accept([reqs[i] for i in live], [tokens[at + i] for i in live],
                             [logprobs[at + i] for i in live])
