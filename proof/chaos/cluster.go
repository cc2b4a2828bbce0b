package chaos

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// FaultNATSNodeKill is SIGKILL of one node of the JetStream cluster (-cluster
// n): half the time the stream's leader, otherwise one of the other nodes;
// the node is started again after a hold. In cluster mode nats-kill also
// kills one node, chosen uniformly, since killing every node at once is the
// single-server fault again.
const FaultNATSNodeKill = "nats-node-kill"

// ClusterFaults are the kinds a cluster run uses when -faults is not given.
var ClusterFaults = append(append([]string(nil), AllFaults...), FaultNATSNodeKill)

// proxyGroup is one relay instance's proxies to NATS: one per node, so a
// cut, a latency or a partition applies to the relay's path to the whole
// cluster, whichever node it is connected to.
type proxyGroup []*Proxy

func (g proxyGroup) Set(mode Mode, delay time.Duration) {
	for _, p := range g {
		p.Set(mode, delay)
	}
}

// Arm arms every proxy of the group (Proxy.Arm).
func (g proxyGroup) Arm(trigger string, delay time.Duration) {
	for _, p := range g {
		p.Arm(trigger, delay)
	}
}

// Fired is the earliest time a proxy of the group saw its trigger.
func (g proxyGroup) Fired() time.Time {
	var t time.Time
	for _, p := range g {
		if f := p.Fired(); !f.IsZero() && (t.IsZero() || f.Before(t)) {
			t = f
		}
	}
	return t
}

// Conns is the number of open connections through the group's proxies.
func (g proxyGroup) Conns() int {
	n := 0
	for _, p := range g {
		n += p.Conns()
	}
	return n
}

// Delayed is the number of chunks the group's proxies held back.
func (g proxyGroup) Delayed() uint64 {
	var n uint64
	for _, p := range g {
		n += p.Delayed()
	}
	return n
}

func (g proxyGroup) Close() error {
	var errs []error
	for _, p := range g {
		errs = append(errs, p.Close())
	}
	return errors.Join(errs...)
}

// LeaderChange is one kill of a cluster node and what the stream's leader
// did about it.
type LeaderChange struct {
	Fault     string `json:"fault"`
	Killed    string `json:"killed"`     // server_name of the killed node
	WasLeader bool   `json:"was_leader"` // the killed node led the stream
	Before    string `json:"leader_before"`
	During    string `json:"leader_while_down,omitempty"`
	After     string `json:"leader_after"` // once the node is back and current
	// ElectSeconds is from the kill of the leader until another node leads
	// the stream (0 when a follower was killed).
	ElectSeconds float64 `json:"elect_seconds,omitempty"`
	// CatchUpSeconds is from the restart until every replica is current
	// again; -1 when that did not happen within a minute.
	CatchUpSeconds float64 `json:"catch_up_seconds"`
}

// natsNodes are the servers the relay publishes to: the one nats-server,
// or every node of the cluster.
func (r *runner) natsNodes() []*testenv.NATS {
	if r.cl != nil {
		nodes := make([]*testenv.NATS, r.cl.Len())
		for i := range nodes {
			nodes[i] = r.cl.Node(i)
		}
		return nodes
	}
	if r.ns != nil {
		return []*testenv.NATS{r.ns}
	}
	return nil
}

// natsURLs is the checker's own way to the servers, not through a proxy.
func (r *runner) natsURLs() string {
	if r.cl != nil {
		return r.cl.URLs()
	}
	return r.ns.URL()
}

// streamCluster is the stream's leader and replicas as the cluster reports
// them now; an error when it cannot tell within timeout (a stream without a
// leader does not answer at all).
func (r *runner) streamCluster(ctx context.Context, timeout time.Duration) (*jetstream.ClusterInfo, error) {
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	s, err := r.js.Stream(cctx, streamName)
	if err != nil {
		return nil, err
	}
	info, err := s.Info(cctx)
	if err != nil {
		return nil, err
	}
	if info.Cluster == nil {
		return nil, errors.New("stream info without cluster")
	}
	r.mu.Lock()
	r.report.StreamReplicas = info.Config.Replicas
	r.mu.Unlock()
	return info.Cluster, nil
}

// streamLeader is the stream's leader, "" when there is none or it cannot
// be told within timeout.
func (r *runner) streamLeader(ctx context.Context, timeout time.Duration) string {
	ci, err := r.streamCluster(ctx, timeout)
	if err != nil {
		return ""
	}
	return ci.Leader
}

// watchLeader samples the stream's leader four times a second and records
// every change it sees, whatever its cause.
func (r *runner) watchLeader(ctx context.Context) {
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	last := ""
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		l := r.streamLeader(ctx, time.Second)
		if l == "" || l == last {
			continue
		}
		if last != "" {
			r.mu.Lock()
			r.report.LeaderTransitions++
			r.mu.Unlock()
			r.logf("stream leader %s -> %s", last, l)
		}
		last = l
	}
}

// nodeKill kills one node of the cluster, waits for a new stream leader
// when it was the leader, starts it again after hold and waits until every
// replica is current, so that the next fault starts from a whole cluster.
func (r *runner) nodeKill(ctx context.Context, kind, label string, hold time.Duration) error {
	before := r.streamLeader(ctx, 2*time.Second)
	var idx int
	switch {
	case kind == FaultNATSNodeKill && before != "" && r.rng.IntN(2) == 0:
		_, idx = r.cl.NodeByName(before)
	case kind == FaultNATSNodeKill && before != "":
		// One of the followers.
		_, li := r.cl.NodeByName(before)
		idx = r.rng.IntN(r.cl.Len() - 1)
		if li >= 0 && idx >= li {
			idx++
		}
	default:
		idx = r.rng.IntN(r.cl.Len())
	}
	if idx < 0 {
		idx = r.rng.IntN(r.cl.Len())
	}
	node := r.cl.Node(idx)
	lc := LeaderChange{Fault: label, Killed: node.ServerName(), Before: before, WasLeader: node.ServerName() == before}
	if err := node.Kill(); err != nil {
		return err
	}
	t0 := time.Now()
	r.count(kind)
	// Kill returned: a running node died.
	r.bit(kind)
	r.logf("fault %s: SIGKILL nats node %s (stream leader %q) for %v", label, node.ServerName(), before, hold)
	if lc.WasLeader {
		// A short timeout: while there is no leader the request goes
		// unanswered, and the election time is measured to about 0.25s.
		for time.Since(t0) < time.Minute && ctx.Err() == nil {
			if l := r.streamLeader(ctx, 250*time.Millisecond); l != "" && l != lc.Killed {
				lc.During = l
				lc.ElectSeconds = time.Since(t0).Seconds()
				break
			}
			time.Sleep(25 * time.Millisecond)
		}
		if lc.During == "" {
			lc.ElectSeconds = -1
		}
		r.logf("fault %s: new stream leader %q after %.2fs", label, lc.During, lc.ElectSeconds)
	} else {
		lc.During = r.streamLeader(ctx, 2*time.Second)
	}
	r.pause(ctx, hold-time.Since(t0))
	if err := node.Start(); err != nil {
		return err
	}
	t1 := time.Now()
	lc.CatchUpSeconds = -1
	for time.Since(t1) < time.Minute && ctx.Err() == nil {
		ci, err := r.streamCluster(ctx, 2*time.Second)
		if err == nil && ci.Leader != "" && len(ci.Replicas) == r.cl.Len()-1 && replicasCurrent(ci) {
			lc.CatchUpSeconds = time.Since(t1).Seconds()
			lc.After = ci.Leader
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if lc.After == "" {
		lc.After = r.streamLeader(ctx, 2*time.Second)
	}
	r.logf("fault %s: node %s back; replicas current after %.2fs; stream leader %q -> %q", label, lc.Killed, lc.CatchUpSeconds, lc.Before, lc.After)
	r.mu.Lock()
	r.report.LeaderChanges = append(r.report.LeaderChanges, lc)
	r.mu.Unlock()
	return nil
}

func replicasCurrent(ci *jetstream.ClusterInfo) bool {
	for _, p := range ci.Replicas {
		if !p.Current || p.Offline {
			return false
		}
	}
	return true
}

// startNATS starts the one server or the cluster's nodes that are down, and
// in a cluster waits until JetStream answers again.
func (r *runner) startNATS(ctx context.Context) error {
	var errs []error
	for _, n := range r.natsNodes() {
		if err := n.Start(); err != nil && !isAlreadyRunning(err) {
			errs = append(errs, err)
		}
	}
	if r.cl != nil && len(errs) == 0 {
		wctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		if err := r.cl.WaitJetStream(wctx); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func validateCluster(n int, faults []string) error {
	if n < 0 || n > 5 {
		return fmt.Errorf("-cluster %d: want 0 (one nats-server) or 1 to 5 nodes", n)
	}
	if n == 0 {
		for _, f := range faults {
			if f == FaultNATSNodeKill {
				return fmt.Errorf("fault %s needs a cluster (-cluster 3)", f)
			}
		}
	}
	return nil
}

func isAlreadyRunning(err error) bool { return strings.Contains(err.Error(), "already running") }
