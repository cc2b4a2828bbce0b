package testenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/devenv"
)

// The servers themselves live in devenv, which the demo links without
// package testing; these names keep the tests' spelling.
type (
	NATS        = devenv.NATS
	NATSOptions = devenv.NATSOptions
	NATSCluster = devenv.NATSCluster
)

// ClusterName is the cluster block's name of every cluster from
// StartNATSCluster.
const ClusterName = devenv.ClusterName

// StartNATS starts a JetStream-enabled nats-server on a free port with a
// fresh store directory (see devenv.StartNATS), with the test defaults
// filled in: the binary from OUTBOX_RELAY_TEST_NATS_SERVER or else the
// pinned one, never PATH, and files kept when OUTBOX_RELAY_TEST_KEEP is set.
func StartNATS(opts NATSOptions) (*NATS, error) {
	opts, err := testNATSOptions(opts)
	if err != nil {
		return nil, err
	}
	return devenv.StartNATS(opts)
}

// StartNATSCluster starts an n-node JetStream cluster (see
// devenv.StartNATSCluster) with the same test defaults as StartNATS.
func StartNATSCluster(n int, opts NATSOptions) (*NATSCluster, error) {
	opts, err := testNATSOptions(opts)
	if err != nil {
		return nil, err
	}
	return devenv.StartNATSCluster(n, opts)
}

func testNATSOptions(opts NATSOptions) (NATSOptions, error) {
	if opts.Bin == "" {
		bin, err := testNATSServer()
		if err != nil {
			return opts, fmt.Errorf("start nats: %w", err)
		}
		opts.Bin = bin
	}
	opts.KeepFiles = opts.KeepFiles || keepFiles()
	return opts, nil
}

// testNATSServer resolves the binary once per test process so the error,
// like the path, is the same for every test.
var testNATSServer = sync.OnceValues(func() (string, error) {
	if p := os.Getenv("OUTBOX_RELAY_TEST_NATS_SERVER"); p != "" {
		return p, nil
	}
	return devenv.PinnedNATSServer()
})

// ModuleRoot is the directory of the product's go.mod above the working
// directory (see devenv.ModuleRoot).
func ModuleRoot() (string, error) { return devenv.ModuleRoot() }

// deleteStream is best effort: the stream lives in the test's own namespace,
// and a server that a fault test left down has nothing to clean.
func deleteStream(t testing.TB, n *NATS, stream string) {
	nc, err := nats.Connect(n.URL(), nats.Timeout(2*time.Second), nats.NoReconnect())
	if err != nil {
		return
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := js.DeleteStream(ctx, stream); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Logf("testenv: delete stream %s: %v", stream, err)
	}
}
