"""The local testbed: two kwok clusters, pods that really run (engines: prfaas_engine_sim), Prometheus, the link."""
