package console_test

import (
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/console"
)

// Issue 20, items 11-13 and the case of auth schemes.

// TestNoTokenAnswersOnlyLoopbackHosts: without a token, a page the operator
// visits can rebind its own name to 127.0.0.1 and read the console as
// same-origin; its requests carry that name as Host. Only a loopback name
// or address is answered.
func TestNoTokenAnswersOnlyLoopbackHosts(t *testing.T) {
	f := setup(t, console.Options{})
	f.Insert(t, row{ID: "secret-1", State: "failed", LastError: "rejected: x", Payload: `{"card":"4111-rebind"}`})
	_, port, _ := strings.Cut(strings.TrimPrefix(f.Server.URL, "http://"), ":")
	anon := f.client(t, nil)
	get := func(host, path string) (int, string) {
		t.Helper()
		req, err := http.NewRequest(http.MethodGet, f.Server.URL+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Host = host
		resp, err := anon.hc.Do(req)
		if err != nil {
			t.Fatalf("GET %s with Host %q: %v", path, host, err)
		}
		return resp.StatusCode, readAll(t, resp)
	}
	rowPath := "/ui/row?id=" + enc("secret-1")
	for _, host := range []string{"evil.example", "evil.example:" + port, "localhost.evil.example:" + port, "127.0.0.1.evil.example",
		"evil.localhost:" + port, "localhost.:" + port, "10.0.0.7:" + port, "[::ffff:127.0.0.1]:" + port, "[fe80::1%25lo]:" + port, "0.0.0.0:" + port, "2130706433:" + port} {
		for _, path := range []string{rowPath, "/ui/api/health", "/ui/rows"} {
			code, body := get(host, path)
			if code != http.StatusForbidden || strings.Contains(body, "4111-rebind") || strings.Contains(body, "secret-1") {
				t.Errorf("Host %q %s: %d %.200s, want 403 and no row data", host, path, code, body)
			}
			if !strings.Contains(body, "127.0.0.1") || !strings.Contains(body, "--console-token") {
				t.Errorf("Host %q: the refusal does not say what to do: %.300s", host, body)
			}
		}
	}
	for _, host := range []string{"127.0.0.1:" + port, "127.0.0.1", "127.3.2.1:" + port, "localhost", "localhost:" + port, "LocalHost:" + port, "[::1]:" + port, "[::1]"} {
		code, body := get(host, rowPath)
		if code != http.StatusOK || !strings.Contains(body, "4111-rebind") {
			t.Errorf("Host %q: %d %.200s, want the row's page", host, code, body)
		}
	}
	// With a token any Host is answered, and only with the token: the
	// rebinding page's origin has no credential to send.
	tf := setup(t, console.Options{Token: token})
	tf.Insert(t, row{ID: "secret-2", State: "failed", LastError: "rejected: x", Payload: `{"card":"4111-token"}`})
	for _, auth := range []bool{false, true} {
		req, _ := http.NewRequest(http.MethodGet, tf.Server.URL+"/ui/row?id="+enc("secret-2"), nil)
		req.Host = "relay.internal.example:8080"
		if auth {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body := readAll(t, resp)
		if auth != (resp.StatusCode == http.StatusOK && strings.Contains(body, "4111-token")) {
			t.Errorf("token set, Host relay.internal.example, authenticated %v: %d", auth, resp.StatusCode)
		}
	}
}

func readAll(t *testing.T, resp *http.Response) string {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// login signs in through the form and returns the session cookie's value
// and the session's CSRF token.
func login(t *testing.T, c *client, tok string) (string, string) {
	t.Helper()
	code, _, h := c.do(http.MethodPost, "/ui/login", url.Values{"token": {tok}}, nil)
	if code != http.StatusSeeOther || h.Get("Location") != "/ui/" {
		t.Fatalf("login: %d to %q", code, h.Get("Location"))
	}
	ck := regexp.MustCompile(`outbox_console_session=([^;]+)`).FindStringSubmatch(h.Get("Set-Cookie"))
	if ck == nil {
		t.Fatalf("login set no session cookie: %q", h.Get("Set-Cookie"))
	}
	return ck[1], c.csrf()
}

// TestLogoutRevokesSession: a cookie and CSRF token copied before a logout
// (from a shared machine, a proxy log, a browser profile) are refused after
// it, and the action they carry changes nothing.
func TestLogoutRevokesSession(t *testing.T) {
	f := setup(t, console.Options{Token: token})
	f.Insert(t, row{ID: "f1", State: "failed", LastError: "rejected: x", Attempts: 3})
	sess := f.client(t, nil)
	cookie, csrf := login(t, sess, token)
	if code, _ := sess.post("/ui/logout", url.Values{"csrf": {csrf}}); code != http.StatusSeeOther {
		t.Fatalf("logout: %d", code)
	}
	thief := f.client(t, http.Header{"Cookie": {"outbox_console_session=" + cookie}})
	code, body := thief.post("/ui/apply", actionForm(csrf, "redrive", "replayed", "f1"))
	if code != http.StatusUnauthorized {
		t.Errorf("apply with a cookie and CSRF token from before the logout: %d %.200s, want 401", code, body)
	}
	if code, _ := thief.get("/ui/api/health"); code != http.StatusUnauthorized {
		t.Errorf("health with the logged-out cookie: %d, want 401", code)
	}
	if code, body := thief.get("/ui/row?id=" + enc("f1")); code != http.StatusSeeOther || strings.Contains(body, "rejected: x") {
		t.Errorf("row page with the logged-out cookie: %d, want 303 to the login", code)
	}
	if got, n := f.State(t, "f1"), f.historyCount(t); got != "failed" || n != 0 {
		t.Errorf("after the replay f1 is %s with %d history rows, want failed and none", got, n)
	}

	// A session that did not log out keeps working; its own logout does
	// not end another.
	other := f.client(t, nil)
	oCookie, oCSRF := login(t, other, token)
	third := f.client(t, nil)
	_, tCSRF := login(t, third, token)
	if code, _ := third.post("/ui/logout", url.Values{"csrf": {tCSRF}}); code != http.StatusSeeOther {
		t.Fatalf("logout: %d", code)
	}
	copyOf := f.client(t, http.Header{"Cookie": {"outbox_console_session=" + oCookie}})
	if code, body := copyOf.post("/ui/apply", actionForm(oCSRF, "redrive", "live session", "f1")); code != 200 {
		t.Fatalf("apply with a live session: %d %.300s", code, body)
	}
	if got := f.State(t, "f1"); got != "scheduled" {
		t.Fatalf("after a live session's redrive f1 is %s, want scheduled", got)
	}

	// A token change is a restart with the new token: the new process
	// refuses the old cookie and CSRF token.
	f.Insert(t, row{ID: "f2", State: "failed", LastError: "rejected: y"})
	c2, err := console.New(console.Options{Token: token + "-rotated"}, "127.0.0.1:0", console.Sources{Store: f.Store, Catalog: f.Pool, Slot: "outbox_relay"})
	if err != nil {
		t.Fatal(err)
	}
	srv2 := httptest.NewServer(c2)
	defer srv2.Close()
	after := &client{t: t, base: srv2.URL, hc: copyOf.hc, header: copyOf.header}
	if code, _ := after.post("/ui/apply", actionForm(oCSRF, "redrive", "old token", "f2")); code != http.StatusUnauthorized {
		t.Errorf("apply with a session of the old token: %d, want 401", code)
	}
	if got := f.State(t, "f2"); got != "failed" {
		t.Errorf("f2 is %s after a replay under a new token, want failed", got)
	}
}

// TestTokenStrength: a blank or short token is refused at start with the
// minimum; surrounding whitespace is trimmed alike on every way in, and
// auth schemes are case-insensitive.
func TestTokenStrength(t *testing.T) {
	for _, tok := range []string{" ", "\t\n", "short-token", strings.Repeat("x", console.MinTokenLen-1), "  " + strings.Repeat("x", console.MinTokenLen-1) + "  "} {
		_, err := console.New(console.Options{Token: tok}, "127.0.0.1:0", console.Sources{})
		if !errors.Is(err, console.ErrWeakToken) || !strings.Contains(err.Error(), fmt.Sprint(console.MinTokenLen)) {
			t.Errorf("token %q: %v, want ErrWeakToken naming the minimum %d", tok, err, console.MinTokenLen)
		}
		if err != nil && strings.Contains(err.Error(), strings.TrimSpace(tok)) && strings.TrimSpace(tok) != "" {
			t.Errorf("the refusal prints the token: %v", err)
		}
		// Not even on an address other machines reach.
		if _, err := console.New(console.Options{Token: tok}, "0.0.0.0:8081", console.Sources{}); !errors.Is(err, console.ErrWeakToken) {
			t.Errorf("token %q on 0.0.0.0: %v, want ErrWeakToken", tok, err)
		}
	}
	if err := console.CheckToken(""); err != nil {
		t.Errorf("no token: %v (it means a read-only console on loopback)", err)
	}

	// Presented with and without whitespace: every way in treats it the
	// same; configured with a trailing newline (a secret file), too.
	basic := func(user, pass string) string {
		return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+pass))
	}
	var f *fixture
	for _, configured := range []string{token, token + "\n"} {
		f = setup(t, console.Options{Token: configured})
		f.Insert(t, row{ID: "f1", State: "failed", LastError: "rejected: x", Payload: `{"seen":"by-every-way"}`})
		for _, auth := range []string{"Bearer " + token, "Bearer  " + token + " ", "bearer " + token, "BEARER " + token,
			basic("alice", token), basic("alice", " "+token+"\t"), "basic " + base64.StdEncoding.EncodeToString([]byte("alice:"+token))} {
			c := f.client(t, http.Header{"Authorization": {auth}})
			if code, body := c.get("/ui/row?id=" + enc("f1")); code != 200 || !strings.Contains(body, "by-every-way") {
				t.Errorf("token %q, Authorization %q: %d, want the row's page", configured, auth, code)
			}
		}
		for _, auth := range []string{"Bearer " + token + "x", basic("alice", token+"x"), "Token " + token, "Bearer", basic("alice", " ")} {
			c := f.client(t, http.Header{"Authorization": {auth}})
			if code, body := c.get("/ui/row?id=" + enc("f1")); code != http.StatusUnauthorized || strings.Contains(body, "by-every-way") {
				t.Errorf("token %q, Authorization %q: %d, want 401", configured, auth, code)
			}
		}
		for _, typed := range []string{token, " " + token, token + "\r\n"} {
			c := f.client(t, nil)
			if code, _, h := c.do(http.MethodPost, "/ui/login", url.Values{"token": {typed}}, nil); code != http.StatusSeeOther || h.Get("Location") != "/ui/" {
				t.Errorf("token %q, login with %q: %d, want 303 to /ui/", configured, typed, code)
				continue
			}
			if code, body := c.get("/ui/row?id=" + enc("f1")); code != 200 || !strings.Contains(body, "by-every-way") {
				t.Errorf("token %q, login with %q: %d, want the row's page", configured, typed, code)
			}
		}
		if code, _ := f.client(t, nil).post("/ui/login", url.Values{"token": {"  "}}); code != http.StatusUnauthorized {
			t.Errorf("login with a blank token: %d, want 401", code)
		}
	}
	// A lower-case scheme can act too.
	lower := f.client(t, http.Header{"Authorization": {"bearer " + token}})
	if code, body := lower.post("/ui/apply", actionForm(lower.csrf(), "cancel", "scheme test", "f1")); code != 200 {
		t.Fatalf("apply with a lower-case bearer: %d %.300s", code, body)
	}
	if got := f.State(t, "f1"); got != "cancelled" {
		t.Errorf("f1 is %s, want cancelled", got)
	}
}
