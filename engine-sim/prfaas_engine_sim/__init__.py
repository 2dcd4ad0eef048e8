"""A fake SGLang engine (SGLang 0.5.23's HTTP API, PD bootstrap, KV transfer and metrics) without a GPU."""
