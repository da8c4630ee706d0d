"""What the engine compiled or planned since its warm-up: a serving run should build nothing.

Three sources, each counted per `CompileWatch`:

- Triton JIT compilations, through Triton's post-compile hook (`triton.knobs.runtime.
  jit_post_compile_hook`, Triton >= 3.4). The hook is process-wide: one function installed once
  forwards each compilation to every live watch. Under TRITON_INTERPRET=1 nothing is compiled and
  the hook never fires.
- torch.compile / dynamo graph compilations (`torch._dynamo.utils.counters`, read only once dynamo
  is imported: the engine itself compiles nothing through it).
- New attention shapes handed to SDPA by the prefill (`note_shapes`): a proxy for the attention
  plans (cuDNN on Hopper) or kernel selections that a new shape costs. It counts distinct
  (kind, shape) keys, not the plans a backend actually builds.

`mark_warm` sets the baseline (the engine calls it at the end of its warm-up); `since_warmup`
answers the counts past it. Shapes seen before the mark stay known: their plans are cached.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import weakref
from typing import Any

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_WATCHES: weakref.WeakSet[CompileWatch] = weakref.WeakSet()
_HOOK_INSTALLED = False
_chained: Any = None  # the post-compile hook installed before ours, still called


def _dynamo_compiles() -> int:
    """Graphs dynamo compiled in this process (0 while dynamo was never imported)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _on_triton_compile(*, fn: Any, **info: Any) -> Any:
    """Triton's post-compile hook: count the kernel in every live watch, then call the hook
    installed before ours."""
    name = f"{fn.module}.{fn.name}"
    with _LOCK:
        watches = list(_WATCHES)
    for watch in watches:
        watch.note_triton(name)
    return _chained(fn=fn, **info) if _chained is not None else None


def install_triton_hook() -> bool:
    """Install the post-compile hook once per process; False where this Triton has none."""
    global _HOOK_INSTALLED, _chained
    with _LOCK:
        if _HOOK_INSTALLED:
            return True
        try:
            from triton import knobs
        except ImportError:
            knobs = None
        if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
            log.warning("this Triton has no post-compile hook (Triton >= 3.4 has): "
                        "compiles_since_warmup counts no Triton compilation")
            return False
        _chained = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = _on_triton_compile
        _HOOK_INSTALLED = True
        return True


class CompileWatch:
    """Counts compilations and new attention shapes of one engine; see the module docstring."""

    def __init__(self) -> None:
        self.hooked = install_triton_hook()
        self._lock = threading.Lock()
        self._triton: collections.Counter[str] = collections.Counter()
        self._shapes: set[tuple] = set()
        self._new_shapes = 0
        self._dynamo_base = _dynamo_compiles()
        with _LOCK:
            _WATCHES.add(self)

    def note_triton(self, kernel: str) -> None:
        with self._lock:
            self._triton[kernel] += 1

    def note_shapes(self, keys: list[tuple]) -> None:
        """The (kind, shape...) keys of the attention calls of one step; counts unseen ones."""
        for key in keys:
            if key not in self._shapes:
                with self._lock:
                    self._shapes.add(key)
                    self._new_shapes += 1

    def mark_warm(self) -> None:
        """The baseline: counts restart from zero; shapes seen so far stay known."""
        with self._lock:
            self._triton.clear()
            self._new_shapes = 0
            self._dynamo_base = _dynamo_compiles()

    def since_warmup(self) -> dict[str, Any]:
        """{"total", "triton", "dynamo", "sdpa_shapes", "triton_kernels": {kernel: count}}."""
        with self._lock:
            kernels = dict(self._triton)
            shapes = self._new_shapes
            dynamo = _dynamo_compiles() - self._dynamo_base
        triton = sum(kernels.values())
        return {"total": triton + dynamo + shapes, "triton": triton, "dynamo": dynamo,
                "sdpa_shapes": shapes, "triton_kernels": kernels}
