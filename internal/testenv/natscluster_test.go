package testenv

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestNATSClusterR3SurvivesLeaderKill starts three nodes, creates an R3
// stream, kills its leader, publishes and reads back through the other
// nodes, and brings the killed node back as a current replica.
func TestNATSClusterR3SurvivesLeaderKill(t *testing.T) {
	c, err := StartNATSCluster(3, NATSOptions{SyncAlways: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	if got := strings.Count(c.URLs(), ","); got != 2 {
		t.Fatalf("URLs() = %q, want three URLs", c.URLs())
	}
	for i := range c.Len() {
		if n, j := c.NodeByName(fmt.Sprintf("n%d", i)); n != c.Node(i) || j != i {
			t.Fatalf("NodeByName(n%d) = %v, %d", i, n, j)
		}
	}
	ctx := context.Background()
	nc, err := nats.Connect(c.URLs(), nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	const stream = "R3"
	// The meta leader answers (WaitJetStream) before it has heard from
	// every peer; until then an R3 stream has "no suitable peers for
	// placement" (10005), seen on a loaded machine.
	var s jetstream.Stream
	WaitFor(t, 30*time.Second, "an R3 stream placed on the three nodes", func() (bool, error) {
		s, err = js.CreateStream(ctx, jetstream.StreamConfig{
			Name: stream, Subjects: []string{"r3.>"}, Storage: jetstream.FileStorage, Replicas: 3,
		})
		var apiErr *jetstream.APIError
		if errors.As(err, &apiErr) && apiErr.ErrorCode == 10005 { // JSClusterNoPeersErr
			return false, err
		}
		return true, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "r3.a", []byte("one"), jetstream.WithMsgID("id-1")); err != nil {
		t.Fatal(err)
	}
	info := streamInfo(t, s, "stream with a leader and two current replicas", func(i *jetstream.StreamInfo) bool {
		return i.Cluster != nil && i.Cluster.Leader != "" && len(i.Cluster.Replicas) == 2 && allCurrent(i)
	})
	if info.Config.Replicas != 3 {
		t.Fatalf("stream has %d replicas, want 3", info.Config.Replicas)
	}
	oldLeader := info.Cluster.Leader
	leader, li := c.NodeByName(oldLeader)
	if leader == nil {
		t.Fatalf("leader %q is not a node of the cluster", oldLeader)
	}
	if err := leader.Kill(); err != nil {
		t.Fatal(err)
	}

	// Publish and read back through each surviving node on its own.
	for i := range c.Len() {
		if i == li {
			continue
		}
		node := c.Node(i)
		nc2, err := nats.Connect(node.URL(), nats.NoReconnect())
		if err != nil {
			t.Fatal(err)
		}
		defer nc2.Close()
		js2, err := jetstream.New(nc2)
		if err != nil {
			t.Fatal(err)
		}
		id := "via-" + node.ServerName()
		WaitFor(t, 30*time.Second, "publish through "+node.ServerName()+" after the leader was killed", func() (bool, error) {
			pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			_, err := js2.Publish(pctx, "r3.b", []byte(id), jetstream.WithMsgID(id))
			return err == nil, err
		})
		s2, err := js2.Stream(ctx, stream)
		if err != nil {
			t.Fatal(err)
		}
		got, err := s2.GetLastMsgForSubject(ctx, "r3.b")
		if err != nil {
			t.Fatal(err)
		}
		if string(got.Data) != id || got.Header.Get(jetstream.MsgIDHeader) != id {
			t.Errorf("through %s: last message %q (id %q), want %q", node.ServerName(), got.Data, got.Header.Get(jetstream.MsgIDHeader), id)
		}
		first, err := s2.GetMsg(ctx, 1)
		if err != nil || string(first.Data) != "one" {
			t.Errorf("through %s: message 1 = %v, %v; want the one published before the kill", node.ServerName(), first, err)
		}
	}
	info = streamInfo(t, s, "a new leader", func(i *jetstream.StreamInfo) bool {
		return i.Cluster != nil && i.Cluster.Leader != "" && i.Cluster.Leader != oldLeader
	})
	t.Logf("stream leader %s killed; new leader %s", oldLeader, info.Cluster.Leader)
	// Deduplication still holds under the new leader.
	ack, err := js.Publish(ctx, "r3.a", []byte("one"), jetstream.WithMsgID("id-1"))
	if err != nil {
		t.Fatal(err)
	}
	if !ack.Duplicate {
		t.Error("republish of id-1 under the new leader was stored again")
	}

	if err := leader.Start(); err != nil {
		t.Fatal(err)
	}
	info = streamInfo(t, s, "the restarted node back as a current replica", func(i *jetstream.StreamInfo) bool {
		if i.Cluster == nil || i.Cluster.Leader == "" || !allCurrent(i) {
			return false
		}
		if i.Cluster.Leader == oldLeader {
			return true
		}
		for _, p := range i.Cluster.Replicas {
			if p.Name == oldLeader {
				return true
			}
		}
		return false
	})
	if info.State.Msgs != 3 {
		t.Errorf("stream holds %d messages, want 3", info.State.Msgs)
	}
	if err := c.Node((li + 1) % c.Len()).Restart(); err != nil {
		t.Fatal(err)
	}
	ctx2, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := c.WaitJetStream(ctx2); err != nil {
		t.Fatal(err)
	}
}

func allCurrent(i *jetstream.StreamInfo) bool {
	for _, p := range i.Cluster.Replicas {
		if !p.Current || p.Offline {
			return false
		}
	}
	return true
}

func streamInfo(t *testing.T, s jetstream.Stream, what string, ok func(*jetstream.StreamInfo) bool) *jetstream.StreamInfo {
	t.Helper()
	var info *jetstream.StreamInfo
	WaitFor(t, time.Minute, what, func() (bool, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		i, err := s.Info(ctx)
		if err != nil {
			return false, err
		}
		info = i
		return ok(i), nil
	})
	return info
}
