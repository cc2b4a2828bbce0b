package inbox_test

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// headerMsg is a delivered message as far as inbox.ExpiresAt looks: its
// headers.
type headerMsg struct {
	jetstream.Msg
	h nats.Header
}

func (m headerMsg) Headers() nats.Header { return m.h }

// The relay's Outbox-Expires-At and the inbox's reading of it agree on
// every deadline the relay can publish (issue 20, item 2): the edges of the
// range migration 0008 and Enqueue allow, to the microsecond, in any zone.
// A deadline outside it the relay rejects instead of writing a header
// (wire.BuildMessage), so no receiver meets one it must call malformed.
func TestExpiresAtHeaderRoundTrip(t *testing.T) {
	for _, d := range []time.Time{
		wire.MinTime.Add(time.Microsecond), // MinTime itself is time.Time's zero: no deadline
		time.Date(1970, 1, 1, 0, 0, 0, 1000, time.UTC),
		time.Date(2026, 11, 30, 5, 4, 42, 123456000, time.FixedZone("+05:30", 5*3600+1800)),
		time.Date(9999, 12, 31, 23, 59, 59, 999999000, time.UTC),
		wire.MaxTime.Add(-time.Microsecond).In(time.FixedZone("+14", 14*3600)),
	} {
		if err := wire.ValidateTime("expires_at", d); err != nil {
			t.Fatalf("%s: %v", d, err)
		}
		msg, err := wire.BuildMessage(wire.Row{WorkID: "w", Kind: "k", Payload: []byte(`{}`), ExpiresAt: d}, "outbox.", nil)
		if err != nil {
			t.Fatalf("BuildMessage with deadline %s: %v", d, err)
		}
		got, ok, err := inbox.ExpiresAt(headerMsg{h: nats.Header(msg.Header)})
		if err != nil || !ok || !got.Equal(d) {
			t.Errorf("deadline %s: header %q read as %s, %v, %v", d, msg.Header[wire.HeaderExpiresAt], got, ok, err)
		}
	}
	for _, d := range []time.Time{wire.MaxTime, time.Date(12026, 11, 30, 5, 4, 42, 0, time.UTC), wire.Infinity, wire.NegInfinity,
		wire.MinTime.Add(-time.Microsecond)} {
		msg, err := wire.BuildMessage(wire.Row{WorkID: "w", Kind: "k", Payload: []byte(`{}`), ExpiresAt: d}, "outbox.", nil)
		if err == nil {
			t.Errorf("deadline %s: published with header %q, want a rejection (invalid_deadline)", wire.FormatTime(d), msg.Header[wire.HeaderExpiresAt])
		}
	}
}
