package devenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// NATSCluster is n nats-server processes with JetStream, routed to each
// other as one cluster on 127.0.0.1. Each node is a *NATS with its own
// store directory, client port and cluster port, all of which survive
// Kill/Stop and Start, so a node can crash and come back as the same peer.
//
// A node's Start waits only until it accepts clients: JetStream answers
// once the cluster has a meta leader, which needs a quorum of nodes. Use
// WaitJetStream after starting the cluster or healing a lost quorum.
type NATSCluster struct {
	name    string
	baseDir string
	nodes   []*NATS
	keep    bool

	closeOnce sync.Once
}

// ClusterName is the cluster block's name of every cluster from
// StartNATSCluster.
const ClusterName = "outbox-relay-test"

// StartNATSCluster starts an n-node JetStream cluster (n >= 1; 3 for R3
// streams) with fresh store directories, and waits until JetStream has a
// meta leader. opts.SyncAlways and opts.NoAdvertise apply to every node.
func StartNATSCluster(n int, opts NATSOptions) (*NATSCluster, error) {
	if n < 1 {
		return nil, fmt.Errorf("start nats cluster: %d nodes", n)
	}
	bin, err := natsServerBin(opts)
	if err != nil {
		return nil, fmt.Errorf("start nats cluster: %w", err)
	}
	for attempt := 1; ; attempt++ {
		c, err := startNATSCluster(bin, n, opts)
		if err == nil {
			return c, nil
		}
		// A free port may have been taken in the meantime by another test
		// binary; the routes name every node's port, so all nodes get new
		// ones.
		if !errors.Is(err, errAddrInUse) || attempt == 3 {
			return nil, err
		}
	}
}

func startNATSCluster(bin string, n int, opts NATSOptions) (*NATSCluster, error) {
	base, err := os.MkdirTemp("", "outbox-relay-nats-cluster-")
	if err != nil {
		return nil, fmt.Errorf("start nats cluster: create temp dir: %w", err)
	}
	c := &NATSCluster{name: ClusterName, baseDir: base, keep: opts.KeepFiles}
	fail := func(err error) (*NATSCluster, error) {
		c.Shutdown(false)
		return nil, err
	}
	clientPorts := make([]int, n)
	routePorts := make([]int, n)
	seen := map[int]bool{}
	for i := range 2 * n {
		var p int
		for {
			if p, err = freePort(); err != nil {
				return fail(fmt.Errorf("start nats cluster: %w", err))
			}
			if !seen[p] {
				break
			}
		}
		seen[p] = true
		if i < n {
			clientPorts[i] = p
		} else {
			routePorts[i-n] = p
		}
	}
	for i := range n {
		dir := filepath.Join(base, fmt.Sprintf("n%d", i))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fail(fmt.Errorf("start nats cluster: %w", err))
		}
		node := &NATS{
			binPath:     bin,
			baseDir:     dir,
			storeDir:    filepath.Join(dir, "store"),
			logPath:     filepath.Join(dir, "nats.log"),
			port:        clientPorts[i],
			serverName:  fmt.Sprintf("n%d", i),
			clusterNode: true,
		}
		confPath := filepath.Join(dir, "nats.conf")
		if err := os.WriteFile(confPath, []byte(clusterNodeConf(node, i, routePorts, opts)), 0o644); err != nil {
			return fail(fmt.Errorf("start nats cluster: write config: %w", err))
		}
		// Everything is in the config file: nats-server rejects the store
		// directory given both there and on the command line.
		node.args = []string{"-c", confPath}
		c.nodes = append(c.nodes, node)
	}
	// Nodes accept clients before their routes are up, so they can start
	// one after the other; they find each other through the routes.
	for _, node := range c.nodes {
		if err := node.Start(); err != nil {
			return fail(fmt.Errorf("node %s: %w", node.serverName, err))
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), natsReadyTimeout)
	defer cancel()
	if err := c.WaitJetStream(ctx); err != nil {
		return fail(fmt.Errorf("start nats cluster: %w\n%s", err, c.logTails()))
	}
	return c, nil
}

// clusterNodeConf is node i's configuration file: client and cluster
// listeners on 127.0.0.1, routes to every other node, JetStream in its own
// store directory.
func clusterNodeConf(node *NATS, i int, routePorts []int, opts NATSOptions) string {
	var b strings.Builder
	fmt.Fprintf(&b, "server_name: %q\n", node.serverName)
	fmt.Fprintf(&b, "listen: \"127.0.0.1:%d\"\n", node.port)
	b.WriteString("jetstream {\n")
	fmt.Fprintf(&b, "  store_dir: %q\n", node.storeDir)
	if opts.SyncAlways {
		b.WriteString("  sync_interval: always\n")
	}
	b.WriteString("}\n")
	b.WriteString("cluster {\n")
	fmt.Fprintf(&b, "  name: %q\n", ClusterName)
	fmt.Fprintf(&b, "  listen: \"127.0.0.1:%d\"\n", routePorts[i])
	if opts.NoAdvertise {
		b.WriteString("  no_advertise: true\n")
	}
	b.WriteString("  routes: [\n")
	for j, p := range routePorts {
		if j != i {
			fmt.Fprintf(&b, "    \"nats-route://127.0.0.1:%d\"\n", p)
		}
	}
	b.WriteString("  ]\n}\n")
	return b.String()
}

// Len returns the number of nodes.
func (c *NATSCluster) Len() int { return len(c.nodes) }

// Node returns node i (0-based); its ServerName is "n<i>".
func (c *NATSCluster) Node(i int) *NATS { return c.nodes[i] }

// NodeByName returns the node with that server_name (as in
// StreamInfo.Cluster.Leader) and its index, or nil and -1.
func (c *NATSCluster) NodeByName(name string) (*NATS, int) {
	for i, n := range c.nodes {
		if n.serverName == name {
			return n, i
		}
	}
	return nil, -1
}

// URLs returns every node's client URL, comma-separated, as nats.Connect
// and the relay's --nats-url take them.
func (c *NATSCluster) URLs() string {
	urls := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		urls[i] = n.URL()
	}
	return strings.Join(urls, ",")
}

// WaitJetStream waits until JetStream answers through the cluster, which
// needs an elected meta leader, polling AccountInfo through any node until
// it succeeds or ctx ends.
func (c *NATSCluster) WaitJetStream(ctx context.Context) error {
	var lastErr error
	for {
		lastErr = c.accountInfo(ctx)
		if lastErr == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("jetstream of cluster %s not answering: %w", c.name, lastErr)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (c *NATSCluster) accountInfo(ctx context.Context) error {
	nc, err := nats.Connect(c.URLs(), nats.Timeout(2*time.Second), nats.NoReconnect())
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := js.AccountInfo(ctx); err != nil {
		return fmt.Errorf("jetstream account info: %w", err)
	}
	return nil
}

// Close kills every node and removes the cluster's directory (kept, with
// the nodes shut down gracefully, when NATSOptions.KeepFiles was set). It
// is safe to call more than once.
func (c *NATSCluster) Close() { c.Shutdown(c.keep) }

// Shutdown is Close with the choice of keeping the directories made now.
func (c *NATSCluster) Shutdown(keep bool) {
	c.closeOnce.Do(func() {
		var wg sync.WaitGroup
		for _, n := range c.nodes {
			wg.Add(1)
			go func() { defer wg.Done(); n.Shutdown(keep) }()
		}
		wg.Wait()
		if !keep {
			_ = os.RemoveAll(c.baseDir)
		}
	})
}

// logTails is the end of every node's log, for a cluster that would not
// form.
func (c *NATSCluster) logTails() string {
	var b strings.Builder
	for _, n := range c.nodes {
		fmt.Fprintf(&b, "--- %s ---\n%s\n", n.logPath, logSince(n.logPath, 0))
	}
	return b.String()
}
