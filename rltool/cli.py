"""The `rltool` command group. Subcommands are imported only when invoked, so `--help` is instant
and imports none of torch, transformers, pyarrow or megatron."""

from __future__ import annotations

import importlib

import click

from rltool import __version__

# name -> (module under rltool.commands, one-line help). Each module defines `command`.
COMMANDS: dict[str, tuple[str, str]] = {
    "init-model": ("init_model", "Write a tiny random-init HF model and tokenizer for a task."),
    "data": ("data", "Make prompt datasets for the built-in tasks."),
    "shards": ("shards", "Inspect and validate rollout shards."),
    "train": ("train", "Train the policy on rollout shards (or SFT), checkpoint and publish it."),
    "convert": ("convert", "Convert checkpoints: HF <-> Megatron torch_dist, block-FP8 quantization."),
    "rollout": ("rollout", "Sample groups for one step through the engines and write a shard."),
    "eval": ("eval", "Evaluate held-out prompts: eval shard and pass@k metrics."),
    "env": ("env", "Environments for agentic RL: list the built-ins, serve one over HTTP."),
    "serve": ("serve", "Serve a model with the builtin engine over SGLang's HTTP API."),
    "delta": ("delta", "Delta weight versions: diff, apply, verify, pull (rltool and slime formats)."),
    "align-gate": ("align_gate", "Gate: trainer-recomputed vs rollout logprobs (and per layer)."),
    "loop": ("loop", "Run the synchronous RL loop (rollout, train, publish, sync, eval); resumable."),
    "report": ("report", "HTML page with PNG plots and a summary table of a loop run's metrics."),
    "profile": ("profile", "Phase table, wait ratios, async speedup and Chrome trace of a traced run."),
    "plan": ("plan", "Cost models: placement, memory, weight sync, async, precision, caches, PD."),
    "doctor": ("doctor", "Versions, GPUs, native kernels, and which tiers can run on this machine."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module = importlib.import_module(f"rltool.commands.{COMMANDS[name][0]}")
        return module.command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"],
                                              "max_content_width": 100})
@click.version_option(__version__, prog_name="rltool")
def main() -> None:
    """rltool: RL post-training of LLMs as composable stages on a shared run directory.

    Exit codes: 0 success, 1 a check or gate failed, 2 usage or bad input, 3 runtime failure.
    """


if __name__ == "__main__":
    main()
