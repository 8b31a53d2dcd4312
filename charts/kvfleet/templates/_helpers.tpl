{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "kvfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release name + chart name, unless the release name already contains it. */}}
{{- define "kvfleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvfleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object of the chart. */}}
{{- define "kvfleet.labels" -}}
helm.sh/chart: {{ include "kvfleet.chart" . }}
{{ include "kvfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvfleet
{{- end }}

{{/* Labels that select the operator pods (immutable once installed: keep them few). */}}
{{- define "kvfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kvfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvfleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvfleet.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The default runtime image of InferenceServices (repository@digest, else repository:tag). */}}
{{- define "kvfleet.runtimeImage" -}}
{{- if .Values.runtimeImage.digest }}
{{- printf "%s@%s" .Values.runtimeImage.repository .Values.runtimeImage.digest }}
{{- else }}
{{- printf "%s:%s" .Values.runtimeImage.repository (default .Chart.AppVersion .Values.runtimeImage.tag) }}
{{- end }}
{{- end }}

{{/* "true" when the operator watches every namespace (no watchNamespaces given). */}}
{{- define "kvfleet.clusterWide" -}}
{{- if not .Values.operator.watchNamespaces }}true{{ end }}
{{- end }}

{{/* Namespaces the runtime pods live in, for the PodMonitor/ServiceMonitor; empty = any. */}}
{{- define "kvfleet.monitoredNamespaces" -}}
{{- $ns := .Values.monitoring.namespaces | default .Values.operator.watchNamespaces }}
{{- toJson ($ns | default list) }}
{{- end }}

{{/*
Whether the PodMonitor/ServiceMonitor is rendered: monitoring.enabled true, or "auto" and the
cluster serves monitoring.coreos.com/v1 with that kind (`helm template` needs
`--api-versions monitoring.coreos.com/v1/PodMonitor` to see it).
*/}}
{{- define "kvfleet.monitoringEnabled" -}}
{{- $m := .Values.monitoring }}
{{- if eq (toString $m.enabled) "true" }}true
{{- else if and (eq (toString $m.enabled) "auto") (.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" $m.kind)) }}true
{{- end }}
{{- end }}

{{/*
The RBAC rules the operator needs in a namespace it watches (or cluster-wide). Every rule
names the code that needs it; nothing here grants access to other kinds.
*/}}
{{- define "kvfleet.operatorRules" -}}
# The InferenceService itself: kopf lists and watches it, and patches its metadata
# (kopf's diff-base annotation kvfleet.io/last-handled-configuration; no finalizer).
- apiGroups: ["kvfleet.io"]
  resources: ["inferenceservices"]
  verbs: ["get", "list", "watch", "patch"]
# Status (conditions, replicas, url, metrics; kopf's progress in status.kopf): merge patches
# of the status subresource.
- apiGroups: ["kvfleet.io"]
  resources: ["inferenceservices/status"]
  verbs: ["get", "patch"]
# Replicas under `autoscaling.mode: operator` are written through the scale subresource
# (a merge patch of the Scale), never into the user's spec by a patch of the main resource.
- apiGroups: ["kvfleet.io"]
  resources: ["inferenceservices/scale"]
  verbs: ["patch"]
# Children, watched (a child edited or deleted by hand is put back) and written by
# server-side apply (an apply that creates needs "create" too). They go away with the
# InferenceService through ownerReferences (garbage collection), not by the operator.
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "list", "watch", "create", "patch"]
# Each InferenceService's fleet Secret (<name>-fleet: the key its router signs peer hints with and
# its replicas check them with): read by name and created once, never listed, watched or changed.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
# Optional children are also deleted when the spec no longer asks for them (a PDB or an HPA
# switched off).
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Runtime pods: readiness, IPs to scrape /metrics from, restart reasons (OOMKilled) for tuning,
# and why a pod is not ready (image pulls, crash loops, scheduling, a missing Secret), watched
# so the status says so at once. HPAs above are also listed to find one that targets an
# InferenceService in mode operator.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# The model volume's claim (download.claimName, pvc://): is it ReadWriteOnce while pods may run
# on several nodes? Read, never listed.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get"]
# KEDA ScaledObjects are listed (never written) to find one that targets an InferenceService or
# its Deployment: one scaler per target. Without this rule (or without KEDA) there are none.
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["list"]
# No Secrets: a missing apiKeySecretRef / hfTokenSecretRef Secret (or key) is learnt from the
# pods' CreateContainerConfigError, so the operator never reads a Secret's value.
# Events (core v1, which kopf posts): invalid specs, applied children, scaling and tuning
# decisions.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# spec.router: the router's ServiceAccount, Role and RoleBinding, applied like the other
# children; with its Deployment and Service deleted when spec.router.enabled is turned off.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["delete"]
# The router's Role grants read access to EndpointSlices; the API server lets the operator
# grant only what it holds itself (RBAC escalation check), so it holds exactly that.
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
# spec.router.inferencePool: the Gateway API Inference Extension's InferencePool.
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "create", "patch", "delete"]
# spec.parallelism.nodes > 1: each replica a LeaderWorkerSet group (the LWS CRD is a prerequisite);
# scaled through its /scale subresource by the autoscaler.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets/scale"]
  verbs: ["patch"]
{{- end }}

{{/* kopf peering: the operator replicas' heartbeats in the peering object's status. */}}
{{- define "kvfleet.peeringRule" -}}
- apiGroups: ["kopf.dev"]
  resources: [{{ . | quote }}]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}

{{/*
Labels the operator puts on every runtime pod and Service it creates
(kvfleet.operator.service_spec.labels); the PodMonitor/ServiceMonitor select on them.
tests/repo/test_chart.py checks them against the builders' output.
*/}}
{{- define "kvfleet.runtimeSelectorLabels" -}}
app.kubernetes.io/name: kvfleet
app.kubernetes.io/component: inference-server
app.kubernetes.io/managed-by: kvfleet-operator
{{- end }}
