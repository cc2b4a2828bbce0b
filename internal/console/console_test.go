package console_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/console"
	"github.com/outbox-relay/outbox-relay/internal/console/consoletest"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

const token = consoletest.Token

// fixture is the shared console fixture, with this package's clients.
type fixture struct{ *consoletest.Fixture }

type row = consoletest.Row

func setup(t *testing.T, o console.Options) *fixture {
	return &fixture{consoletest.Setup(t, o)}
}

func (f *fixture) historyCount(t *testing.T) int {
	t.Helper()
	var n int
	if err := f.Pool.QueryRow(context.Background(), `SELECT count(*) FROM public.outbox_redrives`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

type client struct {
	t      *testing.T
	base   string
	hc     *http.Client
	header http.Header
}

func (f *fixture) client(t *testing.T, h http.Header) *client {
	jar, _ := cookiejar.New(nil)
	return &client{t: t, base: f.Server.URL, header: h, hc: &http.Client{
		Jar: jar,
		// Redirects are part of what is tested.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}}
}

func bearer() http.Header { return http.Header{"Authorization": {"Bearer " + token}} }

func (c *client) do(method, path string, form url.Values, extra http.Header) (int, string, http.Header) {
	c.t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, c.base+path, body)
	if err != nil {
		c.t.Fatal(err)
	}
	for k, v := range c.header {
		req.Header[k] = v
	}
	for k, v := range extra {
		req.Header[k] = v
	}
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		c.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		c.t.Fatal(err)
	}
	return resp.StatusCode, string(b), resp.Header
}

func (c *client) get(path string) (int, string) {
	code, body, _ := c.do(http.MethodGet, path, nil, nil)
	return code, body
}

func (c *client) post(path string, form url.Values) (int, string) {
	code, body, _ := c.do(http.MethodPost, path, form, nil)
	return code, body
}

var csrfRe = regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`)

// csrf reads the CSRF token from a page, as a browser's form carries it.
func (c *client) csrf() string {
	c.t.Helper()
	code, body := c.get("/ui/rows")
	m := csrfRe.FindStringSubmatch(body)
	if code != 200 || m == nil {
		c.t.Fatalf("no CSRF token on /ui/rows (%d): %.300s", code, body)
	}
	return m[1]
}

var enc = consoletest.Enc

var workIDRe = regexp.MustCompile(`href="/ui/row\?id=([A-Za-z0-9_-]+)" class="work-id"`)

// listed returns the work IDs a rows page lists, in order.
func listed(t *testing.T, body string) []string {
	t.Helper()
	var ids []string
	for _, m := range workIDRe.FindAllStringSubmatch(body, -1) {
		b, err := base64.RawURLEncoding.DecodeString(m[1])
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, string(b))
	}
	return ids
}

func actionForm(csrf, action, reason string, ids ...string) url.Values {
	v := url.Values{"csrf": {csrf}, "action": {action}, "reason": {reason}, "scope": {"selected"}}
	for _, id := range ids {
		v.Add("id", enc(id))
	}
	return v
}

func TestAuthentication(t *testing.T) {
	f := setup(t, console.Options{Token: token})
	f.Insert(t, row{ID: "f1", State: "failed", LastError: "rejected: max_payload: too big", Attempts: 3})

	anon := f.client(t, nil)
	code, _, h := anon.do(http.MethodGet, "/ui/", nil, nil)
	if code != http.StatusSeeOther || h.Get("Location") != "/ui/login" {
		t.Fatalf("GET /ui/ without a token: %d to %q, want 303 to /ui/login", code, h.Get("Location"))
	}
	for _, path := range []string{"/ui/api/health"} {
		if code, _ := anon.get(path); code != http.StatusUnauthorized {
			t.Errorf("GET %s without a token: %d, want 401", path, code)
		}
	}
	for _, path := range []string{"/ui/preview", "/ui/apply"} {
		if code, _ := anon.post(path, actionForm("x", "redrive", "r", "f1")); code != http.StatusUnauthorized {
			t.Errorf("POST %s without a token: %d, want 401", path, code)
		}
	}
	wrong := f.client(t, http.Header{"Authorization": {"Bearer " + token + "x"}})
	if code, _ := wrong.get("/ui/rows"); code != http.StatusUnauthorized {
		t.Errorf("wrong bearer token: %d, want 401", code)
	}
	wrongBasic := f.client(t, nil)
	if code, _, _ := wrongBasic.do(http.MethodGet, "/ui/rows", nil, http.Header{"Authorization": {"Basic " + base64.StdEncoding.EncodeToString([]byte("alice:nope"))}}); code != http.StatusUnauthorized {
		t.Errorf("wrong basic password: %d, want 401", code)
	}
	if code, body := anon.post("/ui/login", url.Values{"token": {"nope"}}); code != http.StatusUnauthorized || !strings.Contains(body, "Wrong token") {
		t.Errorf("login with a wrong token: %d, want 401 and a message", code)
	}

	// Bearer: pages open; an action needs the CSRF token too.
	b := f.client(t, bearer())
	if code, _ := b.get("/ui/rows"); code != 200 {
		t.Fatalf("bearer GET /ui/rows: %d", code)
	}
	if code, body := b.post("/ui/preview", actionForm("", "redrive", "r", "f1")); code != http.StatusForbidden || !strings.Contains(body, "CSRF") {
		t.Errorf("preview without CSRF token: %d %.200s, want 403", code, body)
	}
	if code, _ := b.post("/ui/apply", actionForm("0123abcd", "redrive", "r", "f1")); code != http.StatusForbidden {
		t.Errorf("apply with a wrong CSRF token: %d, want 403", code)
	}
	// A request from another site is refused before its token is read.
	csrf := b.csrf()
	if code, _, _ := b.do(http.MethodPost, "/ui/preview", actionForm(csrf, "redrive", "r", "f1"), http.Header{"Sec-Fetch-Site": {"cross-site"}}); code != http.StatusForbidden {
		t.Errorf("cross-site preview: %d, want 403", code)
	}
	if code, body := b.post("/ui/preview", actionForm(csrf, "redrive", "r", "f1")); code != 200 {
		t.Fatalf("bearer preview with CSRF token: %d %.300s", code, body)
	}
	if got := f.State(t, "f1"); got != "failed" {
		t.Fatalf("a preview changed the row: %s", got)
	}

	// Basic auth with the token as the password; the user is recorded.
	basic := f.client(t, http.Header{"Authorization": {"Basic " + base64.StdEncoding.EncodeToString([]byte("alice:"+token))}})
	bcsrf := basic.csrf()
	if bcsrf == csrf {
		t.Error("basic auth and bearer share a CSRF token")
	}

	// The login form: a session cookie; its CSRF token is its own.
	sess := f.client(t, nil)
	code, _, h = sess.do(http.MethodPost, "/ui/login", url.Values{"token": {token}}, nil)
	if code != http.StatusSeeOther || h.Get("Location") != "/ui/" {
		t.Fatalf("login: %d to %q", code, h.Get("Location"))
	}
	ck := h.Get("Set-Cookie")
	for _, want := range []string{"HttpOnly", "SameSite=Strict", "Path=/ui/"} {
		if !strings.Contains(ck, want) {
			t.Errorf("session cookie %q lacks %s", ck, want)
		}
	}
	scsrf := sess.csrf()
	if code, _ := sess.post("/ui/preview", actionForm(csrf, "redrive", "r", "f1")); code != http.StatusForbidden {
		t.Errorf("session with another principal's CSRF token: %d, want 403", code)
	}
	if code, body := sess.post("/ui/apply", actionForm(scsrf, "redrive", "login test", "f1")); code != 200 {
		t.Fatalf("session apply: %d %.300s", code, body)
	}
	if got := f.State(t, "f1"); got != "scheduled" {
		t.Fatalf("after the session's redrive: %s, want scheduled", got)
	}
	// A forged cookie is nobody.
	forged := f.client(t, http.Header{"Cookie": {"outbox_console_session=00.99999999999.abc"}})
	if code, _ := forged.get("/ui/api/health"); code != http.StatusUnauthorized {
		t.Errorf("forged session cookie: %d, want 401", code)
	}
	// Logging out ends the session.
	if code, _ := sess.post("/ui/logout", url.Values{"csrf": {scsrf}}); code != http.StatusSeeOther {
		t.Errorf("logout: %d", code)
	}
	if code, _ := sess.get("/ui/api/health"); code != http.StatusUnauthorized {
		t.Errorf("after logout: %d, want 401", code)
	}
}

func TestSecurityHeaders(t *testing.T) {
	f := setup(t, console.Options{Token: token})
	b := f.client(t, bearer())
	for _, path := range []string{"/ui/", "/ui/rows", "/ui/history", "/ui/login"} {
		code, _, h := b.do(http.MethodGet, path, nil, nil)
		if code != 200 {
			t.Fatalf("GET %s: %d", path, code)
		}
		csp := h.Get("Content-Security-Policy")
		if !strings.Contains(csp, "script-src 'self'") || strings.Contains(csp, "unsafe-inline") || !strings.Contains(csp, "frame-ancestors 'none'") {
			t.Errorf("%s: Content-Security-Policy %q", path, csp)
		}
		if h.Get("X-Frame-Options") != "DENY" || h.Get("Cache-Control") != "no-store" || h.Get("X-Content-Type-Options") != "nosniff" {
			t.Errorf("%s: headers %v", path, h)
		}
	}
	code, body, h := b.do(http.MethodGet, "/ui/static/console.js", nil, nil)
	if code != 200 || !strings.Contains(h.Get("Content-Type"), "javascript") || !strings.Contains(body, "DOMParser") {
		t.Errorf("console.js: %d %s", code, h.Get("Content-Type"))
	}
	// No page has inline script: the CSP would block it, so it must not be
	// needed.
	_, page := b.get("/ui/")
	if regexp.MustCompile(`<script(?:\s[^>]*)?>[^<]`).MatchString(page) || strings.Contains(page, " onclick=") {
		t.Error("the overview has inline script")
	}
}

func TestReadOnly(t *testing.T) {
	t.Run("flag", func(t *testing.T) {
		f := setup(t, console.Options{Token: token, ReadOnly: true})
		f.Insert(t, row{ID: "f1", State: "failed", LastError: "rejected: x"})
		b := f.client(t, bearer())
		code, body := b.get("/ui/rows")
		if code != 200 || strings.Contains(body, `id="preview"`) || !strings.Contains(body, "read-only") {
			t.Errorf("read-only rows page: %d, action form shown or mode not said", code)
		}
		csrf := csrfRe.FindStringSubmatch(body)
		if csrf == nil {
			t.Fatal("no CSRF token on the page")
		}
		for _, path := range []string{"/ui/preview", "/ui/apply"} {
			if code, _ := b.post(path, actionForm(csrf[1], "redrive", "r", "f1")); code != http.StatusForbidden {
				t.Errorf("read-only POST %s: %d, want 403", path, code)
			}
		}
		if got := f.State(t, "f1"); got != "failed" || f.historyCount(t) != 0 {
			t.Errorf("read-only console changed the row: %s", got)
		}
	})
	t.Run("no token", func(t *testing.T) {
		f := setup(t, console.Options{})
		f.Insert(t, row{ID: "f1", State: "failed", LastError: "rejected: x"})
		anon := f.client(t, nil)
		code, body := anon.get("/ui/rows")
		if code != 200 || !strings.Contains(body, "no token") {
			t.Fatalf("rows without a token on loopback: %d", code)
		}
		csrf := csrfRe.FindStringSubmatch(body)
		for _, path := range []string{"/ui/preview", "/ui/apply"} {
			code, body := anon.post(path, actionForm(csrf[1], "redrive", "r", "f1"))
			if code != http.StatusForbidden || !strings.Contains(body, "--console-token") {
				t.Errorf("POST %s without a token: %d %.200s, want 403 naming --console-token", path, code, body)
			}
		}
		if got := f.State(t, "f1"); got != "failed" {
			t.Errorf("row changed: %s", got)
		}
	})
}

func TestCheckAddr(t *testing.T) {
	for _, addr := range []string{":8080", "0.0.0.0:8080", "[::]:8080", "10.1.2.3:8080", "db.example:8080"} {
		if err := console.CheckAddr(addr, ""); !errors.Is(err, console.ErrInsecureAddr) {
			t.Errorf("CheckAddr(%q, no token) = %v, want ErrInsecureAddr", addr, err)
		}
		if err := console.CheckAddr(addr, token); err != nil {
			t.Errorf("CheckAddr(%q, token) = %v", addr, err)
		}
		if _, err := console.New(console.Options{}, addr, console.Sources{}); !errors.Is(err, console.ErrInsecureAddr) {
			t.Errorf("New on %q without a token: %v, want ErrInsecureAddr", addr, err)
		}
	}
	for _, addr := range []string{"127.0.0.1:8080", "127.0.0.2:0", "[::1]:8080", "localhost:8080"} {
		if err := console.CheckAddr(addr, ""); err != nil {
			t.Errorf("CheckAddr(%q, no token) = %v", addr, err)
		}
	}
}

func TestRequestSizeCap(t *testing.T) {
	f := setup(t, console.Options{Token: token, MaxRequestBytes: 4 << 10})
	b := f.client(t, bearer())
	csrf := b.csrf()
	big := actionForm(csrf, "redrive", strings.Repeat("x", 8<<10), "f1")
	if code, body := b.post("/ui/preview", big); code != http.StatusRequestEntityTooLarge {
		t.Errorf("8 KiB form over a 4 KiB cap: %d %.200s, want 413", code, body)
	}
	var ids []string
	for i := range 600 {
		ids = append(ids, fmt.Sprintf("id-%d", i))
	}
	f2 := setup(t, console.Options{Token: token})
	b2 := f2.client(t, bearer())
	if code, body := b2.post("/ui/preview", actionForm(b2.csrf(), "redrive", "r", ids...)); code != http.StatusBadRequest || !strings.Contains(body, "at most 500") {
		t.Errorf("600 work IDs: %d %.300s, want 400 naming the cap", code, body)
	}
}

// hostile values, as a producer could write them.
const (
	xssScript = `<script>alert(1)</script>`
	xssAttr   = `"><img src=x onerror=alert(2)>`
	xssEsc    = "evil\x1b[2K\rforged\u202e"
	// work_id's CHECK refuses control characters, not bidi controls.
	xssID = "evil\u202egnp.exe"
)

func TestHostileValuesEscaped(t *testing.T) {
	f := setup(t, console.Options{Token: token})
	f.Insert(t,
		row{ID: xssScript, Kind: xssAttr, State: "failed", LastError: "rejected: bad: " + xssScript, Payload: `{"html":"` + strings.ReplaceAll(xssAttr, `"`, `\"`) + `"}`},
		row{ID: xssAttr, State: "failed", LastError: "uncertain: timeout " + xssAttr, Payload: `{"s":"</pre><script>alert(3)</script>"}`},
		row{ID: xssID, State: "failed", LastError: "rejected: x " + xssEsc, Payload: `{"e":"` + "\u202e" + `"}`},
	)
	b := f.client(t, bearer())
	csrf := b.csrf()
	hostileReason := "reason " + xssScript + xssAttr
	if code, body := b.post("/ui/apply", func() url.Values {
		v := actionForm(csrf, "cancel", hostileReason, xssAttr)
		v.Set("name", `<b>mallory</b>`+"\x1b[1m")
		return v
	}()); code != 200 {
		t.Fatalf("cancel: %d %.300s", code, body)
	}
	pages := map[string]string{}
	for _, path := range []string{"/ui/rows?state=any", "/ui/row?id=" + enc(xssScript), "/ui/row?id=" + enc(xssAttr), "/ui/row?id=" + enc(xssID),
		"/ui/history", "/ui/history?work_id=" + url.QueryEscape(xssAttr), "/ui/", "/ui/rows?kind=" + url.QueryEscape(xssAttr)} {
		code, body := b.get(path)
		if code != 200 {
			t.Fatalf("GET %s: %d", path, code)
		}
		pages[path] = body
	}
	code, body := b.post("/ui/preview", actionForm(csrf, "redrive", hostileReason, xssScript, xssID))
	if code != 200 {
		t.Fatalf("preview: %d", code)
	}
	pages["preview"] = body
	for path, body := range pages {
		for _, raw := range []string{"<script>alert", "<img src=x", "\x1b", "\u202e", "<b>mallory"} {
			if strings.Contains(body, raw) {
				i := strings.Index(body, raw)
				t.Errorf("%s shows %q raw: ...%s...", path, raw, body[max(0, i-80):min(len(body), i+80)])
			}
		}
	}
	for path, want := range map[string]string{
		"/ui/rows?state=any":                        "&lt;script&gt;alert(1)&lt;/script&gt;",
		"/ui/row?id=" + enc(xssAttr):                "&lt;/pre&gt;&lt;script&gt;alert(3)&lt;/script&gt;",
		"/ui/row?id=" + enc(xssID):                  `\x1b[2K\rforged\u202e`,
		"/ui/history":                               "&lt;b&gt;mallory&lt;/b&gt;",
		"preview":                                   "&lt;script&gt;alert(1)&lt;/script&gt;",
		"/ui/rows?kind=" + url.QueryEscape(xssAttr): "&#34;&gt;&lt;img src=x onerror=alert(2)&gt;",
	} {
		if !strings.Contains(pages[path], want) {
			t.Errorf("%s lacks the escaped %q", path, want)
		}
	}
	// The history keeps the reason as given; who lost its control bytes.
	hist, err := f.Store.History(context.Background(), xssAttr)
	if err != nil || len(hist) != 1 {
		t.Fatalf("history: %v %v", hist, err)
	}
	if hist[0].Reason != hostileReason || strings.Contains(hist[0].By, "\x1b") || !strings.HasPrefix(hist[0].By, "<b>mallory</b>[1m (console bearer token from 127.0.0.1)") {
		t.Errorf("history row: reason %q by %q", hist[0].Reason, hist[0].By)
	}
	// The JSON API escapes markup too.
	f.Insert(t, row{ID: "j1", State: "failed", LastError: "rejected: " + xssScript})
	_, j := b.get("/ui/api/health")
	if strings.Contains(j, "<script>") {
		t.Error("health JSON holds raw markup")
	}
	var h console.Health
	if err := json.Unmarshal([]byte(j), &h); err != nil {
		t.Fatal(err)
	}
}

// health reads /ui/api/health and its counts by state.
func (c *client) health(t *testing.T) (console.Health, map[string]int64) {
	t.Helper()
	var h console.Health
	_, j := c.get("/ui/api/health")
	if err := json.Unmarshal([]byte(j), &h); err != nil {
		t.Fatal(err)
	}
	counts := map[string]int64{}
	for _, s := range h.ByState {
		counts[s.Name] = s.N
	}
	return h, counts
}

var hiddenIDRe = regexp.MustCompile(`<input type="hidden" name="id" value="([A-Za-z0-9_-]+)">`)

// confirmIDs reads the work IDs a preview's confirmation carries.
func confirmIDs(t *testing.T, body string) []string {
	t.Helper()
	var ids []string
	for _, m := range hiddenIDRe.FindAllStringSubmatch(body, -1) {
		b, _ := base64.RawURLEncoding.DecodeString(m[1])
		ids = append(ids, string(b))
	}
	return ids
}

func TestPreviewThenApply(t *testing.T) {
	f := setup(t, console.Options{Token: token})
	f.Insert(t,
		row{ID: "f1", State: "failed", LastError: "rejected: max_payload: 2MB", Attempts: 5, Age: 3 * time.Second},
		row{ID: "f2", State: "failed", LastError: "uncertain: timeout", Attempts: 5, Age: 2 * time.Second},
		row{ID: "fx", State: "failed", LastError: "rejected: x", Attempts: 5, Expired: true, Age: time.Second},
		row{ID: "r1", State: "ready"},
		row{ID: "p1", State: "published", StreamSeq: 42},
	)
	b := f.client(t, bearer())
	csrf := b.csrf()
	form := actionForm(csrf, "redrive", "INC-7: limit raised", "f1", "f2", "fx", "r1", "p1", "nope")
	form.Set("name", "alice")
	code, body := b.post("/ui/preview", form)
	if code != 200 {
		t.Fatalf("preview: %d %.300s", code, body)
	}
	for _, want := range []string{`<strong id="would-change">2</strong>`, `<strong id="would-refuse">4</strong>`,
		"its deadline passed; redrive it with a new one (new deadline) or none (no deadline)",
		"ready: already on its way", "published: the broker has it", "not found", "uncertain outcome"} {
		if !strings.Contains(body, want) {
			t.Errorf("preview lacks %q", want)
		}
	}
	ids := confirmIDs(t, body)
	if !slices.Equal(ids, []string{"f1", "f2"}) {
		t.Fatalf("the confirmation carries %q, want the rows the preview would change", ids)
	}
	// The preview changed nothing.
	for id, want := range map[string]string{"f1": "failed", "f2": "failed", "fx": "failed", "r1": "ready"} {
		if got := f.State(t, id); got != want {
			t.Errorf("after the preview %s is %s", id, got)
		}
	}
	if n := f.historyCount(t); n != 0 {
		t.Errorf("the preview wrote %d history rows", n)
	}

	// Confirm what the preview showed: exactly those rows change.
	confirm := actionForm(csrf, "redrive", "INC-7: limit raised", ids...)
	confirm.Set("name", "alice")
	confirm.Set("deadline", "keep")
	code, body = b.post("/ui/apply", confirm)
	if code != 200 || !strings.Contains(body, `<strong id="changed-count">2</strong>`) {
		t.Fatalf("apply: %d %.500s", code, body)
	}
	for id, want := range map[string]string{"f1": "scheduled", "f2": "scheduled", "fx": "failed", "r1": "ready", "p1": "published"} {
		if got := f.State(t, id); got != want {
			t.Errorf("after the redrive %s is %s, want %s", id, got, want)
		}
	}
	var by, reason string
	if err := f.Pool.QueryRow(context.Background(), `SELECT redriven_by, redrive_reason FROM public.outbox WHERE work_id = 'f1'`).Scan(&by, &reason); err != nil {
		t.Fatal(err)
	}
	if by != "alice (console bearer token from 127.0.0.1)" || reason != "INC-7: limit raised" {
		t.Errorf("f1 redriven_by %q, reason %q", by, reason)
	}
	for _, id := range []string{"f1", "f2"} {
		h, err := f.Store.History(context.Background(), id)
		if err != nil || len(h) != 1 || h[0].Action != store.ActionRedrive || h[0].By != by || h[0].Reason != reason || h[0].PreviousState != "failed" || h[0].PreviousAttempts != 5 {
			t.Errorf("history of %s: %+v %v", id, h, err)
		}
	}
	if _, page := b.get("/ui/history?work_id=f2"); !strings.Contains(page, "INC-7: limit raised") || !strings.Contains(page, "uncertain: timeout") {
		t.Error("the history page lacks f2's redrive and its previous error")
	}

	// A row that moved between preview and confirmation is refused, not
	// changed by surprise.
	f.Insert(t, row{ID: "f3", State: "failed", LastError: "rejected: y"})
	_, body = b.post("/ui/preview", actionForm(csrf, "cancel", "stop", "f3"))
	if ids := confirmIDs(t, body); !slices.Equal(ids, []string{"f3"}) {
		t.Fatalf("cancel preview carries %q", ids)
	}
	if _, err := f.Pool.Exec(context.Background(), `UPDATE public.outbox SET state = 'scheduled' WHERE work_id = 'f3'`); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Pool.Exec(context.Background(), `UPDATE public.outbox SET state = 'running', claimed_by = 'w', lease_until = now() + interval '1 minute' WHERE work_id = 'f3'`); err != nil {
		t.Fatal(err)
	}
	_, body = b.post("/ui/apply", actionForm(csrf, "cancel", "stop", "f3"))
	if !strings.Contains(body, `<strong id="refused-count">1</strong>`) || !strings.Contains(body, "running: a worker holds it") {
		t.Errorf("apply on a row that moved: %.600s", body)
	}
	if got := f.State(t, "fx"); got != "failed" {
		t.Fatal(got)
	}

	// The expired row needs a deadline decision: with none, it goes.
	form = actionForm(csrf, "redrive", "INC-7 late", "fx")
	form.Set("deadline", "new")
	form.Set("expires_at", "2h")
	_, body = b.post("/ui/preview", form)
	if !strings.Contains(body, `<strong id="would-change">1</strong>`) || !strings.Contains(body, "new deadline 20") {
		t.Fatalf("preview with a new deadline: %.600s", body)
	}
	form.Set("deadline", "none")
	if _, body = b.post("/ui/apply", form); !strings.Contains(body, `<strong id="changed-count">1</strong>`) {
		t.Fatalf("redrive with no deadline: %.600s", body)
	}
	var expires *time.Time
	if err := f.Pool.QueryRow(context.Background(), `SELECT expires_at FROM public.outbox WHERE work_id = 'fx'`).Scan(&expires); err != nil || expires != nil || f.State(t, "fx") != "scheduled" {
		t.Errorf("fx after redrive with no deadline: %s, expires %v, %v", f.State(t, "fx"), expires, err)
	}

	// A reason is required.
	if code, body := b.post("/ui/preview", actionForm(csrf, "redrive", "  ", "f1")); code != http.StatusBadRequest || !strings.Contains(body, "reason is required") {
		t.Errorf("no reason: %d %.200s", code, body)
	}
}

func TestFilterAction(t *testing.T) {
	f := setup(t, console.Options{Token: token, MaxActionRows: 3})
	f.Insert(t,
		row{ID: "a1", Kind: "a", State: "scheduled", Age: 5 * time.Second},
		row{ID: "a2", Kind: "a", State: "scheduled", Age: 4 * time.Second},
		row{ID: "b1", Kind: "b", State: "scheduled", Age: 3 * time.Second},
		row{ID: "a3", Kind: "a", State: "scheduled", Age: 2 * time.Second},
		row{ID: "a4", Kind: "a", State: "scheduled", Age: time.Second},
	)
	b := f.client(t, bearer())
	csrf := b.csrf()
	v := url.Values{"csrf": {csrf}, "action": {"cancel"}, "reason": {"bad deploy"}, "scope": {"filter"}, "state": {"scheduled"}, "kind": {"a"}}
	code, body := b.post("/ui/preview", v)
	if code != 200 {
		t.Fatalf("filter preview: %d %.300s", code, body)
	}
	if !strings.Contains(body, `<strong id="would-change">3</strong>`) || !strings.Contains(body, "takes the oldest 3") {
		t.Fatalf("filter preview over the cap: %.500s", body)
	}
	// The confirmation carries the filter and a digest of the previewed
	// rows (TestFilterConfirmByDigest).
	confirm := confirmForm(t, body)
	if _, body = b.post("/ui/apply", confirm); !strings.Contains(body, `<strong id="changed-count">3</strong>`) {
		t.Fatalf("apply: %.500s", body)
	}
	for id, want := range map[string]string{"a1": "cancelled", "a2": "cancelled", "a3": "cancelled", "a4": "scheduled", "b1": "scheduled"} {
		if got := f.State(t, id); got != want {
			t.Errorf("%s is %s, want %s", id, got, want)
		}
	}
}

func TestPagingAndFilters(t *testing.T) {
	f := setup(t, console.Options{Token: token, PageSize: 3})
	var all []string
	for i := range 8 {
		id := fmt.Sprintf("w%02d", i)
		r := row{ID: id, State: "failed", LastError: "rejected: max_payload: big", Kind: "a", Age: time.Duration(20-i) * time.Minute}
		if i%2 == 1 {
			r.LastError, r.Kind = "uncertain: timeout", "b"
		}
		if i >= 6 {
			r.Age = time.Duration(10-i) * time.Second
		}
		all = append(all, id)
		f.Insert(t, r)
	}
	f.Insert(t, row{ID: "s1", State: "scheduled"}, row{ID: "p1", State: "published", StreamSeq: 7, Age: time.Hour})
	// Two rows with the same created_at: the keyset's work_id breaks the tie.
	if _, err := f.Pool.Exec(context.Background(), `UPDATE public.outbox SET created_at = (SELECT created_at FROM public.outbox WHERE work_id = 'w02') WHERE work_id = 'w03'`); err != nil {
		t.Fatal(err)
	}
	b := f.client(t, bearer())
	var got []string
	path := "/ui/rows?state=failed"
	for pages := 0; path != ""; pages++ {
		if pages > 5 {
			t.Fatal("paging does not end")
		}
		code, body := b.get(path)
		if code != 200 {
			t.Fatalf("GET %s: %d", path, code)
		}
		ids := listed(t, body)
		if len(ids) > 3 {
			t.Fatalf("page of %d rows, want at most 3", len(ids))
		}
		got = append(got, ids...)
		path = ""
		if m := regexp.MustCompile(`href="(/ui/rows\?[^"]*)" id="next-page"`).FindStringSubmatch(body); m != nil {
			path = strings.ReplaceAll(m[1], "&amp;", "&")
		}
	}
	if !slices.Equal(got, all) {
		t.Errorf("pages listed %q, want %q", got, all)
	}
	for q, want := range map[string][]string{
		"state=failed&kind=b":                    {"w01", "w03", "w05", "w07"},
		"state=failed&error=uncertain":           {"w01", "w03", "w05", "w07"},
		"state=failed&error=rejected&min_age=1h": nil,
		"state=failed&error=rejected&min_age=5m": {"w00", "w02", "w04"},
		"state=failed&max_age=1m":                {"w06", "w07"},
		"state=scheduled":                        {"s1"},
		"state=any&error=none&limit=10":          {"p1", "s1"},
		"state=published":                        {"p1"},
	} {
		code, body := b.get("/ui/rows?" + q)
		if code != 200 {
			t.Errorf("%s: %d", q, code)
			continue
		}
		ids := listed(t, body)
		if q == "state=failed&kind=b" || q == "state=failed&error=uncertain" {
			// PageSize 3: the first page.
			want = want[:3]
		}
		if !slices.Equal(ids, want) {
			t.Errorf("%s listed %q, want %q", q, ids, want)
		}
	}
	_, body := b.get("/ui/rows?state=published")
	if !strings.Contains(body, "seq 7") {
		t.Error("a published row's stream_seq is not shown")
	}
	if _, body := b.get("/ui/rows?state=failed&kind=a"); !strings.Contains(body, "never accepted") {
		t.Error("a failed row does not say it was never accepted")
	}
	for _, q := range []string{"state=bogus", "error=bogus", "min_age=yesterday"} {
		if code, _ := b.get("/ui/rows?" + q); code != http.StatusBadRequest {
			t.Errorf("%s: %d, want 400", q, code)
		}
	}
}

func TestOverview(t *testing.T) {
	f := setup(t, console.Options{Token: token})
	f.Insert(t,
		row{ID: "f1", State: "failed", LastError: "rejected: max_payload: big"},
		row{ID: "f2", State: "failed", LastError: "rejected: max_payload: big", Age: 3 * time.Hour},
		row{ID: "s1", State: "scheduled"},
	)
	b := f.client(t, bearer())
	code, body := b.get("/ui/")
	if code != 200 {
		t.Fatal(code)
	}
	for _, want := range []string{`id="role">console only<`, "rejected: max_payload", "slot <code>outbox_relay</code>: <span data-field=\"slot_state\">missing"} {
		if !strings.Contains(body, want) {
			t.Errorf("overview lacks %q", want)
		}
	}
	h, counts := b.health(t)
	if counts["failed"] != 2 || counts["scheduled"] != 1 || len(h.Problems) != 0 {
		t.Errorf("health: %+v", h)
	}
	if len(h.RecentFailures) != 1 || h.RecentFailures[0].N != 1 || len(h.FailedByReason) != 1 || h.FailedByReason[0].N != 2 {
		t.Errorf("failures: last hour %+v, all %+v", h.RecentFailures, h.FailedByReason)
	}
	if len(h.Samples) == 0 || h.ChartPoints == "" {
		t.Errorf("no lag sample: %+v", h.Samples)
	}
}

// Every tab and browser polls the overview each refresh interval, and each
// read runs the table's counts: requests within one interval share one read,
// those that come while it runs wait for it, and an action makes the next
// look read afresh (G16).
func TestOverviewReadOncePerInterval(t *testing.T) {
	f := setup(t, console.Options{Token: token, Refresh: time.Minute})
	f.Insert(t, row{ID: "f1", State: "failed", LastError: "rejected: max_payload: big"})
	b := f.client(t, bearer())
	var wg sync.WaitGroup
	for i := range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			path := "/ui/api/health"
			if i%2 == 0 {
				path = "/ui/"
			}
			req, err := http.NewRequest(http.MethodGet, f.Server.URL+path, nil)
			if err != nil {
				t.Error(err)
				return
			}
			req.Header.Set("Authorization", "Bearer "+token)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Errorf("GET %s: %d", path, resp.StatusCode)
			}
		}()
	}
	wg.Wait()
	if n := console.OverviewReads(f.Console); n != 1 {
		t.Fatalf("24 overview requests within one interval read the overview %d times, want 1", n)
	}
	var h console.Health
	if _, j := b.get("/ui/api/health"); json.Unmarshal([]byte(j), &h) != nil || h.ByState[4].N != 1 {
		t.Fatalf("cached overview: %+v", h)
	}
	code, _ := b.post("/ui/apply", actionForm(b.csrf(), "cancel", "test", "f1"))
	if code != http.StatusOK {
		t.Fatalf("cancel: %d", code)
	}
	if _, j := b.get("/ui/api/health"); json.Unmarshal([]byte(j), &h) != nil || h.ByState[4].N != 0 || h.ByState[5].N != 1 {
		t.Fatalf("overview after a cancel: %+v", h.ByState)
	}
	if n := console.OverviewReads(f.Console); n != 2 {
		t.Fatalf("after an action the overview was read %d times in all, want 2", n)
	}
}

func TestOverviewWithDatabaseDown(t *testing.T) {
	// The console is most needed when something is broken: a part it
	// cannot read is a problem line, not a failed page.
	f := setup(t, console.Options{Token: token})
	b := f.client(t, bearer())
	f.Pool.Close()
	code, body := b.get("/ui/")
	if code != 200 || !strings.Contains(body, "count rows: ") {
		t.Fatalf("overview with the pool closed: %d %.300s", code, body)
	}
}
