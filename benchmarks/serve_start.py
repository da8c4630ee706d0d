"""How long `rltool serve` takes to start and stop, phase by phase, in each process layout.

Each round starts `python -m rltool serve` through `rltool.rollout.launch.start_engine` (as the
rollout stage, the loop and the tests start engines), sends one generate request once it serves,
and stops it. The phases come from the server's own log lines, timed against the launch:

- `imports`: the engine process's own start until its engine modules are imported (its
  interpreter start included; in two processes, the scheduler process's);
- `to loaded`: launch until the engine is loaded (the "engine loaded" line: tokenizer, checkpoint,
  CUDA initialisation, the build), of which `build` is the "engine built" line's seconds
  (weights, KV pool, decode graphs, warm-up);
- `to ready`: from the loaded engine to the ready file (the HTTP app where not yet imported, the
  self-check request);
- `front end`: two processes only: launch until the front end had its HTTP app and tokenizer;
- `first request`: one 16-token generate after ready; `stop`: SIGTERM until both processes ended.

    python -m benchmarks.serve_start --device cuda --rounds 3 --out benchmarks/results
    python -m benchmarks.serve_start --quick          # CPU, tiny model, 1 round per layout
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks import harness
from rltool.errors import BadInputError

LAYOUTS = {"one": "--no-frontend-process", "two": "--frontend-process"}
STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
LINES = {  # phase mark -> the pattern of its log line
    "loaded": rf"{STAMP} .*engine loaded [0-9.]+ s after its process started \(modules "
              r"imported after ([0-9.]+) s\)",
    "built": rf"{STAMP} .*engine built in ([0-9.]+) s",
    "front_end": rf"{STAMP} .*front end loaded",
    "ready": rf"{STAMP} .*builtin engine ready at",
}
PHASES = ("imports_s", "to_loaded_s", "build_s", "to_ready_s", "front_end_s", "ready_s",
          "first_request_s", "stop_s")


def stamp_s(stamp: str) -> float:
    """A log line's local-time stamp as seconds since the epoch."""
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def phases(log: str, launched: float) -> dict[str, float | None]:
    """Seconds from the launch to each mark's first line (None where absent), and the seconds
    its lines give (imports, build)."""
    found = {mark: re.search(pattern, log) for mark, pattern in LINES.items()}
    if not (found["loaded"] and found["built"] and found["ready"]):
        raise RuntimeError("the server's log lacks its start lines (loaded, built, ready):\n"
                           + log[-3000:])
    at = {mark: stamp_s(m.group(1)) - launched if m else None for mark, m in found.items()}
    return {"imports_s": float(found["loaded"].group(2)), "to_loaded_s": at["loaded"],
            "build_s": float(found["built"].group(2)),
            "to_ready_s": at["ready"] - at["loaded"], "front_end_s": at["front_end"]}


def one_round(model_dir: Path, device: str, layout: str, log_path: Path,
              extra: list[str]) -> dict[str, Any]:
    import httpx

    from rltool.engine import api
    from rltool.rollout.launch import start_engine

    launched = time.time()
    proc = start_engine(["--engine", "builtin", "--model", str(model_dir), "--device", device,
                         LAYOUTS[layout], *extra], log_path=log_path, ready_timeout_s=300.0)
    ready_s = time.time() - launched
    try:
        t0 = time.perf_counter()
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 16,
                                                               "ignore_eos": True}}
        r = httpx.post(proc.url + api.GENERATE, json=body, timeout=120.0)
        r.raise_for_status()
        first_request_s = time.perf_counter() - t0
    finally:
        t0 = time.perf_counter()
        code = proc.stop(timeout_s=60.0)
        stop_s = time.perf_counter() - t0
    row = {"layout": layout, **phases(log_path.read_text(errors="replace"), launched),
           "ready_s": ready_s, "first_request_s": first_request_s, "stop_s": stop_s,
           "exit_code": code}
    harness.progress(f"{layout}: ready {ready_s:.2f} s, stop {stop_s:.2f} s")
    return row


def median_phases(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each phase's median over the rounds (None for a phase a layout does not have)."""
    values = {p: [r[p] for r in rows] for p in PHASES}
    return {p: None if None in xs else statistics.median(xs) for p, xs in values.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--preset", default="tiny", help="Model shapes (rltool.data.models).")
    parser.add_argument("--rounds", type=int, default=3, help="Starts per layout (alternating).")
    parser.add_argument("--layouts", default="one,two", help="Comma-separated: one, two.")
    parser.add_argument("--quick", action="store_true", help="CPU, tiny model, 1 round.")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.device, args.preset, args.rounds = "cpu", "tiny", 1
    layouts = args.layouts.split(",")
    try:
        if set(layouts) - set(LAYOUTS):
            raise BadInputError(f"--layouts {args.layouts!r}: choose from {sorted(LAYOUTS)}")
        harness.require_positive(args, "--rounds")
        harness.require_device(args.device)
    except BadInputError as e:
        parser.error(str(e))

    from rltool.data.models import init_model

    run = harness.Run("serve_start", device=args.device)
    tmp = Path(tempfile.mkdtemp(prefix="rltool-serve-start-"))
    model_dir = init_model(tmp / args.preset, preset=args.preset, task="reverse", seed=0,
                           dtype="bf16" if args.device == "cuda" else "fp32")
    extra = ["--num-threads", "1"] if args.device == "cpu" else []
    rows = [one_round(model_dir, args.device, layout, tmp / f"serve-{layout}-{i}.log", extra)
            for i in range(args.rounds) for layout in layouts]
    medians = {layout: median_phases([r for r in rows if r["layout"] == layout])
               for layout in layouts}
    harness.print_table(["layout", "round", *PHASES],
                        [[r["layout"], i // len(layouts), *(r[p] for p in PHASES)]
                         for i, r in enumerate(rows)]
                        + [[layout, "median", *(medians[layout][p] for p in PHASES)]
                           for layout in layouts])
    return run.finish({"settings": {"preset": args.preset, "rounds": args.rounds,
                                    "args": extra}, "medians": medians},
                      out=args.out, detail={"rounds": rows})


if __name__ == "__main__":
    try:
        main()
    except BadInputError as e:
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(2)
