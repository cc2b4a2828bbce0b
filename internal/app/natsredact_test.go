package app_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// closedPort is a local port nothing listens on.
func closedPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	return port
}

// noSecret fails the test when text holds any of the secrets.
func noSecret(t *testing.T, what, text string, secrets ...string) {
	t.Helper()
	for _, s := range secrets {
		if strings.Contains(text, s) {
			t.Errorf("%s shows the secret %q:\n%s", what, s, text)
		}
	}
}

// Every form of --nats-url the reviewers tried, well-formed or not, comes out
// of the redaction without its secret; the secrets are spelled so that any
// piece a parser's error could quote (the part before a '#', '%zz' or a
// space) is itself a marker.
func TestRedactNATSURLs(t *testing.T) {
	// HOST stands for an address nothing listens on when nats.Connect
	// tries the same input.
	cases := []struct {
		in, want string
		secrets  []string
	}{
		{"nats://HOST", "nats://HOST", nil},
		{"nats://h1:4222,nats://h2:4222", "nats://h1:4222,nats://h2:4222", nil},
		{"nats://TokSecret1@HOST", "nats://xxxxx@HOST", []string{"TokSecret1"}},
		{"nats://relay:PassSecret2@HOST", "nats://relay:xxxxx@HOST", []string{"PassSecret2"}},
		{"relay:PassSecret3@HOST", "relay:xxxxx@HOST", []string{"PassSecret3"}},
		{"TokSecret4@HOST", "xxxxx@HOST", []string{"TokSecret4"}},
		{"nats://relay:Sec5a%zzSec5b@HOST", "nats://relay:xxxxx@HOST", []string{"Sec5a", "Sec5b"}},
		{"nats://Sec6a%zzSec6b@HOST", "nats://xxxxx@HOST", []string{"Sec6a", "Sec6b"}},
		{"nats://relay:Sec7a#Sec7b@HOST", "nats://relay:xxxxx@HOST", []string{"Sec7a", "Sec7b"}},
		{"nats://Sec8a#Sec8b@HOST", "nats://xxxxx@HOST", []string{"Sec8a", "Sec8b"}},
		{"nats://relay:Sec9a Sec9b@HOST", "nats://relay:xxxxx@HOST", []string{"Sec9a", "Sec9b"}},
		{"nats://relay:Sec10a/Sec10b@HOST", "nats://relay:xxxxx@HOST", []string{"Sec10a", "Sec10b"}},
		{"nats://relay:Sec11a@Sec11b@HOST", "nats://relay:xxxxx@HOST", []string{"Sec11a", "Sec11b"}},
		{"nats://Sec12a?Sec12b@HOST", "nats://xxxxx@HOST", []string{"Sec12a", "Sec12b"}},
		{"nats://tok%40Secret13@HOST", "nats://xxxxx@HOST", []string{"Secret13"}},
		{"ws://Secret14@HOST/ws", "ws://xxxxx@HOST/ws", []string{"Secret14"}},
		{
			"nats://a:Secret15@HOST, nats://Secret16@127.0.0.1:bad ,nats://c:Secret17@HOST,HOST",
			"nats://a:xxxxx@HOST, nats://xxxxx@127.0.0.1:bad ,nats://c:xxxxx@HOST,HOST",
			[]string{"Secret15", "Secret16", "Secret17"},
		},
		{"nats://relay:Secret18@[::1:4222", "nats://relay:xxxxx@[::1:4222", []string{"Secret18"}},
		{"nats://relay:Secret19@HOST:99", "nats://relay:xxxxx@HOST:99", []string{"Secret19"}},
		{"nats://relay:Sec20a:Sec20b@HOST", "nats://relay:xxxxx@HOST", []string{"Sec20a", "Sec20b"}},
	}
	host := "127.0.0.1:" + strconv.Itoa(closedPort(t))
	for _, c := range cases {
		got := app.RedactNATSURLs(c.in)
		if got != c.want {
			t.Errorf("RedactNATSURLs(%q) = %q, want %q", c.in, got, c.want)
		}
		noSecret(t, "the redacted URL", got, c.secrets...)
		if c.secrets == nil {
			continue
		}

		// What nats.go says about the same input (a parse error, or no
		// server when it parsed) must come out of the scrubber without the
		// secret too, and still say something.
		in := strings.ReplaceAll(c.in, "HOST", host)
		_, err := nats.Connect(in, nats.Timeout(500*time.Millisecond), nats.NoReconnect())
		if err == nil {
			t.Errorf("nats.Connect(%q) succeeded", in)
			continue
		}
		scrubbed := app.NewNATSScrubber(in, app.NATSAuth{}).Err(err)
		t.Logf("%q: %v", c.in, scrubbed)
		noSecret(t, "the scrubbed error", scrubbed.Error(), c.secrets...)
		if len(scrubbed.Error()) < 10 {
			t.Errorf("the scrubbed error %q says too little", scrubbed)
		}
	}
}

// The scrubber hides flag secrets and url.Parse's quoted pieces of a
// userinfo, keeps the rest of the message and keeps errors.Is working.
func TestNATSScrubber(t *testing.T) {
	s := app.NewNATSScrubber("nats://relay:Sec1a#Sec1b@h:4222,nats://Tok%21en2@h2", app.NATSAuth{Password: "FlagPass3", Token: "FlagTok4"})
	cases := []struct{ in, want string }{
		{`parse "nats://relay:Sec1a#Sec1b@h:4222": invalid port ":Sec1a" after host`, `parse "nats://relay:xxxxx@h:4222": invalid port ":xxxxx" after host`},
		{`parse "nats://relay:Sec1a": invalid port ":Sec1a" after host`, `parse "nats://relay:xxxxx": invalid port ":xxxxx" after host`},
		{`invalid URL escape "%zz"`, `invalid URL escape "%zz"`},
		{"auth with FlagPass3 and FlagTok4 failed", "auth with xxxxx and xxxxx failed"},
		{"server nats://Tok!en2@h2:4222 down", "server nats://xxxxx@h2:4222 down"},
		{"server nats://Tok%21en2@h2:4222 down", "server nats://xxxxx@h2:4222 down"},
		{`subject "orders.created" has no stream`, `subject "orders.created" has no stream`},
		{"nats: no servers available for connection", "nats: no servers available for connection"},
	}
	for _, c := range cases {
		if got := s.Scrub(c.in); got != c.want {
			t.Errorf("Scrub(%q) = %q, want %q", c.in, got, c.want)
		}
	}
	// A short piece of a secret is hidden where it stands alone, not inside
	// other words; a quoted piece of the userinfo is hidden whole.
	short := app.NewNATSScrubber("nats://u:pa#s%zz@h", app.NATSAuth{})
	if got, want := short.Scrub(`parse "nats://u:pa": invalid port ":pa" after host; invalid URL escape "%zz"`),
		`parse "nats://u:xxxxx": invalid port ":xxxxx" after host; invalid URL escape "%xxxxx"`; got != want {
		t.Errorf("short pieces: got %q, want %q", got, want)
	}

	err := s.Err(fmt.Errorf("connect to nats://Tok%%21en2@h2: %w", nats.ErrAuthorization))
	if !errors.Is(err, nats.ErrAuthorization) {
		t.Errorf("errors.Is(%v, nats.ErrAuthorization) = false after scrubbing", err)
	}
	noSecret(t, "the scrubbed error", err.Error(), "Tok", "en2")
	if errors.Unwrap(err) != nil {
		t.Errorf("the scrubbed error unwraps to the unscrubbed one: %v", errors.Unwrap(err))
	}
	plain := errors.New("nothing secret")
	if got := s.Err(plain); got != plain {
		t.Errorf("an error without secrets was rewrapped: %v", got)
	}
}

// startTokenNATS runs an in-process nats-server that requires token on
// port (0: any).
func startTokenNATS(t *testing.T, token string, port int) *natsserver.Server {
	t.Helper()
	if port == 0 {
		port = -1
	}
	srv, err := natsserver.NewServer(&natsserver.Options{Host: "127.0.0.1", Port: port, Authorization: token, NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	t.Cleanup(srv.Shutdown)
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("in-process nats-server not ready")
	}
	return srv
}

// The relay still authenticates with a token in --nats-url, and neither a
// failed connect nor a disconnect, a reconnect or an authorization error
// while reconnecting prints it: the log names the server as
// nats://xxxxx@host:port.
func TestNATSTokenNeverLogged(t *testing.T) {
	env := testenv.Shared(t)
	dbURL := env.PG.CreateDatabase(t)
	const token = "TokSecret-relay-7731"
	srv := startTokenNATS(t, token, 0)
	port := srv.Addr().(*net.TCPAddr).Port
	hostPort := fmt.Sprintf("127.0.0.1:%d", port)
	ctx := context.Background()

	// Failed connects: a wrong token, an unreachable server, a list with a
	// bad entry.
	for _, c := range []struct {
		url, want string
		secrets   []string
	}{
		{"nats://WrongTok-1@" + hostPort, "uthorization", []string{"WrongTok-1"}},
		{fmt.Sprintf("nats://%s@127.0.0.1:%d", token, closedPort(t)), "no servers", []string{token}},
		{fmt.Sprintf("nats://%s@%s,nats://relay:Pw2a#Pw2b@127.0.0.1:bad", token, hostPort), "invalid port", []string{token, "Pw2a", "Pw2b"}},
		{fmt.Sprintf("relay:Pw3a%%zzPw3b@%s", hostPort), "invalid URL escape", []string{"Pw3a", "Pw3b"}},
	} {
		logs := &testenv.LogBuffer{}
		o := app.Options{DatabaseURL: dbURL, NATSURL: c.url}
		pool, nc, err := app.Connect(ctx, &o, zerolog.New(logs))
		if err == nil {
			pool.Close()
			nc.Close()
			t.Errorf("Connect with %s succeeded", app.RedactNATSURLs(c.url))
			continue
		}
		t.Logf("%v", err)
		if !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "xxxxx") {
			t.Errorf("the error %q does not say %q about the redacted URL", err, c.want)
		}
		noSecret(t, "the connect error", err.Error(), c.secrets...)
		noSecret(t, "the log", logs.String(), c.secrets...)
	}

	logs := &testenv.LogBuffer{}
	o := app.Options{DatabaseURL: dbURL, NATSURL: "nats://" + token + "@" + hostPort}
	pool, nc, err := app.Connect(ctx, &o, zerolog.New(logs))
	if err != nil {
		t.Fatalf("Connect with the token in the URL: %v", err)
	}
	defer pool.Close()
	defer nc.Close()

	// A restart: disconnected, then reconnected.
	srv.Shutdown()
	srv = startTokenNATS(t, token, port)
	testenv.WaitFor(t, 30*time.Second, "reconnected to NATS", func() (bool, error) {
		return strings.Contains(logs.String(), "reconnected to NATS"), errors.New(logs.String())
	})
	if want := `"server":"nats://xxxxx@` + hostPort + `"`; !strings.Contains(logs.String(), want) {
		t.Errorf("the reconnect line lacks %s:\n%s", want, logs.String())
	}
	if !strings.Contains(logs.String(), "disconnected from NATS") {
		t.Errorf("no disconnect line:\n%s", logs.String())
	}

	// Back with another token: the reconnects fail authorization, reported
	// through the relay's log rather than nats.go's stderr.
	srv.Shutdown()
	startTokenNATS(t, "another-token", port)
	testenv.WaitFor(t, 30*time.Second, "authorization error logged", func() (bool, error) {
		return strings.Contains(logs.String(), "uthorization"), errors.New(logs.String())
	})
	t.Logf("log:\n%s", logs.String())
	noSecret(t, "the log", logs.String(), token)
}
