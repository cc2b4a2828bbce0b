// Command outbox-compose-test is the Go half of `make compose-test`
// (scripts/compose-test.sh), which runs docker-compose.yml for real:
//
//	outbox-compose-test override -o FILE [flags]   write the compose override (package composetest)
//	outbox-compose-test modproxy -dir DIR -port-file FILE
//	                                                serve a module cache's download dir as a GOPROXY on loopback
//	outbox-compose-test wait -db URL -nats URL -min N -timeout D
//	                                                wait until every order reached the stream and the consumer once
//	outbox-compose-test counts -db URL -nats URL    print the counts wait compares
//	outbox-compose-test get URL                     GET, fail unless 200
//	outbox-compose-test closed ADDR...              fail if anything still accepts connections there
//
// Counts come from the database (the producer's orders, the consumer's
// inbox and effects) and from the stream (the Nats-Msg-Id of every
// message), never from logs.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/proof/composetest"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: outbox-compose-test override|modproxy|wait|counts|get|closed ...")
		os.Exit(2)
	}
	var err error
	args := os.Args[2:]
	switch os.Args[1] {
	case "override":
		err = override(args)
	case "modproxy":
		err = modproxy(args)
	case "wait":
		err = wait(args)
	case "counts":
		err = printCounts(args)
	case "get":
		err = get(args)
	case "closed":
		err = closed(args)
	default:
		err = fmt.Errorf("unknown subcommand %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "outbox-compose-test %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

type kvFlag map[string]string

func (m kvFlag) String() string { return fmt.Sprint(map[string]string(m)) }
func (m kvFlag) Set(s string) error {
	k, v, ok := strings.Cut(s, "=")
	if !ok || k == "" {
		return fmt.Errorf("%q: want KEY=VALUE", s)
	}
	m[k] = v
	return nil
}

func override(args []string) error {
	fs := flag.NewFlagSet("override", flag.ExitOnError)
	base := fs.String("base", "docker-compose.yml", "the compose file")
	out := fs.String("o", "", "where to write the override")
	pg := fs.String("pg", "127.0.0.1:15432", "loopback address:port PostgreSQL listens on")
	nt := fs.String("nats", "127.0.0.1:14222", "loopback address:port NATS listens on for clients")
	httpAddr := fs.String("http", "127.0.0.1:18080", "the relay's HTTP address")
	pgImage := fs.String("pg-image", "", "stand-in for the postgres service's image")
	natsImage := fs.String("nats-image", "", "stand-in for the nats service's image")
	buildArgs := kvFlag{}
	fs.Var(buildArgs, "build-arg", "KEY=VALUE for every built image (repeatable)")
	fs.Parse(args) //nolint:errcheck // ExitOnError
	if *out == "" {
		return errors.New("-o is required")
	}
	b, err := os.ReadFile(*base)
	if err != nil {
		return err
	}
	cfg, err := composetest.Machine(*pg, *nt, *httpAddr)
	if err != nil {
		return err
	}
	cfg.BuildArgs = buildArgs
	if *pgImage != "" {
		cfg.Images["postgres"] = *pgImage
	}
	if *natsImage != "" {
		cfg.Images["nats"] = *natsImage
	}
	o, err := composetest.Override(b, cfg)
	if err != nil {
		return err
	}
	return os.WriteFile(*out, o, 0o644)
}

// modproxy serves a module cache's cache/download directory, which has the
// GOPROXY protocol's layout, so that image builds download modules from the
// host's cache over loopback instead of from the network.
func modproxy(args []string) error {
	fs := flag.NewFlagSet("modproxy", flag.ExitOnError)
	dir := fs.String("dir", "", "GOMODCACHE/cache/download")
	addr := fs.String("addr", "127.0.0.1:0", "loopback address to listen on")
	portFile := fs.String("port-file", "", "write the port here once listening")
	fs.Parse(args) //nolint:errcheck
	if _, err := os.Stat(*dir); err != nil {
		return fmt.Errorf("module cache download dir: %w", err)
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return err
	}
	port := fmt.Sprint(ln.Addr().(*net.TCPAddr).Port)
	if err := os.WriteFile(*portFile+".tmp", []byte(port+"\n"), 0o644); err != nil {
		return err
	}
	if err := os.Rename(*portFile+".tmp", *portFile); err != nil {
		return err
	}
	return http.Serve(ln, http.FileServer(http.Dir(*dir)))
}

type dbFlags struct {
	db, nats, stream *string
}

func addDBFlags(fs *flag.FlagSet) dbFlags {
	return dbFlags{
		db:     fs.String("db", "", "PostgreSQL URL (the producer's and the consumer's database)"),
		nats:   fs.String("nats", "", "NATS URL"),
		stream: fs.String("stream", "OUTBOX", "the relay's stream"),
	}
}

type counts struct {
	orders, acks, ackedOrders, inbox int
	streamMsgs, streamIDs            int
	missingFromStream                int // orders whose message the stream does not hold
	missingAcks                      int // orders the consumer has not applied
}

func (c counts) String() string {
	return fmt.Sprintf("orders=%d stream_messages=%d stream_distinct_ids=%d missing_from_stream=%d inbox=%d acknowledged=%d acknowledged_distinct=%d not_acknowledged=%d",
		c.orders, c.streamMsgs, c.streamIDs, c.missingFromStream, c.inbox, c.acks, c.ackedOrders, c.missingAcks)
}

// caughtUp: every order's message is in the stream once and applied once.
func (c counts) caughtUp() bool {
	return c.missingFromStream == 0 && c.missingAcks == 0 && c.streamMsgs == c.orders && c.inbox == c.orders && c.acks == c.orders
}

// duplicate reports what no amount of waiting can undo.
func (c counts) duplicate() string {
	switch {
	case c.streamMsgs != c.streamIDs:
		return fmt.Sprintf("the stream holds %d messages but %d distinct Nats-Msg-Ids: a row was published twice", c.streamMsgs, c.streamIDs)
	case c.acks != c.ackedOrders:
		return fmt.Sprintf("acknowledged_orders has %d rows for %d orders: an effect was applied twice", c.acks, c.ackedOrders)
	}
	return ""
}

func measure(ctx context.Context, f dbFlags) (counts, error) {
	var c counts
	// The stream first: an order committed after this read is then missing
	// from the stream, which waiting resolves, rather than looking like a
	// message without an order.
	ids, err := streamIDs(ctx, *f.nats, *f.stream)
	if err != nil {
		return c, err
	}
	c.streamIDs = len(ids)
	for _, n := range ids {
		c.streamMsgs += n
	}
	conn, err := pgx.Connect(ctx, *f.db)
	if err != nil {
		return c, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer conn.Close(context.Background())
	// One snapshot for the database's counts.
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return c, err
	}
	defer tx.Rollback(context.Background()) //nolint:errcheck
	if err := tx.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM orders),
		(SELECT count(*) FROM acknowledged_orders),
		(SELECT count(DISTINCT order_id) FROM acknowledged_orders),
		(SELECT count(*) FROM inbox),
		(SELECT count(*) FROM orders o WHERE NOT EXISTS (SELECT 1 FROM acknowledged_orders a WHERE a.order_id = o.id))`).
		Scan(&c.orders, &c.acks, &c.ackedOrders, &c.inbox, &c.missingAcks); err != nil {
		return c, fmt.Errorf("count orders, acknowledged_orders and inbox: %w", err)
	}
	rows, err := tx.Query(ctx, `SELECT id FROM orders`)
	if err != nil {
		return c, err
	}
	orderIDs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return c, fmt.Errorf("read orders: %w", err)
	}
	for _, id := range orderIDs {
		if ids[fmt.Sprintf("order-%d-ack", id)] == 0 {
			c.missingFromStream++
		}
	}
	return c, nil
}

// streamIDs reads every message of the stream and counts them by
// Nats-Msg-Id.
func streamIDs(ctx context.Context, natsURL, stream string) (map[string]int, error) {
	nc, err := nats.Connect(natsURL, nats.Timeout(5*time.Second))
	if err != nil {
		return nil, fmt.Errorf("connect to NATS: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("stream %s info: %w", stream, err)
	}
	ids := map[string]int{}
	for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("stream %s message %d: %w", stream, seq, err)
		}
		ids[m.Header.Get(jetstream.MsgIDHeader)]++
	}
	return ids, nil
}

func wait(args []string) error {
	fs := flag.NewFlagSet("wait", flag.ExitOnError)
	f := addDBFlags(fs)
	minOrders := fs.Int("min", 1, "at least this many orders")
	timeout := fs.Duration("timeout", 3*time.Minute, "give up after")
	fs.Parse(args) //nolint:errcheck
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	var (
		last    counts
		lastErr error
	)
	for {
		c, err := measure(ctx, f)
		if err == nil {
			if d := c.duplicate(); d != "" {
				return fmt.Errorf("%s (%s)", d, c)
			}
			if c.orders >= *minOrders && c.caughtUp() {
				fmt.Println("caught up:", c)
				return nil
			}
			last = c
		} else {
			lastErr = err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("not caught up after %s (at least %d orders): last counts %s; last error: %v", *timeout, *minOrders, last, lastErr)
		case <-time.After(500 * time.Millisecond):
		}
	}
}

func printCounts(args []string) error {
	fs := flag.NewFlagSet("counts", flag.ExitOnError)
	f := addDBFlags(fs)
	fs.Parse(args) //nolint:errcheck
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := measure(ctx, f)
	if err != nil {
		return err
	}
	fmt.Println(c)
	return nil
}

func get(args []string) error {
	if len(args) != 1 {
		return errors.New("want one URL")
	}
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get(args[0])
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	fmt.Printf("%s %s\n%s\n", args[0], resp.Status, strings.TrimSpace(string(body)))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", args[0], resp.Status)
	}
	return nil
}

func closed(args []string) error {
	var open []string
	for _, a := range args {
		c, err := net.DialTimeout("tcp", a, 2*time.Second)
		if err == nil {
			c.Close()
			open = append(open, a)
		}
	}
	if len(open) > 0 {
		return fmt.Errorf("still accepting connections: %s", strings.Join(open, " "))
	}
	return nil
}
