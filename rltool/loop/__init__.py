"""`rltool loop`: the synchronous RL loop (rollout -> train -> publish -> sync -> eval) over a run
directory, resumable after a kill. See docs/loop.md.

config.py   the loop's TOML tables, validated by each stage's own model
state.py    state.json: step, last completed phase, policy version
engines.py  engines and the trainer subprocess, recorded in engines.json, ended by PID
phases.py   one function per phase, each checking its artifact's marker first
runner.py   start / resume / run_step
report.py   `rltool report`: plots and a summary of the metrics
"""
