"""Not SGLang: a shim of the fake engine (prfaas-engine-sim) that answers SGLang's command.

Engine pods written by the operator run ``python3 -m sglang.launch_server ARGS``; with this
package installed (the prfaas-engine-sim distribution, never the product) that command starts
the fake SGLang engine with the same ARGS. See ``sglang.launch_server``.
"""
