{{/*
One radixserve service as a Deployment. Called with a dict:
  root        the top context ($)
  component   gateway | tokenizer | scheduler | grammar | detokenizer | worker
  replicas    the count (left out when autoscaled, so an upgrade does not reset it)
  autoscaled  true: an HPA or KEDA owns the replica count
  singleton   true: Recreate (never two at once), for the detokenizer (and a scheduler without haLease)
  rollingUpdate  maxSurge / maxUnavailable (default: one extra pod first, none down)
  image       the image reference
  args        the container's arguments (after the image's `radixserve` entrypoint)
  env         extra environment (a list of name/value maps)
  engine      true: the engine ConfigMap too (the worker)
  model       true: mount modelDir (services that load the model's tokenizer)
  ports       container ports (a list of name/containerPort maps)
  port        the /metrics port (scrape annotations)
  probes      the startup/readiness/liveness probes (YAML text)
  resources   requests and limits
  extraVolumes, extraVolumeMounts, nodeSelector, tolerations, affinity,
  terminationGracePeriodSeconds: optional
Every one gets its NATS and Redis credentials and TLS files (radixserve.busCredentials).
*/}}
{{- define "radixserve.deployment" -}}
{{- $root := .root -}}
{{- $fullname := include "radixserve.fullname" $root -}}
{{- $bus := include "radixserve.busCredentials" . | fromYaml -}}
{{- $env := concat (default list .env) $bus.env -}}
{{- $extraVolumes := concat (default list .extraVolumes) $bus.volumes -}}
{{- $extraMounts := concat (default list .extraVolumeMounts) $bus.mounts -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $fullname }}-{{ .component }}
  labels:
    {{- include "radixserve.labels" . | nindent 4 }}
spec:
  {{- if not .autoscaled }}
  replicas: {{ .replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  strategy:
    {{- if .singleton }}
    type: Recreate
    {{- else }}
    type: RollingUpdate
    rollingUpdate:
      {{- toYaml (default (dict "maxSurge" 1 "maxUnavailable" 0) .rollingUpdate) | nindent 6 }}
    {{- end }}
  selector:
    matchLabels:
      {{- include "radixserve.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "radixserve.labels" . | nindent 8 }}
        {{- with $root.Values.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        {{- include "radixserve.podAnnotations" (dict "root" $root "port" .port) | nindent 8 }}
    spec:
      {{- include "radixserve.podCommon" . | nindent 6 }}
      terminationGracePeriodSeconds: {{ default $root.Values.terminationGracePeriodSeconds .terminationGracePeriodSeconds }}
      {{- include "radixserve.scheduling" . | nindent 6 }}
      containers:
        - name: {{ .component }}
          image: {{ .image | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            {{- toYaml .args | nindent 12 }}
          envFrom:
            - configMapRef:
                name: {{ $fullname }}-config
            {{- if .engine }}
            - configMapRef:
                name: {{ $fullname }}-engine
            {{- end }}
          {{- with $env }}
          env:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          ports:
            {{- range .ports }}
            - name: {{ .name }}
              containerPort: {{ .containerPort }}
              protocol: TCP
            {{- end }}
          {{- .probes | nindent 10 }}
          resources:
            {{- toYaml .resources | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            {{- include "radixserve.volumeMounts" . | nindent 12 }}
            {{- with $extraMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "radixserve.volumes" . | nindent 8 }}
        {{- with $extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end }}
