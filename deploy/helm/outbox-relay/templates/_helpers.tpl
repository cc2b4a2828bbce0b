{{- define "outbox-relay.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "outbox-relay.fullname" -}}
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

{{- define "outbox-relay.selectorLabels" -}}
app.kubernetes.io/name: {{ include "outbox-relay.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "outbox-relay.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "outbox-relay.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "outbox-relay.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "outbox-relay.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "outbox-relay.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "outbox-relay.secretName" -}}
{{- default (include "outbox-relay.fullname" .) .Values.secret.existingSecret }}
{{- end }}

{{/*
The settings every command of one table shares, as OUTBOX_RELAY_* variables.
*/}}
{{- define "outbox-relay.commonEnv" -}}
- name: OUTBOX_RELAY_TABLE
  value: {{ .Values.relay.table | quote }}
- name: OUTBOX_RELAY_PUBLICATION
  value: {{ .Values.relay.publication | quote }}
- name: OUTBOX_RELAY_ON_PUBLISH
  value: {{ .Values.relay.onPublish | quote }}
- name: OUTBOX_RELAY_LOG_FORMAT
  value: {{ .Values.relay.logFormat | quote }}
- name: OUTBOX_RELAY_LOG_LEVEL
  value: {{ .Values.relay.logLevel | quote }}
{{- end }}

{{- define "outbox-relay.secretEnv" -}}
- name: {{ .env }}
  valueFrom:
    secretKeyRef:
      name: {{ include "outbox-relay.secretName" .root }}
      key: {{ .key }}
      {{- if .optional }}
      optional: true
      {{- end }}
{{- end }}

{{- define "outbox-relay.podSecurity" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
serviceAccountName: {{ include "outbox-relay.serviceAccountName" . }}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/*
Refuse values that would start a relay that cannot work, at render time
rather than in a crash loop.
*/}}
{{- define "outbox-relay.validate" -}}
{{- if not .Values.secret.existingSecret }}
{{- if not .Values.secret.databaseURL }}
{{- fail "set secret.databaseURL (the relay role's PostgreSQL URL) or secret.existingSecret (a Secret with a database-url key)" }}
{{- end }}
{{- if and .Values.console.enabled (lt (len .Values.secret.consoleToken) 16) }}
{{- fail "console.enabled: set secret.consoleToken to at least 16 bytes (e.g. openssl rand -hex 32), or use secret.existingSecret with a console-token key" }}
{{- end }}
{{- if and .Values.secret.natsCredsFile (not .Values.secret.natsCreds) }}
{{- fail "secret.natsCredsFile: set secret.natsCreds to the credentials file's content" }}
{{- end }}
{{- end }}
{{- if not (has .Values.relay.onPublish (list "mark" "delete" "none")) }}
{{- fail (printf "relay.onPublish %q: must be mark, delete or none" .Values.relay.onPublish) }}
{{- end }}
{{- if not (has .Values.relay.ordering (list "none" "aggregate")) }}
{{- fail (printf "relay.ordering %q: must be none or aggregate" .Values.relay.ordering) }}
{{- end }}
{{- end }}
