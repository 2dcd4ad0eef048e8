{{/* Chart name, at most 63 characters (a label value). */}}
{{- define "prfaas-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-qualified name of every object; the release name alone when it already says it. */}}
{{- define "prfaas-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "prfaas-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "prfaas-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "prfaas-operator.labels" -}}
{{ include "prfaas-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "prfaas-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "prfaas-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "prfaas-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
Namespaced permissions of the operator in its own (PD) cluster. Granted cluster-wide or per
watched namespace; never a wildcard.
*/}}
{{- define "prfaas-operator.namespacedRules" -}}
{{- if .Values.operator.poolController -}}
# The pool controller: its pools (patch: their finalizer), the claims beside them, both statuses.
- apiGroups: [prfaas.io]
  resources: [prfaaspools]
  verbs: [get, list, watch, patch]
- apiGroups: [prfaas.io]
  resources: [prfaaspoolclaims]
  verbs: [get, list, watch]
- apiGroups: [prfaas.io]
  resources: [prfaaspools/status, prfaaspoolclaims/status]
  verbs: [patch]
# The pool's prefill fleet, applied beside it (server-side apply: create and patch, no delete: its
# children carry an ownerReference and go with it); its StatefulSets and pods watched. Update on
# prfaaspools/finalizers: that ownerReference blocks the pool's deletion (OwnerReferencesPermissionEnforcement).
- apiGroups: [prfaas.io]
  resources: [prfaaspools/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, list, watch, create, patch]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
{{- else -}}
- apiGroups: [prfaas.io]
  resources: [prfaasdeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [prfaas.io]
  resources: [prfaasdeployments/status]
  verbs: [get, patch, update]
# Owner references with blockOwnerDeletion need update on the owner's finalizers.
- apiGroups: [prfaas.io]
  resources: [prfaasdeployments/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [statefulsets, deployments]
  verbs: [get, list, watch, create, patch, update, delete]
# Engine pools with nodesPerInstance > 1 (where LeaderWorkerSet is installed).
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# A disruption budget per engine pool and for the router.
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, update, delete]
# A PrfaasDeployment's spec.gateway: an InferencePool over its decode pods (the CRD is the
# gateway's; where it is not installed the operator says so in GatewayReady).
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch, create, patch, update, delete]
# Each router's identity: a ServiceAccount whose Role reads only its config ConfigMap (the
# operator can grant that because it reads ConfigMaps itself).
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, update, delete]
# Only to read the PrfaaS cluster's kubeconfig Secret a PrfaasDeployment names.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
{{- end }}
{{- end -}}

{{/* Cluster-scoped reads kopf needs to discover namespaces and the CRD. */}}
{{- define "prfaas-operator.clusterRules" -}}
- apiGroups: [""]
  resources: [namespaces]
  verbs: [get, list, watch]
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
{{- end -}}

{{/* Name of the CRD-upgrade hook's Job, ServiceAccount, ClusterRole and binding (a Job name must fit a label). */}}
{{- define "prfaas-operator.crdUpgradeName" -}}
{{- printf "%s-crd-upgrade" (include "prfaas-operator.fullname" . | trunc 51 | trimSuffix "-") -}}
{{- end -}}

{{/* The PrfaasDeployment CRD. */}}
{{- define "prfaas-operator.crdName" -}}
prfaasdeployments.prfaas.io
{{- end -}}

{{/* The CRDs this chart owns (crd.KINDS); the hook may touch no other. */}}
{{- define "prfaas-operator.crdNames" -}}
{{ include "prfaas-operator.crdName" . }}, prfaaspools.prfaas.io, prfaaspoolclaims.prfaas.io
{{- end -}}

{{/* The leader-election Lease (in the release namespace). */}}
{{- define "prfaas-operator.leaseName" -}}
{{- .Values.leaderElection.leaseName | default (include "prfaas-operator.fullname" .) -}}
{{- end }}

{{/*
"true" when the cluster serves the Prometheus Operator's API (for `helm template`: pass
`--api-versions monitoring.coreos.com/v1`). Without it the monitoring objects are skipped and
NOTES.txt says so: an install never fails for want of the Prometheus Operator.
*/}}
{{- define "prfaas-operator.monitoringAPI" -}}
{{- .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}
{{- end -}}

{{/* Labels of every ServiceMonitor, PodMonitor and PrometheusRule. */}}
{{- define "prfaas-operator.monitoringLabels" -}}
{{ include "prfaas-operator.labels" . }}
{{- with .Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Relabelings that give every scraped series the labels the alerts and the dashboard select on:
`role` (the pod's prfaas.io/role, or "operator") and `cluster` (monitoring.cluster), besides
the `namespace` and `pod` the Prometheus Operator adds and the planner selects by.
*/}}
{{- define "prfaas-operator.scrapeRelabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_label_prfaas_io_role]
  targetLabel: role
  regex: (.+)
- targetLabel: cluster
  replacement: {{ .Values.monitoring.cluster | quote }}
{{- end -}}
