"""The engine's named operations: what the HTTP routes ask of the side that holds the model
(control, information, LoRA adapters, debug, weight updates), each an `async` method taking and
answering JSON values. The same call runs in the server's own process (one-process layout,
rltool.engine.link.LocalLink) or in the scheduler process, sent over its channel
(rltool.engine.remote_link, rltool.engine.scheduler_process), so the routes do not know which
layout serves them. Whatever reads or changes the model or the request lists runs on the
scheduler thread, between steps (`PagedScheduler.call`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

from rltool import trace
from rltool.engine.weight_ops import WeightOps
from rltool.errors import BadInputError


class EngineOps(WeightOps):
    """One engine's operations; `NAMES` are those a channel may call."""

    NAMES = frozenset({
        "readiness", "loads", "model_info", "engine_info", "weight_version",
        "flush_if_idle", "pause", "resume_generation", "abort", "release_memory",
        "resume_memory", "set_weight_version", "load_lora", "unload_lora", "lora_adapters",
        "hidden_states", "update_weights_from_disk", "update_weights_from_tensor",
        "init_weights_update_group", "update_weights_from_distributed"})

    def __init__(self, *, runner: Any, scheduler: Any, max_running: int,
                 allowed_sync_hosts: list[str]):
        super().__init__(runner=runner, scheduler=scheduler,
                         allowed_sync_hosts=allowed_sync_hosts)
        self.max_running = max_running

    async def on_thread(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the scheduler thread between steps and await its result."""
        return await asyncio.wrap_future(self.sched.call(fn))

    # ----- information -----------------------------------------------------------------------

    async def readiness(self) -> bool:
        """Serving: alive, not paused, weights in memory."""
        return self.sched.alive and self.sched.paused is None and not self.runner.released

    async def loads(self) -> dict[str, Any]:
        st = self.sched.stats()
        return {"dp_rank": 0, "num_running_reqs": st["num_running_reqs"],
                "num_waiting_reqs": st["num_waiting_reqs"],
                "token_usage": st["num_running_reqs"] / self.max_running,
                "gen_throughput": st["gen_throughput"]}

    async def model_info(self) -> dict[str, Any]:
        """SGLang's /get_model_info body but served_model_name (model and tokenizer paths,
        weight version, ...)."""
        runner = self.runner
        cfg_json = runner.config_json
        return {"model_path": str(runner.model_path), "tokenizer_path": str(runner.tokenizer_path),
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": runner.weight_version, "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": cfg_json.get("model_type"),
                "architectures": list(cfg_json.get("architectures") or []),
                "device": runner.device.type, "dtype": runner.dtype, **runner.weight_info}

    async def engine_info(self) -> dict[str, Any]:
        """The model side of /server_info."""
        runner = self.runner
        return {
            "model_path": str(runner.model_path),
            "context_length": runner.context_length,
            "max_total_num_tokens": runner.max_total_num_tokens,  # the KV pool, as SGLang
            "max_req_input_len": runner.context_length - 1,
            "weight_version": runner.weight_version, **runner.weight_info,
            "kv_bytes_per_token": runner.kv_bytes_per_token,
            "kv_pool_tokens": runner.max_total_num_tokens,
            # B_cache = N*c_A + K*c_R (K = 0 for a model without recurrent state)
            "cache_sizes": runner.cache_sizes(),
            "hicache": runner.cache_stats(),  # prefix-cache hits per tier, host tier traffic
            # --enable-lora: the policy adapter (once a sync installed one), then the named ones
            "lora_adapters": runner.lora.describe() if runner.lora is not None else [],
            "internal_states": [self.sched.stats()],
            "scheduler_pid": os.getpid(),  # the server's own pid in the one-process layout
        }

    async def weight_version(self) -> str:
        return self.runner.weight_version

    # ----- control ---------------------------------------------------------------------------

    async def flush_if_idle(self) -> bool:
        """Empty the prefix cache unless requests are running or waiting; answers whether busy."""
        sched = self.sched

        def flush() -> bool:
            busy = (bool(sched.running or sched.prefilling)
                    or (bool(sched.waiting) and sched.paused is None))
            if not busy:
                sched.flush_cache()
            return busy

        return await self.on_thread(flush)

    async def pause(self, *, mode: str) -> None:
        await self.on_thread(lambda: self.sched.pause(mode))

    async def resume_generation(self) -> None:
        await self.on_thread(self.sched.resume_generation)

    async def abort(self, *, rid: str = "", abort_all: bool = False) -> int:
        return await self.on_thread(lambda: self.sched.abort(rid=rid, abort_all=abort_all))

    async def release_memory(self, *, tags: list[str]) -> None:
        sched, runner = self.sched, self.runner

        def release() -> None:
            sched.retract_for_release()  # KV is per request: dropping it means recompute later
            if "weights" in tags:
                runner.release()

        with trace.span("offload", cat="memory"):
            await self.on_thread(release)

    async def resume_memory(self) -> None:
        with trace.span("reload", cat="memory"):
            await self.on_thread(self.runner.resume)

    async def set_weight_version(self, *, version: str, abort_all: bool) -> None:
        if abort_all:
            await self.abort(abort_all=True)
        runner = self.runner

        def set_version() -> None:
            runner.weight_version = version

        await self.on_thread(set_version)

    # ----- LoRA adapters (--enable-lora) -----------------------------------------------------

    async def lora_adapters(self) -> dict[str, str]:
        lora = self.runner.lora
        return {} if lora is None else {name: a.path or "" for name, a in lora.adapters.items()}

    async def load_lora(self, *, name: str, path: str) -> None:
        """Read and check the adapter's files on a worker thread (generation goes on), then hold
        it, on the scheduler thread."""
        from pathlib import Path

        lora = self.runner.lora
        adapter = await asyncio.to_thread(lora.read, name, Path(path))
        await self.on_thread(lambda: lora.add(adapter))

    async def unload_lora(self, *, name: str) -> int:
        """Unload `name` unless waiting or running requests use it; answers how many do."""
        sched, lora = self.sched, self.runner.lora

        def unload() -> int:
            users = sum(r.lora == name for r in (*sched.waiting, *sched.prefilling,
                                                  *sched.running.values()))
            if not users:
                lora.unload(name)
            return users

        return await self.on_thread(unload)

    # ----- debug (--enable-debug-endpoints) --------------------------------------------------

    async def hidden_states(self, *, input_ids: list[int]) -> dict[str, Any]:
        return await self.on_thread(lambda: hidden_states(self.runner, input_ids))


def hidden_states(runner: Any, input_ids: list[int]) -> dict[str, Any]:
    """Per-layer hidden states and token logprobs of one unpadded pass (scheduler thread)."""
    import torch

    from rltool.logprobs import logits_to_logprobs

    if runner.released:
        raise BadInputError("weights are released; call /resume_memory_occupation first")
    bad = [t for t in input_ids if not 0 <= t < runner.vocab_size]
    if bad:
        raise BadInputError(f"input_ids: token id {bad[0]} outside [0, {runner.vocab_size})")
    if len(input_ids) > runner.context_length:
        raise BadInputError(f"input_ids: {len(input_ids)} tokens exceed the context length "
                            f"{runner.context_length}")
    states, logits = runner.hidden_states(input_ids)
    ids = torch.tensor(input_ids, dtype=torch.long)
    logprobs = logits_to_logprobs(logits[:-1].cpu(), ids[1:], temperature=1.0)
    return {"weight_version": runner.weight_version, "dtype": runner.dtype,
            "num_tokens": len(input_ids),
            "hidden_states": [h.double().tolist() for h in states],
            "token_logprobs": logprobs.double().tolist()}
