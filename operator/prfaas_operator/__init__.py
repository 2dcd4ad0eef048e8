"""The PrfaasDeployment operator: the CR's models, pure builders and reconcile pass, the executors, kube and Prometheus adapters."""
