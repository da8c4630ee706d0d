"""Named weight snapshots ("tags") of one model across three tiers: device, host memory, local SSD.

A trainer holds one set of live weights (the module's parameters) and switches them between
roles: the actor it trains, the KL reference, the old actor that generated stale rollouts, an
on-policy-distillation teacher. Each role is a tag; `restore(tag)` copies the tag's weights into
the live parameters, `backup(tag)` copies the live parameters into the tag.

Tiers, fastest first:
- device: a staged copy on the accelerator, made by `prefetch(tag)` on a background thread (and
  a side CUDA stream) while the current forward/backward runs; `restore` is then a device-to-device
  copy. At most `max_staged` tags are staged (each costs one model's device memory).
- host: one flat buffer per tag, pinned on CUDA hosts (plain memory on CPU-only torch); copies
  to and from the device are single non-blocking transfers per tensor.
- ssd: a checksummed safetensors file per tag under `ssd_dir` (rltool.train.snapshot_file),
  memory-mapped on read. Host copies are bounded by `host_budget_bytes`: the least recently used
  tags spill to SSD (written once; a tag whose file is current spills by dropping its host copy).
  A read refuses any file but the one the backuper wrote (its checksum and layout), so `ssd_dir`
  may be a directory others can write to.

Single-tag mode (`single_tag="actor"`): the live weights are the only copy, nothing is copied;
`backup` records a fingerprint and `restore` verifies it, so a run that switches nothing pays no
memory and still fails loudly if something changed the weights behind the backuper's back.

Thread safety: each tag has a lock held for the whole of any operation on it, so a `restore`
racing a `prefetch` of the same tag waits for the prefetch and then uses its result. Spilling
another tag only try-locks it (a tag in use is skipped), so no two operations wait on each other.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rltool.errors import BadInputError, CheckpointError, RltoolError
from rltool.train.live_weights import dtensor_sharder, fingerprint, fsdp_resharder, module_tensors
from rltool.train.snapshot_file import SUFFIX, MappedSnapshot, write_snapshot

__all__ = ["BackuperError", "WeightBackuper", "dtensor_sharder", "fingerprint", "fsdp_resharder",
           "module_tensors"]

log = logging.getLogger(__name__)

_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_ALIGN_BYTES = 64


class BackuperError(RltoolError):
    """A snapshot is missing, or the live weights no longer match a single-tag fingerprint."""


@dataclass
class _Tag:
    name: str
    lock: threading.RLock = field(default_factory=threading.RLock)
    host: torch.Tensor | None = None           # flat uint8 buffer (pinned on CUDA)
    ssd: Path | None = None                     # current snapshot file
    ssd_checksum: str | None = None             # what the backuper wrote it with
    staged: dict[str, torch.Tensor] | None = None  # device copy made by prefetch
    fingerprint: str | None = None              # single-tag mode
    last_use: int = 0


class WeightBackuper:
    """See the module docstring. `tensors`: the live tensors by name (e.g. `module_tensors`)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, host_budget_bytes: int | None = None,
                 ssd_dir: str | Path | None = None, single_tag: str | None = None,
                 stage_on_device: bool | None = None, max_staged: int = 1,
                 pin_memory: bool | None = None,
                 shard_full: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                 before_restore: Callable[[], None] | None = None):
        if not tensors:
            raise BadInputError("the backuper needs at least one live tensor")
        self.live = dict(tensors)
        self.device = next(iter(self.live.values())).device
        cuda = self.device.type == "cuda"
        self.pin_memory = cuda if pin_memory is None else pin_memory
        self.stage_on_device = cuda if stage_on_device is None else stage_on_device
        self.max_staged = max_staged
        self.host_budget_bytes = host_budget_bytes
        self.single_tag = single_tag
        self._shard_full = shard_full
        self._before_restore = before_restore  # e.g. FSDP2: drop gathered copies of the weights
        self._own_dir = ssd_dir is None
        self.ssd_dir = Path(ssd_dir) if ssd_dir else None
        self.layout = [(n, t.dtype, tuple(t.shape)) for n, t in self.live.items()]
        self._offsets: dict[str, int] = {}
        offset = 0
        for name, t in self.live.items():
            self._offsets[name] = offset
            offset += -(-t.numel() * t.element_size() // _ALIGN_BYTES) * _ALIGN_BYTES
        self.snapshot_bytes = offset
        self._tags: dict[str, _Tag] = {}
        self._lock = threading.Lock()  # the tag table and the host accounting
        self._clock = 0
        self.active: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._stream = torch.cuda.Stream(self.device) if cuda else None

    # -- public API --------------------------------------------------------------------------
    @property
    def tags(self) -> list[str]:
        with self._lock:
            return sorted(self._tags)

    def tiers(self, tag: str) -> set[str]:
        """Where `tag` lives now: a subset of {"device", "host", "ssd", "live"}; "live" means the
        live weights were last restored from or backed up to it (training may have moved them
        since)."""
        t = self._get(tag)
        with t.lock:
            out = {"device"} if t.staged is not None else set()
            out |= {"host"} if t.host is not None else set()
            out |= {"ssd"} if t.ssd is not None else set()
            return out | ({"live"} if self.active == tag else set())

    @property
    def host_bytes(self) -> int:
        with self._lock:
            return sum(t.host.numel() for t in self._tags.values() if t.host is not None)

    def backup(self, tag: str) -> None:
        """Copy the live weights into `tag` (created if new); the live weights now are `tag`."""
        self._check_single(tag)
        t = self._tag(tag, create=True)
        with t.lock:
            self._touch(t)
            self._clear(t, keep_host=True)  # re-backing up reuses the (pinned) buffer
            if self.single_tag is not None:
                t.fingerprint = fingerprint(self.live.values())
            elif t.host is not None or self._make_room(self.snapshot_bytes, keep=t):
                t.host = self._host_buffer() if t.host is None else t.host
                views = self._views(t.host)
                for name, src in self.live.items():
                    views[name].copy_(src, non_blocking=True)
                self._sync()
            else:  # bigger than the whole budget: stream it to disk a tensor at a time
                self._write(t, ((n, s.cpu()) for n, s in self.live.items()))
            self.active = tag

    def restore(self, tag: str) -> None:
        """Make the live weights equal `tag`'s snapshot, from its fastest tier (waits for a
        prefetch of it in flight)."""
        t = self._get(tag)
        with t.lock:
            self._touch(t)
            if self.single_tag is not None:
                if t.fingerprint is None:
                    raise BackuperError(f"restore({tag!r}): nothing was backed up under it")
                if fingerprint(self.live.values()) != t.fingerprint:
                    raise BackuperError(
                        f"restore({tag!r}) in single-tag mode: the live weights changed since "
                        "backup and there is no copy to restore; back up after every change")
                self.active = tag
                return
            if self._before_restore is not None:
                self._before_restore()
            if t.staged is not None:
                with torch.no_grad():
                    for name, dst in self.live.items():
                        dst.copy_(t.staged[name])
                        if self._stream is not None:  # read on this stream: freed after it
                            t.staged[name].record_stream(torch.cuda.current_stream(self.device))
                t.staged = None  # its device memory goes back to the allocator
            elif t.host is not None:
                with torch.no_grad():
                    views = self._views(t.host)
                    for name, dst in self.live.items():
                        dst.copy_(views[name], non_blocking=True)
                self._sync()
            elif t.ssd is not None:
                with self._mapped(t) as snap, torch.no_grad():
                    for name, dst in self.live.items():
                        dst.copy_(snap.tensors[name])
            else:
                raise BackuperError(f"restore({tag!r}): the tag holds no snapshot")
            self.active = tag

    def copy(self, src: str, dst: str) -> None:
        """`dst` becomes a copy of `src`'s snapshot (the live weights are untouched)."""
        if src == dst:
            return
        s, d = self._get(src), self._tag(dst, create=True)
        first, second = sorted((s, d), key=lambda x: x.name)  # one lock order: no deadlock
        with first.lock, second.lock:
            self._touch(d)
            self._clear(d)
            if self.single_tag is not None:
                raise BackuperError("copy() needs a second snapshot; single-tag mode holds none")
            if s.host is not None and self._make_room(self.snapshot_bytes, keep=d):
                d.host = self._host_buffer()
                d.host.copy_(s.host)
            elif s.host is not None:
                self._write(d, self._views(s.host).items())
            elif s.ssd is not None:
                d.ssd = self._ssd_path(d.name)
                self._copy_file(s.ssd, d.ssd)
                d.ssd_checksum = s.ssd_checksum
            else:
                raise BackuperError(f"copy({src!r}, {dst!r}): {src!r} holds no snapshot")
            if self.active == dst:
                self.active = None

    def spill(self, tag: str) -> None:
        """Move `tag`'s host copy to SSD now (free when its file is current), e.g. to make room
        before a phase that needs host memory."""
        t = self._get(tag)
        with t.lock:
            self._spill(t)

    def drop(self, tag: str) -> None:
        """Forget `tag` on every tier (waits for its prefetch)."""
        t = self._get(tag)
        with t.lock:
            self._clear(t)
            with self._lock:
                self._tags.pop(tag, None)
            if self.active == tag:
                self.active = None

    def add(self, tag: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Create `tag` from full tensors by name (e.g. another checkpoint's), without touching
        the live weights. Names, shapes and dtypes must match the live set (dtypes are cast, as
        a model loaded in the live dtype would be); any name missing or extra is refused."""
        self._check_single(None)
        self._check_names(tensors, tag)
        t = self._tag(tag, create=True)
        with t.lock:
            self._touch(t)
            self._clear(t)
            if self._make_room(self.snapshot_bytes, keep=t):
                t.host = self._host_buffer()
                views = self._views(t.host)
                for name, src in self._converted(tensors):
                    views[name].copy_(src)
            else:
                self._write(t, self._converted(tensors))

    def load_dir(self, tag: str, model_dir: str | Path) -> None:
        """`add` from a HF safetensors checkpoint directory (memory-mapped, one tensor at a time)."""
        from rltool.io.checkpoint import checkpoint_tensors
        from rltool.io.reader import read_tensor

        infos = checkpoint_tensors(model_dir)
        tied = [n for n in infos if n not in self.live and _tied_alias(n, self.live)]
        lazy = _LazyTensors({n: i for n, i in infos.items() if n not in tied}, read_tensor)
        try:
            self.add(tag, lazy)
        except CheckpointError as e:
            raise CheckpointError(f"{model_dir}: {e}") from e

    def prefetch(self, tag: str) -> Future:
        """Bring `tag` toward the device on a background thread: SSD -> host (within the budget)
        -> device staging (when staging on the device). Returns the job's future; `restore`
        waits for it by itself."""
        t = self._get(tag)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="backuper")
        future = self._pool.submit(self._prefetch_job, t)
        future.add_done_callback(_log_failure)
        return future

    @contextmanager
    def switched(self, tag: str, *, back: str) -> Iterator[None]:
        """Run a block with `tag`'s weights live, then restore `back` (e.g. the actor)."""
        self.restore(tag)
        try:
            yield
        finally:
            self.restore(back)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for name in self.tags:
            self.drop(name)
        if self._own_dir and self.ssd_dir is not None:
            shutil.rmtree(self.ssd_dir, ignore_errors=True)
            self.ssd_dir = None

    def __enter__(self) -> "WeightBackuper":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- tiers -------------------------------------------------------------------------------
    def _prefetch_job(self, t: _Tag) -> None:
        with t.lock:
            self._touch(t)  # about to be used: the last tag to spill
            if self._tags.get(t.name) is not t or t.staged is not None:
                return  # dropped meanwhile, or already staged
            if t.host is None and t.ssd is not None and self._make_room(self.snapshot_bytes,
                                                                        keep=t):
                host = self._host_buffer()
                views = self._views(host)
                with self._mapped(t) as snap:
                    for name, view in views.items():
                        view.copy_(snap.tensors[name])
                t.host = host
            if not self.stage_on_device:
                return
            self._unstage_others(keep=t)
            with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
                # On the filling stream: memory the main stream freed may still be in use there.
                staged = {n: torch.empty_like(x, device=self.device) for n, x in self.live.items()}
                if t.host is not None:
                    for name, view in self._views(t.host).items():
                        staged[name].copy_(view, non_blocking=True)
                elif t.ssd is not None:
                    with self._mapped(t) as snap:
                        for name in staged:
                            staged[name].copy_(snap.tensors[name])
                else:
                    return
            if self._stream is not None:
                self._stream.synchronize()
            t.staged = staged

    def _unstage_others(self, *, keep: _Tag) -> None:
        with self._lock:
            staged = sorted((x for x in self._tags.values() if x.staged is not None and x is not keep),
                            key=lambda x: x.last_use)
        for other in staged[:max(0, len(staged) - self.max_staged + 1)]:
            if other.lock.acquire(blocking=False):
                try:
                    other.staged = None
                finally:
                    other.lock.release()

    def _make_room(self, nbytes: int, *, keep: _Tag) -> bool:
        """Spill least recently used host copies to SSD until `nbytes` more fit the budget."""
        if self.host_budget_bytes is None:
            return True
        if nbytes > self.host_budget_bytes:
            return False
        while True:
            with self._lock:
                used = sum(x.host.numel() for x in self._tags.values() if x.host is not None)
                if used + nbytes <= self.host_budget_bytes:
                    return True
                victims = sorted((x for x in self._tags.values()
                                  if x.host is not None and x is not keep),
                                 key=lambda x: x.last_use)
            for victim in victims:
                if victim.lock.acquire(blocking=False):
                    try:
                        self._spill(victim)
                    finally:
                        victim.lock.release()
                    break
            else:
                return False  # every host copy is in use by another operation

    def _spill(self, t: _Tag) -> None:
        if t.host is None:
            return
        if t.ssd is None:
            self._write(t, self._views(t.host).items())
        log.debug("backuper: spilled %s to %s", t.name, t.ssd)
        t.host = None

    def _write(self, t: _Tag, tensors: Any) -> None:
        path = self._ssd_path(t.name)
        t.ssd_checksum = write_snapshot(path, tensors, layout=self.layout)
        t.ssd = path

    def _mapped(self, t: _Tag) -> MappedSnapshot:
        """`t`'s file, verified to be the one the backuper wrote: its checksum (data) and the
        live layout in order (names, dtypes, shapes: the rest of what the header says)."""
        assert t.ssd is not None and t.ssd_checksum is not None
        snap = MappedSnapshot(t.ssd, checksum=t.ssd_checksum)
        layout = [(n, x.dtype, tuple(x.shape)) for n, x in snap.tensors.items()]
        if layout != self.layout:
            names = dict.fromkeys(snap.tensors)
            snap.close()
            self._check_names(names, t.ssd)  # the clearer message when names differ
            raise CheckpointError(f"{t.ssd}: its tensors' order, dtypes or shapes differ from "
                                  "the snapshot the backuper wrote; refusing it: drop the tag "
                                  "and back it up again")
        return snap

    def _ssd_path(self, name: str) -> Path:
        if self.ssd_dir is None:
            if not self._own_dir:
                raise BackuperError("the host budget is full and there is no SSD directory")
            self.ssd_dir = Path(tempfile.mkdtemp(prefix="rltool-backuper-"))
        self.ssd_dir.mkdir(parents=True, exist_ok=True)
        return self.ssd_dir / f"{name}{SUFFIX}"

    @staticmethod
    def _copy_file(src: Path, dst: Path) -> None:
        from rltool import atomic

        with atomic.atomic_path(dst) as tmp:
            shutil.copyfile(src, tmp)

    def _clear(self, t: _Tag, *, keep_host: bool = False) -> None:
        t.staged = t.fingerprint = None
        if not keep_host:
            t.host = None
        if t.ssd is not None:
            t.ssd.unlink(missing_ok=True)
            t.ssd = t.ssd_checksum = None

    # -- helpers -----------------------------------------------------------------------------
    def _host_buffer(self) -> torch.Tensor:
        return torch.empty(self.snapshot_bytes, dtype=torch.uint8, pin_memory=self.pin_memory)

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: flat[self._offsets[name]:self._offsets[name] + torch.Size(shape).numel()
                           * dtype.itemsize].view(dtype).view(shape)
                for name, dtype, shape in self.layout}

    def _converted(self, tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, dtype, shape in self.layout:
            src = tensors[name]
            if self._shard_full is not None:
                src = self._shard_full(name, src)
            if tuple(src.shape) != shape:
                raise CheckpointError(f"{name} has shape {tuple(src.shape)}, the live model "
                                      f"{shape}; the weights are not of this architecture")
            yield name, src.to(dtype=dtype, device="cpu")

    def _check_names(self, tensors: Mapping[str, Any], where: Any) -> None:
        missing = [n for n in self.live if n not in tensors]
        extra = [n for n in tensors if n not in self.live]
        if missing or extra:
            raise CheckpointError(
                f"{where}: tensors do not match the live model (missing {missing[:3]}, unknown "
                f"{extra[:3]}); snapshots must come from the same architecture")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _check_single(self, tag: str | None) -> None:
        if self.single_tag is not None and tag != self.single_tag:
            raise BackuperError(f"single-tag mode holds only {self.single_tag!r}; build the "
                                "backuper without single_tag to keep other snapshots")

    def _touch(self, t: _Tag) -> None:
        with self._lock:
            self._clock += 1
            t.last_use = self._clock

    def _tag(self, tag: str, *, create: bool) -> _Tag:
        if not _TAG_RE.match(tag):
            raise BadInputError(f"bad backuper tag {tag!r}: use letters, digits, '.', '_', '-'")
        with self._lock:
            if tag not in self._tags:
                if not create:
                    raise BackuperError(f"unknown backuper tag {tag!r} (have {sorted(self._tags)})")
                self._tags[tag] = _Tag(tag)
            return self._tags[tag]

    def _get(self, tag: str) -> _Tag:
        return self._tag(tag, create=False)


class _LazyTensors(Mapping):
    """A mapping that reads each tensor when it is looked up (one checkpoint tensor in memory)."""

    def __init__(self, infos: dict[str, Any], read: Callable[[Any], torch.Tensor]):
        self._infos, self._read = infos, read

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._read(self._infos[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)


def _log_failure(future: Future) -> None:
    """A failed prefetch costs only speed (restore reads the slower tier, and raises there if the
    tier is bad), but should not go unseen."""
    if not future.cancelled() and future.exception() is not None:
        log.warning("backuper: prefetch failed: %s", future.exception())


def _tied_alias(name: str, live: Mapping[str, torch.Tensor]) -> bool:
    """lm_head.weight of a tied-embedding model: the live module lists the shared tensor once."""
    return name == "lm_head.weight" and "model.embed_tokens.weight" in live
