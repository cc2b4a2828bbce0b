package relay_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// A broker that acknowledged messages and then lost them (G19): the
// stream's store comes back missing the tail of its newest block (what a
// power loss before JetStream's sync leaves). Under mark the relay finds
// the rows recorded published past the stream's last sequence and hands
// them to the poller, which publishes them again: 0 lost, 0 stored twice.
func TestBrokerLostTailRepublished(t *testing.T) {
	env := testenv.Shared(t)
	n, err := testenv.StartNATS(testenv.NATSOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.Close)
	h := newHarness(t, setup{dbURL: env.PG.CreateDatabase(t), natsURL: n.URL(), stream: "LOSTTAIL", subjectPrefix: "losttail."})
	h.opts.LostCheckInterval = 300 * time.Millisecond
	logs := &testenv.LogBuffer{}
	h.logs = logs
	h.start()
	ids := h.insertRows("lt", 2000, 50)
	h.waitPublished(len(ids), 30*time.Second)
	if got := h.streamCount(); got != uint64(len(ids)) {
		t.Fatalf("stream holds %d before the fault, want %d", got, len(ids))
	}

	if err := n.Stop(); err != nil {
		t.Fatal(err)
	}
	cutStreamTail(t, filepath.Join(n.StoreDir(), "jetstream", "$G", "streams", "LOSTTAIL"), 0.6)
	if err := n.Start(); err != nil {
		t.Fatal(err)
	}
	left := h.streamCount()
	t.Logf("stream holds %d of %d after the cut", left, len(ids))
	if left == 0 || left >= uint64(len(ids)) {
		t.Fatalf("the cut left %d of %d messages: the test proves nothing", left, len(ids))
	}
	testenv.WaitFor(t, 30*time.Second, "every row stored again", func() (bool, error) {
		return h.streamCount() >= uint64(len(ids)) && h.countState("published") == len(ids), nil
	})
	h.assertExactlyOnce(ids)
	// The error names the range the broker lost: what was cut.
	want := fmt.Sprintf(`"stream_last_seq":%d,"from_seq":%d,"to_seq":%d,"rows":%d`, left, left+1, len(ids), uint64(len(ids))-left)
	if !strings.Contains(logs.String(), want) {
		t.Errorf("no error log with %s", want)
	}
}

// cutStreamTail truncates the newest message block of the stream stored in
// dir to keep of its size and removes what would restore the stream's
// state past it (the index and per-block index files).
func cutStreamTail(t *testing.T, dir string, keep float64) {
	t.Helper()
	msgs := filepath.Join(dir, "msgs")
	blks, err := filepath.Glob(filepath.Join(msgs, "*.blk"))
	if err != nil || len(blks) == 0 {
		t.Fatalf("no message blocks in %s: %v", msgs, err)
	}
	newest := blks[len(blks)-1]
	fi, err := os.Stat(newest)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(newest, int64(float64(fi.Size())*keep)); err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(msgs)
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".blk") {
			if err := os.Remove(filepath.Join(msgs, e.Name())); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Logf("cut %s from %d to %d bytes", newest, fi.Size(), int64(float64(fi.Size())*keep))
}

// Under none the relay keeps no sequence per row: the loss is detected
// against the highest sequence its CDC path saw acknowledged and reported
// at error with the range (G19), not repaired.
func TestBrokerLostTailReportedUnderNone(t *testing.T) {
	env := testenv.Shared(t)
	n, err := testenv.StartNATS(testenv.NATSOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.Close)
	h := newHarness(t, setup{dbURL: env.PG.CreateDatabase(t), natsURL: n.URL(), stream: "LOSTNONE", subjectPrefix: "lostnone."})
	h.opts.Policy = store.PolicyNone
	h.opts.LostCheckInterval = 300 * time.Millisecond
	logs := &testenv.LogBuffer{}
	h.logs = logs
	h.start()
	ids := h.insertRows("ln", 2000, 50)
	testenv.WaitFor(t, 30*time.Second, "every row stored", func() (bool, error) { return h.streamCount() == uint64(len(ids)), nil })
	if err := n.Stop(); err != nil {
		t.Fatal(err)
	}
	cutStreamTail(t, filepath.Join(n.StoreDir(), "jetstream", "$G", "streams", "LOSTNONE"), 0.6)
	if err := n.Start(); err != nil {
		t.Fatal(err)
	}
	left := h.streamCount()
	if left == 0 || left >= uint64(len(ids)) {
		t.Fatalf("the cut left %d of %d messages: the test proves nothing", left, len(ids))
	}
	want := fmt.Sprintf(`"from_seq":%d,"to_seq":%d,"messages":%d,"command":"outbox-relay republish --on-publish none --since `, left+1, len(ids), uint64(len(ids))-left)
	testenv.WaitFor(t, 10*time.Second, "the loss reported", func() (bool, error) {
		return strings.Contains(logs.String(), want), fmt.Errorf("no log with %s", want)
	})
}
