"""Discrete-event simulator driving the product's own routing policy and planner.

`engine.run_system(SystemSpec, requests, SimulationSettings, link_changes)` runs one deployment on one
request stream; `systems.deployments` builds the paper's three deployments from a profile at the
planner's allocations; `scenarios`, `study` and `replicas` (router replicas sharing the link
budget) hold the experiments behind docs/sim; the command line is `python -m prfaas_sim` (`cli.main`).
"""
