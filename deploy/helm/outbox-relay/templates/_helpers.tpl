{{/* The release's object names: the release name, with the chart's when it lacks it. */}}
{{- define "outbox-relay.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object; call with (dict "root" $ "component" "relay"). */}}
{{- define "outbox-relay.labels" -}}
{{ include "outbox-relay.selector" . }}
app.kubernetes.io/part-of: outbox-relay
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "outbox-relay.selector" -}}
app.kubernetes.io/name: outbox-relay
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "outbox-relay.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The pod's user and group own the mounted Secrets' files, which only they may read. */}}
{{- define "outbox-relay.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "outbox-relay.containerSecurityContext" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* A Secret as read-only files; call with (dict "name" volume "secret" secretName). */}}
{{- define "outbox-relay.secretVolume" -}}
- name: {{ .name }}
  secret:
    secretName: {{ .secret }}
    defaultMode: 288 # 0440
{{- end -}}

{{/* The relays' settings, rendered as their TOML file. */}}
{{- define "outbox-relay.settings" -}}
{{- $v := .Values -}}
{{- $s := deepCopy $v.config -}}
{{- $_ := set $s "database_schema" $v.databaseSchema -}}
{{- $_ = set $s "bootstrap_servers" $v.kafka.bootstrapServers -}}
{{- $_ = set $s "metrics_host" "0.0.0.0" -}}
{{- $_ = set $s "metrics_port" (int $v.metricsPort) -}}
{{- $_ = set $s "probe_port" (int $v.probePort) -}}
{{- $_ = set $s "subscribers" $v.subscribers -}}
{{- $kafka := deepCopy $v.kafka.properties -}}
{{- $tls := $v.kafka.tls.enabled -}}
{{- $sasl := $v.kafka.sasl.mechanism -}}
{{- if or $tls $sasl -}}
{{- $_ = set $kafka "security.protocol" (printf "%s%s" (ternary "SASL_" "" (ne $sasl "")) (ternary "SSL" "PLAINTEXT" $tls)) -}}
{{- end -}}
{{- if $v.kafka.tls.caSecret -}}
{{- $_ = set $kafka "ssl.ca.location" "/run/secrets/kafka-ca/ca.crt" -}}
{{- end -}}
{{- if $sasl -}}
{{- $_ = set $kafka "sasl.mechanism" $sasl -}}
{{- $_ = set $kafka "sasl.username" $v.kafka.sasl.username -}}
{{- end -}}
{{- $_ = set $s "kafka" $kafka -}}
{{- with $v.schemaRegistry -}}
{{- if .url -}}
{{- $_ = set $s "schema_registry_url" .url -}}
{{- end -}}
{{- if .user -}}
{{- $_ = set $s "schema_registry_user" .user -}}
{{- end -}}
{{- if .caSecret -}}
{{- $_ = set $s "schema_registry_ca" "/run/secrets/schema-registry-ca/ca.crt" -}}
{{- end -}}
{{- end -}}
{{- if $v.schemas.configMap -}}
{{- $_ = set $s "schemas_dir" "/app/schemas" -}}
{{- end -}}
{{- with $v.tracing -}}
{{- $_ = set $s "tracing" .enabled -}}
{{- if .enabled -}}
{{- if .endpoint -}}
{{- $_ = set $s "tracing_endpoint" .endpoint -}}
{{- end -}}
{{- $_ = set $s "tracing_sample_ratio" .sampleRatio -}}
{{- $_ = set $s "tracing_spans" .spans -}}
{{- end -}}
{{- end -}}
{{- toToml $s -}}
{{- end -}}
