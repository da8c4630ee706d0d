"""The channel between the HTTP front end and the scheduler process (two-process layout,
docs/serve.md "Process layout"): a unix socket pair the front end creates and the scheduler
process inherits (no path, no port: nothing outside the two processes can reach it), carrying
frames of a 4-byte little-endian length and a JSON object. No pickle crosses it.

Messages, by `t`:
  front end -> scheduler: config {cfg}; submit {reqs: [request]}; abort {rids}; call {id, op, kw};
                          stop {}
  scheduler -> front end: hello {facts, weight_version, pid}; fail {err};
                          step {v, tok: {rids, n, ids, lp, extra, spans} | null, fin: [final]};
                          refused {rids, err}; reply {id, ok | err}
A step message is what one scheduler iteration produced: the new tokens of the streamed
requests (their ids, the count of new tokens of each, and all new ids and logprobs row after
row, packed; top logprobs in `extra` for the rows that asked; in `spans` the weight-version
spans of the rows whose new tokens are not all of version `v`) and the final record of every
request that finished (rltool.engine.scheduler_process), whose output ids and logprobs travel
packed too (`pack`: int32 and float64 arrays in base64).
An error travels as [kind, message]; `kind` is the nearest of ERROR_KINDS in its class's MRO.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the front end's scheduler_child frames the config before it imports torch
    from rltool.engine.request import Request
from rltool.engine.scheduler import QueueFullError
from rltool.errors import BadInputError, EngineError

HEADER = struct.Struct("<I")
ERROR_KINDS: dict[str, type[Exception]] = {"QueueFullError": QueueFullError,
                                           "BadInputError": BadInputError,
                                           "EngineError": EngineError}


def frame(msg: dict[str, Any]) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body


class Channel:
    """The scheduler process's end: blocking reads on one thread, sends from any thread."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()
        self._file = sock.makefile("rb")

    def send(self, msg: dict[str, Any]) -> None:
        data = frame(msg)
        with self._send_lock:
            self.sock.sendall(data)

    def recv(self) -> dict[str, Any] | None:
        """The next message, or None once the front end has closed its end."""
        head = self._file.read(HEADER.size)
        if len(head) < HEADER.size:
            return None
        (size,) = HEADER.unpack(head)
        body = self._file.read(size)
        if len(body) < size:
            return None
        return json.loads(body)


async def read_message(reader: Any) -> dict[str, Any]:
    """The next message from an asyncio StreamReader; IncompleteReadError at the end."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return json.loads(await reader.readexactly(size))


def error_of(e: BaseException) -> list[str]:
    kind = next((c.__name__ for c in type(e).__mro__ if c.__name__ in ERROR_KINDS),
                type(e).__name__)
    return [kind, str(e)]


def error_from(err: list[str]) -> Exception:
    """The exception an [kind, message] pair stands for (RuntimeError for unexpected kinds: the
    app answers those 500 as it does in one process)."""
    kind, message = err
    cls = ERROR_KINDS.get(kind)
    return cls(message) if cls is not None else RuntimeError(f"{kind}: {message}")


# ----- requests ------------------------------------------------------------------------------

def encode_request(r: Request, *, stream: bool) -> dict[str, Any]:
    return {"rid": r.rid, "prompt": r.prompt_ids,
            "params": r.params.model_dump(mode="json", exclude_defaults=True), "lora": r.lora,
            "logprob": r.return_logprob, "start": r.logprob_start_len,
            "top": r.top_logprobs_num, "ids": r.token_ids_logprob,
            "text_lp": r.return_text_in_logprobs, "routed": r.return_routed_experts,
            "seed": None if r.generator is None else r.generator.initial_seed(),
            "stream": stream}


def decode_request(d: dict[str, Any]) -> Request:
    from rltool.engine.request import Request
    from rltool.engine.sampling import SamplingParams, make_generator

    return Request(rid=d["rid"], prompt_ids=d["prompt"], params=SamplingParams(**d["params"]),
                   lora=d["lora"], return_logprob=d["logprob"], logprob_start_len=d["start"],
                   top_logprobs_num=d["top"], token_ids_logprob=d["ids"],
                   return_text_in_logprobs=d["text_lp"], return_routed_experts=d["routed"],
                   generator=None if d["seed"] is None else make_generator(d["seed"]))


# ----- results -------------------------------------------------------------------------------

def pack(values: Any, dtype: str) -> str:
    """A list of numbers as base64 of a little-endian array: float64 keeps every Python float
    exactly, and it is far cheaper to encode and parse than JSON numbers."""
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode("ascii")


def unpack(data: str, dtype: str) -> list:
    return np.frombuffer(base64.b64decode(data), dtype=dtype).tolist()


def encode_final(r: Request) -> dict[str, Any]:
    """Everything a finished request's response is built from (rltool.engine.request); the
    output's ids and logprobs packed (`pack`)."""
    routed = r.routed_experts
    return {"rid": r.rid, "out": pack(r.output_ids, "<i4"), "lp": pack(r.output_logprobs, "<f8"),
            "top": r.output_top_logprobs, "idl": r.output_token_ids_logprobs,
            "inlp": r.input_logprobs, "intop": r.input_top_logprobs,
            "routed": None if routed is None else [pack(routed, "<i4"), list(routed.shape)],
            "spans": r.spans, "reason": r.finish_reason, "stop_at": r.matched_stop_at,
            "cached": r.cached_tokens, "text": r.text, "t1": r.t_first_token,
            "t2": r.t_finish}


def apply_final(r: Request, d: dict[str, Any]) -> None:
    """Fill the front end's copy of a request from its final record."""
    r.output_ids = unpack(d["out"], "<i4")
    r.output_logprobs = unpack(d["lp"], "<f8")
    r.output_top_logprobs = d["top"]
    r.output_token_ids_logprobs = d["idl"]
    r.input_logprobs = d["inlp"]
    r.input_top_logprobs = d["intop"]
    if d["routed"] is not None:
        data, shape = d["routed"]
        r.routed_experts = np.frombuffer(base64.b64decode(data), dtype="<i4").reshape(shape)
    r.spans = d["spans"]
    r.matched_stop_at = d["stop_at"]
    r.cached_tokens = d["cached"]
    r.text = d["text"]
    r.t_first_token = d["t1"]
    r.t_finish = d["t2"]  # time.monotonic() is the host's clock: both processes share it
    r.finish_reason = d["reason"]
