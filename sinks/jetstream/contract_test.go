package jetstream_test

import (
	"context"
	"errors"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

func checksOf(fs []natssink.Finding) []string {
	var out []string
	for _, f := range fs {
		out = append(out, f.Check+"/"+f.Level)
	}
	return out
}

// Each check of the broker contract fires on the stream that falls short of
// it, and on no other: the stream the relay creates on a cluster (R3, file,
// TTL allowed, a window past the retry span) meets them all.
func TestContractChecks(t *testing.T) {
	good := jetstream.StreamConfig{Name: "OUTBOX", Storage: jetstream.FileStorage, Replicas: 3, Duplicates: 10 * time.Minute,
		Retention: jetstream.LimitsPolicy, Discard: jetstream.DiscardOld, AllowMsgTTL: true}
	want := natssink.Contract{RetrySpan: 5 * time.Minute, RetrySpanFrom: "--backoff-max 5m0s", DeadlineTTL: true}
	for _, c := range []struct {
		name    string
		edit    func(*jetstream.StreamConfig)
		version string
		sync    *natssink.ServerSync
		want    natssink.Contract
		checks  []string
	}{
		{"meets every check", nil, "2.15.2", nil, want, nil},
		{"no_ack", func(c *jetstream.StreamConfig) { c.NoAck = true }, "2.15.2", nil, want, []string{"no_ack/refuse"}},
		{"sealed", func(c *jetstream.StreamConfig) { c.Sealed = true }, "2.15.2", nil, want, []string{"sealed/refuse"}},
		{"memory", func(c *jetstream.StreamConfig) { c.Storage = jetstream.MemoryStorage }, "2.15.2", nil, want, []string{"memory_storage/warn"}},
		{"R1, sync unknown", func(c *jetstream.StreamConfig) { c.Replicas = 1 }, "2.15.2", nil, want, []string{"unsynced_store/warn"}},
		{"R1, sync every 2m", func(c *jetstream.StreamConfig) { c.Replicas = 1 }, "2.15.2", &natssink.ServerSync{Interval: 2 * time.Minute}, want, []string{"unsynced_store/warn"}},
		{"R1, sync always", func(c *jetstream.StreamConfig) { c.Replicas = 1 }, "2.15.2", &natssink.ServerSync{Always: true}, want, nil},
		{"short window", func(c *jetstream.StreamConfig) { c.Duplicates = time.Second }, "2.15.2", nil, want, []string{"duplicate_window/warn"}},
		{"window equal to the span", func(c *jetstream.StreamConfig) { c.Duplicates = 5 * time.Minute }, "2.15.2", nil, want, nil},
		{"max_msg_size", func(c *jetstream.StreamConfig) { c.MaxMsgSize = 1024 }, "2.15.2", nil, want, []string{"max_msg_size/warn"}},
		{"discard new, limited", func(c *jetstream.StreamConfig) { c.Discard, c.MaxMsgs = jetstream.DiscardNew, 1000 }, "2.15.2", nil, want, []string{"discard_new/warn"}},
		{"discard new, unlimited", func(c *jetstream.StreamConfig) { c.Discard = jetstream.DiscardNew }, "2.15.2", nil, want, nil},
		{"work queue", func(c *jetstream.StreamConfig) { c.Retention = jetstream.WorkQueuePolicy }, "2.15.2", nil, want, []string{"retention/warn"}},
		{"no TTL", func(c *jetstream.StreamConfig) { c.AllowMsgTTL = false }, "2.15.2", nil, want, []string{"msg_ttl/warn"}},
		{"no TTL, not asked", func(c *jetstream.StreamConfig) { c.AllowMsgTTL = false }, "2.15.2", nil, natssink.Contract{}, nil},
		{"old server, TTL", nil, "2.10.22", nil, want, []string{"server_version/warn"}},
		{"old server, atomic", func(c *jetstream.StreamConfig) { c.AllowAtomicPublish = true }, "v2.11.9", nil, natssink.Contract{AtomicBatches: true}, []string{"server_version/refuse"}},
		{"no atomic publish", nil, "2.15.2", nil, natssink.Contract{AtomicBatches: true}, []string{"atomic_publish/refuse"}},
		{"atomic publish allowed", func(c *jetstream.StreamConfig) { c.AllowAtomicPublish = true }, "2.15.2", nil, natssink.Contract{AtomicBatches: true}, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := good
			if c.edit != nil {
				c.edit(&cfg)
			}
			got := natssink.CheckContract(&jetstream.StreamInfo{Config: cfg}, c.version, c.sync, c.want)
			if !slices.Equal(checksOf(got), c.checks) {
				t.Fatalf("findings %v, want %v: %v", checksOf(got), c.checks, got)
			}
			for _, f := range got {
				if !strings.Contains(f.Msg, "OUTBOX") && f.Check != natssink.CheckServerVersion {
					t.Errorf("%s: the message does not name the stream: %s", f.Check, f.Msg)
				}
				if f.Fix == "" || !slices.Contains(natssink.Checks, f.Check) {
					t.Errorf("%s: no fix, or a check missing from Checks", f.Check)
				}
			}
		})
	}
	// A server before 2.11 cannot allow TTL on a stream: the advice is to
	// upgrade it, not an edit it would refuse.
	old := natssink.CheckContract(&jetstream.StreamInfo{Config: jetstream.StreamConfig{Name: "OUTBOX", Replicas: 3, Duplicates: 5 * time.Minute}}, "2.9.25", nil, want)
	if len(old) != 1 || old[0].Check != natssink.CheckMsgTTL || !strings.HasPrefix(old[0].Fix, "upgrade nats-server (2.9.25 has no per-message TTL") {
		t.Errorf("on nats-server 2.9 the TTL finding does not advise an upgrade first: %v", old)
	}
	if cur := natssink.CheckContract(&jetstream.StreamInfo{Config: jetstream.StreamConfig{Name: "OUTBOX", Replicas: 3, Duplicates: 5 * time.Minute}}, "2.11.0", nil, want); len(cur) != 1 || !strings.HasPrefix(cur[0].Fix, "allow it") {
		t.Errorf("on nats-server 2.11 the TTL finding should advise the edit: %v", cur)
	}
	short := natssink.CheckContract(&jetstream.StreamInfo{Config: jetstream.StreamConfig{Name: "OUTBOX", Replicas: 3, Duplicates: time.Second, AllowMsgTTL: true}}, "2.15.2", nil, want)
	if len(short) != 1 || !strings.Contains(short[0].Msg, "1s") || !strings.Contains(short[0].Msg, "--backoff-max 5m0s") || !strings.Contains(short[0].Fix, "--dupe-window 5m0s") {
		t.Errorf("the duplicate window finding names neither the window nor the flag: %v", short)
	}
}

// Against real servers: a stream with a 1 s duplicate window and an R1 file
// store on a server that syncs every 2 minutes (read from its monitoring
// endpoint) each get their finding; on a server with sync_interval: always
// the R1 store does not.
func TestContractAgainstRealServers(t *testing.T) {
	ctx := context.Background()
	for _, syncAlways := range []bool{false, true} {
		srv, err := testenv.StartNATS(testenv.NATSOptions{Monitor: true, SyncAlways: syncAlways})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.Close)
		nc, err := nats.Connect(srv.URL())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		info, _, err := natssink.EnsureStream(ctx, js, natssink.StreamConfig{Name: "CONTRACT", SubjectPrefix: "contract.", DuplicateWindow: time.Second, MsgTTL: true})
		if err != nil {
			t.Fatal(err)
		}
		sync, err := natssink.ReadServerSync(ctx, srv.MonitorURL())
		if err != nil {
			t.Fatal(err)
		}
		if sync.Always != syncAlways {
			t.Fatalf("sync read from /varz: %+v, want always=%v", sync, syncAlways)
		}
		got := checksOf(natssink.CheckContract(info, nc.ConnectedServerVersion(), sync,
			natssink.Contract{RetrySpan: 5 * time.Minute, RetrySpanFrom: "--backoff-max 5m0s", DeadlineTTL: true}))
		want := []string{"unsynced_store/warn", "duplicate_window/warn"}
		if syncAlways {
			want = []string{"duplicate_window/warn"}
		}
		if !slices.Equal(got, want) {
			t.Errorf("sync always %v: findings %v, want %v", syncAlways, got, want)
		}
	}
}

func TestTTLRoundsUp(t *testing.T) {
	now := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	for _, c := range []struct {
		left time.Duration
		want string
	}{{20 * time.Second, "20s"}, {19*time.Second + time.Millisecond, "20s"}, {1500 * time.Millisecond, "2s"},
		{time.Millisecond, "1s"}, {0, "1s"}, {-time.Hour, "1s"}, {48 * time.Hour, "172800s"}} {
		if got := natssink.TTL(now.Add(c.left), now); got != c.want {
			t.Errorf("TTL with %s left = %s, want %s", c.left, got, c.want)
		}
	}
}

// G21: a row with a deadline carries Nats-TTL, the time left rounded up,
// and the stream removes its message once the deadline has passed; a row
// without one stays. On a stream that does not allow per-message TTL the
// same row is published without the header, and stored.
func TestDeadlineTTLIsEnforcedByTheBroker(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	ttlStream := f.stream + "_TTL"
	info, _, err := natssink.EnsureStream(ctx, f.js, natssink.StreamConfig{Name: ttlStream, SubjectPrefix: ttlStream + ".", DuplicateWindow: time.Minute, MsgTTL: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.js.DeleteStream(context.Background(), ttlStream) })
	if !info.Config.AllowMsgTTL {
		t.Fatal("the stream was created without AllowMsgTTL")
	}
	sink := natssink.New(f.js, natssink.Options{Stream: ttlStream, SubjectPrefix: ttlStream + ".", DeadlineTTL: true})
	sink.Observe(info)
	deadline := time.Now().Add(3 * time.Second)
	publish := func(sink *natssink.Sink, prefix, id string, expires time.Time) uint64 {
		t.Helper()
		m, err := wire.BuildMessage(wire.Row{WorkID: id, Kind: "k", Payload: []byte(`{}`), ExpiresAt: expires}, prefix, nil)
		if err != nil {
			t.Fatal(err)
		}
		fut, err := sink.Publish(ctx, m)
		if err != nil {
			t.Fatal(err)
		}
		ack, err := fut.Wait(ctx)
		if err != nil {
			t.Fatalf("publish %s: %v", id, err)
		}
		return ack.Sequence
	}
	dueSeq := publish(sink, ttlStream+".", "due", deadline)
	keptSeq := publish(sink, ttlStream+".", "kept", time.Time{})
	st, err := f.js.Stream(ctx, ttlStream)
	if err != nil {
		t.Fatal(err)
	}
	due, err := st.GetMsg(ctx, dueSeq)
	if err != nil {
		t.Fatal(err)
	}
	if got := due.Header.Get(wire.HeaderTTL); got != "3s" {
		t.Errorf("Nats-TTL %q, want 3s (the 3 s left, rounded up)", got)
	}
	if got := due.Header.Get(wire.HeaderExpiresAt); got == "" {
		t.Error("Outbox-Expires-At is gone: receivers keep their own check")
	}
	testenv.WaitFor(t, 15*time.Second, "the stream removed the message past its deadline", func() (bool, error) {
		_, err := st.GetMsg(ctx, dueSeq)
		return errors.Is(err, jetstream.ErrMsgNotFound), err
	})
	if time.Now().Before(deadline) {
		t.Errorf("removed before the deadline")
	}
	kept, err := st.GetMsg(ctx, keptSeq)
	if err != nil {
		t.Fatalf("the message without a deadline is gone: %v", err)
	}
	if kept.Header.Get(wire.HeaderTTL) != "" {
		t.Errorf("a message without a deadline carries Nats-TTL %q", kept.Header.Get(wire.HeaderTTL))
	}

	// The fixture's stream does not allow TTL: published without it.
	plainInfo, err := mustStream(t, f.js, f.stream).Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	plain := natssink.New(f.js, natssink.Options{Stream: f.stream, SubjectPrefix: f.prefix, DeadlineTTL: true})
	plain.Observe(plainInfo)
	seq := publish(plain, f.prefix, "due-plain", time.Now().Add(time.Hour))
	m, err := mustStream(t, f.js, f.stream).GetMsg(ctx, seq)
	if err != nil {
		t.Fatal(err)
	}
	if m.Header.Get(wire.HeaderTTL) != "" {
		t.Errorf("Nats-TTL %q on a stream without AllowMsgTTL", m.Header.Get(wire.HeaderTTL))
	}
}

func mustStream(t *testing.T, js jetstream.JetStream, name string) jetstream.Stream {
	t.Helper()
	st, err := js.Stream(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// The monitoring URL's password never reaches an error (the relay logs
// them at warn: 9 lines in 20 s carried it), whatever went wrong.
func TestReadServerSyncErrorsHideThePassword(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	for _, u := range []string{"http://ops:s3cr3t-pw@" + addr, "http://ops:s3cr3t-pw@" + addr + "/%zz", "http://ops:s3cr3t-pw@[::1"} {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := natssink.ReadServerSync(ctx, u)
		cancel()
		if err == nil {
			t.Fatalf("%s: no error", u)
		}
		if strings.Contains(err.Error(), "s3cr3t-pw") {
			t.Errorf("the error shows the password: %v", err)
		}
	}
}
