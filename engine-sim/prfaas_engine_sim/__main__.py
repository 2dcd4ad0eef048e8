"""``python -m prfaas_engine_sim ARGS``: the fake SGLang engine (see ``cli``)."""

from prfaas_engine_sim.cli import main

main()
