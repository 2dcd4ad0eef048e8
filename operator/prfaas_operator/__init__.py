"""The PrfaasDeployment operator: the CR's models, pure builders and reconcile pass, the executors, kube and Prometheus adapters."""

RECONCILE_LOGGER = "prfaas_operator.loops.reconcile"
"""The logger of a reconcile pass, whichever room writes the line: the executor (loops.reconcile,
whose module name it is), its hands (loops.children, loops.prefill_cluster) and the pure pass's
decisions (planning.reconcile_pass). Defined here, below every room, so each can import it."""
