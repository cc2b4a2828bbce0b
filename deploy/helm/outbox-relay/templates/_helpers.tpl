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
{{- /* The relay trims the token and refuses a blank or short one at start. */}}
{{- if and .Values.console.enabled (lt (len (trim .Values.secret.consoleToken)) 16) }}
{{- fail "console.enabled: set secret.consoleToken to at least 16 bytes once surrounding whitespace is trimmed (e.g. openssl rand -hex 32), or use secret.existingSecret with a console-token key" }}
{{- end }}
{{- if and .Values.migrate.enabled (eq .Values.migrate.databaseURLKey "migrate-database-url") (not .Values.secret.migrateDatabaseURL) }}
{{- fail "migrate.enabled: set secret.migrateDatabaseURL to the table owner's PostgreSQL URL (migrate runs only as the table's owner; the relay's least-privilege role cannot), or migrate.databaseURLKey: database-url if the relay's role owns the table, or migrate.enabled: false to run outbox-relay migrate yourself" }}
{{- end }}
{{- if and .Values.secret.natsCredsFile (not .Values.secret.natsCreds) }}
{{- fail "secret.natsCredsFile: set secret.natsCreds to the credentials file's content" }}
{{- end }}
{{- end }}
{{- /* What the chart sets itself: an extraEnv or env entry of the same name
would shadow it (for the Secret's, with a plain value in the Deployment). */}}
{{- $own := dict "DATABASE_URL" "secret.databaseURL (the Secret's database-url key)" "NATS_USER" "secret.natsUser" "NATS_PASSWORD" "secret.natsPassword" "NATS_TOKEN" "secret.natsToken" "NATS_CREDS" "secret.natsCreds with secret.natsCredsFile" "CONSOLE_TOKEN" "secret.consoleToken (the Secret's console-token key)" "NATS_URL" "relay.natsURL" "TABLE" "relay.table" "SLOT" "relay.slot" "PUBLICATION" "relay.publication" "STREAM" "relay.stream" "SUBJECT_PREFIX" "relay.subjectPrefix" "ON_PUBLISH" "relay.onPublish" "ORDERING" "relay.ordering" "MESSAGE_FORMAT" "relay.messageFormat" "CLOUDEVENTS_SOURCE" "relay.cloudeventsSource" "LOG_FORMAT" "relay.logFormat" "LOG_LEVEL" "relay.logLevel" "HTTP_ADDR" "relay.httpPort" "DRAIN_TIMEOUT" "relay.drainTimeout" "CONSOLE" "console.enabled" "CONSOLE_READ_ONLY" "console.readOnly" }}
{{- range $k, $v := .Values.relay.extraEnv }}
{{- $flag := upper $k | replace "-" "_" | trimPrefix "OUTBOX_RELAY_" }}
{{- if hasKey $own $flag }}
{{- fail (printf "relay.extraEnv.%s: the chart sets OUTBOX_RELAY_%s itself; set %s instead (an extraEnv entry would shadow it in plain text)" $k $flag (get $own $flag)) }}
{{- end }}
{{- end }}
{{- range .Values.env }}
{{- $flag := upper (toString .name) | trimPrefix "OUTBOX_RELAY_" }}
{{- if and (hasPrefix "OUTBOX_RELAY_" (upper (toString .name))) (hasKey $own $flag) }}
{{- fail (printf "env %s: the chart sets it itself; set %s instead (an env entry would shadow it)" .name (get $own $flag)) }}
{{- end }}
{{- end }}
{{- if not (has .Values.relay.onPublish (list "mark" "delete" "none")) }}
{{- fail (printf "relay.onPublish %q: must be mark, delete or none" .Values.relay.onPublish) }}
{{- end }}
{{- if not (has .Values.relay.ordering (list "none" "aggregate")) }}
{{- fail (printf "relay.ordering %q: must be none or aggregate" .Values.relay.ordering) }}
{{- end }}
{{- if not (has .Values.relay.messageFormat (list "outbox" "cloudevents" "cloudevents-structured")) }}
{{- fail (printf "relay.messageFormat %q: must be outbox, cloudevents or cloudevents-structured" .Values.relay.messageFormat) }}
{{- end }}
{{- end }}
