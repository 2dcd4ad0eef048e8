"""The PrfaaS router: per-request route choice and SGLang's PD protocol."""
