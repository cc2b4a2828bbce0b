package inbox_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/binding/spec"
	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// readEvent is docs/consumers.md's reading of a message with the
// CloudEvents SDK for Go, as printed there: binary mode from the ce-*
// headers, structured mode by unmarshalling the data.
func readEvent(msg jetstream.Msg) (event.Event, error) {
	h := msg.Headers()
	if h.Get("Content-Type") == "application/cloudevents+json" { // structured
		var ev event.Event
		err := json.Unmarshal(msg.Data(), &ev)
		return ev, err
	}
	v := spec.WithPrefix("ce-").Version(h.Get("ce-specversion")) // binary
	if v == nil {
		return event.Event{}, errors.New("not a CloudEvent")
	}
	ev := event.New()
	for k, vs := range h { // ce-*: an attribute or an extension; other headers are skipped
		if err := v.SetAttribute(ev.Context, k, vs[0]); err != nil {
			return ev, err
		}
	}
	ev.DataEncoded = msg.Data()
	return ev, ev.Validate()
}

// TestPayloadAgreesWithTheCloudEventsSDK: the SDK reads every row's
// message in both CloudEvents formats as a valid event whose attributes
// are the row's and whose data is the row's payload, which is also what
// inbox.Payload returns.
func TestPayloadAgreesWithTheCloudEventsSDK(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{})
	type sent struct {
		row  wire.Row
		mode wire.Mode
	}
	byID := map[string]sent{}
	for _, r := range formatRows {
		for _, mode := range []wire.Mode{wire.ModeCloudEvents, wire.ModeCloudEventsStructured} {
			id := r.WorkID + "-" + mode.String()
			byID[id] = sent{r, mode}
			f.publishRow(r, id, mode)
		}
	}
	for range byID {
		msg := f.fetch(5 * time.Second)
		id := msg.Headers().Get(jetstream.MsgIDHeader)
		s := byID[id]
		ev, err := readEvent(msg)
		if err != nil {
			t.Errorf("%s: the SDK: %v", id, err)
			continue
		}
		if err := ev.Validate(); err != nil {
			t.Errorf("%s: %v", id, err)
		}
		if ev.ID() != id || ev.Type() != s.row.Kind || ev.Source() != "/test" || ev.SpecVersion() != "1.0" ||
			!ev.Time().Equal(time.Date(2025, 3, 1, 12, 30, 0, 123456000, time.UTC)) {
			t.Errorf("%s: event %s", id, ev)
		}
		if s.row.AggregateSeq != 0 {
			want := map[string]any{"partitionkey": "order/103", "sequence": "0000000000000000007"}
			if fmt.Sprint(ev.Extensions()) != fmt.Sprint(want) {
				t.Errorf("%s: extensions %v, want %v", id, ev.Extensions(), want)
			}
		}
		if s.row.WorkID == "text" && (ev.Extensions()["tenant"] != "acme" || ev.DataContentType() != "text/plain; charset=utf-8") {
			t.Errorf("%s: extensions %v, datacontenttype %q", id, ev.Extensions(), ev.DataContentType())
		}
		p, err := inbox.Payload(msg)
		if err != nil || !bytes.Equal(ev.Data(), s.row.Payload) || !bytes.Equal(p, ev.Data()) {
			t.Errorf("%s in %s: the SDK's data %q, inbox.Payload %q (%v); want the row's %q", id, s.mode, ev.Data(), p, err, s.row.Payload)
		}
	}
}
