"""What every mode of the operator's kopf process shares: its settings and how it logs in.

Imported by the handler module of the mode that runs (handlers.py for PrfaasDeployments,
pool_handlers.py for the pool controller): `login` registers on import.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import kopf
from prfaas_core.vocabulary import ANNOTATION_PREFIX, FINALIZER


def configure(settings: kopf.OperatorSettings) -> None:
    """Our own finalizer and annotation prefix; events from logs only for warnings; bounded watches."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300  # the API server ends each watch; kopf re-lists
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Pinned: the in-cluster service account, else KUBECONFIG; never another library's config.

    In a pod, the apiserver is the address the kubelet puts in KUBERNETES_SERVICE_HOST/PORT, as
    client-go and lightkube (our own clients) find it: kopf's own choice, the name
    kubernetes.default.svc, needs cluster DNS, which a cluster need not run.
    """
    in_cluster = kopf.login_with_service_account(**kwargs)
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if in_cluster is not None and host and port:
        host = f"[{host}]" if ":" in host else host
        return dataclasses.replace(in_cluster, server=f"https://{host}:{port}")
    return in_cluster or kopf.login_with_kubeconfig(**kwargs)
