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
{{- printf "%s://%s-nats:4222" (ternary "tls" "nats" .Values.nats.tls.enabled) (include "radixserve.fullname" .) }}
{{- else }}
{{- required "nats.url is required when nats.enabled is false" .Values.nats.url }}
{{- end }}
{{- end }}

{{- define "radixserve.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "%s://%s-redis:6379/0" (ternary "rediss" "redis" .Values.redis.tls.enabled) (include "radixserve.fullname" .) }}
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

{{/* The Secret holding the gateway's api-keys.json: auth.existingSecret, else the chart's. */}}
{{- define "radixserve.apiKeysSecret" -}}
{{- default (printf "%s-api-keys" (include "radixserve.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/*
The data of a Secret of the release as installed (JSON; {} when there is none, and always
under `helm template`, which sees no cluster): a generated secret keeps its values across
upgrades. Call with (dict "root" $ "name" NAME).
*/}}
{{- define "radixserve.installedSecretData" -}}
{{- (lookup "v1" "Secret" .root.Release.Namespace .name).data | default dict | toJson }}
{{- end }}

{{/* The NATS users, one per role (radixserve.infra.nats_auth ROLES): a service's is its component. */}}
{{- define "radixserve.natsRoles" -}}
{{- list "gateway" "tokenizer" "scheduler" "worker" "grammar" "detokenizer" "admin" | toJson }}
{{- end }}

{{/* The services that use Redis (request records, the grammar cache, the output log of
resumable streams, the schedulers' lease): only they get its password. Call with a dict
holding "root". */}}
{{- define "radixserve.redisClients" -}}
{{- $clients := list "gateway" "grammar" "detokenizer" }}
{{- if .root.Values.scheduler.haLease }}
{{- $clients = append $clients "scheduler" }}
{{- end }}
{{- $clients | toJson }}
{{- end }}

{{/* The Secret of the NATS passwords (a key per role): natsAuth.existingSecret, else the chart's. */}}
{{- define "radixserve.natsAuthSecret" -}}
{{- default (printf "%s-nats-auth" (include "radixserve.fullname" .)) .Values.natsAuth.existingSecret }}
{{- end }}

{{/* The Secret of the Redis user's password (key `password`): redisAuth.existingSecret, else the chart's. */}}
{{- define "radixserve.redisAuthSecret" -}}
{{- default (printf "%s-redis-auth" (include "radixserve.fullname" .)) .Values.redisAuth.existingSecret }}
{{- end }}

{{/*
What a service's pod needs to reach NATS and Redis: its own role's NATS user and password
(a Secret volume of that one key: never another role's), the Redis user's password for the
services that use Redis, and the TLS CA (and client certificate) when TLS is on. Called
with (dict "root" $ "component" NAME); YAML {env, volumes, mounts}.
*/}}
{{- define "radixserve.busCredentials" -}}
{{- $v := .root.Values }}
{{- $env := list }}
{{- $volumes := list }}
{{- $mounts := list }}
{{- $secretMode := 288 }}{{/* 0440: the pod's fsGroup reads it, nobody else */}}
{{- if $v.natsAuth.enabled }}
{{- $dir := "/etc/radixserve/nats" }}
{{- $file := ternary "user.creds" "password" $v.natsAuth.creds }}
{{- $key := ternary (printf "%s.creds" .component) .component $v.natsAuth.creds }}
{{- if $v.natsAuth.creds }}
{{- $env = append $env (dict "name" "RADIXSERVE_NATS_CREDS_FILE" "value" (printf "%s/%s" $dir $file)) }}
{{- else }}
{{- $env = append $env (dict "name" "RADIXSERVE_NATS_USER" "value" .component) }}
{{- $env = append $env (dict "name" "RADIXSERVE_NATS_PASSWORD_FILE" "value" (printf "%s/%s" $dir $file)) }}
{{- end }}
{{- $secret := dict "secretName" (include "radixserve.natsAuthSecret" .root) "defaultMode" $secretMode "items" (list (dict "key" $key "path" $file)) }}
{{- $volumes = append $volumes (dict "name" "nats-auth" "secret" $secret) }}
{{- $mounts = append $mounts (dict "name" "nats-auth" "mountPath" $dir "readOnly" true) }}
{{- end }}
{{- if $v.nats.tls.enabled }}
{{- $dir := "/etc/radixserve/nats-tls" }}
{{- $env = append $env (dict "name" "RADIXSERVE_NATS_TLS_CA" "value" (printf "%s/ca.crt" $dir)) }}
{{- $items := list "ca.crt" }}
{{- if $v.nats.tls.verifyClients }}
{{- $items = list "ca.crt" "tls.crt" "tls.key" }}
{{- $env = append $env (dict "name" "RADIXSERVE_NATS_TLS_CERT" "value" (printf "%s/tls.crt" $dir)) }}
{{- $env = append $env (dict "name" "RADIXSERVE_NATS_TLS_KEY" "value" (printf "%s/tls.key" $dir)) }}
{{- end }}
{{- $volumes = append $volumes (dict "name" "nats-tls" "secret" (dict "secretName" (required "nats.tls.secretName is required with nats.tls.enabled" $v.nats.tls.secretName) "defaultMode" $secretMode "items" (include "radixserve.secretItems" $items | fromYamlArray))) }}
{{- $mounts = append $mounts (dict "name" "nats-tls" "mountPath" $dir "readOnly" true) }}
{{- end }}
{{- if has .component (include "radixserve.redisClients" . | fromJsonArray) }}
{{- if $v.redisAuth.enabled }}
{{- $dir := "/etc/radixserve/redis" }}
{{- with $v.redisAuth.user }}
{{- $env = append $env (dict "name" "RADIXSERVE_REDIS_USER" "value" .) }}
{{- end }}
{{- $env = append $env (dict "name" "RADIXSERVE_REDIS_PASSWORD_FILE" "value" (printf "%s/password" $dir)) }}
{{- $secret := dict "secretName" (include "radixserve.redisAuthSecret" .root) "defaultMode" $secretMode "items" (list (dict "key" "password" "path" "password")) }}
{{- $volumes = append $volumes (dict "name" "redis-auth" "secret" $secret) }}
{{- $mounts = append $mounts (dict "name" "redis-auth" "mountPath" $dir "readOnly" true) }}
{{- end }}
{{- if $v.redis.tls.enabled }}
{{- $dir := "/etc/radixserve/redis-tls" }}
{{- $env = append $env (dict "name" "RADIXSERVE_REDIS_TLS_CA" "value" (printf "%s/ca.crt" $dir)) }}
{{- $items := list "ca.crt" }}
{{- if $v.redis.tls.verifyClients }}
{{- $items = list "ca.crt" "tls.crt" "tls.key" }}
{{- $env = append $env (dict "name" "RADIXSERVE_REDIS_TLS_CERT" "value" (printf "%s/tls.crt" $dir)) }}
{{- $env = append $env (dict "name" "RADIXSERVE_REDIS_TLS_KEY" "value" (printf "%s/tls.key" $dir)) }}
{{- end }}
{{- $volumes = append $volumes (dict "name" "redis-tls" "secret" (dict "secretName" (required "redis.tls.secretName is required with redis.tls.enabled" $v.redis.tls.secretName) "defaultMode" $secretMode "items" (include "radixserve.secretItems" $items | fromYamlArray))) }}
{{- $mounts = append $mounts (dict "name" "redis-tls" "mountPath" $dir "readOnly" true) }}
{{- end }}
{{- end }}
{{- dict "env" $env "volumes" $volumes "mounts" $mounts | toYaml }}
{{- end }}

{{/* Secret volume items: each key as a file of the same name. */}}
{{- define "radixserve.secretItems" -}}
{{- range . }}
- key: {{ . }}
  path: {{ . }}
{{- end }}
{{- end }}
