package chaos

import (
	"slices"
	"strings"
	"testing"
)

func TestClusterFaultsNeedACluster(t *testing.T) {
	if err := ValidateFaults([]string{FaultNATSNodeKill}); err != nil {
		t.Fatalf("%s is a known fault: %v", FaultNATSNodeKill, err)
	}
	if err := validateCluster(0, []string{FaultRelayKill, FaultNATSNodeKill}); err == nil {
		t.Error("nats-node-kill without -cluster was accepted")
	}
	if err := validateCluster(3, []string{FaultNATSNodeKill}); err != nil {
		t.Error(err)
	}
	if err := validateCluster(7, nil); err == nil {
		t.Error("-cluster 7 was accepted (JetStream allows at most 5 replicas)")
	}
	// The single-server run keeps its kinds and so its schedule for a seed.
	if slices.Contains(AllFaults, FaultNATSNodeKill) || !slices.Contains(ClusterFaults, FaultNATSNodeKill) {
		t.Errorf("AllFaults %v, ClusterFaults %v", AllFaults, ClusterFaults)
	}
	c := Config{Cluster: 3}
	c.defaults()
	if !slices.Equal(c.Faults, ClusterFaults) {
		t.Errorf("cluster run defaults to %v", c.Faults)
	}
	c = Config{}
	c.defaults()
	if !slices.Equal(c.Faults, AllFaults) {
		t.Errorf("single-server run defaults to %v", c.Faults)
	}
}

func TestReportClusterRows(t *testing.T) {
	r := &Report{Seed: 1, Figures: Figures{G3Checks: 1}, ClusterNodes: 3, StreamReplicas: 3,
		Faults: map[string]int{FaultNATSNodeKill: 3}, FaultsBit: map[string]int{FaultNATSNodeKill: 3}, FaultsEnabled: []string{FaultNATSNodeKill},
		LeaderChanges: []LeaderChange{
			{Killed: "n0", WasLeader: true, Before: "n0", During: "n1", After: "n1", ElectSeconds: 4.5, CatchUpSeconds: 1},
			{Killed: "n2", Before: "n1", During: "n1", After: "n1", CatchUpSeconds: 0.5},
			{Killed: "n1", WasLeader: true, Before: "n1", After: "", ElectSeconds: -1, CatchUpSeconds: -1},
		}}
	tab := r.Table()
	for _, want := range []string{
		"3 nodes, stream R3",
		"| 3 (2)",
		"2 of 3",
		"n0->n1 x1, n1->- x1, n1->n1 x1",
		"n=1 min 4.50 med 4.50 max 4.50",
		"1 without a new leader within 1 min",
		"1 not current within 1 min",
		"RESULT: ok",
	} {
		if !strings.Contains(tab, want) {
			t.Errorf("table lacks %q:\n%s", want, tab)
		}
	}
	if strings.Contains((&Report{Seed: 1}).Table(), "nats cluster") {
		t.Error("a single-server report shows cluster rows")
	}
}
