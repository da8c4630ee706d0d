"""On-policy distillation teachers: `--opd-teacher` specs and per-sample routing.

A spec is `[NAME=]LOCATION[@WEIGHT]`: LOCATION is an engine URL (engine mode, rollout stage) or a
HF weights directory (in-process mode, trainer); NAME names the teacher in metrics and routes
(default `teacher`, or `teacherK` for the K-th spec, from 0, when there are several); WEIGHT (default 1) is its share of a mix.
Several teachers are either routed, each sample to the teacher its metadata field names
(`--opd-teacher-route FIELD`), or mixed with their weights (normalised to sum 1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rltool.errors import BadInputError, ConfigError

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class TeacherSpec:
    name: str
    location: str
    weight: float = 1.0


def parse_teacher_specs(specs: list[str]) -> list[TeacherSpec]:
    """Parse --opd-teacher values; ConfigError naming the bad spec and the expected form."""
    out: list[TeacherSpec] = []
    for k, spec in enumerate(specs):
        name, eq, rest = spec.partition("=")
        if not eq or "/" in name or ":" in name:  # no name given: the whole spec is the location
            name, rest = "teacher" if len(specs) == 1 else f"teacher{k}", spec
        location, weight = rest, 1.0
        head, at, tail = rest.rpartition("@")
        if at:
            try:
                location, weight = head, float(tail)
            except ValueError:
                location = rest
        if not location or not _NAME.match(name) or not weight > 0:
            raise ConfigError(f"--opd-teacher {spec!r}: expected [NAME=]LOCATION[@WEIGHT] with "
                              "NAME of letters, digits, '_.-' and WEIGHT > 0")
        out.append(TeacherSpec(name=name, location=location, weight=weight))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"--opd-teacher names {names} repeat; give every teacher its own NAME= "
                          "(e.g. math=URL,code=URL)")
    return out


def route_teacher(teachers: list[TeacherSpec], route: str, metadata: dict[str, Any], *,
                  uid: str) -> TeacherSpec:
    """The teacher a sample's metadata field `route` names; BadInputError when none does."""
    value = metadata.get(route)
    for t in teachers:
        if t.name == value:
            return t
    raise BadInputError(f"sample {uid}: metadata {route}={value!r} names no teacher (teachers: "
                        f"{', '.join(t.name for t in teachers)}); add --opd-teacher "
                        f"{value}=LOCATION or fix the prompts' metadata")


def assignments(teachers: list[TeacherSpec], route: str | None, metadata: dict[str, Any], *,
                uid: str) -> list[tuple[TeacherSpec, float]]:
    """(teacher, weight) pairs of one sample, weights summing to 1: the routed teacher alone,
    or every teacher with its normalised weight."""
    if route is not None:
        return [(route_teacher(teachers, route, metadata, uid=uid), 1.0)]
    total = sum(t.weight for t in teachers)
    return [(t, t.weight / total) for t in teachers]
