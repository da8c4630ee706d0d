"""Partial rollout carry-over: groups with aborted samples, kept with their tokens for a later call.

With `--partial`, the call for step K writes `<out parent>/partial/step-K.parquet` (always, possibly
empty; atomic) holding every sample of the groups it carries over, in the shard schema. The call for
step K reads the newest such file with a step below K and resumes its aborted samples from their
tokens (finished members are kept as they are). So a re-run of step K after a crash reads the same
carry-over again and nothing is lost or used twice; files older than the one
step K read are removed.
"""

from __future__ import annotations

import os
from pathlib import Path

from rltool import atomic
from rltool.data.shards import SCHEMA, ShardMeta
from rltool.errors import TokenizerMismatchError
from rltool.rollout.generate import Sample, from_row, to_row
from rltool.rundir import parse_step_dir_name, step_dir_name

PARTIAL_DIR = "partial"


def partial_dir(out: str | os.PathLike) -> Path:
    return Path(out).parent / PARTIAL_DIR


def _steps(directory: Path) -> dict[int, Path]:
    if not directory.is_dir():
        return {}
    found = {}
    for p in directory.glob("step-*.parquet"):
        step = parse_step_dir_name(p.name.removesuffix(".parquet"))
        if step is not None:
            found[step] = p
    return found


def load_carry(directory: Path, *, step: int, tokenizer_hash: str) -> tuple[list[list[Sample]], Path | None]:
    """Groups carried over by the newest earlier step (and the file they came from)."""
    import pyarrow.parquet as pq

    earlier = {s: p for s, p in _steps(directory).items() if s < step}
    if not earlier:
        return [], None
    path = earlier[max(earlier)]
    table = pq.read_table(path)
    meta = ShardMeta.from_parquet(table.schema.metadata, where=str(path))
    if meta.tokenizer_hash != tokenizer_hash:
        raise TokenizerMismatchError(f"{path}: carried-over samples were made with tokenizer "
                                     f"{meta.tokenizer_hash}, not {tokenizer_hash}; delete the "
                                     "file to start without them")
    groups: dict[int, list[Sample]] = {}
    for row in table.to_pylist():
        sample = from_row(row)
        groups.setdefault(sample.group_id, []).append(sample)
    return [sorted(g, key=lambda s: s.sample_index) for _, g in sorted(groups.items())], path


def save_carry(directory: Path, *, step: int, groups: list[list[Sample]], meta: ShardMeta) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [to_row(s) for g in groups for s in g]
    table = pa.Table.from_pylist(rows, schema=SCHEMA).replace_schema_metadata(meta.to_parquet())
    path = directory / f"{step_dir_name(step)}.parquet"
    with atomic.atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    found = _steps(directory)
    resumed = max((s for s in found if s < step), default=None)  # what this call read
    for old_step, old in found.items():
        if resumed is not None and old_step < resumed:
            old.unlink(missing_ok=True)
    return path
