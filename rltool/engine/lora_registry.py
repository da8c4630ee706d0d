"""The LoRA adapters an engine started with --enable-lora holds (rltool.engine.lora): named ones
(/load_lora_adapter, --lora-paths) and the policy adapter, the one the last LoRA weight sync
installed, which a request without `lora_path` uses (the base model until a sync installs one).

Adapters live on the host in the fused layout; the forward reads one at a time from the model's
device buffers (`LoraLayers`), into which `activate` copies the adapter a batch runs when it is
not the one already there. Every adapter content carries a fresh tag, so a replaced adapter is
copied again and never shares prefix-cache entries with the one it replaced.

Every method that changes adapters runs on the scheduler thread; `adapters` is replaced, never
changed in place, so the routes read it from the event loop (request checks, server info) safely.
`read` alone runs anywhere: /load_lora_adapter reads and checks the files on a worker thread, and
the scheduler thread only adds what it read (`add`), so generation goes on during the read.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from rltool.engine.lora import (LoraAdapter, LoraLayers, LoraShapes, check_config, coverage,
                               locate, read_adapter)
from rltool.engine.model_spec import ModelSpec
from rltool.errors import BadInputError

POLICY = "policy"  # how /get_server_info lists the policy adapter
# A tensor sync without lora_config into an engine whose policy adapter never had a config (from
# disk or an earlier sync's): the trainer's default lora_alpha (2 x rank), so scale 2.
DEFAULT_SCALING = 2.0


class LoraRegistry:
    def __init__(self, spec: ModelSpec, *, max_rank: int, dtype: torch.dtype,
                 device: torch.device, quantized: bool = False):
        """Refused where the adapter compute is not there: hybrid models' layers, FP8 and INT4
        linears (`quantized`)."""
        if spec.linear is not None:
            raise BadInputError("--enable-lora serves dense and MoE models; drop --enable-lora to "
                                "serve this hybrid linear-attention model")
        if quantized:
            raise BadInputError("--enable-lora computes adapters over bf16/fp32 linears; drop "
                                "--enable-lora or serve a checkpoint `rltool convert dequant` "
                                "wrote")
        if max_rank < 1:
            raise BadInputError(f"--max-lora-rank {max_rank}: must be at least 1")
        sparse = frozenset(spec.moe.sparse_layers) if spec.moe is not None else frozenset()
        self.shapes = LoraShapes.of(spec, max_rank=max_rank, sparse=sparse,
                                    pin=device.type == "cuda")
        self.dtype = dtype
        self.adapters: dict[str, LoraAdapter] = {}
        self.policy: LoraAdapter | None = None
        self.layers: LoraLayers | None = None
        self._tags = itertools.count(1)

    def attach(self, model: Any, *, exact: bool = False) -> None:
        """Give a freshly built model its adapter buffers (holding the policy adapter); `exact`:
        each module's update apart, the trainer's numerics (the deterministic mode)."""
        self.layers = model.lora = LoraLayers(self.shapes, device=model.device, dtype=self.dtype,
                                              exact=exact)
        self.layers.load(self.policy)

    def detach(self) -> None:
        self.layers = None

    # ----- which adapter a request runs ---------------------------------------------------

    def check_name(self, name: str | None) -> None:
        """BadInputError naming the loaded adapters when a request names an unknown one."""
        if name is not None and name not in self.adapters:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise BadInputError(f"lora_path {name!r} is not a loaded adapter (loaded: {loaded}); "
                                "load it with /load_lora_adapter first")

    def has(self, name: str | None) -> bool:
        """Whether a request naming `name` can run (None: the policy adapter, always)."""
        return name is None or name in self.adapters

    def get(self, name: str | None) -> LoraAdapter | None:
        return self.policy if name is None else self.adapters.get(name)

    def tag(self, name: str | None) -> int:
        """The prefix cache's tag of the adapter `name` runs now (0: the base model)."""
        adapter = self.get(name)
        return adapter.tag if adapter is not None else 0

    def activate(self, name: str | None) -> None:
        """Make the forward compute with adapter `name` (None: the policy adapter)."""
        adapter = self.get(name)
        if self.layers is not None and self.layers.tag != (adapter.tag if adapter else 0):
            self.layers.load(adapter)

    # ----- named adapters -------------------------------------------------------------------

    def load(self, name: str, path: Path) -> LoraAdapter:
        """Read adapter `path` and hold it as `name` (at start, --lora-paths)."""
        return self.add(self.read(name, path))

    def read(self, name: str, path: Path) -> LoraAdapter:
        """Adapter `path` read and checked for `name`, not yet held (any thread)."""
        self.check_new(name)
        return read_adapter(path, name=name, tag=next(self._tags), shapes=self.shapes,
                            dtype=self.dtype)

    def add(self, adapter: LoraAdapter) -> LoraAdapter:
        """Hold adapter `read` gave, unless its name was taken meanwhile."""
        self.check_new(adapter.name)
        self.adapters = {**self.adapters, adapter.name: adapter}
        return adapter

    def check_new(self, name: str) -> None:
        if not name or name in self.adapters:
            raise BadInputError(f"lora_name {name!r} is empty or already loaded; unload it "
                                "first or choose another name")

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise BadInputError(f"lora_name {name!r} is not a loaded adapter (loaded: {loaded}); "
                                "nothing to unload")
        self.adapters = {k: v for k, v in self.adapters.items() if k != name}

    # ----- weight syncs of the policy adapter -----------------------------------------------

    def install_policy(self, path: Path) -> int:
        """A LoRA weight sync from an adapter directory: it replaces the policy adapter.
        Returns how many fused linears it targets."""
        self.policy = read_adapter(path, name=POLICY, tag=next(self._tags), shapes=self.shapes,
                                   dtype=self.dtype)
        self.activate(None)
        return len(self.policy.weights)

    def clear_policy(self) -> None:
        """No policy adapter: requests without lora_path run the base model (a full weight load
        from disk; named adapters stay)."""
        self.policy = None
        self.activate(None)

    def sync_policy(self, named: list[tuple[str, Any]], config: Any = None) -> int:
        """A LoRA weight sync from PEFT-named tensors (any subset, e.g. one bucket): each replaces
        its block of the policy adapter. `config`: the adapter's PEFT LoraConfig fields (r,
        lora_alpha, target_modules, ...; `check_config`), which set its scale lora_alpha / r;
        without one the scale stays (DEFAULT_SCALING for a first adapter). A config of another
        `coverage` (rank, target modules) than the policy adapter's starts the policy afresh
        from zeros, so once every bucket is in it is exactly the adapter sent (what that one
        lacks, zero); one of the same coverage fills the same blocks, each bucket its own.
        Every tensor (and the config) is checked before any is copied; each is then copied
        once, and when the forward's buffers hold the policy only the fused linears the sync
        touched are uploaded (else the whole policy adapter is)."""
        slots = []
        for name, t in named:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise BadInputError(f"LoRA tensor {name!r} must be a floating-point tensor")
            slots.append(locate(name, t, self.shapes))
        scaling = cover = None
        if config is not None:
            rank, scaling = check_config(config, where="lora_config")
            odd = [name for (name, _), slot in zip(named, slots) if slot.rank != rank]
            if odd:
                raise BadInputError(f"LoRA tensor {odd[0]!r} is not of lora_config's rank r "
                                    f"{rank}; send the adapter's own config")
            cover = coverage(config)
        old = self.policy
        held = self.layers is not None and self.layers.tag == (old.tag if old else 0)
        if old is None or (cover is not None and cover != old.cover):
            # another rank or other modules: nothing of the old adapter stays
            held = held and old is None
            policy = LoraAdapter(name=POLICY, path=None, rank=0, tag=0, cover=cover,
                                 scaling=DEFAULT_SCALING if old is None else old.scaling)
        else:
            policy = old
        for slot, (_, t) in zip(slots, named):
            policy.write(slot, t, self.shapes, self.dtype)
            policy.rank = max(policy.rank, slot.rank)
        if scaling is not None:
            policy.scaling = scaling
        policy.tag, policy.path = next(self._tags), None
        self.policy = policy
        if held:  # the rest of the policy (zeros before a first one) is in the buffers already
            self.layers.update(policy, {slot.key for slot in slots})
        else:
            self.activate(None)
        return len(named)

    def describe(self) -> list[dict[str, Any]]:
        """/get_server_info's `lora_adapters`: the policy adapter first (when installed)."""
        out = [self.policy] if self.policy is not None else []
        out += list(self.adapters.values())
        return [{"name": a.name, "path": a.path, "rank": a.rank, "scaling": a.scaling}
                for a in out]
