{{- define "epp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "epp.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "epp.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "epp.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "epp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "epp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "epp.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "epp.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The InferencePool epp watches: by default the one this chart creates. */}}
{{- define "epp.poolName" -}}
{{- default (include "epp.fullname" .) .Values.discovery.pool.name -}}
{{- end -}}

{{- define "epp.poolNamespace" -}}
{{- default .Release.Namespace .Values.discovery.pool.namespace -}}
{{- end -}}

{{/* "true" when index sync runs: sync.enabled, or by default when there are peers. */}}
{{- define "epp.syncEnabled" -}}
{{- if kindIs "bool" .Values.sync.enabled -}}
{{- .Values.sync.enabled -}}
{{- else -}}
{{- gt (int .Values.replicaCount) 1 -}}
{{- end -}}
{{- end -}}

{{/* The headless Service through which epp replicas find each other. */}}
{{- define "epp.peersServiceName" -}}
{{- printf "%s-peers" (include "epp.fullname" . | trunc 57 | trimSuffix "-") -}}
{{- end -}}

{{- define "epp.validate" -}}
{{- if not (has .Values.discovery.mode (list "pool" "static")) -}}
{{- fail (printf "discovery.mode must be pool or static, not %q" .Values.discovery.mode) -}}
{{- end -}}
{{- if and (eq .Values.discovery.mode "static") (not .Values.discovery.static.endpoints) -}}
{{- fail "discovery.static.endpoints must list at least one ip:port in static mode" -}}
{{- end -}}
{{- if not (or (kindIs "bool" .Values.sync.enabled) (kindIs "invalid" .Values.sync.enabled)) -}}
{{- fail (printf "sync.enabled must be true, false or unset, not %v" .Values.sync.enabled) -}}
{{- end -}}
{{- if and .Values.inferencePool.create (not .Values.inferencePool.modelServers.matchLabels) -}}
{{- fail "inferencePool.modelServers.matchLabels must not be empty" -}}
{{- end -}}
{{- end -}}

{{/*
The scheduling config: scheduling.config as written, plus the precise prefix producer when
precisePrefix.enabled.
*/}}
{{- define "epp.schedulingConfig" -}}
{{- if .Values.precisePrefix.enabled -}}
{{- $cfg := fromYaml .Values.scheduling.config -}}
{{- $p := .Values.precisePrefix -}}
{{- $params := dict "blockSize" (int $p.blockSize) "hashAlgo" $p.hashAlgo "eventsMode" "connect" "eventsPort" (int $p.eventsPort) "replayPort" (int $p.replayPort) "speculativeTtlSeconds" $p.speculativeTtlSeconds "tokenizerDir" "/etc/epp/tokenizers" "loraPaths" $p.loraPaths -}}
{{- $plugin := dict "type" "precise-prefix-cache-producer" "parameters" $params -}}
{{- $_ := set $cfg "plugins" (append (get $cfg "plugins") $plugin) -}}
{{- toYaml $cfg -}}
{{- else -}}
{{- .Values.scheduling.config -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the ext_proc port's certificate ("" = plaintext). */}}
{{- define "epp.extProcTlsSecret" -}}
{{- if .Values.extProc.tls.enabled -}}
{{- .Values.extProc.tls.secretName | default (printf "%s-extproc-tls" (include "epp.fullname" . | trunc 50 | trimSuffix "-")) -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the sync port's certificate ("" = plaintext). */}}
{{- define "epp.syncTlsSecret" -}}
{{- if .Values.sync.tls.secretName -}}
{{- .Values.sync.tls.secretName -}}
{{- else if .Values.sync.tls.generate -}}
{{- printf "%s-sync-tls" (include "epp.fullname" . | trunc 54 | trimSuffix "-") -}}
{{- end -}}
{{- end -}}

{{/* The model router's objects (modelRouter.enabled): their own name, so that the epp
Service and NetworkPolicy, which select epp's pods by name, never select the router's. */}}
{{- define "epp.routerName" -}}
{{- printf "%s-model-router" (include "epp.fullname" . | trunc 50 | trimSuffix "-") -}}
{{- end -}}

{{- define "epp.routerSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-model-router" (include "epp.name" . | trunc 50 | trimSuffix "-") }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "epp.routerLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "epp.routerSelectorLabels" . }}
app.kubernetes.io/component: model-router
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The model router's --pools file: modelRouter.pools and modelRouter.adapters. */}}
{{- define "epp.routerPools" -}}
{{- $r := .Values.modelRouter -}}
{{- if not $r.pools -}}
{{- fail "modelRouter.pools must list the pools (name, models, servers) when modelRouter.enabled" -}}
{{- end -}}
{{- $out := dict "pools" $r.pools -}}
{{- if $r.adapters -}}
{{- $_ := set $out "adapters" $r.adapters -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}
