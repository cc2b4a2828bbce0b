package app

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/net/netutil"

	"github.com/outbox-relay/outbox-relay/internal/console"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/store"
)

// The --http-addr server serves a scraper and a few probes, never a crowd.
// Its limits keep a flood of connections (idle keep-alives, clients that
// never finish a request) from taking the relay's file descriptors and
// memory: at most DefaultHTTPMaxConns are accepted at once, and each is
// closed when it idles or stalls, so a slot frees within seconds and the
// probes get in again. Streaming shares nothing with this server but the
// process's descriptor table, which the cap protects.
const (
	// DefaultHTTPMaxConns is far below any usual descriptor limit (1024 at
	// the least), so the relay's own database and broker connections always
	// find descriptors. Connections beyond it wait in the kernel's accept
	// queue, costing the relay nothing.
	DefaultHTTPMaxConns = 128
	// DefaultHTTPReadHeaderTimeout closes a connection that does not finish
	// its request's headers in time (slowloris), including one that never
	// sends anything.
	DefaultHTTPReadHeaderTimeout = 5 * time.Second
	// DefaultHTTPReadTimeout bounds reading a whole request.
	DefaultHTTPReadTimeout = 10 * time.Second
	// DefaultHTTPWriteTimeout bounds a response; /readyz waits at most 2s
	// for PostgreSQL and /metrics is small.
	DefaultHTTPWriteTimeout = 30 * time.Second
	// DefaultHTTPIdleTimeout closes keep-alive connections between
	// requests. Short: a scraper reconnecting every interval costs less than
	// idle connections holding slots under the cap.
	DefaultHTTPIdleTimeout = 15 * time.Second
	// DefaultHTTPMaxHeaderBytes: probes and scrapers send a few hundred
	// bytes; the net/http default of 1 MiB per connection only helps a flood.
	DefaultHTTPMaxHeaderBytes = 8 << 10
)

// HTTPLimits bounds the --http-addr server. Zero fields take the Default*
// values; tests set small ones.
type HTTPLimits struct {
	MaxConns          int
	ReadHeaderTimeout time.Duration
	ReadTimeout       time.Duration
	WriteTimeout      time.Duration
	IdleTimeout       time.Duration
	MaxHeaderBytes    int
}

func (l HTTPLimits) withDefaults() HTTPLimits {
	dur := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	dur(&l.ReadHeaderTimeout, DefaultHTTPReadHeaderTimeout)
	dur(&l.ReadTimeout, DefaultHTTPReadTimeout)
	dur(&l.WriteTimeout, DefaultHTTPWriteTimeout)
	dur(&l.IdleTimeout, DefaultHTTPIdleTimeout)
	if l.MaxConns <= 0 {
		l.MaxConns = DefaultHTTPMaxConns
	}
	if l.MaxHeaderBytes <= 0 {
		l.MaxHeaderBytes = DefaultHTTPMaxHeaderBytes
	}
	return l
}

// listenHTTP serves /metrics, /healthz and /readyz on addr, and with
// o.Console.Enabled the operator console under /ui/. The listener is
// returned apart from the server so that the caller learns the address
// before serving (":0" in tests).
func listenHTTP(addr string, lim HTTPLimits, m *metrics.Metrics, r *relay.Relay, pool, obs *pgxpool.Pool, nc *nats.Conn, o *Options) (*http.Server, net.Listener, error) {
	lim = lim.withDefaults()
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, req *http.Request) {
		role := r.Role()
		var problems []string
		if role != relay.RoleActive && role != relay.RoleWaiting {
			problems = append(problems, "cdc: "+role.String())
		}
		if !nc.IsConnected() {
			problems = append(problems, "nats: "+nc.Status().String())
		}
		ctx, cancel := context.WithTimeout(req.Context(), 2*time.Second)
		defer cancel()
		if err := pool.Ping(ctx); err != nil {
			problems = append(problems, "postgres: unreachable")
		}
		if len(problems) > 0 {
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprintln(w, strings.Join(problems, "; "))
			return
		}
		fmt.Fprintln(w, role.String())
	})
	if o.Console.Enabled {
		// Refused before listening: a console without a token on a
		// reachable address must not serve for even a moment.
		ui, err := console.New(o.Console, addr, console.Sources{
			Store: store.New(obs, o.Table, o.Policy), Catalog: obs, Slot: o.Slot,
			Role:     func() string { return r.Role().String() },
			Standbys: console.StandbysFromRegistry(m.Registry),
		})
		if err != nil {
			return nil, nil, fmt.Errorf("--console on --http-addr %s: %w", addr, err)
		}
		mux.Handle("/ui/", ui)
	}
	return listen(addr, mux, lim)
}

// listen opens addr for h with lim's bounds (lim already with defaults).
func listen(addr string, h http.Handler, lim HTTPLimits) (*http.Server, net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, nil, fmt.Errorf("listen on --http-addr %s: %w", addr, err)
	}
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: lim.ReadHeaderTimeout,
		ReadTimeout:       lim.ReadTimeout,
		WriteTimeout:      lim.WriteTimeout,
		IdleTimeout:       lim.IdleTimeout,
		MaxHeaderBytes:    lim.MaxHeaderBytes,
	}
	return srv, netutil.LimitListener(ln, lim.MaxConns), nil
}

// ServeConsole serves a console (console.New) alone under /ui/ on addr, with
// the bounds of run's --http-addr server, until ctx ends; then it shuts the
// server down. listening, when set, is told the address once it listens
// (addr may end in :0).
func ServeConsole(ctx context.Context, addr string, ui http.Handler, listening func(addr net.Addr)) error {
	mux := http.NewServeMux()
	mux.Handle("/ui/", ui)
	mux.Handle("/{$}", http.RedirectHandler("/ui/", http.StatusSeeOther))
	srv, ln, err := listen(addr, mux, HTTPLimits{}.withDefaults())
	if err != nil {
		return err
	}
	if listening != nil {
		listening(ln.Addr())
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return fmt.Errorf("serve the console on %s: %w", addr, err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("stop the console: %w", err)
	}
	return nil
}
