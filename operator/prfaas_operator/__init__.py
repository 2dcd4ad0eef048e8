"""The PrfaasDeployment operator: CRD models, pure builders and planner, kube and Prometheus adapters."""
