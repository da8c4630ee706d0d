"""Benchmark the builtin engine against transformers `generate` in the same run.

Same model, prompts and sampling (greedy, so both do the same work token for token; EOS enabled,
no ignore_eos). Output lengths are capped per request by a long-tail draw of max_new_tokens
(Pareto, alpha 1.1, scaled so most requests are short and a few are long). Two measurements per
(model, batch size B):

* throughput: a closed loop of B concurrent clients over HTTP, each sending its next request as
  soon as the previous one finishes (what a rollout stage does); the baseline runs the same
  requests through `model.generate` in chunks of B (left-padded; a chunk runs until its longest
  request is done). Useful output tokens / wall second; EOS and each request's own cap end it.
  Three baselines: "naive" (chunks in arrival order, dynamic KV cache), and the best reasonable
  use of `generate`: requests sorted by output cap so a chunk's members need similar numbers of
  decode steps, with the dynamic and with transformers' static KV cache
  (`cache_implementation="static"`); the ratio is taken against the faster of the two sorted
  runs. Baselines, engine core and engine over HTTP run in turn within each of --repeats rounds
  (medians reported), so machine drift hits all alike.
* time to first token: B requests sent at once (streaming; the first SSE event is the first
  token) vs `generate(max_new_tokens=1)` on the same B prompts, the two alternating wave by wave.
  Mean over the wave; at B=1 over up to TTFT_WAVES_B1 single prompts (one is too noisy a sample).

The server is `rltool serve --engine builtin` in a subprocess (--max-running-requests B), so its
times include HTTP and JSON. Both sides use the same torch thread count (--threads, default 1:
on this shared, oversubscribed 2-core box two OpenMP threads per process run ~15x slower).

Usage: python -m benchmarks.engine_throughput [--presets tiny,qwen2.5-0.5b]
       [--batches 1,16,64] [--quick] [--out DIR_OR_FILE.json]
Prints a table and, last, one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import torch
import transformers

from rltool.data.models import init_model
from rltool.rollout.launch import start_engine

from benchmarks import harness
from benchmarks.workloads import hf_generate

# Per preset: requests per batch size, cap on max_new_tokens, prompt length range (tokens).
PLANS = {
    "tiny": {"requests": {1: 16, 16: 128, 64: 512}, "cap": 256, "scale": 6, "prompt": (16, 64)},
    # 0.5B on 2 cores: several requests per slot (with one wave nothing refills the freed slots;
    # with two, the drain at the end is a third of the engine's time) and a short scale keep the
    # run to ~15 minutes, most of it `generate`'s.
    "qwen2.5-0.5b": {"requests": {1: 3, 16: 32, 64: 256}, "cap": 128, "scale": 3,
                     "prompt": (16, 48)},
}
TARGET_RATIO_B64 = 3.0
TTFT_WAVES_B1 = 16


def long_tail_lengths(n: int, *, scale: int, cap: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(cap, int(scale * (1.0 - rng.random()) ** (-1 / 1.1))) for _ in range(n)]


def make_prompts(tokenizer, n: int, lo: int, hi: int, *, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    chars = "abcdefghijklmnopqrstuvwxyz0123456789 "
    prompts = []
    for _ in range(n):
        text = "".join(rng.choice(chars) for _ in range(rng.randint(lo, hi)))
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def useful_tokens(row: list[int], *, cap: int, eos: set[int]) -> int:
    for i, tok in enumerate(row[:cap]):
        if tok in eos:
            return i + 1
    return min(len(row), cap)


# ----- transformers generate baseline -------------------------------------------------------

def hf_chunk(model, prompts: list[list[int]], caps: list[int], *, pad: int, eos: set[int],
             max_new_tokens: int | None = None,
             cache_implementation: str | None = None) -> tuple[int, float]:
    """One greedy left-padded generate() over the chunk; returns (useful tokens, seconds)."""
    new = max_new_tokens if max_new_tokens is not None else max(caps)
    gen, elapsed = hf_generate(model, prompts, max_new_tokens=new, pad_token_id=pad,
                               do_sample=False, eos_token_id=sorted(eos),
                               cache_implementation=cache_implementation)
    return sum(useful_tokens(row, cap=c, eos=eos) for row, c in zip(gen, caps)), elapsed


HF_BASELINES = {"naive": (False, None), "sorted": (True, None), "sorted_static": (True, "static")}


def hf_throughput(model, prompts, caps, batch: int, *, pad: int, eos: set[int],
                  sort_by_cap: bool = False, cache_implementation: str | None = None) -> dict:
    order = list(range(len(prompts)))
    if sort_by_cap:
        order.sort(key=lambda i: caps[i])
    prompts, caps = [prompts[i] for i in order], [caps[i] for i in order]
    tokens, t0, cpu0 = 0, time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch):
        n, _ = hf_chunk(model, prompts[i:i + batch], caps[i:i + batch], pad=pad, eos=eos,
                           cache_implementation=cache_implementation)
        tokens += n
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "cpu_s": cpu,
            "tokens_per_cpu_s": tokens / cpu if cpu > 0 else float("nan")}


def ttft_starts(batch: int, n: int) -> range:
    """First prompt index of each TTFT wave: one wave of B, or several single prompts at B=1."""
    return range(min(TTFT_WAVES_B1, n)) if batch == 1 else range(1)


def hf_ttft(model, prompts, *, pad: int, eos: set[int]) -> float:
    _, elapsed = hf_chunk(model, prompts, [1] * len(prompts), pad=pad, eos=eos,
                          max_new_tokens=1)
    return elapsed


# ----- builtin engine core in this process (scheduler thread, no HTTP) ------------------------

def core_run(model_dir: Path, prompts, caps, batch: int, *, deterministic: bool = False,
             return_logprob: bool = False) -> dict:
    """The same closed loop and TTFT wave against Scheduler directly: isolates the engine's
    batching from HTTP/JSON costs and from process scheduling on the shared box."""
    import threading

    from rltool.engine.config import ServeConfig
    from rltool.engine.request import Request
    from rltool.engine.sampling import SamplingParams
    from rltool.engine.server import build_engine

    _, sched = build_engine(ServeConfig(model=model_dir, device="cpu", max_running_requests=batch,
                                        deterministic=deterministic))
    sched.start()
    lock, done = threading.Lock(), threading.Event()
    pending = list(range(len(prompts)))
    finished = [0]

    def request(i: int, cap: int, **kw) -> Request:
        return Request(rid=f"r{i}-{cap}-{time.perf_counter_ns()}", prompt_ids=prompts[i],
                       params=SamplingParams(max_new_tokens=cap, temperature=0.0),
                       return_logprob=return_logprob, **kw)

    def next_one(_req: Request | None = None) -> None:
        with lock:
            if _req is not None:
                finished[0] += 1
            if finished[0] == len(prompts):
                done.set()
            if not pending:
                return
            i = pending.pop(0)
        sched.submit([request(i, caps[i], on_finish=next_one)])

    try:
        warm = threading.Event()
        sched.submit([request(0, 2, on_finish=lambda r: warm.set())])
        warm.wait()
        tokens0, t0, cpu0 = sched.total_output_tokens, time.perf_counter(), time.process_time()
        for _ in range(batch):
            next_one()
        done.wait()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        tokens = sched.total_output_tokens - tokens0
        firsts = []
        for start in ttft_starts(batch, len(prompts)):
            wave_done = threading.Semaphore(0)
            wave = [request(i, 1, on_finish=lambda r: wave_done.release())
                    for i in range(start, start + batch)]
            sched.submit(wave)
            for _ in wave:
                wave_done.acquire()
            firsts += [r.t_first_token - r.t_arrival for r in wave]
        ttft = statistics.mean(firsts)
    finally:
        sched.stop()
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "cpu_s": cpu,
            "tokens_per_cpu_s": tokens / cpu, "ttft_s": ttft,
            "max_decode_batch_seen": sched.max_decode_batch}


# ----- builtin engine over HTTP ---------------------------------------------------------------

def payload(prompt: list[int], cap: int, *, stream: bool = False) -> dict:
    return {"input_ids": prompt, "stream": stream,
            "sampling_params": {"max_new_tokens": cap, "temperature": 0.0}}


class Connection:
    """A minimal HTTP/1.1 keep-alive client for the load generator.

    httpx measured ~11 ms of client CPU per request at 64 concurrent connections on this 2-core
    box, i.e. the load generator took as much CPU as the server it measured. This client does only
    what the benchmark needs (POST JSON, read a Content-Length or chunked body) so the engine is
    what gets measured. Rollouts use rltool.rollout.client.EngineClient (httpx).
    """

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _send(self, path: str, body: dict) -> None:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: "
                          f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                          + data)
        await self.writer.drain()

    async def _headers(self) -> dict[str, str]:
        head = await self.reader.readuntil(b"\r\n\r\n")
        status, *lines = head.decode("latin-1").split("\r\n")
        if not status.startswith("HTTP/1.1 200"):
            raise RuntimeError(f"engine answered {status}")
        return {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines if ln)}

    async def post_json(self, path: str, body: dict) -> dict:
        await self._send(path, body)
        headers = await self._headers()
        return json.loads(await self.reader.readexactly(int(headers["content-length"])))

    async def first_event(self, path: str, body: dict) -> None:
        """Send a streaming request, return at its first SSE data event, drop the connection."""
        await self._send(path, body)
        await self._headers()  # chunked: each chunk is "<hex size>\r\n<data>\r\n"
        while True:
            size = int((await self.reader.readline()).strip(), 16)
            chunk = await self.reader.readexactly(size + 2)
            if chunk.startswith(b"data: {"):
                self.close()
                return
            if size == 0:
                raise RuntimeError("stream ended without a token")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def builtin_throughput(url: str, prompts, caps, batch: int, *, pid: int) -> dict:
    """Closed loop over HTTP. CPU time counts the server process and this client process."""
    server, me = psutil.Process(pid), psutil.Process()
    cpu0 = sum(server.cpu_times()[:2]) + sum(me.cpu_times()[:2])
    queue = list(range(len(prompts)))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        conn = Connection(url)
        try:
            while queue:
                i = queue.pop(0)
                out = await conn.post_json("/generate", payload(prompts[i], caps[i]))
                tokens += out["meta_info"]["completion_tokens"]
        finally:
            conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(batch)])
    wall = time.perf_counter() - t0
    cpu = sum(server.cpu_times()[:2]) + sum(me.cpu_times()[:2]) - cpu0
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "cpu_s": cpu,
            "tokens_per_cpu_s": tokens / cpu if cpu > 0 else float("nan")}


async def builtin_ttft(url: str, prompts) -> float:
    """B streaming requests at once on fresh connections; mean time to the first SSE event."""
    conns = [Connection(url) for _ in prompts]
    for c in conns:  # connect first: TCP set-up is not the engine's time to first token
        c.reader, c.writer = await asyncio.open_connection(c.host, c.port)

    async def first_token(conn: Connection, prompt: list[int]) -> float:
        t = time.perf_counter()
        await conn.first_event("/generate", payload(prompt, 1, stream=True))
        return time.perf_counter() - t

    times = await asyncio.gather(*[first_token(c, p) for c, p in zip(conns, prompts)])
    return statistics.mean(times)


# ----- driver ---------------------------------------------------------------------------------

def _median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (the lower middle one for an even count), with every
    repeat's tokens/s kept beside it."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ranked[(len(ranked) - 1) // 2],
            "tokens_per_s_runs": [r["tokens_per_s"] for r in runs]}


def run_case(model_dir: Path, preset: str, batch: int, *, quick: bool, workdir: Path,
             requests: int | None = None, repeats: int = 1) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plan = PLANS[preset]
    n = requests or plan["requests"][batch]
    if quick and not requests:  # keep several requests per slot, or continuous batching has nothing to refill
        n = max(min(n, 4 * batch), batch)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = make_prompts(tok, n, *plan["prompt"], seed=batch)
    caps = long_tail_lengths(n, scale=plan["scale"], cap=plan["cap"], seed=batch)

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    eos = {tok.eos_token_id}
    pad = tok.pad_token_id
    for impl in (None, "static"):  # warm-up
        hf_chunk(model, prompts[:1], [2], pad=pad, eos=eos, cache_implementation=impl)
    waves = [prompts[s:s + batch] for s in ttft_starts(batch, n)]
    hf_runs: dict[str, list[dict]] = {name: [] for name in HF_BASELINES}
    core_runs, http_runs = [], []

    engine = start_engine(["--engine", "builtin", "--model", str(model_dir),
                           "--max-running-requests", str(batch), "--log-level", "warning",
                           "--num-threads", str(torch.get_num_threads())],
                          log_path=workdir / f"engine-{preset}-{batch}.log", ready_timeout_s=600)
    try:
        asyncio.run(builtin_throughput(engine.url, prompts[:1], [2], 1, pid=engine.pid))  # warm
        for _ in range(repeats):
            for name, (sort_by_cap, impl) in HF_BASELINES.items():
                hf_runs[name].append(hf_throughput(model, prompts, caps, batch, pad=pad, eos=eos,
                                                   sort_by_cap=sort_by_cap,
                                                   cache_implementation=impl))
            core_runs.append(core_run(model_dir, prompts, caps, batch))
            http_runs.append(asyncio.run(builtin_throughput(engine.url, prompts, caps, batch,
                                                            pid=engine.pid)))
        hf_all = {name: _median_run(runs) for name, runs in hf_runs.items()}
        core, ours = _median_run(core_runs), _median_run(http_runs)
        core["ttft_s"] = statistics.median(r["ttft_s"] for r in core_runs)
        best_name = max(("sorted", "sorted_static"), key=lambda k: hf_all[k]["tokens_per_s"])
        hf = dict(hf_all[best_name], config=best_name)
        # Wave by wave, generate then the engine: both sides see the same machine state (the
        # shared box drifts by tens of percent between minutes, more than a tiny model's TTFT).
        hf_ttfts, ttfts = [], []
        for w in waves:
            hf_ttfts.append(hf_ttft(model, w, pad=pad, eos=eos))
            ttfts.append(asyncio.run(builtin_ttft(engine.url, w)))
        hf["ttft_s"], ours["ttft_s"] = statistics.mean(hf_ttfts), statistics.mean(ttfts)
        info = httpx.get(engine.url + "/get_server_info", timeout=60).json()["internal_states"][0]
        ours["max_decode_batch_seen"] = info["max_decode_batch_seen"]
    finally:
        engine.stop()
    del model
    naive = hf_all["naive"]
    return {"preset": preset, "batch": batch, "requests": n, "cap": plan["cap"],
            "mean_cap": statistics.mean(caps), "repeats": repeats, "builtin": ours,
            "builtin_core": core, "hf_generate": hf, "hf_generate_all": hf_all,
            "throughput_ratio": ours["tokens_per_s"] / hf["tokens_per_s"],
            "throughput_ratio_vs_naive": ours["tokens_per_s"] / naive["tokens_per_s"],
            "cpu_throughput_ratio": ours["tokens_per_cpu_s"] / hf["tokens_per_cpu_s"],
            "ttft_ratio": ours["ttft_s"] / hf["ttft_s"],
            "core_throughput_ratio": core["tokens_per_s"] / hf["tokens_per_s"],
            "core_ttft_ratio": core["ttft_s"] / hf["ttft_s"]}


TABLE_HEAD = ("| model | B | requests | generate naive tok/s | generate sorted tok/s | "
              "generate sorted+static tok/s | core tok/s (x best) | HTTP tok/s (x best) | "
              "HTTP x naive | HTTP per CPU-s (x best) | generate TTFT ms | core TTFT ms (x) | "
              "HTTP TTFT ms (x) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
TABLE_ROW = ("| {preset} | {batch} | {requests} | {naive_tps:.1f} | {sorted_tps:.1f} | "
             "{static_tps:.1f} | {core_tps:.1f} ({core_x:.2f}) | "
             "{http_tps:.1f} ({http_x:.2f}) | {naive_x:.2f} | {cpu_x:.2f} | {hf_ttft:.1f} | "
             "{core_ttft:.1f} ({core_ttft_x:.2f}) | {http_ttft:.1f} ({http_ttft_x:.2f}) |")


def flat(row: dict) -> dict:
    return {"preset": row["preset"], "batch": row["batch"], "requests": row["requests"],
            "naive_tps": row["hf_generate_all"]["naive"]["tokens_per_s"],
            "sorted_tps": row["hf_generate_all"]["sorted"]["tokens_per_s"],
            "static_tps": row["hf_generate_all"]["sorted_static"]["tokens_per_s"],
            "naive_x": row["throughput_ratio_vs_naive"],
            "core_tps": row["builtin_core"]["tokens_per_s"], "core_x": row["core_throughput_ratio"],
            "http_tps": row["builtin"]["tokens_per_s"], "http_x": row["throughput_ratio"],
            "cpu_x": row["cpu_throughput_ratio"], "hf_ttft": row["hf_generate"]["ttft_s"] * 1e3,
            "core_ttft": row["builtin_core"]["ttft_s"] * 1e3, "core_ttft_x": row["core_ttft_ratio"],
            "http_ttft": row["builtin"]["ttft_s"] * 1e3, "http_ttft_x": row["ttft_ratio"]}


def deterministic_cost(model_dir: Path, *, batch: int = 16, requests: int = 64) -> dict:
    """Engine core, same requests with logprobs: --deterministic vs the batched default."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = make_prompts(tok, requests, 16, 64, seed=7)
    caps = long_tail_lengths(requests, scale=6, cap=256, seed=7)
    fast = core_run(model_dir, prompts, caps, batch, return_logprob=True)
    det = core_run(model_dir, prompts, caps, batch, deterministic=True, return_logprob=True)
    return {"batch": batch, "requests": requests, "batched": fast, "deterministic": det,
            "throughput_ratio": det["tokens_per_s"] / fast["tokens_per_s"],
            "ttft_ratio": det["ttft_s"] / fast["ttft_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="tiny,qwen2.5-0.5b")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--quick", action="store_true", help="at most 4 requests per batch slot")
    ap.add_argument("--out", default=None, help="also write the results JSON here")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both sides (1: the box is shared and oversubscribed)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of baselines + engine (medians reported)")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per batch size (default: the preset's plan)")
    ap.add_argument("--deterministic-cost", action="store_true",
                    help="only measure --deterministic against the default (tiny, engine core)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.deterministic_cost:
        with tempfile.TemporaryDirectory(prefix="rltool-bench-") as tmp:
            cost = deterministic_cost(init_model(Path(tmp) / "tiny", preset="tiny", seed=0))
        print(f"deterministic / batched, B={cost['batch']}: throughput x{cost['throughput_ratio']:.2f}"
              f", TTFT x{cost['ttft_ratio']:.2f}")
        harness.Run("engine_throughput").finish(cost, out=args.out, variant="deterministic")
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run = harness.Run("engine_throughput")
    rows = []
    print(TABLE_HEAD, flush=True)
    with tempfile.TemporaryDirectory(prefix="rltool-bench-") as tmp:
        workdir = Path(tmp)
        for preset in args.presets.split(","):
            model_dir = init_model(workdir / preset, arch="qwen2", preset=preset, seed=0)
            for batch in (int(b) for b in args.batches.split(",")):
                row = run_case(model_dir, preset, batch, quick=args.quick, workdir=workdir,
                               requests=args.requests, repeats=args.repeats)
                rows.append(row)
                print(TABLE_ROW.format(**flat(row)), flush=True)
    run.finish({"threads": args.threads, "transformers": transformers.__version__,
                "rows": rows,
                "targets": {"throughput_ratio_b64": TARGET_RATIO_B64, "ttft_ratio_b1": 1.0}},
               out=args.out)


if __name__ == "__main__":
    main()
