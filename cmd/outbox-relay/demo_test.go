package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The demo against given servers: every committed order reaches the stream
// once, the rolled-back one never, the slot ends confirmed, and the inbox
// consumer applies each effect once although every message is delivered twice.
//
// Then the rest of the product, on two orders in a stream of their own: under
// --ordering aggregate order 201's refused invoice holds its later messages
// while order 202 flows; 201's reminder, whose deadline passes while it
// waits, ends expired and never sent; the invoice, a dead letter, is
// redriven (as the CLI does) and published, and each order's messages are
// in sequence in the stream. Written to a buffer, not a terminal, the story
// has no carriage return or escape sequence in it, and no console.
func TestDemoOnGivenServers(t *testing.T) {
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	deleteOrdersStream(t, env.NATS.URL(), stream)
	dbURL := env.PG.CreateDatabase(t)
	var out, errb bytes.Buffer
	start := time.Now()
	code := mainErr([]string{"demo", "--database-url", dbURL, "--nats-url", env.NATS.URL(),
		"--stream", stream, "--subject-prefix", prefix, "--slot", "demo_test"}, &out, &errb)
	t.Logf("the demo took %v", time.Since(start))
	t.Logf("demo output:\n%s\n%s", out.String(), errb.String())
	if code != 0 {
		t.Fatalf("demo exited %d", code)
	}
	for _, want := range []string{
		"5 rows committed, 5 in the stream (0 duplicates), 1 rolled back and 0 published by mistake, 5 rows marked published",
		"consumer: 10 deliveries, 5 effects applied, 5 duplicates dropped by the inbox",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the demo's output lacks %q", want)
		}
	}
	if i := strings.IndexAny(out.String(), "\r\x1b"); i >= 0 {
		t.Errorf("stdout is not a terminal, yet the output has a carriage return or escape at byte %d: %q", i, out.String()[max(0, i-40):i+1])
	}
	if strings.Contains(out.String(), "console:") {
		t.Errorf("stdout is not a terminal and --console was not given, yet the demo served the console")
	}
	for _, want := range []*regexp.Regexp{
		regexp.MustCompile(`order-201-4\S* #4 order_cancelled\s+scheduled\s+held: waiting for order-201-2`),
		regexp.MustCompile(`order-202-3\S* #3 order_shipped\s+published`),
		regexp.MustCompile(`order-201-2\S* #2 invoice_attached\s+failed\s+rejected: max_msg_size`),
		regexp.MustCompile(`redriven: order-201-2`),
		regexp.MustCompile(`each order in sequence; order-201-3\S* expired and was never sent`),
	} {
		if !want.MatchString(out.String()) {
			t.Errorf("the demo's output lacks %s", want)
		}
	}

	// The table and the stream, not the story, decide.
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	states := map[string]string{}
	var redrivenBy string
	rows, err := pool.Query(ctx, `SELECT regexp_replace(work_id, '-[0-9]+$', ''), state, coalesce(redriven_by, '') FROM outbox WHERE kind <> 'order_received'`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id, state, by string
		if err := rows.Scan(&id, &state, &by); err != nil {
			t.Fatal(err)
		}
		states[id] = state
		if id == "order-201-2" {
			redrivenBy = by
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	wantStates := map[string]string{"order-201-1": "published", "order-201-2": "published", "order-201-3": "expired", "order-201-4": "published",
		"order-202-1": "published", "order-202-2": "published", "order-202-3": "published"}
	for id, want := range wantStates {
		if states[id] != want {
			t.Errorf("%s is %q, want %s", id, states[id], want)
		}
	}
	if len(states) != len(wantStates) || redrivenBy != "demo" {
		t.Errorf("orders rows %v, order-201-2 redriven by %q; want the 7 above and demo", states, redrivenBy)
	}
	got := ordersInStream(t, env.NATS.URL(), stream+"_DEMO_ORDERS")
	if want := []string{"order-201-1", "order-202-1", "order-202-2", "order-202-3", "order-201-2", "order-201-4"}; !sameOrderPerAggregate(got, want) {
		t.Errorf("the orders stream holds %v; want each order in sequence: %v (201's #3 never)", got, want)
	}
}

// deleteOrdersStream removes the demo's orders stream after the test.
func deleteOrdersStream(t *testing.T, natsURL, stream string) {
	t.Cleanup(func() {
		nc, err := nats.Connect(natsURL)
		if err != nil {
			return
		}
		defer nc.Close()
		if js, err := jetstream.New(nc); err == nil {
			_ = js.DeleteStream(context.Background(), stream+"_DEMO_ORDERS")
		}
	})
}

// ordersInStream is the stream's messages' work IDs (their run suffix cut)
// in stream order.
func ordersInStream(t *testing.T, natsURL, stream string) []string {
	t.Helper()
	nc, err := nats.Connect(natsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	suffix := regexp.MustCompile(`-[0-9]+$`)
	for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, suffix.ReplaceAllString(m.Header.Get(jetstream.MsgIDHeader), ""))
	}
	return ids
}

// sameOrderPerAggregate says got holds exactly want's IDs and, for each
// order (order-<id>-<seq>), in want's order; orders may interleave.
func sameOrderPerAggregate(got, want []string) bool {
	if len(got) != len(want) {
		return false
	}
	perOrder := func(ids []string) map[string][]int {
		m := map[string][]int{}
		for _, id := range ids {
			parts := strings.Split(id, "-")
			if len(parts) != 3 {
				return nil
			}
			n, err := strconv.Atoi(parts[2])
			if err != nil {
				return nil
			}
			m[parts[1]] = append(m[parts[1]], n)
		}
		return m
	}
	g, w := perOrder(got), perOrder(want)
	if g == nil || len(g) != len(w) {
		return false
	}
	for k, ws := range w {
		gs := g[k]
		if len(gs) != len(ws) {
			return false
		}
		for i := range ws {
			if gs[i] != ws[i] {
				return false
			}
		}
	}
	return true
}

// demo --console ends by serving the console: the printed URL answers the
// printed token with the overview, and its history shows the demo's redrive, until
// the demo is cancelled; then it returns without an error.
func TestDemoConsole(t *testing.T) {
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	deleteOrdersStream(t, env.NATS.URL(), stream)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pr, pw := io.Pipe()
	var errOut testenv.LogBuffer
	done := make(chan error, 1)
	go func() {
		err := runDemo(ctx, []string{"--console", "--database-url", env.PG.CreateDatabase(t), "--nats-url", env.NATS.URL(),
			"--stream", stream, "--subject-prefix", prefix, "--slot", "demo_console"}, pw, &errOut)
		pw.Close()
		done <- err
	}()
	type served struct{ url, token string }
	found := make(chan served, 1)
	var out testenv.LogBuffer
	go func() {
		var s served
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			line := sc.Text()
			out.Write([]byte(line + "\n"))
			if u, ok := strings.CutPrefix(line, "console: "); ok {
				s.url = u
			}
			if tok, ok := strings.CutPrefix(strings.TrimSpace(line), "token for this session: "); ok {
				s.token = tok
				found <- s
			}
		}
		_, _ = io.Copy(io.Discard, pr)
	}()
	var s served
	select {
	case s = <-found:
	case err := <-done:
		t.Fatalf("the demo returned before serving the console: %v\n%s\n%s", err, out.String(), errOut.String())
	case <-time.After(90 * time.Second):
		t.Fatalf("no console URL and token printed within 90 s:\n%s", out.String())
	}
	if !strings.HasPrefix(s.url, "http://127.0.0.1:") || len(s.token) < 16 {
		t.Fatalf("console %q, token %q: want a loopback URL and a token of at least 16 bytes", s.url, s.token)
	}
	get := func(path, token string) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, s.url+path, nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, body := get("", s.token)
	if code != http.StatusOK || !strings.Contains(body, `id="role">console only<`) {
		t.Errorf("GET %s with the printed token: %d; want 200 and the overview:\n%.2000s", s.url, code, body)
	}
	if code, body := get("history", s.token); code != http.StatusOK || !strings.Contains(body, "invoice limit raised") {
		t.Errorf("GET %shistory with the printed token: %d; want 200 and the demo's redrive:\n%.3000s", s.url, code, body)
	}
	if code, _ := get("", strings.Repeat("x", 24)); code == http.StatusOK {
		t.Errorf("GET %s with another token: 200", s.url)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("the demo, cancelled while serving the console: %v\n%s", err, errOut.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the demo did not stop on its context")
	}
}

// Without --nats-url the demo starts a nats-server; when the one it is told
// to use does not exist, the error says every way to fix that, before
// anything was started or connected.
func TestDemoWithoutNATSServerSaysHowToFix(t *testing.T) {
	t.Setenv("OUTBOX_RELAY_NATS_SERVER", "/nonexistent/nats-server")
	code, out, errOut := run(t, "demo", "--database-url", "postgres://nobody@127.0.0.1:1/none")
	if code != 1 {
		t.Fatalf("demo exited %d, want 1", code)
	}
	if strings.Contains(out, "starting") {
		t.Errorf("the demo started something:\n%s", out)
	}
	for _, want := range []string{"/nonexistent/nats-server", "--nats-url", "install nats-server", "OUTBOX_RELAY_NATS_SERVER"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("the error lacks %q: %s", want, errOut)
		}
	}
}
