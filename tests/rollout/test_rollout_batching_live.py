"""`rltool rollout` against a live deterministic builtin engine behind a counting proxy: how many
/generate requests the engine receives for G groups x n samples (one batched body, one per group
with --samples-per-request n, one per sample with a custom generate function), and that the
seeded shards those give are identical; teacher scoring (--opd-teacher) batches the same way."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from rltool.cli import main
from rltool.data.shards import open_shard
from rltool.data.tasks import make_rows, write_prompts
from rltool.rollout.generate import generate_single_turn

HERE = "tests.rollout.test_rollout_batching_live"
GROUPS, N = 4, 3


async def per_sample(sample, ctx):
    """The default function behind another name: one request per sample."""
    return await generate_single_turn(sample, ctx)


class CountingProxy:
    """Forwards every request to `upstream` and records each POST /generate's prompt count
    (`bodies`; `scoring`: those of bodies that generate nothing, a teacher's)."""

    def __init__(self, upstream: str):
        self.bodies: list[int] = []
        self.scoring: list[int] = []
        client = httpx.Client(base_url=upstream, timeout=120)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.command == "POST" and self.path == "/generate":
                    sent = json.loads(body)
                    ids, params = sent["input_ids"], sent["sampling_params"]
                    first = params[0] if isinstance(params, list) else params
                    into = proxy.scoring if first.get("max_new_tokens") == 0 else proxy.bodies
                    into.append(len(ids) if isinstance(ids[0], list) else 1)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() in ("content-type", "authorization")}
                answer = client.request(self.command, self.path, content=body, headers=headers)
                self.send_response(answer.status_code)
                self.send_header("Content-Type", answer.headers.get("content-type", "text/plain"))
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_POST = do_OPTIONS = forward

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.client = client

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.client.close()


@pytest.fixture(scope="module")
def proxy(det_engine):
    counting = CountingProxy(det_engine.url)
    yield counting
    counting.close()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "reverse.jsonl"
    write_prompts(make_rows("reverse", num=GROUPS, seed=2), path)
    return path


def rollout(proxy, prompts, out: Path, *extra) -> list[int]:
    """The /generate bodies (prompt counts) one rollout sent."""
    before = len(proxy.bodies)
    result = CliRunner().invoke(main, [
        "rollout", "--quiet", "--engines", proxy.url, "--prompts", str(prompts), "--out", str(out),
        "--n-samples-per-prompt", str(N), "--rollout-batch-size", str(GROUPS),
        "--max-response-len", "10", "--reward", "reverse", "--seed", "5", *map(str, extra)])
    assert result.exit_code == 0, result.output
    return proxy.bodies[before:]


def test_requests_per_rollout_and_identical_seeded_shards(proxy, prompts, tmp_path):
    batched = rollout(proxy, prompts, tmp_path / "batched")
    per_group = rollout(proxy, prompts, tmp_path / "per-group", "--samples-per-request", N)
    alone = rollout(proxy, prompts, tmp_path / "per-sample", "--generate-fn", f"{HERE}:per_sample")
    assert batched == [GROUPS * N]
    assert per_group == [N] * GROUPS
    assert alone == [1] * (GROUPS * N)
    rows = list(open_shard(tmp_path / "batched").rows())
    assert len(rows) == GROUPS * N and len({tuple(r["response_token_ids"]) for r in rows}) > 1
    assert list(open_shard(tmp_path / "per-group").rows()) == rows
    assert list(open_shard(tmp_path / "per-sample").rows()) == rows
    data = sorted(p.name for p in (tmp_path / "batched").iterdir() if p.suffix == ".parquet")
    assert data and all((tmp_path / "batched" / name).read_bytes()
                        == (tmp_path / "per-group" / name).read_bytes() for name in data)


def test_teacher_scoring_is_batched(proxy, prompts, tmp_path):
    before = len(proxy.scoring)
    sent = rollout(proxy, prompts, tmp_path / "opd", "--opd-teacher", proxy.url,
                   "--samples-per-request", 2 * N)
    assert sent == [2 * N] * (GROUPS // 2)
    assert proxy.scoring[before:] == [2 * N] * (GROUPS // 2)
    rows = list(open_shard(tmp_path / "opd").rows())
    assert all(len(r["teacher_logprobs"]) == len(r["response_token_ids"]) for r in rows)
