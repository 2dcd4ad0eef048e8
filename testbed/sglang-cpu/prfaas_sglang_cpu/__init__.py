"""What real SGLang needs to serve on a CPU-only machine: its workarounds and a tiny model.

This package is not installed in the project's venv: scripts/setup.sh copies it into the real
engine's venv (`prfaas_testbed.sglang_cpu.ENGINE_VENV`), beside SGLang itself, with a `.pth`
file that installs `workarounds.install()` in every interpreter of that venv (SGLang's
scheduler subprocesses included). It imports SGLang, torch and transformers; the testbed asks
it for what it needs through its command line.
"""
