package inbox_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// jsLine is what consumer.mjs prints for one message.
type jsLine struct {
	Subject     string            `json:"subject"`
	Seq         uint64            `json:"seq"`
	MsgID       *string           `json:"msgId"`
	Kind        *string           `json:"kind"`
	Format      string            `json:"format"`
	Outbox      map[string]string `json:"outbox"`
	CE          map[string]string `json:"ce"`
	ContentType *string           `json:"contentType"`
	Data        []byte            `json:"data"`    // base64
	Payload     []byte            `json:"payload"` // base64
	Event       map[string]any    `json:"event"`
	JSON        json.RawMessage   `json:"json"`
	Error       string            `json:"error"`
}

// jsRows are outbox rows as the relay reads them: each kind of payload the
// formats carry differently.
var jsRows = []struct {
	name string
	row  wire.Row
	ct   string // the payload's content type (CloudEvents datacontenttype)
	json bool   // the payload is JSON: the consumer parses it
}{
	{"order", wire.Row{Kind: "order.received", Payload: []byte(`{"order_id": 103, "note": "café \"☕\"", "total": "29.00"}`),
		Headers:       []byte(`{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "ce-tenant": "acme"}`),
		AggregateType: "order", AggregateID: "103", AggregateSeq: 2, ExpiresAt: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)},
		wire.MediaJSON, true},
	// A json column keeps the producer's bytes: a number no JavaScript
	// number holds, which only a raw read of the envelope keeps.
	{"bignum", wire.Row{Kind: "ledger.posted", Payload: []byte(`{"amount":12345678901234567890,"rate":2.50}`)}, wire.MediaJSON, true},
	{"spaced", wire.Row{Kind: "ledger.posted", Payload: []byte(" [1, 2]\n")}, wire.MediaJSON, true},
	{"bytes", wire.Row{Kind: "image.stored", Payload: []byte{0, 0xff, 0xfe, '{', '"', '\n', 0x80}, Binary: true}, wire.MediaOctetStream, false},
	{"text", wire.Row{Kind: "note.added", Payload: []byte("héllo \"x\"\n"), Binary: true,
		Headers: []byte(`{"Content-Type": "text/plain; charset=utf-8"}`)}, "text/plain; charset=utf-8", false},
}

// TestConsumerReadsEveryFormat runs consumer.mjs (nats.js) against messages
// built as the relay builds them (wire.Format) in each --message-format,
// with JSON and binary payloads, and checks every line it prints: the IDs,
// the headers, the data and the payload's exact bytes.
func TestConsumerReadsEveryFormat(t *testing.T) {
	t.Parallel()
	node, dir := nodeWithDeps(t)
	env := testenv.Shared(t)
	url := env.NATS.URL()
	name, prefix := env.StreamName(t)
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{prefix + ">"}, Storage: jetstream.MemoryStorage})
	if err != nil {
		t.Fatal(err)
	}
	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: "js", AckPolicy: jetstream.AckExplicitPolicy, MaxDeliver: -1})
	if err != nil {
		t.Fatal(err)
	}

	type sent struct {
		msg  *wire.Message
		mode wire.Mode
		row  int
	}
	var all []sent
	created := time.Date(2025, 3, 1, 12, 30, 0, 123456000, time.UTC)
	for i, r := range jsRows {
		for _, mode := range []wire.Mode{wire.ModeOutbox, wire.ModeCloudEvents, wire.ModeCloudEventsStructured} {
			row := r.row
			row.WorkID = r.name + "-" + mode.String()
			row.CreatedAt = created
			m, err := wire.Format{SubjectPrefix: prefix, Mode: mode, Source: "/test"}.Build(row, nil)
			if err != nil {
				t.Fatalf("build %s: %v", row.WorkID, err)
			}
			pub := &nats.Msg{Subject: m.Subject, Data: m.Data, Header: nats.Header{}}
			for k, vs := range m.Header {
				pub.Header[k] = append([]string(nil), vs...)
			}
			pub.Header.Set(jetstream.MsgIDHeader, m.ID) // what the sink adds
			if _, err := js.PublishMsg(ctx, pub); err != nil {
				t.Fatalf("publish %s: %v", m.ID, err)
			}
			m.Header[jetstream.MsgIDHeader] = []string{m.ID}
			all = append(all, sent{m, mode, i})
		}
	}

	// The durable consumer: every message printed and acked.
	got := runJSConsumer(t, node, dir, "--url", url, "--stream", name, "--consumer", "js", "--count", fmt.Sprint(len(all)), "--timeout-ms", "10000")
	if len(got) != len(all) {
		t.Fatalf("consumer.mjs printed %d lines, want %d", len(got), len(all))
	}
	for i, s := range all {
		checkJSLine(t, got[i], s.msg, s.mode, jsRows[s.row].row, jsRows[s.row].ct, jsRows[s.row].json)
	}
	info, err := cons.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.NumAckPending != 0 || info.NumPending != 0 || info.AckFloor.Stream != uint64(len(all)) {
		t.Errorf("durable consumer after the run: %d ack pending, %d pending, ack floor %d; want 0, 0, %d",
			info.NumAckPending, info.NumPending, info.AckFloor.Stream, len(all))
	}

	// Without a consumer name: an ordered consumer from the stream's start
	// prints the same lines.
	again := runJSConsumer(t, node, dir, "--url", url, "--stream", name, "--count", fmt.Sprint(len(all)), "--timeout-ms", "10000")
	if !reflect.DeepEqual(again, got) {
		t.Errorf("the ordered consumer printed other lines than the durable one:\n%v\n%v", again, got)
	}
}

// checkJSLine compares what consumer.mjs printed for a message with the
// message the relay would publish for row in mode.
func checkJSLine(t *testing.T, l jsLine, m *wire.Message, mode wire.Mode, row wire.Row, ct string, isJSON bool) {
	t.Helper()
	id := m.ID
	if l.Error != "" {
		t.Errorf("%s: consumer.mjs: %s", id, l.Error)
	}
	if l.MsgID == nil || *l.MsgID != id || l.Subject != m.Subject || l.Kind == nil || *l.Kind != row.Kind || l.Format != mode.String() {
		t.Errorf("%s: printed msgId %v, subject %q, kind %v, format %q; want %q, %q, %q, %q",
			id, derefJS(l.MsgID), l.Subject, derefJS(l.Kind), l.Format, id, m.Subject, row.Kind, mode)
	}
	wantOutbox, wantCE := map[string]string{}, map[string]string{}
	var wantCT *string
	for k, vs := range m.Header {
		switch lk := strings.ToLower(k); {
		case strings.HasPrefix(lk, "outbox-") && lk != "outbox-kind":
			wantOutbox[k] = vs[0]
		case strings.HasPrefix(lk, "ce-"):
			wantCE[k] = vs[0]
		case lk == "content-type":
			wantCT = &vs[0]
		}
	}
	if !reflect.DeepEqual(l.Outbox, wantOutbox) || !reflect.DeepEqual(l.CE, wantCE) {
		t.Errorf("%s: printed Outbox-* %v and ce-* %v; want %v and %v", id, l.Outbox, l.CE, wantOutbox, wantCE)
	}
	if mode == wire.ModeCloudEvents && (wantCE["ce-id"] != id || wantCE["ce-datacontenttype"] != ct || wantCE["ce-source"] != "/test") {
		t.Errorf("%s: built ce-* headers %v", id, wantCE)
	}
	if derefJS(l.ContentType) != derefJS(wantCT) || (l.ContentType == nil) != (wantCT == nil) {
		t.Errorf("%s: printed content type %v, want %v", id, derefJS(l.ContentType), derefJS(wantCT))
	}
	if !bytes.Equal(l.Data, m.Data) {
		t.Errorf("%s: printed data %q, want %q", id, l.Data, m.Data)
	}
	if !bytes.Equal(l.Payload, row.Payload) {
		t.Errorf("%s: printed payload %q, want the row's %q", id, l.Payload, row.Payload)
	}
	if mode == wire.ModeCloudEventsStructured {
		var want map[string]any
		if err := json.Unmarshal(m.Data, &want); err != nil {
			t.Fatalf("%s: the envelope: %v", id, err)
		}
		delete(want, "data")
		delete(want, "data_base64")
		if !reflect.DeepEqual(l.Event, want) || want["id"] != id || want["source"] != "/test" || want["datacontenttype"] != ct {
			t.Errorf("%s: printed event %v, want %v (id %s, datacontenttype %s)", id, l.Event, want, id, ct)
		}
	} else if l.Event != nil {
		t.Errorf("%s: printed an event for a %s message: %v", id, mode, l.Event)
	}
	if isJSON {
		var got, want any
		if err := json.Unmarshal(l.JSON, &got); err != nil || json.Unmarshal(row.Payload, &want) != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("%s: printed json %s (%v), want the payload %s", id, l.JSON, err, row.Payload)
		}
	} else if l.JSON != nil {
		t.Errorf("%s: printed json %s for a %s payload", id, l.JSON, ct)
	}
}

func derefJS(s *string) string {
	if s == nil {
		return "<none>"
	}
	return *s
}

// runJSConsumer runs consumer.mjs with args and returns its lines.
func runJSConsumer(t *testing.T, node, dir string, args ...string) []jsLine {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, append([]string{"consumer.mjs"}, args...)...)
	cmd.Dir = dir
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	if err := cmd.Run(); err != nil {
		t.Fatalf("node consumer.mjs %s: %v\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), err, stdout.Bytes(), stderr.Bytes())
	}
	t.Logf("node consumer.mjs %s: %v", strings.Join(args, " "), time.Since(start).Round(time.Millisecond))
	var out []jsLine
	sc := bufio.NewScanner(&stdout)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var l jsLine
		dec := json.NewDecoder(bytes.NewReader(sc.Bytes()))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&l); err != nil {
			t.Fatalf("consumer.mjs printed %q: %v", sc.Bytes(), err)
		}
		out = append(out, l)
	}
	return out
}

// nodeWithDeps returns node and examples/consumer-js with its
// dependencies installed: `npm ci` unless the pinned versions are already
// there. It skips only when node (or npm, to install) is missing or the
// registry is unreachable; any other failure fails.
func nodeWithDeps(t *testing.T) (node, dir string) {
	t.Helper()
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("node is not installed: the JavaScript consumer cannot run (Node.js 20 or later; CI has it)")
	}
	if dir, err = filepath.Abs(filepath.Join("..", "examples", "consumer-js")); err != nil {
		t.Fatal(err)
	}
	if jsDepsInstalled(dir) {
		return node, dir
	}
	npm, err := exec.LookPath("npm")
	if err != nil {
		t.Skip("npm is not installed and examples/consumer-js/node_modules is missing: run npm ci there")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, npm, "ci", "--no-audit", "--no-fund")
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		for _, sign := range []string{"ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ECONNRESET", "ETIMEDOUT", "ENETUNREACH", "EHOSTUNREACH"} {
			if bytes.Contains(out, []byte(sign)) {
				t.Skipf("npm ci in %s could not reach the registry (%s); the JavaScript consumer was not run:\n%s", dir, sign, out)
			}
		}
		t.Fatalf("npm ci in %s: %v\n%s", dir, err, out)
	}
	if !jsDepsInstalled(dir) {
		t.Fatalf("npm ci in %s succeeded but the pinned packages are not in node_modules:\n%s", dir, out)
	}
	return node, dir
}

// jsDepsInstalled says whether node_modules holds the versions package.json pins.
func jsDepsInstalled(dir string) bool {
	var pkg struct {
		Dependencies map[string]string `json:"dependencies"`
	}
	b, err := os.ReadFile(filepath.Join(dir, "package.json"))
	if err != nil || json.Unmarshal(b, &pkg) != nil || len(pkg.Dependencies) == 0 {
		return false
	}
	for name, version := range pkg.Dependencies {
		var got struct {
			Version string `json:"version"`
		}
		b, err := os.ReadFile(filepath.Join(dir, "node_modules", filepath.FromSlash(name), "package.json"))
		if errors.Is(err, os.ErrNotExist) || err != nil || json.Unmarshal(b, &got) != nil || got.Version != version {
			return false
		}
	}
	return true
}
