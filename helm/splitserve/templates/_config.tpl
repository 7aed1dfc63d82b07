{{/*
The component configs: the JSON of runtime/config.py's dataclasses that each component reads with
`--config` (runtime/config_file.py). Values' `config` blocks are copied key by key (never merged
with sprig's merge, which drops false and 0), then the chart's own fields are set over them: bind
host, ports, model path, role and Redis namespace tie the pods and Services together. The Redis URL
and the secrets are not here: they come by environment (SPLITSERVE_REDIS_URL, SPLITSERVE_API_KEY,
SPLITSERVE_ADMIN_TOKEN).
*/}}

{{- define "splitserve.frontendConfig" -}}
{{- $c := dict }}
{{- range $k, $v := .Values.frontend.config }}{{ $_ := set $c $k $v }}{{ end }}
{{- if and .Values.planner.enabled (eq (toString $c.itl_target_ms) "<nil>") }}
{{- $_ := set $c "itl_target_ms" .Values.planner.config.itl_ms }}
{{- end }}
{{- if and .Values.planner.enabled (eq (toString $c.ttft_target_ms) "<nil>") }}
{{- $_ := set $c "ttft_target_ms" .Values.planner.config.ttft_ms }}
{{- end }}
{{- $_ := set $c "itl_budget_share" (divf 1 (max 1 (int .Values.frontend.replicas))) }}
{{- $_ := set $c "model" (include "splitserve.modelDir" .) }}
{{- $_ := set $c "host" "0.0.0.0" }}
{{- $_ := set $c "http_port" .Values.frontend.httpPort }}
{{- $_ := set $c "grpc_port" .Values.frontend.grpcPort }}
{{- $_ := set $c "redis" (deepCopy .Values.redis.config) }}
{{- toPrettyJson $c }}
{{- end }}

{{/* (dict "root" $ "pool" "prefill"|"decode") */}}
{{- define "splitserve.workerConfig" -}}
{{- $root := .root }}
{{- $pool := index $root.Values .pool }}
{{- $engine := dict }}
{{- range $k, $v := $root.Values.engine }}{{ $_ := set $engine $k $v }}{{ end }}
{{- range $k, $v := ($pool.config.engine | default dict) }}{{ $_ := set $engine $k $v }}{{ end }}
{{- $_ := set $engine "model" (include "splitserve.modelDir" $root) }}
{{- /* a worker spans its pool's GPUs: the model split over them (1 on the CPU) */}}
{{- $_ := set $engine "tensor_parallel_size" (max 1 (int $pool.gpus)) }}
{{- $c := dict }}
{{- range $k, $v := $pool.config }}{{ if ne $k "engine" }}{{ $_ := set $c $k $v }}{{ end }}{{ end }}
{{- $_ := set $c "engine" $engine }}
{{- $_ := set $c "redis" (deepCopy $root.Values.redis.config) }}
{{- if eq .pool "decode" }}
{{- $_ := set $c "role" (ternary "decode" "aggregated" $root.Values.prefill.enabled) }}
{{- else if and $root.Values.planner.enabled (eq (toString $c.prefill_deadline_ms) "<nil>") (eq (toString $root.Values.planner.config.prefill_order) "deadline") }}
{{- /* the queue order the planner sizes prefill workers for: deadline order by its TTFT target */}}
{{- $_ := set $c "prefill_deadline_ms" $root.Values.planner.config.ttft_ms }}
{{- end }}
{{- $_ := set $c "host" "0.0.0.0" }}
{{- $_ := set $c "port" $root.Values.workers.grpcPort }}
{{- $_ := set $c "metrics_port" $root.Values.workers.metricsPort }}
{{- toPrettyJson $c }}
{{- end }}

{{/*
The pool controller's config (`splitserve controller`, runtime/config.py ControllerComponentConfig).
Its `kubernetes` block names the two Deployments the Role lets it scale (templates/planner.yaml),
so the connector and the RBAC rules cannot disagree. Its metrics port is picked at start; the
frontends merge its /metrics (it publishes the URL in Redis).
*/}}
{{- define "splitserve.controllerConfig" -}}
{{- $c := dict }}
{{- $ctl := dict }}
{{- range $k, $v := (.Values.planner.config.controller | default dict) }}{{ $_ := set $ctl $k $v }}{{ end }}
{{- $_ := set $ctl "admin_host" "0.0.0.0" }}
{{- $_ := set $ctl "admin_port" .Values.planner.adminPort }}
{{- if not .Values.prefill.enabled }}
{{- $_ := set $ctl "min_prefill_workers" 0 }}
{{- $_ := set $ctl "max_prefill_workers" 0 }}
{{- end }}
{{- $_ := set $c "controller" $ctl }}
{{- $_ := set $c "redis" (deepCopy .Values.redis.config) }}
{{- $_ := set $c "metrics_port" 0 }}
{{- $k8s := dict "namespace" .Release.Namespace "decode_deployment" (include "splitserve.component" (dict "root" . "component" "decode")) }}
{{- if .Values.prefill.enabled }}
{{- $_ := set $k8s "prefill_deployment" (include "splitserve.component" (dict "root" . "component" "prefill")) }}
{{- end }}
{{- $_ := set $c "kubernetes" $k8s }}
{{- toPrettyJson $c }}
{{- end }}

{{/*
The SLA planner's config: its settings (planner.config but the controller's limits); it drives the
controller's admin API in the same pod.
*/}}
{{- define "splitserve.plannerConfig" -}}
{{- $c := dict }}
{{- range $k, $v := .Values.planner.config }}{{ if ne $k "controller" }}{{ $_ := set $c $k $v }}{{ end }}{{ end }}
{{- $_ := set $c "redis" (deepCopy .Values.redis.config) }}
{{- $_ := set $c "metrics_host" "0.0.0.0" }}
{{- $_ := set $c "metrics_port" .Values.planner.metricsPort }}
{{- $_ := set $c "admin_address" (printf "127.0.0.1:%v" .Values.planner.adminPort) }}
{{- toPrettyJson $c }}
{{- end }}
