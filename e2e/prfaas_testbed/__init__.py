"""The local testbed: two kwok clusters, pods that really run, fake SGLang engines, Prometheus, the link."""
