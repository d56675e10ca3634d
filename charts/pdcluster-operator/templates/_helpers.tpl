{{- define "pdcluster.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdcluster.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdcluster
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pdcluster.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdcluster.serviceAccountName" -}}
{{- default (include "pdcluster.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- /* An image of values.images: repository:tag, the tag defaulting to the chart's appVersion. */ -}}
{{- define "pdcluster.image" -}}
{{- $image := index . 0 -}}
{{- printf "%s:%s" $image.repository ($image.tag | default (index . 1).Chart.AppVersion) -}}
{{- end -}}
