{{/*
Chart name, truncated to 63 characters (the label value limit).
*/}}
{{- define "rlrun-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the namespaced objects: "<release>-<chart>", or "<release>" when the release name
already contains the chart name; truncated to 63 characters.
*/}}
{{- define "rlrun-operator.fullname" -}}
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

{{/*
Name of the cluster-scoped objects (ClusterRole, ClusterRoleBinding): the full name prefixed with
the release namespace, so the same release name in two namespaces does not collide.
*/}}
{{- define "rlrun-operator.clusterName" -}}
{{- printf "%s-%s" .Release.Namespace (include "rlrun-operator.fullname" .) }}
{{- end }}

{{/*
"name-version" for the helm.sh/chart label.
*/}}
{{- define "rlrun-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of every object.
*/}}
{{- define "rlrun-operator.labels" -}}
helm.sh/chart: {{ include "rlrun-operator.chart" . }}
{{ include "rlrun-operator.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: rlrun
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Selector labels (stable across upgrades: never add version-dependent labels here).
*/}}
{{- define "rlrun-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rlrun-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Name of the operator's ServiceAccount.
*/}}
{{- define "rlrun-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rlrun-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
"repository:tag" of an image value ({repository, tag}); an empty tag means the chart's appVersion.
Call with (list $image $).
*/}}
{{- define "rlrun-operator.imageRef" -}}
{{- $image := index . 0 }}
{{- $root := index . 1 }}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) }}
{{- end }}

{{/*
THE RBAC rules of the operator, the only place they are written. A YAML map of three rule lists:
  namespaced     resources in the namespaces the operator watches: in the ClusterRole when it
                 watches all namespaces, else in a Role in each watched namespace
  clusterScoped  cluster-scoped reads it always needs (CRDs, nodes): always in a ClusterRole
  listedNamespaces  only needed with watchNamespaces: kopf lists and watches namespaces to follow
                 the listed ones (watching all namespaces needs no namespace reads)
templates/rbac.yaml reads it with fromYaml; tests compare the rendered rules with it and with the
API calls the operator makes. One grant is for admission, not for a call (tests/support/chart.py
ADMISSION_REQUIRED): rlruns/finalizers update.
*/}}
{{- define "rlrun-operator.rbacRules" -}}
namespaced:
  # kopf watches RLRuns, patches its progress annotations and finalizer, and writes status;
  # preemption reads a run afresh before acting on it
  - apiGroups: ["rlrun.dev"]
    resources: ["rlruns"]
    verbs: ["get", "list", "watch", "patch"]
  - apiGroups: ["rlrun.dev"]
    resources: ["rlruns/status"]
    verbs: ["patch"]
  # Never called: the OwnerReferencesPermissionEnforcement admission plugin (OpenShift and other
  # hardened clusters) lets an object set blockOwnerDeletion: true in an ownerReference only if
  # its creator may update the owner's finalizers; every object the operator creates is owned by
  # its RLRun that way, so without this grant those creates are refused there.
  - apiGroups: ["rlrun.dev"]
    resources: ["rlruns/finalizers"]
    verbs: ["update"]
  # the pods index watches pods; attempts create them, suspend and preemption delete them
  # (force-deleting those stuck terminating on a lost node); the reconciler lists a run's pods
  # afresh before it declares one missing or the old attempt gone
  - apiGroups: [""]
    resources: ["pods"]
    verbs: ["list", "watch", "create", "delete"]
  - apiGroups: [""]
    resources: ["services", "persistentvolumeclaims"]
    verbs: ["create"]
  # the resolved manifest; rewritten when the spec changes
  - apiGroups: [""]
    resources: ["configmaps"]
    verbs: ["create", "patch"]
  # the control token: created once, read back to call the orchestrator
  - apiGroups: [""]
    resources: ["secrets"]
    verbs: ["create", "get"]
  - apiGroups: [""]
    resources: ["events"]
    verbs: ["create"]
{{- if .Values.kueue.enabled }}
  # Kueue: one Workload per labelled RLRun, created, read afresh by each reconcile and watched (admission and
  # eviction wake the run); spec.active follows spec.suspend, and the pod sets a queued Workload's new spec;
  # deleted when its run's queue label is removed (the run leaves Kueue)
  - apiGroups: ["kueue.x-k8s.io"]
    resources: ["workloads"]
    verbs: ["get", "list", "watch", "create", "patch", "delete"]
  # the job side of Kueue's contract: the quota released once an evicted run's pods are gone, PodsReady, Finished
  - apiGroups: ["kueue.x-k8s.io"]
    resources: ["workloads/status"]
    verbs: ["patch"]
{{- end }}
clusterScoped:
  # kopf follows CRDs to learn the RLRun resource
  - apiGroups: ["apiextensions.k8s.io"]
    resources: ["customresourcedefinitions"]
    verbs: ["list", "watch"]
  # at start, the RLRun CRD's schema hash: is the installed CRD this operator's (Helm never upgrades crds/)?
  - apiGroups: ["apiextensions.k8s.io"]
    resources: ["customresourcedefinitions"]
    resourceNames: ["rlruns.rlrun.dev"]
    verbs: ["get"]
  # the nodes index: taints and readiness of the nodes a run's pods are on (preemption). Nodes are
  # cluster-scoped: kopf watches them cluster-wide even when it watches listed namespaces
  - apiGroups: [""]
    resources: ["nodes"]
    verbs: ["list", "watch"]
{{- if .Values.kueue.enabled }}
  # Kueue: the admitted ResourceFlavors' node labels and tolerations (the pods' placement), and the priority of a
  # run labelled kueue.x-k8s.io/priority-class
  - apiGroups: ["kueue.x-k8s.io"]
    resources: ["resourceflavors", "workloadpriorityclasses"]
    verbs: ["get"]
{{- end }}
listedNamespaces:
  - apiGroups: [""]
    resources: ["namespaces"]
    verbs: ["list", "watch"]
{{- end }}

{{/*
interval / scrapeTimeout of a PodMonitor endpoint, each only when set (empty: the Prometheus' own).
Call with .Values.monitoring.podMonitor.
*/}}
{{- define "rlrun-operator.scrapeTiming" -}}
{{- with .interval }}
interval: {{ . | quote }}
{{- end }}
{{- with .scrapeTimeout }}
scrapeTimeout: {{ . | quote }}
{{- end }}
{{- end }}

{{/*
Relabelings of a run pod's target: its RLRun (app.kubernetes.io/instance), component and attempt as the
labels run, component and attempt, which the dashboard's queries group by.
*/}}
{{- define "rlrun-operator.runRelabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_instance]
  targetLabel: run
- sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_component]
  targetLabel: component
- sourceLabels: [__meta_kubernetes_pod_label_rlrun_dev_attempt]
  targetLabel: attempt
{{- end }}
