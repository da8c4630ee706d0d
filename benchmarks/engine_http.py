"""The builtin engine over HTTP against the same engine in process, on RL-shaped traffic.

Per arm one engine with the same settings: `in_process` is `rltool.engine.inprocess`'s engine on
a thread of this process, driven through its `EngineState` (the call path of
`InProcessEngine.generate`: expand the /generate body, submit, await the responses); `http` is
one `rltool serve --engine builtin` process on loopback, driven by concurrent /generate calls
(aiohttp when it is installed, else httpx; the record says which). The in-process engine runs
first and is stopped before the server starts, so the two never share the device.

Workloads (random prompt ids; sampling at temperature 1.0 with ignore_eos, so every request
produces exactly its max_new_tokens; plain requests ask for logprobs, as RL rollouts do). A
workload runs in rounds: a round is a fixed list of requests kept IN_FLIGHT at a time (a new
call starts when one ends), and rounds with new prompts repeat until the run has lasted
`--min-seconds` (5). Both arms get the same rounds (the same seeds), and a warm-up of every
workload first (its shapes, other token ids, outputs an eighth as long), so no timed prompt is
in a prefix cache and no timed run compiles a kernel for a new shape.

  uniform-64    128-token prompts x 256 outputs, 64 in flight, 128 per round
  uniform-256   the same, 256 in flight, 512 per round
  mixed-256     prompts log-uniform in 64..2048 tokens, outputs lognormal (median 300,
                sigma 0.8, capped at 4096), 256 in flight, 512 per round
  grpo-8        groups: one /generate call with n = 8 per prompt (prompts 64..512 tokens, one
                lognormal output length per group), a sampling_seed on every other group; 32
                groups (256 sequences) in flight, 64 per round
  stream-64     uniform-64 streamed (server-sent events; in process: the same per-token
                updates the route streams, `EngineState.updates`), without logprobs

Per run: output tokens/s; time to first token p50/p99 (streamed runs: from the call to the first
event that carries a token, in both arms; plain runs in process: the engine's own arrival to
first token; plain runs over HTTP: not observable, the answer carries no first-token time);
prefill and decode forwards and the mean decode batch (output tokens not sampled by a prefill,
over decode forwards) from the engine's counters (`PagedScheduler.stats()`, over HTTP
/get_server_info, read at the run's ends: in process the last step's counts may land a moment
after the last answer, so a run's counts can be off by a step or two); the compilations in the run
(`compiles`: Triton builds, dynamo graphs and new prefill attention shapes, a proxy for cuDNN
plan builds, from `compiles_since_warmup`, rltool.engine.compile_watch); the CPU seconds of this
process and, over HTTP, of the server process.
With `--device cuda`, transformers `generate` on uniform-64's first round beside them (one
left-padded batch of 64, sampling, static cache).

`--layouts one,two` times the server in both layouts (docs/serve.md "Process layout") one after
the other: arm `http` with --no-frontend-process (the scheduler thread beside uvicorn), arm
`http_two_process` with --frontend-process (the scheduler in a process of its own; the server's
CPU seconds include it), and records `two_over_one_process` per workload.

GPU (one command, sized to fit 8 minutes on one H100 or H200; figures in docs/benchmarks.md):
  python -m benchmarks.engine_http --device cuda --preset qwen2.5-0.5b --out benchmarks/results
Both layouts (the in-process arm, then each server, three workloads; not yet run):
  python -m benchmarks.engine_http --device cuda --preset qwen2.5-0.5b --layouts one,two
      --skip-hf --workloads uniform-64,uniform-256,stream-64 --out benchmarks/results
  (one command line)
The mixed workload with varlen prefill (one attention call per layer for every prompt length,
where grouped prefill meets a new attention shape per length):
  python -m benchmarks.engine_http --device cuda --preset qwen2.5-0.5b --layouts two --skip-hf
      --workloads mixed-256 --prefill-attention varlen --out benchmarks/results
CPU smoke (tiny model, short runs, well under a minute on 2 cores):
  python -m benchmarks.engine_http --quick --out /tmp/engine-http
Prints a table and, last, one JSON line; `--out DIR` writes DIR/engine_http-DATE-DEVICE.json
(`engine_http-quick-...` with --quick; after each timed workload too, so a run cut short keeps
the workloads it finished).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rltool.errors import BadInputError
from rltool.supervisor import log_tail

from benchmarks import harness

LOGNORMAL_SIGMA = 0.8
TWO_PROCESS_ARM = "http_two_process"
# --layouts: the arm's name and the `rltool serve` flag that picks the layout
LAYOUTS = {"one": ("http", "--no-frontend-process"),
           "two": (TWO_PROCESS_ARM, "--frontend-process")}
WARMUP_SEED = 10_000  # warm-up rounds draw their prompts from other seeds than the timed ones


@dataclass(frozen=True)
class Workload:
    name: str
    in_flight: int  # calls in flight
    per_round: int  # calls per round
    prompt_len: tuple[int, int]  # inclusive; log-uniform between the two
    output_median: int
    output_cap: int  # the output length when fixed (output_median == output_cap)
    n: int = 1  # samples per call
    stream: bool = False

    @property
    def fixed_output(self) -> bool:
        return self.output_median == self.output_cap


def workloads(quick: bool) -> list[Workload]:
    if quick:  # the tiny model's context is 512 tokens
        return [Workload("uniform-8", 8, 16, (16, 16), 32, 32),
                Workload("uniform-32", 32, 64, (16, 16), 32, 32),
                Workload("mixed-32", 32, 64, (8, 128), 24, 96),
                Workload("grpo-8", 4, 8, (8, 64), 24, 96, n=8),
                Workload("stream-8", 8, 16, (16, 16), 32, 32, stream=True)]
    return [Workload("uniform-64", 64, 128, (128, 128), 256, 256),
            Workload("uniform-256", 256, 512, (128, 128), 256, 256),
            Workload("mixed-256", 256, 512, (64, 2048), 300, 4096),
            Workload("grpo-8", 32, 64, (64, 512), 300, 4096, n=8),
            Workload("stream-64", 64, 128, (128, 128), 256, 256, stream=True)]


def round_bodies(w: Workload, *, seed: int, vocab: int, output_scale: float = 1.0
                 ) -> list[dict[str, Any]]:
    """One round's /generate bodies, seeded; `output_scale` shortens the outputs (warm-up)."""
    rng = random.Random(seed)
    lo_id = min(100, vocab // 4)  # clear of the special ids at both ends
    lo, hi = w.prompt_len
    bodies = []
    for i in range(w.per_round):
        length = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        ids = [rng.randrange(lo_id, vocab - lo_id) for _ in range(length)]
        out = w.output_cap if w.fixed_output else min(w.output_cap, max(1, round(
            rng.lognormvariate(math.log(w.output_median), LOGNORMAL_SIGMA))))
        sp: dict[str, Any] = {"max_new_tokens": max(1, round(out * output_scale)),
                              "temperature": 1.0, "ignore_eos": True, "n": w.n}
        if w.n > 1 and i % 2 == 0:  # GRPO: seeded and unseeded groups alternate
            sp["sampling_seed"] = rng.randrange(1 << 30)
        bodies.append({"input_ids": ids, "sampling_params": sp, "stream": w.stream,
                       "return_logprob": not w.stream})
    return bodies


def expected_tokens(body: dict[str, Any]) -> int:
    sp = body["sampling_params"]
    return sp["max_new_tokens"] * sp["n"]


# ----- the two arms: a call is a body in, (output tokens, seconds to first token or None) out --


Call = Callable[[dict[str, Any]], Awaitable[tuple[int, list[float]]]]


class InProcessArm:
    """The engine on a thread of this process, through its EngineState."""

    name = "in_process"

    def __init__(self, cfg: Any):
        from rltool.engine.inprocess import InProcessEngine

        self.engine = InProcessEngine(cfg)

    async def call(self, body: dict[str, Any]) -> tuple[int, list[float]]:
        from rltool.engine.api import GenerateInput

        state = self.engine.state
        t0 = time.perf_counter()
        reqs, _ = state.expand(GenerateInput.model_validate(body))
        if not body["stream"]:
            outs = await state.run(reqs)
            return (sum(len(o["output_ids"]) for o in outs),
                    [r.t_first_token - r.t_arrival for r in reqs])
        first, tokens = None, 0
        async for _, final, event in state.updates(reqs):
            if first is None and event["output_ids"]:
                first = time.perf_counter() - t0
            if final:
                tokens += len(event["output_ids"])
        return tokens, [first]

    async def stats(self) -> dict[str, Any]:
        return self.engine.scheduler.stats()

    def cpu_s(self) -> float | None:
        return None  # the engine's threads are this process's

    def stop(self) -> None:
        self.engine.stop()


class HttpArm:
    """`rltool serve` in its own process (and its scheduler process, in the two-process
    layout), called over loopback."""

    def __init__(self, cfg_args: list[str], *, log_path: Path, max_in_flight: int,
                 name: str = "http"):
        import psutil

        from rltool.rollout.launch import start_engine

        self.name = name
        self.proc = start_engine(["--engine", "builtin", *cfg_args], log_path=log_path,
                                 ready_timeout_s=900.0)
        self.url = self.proc.url
        self.server = psutil.Process(self.proc.pid)
        self.max_in_flight = max_in_flight
        self.session: Any = None
        try:
            import aiohttp  # noqa: F401 - httpx's pool is slow at hundreds of connections

            self.client = "aiohttp"
        except ImportError:
            self.client = "httpx"

    async def open(self) -> None:
        if self.client == "aiohttp":
            import aiohttp

            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=1800))
        else:
            import httpx

            self.session = httpx.AsyncClient(timeout=1800.0, limits=httpx.Limits(
                max_connections=self.max_in_flight + 8,
                max_keepalive_connections=self.max_in_flight + 8))

    async def close(self) -> None:
        if self.session is not None:
            await (self.session.close() if self.client == "aiohttp" else self.session.aclose())
            self.session = None

    async def _post(self, body: dict[str, Any]) -> Any:
        """A plain call's answer, read whole (aiohttp's line reader caps a line at 64 KiB, less
        than an answer with thousands of logprobs)."""
        url = self.url + "/generate"
        if self.client == "aiohttp":
            async with self.session.post(url, json=body) as r:
                raw = await r.read()
                status = r.status
        else:
            r = await self.session.post(url, json=body)
            raw, status = r.content, r.status_code
        if status != 200:
            raise RuntimeError(f"/generate answered {status}: {raw[:300]!r}")
        return json.loads(raw)

    async def _events(self, body: dict[str, Any]):
        """A streamed call's events, parsed (each cumulative event is one short line)."""
        url = self.url + "/generate"
        if self.client == "aiohttp":
            async with self.session.post(url, json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"/generate answered {r.status}: {await r.text()}")
                lines = (raw.decode().rstrip("\n") async for raw in r.content)
                async for event in _parse_sse(lines):
                    yield event
        else:
            async with self.session.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise RuntimeError(f"/generate answered {r.status_code}: {r.text}")
                async for event in _parse_sse(r.aiter_lines()):
                    yield event

    async def call(self, body: dict[str, Any]) -> tuple[int, list[float]]:
        t0 = time.perf_counter()
        if not body["stream"]:
            out = await self._post(body)
            outs = out if isinstance(out, list) else [out]
            return sum(len(o["output_ids"]) for o in outs), []
        first, final = None, None
        async for event in self._events(body):
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if first is None and event["output_ids"]:
                first = time.perf_counter() - t0
            if event["meta_info"]["finish_reason"] is not None:
                final = event
        if final is None:
            raise RuntimeError("the stream ended without a finished event")
        return len(final["output_ids"]), [first]

    async def stats(self) -> dict[str, Any]:
        if self.client == "aiohttp":
            async with self.session.get(self.url + "/get_server_info") as r:
                info = await r.json()
        else:
            info = (await self.session.get(self.url + "/get_server_info")).json()
        return info["internal_states"][0]

    def cpu_s(self) -> float:
        """The server's CPU seconds, its scheduler process's included."""
        total = 0.0
        for proc in [self.server, *self.server.children(recursive=True)]:
            t = proc.cpu_times()
            total += t.user + t.system
        return total

    def stop(self) -> None:
        self.proc.stop()


async def _parse_sse(lines: Any):
    async for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


# ----- runs ------------------------------------------------------------------------------------


async def run_round(call: Call, bodies: list[dict[str, Any]], in_flight: int
                    ) -> list[tuple[int, list[float]]]:
    """`bodies` with at most `in_flight` calls at a time; each call's tokens are checked."""
    gate = asyncio.Semaphore(in_flight)

    async def one(body: dict[str, Any]) -> tuple[int, list[float]]:
        async with gate:
            tokens, ttfts = await call(body)
        if tokens != expected_tokens(body):
            raise RuntimeError(f"a call returned {tokens} output tokens, not "
                               f"{expected_tokens(body)}")
        return tokens, ttfts

    return await asyncio.gather(*(one(b) for b in bodies))


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def timed_run(arm: Any, w: Workload, *, vocab: int, min_seconds: float, seed: int
                    ) -> dict[str, Any]:
    """Rounds of `w` (round r from seed + r) until `min_seconds` have passed."""
    before = await arm.stats()
    cpu0, server0 = time.process_time(), arm.cpu_s()
    t0 = time.perf_counter()
    results: list[tuple[int, list[float]]] = []
    rounds = 0
    while rounds == 0 or time.perf_counter() - t0 < min_seconds:
        results += await run_round(arm.call, round_bodies(w, seed=seed + rounds, vocab=vocab),
                                   w.in_flight)
        rounds += 1
    seconds = time.perf_counter() - t0
    cpu, server1 = time.process_time() - cpu0, arm.cpu_s()
    after = await arm.stats()
    delta = {k: after[k] - before[k] for k in ("total_output_tokens", "num_decode_forwards",
                                               "num_prefill_forwards", "num_prefill_tokens")}
    compiles = {k: after["compiles_since_warmup"][k] - before["compiles_since_warmup"][k]
                for k in ("triton", "dynamo", "sdpa_shapes")}
    tokens = sum(t for t, _ in results)
    sequences = len(results) * w.n
    ttfts = [x for _, xs in results for x in xs]
    decode_fw = delta["num_decode_forwards"]
    return {"workload": w.name, "arm": arm.name, "in_flight": w.in_flight, "n": w.n,
            "stream": w.stream, "rounds": rounds, "calls": len(results),
            "sequences": sequences, "seconds": seconds, "output_tokens": tokens,
            "engine_output_tokens": delta["total_output_tokens"],
            "tokens_per_s": tokens / seconds,
            "ttft_p50_ms": None if not ttfts else 1e3 * percentile(ttfts, 0.5),
            "ttft_p99_ms": None if not ttfts else 1e3 * percentile(ttfts, 0.99),
            "prefill_forwards": delta["num_prefill_forwards"],
            "prefill_tokens": delta["num_prefill_tokens"], "decode_forwards": decode_fw,
            "mean_decode_batch": (tokens - sequences) / decode_fw if decode_fw else None,
            "compiles": compiles, "this_process_cpu_s": cpu,
            "server_cpu_s": None if server0 is None else server1 - server0}


async def run_arm(arm: Any, ws: list[Workload], *, vocab: int, min_seconds: float,
                  rows: list[dict[str, Any]], saved: Callable[[], None]) -> None:
    """Warm every workload up (other prompts, short outputs), then time each: its row appended
    to `rows`, then `saved()` (so a run cut short keeps the workloads it finished)."""
    for i, w in enumerate(ws):
        harness.progress(f"{arm.name}: warm-up {w.name}")
        await run_round(arm.call, round_bodies(w, seed=WARMUP_SEED + 100 * i, vocab=vocab,
                                               output_scale=1 / 8), w.in_flight)
    for i, w in enumerate(ws):
        row = await timed_run(arm, w, vocab=vocab, min_seconds=min_seconds, seed=1000 * (i + 1))
        harness.progress(f"{arm.name}: {w.name} {row['tokens_per_s']:.0f} tok/s over "
                         f"{row['seconds']:.1f} s ({row['rounds']} rounds)")
        rows.append(row)
        saved()


async def run_http(arm: HttpArm, ws: list[Workload], **kw: Any) -> None:
    await arm.open()
    try:
        await run_arm(arm, ws, **kw)
    finally:
        await arm.close()


def hf_baseline(model_dir: Path, w: Workload, *, vocab: int) -> dict[str, Any]:
    """transformers `generate` on the first timed round's first in-flight batch of `w`."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.workloads import hf_generate

    bodies = round_bodies(w, seed=1000, vocab=vocab)[:w.in_flight]
    prompts = [b["input_ids"] for b in bodies]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda()
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              cache_implementation="static", disable_compile=True)
    hf_generate(model, [p[:16] for p in prompts], max_new_tokens=4, pad_token_id=0,
                min_new_tokens=4, **kw)
    out, seconds = hf_generate(model, prompts, max_new_tokens=w.output_cap, pad_token_id=0,
                               min_new_tokens=w.output_cap, **kw)
    del model
    torch.cuda.empty_cache()
    tokens = sum(map(len, out))
    return {"workload": w.name, "batch": len(prompts), "seconds": seconds,
            "output_tokens": tokens, "tokens_per_s": tokens / seconds}


def serve_settings(args: argparse.Namespace, ws: list[Workload]) -> dict[str, Any]:
    """The engine's settings, the same for both arms (ServeConfig fields)."""
    max_running = max(w.in_flight * w.n for w in ws)
    settings: dict[str, Any] = {"device": args.device, "max_running_requests": max_running,
                                "max_queued_requests": 4 * max_running}
    if args.device == "cuda":
        settings |= {"dtype": "bf16", "cuda_graph_max_bs": max_running,
                     "mem_fraction_static": args.mem_fraction_static}
    else:
        settings |= {"dtype": "fp32", "num_threads": args.num_threads}
    if args.prefill_attention:
        settings["prefill_attention"] = args.prefill_attention
    if args.enable_mixed_chunk:
        settings["enable_mixed_chunk"] = True
    return settings


def flags(settings: dict[str, Any]) -> list[str]:
    """`rltool serve`'s flags for the settings (a True field is its bare flag)."""
    out: list[str] = []
    for k, v in settings.items():
        out += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return out


def ratios(rows: list[dict[str, Any]], arm: str, base: str) -> dict[str, float]:
    """`arm`'s tokens/s over `base`'s per workload."""
    by = {(r["workload"], r["arm"]): r["tokens_per_s"] for r in rows}
    return {w: by[(w, arm)] / by[(w, base)] for w, a in by if a == arm and (w, base) in by}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--preset", default="qwen2.5-0.5b",
                        help="Model shapes (rltool.data.models presets); --quick: tiny.")
    parser.add_argument("--quick", action="store_true",
                        help="CPU, tiny model, small workloads, 1 s runs.")
    parser.add_argument("--min-seconds", type=float, default=None,
                        help="Each timed run repeats rounds until this long (5; --quick: 1).")
    parser.add_argument("--workloads", default=None,
                        help="Comma-separated subset of the workloads' names.")
    parser.add_argument("--skip-hf", action="store_true", help="No transformers baseline.")
    parser.add_argument("--mem-fraction-static", type=float, default=0.8)
    parser.add_argument("--num-threads", type=int, default=1, help="cpu: torch threads.")
    parser.add_argument("--layouts", default="one",
                        help="Comma-separated server layouts to time: one (the scheduler thread "
                             "beside uvicorn, arm http), two (--frontend-process, arm "
                             f"{TWO_PROCESS_ARM}).")
    parser.add_argument("--prefill-attention", choices=("grouped", "varlen"), default=None,
                        help="Both arms' engines' prefill attention (serve's "
                             "--prefill-attention; default the engine's); named in the results' "
                             "file name.")
    parser.add_argument("--enable-mixed-chunk", action="store_true",
                        help="Both arms' engines prefill in the decode forwards (serve's "
                             "--enable-mixed-chunk); named in the results' file name.")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",")
    if not layouts or set(layouts) - set(LAYOUTS):
        parser.error(f"--layouts {args.layouts!r}: choose from {sorted(LAYOUTS)}")
    if args.quick:
        args.device, args.preset = "cpu", "tiny"
    try:
        harness.require_device(args.device)
    except BadInputError as e:
        parser.error(str(e))
    min_seconds = args.min_seconds if args.min_seconds is not None else (
        1.0 if args.quick else 5.0)
    ws = workloads(args.quick)
    if args.workloads:
        names = args.workloads.split(",")
        unknown = set(names) - {w.name for w in ws}
        if unknown:
            parser.error(f"unknown workloads {sorted(unknown)}; choose from "
                         f"{[w.name for w in ws]}")
        ws = [w for w in ws if w.name in names]

    import torch

    from rltool.data.models import init_model
    from rltool.engine.config import ServeConfig

    if args.device == "cpu":
        torch.set_num_threads(args.num_threads)  # the server gets the same (--num-threads)
    run = harness.Run("engine_http", device=args.device)
    variant = "-".join(v for v in ("quick" if args.quick else "", args.prefill_attention or "",
                                   "mixed" if args.enable_mixed_chunk else "") if v)
    tmp = Path(tempfile.mkdtemp(prefix="rltool-engine-http-"))
    harness.progress(f"model {args.preset} on {args.device}")
    if args.device == "cuda":
        from benchmarks.engine_common import random_checkpoint

        model_dir = random_checkpoint(tmp / args.preset, args.preset)
    else:
        model_dir = init_model(tmp / args.preset, preset=args.preset, task="reverse", seed=0)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    settings = serve_settings(args, ws)
    fields: dict[str, Any] = {"settings": {"preset": args.preset, "min_seconds": min_seconds,
                                           "serve": settings, "quick": args.quick,
                                           "lognormal_sigma": LOGNORMAL_SIGMA},
                              "workloads": [asdict(w) for w in ws], "results": []}

    def saved() -> None:
        if args.out:
            run.write(run.record(fields), args.out, variant=variant)

    kw = dict(vocab=vocab, min_seconds=min_seconds, rows=fields["results"], saved=saved)
    inproc = InProcessArm(ServeConfig(model=model_dir, **settings))
    try:
        asyncio.run(run_arm(inproc, ws, **kw))
    finally:
        inproc.stop()
        del inproc
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    for layout in layouts:
        arm_name, flag = LAYOUTS[layout]
        http = HttpArm(["--model", str(model_dir), *flags(settings), flag,
                        "--log-level", "warning"], log_path=tmp / f"serve-{layout}.log",
                       max_in_flight=max(w.in_flight for w in ws), name=arm_name)
        fields["settings"]["http_client"] = http.client
        try:
            asyncio.run(run_http(http, ws, **kw))
        except Exception:
            harness.progress(f"{arm_name} failed; the server's log ends:\n"
                             + log_tail(tmp / f"serve-{layout}.log"))
            raise
        finally:
            http.stop()
        fields[f"{arm_name}_over_in_process"] = ratios(fields["results"], arm_name, "in_process")
        saved()
    if len(layouts) == 2:
        fields["two_over_one_process"] = ratios(fields["results"], TWO_PROCESS_ARM, "http")

    uniform = [w for w in ws if w.name.startswith("uniform")]
    if args.device == "cuda" and not args.skip_hf and uniform:
        harness.progress("transformers generate")
        fields["hf_generate"] = hf_baseline(model_dir, uniform[0], vocab=vocab)

    inproc_tps = {r["workload"]: r["tokens_per_s"] for r in fields["results"]
                  if r["arm"] == "in_process"}
    harness.print_table(
        ["workload", "arm", "in flight", "calls", "s", "out tok/s", "http/inproc",
         "TTFT p50 ms", "TTFT p99 ms", "prefill fw", "decode fw", "mean decode B",
         "compiles", "cpu s (here)", "cpu s (server)"],
        [[r["workload"], r["arm"], r["in_flight"], r["calls"], r["seconds"], r["tokens_per_s"],
          (r["tokens_per_s"] / inproc_tps[r["workload"]]
           if r["arm"] != "in_process" and r["workload"] in inproc_tps else None),
          r["ttft_p50_ms"], r["ttft_p99_ms"], r["prefill_forwards"], r["decode_forwards"],
          r["mean_decode_batch"], sum(r["compiles"].values()), r["this_process_cpu_s"],
          r["server_cpu_s"]]
         for r in sorted(fields["results"], key=lambda r: (r["workload"], r["arm"]))])
    if "hf_generate" in fields:
        hf = fields["hf_generate"]
        print(f"transformers generate, {hf['workload']} batch {hf['batch']}: "
              f"{hf['tokens_per_s']:.0f} tok/s")
    return run.finish(fields, out=args.out, variant=variant)


if __name__ == "__main__":
    main()
    sys.exit(0)
