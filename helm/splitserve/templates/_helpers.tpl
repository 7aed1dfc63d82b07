{{/*
Names, labels, images, security contexts and the pieces every pod shares.
*/}}

{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A component's object name: fullname-COMPONENT (fullname is cut at 50 so this stays under 63). */}}
{{- define "splitserve.component" -}}
{{- printf "%s-%s" (include "splitserve.fullname" .root) .component }}
{{- end }}

{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "splitserve.labels" -}}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: splitserve
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end }}

{{/* image: repository:tag, or repository@digest when a digest is given. */}}
{{- define "splitserve.image" -}}
{{- if .digest }}{{ printf "%s@%s" .repository .digest }}{{ else }}{{ printf "%s:%s" .repository .tag }}{{ end }}
{{- end }}

{{- define "splitserve.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "splitserve.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop: ["ALL"]
{{- end }}

{{- define "splitserve.authSecret" -}}
{{- .Values.auth.existingSecret | default (include "splitserve.component" (dict "root" . "component" "auth")) }}
{{- end }}

{{/* SPLITSERVE_REDIS_URL: the bundled Service, an external URL, or a Secret's key (a URL with a password). */}}
{{- define "splitserve.redisEnv" -}}
- name: SPLITSERVE_REDIS_URL
{{- if eq .Values.redis.mode "bundled" }}
  value: {{ printf "redis://%s:6379/0" (include "splitserve.component" (dict "root" . "component" "redis")) | quote }}
{{- else if .Values.redis.external.existingSecret }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.urlKey }}
{{- else }}
  value: {{ required "redis.external.url or redis.external.existingSecret is required with redis.mode=external" .Values.redis.external.url | quote }}
{{- end }}
{{- end }}

{{/* SPLITSERVE_CLUSTER_TOKEN: what every call to a worker carries and every worker requires. */}}
{{- define "splitserve.clusterTokenEnv" -}}
- name: SPLITSERVE_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "splitserve.authSecret" . }}
      key: {{ .Values.auth.clusterTokenKey }}
{{- end }}

{{/* Writable paths under a read-only root: caches (SPLITSERVE_CACHE, JIT caches under HOME) and /tmp. */}}
{{- define "splitserve.cacheEnv" -}}
- name: HOME
  value: /cache
- name: XDG_CACHE_HOME
  value: /cache
- name: SPLITSERVE_CACHE
  value: /cache/splitserve
- name: TMPDIR
  value: /tmp
{{- end }}

{{/* Where the model directory is mounted, and its path there. */}}
{{- define "splitserve.modelDir" -}}
{{- if eq .Values.model.source "tiny" }}/models/tiny{{ else }}{{ printf "/models/%s" (.Values.model.path | trimPrefix "/") | trimSuffix "/" }}{{ end }}
{{- end }}

{{- define "splitserve.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "tiny" }}
  emptyDir:
    sizeLimit: 256Mi
{{- else if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source=pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else }}
  hostPath:
    path: {{ required "model.hostPath.path is required with model.source=hostPath" .Values.model.hostPath.path }}
    type: Directory
{{- end }}
{{- end }}

{{- define "splitserve.modelMount" -}}
- name: model
  mountPath: /models
  readOnly: true
{{- end }}

{{/*
The tiny model is written at pod start into the pod's model volume: by the worker image in worker
pods (weights need torch), and without its weights by the control-plane image in frontend pods
(a frontend reads the config, tokenizer and chat template only: no multi-GB CUDA image to pull).
Both images run the same Python, so frontends and workers hold byte-identical tokenizers.
(dict "root" $ "weights" true|false)
*/}}
{{- define "splitserve.tinyModelInit" -}}
{{- $root := .root }}
{{- if eq $root.Values.model.source "tiny" }}
- name: tiny-model
  image: {{ include "splitserve.image" (ternary $root.Values.images.worker $root.Values.images.controlPlane .weights) }}
  imagePullPolicy: {{ $root.Values.images.pullPolicy }}
  command: ["splitserve", "model", "tiny", "--out", "/models/tiny", "--arch", {{ $root.Values.model.tiny.arch | quote }}, "--seed", {{ $root.Values.model.tiny.seed | quote }}{{ if not .weights }}, "--no-weights"{{ end }}]
  env:
    {{- include "splitserve.cacheEnv" $root | nindent 4 }}
  securityContext:
    {{- include "splitserve.containerSecurityContext" $root | nindent 4 }}
  resources:
    requests: {cpu: 500m, memory: 1Gi}
    limits: {memory: 2Gi}
  volumeMounts:
    - name: model
      mountPath: /models
    - name: cache
      mountPath: /cache
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* The pod-level pieces every Splitserve pod shares. */}}
{{- define "splitserve.podCommon" -}}
securityContext:
  {{- include "splitserve.podSecurityContext" . | nindent 2 }}
{{- with .Values.images.pullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Pod identity from the downward API: the advertised address and the worker's name in discovery. */}}
{{- define "splitserve.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- end }}
