{{/*
Names and labels. Every object is "<fullname>-<component>"; the component label says
which service a pod runs (gateway, tokenizer, scheduler, grammar, detokenizer, worker,
nats, redis).
*/}}
{{- define "radixserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "radixserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "radixserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "radixserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "radixserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "radixserve.selectorLabels" . }}
app.kubernetes.io/part-of: radixserve
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/* Every pod of the release (NetworkPolicies). */}}
{{- define "radixserve.releaseSelector" -}}
app.kubernetes.io/name: {{ include "radixserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "radixserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "radixserve.cudaImage" -}}
{{- printf "%s:%s" .Values.cudaImage.repository (default .Chart.AppVersion .Values.cudaImage.tag) }}
{{- end }}

{{- define "radixserve.natsUrl" -}}
{{- if .Values.nats.enabled }}
{{- printf "nats://%s-nats:4222" (include "radixserve.fullname" .) }}
{{- else }}
{{- required "nats.url is required when nats.enabled is false" .Values.nats.url }}
{{- end }}
{{- end }}

{{- define "radixserve.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s-redis:6379/0" (include "radixserve.fullname" .) }}
{{- else }}
{{- required "redis.url is required when redis.enabled is false" .Values.redis.url }}
{{- end }}
{{- end }}

{{/*
A value as an environment string: whole numbers without an exponent (Helm reads every
number as a float, and 604800 would print as 6.048e+05).
*/}}
{{- define "radixserve.envValue" -}}
{{- if and (kindIs "float64" .) (eq . (float64 (int64 .))) }}
{{- int64 . | toString }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}

{{/* Model volume: does the release mount one? */}}
{{- define "radixserve.hasModelDir" -}}
{{- if or .Values.modelDir.existingClaim .Values.modelDir.hostPath }}true{{- end }}
{{- end }}

{{/*
The pod-level part every radixserve Deployment shares. Call with (dict "root" $ "component" NAME).
*/}}
{{- define "radixserve.podCommon" -}}
serviceAccountName: {{ include "radixserve.fullname" .root }}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "radixserve.podAnnotations" -}}
checksum/config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
prometheus.io/scrape: "true"
prometheus.io/path: /metrics
prometheus.io/port: {{ .port | quote }}
{{- with .root.Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "radixserve.scheduling" -}}
{{- with (default .root.Values.nodeSelector .nodeSelector) }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (default .root.Values.tolerations .tolerations) }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (default .root.Values.affinity .affinity) }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Container mounts: /tmp always, the model folder when there is one. */}}
{{- define "radixserve.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if and .model (include "radixserve.hasModelDir" .root) }}
- name: model
  mountPath: {{ .root.Values.modelDir.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "radixserve.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .root.Values.tmpSizeLimit }}
{{- if and .model (include "radixserve.hasModelDir" .root) }}
- name: model
  {{- if .root.Values.modelDir.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .root.Values.modelDir.existingClaim }}
    readOnly: true
  {{- else }}
  hostPath:
    path: {{ .root.Values.modelDir.hostPath }}
    type: Directory
  {{- end }}
{{- end }}
{{- end }}

{{/* The probes of a service whose health is its /metrics port. */}}
{{- define "radixserve.metricsProbes" -}}
startupProbe:
  httpGet:
    path: /metrics
    port: metrics
  periodSeconds: 5
  failureThreshold: 60
readinessProbe:
  httpGet:
    path: /metrics
    port: metrics
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
livenessProbe:
  httpGet:
    path: /metrics
    port: metrics
  periodSeconds: 15
  timeoutSeconds: 5
  failureThreshold: 4
{{- end }}
