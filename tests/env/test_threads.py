"""Environment calls in daemon threads: a hung call times out, frees its slot, and does not keep
the process from exiting (a thread pool's threads would be joined at exit)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from rltool.env.base import EnvTimeoutError
from rltool.env.threads import CallLimiter, call_in_thread

pytestmark = pytest.mark.timeout(60)


def test_a_timed_out_call_frees_its_slot():
    release = threading.Event()
    limiter = CallLimiter(1)

    async def main():
        with pytest.raises(EnvTimeoutError, match="step took more than 0.2s"):
            await call_in_thread(release.wait, timeout_s=0.2, what="step", limiter=limiter)
        # The only slot is free again although the first call still blocks.
        return await call_in_thread(lambda x: x * 2, 21, timeout_s=5, what="next",
                                    limiter=limiter)

    assert asyncio.run(main()) == 42
    release.set()


def test_errors_reach_the_caller():
    async def main():
        await call_in_thread(int, "x", timeout_s=5, what="parse")

    with pytest.raises(ValueError, match="invalid literal"):
        asyncio.run(main())


def test_a_hung_call_does_not_block_exit():
    code = ("import asyncio, time\n"
            "from rltool.env.threads import call_in_thread\n"
            "async def main():\n"
            "    try:\n"
            "        await call_in_thread(time.sleep, 3600, timeout_s=0.2, what='step')\n"
            "    except Exception as e:\n"
            "        print(type(e).__name__)\n"
            "asyncio.run(main())\n")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    assert out.strip() == "EnvTimeoutError" and time.monotonic() - start < 20
