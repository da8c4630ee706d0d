"""The rollout stage: prompts -> engines -> rewards -> one Parquet shard directory per call.

`run(cfg)` is the library entry the loop calls in-process; `rltool rollout` is its thin command.
It takes the step's prompts (`prompts.py`), samples `n_samples_per_prompt` responses per prompt
through the router (`router.py`) with the generate function (`generate.py`), rewards them off the
event loop and filters them (`collect.py`), and writes the shard (rltool.data.shards), the metrics
line (`metrics.py`) and the resolved config. Nothing is written when the input is bad.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rltool import atomic, trace
from rltool.config import StageConfig, checked_urls, cli, url_error, write_resolved
from rltool.errors import BadInputError, ConfigError, EngineError, RewardError
from rltool.rollout.batching import DEFAULT_SAMPLES_PER_REQUEST
from rltool.rollout.client import engine_model_infos, tokenizer_path_of
from rltool.rollout.generate import Sample, load_generate_fn, to_row
from rltool.rollout.prompts import (Prompt, PromptKeys, cached_prompts, cached_tokenizer,
                                    check_chat_template, prompt_at, render_prompt)

log = logging.getLogger(__name__)
PRODUCER = "rltool rollout"
CONFIG_NAME = "rollout_config.toml"


def split_urls(value: Any) -> Any:
    """URLs given as one string or a list, each item possibly comma-separated -> a list without
    trailing slashes (None when empty); anything else is left for pydantic to refuse."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)):
        urls = [u.strip().rstrip("/") for item in value for u in str(item).split(",")]
        return [u for u in urls if u] or None
    return value


class EngineStageConfig(StageConfig):
    """Fields shared by rollout and eval: where the engines are, what to sample, how to reward."""

    engines: list[str] | None = Field(None, description="Engine base URLs; rltool balances over "
                                      "them itself.", json_schema_extra=cli(metavar="URL[,URL...]"))
    router: str | None = Field(None, description="A gateway URL (smg / sglang-router) instead of "
                               "--engines; the gateway balances, sessions go as X-SMG-Routing-Key.")
    prompts: str = Field(description="Prompt file (.jsonl or .parquet) or a directory saved by "
                         "HF datasets; rows {prompt, label, prompt_id, metadata} (see --input-key).")
    input_key: str = Field("prompt", description="Field holding the prompt (a string or a chat "
                           "list); dotted keys reach nested fields.")
    label_key: str = Field("label", description="Field holding the label the reward compares "
                           "against, e.g. reward_model.ground_truth.")
    metadata_key: str = Field("metadata", description="Field holding the per-prompt metadata "
                              "object passed to the reward.")
    apply_chat_template: bool = Field(True, description="Apply the tokenizer's chat template to "
                                      "each prompt; off: a string prompt is encoded as it is.")
    out: str = Field(description="Shard directory to create; refused if it exists.")
    n_samples_per_prompt: int = Field(1, ge=1, description="Samples per prompt (the group size).")
    max_response_len: int = Field(ge=1, description="Most response tokens per sample (all turns).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (<1e-6: greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, description="Top-k (-1: whole vocabulary).")
    env: str | None = Field(None, description="Agentic episodes against an environment: a "
                            "built-in name (rltool env list), module:Class, or the URL of "
                            "`rltool env serve`; replaces --reward and --generate-fn.")
    reward: str | None = Field(None, validate_default=True, description="Reward: a task name, "
                               "module:function or an http(s) URL (not with --env: the "
                               "environment rewards).")
    max_turns: int = Field(8, ge=1, description="With --env: most model turns per episode.")
    max_tokens_per_turn: int | None = Field(None, ge=1, description="With --env: most tokens "
                                            "of one model turn (default: what is left of "
                                            "--max-response-len).")
    env_step_timeout_s: float = Field(60.0, gt=0, description="With --env: timeout of one "
                                      "environment call (reset, step, verify); a timeout "
                                      "fails the episode (env_timeout), not the step.")
    env_workers: int = Field(32, ge=1, description="With --env: threads that run environment "
                             "calls of the episodes in flight.")
    env_api_key: str | None = Field(None, description="With --env URL: the key of `rltool env "
                                    "serve --api-key`.",
                                    json_schema_extra=cli(envvar="RLTOOL_ENV_API_KEY"))
    tokenizer: str | None = Field(None, description="Tokenizer directory (default: the engine's "
                                  "tokenizer_path from /get_model_info).")
    concurrency: int = Field(32, ge=1, description="Most in-flight requests per engine.")
    samples_per_request: int = Field(DEFAULT_SAMPLES_PER_REQUEST, ge=1, description="Most "
                                     "samples in one batched /generate (a group is never split).")
    step: int = Field(0, ge=0, description="Step number: picks the prompts and goes in the metadata.")
    seed: int | None = Field(None, description="Base seed; each request gets sampling_seed derived "
                             "from it and the sample uid (reproducible with deterministic engines).")
    generate_fn: str | None = Field(None, description="Custom async generate function "
                                    "module:function (default: single-turn).")
    metrics: str | None = Field(None, description="Metrics JSONL file (default: next to --out).")
    policy_version: int | None = Field(None, description="Policy version for the metrics line "
                                       "(default: the newest weight version seen in the samples).")
    api_key: str | None = Field(None, description="Bearer token for the engines or gateway.",
                                 json_schema_extra=cli(envvar="RLTOOL_API_KEY"))
    request_timeout_s: float = Field(600.0, gt=0, description="Timeout of one /generate call.")
    reward_timeout_s: float = Field(30.0, gt=0, description="Timeout of one reward call; a "
                                    "timeout marks the sample failed (reward_timeout).")
    reward_workers: int = Field(4, ge=1, description="Threads that run reward functions.")
    quiet: bool = Field(False, description="No progress bar (the command's -q sets it).",
                        json_schema_extra=cli(option=False))

    def prompt_keys(self) -> PromptKeys:
        return PromptKeys(input=self.input_key, label=self.label_key, metadata=self.metadata_key)

    @field_validator("engines", mode="before")
    @classmethod
    def _split_engines(cls, value: Any) -> Any:
        return split_urls(value)

    @field_validator("engines", "router")
    @classmethod
    def _check_urls(cls, value: list[str] | str | None) -> list[str] | str | None:
        return checked_urls(value)

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError("must be -1 (whole vocabulary) or >= 1")
        return value

    @model_validator(mode="after")
    def _one_target(self) -> "EngineStageConfig":
        if bool(self.engines) == bool(self.router):
            raise ValueError("give exactly one of --engines URL[,URL...] or --router URL")
        return self

    @field_validator("reward")
    @classmethod
    def _reward_or_env(cls, value: str | None, info: Any) -> str | None:
        env = info.data.get("env")  # declared before reward, so already validated
        if env is None and not value:
            raise ValueError("give --reward SPEC (or --env NAME|module:Class|URL, whose "
                             "environment rewards the episodes)")
        if env is not None and value:
            raise ValueError("--reward and --env exclude each other: the environment rewards "
                             "the episodes; drop --reward")
        return value

    @model_validator(mode="after")
    def _env_without_generate_fn(self) -> "EngineStageConfig":
        if self.env is not None and self.generate_fn:
            raise ValueError("--generate-fn and --env exclude each other: --env runs its own "
                             "episode loop; drop --generate-fn")
        return self

    def request_fields(self) -> dict[str, Any]:
        """Fields added to every /generate body of the stage."""
        return {}

    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_response_len": self.max_response_len,
                "n_samples_per_prompt": self.n_samples_per_prompt, "seed": self.seed}


class RolloutConfig(EngineStageConfig):
    """`rltool rollout`: one step's shard of groups for training."""

    rollout_batch_size: int = Field(ge=1, description="Prompts (groups) per step: step K takes "
                                    "prompt positions [K*P, (K+1)*P), cycling over the file.")
    filter: Literal["none", "all-equal-reward"] = Field(
        "none", description="all-equal-reward: DAPO dynamic sampling (drop groups whose rewards "
        "are all equal, over-sample to fill the batch).")
    over_sample_factor: float = Field(1.0, ge=1.0, description="With --filter, start this many "
                                      "times rollout_batch_size groups at once.")
    max_prompts: int | None = Field(None, ge=1, description="With --filter, most prompts one "
                                    "step may start (default 4 x rollout_batch_size).")
    partial: bool = Field(False, description="Carry groups with aborted samples (with their "
                          "tokens) over to the next step instead of writing them.")
    opd_teacher: list[str] = Field(default_factory=list, description="On-policy distillation: "
                                   "teacher engines [NAME=]URL[@WEIGHT] that score every sampled "
                                   "token (the shard's teacher_logprobs).",
                                   json_schema_extra=cli(metavar="SPEC[,SPEC...]"))
    opd_teacher_route: str | None = Field(None, description="Prompt metadata field whose value "
                                          "names each sample's teacher (default: teachers mixed "
                                          "by their weights).")
    opd_teacher_api_key: str | None = Field(None, description="Bearer key of the teacher "
                                            "engines (--api-key goes to the engines only).",
                                            json_schema_extra=cli(
                                                envvar="RLTOOL_OPD_TEACHER_API_KEY"))
    use_rollout_routing_replay: bool = Field(
        False, description="MoE models: ask the engines for the experts they routed every "
        "token to (return_routed_experts) and store them in the shard "
        "(rollout_routed_experts), for the trainer to replay.")
    max_failed_rewards_frac: float = Field(
        0.05, ge=0.0, le=1.0, description="Exit 3, writing nothing, when more than this share "
        "of the step's reward calls failed (raised or timed out), so a broken reward function "
        "cannot produce a shard of zeros.")

    @field_validator("opd_teacher", mode="before")
    @classmethod
    def _split_teachers(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @model_validator(mode="after")
    def _check_opd(self) -> "RolloutConfig":
        from rltool.data.teachers import parse_teacher_specs

        for teacher in parse_teacher_specs(self.opd_teacher):
            if problem := url_error(teacher.location):
                raise ConfigError(f"--opd-teacher {teacher.name}: {problem} (a teacher engine)")
        if self.opd_teacher_route and not self.opd_teacher:
            raise ValueError("--opd-teacher-route needs --opd-teacher NAME=URL[,...]")
        return self

    def request_fields(self) -> dict[str, Any]:
        return {"return_routed_experts": True} if self.use_rollout_routing_replay else {}

    @model_validator(mode="after")
    def _filter_needs_groups(self) -> "RolloutConfig":
        if self.env is not None and self.partial:
            raise ValueError("--partial cannot carry --env episodes over (an environment's "
                             "state is not saved); drop --partial")
        if self.filter == "all-equal-reward" and self.n_samples_per_prompt < 2:
            raise ValueError("--filter all-equal-reward needs --n-samples-per-prompt >= 2 "
                             "(a group of one always has equal rewards)")
        return self


def check_outputs(cfg: EngineStageConfig) -> None:
    """BadInputError unless --out is a new directory and --metrics a file that can be written:
    checked before anything (a trace, a shard) is written."""
    out = atomic.check_output_path(cfg.out, flag="--out", directory=True)
    if out.exists():
        raise BadInputError(f"--out {out} already exists; choose a new directory (a complete "
                            "shard is never overwritten)")
    if cfg.metrics:
        atomic.check_output_path(cfg.metrics, flag="--metrics")


class StageInputs:
    """Everything a stage resolves before generating: prompts, tokenizer, reward, generate fn."""

    def __init__(self, cfg: EngineStageConfig, *, clients: dict[str, Any] | None = None):
        from rltool.rollout.rewards import check_labels, resolve_reward

        check_outputs(cfg)
        self.prompts, rendered = cached_prompts(cfg.prompts, cfg.prompt_keys())
        self.apply_chat_template = cfg.apply_chat_template
        self.env_source = None
        if cfg.env is not None:
            from rltool.rollout.episode import EnvSource

            # Episodes are rewarded by their environment: no reward function.
            self.env_source = EnvSource(cfg.env, api_key=cfg.env_api_key,
                                        timeout_s=cfg.env_step_timeout_s,
                                        workers=cfg.env_workers)
            self.reward_fn = None
        else:
            self.generate_fn = load_generate_fn(cfg.generate_fn)
            self.reward_fn = resolve_reward(cfg.reward, timeout_s=cfg.reward_timeout_s)
            check_labels(self.reward_fn, self.prompts, spec=cfg.reward)
        self.urls = cfg.engines or [cfg.router]
        self.via_gateway = cfg.router is not None
        # Engine clients the caller owns (an in-process engine, rltool.engine.inprocess), by URL;
        # without them each stage call opens its own HTTP clients.
        self.clients = clients
        if clients is not None and set(clients) != set(self.urls):
            raise ValueError(f"clients for {sorted(clients)} but --engines {self.urls}")
        infos = engine_model_infos(self.urls, api_key=cfg.api_key, clients=clients)
        # What each engine computed with, for the trainer and the align gate to match (null for
        # an engine whose /get_model_info does not say, such as SGLang, or that did not answer:
        # the router routes around engines that are down).
        self.engine_precision = {
            url: {key: None if isinstance(info, Exception) else info.get(key)
                  for key in ("device", "dtype")} for url, info in infos.items()}
        self.tokenizer_dir = cfg.tokenizer or tokenizer_path_of(infos)
        self.tokenizer, self.tokenizer_hash = cached_tokenizer(self.tokenizer_dir)
        if cfg.apply_chat_template or self.env_source is not None:
            check_chat_template(self.tokenizer, where=str(self.tokenizer_dir))
        if self.env_source is not None:
            from rltool.rollout.episode import make_env_generate

            self.generate_fn = make_env_generate(self.env_source, max_turns=cfg.max_turns,
                                                 max_tokens_per_turn=cfg.max_tokens_per_turn,
                                                 step_timeout_s=cfg.env_step_timeout_s,
                                                 tokenizer=self.tokenizer)
        self._rendered: dict[int, list[int]] = rendered.setdefault(
            (self.tokenizer_hash, self.apply_chat_template), {})

    def new_group(self, position: int, *, n: int, uid_prefix: str) -> list[Sample]:
        """The n fresh samples of the prompt at a stream position (group_id = position)."""
        prompt: Prompt = prompt_at(self.prompts, position)
        if prompt.row_index not in self._rendered:
            self._rendered[prompt.row_index] = render_prompt(
                self.tokenizer, prompt, apply_chat_template=self.apply_chat_template)
        ids = self._rendered[prompt.row_index]
        return [Sample(uid=f"{uid_prefix}-g{position}-{i}", prompt_id=prompt.prompt_id,
                       group_id=position, sample_index=i, prompt=prompt.text,
                       prompt_token_ids=list(ids), label=prompt.label,
                       metadata=dict(prompt.metadata), prompt_row=prompt) for i in range(n)]

    def make_router(self, cfg: EngineStageConfig) -> Any:
        from rltool.rollout.client import EngineClient
        from rltool.rollout.router import Router

        clients = self.clients or {
            url: EngineClient(url, api_key=cfg.api_key, timeout_s=cfg.request_timeout_s,
                              keepalive=cfg.concurrency)
            for url in self.urls}
        return Router(clients, concurrency=cfg.concurrency, via_gateway=self.via_gateway)

    def collect(self, cfg: EngineStageConfig, source: Iterator[list[Sample]], *,
                target_groups: int, label: str, **run_kwargs: Any) -> tuple[Any, dict[str, Any]]:
        """Run the collector over the engines (own event loop); (CollectResult, router stats).

        Raises EngineError when no engine is left alive at the end (nothing is written)."""
        from rltool.rollout.collect import Collector
        from rltool.rollout.metrics import RolloutProgress

        out: list[tuple[Any, dict[str, Any]]] = []

        async def main() -> None:
            # Returns nothing: asyncio.run's SIGINT bookkeeping formats the finished task with
            # its result, and the repr of a whole rollout cost several ms per step.
            router = self.make_router(cfg)
            try:
                with RolloutProgress(total_groups=target_groups,
                                     total_samples=target_groups * cfg.n_samples_per_prompt,
                                     quiet=cfg.quiet, label=label) as progress:
                    collector = Collector(router=router, tokenizer=self.tokenizer,
                                          generate_fn=self.generate_fn, sampling=cfg.sampling(),
                                          reward_fn=self.reward_fn,
                                          reward_timeout_s=cfg.reward_timeout_s,
                                          reward_workers=cfg.reward_workers, progress=progress,
                                          request_fields=cfg.request_fields(),
                                          samples_per_request=cfg.samples_per_request)
                    result = await collector.run(source, target_groups=target_groups, **run_kwargs)
                out.append((result, router.stats()))
            finally:
                await router.aclose()

        asyncio.run(main())
        result, stats = out[0]
        if not any(e["alive"] for e in stats["engines"].values()):
            raise EngineError("every engine died during the rollout; nothing was written; restart "
                              "the engines and re-run the step")
        return result, stats

    def shard_meta(self, cfg: EngineStageConfig, *, producer: str, extra: dict[str, Any]) -> Any:
        from rltool.data.shards import ShardMeta

        return ShardMeta(tokenizer_hash=self.tokenizer_hash, step=cfg.step, producer=producer,
                         sampling=cfg.sampling(),
                         extra={"prompts": str(cfg.prompts), "reward": cfg.reward or "env",
                                "generate_fn": ("env" if cfg.env else
                                                cfg.generate_fn or "single-turn"),
                                **({"env": cfg.env, "max_turns": cfg.max_turns}
                                   if cfg.env else {}),
                                "engines": self.urls, "engine_precision": self.engine_precision,
                                **extra})

    def write(self, cfg: EngineStageConfig, groups: list[list[Sample]], *, meta: Any,
              config_name: str) -> dict[str, Any]:
        """Publish the shard, then the resolved config (without its keys) inside it; the
        manifest."""
        from rltool.data.shards import write_shard

        manifest = write_shard(cfg.out, [to_row(s) for g in groups for s in g], meta)
        write_resolved(cfg, Path(cfg.out) / config_name)
        return manifest


def with_seed(cfg: EngineStageConfig) -> EngineStageConfig:
    """Fix a base seed when none was given, so every request carries a distinct sampling_seed.

    A deterministic engine (SGLang's --enable-deterministic-inference, builtin --deterministic)
    seeds a request without one with 42: every sample of a group would be the same, and GRPO would
    see no variance. The seed drawn here goes into the shard metadata (sampling.seed)."""
    if cfg.seed is not None:
        return cfg
    import secrets

    return cfg.model_copy(update={"seed": secrets.randbelow(2**31)})


def run(cfg: RolloutConfig, *, clients: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one rollout step; returns {out, rows, groups, metrics, counts, engines, ...}.
    `clients`: the engines' clients by URL (kept open) instead of HTTP clients per call."""
    check_outputs(cfg)  # before the trace directory beside --out is set up
    with trace.scope(Path(cfg.out).parent / "trace", role="rollout"):
        return _run(cfg, clients=clients)


def _run(cfg: RolloutConfig, *, clients: dict[str, Any] | None) -> dict[str, Any]:
    from rltool.rollout import partial as partial_store
    from rltool.rollout.collect import check_generation
    from rltool.rollout.metrics import rollout_metrics

    cfg = with_seed(cfg)
    inputs = StageInputs(cfg, clients=clients)
    if cfg.opd_teacher:
        from rltool.rollout.teachers import check_teachers

        check_teachers(cfg.opd_teacher, route=cfg.opd_teacher_route, prompts=inputs.prompts,
                       student_tokenizer_hash=inputs.tokenizer_hash,
                       api_key=cfg.opd_teacher_api_key)
    n, batch = cfg.n_samples_per_prompt, cfg.rollout_batch_size
    budget = (cfg.max_prompts or 4 * batch) if cfg.filter != "none" else batch
    carry_dir = partial_store.partial_dir(cfg.out)
    carried, carried_from = ([], None)
    if cfg.partial:
        carried, carried_from = partial_store.load_carry(carry_dir, step=cfg.step,
                                                         tokenizer_hash=inputs.tokenizer_hash)
    fresh_budget = max(0, budget - len(carried)) if cfg.filter == "none" else budget
    source = (inputs.new_group(p, n=n, uid_prefix=f"s{cfg.step:06d}")
              for p in fresh_positions(step=cfg.step, batch=batch, budget=fresh_budget,
                                       carried=carried))
    result, router_stats = inputs.collect(cfg, source, target_groups=batch, label="rollout",
                                          carried=carried, dynamic_filter=cfg.filter != "none",
                                          over_sample_factor=cfg.over_sample_factor,
                                          partial=cfg.partial)
    check_generation(result.kept, step=cfg.step)
    check_reward_failures(result.counts, result.first_reward_failure,
                          max_frac=cfg.max_failed_rewards_frac, step=cfg.step)
    opd_metrics = {}
    if cfg.opd_teacher:
        from rltool.rollout.teachers import score_samples

        opd_metrics = score_samples(
            [s for g in result.kept for s in g], specs=cfg.opd_teacher,
            route=cfg.opd_teacher_route, temperature=cfg.temperature,
            api_key=cfg.opd_teacher_api_key,
            timeout_s=cfg.request_timeout_s, concurrency=cfg.concurrency,
            samples_per_request=cfg.samples_per_request)
    meta = inputs.shard_meta(cfg, producer=PRODUCER,
                             extra={"filter": cfg.filter, "partial": cfg.partial})
    carry_path = None
    if cfg.partial:
        # Before the shard: a crash in between re-runs this step, which reads the same earlier
        # carry file again; the other order would let the next step resume it a second time.
        carry_path = partial_store.save_carry(carry_dir, step=cfg.step, groups=result.carry,
                                              meta=meta)
    manifest = inputs.write(cfg, result.kept, meta=meta, config_name=CONFIG_NAME)
    metrics = rollout_metrics(result.kept, counts=result.counts, output_tokens=result.output_tokens,
                              elapsed_s=result.elapsed_s,
                              redispatched=router_stats["redispatched"]) | opd_metrics
    metrics_path = write_metrics(cfg, metrics, default_name="rollout.jsonl")
    return {"out": cfg.out, "rows": manifest["num_rows"], "groups": len(result.kept),
            "step": cfg.step, "metrics": metrics, "metrics_path": str(metrics_path),
            "counts": result.counts, "engines": router_stats["engines"],
            "carried_from": str(carried_from) if carried_from else None,
            "carried_to": str(carry_path) if carry_path else None}


def fresh_positions(*, step: int, batch: int, budget: int, carried: list[list[Any]]) -> list[int]:
    """The prompt positions step `step` may start fresh: `budget` from its own range on, less
    those a carried group holds (an over-sampling step starts positions of the next step's range;
    with --partial they come back carried, and a fresh copy beside one would put two groups of
    one group_id in the shard)."""
    held = {group[0].group_id for group in carried}
    start = step * batch
    return [p for p in range(start, start + budget) if p not in held]


def check_reward_failures(counts: dict[str, int], first_failure: str | None, *, max_frac: float,
                          step: int) -> None:
    """RewardError (exit 3) when more than `max_frac` of the step's reward calls failed (`counts`:
    "reward_calls", "failed_rewards"; `first_failure`: the first failed call's finish_reason).

    Runs before anything is written (carry file, shard, metrics), so the step can be re-run once
    the reward is fixed. A failed call already marked its sample `failed` (reward 0.0); below the
    threshold those samples go into the shard and the trainer leaves their groups out."""
    calls = counts.get("reward_calls", 0)
    failed = counts.get("failed_rewards", 0)
    if calls and failed / calls > max_frac:
        raise RewardError(
            f"{failed} of {calls} reward calls failed at step {step} ({failed / calls:.0%}, more "
            f"than --max-failed-rewards-frac {max_frac:g}); first: {first_failure}; "
            "nothing was written: fix the reward (or raise --max-failed-rewards-frac) and re-run "
            "the step")


def write_metrics(cfg: EngineStageConfig, metrics: dict[str, Any], *, default_name: str,
                  version_key: str = "rollout/weight_version/max") -> Path:
    from rltool.rundir import MetricsWriter

    path = Path(cfg.metrics) if cfg.metrics else Path(cfg.out).parent / default_name
    version = cfg.policy_version
    if version is None:
        version = max(metrics.get(version_key, 0), 0)
    with MetricsWriter(path) as writer:
        writer.log(metrics, step=cfg.step, policy_version=int(version))
    return path
