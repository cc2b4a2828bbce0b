// Package helmcheck holds only tests. They lint and render the Helm chart in
// deploy/helm/outbox-relay with the Helm that proof/go.mod pins as a tool
// (`go tool helm`, built from the Go module proxy: no cluster and no Helm
// install needed) and check what the rendered objects contain: two
// instances on one slot, probes that never restart the waiting one, a
// PodDisruptionBudget, credentials only from a Secret (never shadowed by
// extraEnv or env), the migrate hook on the table owner's URL, the console
// only behind its token (measured trimmed, as the relay does) and a
// NetworkPolicy, and the ServiceMonitor and alert rules only when asked.
package helmcheck
