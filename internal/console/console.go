// Package console is the operator console: a few server-rendered pages
// under /ui/ that show the relay's health and its dead letters, and redrive
// or cancel rows through the same guarded statements as the CLI
// (store.Redrive, store.Cancel), so into the same history.
//
// It sits next to a database that holds every payload, so it is built as an
// admin page must be: every request needs the token once one is set, and
// without one it serves only on a loopback address and changes nothing;
// actions need a CSRF token bound to the session and pass Go's cross-origin
// check; bodies are capped; everything a row holds is escaped by
// html/template and shown with control and bidi characters made visible;
// pages carry a Content-Security-Policy that allows no inline script, and
// the binary embeds every file it serves.
package console

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/replication"
)

// The console's defaults; zero fields of Options take them.
const (
	// DefaultMaxRequestBytes caps a request body. The largest legitimate
	// one is a preview or confirmation of ticked rows, which carries their
	// work IDs (a filter's carries the filter and a digest).
	DefaultMaxRequestBytes = 256 << 10
	// DefaultPageSize rows per page of the rows table; MaxPageSize bounds
	// what a ?limit= may ask for.
	DefaultPageSize = 50
	MaxPageSize     = 500
	// DefaultMaxActionRows bounds one redrive or cancel from the console: a
	// preview lists every row it would change, and a bigger bulk action
	// belongs to the CLI's --limit slices.
	DefaultMaxActionRows = 500
	// DefaultSessionTTL is how long a login lasts.
	DefaultSessionTTL = 8 * time.Hour
	// DefaultStagger spreads a redrive's rows as the CLI's default does.
	DefaultStagger = store.DefaultStagger
	// DefaultRefresh is how often the overview refreshes itself, and the
	// spacing of the lag chart's samples.
	DefaultRefresh = 5 * time.Second
	// DefaultChartSamples is the lag chart's length: 15 minutes at
	// DefaultRefresh.
	DefaultChartSamples = 180
	// DefaultPayloadChars is how much of a payload the rows table shows;
	// the row's page shows all of it.
	DefaultPayloadChars = 120
	// RecentWindow is the window of "failures in the last hour".
	RecentWindow = time.Hour
	// RoleConsoleOnly is the role the console command reports: it serves
	// the console and streams nothing.
	RoleConsoleOnly = "console only"
)

// Options are the console's settings, from run's or console's flags.
type Options struct {
	// Enabled serves the console (run --console); the console command
	// always serves it.
	Enabled bool
	// Token authenticates every request (--console-token): a bearer token,
	// the password of basic auth, or the login form's field. Empty: the
	// console serves only on a loopback address and is read-only.
	Token string
	// ReadOnly refuses every action (--console-read-only).
	ReadOnly bool

	// Zero values take the Default* constants.
	MaxRequestBytes int64
	PageSize        int
	MaxActionRows   int
	SessionTTL      time.Duration
	Stagger         time.Duration
	Refresh         time.Duration
	ChartSamples    int
}

func (o Options) withDefaults() Options {
	if o.MaxRequestBytes <= 0 {
		o.MaxRequestBytes = DefaultMaxRequestBytes
	}
	if o.PageSize <= 0 {
		o.PageSize = DefaultPageSize
	}
	if o.MaxActionRows <= 0 {
		o.MaxActionRows = DefaultMaxActionRows
	}
	if o.SessionTTL <= 0 {
		o.SessionTTL = DefaultSessionTTL
	}
	if o.Stagger <= 0 {
		o.Stagger = DefaultStagger
	}
	if o.Refresh <= 0 {
		o.Refresh = DefaultRefresh
	}
	if o.ChartSamples <= 0 {
		o.ChartSamples = DefaultChartSamples
	}
	return o
}

// Writable reports whether the console may change rows: only with a token,
// and not read-only.
func (o Options) Writable() bool { return o.Token != "" && !o.ReadOnly }

// ErrInsecureAddr refuses to serve the console without a token on an
// address other machines can reach.
var ErrInsecureAddr = errors.New("the console needs --console-token (or OUTBOX_RELAY_CONSOLE_TOKEN) on an address other than loopback")

// CheckAddr refuses a listen address that is not loopback when no token
// is set. A host name other than localhost counts as reachable: what it
// resolves to can change.
func CheckAddr(addr, token string) error {
	if token != "" {
		return nil
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("console address %q: %w", addr, err)
	}
	if host == "localhost" {
		return nil
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		return nil
	}
	if host == "" {
		host = "every interface"
	}
	return fmt.Errorf("%w: %s listens on %s; give a token, or listen on 127.0.0.1", ErrInsecureAddr, addr, host)
}

// loopbackHost reports whether a request's Host names this machine in a
// way no DNS answer can change: localhost, an address in 127.0.0.0/8, or
// [::1], each with or without a port. Nothing else: not a subdomain of
// localhost, not a trailing dot, not an IPv4-mapped or zoned address.
func loopbackHost(hostport string) bool {
	host := hostport
	if h, port, err := net.SplitHostPort(hostport); err == nil {
		if _, err := strconv.ParseUint(port, 10, 16); err != nil {
			return false
		}
		host = h
	} else if strings.HasPrefix(hostport, "[") && strings.HasSuffix(hostport, "]") {
		host = hostport[1 : len(hostport)-1]
	} else if strings.Contains(hostport, ":") {
		return false // an IPv6 address without brackets is not a Host
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	a, err := netip.ParseAddr(host)
	if err != nil || a.Zone() != "" {
		return false
	}
	return (a.Is4() && a.IsLoopback()) || a == netip.IPv6Loopback()
}

// quoteHost shows a client-supplied Host in an error: quoted, and cut.
func quoteHost(h string) string {
	if len(h) > 100 {
		h = h[:100] + "..."
	}
	return strconv.Quote(h)
}

// Standby is one --standby-slot standby as the overview shows it.
type Standby struct {
	Slot     string `json:"slot"`
	LagBytes int64  `json:"lag_bytes"`
	// Missing: no physical slot of this name on the server, so it holds
	// nothing back (after a failover, name the new primary's standbys).
	Missing bool `json:"missing"`
}

// Sources are what the console reads. Store is required; the others may be
// nil.
type Sources struct {
	Store *store.Store
	// Catalog reads the slot's lag and the standbys' positions.
	Catalog replication.Querier
	Slot    string
	// Role is this instance's CDC role; nil: RoleConsoleOnly.
	Role func() string
	// Standbys reports the standbys delivery waits for (run: from the
	// metrics registry; console: from the catalog).
	Standbys func(ctx context.Context) ([]Standby, error)
}

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Console serves the pages. Its handler expects the full /ui/... paths.
type Console struct {
	o    Options
	src  Sources
	tmpl map[string]*template.Template
	mux  *http.ServeMux
	// key signs sessions and CSRF tokens: derived from a secret fresh per
	// process and from the token, so a restart logs everyone out (which
	// costs a login and keeps no secret on disk) and nothing signed under
	// one token is valid under another.
	key [32]byte

	smu      sync.Mutex
	sessions map[string]time.Time // live session IDs and their expiry

	mu      sync.Mutex
	samples []Sample

	// The overview, read once per refresh interval whoever asks
	// (cachedHealth): hmu guards it.
	hmu      sync.Mutex
	health   Health
	healthAt time.Time     // when health was read; zero: never, or forgotten
	reading  chan struct{} // closed when the read under way ends; nil when none is
	reads    atomic.Int64  // reads of the overview from the database, for tests
}

// New builds the console. addr is where it will listen, checked by
// CheckAddr.
func New(o Options, addr string, src Sources) (*Console, error) {
	if err := CheckToken(o.Token); err != nil {
		return nil, err
	}
	o.Token = trimToken(o.Token)
	if err := CheckAddr(addr, o.Token); err != nil {
		return nil, err
	}
	if src.Store == nil {
		return nil, errors.New("console: no store")
	}
	c := &Console{o: o.withDefaults(), src: src, sessions: map[string]time.Time{}}
	var secret [32]byte
	if _, err := rand.Read(secret[:]); err != nil {
		return nil, fmt.Errorf("console: session key: %w", err)
	}
	m := hmac.New(sha256.New, secret[:])
	m.Write([]byte("outbox-relay console session key\x00" + c.o.Token))
	copy(c.key[:], m.Sum(nil))
	var err error
	if c.tmpl, err = parseTemplates(); err != nil {
		return nil, err
	}
	c.routes()
	return c, nil
}

func (c *Console) routes() {
	m := http.NewServeMux()
	static, err := fs.Sub(staticFS, "static")
	if err != nil {
		panic(err) // the embedded tree is fixed at build time
	}
	m.Handle("GET /ui/static/", http.StripPrefix("/ui/static/", staticHandler(http.FileServerFS(static))))
	m.HandleFunc("GET /ui/login", c.loginPage)
	m.HandleFunc("POST /ui/login", c.login)
	m.Handle("POST /ui/logout", c.authed(c.csrf(http.HandlerFunc(c.logout))))
	m.Handle("GET /ui/{$}", c.authed(http.HandlerFunc(c.overview)))
	m.Handle("GET /ui/api/health", c.authed(http.HandlerFunc(c.healthJSON)))
	m.Handle("GET /ui/rows", c.authed(http.HandlerFunc(c.rows)))
	m.Handle("GET /ui/row", c.authed(http.HandlerFunc(c.row)))
	m.Handle("GET /ui/history", c.authed(http.HandlerFunc(c.history)))
	m.Handle("POST /ui/preview", c.authed(c.writable(c.csrf(http.HandlerFunc(c.preview)))))
	m.Handle("POST /ui/apply", c.authed(c.writable(c.csrf(http.HandlerFunc(c.apply)))))
	m.HandleFunc("/ui/", func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "not found", http.StatusNotFound)
	})
	c.mux = m
}

// ServeHTTP applies the headers and limits every response and request
// gets, then routes.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	// No inline script or style anywhere: what a row smuggles into a page
	// cannot run even if an escape were missed.
	h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "+
		"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Frame-Options", "DENY")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cross-Origin-Opener-Policy", "same-origin")
	// Pages hold row data and CSRF tokens: no cache may keep them.
	h.Set("Cache-Control", "no-store")
	if c.o.Token == "" && !loopbackHost(r.Host) {
		// DNS rebinding: a page the operator visits points its own name
		// at 127.0.0.1 and reads the console as same-origin. Its requests
		// carry that name as Host; a loopback name or address cannot be
		// rebound. With a token, the browser has no credential for the
		// other name to send.
		http.Error(w, "this console has no token (--console-token), so it answers only requests addressed to localhost, 127.0.0.1 or [::1]; "+
			"this one was addressed to "+quoteHost(r.Host)+": open the console by a loopback address, or set a token", http.StatusForbidden)
		return
	}
	if r.Body != nil {
		r.Body = http.MaxBytesReader(w, r.Body, c.o.MaxRequestBytes)
	}
	crossOrigin.Handler(c.mux).ServeHTTP(w, r)
}

// crossOrigin rejects state-changing requests a browser sends from another
// origin (Sec-Fetch-Site, Origin), before the CSRF token is even read.
var crossOrigin = http.NewCrossOriginProtection()

// staticHandler lets the embedded files be cached briefly: they hold no
// data and change only with the binary.
func staticHandler(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "private, max-age=300")
		h.ServeHTTP(w, r)
	})
}
