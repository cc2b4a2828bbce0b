package console

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// Authentication. One shared token (--console-token) admits a request in
// any of three ways: "Authorization: Bearer <token>", basic auth with the
// token as the password (the user name is kept as who), or the login form,
// which sets a session cookie. Every way yields a principal, recorded with
// every action, and a session ID, to which the CSRF token is bound.
//
// Surrounding whitespace is never part of a token: the configured one and
// the one presented on every way in are trimmed alike, so a token pasted
// with a newline works in the login form as it does in a header.
//
// A session is a random ID the process remembers until logout or expiry;
// the cookie carries it signed with a key derived from a per-process secret
// and the token. A copied cookie is worth nothing after its logout, and a
// restart (the only way to change the token) ends every session.

const (
	sessionCookie = "outbox_console_session"
	csrfField     = "csrf"
	// maxNameLen bounds the who a client supplies (basic auth user, the
	// action's name field): it ends up in every history row.
	maxNameLen = 64
	// MinTokenLen is the shortest token accepted, in bytes after trimming:
	// there is no lockout after failed logins, so the token's length is
	// all that stands against guessing.
	MinTokenLen = 16
	// maxSessions bounds the sessions the process remembers; beyond it a
	// login ends the session closest to expiry.
	maxSessions = 1024
)

// ErrWeakToken refuses a --console-token that is blank or too short.
var ErrWeakToken = errors.New("--console-token (OUTBOX_RELAY_CONSOLE_TOKEN) is too weak")

// CheckToken refuses a token that is set but blank or shorter than
// MinTokenLen bytes once its surrounding whitespace is trimmed. Empty is
// no token: the console is then read-only and loopback-only (CheckAddr).
func CheckToken(token string) error {
	if token == "" {
		return nil
	}
	t := trimToken(token)
	if t == "" {
		return fmt.Errorf("%w: it is blank (only whitespace); give a random token of at least %d bytes, e.g. openssl rand -hex 24, or none for a read-only console on loopback", ErrWeakToken, MinTokenLen)
	}
	if len(t) < MinTokenLen {
		return fmt.Errorf("%w: it is %d bytes long; use at least %d, e.g. openssl rand -hex 24 (there is no lockout after failed logins)", ErrWeakToken, len(t), MinTokenLen)
	}
	return nil
}

// trimToken is the one rule for whitespace around a token, configured or
// presented.
func trimToken(s string) string { return strings.TrimSpace(s) }

type principalKey struct{}

// principal is who made a request, as far as the console can tell.
type principal struct {
	Who       string // "session", "bearer token", "basic auth user alice", or "no token (loopback)"
	SessionID string // what the CSRF token is bound to
	Writable  bool   // authenticated with the token and not read-only
}

func principalOf(r *http.Request) principal {
	p, _ := r.Context().Value(principalKey{}).(principal)
	return p
}

// tokenEqual compares in constant time. Hashing first makes the comparison
// independent of the lengths too, which ConstantTimeCompare is not.
func tokenEqual(given, want string) bool {
	a, b := sha256.Sum256([]byte(given)), sha256.Sum256([]byte(want))
	return subtle.ConstantTimeCompare(a[:], b[:]) == 1 && want != ""
}

func (c *Console) mac(parts ...string) string {
	m := hmac.New(sha256.New, c.key[:])
	for _, p := range parts {
		m.Write([]byte(p))
		m.Write([]byte{0})
	}
	return hex.EncodeToString(m.Sum(nil))
}

// authenticate finds the request's principal; false: none.
func (c *Console) authenticate(r *http.Request) (principal, bool) {
	if c.o.Token == "" {
		// Only ever on loopback (CheckAddr, loopbackHost), and never
		// writable: nothing that changes state works without
		// authentication.
		return principal{Who: "no token (loopback)", SessionID: "anonymous"}, true
	}
	writable := !c.o.ReadOnly
	if auth := r.Header.Get("Authorization"); auth != "" {
		// Auth schemes are case-insensitive (RFC 9110, 11.1).
		scheme, rest, _ := strings.Cut(auth, " ")
		switch {
		case strings.EqualFold(scheme, "Bearer"):
			if tokenEqual(trimToken(rest), c.o.Token) {
				return principal{Who: "bearer token", SessionID: "bearer", Writable: writable}, true
			}
		case strings.EqualFold(scheme, "Basic"):
			if user, pass, ok := r.BasicAuth(); ok && tokenEqual(trimToken(pass), c.o.Token) {
				user = cleanName(user)
				who := "basic auth"
				if user != "" {
					who = "basic auth user " + user
				}
				return principal{Who: who, SessionID: "basic:" + user, Writable: writable}, true
			}
		}
		return principal{}, false
	}
	if ck, err := r.Cookie(sessionCookie); err == nil {
		if sid, ok := c.verifySession(ck.Value); ok {
			return principal{Who: "session", SessionID: sid, Writable: writable}, true
		}
	}
	return principal{}, false
}

// newSession starts a session the process remembers and returns its cookie
// value: id.expiry.mac.
func (c *Console) newSession() (string, time.Time) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand does not fail on supported systems
	}
	id := hex.EncodeToString(b[:])
	now := time.Now()
	exp := now.Add(c.o.SessionTTL)
	c.smu.Lock()
	for sid, e := range c.sessions {
		if now.After(e) {
			delete(c.sessions, sid)
		}
	}
	for len(c.sessions) >= maxSessions {
		oldest := ""
		for sid, e := range c.sessions {
			if oldest == "" || e.Before(c.sessions[oldest]) {
				oldest = sid
			}
		}
		delete(c.sessions, oldest)
	}
	c.sessions[id] = exp
	c.smu.Unlock()
	e := strconv.FormatInt(exp.Unix(), 10)
	return id + "." + e + "." + c.mac("session", id, e), exp
}

// verifySession checks the cookie's signature and expiry, and that its
// session has not ended: a signature alone outlives a logout.
func (c *Console) verifySession(v string) (string, bool) {
	parts := strings.Split(v, ".")
	if len(parts) != 3 {
		return "", false
	}
	if !hmac.Equal([]byte(parts[2]), []byte(c.mac("session", parts[0], parts[1]))) {
		return "", false
	}
	exp, err := strconv.ParseInt(parts[1], 10, 64)
	if err != nil || time.Now().Unix() > exp {
		return "", false
	}
	c.smu.Lock()
	e, live := c.sessions[parts[0]]
	c.smu.Unlock()
	if !live || time.Now().After(e) {
		return "", false
	}
	return parts[0], true
}

// endSession forgets a session: its cookie and CSRF token stop working,
// wherever copies of them are.
func (c *Console) endSession(id string) {
	c.smu.Lock()
	delete(c.sessions, id)
	c.smu.Unlock()
}

// csrfToken is bound to the session: a token read from one session is
// worth nothing in another, and a page from before a logout is dead.
func (c *Console) csrfToken(p principal) string { return c.mac("csrf", p.SessionID) }

// authed admits authenticated requests; a browser asking for a page is sent
// to the login form, anything else gets 401.
func (c *Console) authed(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, ok := c.authenticate(r)
		if !ok {
			if r.Method == http.MethodGet && !strings.HasPrefix(r.URL.Path, "/ui/api/") && r.Header.Get("Authorization") == "" {
				http.Redirect(w, r, "/ui/login", http.StatusSeeOther)
				return
			}
			w.Header().Set("WWW-Authenticate", `Bearer realm="outbox-relay console"`)
			http.Error(w, "authentication required: the console's token (--console-token) as a bearer token, as the basic auth password, or at /ui/login", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), principalKey{}, p)))
	})
}

// writable refuses actions in read-only mode and without a token.
func (c *Console) writable(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !principalOf(r).Writable {
			why := "the console is read-only (--console-read-only)"
			if c.o.Token == "" {
				why = "the console is read-only without a token: set --console-token to redrive or cancel"
			}
			http.Error(w, why, http.StatusForbidden)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// csrf checks the form's CSRF token against the session's.
func (c *Console) csrf(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !c.parseForm(w, r) {
			return
		}
		given := r.PostForm.Get(csrfField)
		if given == "" || !hmac.Equal([]byte(given), []byte(c.csrfToken(principalOf(r)))) {
			http.Error(w, "missing or wrong CSRF token: reload the page and try again", http.StatusForbidden)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// parseForm reads the (capped) body, answering 413 when it is too large.
func (c *Console) parseForm(w http.ResponseWriter, r *http.Request) bool {
	if err := r.ParseForm(); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			http.Error(w, "request too large: tick fewer rows, or act on every row the filter matches (at most "+strconv.FormatInt(c.o.MaxRequestBytes>>10, 10)+" KiB)", http.StatusRequestEntityTooLarge)
			return false
		}
		http.Error(w, "bad form", http.StatusBadRequest)
		return false
	}
	return true
}

func (c *Console) loginPage(w http.ResponseWriter, r *http.Request) {
	c.render(w, r, "login", map[string]any{"NoToken": c.o.Token == ""}, http.StatusOK)
}

func (c *Console) login(w http.ResponseWriter, r *http.Request) {
	if !c.parseForm(w, r) {
		return
	}
	if c.o.Token == "" {
		http.Redirect(w, r, "/ui/", http.StatusSeeOther)
		return
	}
	if !tokenEqual(trimToken(r.PostForm.Get("token")), c.o.Token) {
		c.render(w, r, "login", map[string]any{"Failed": true}, http.StatusUnauthorized)
		return
	}
	v, exp := c.newSession()
	http.SetCookie(w, &http.Cookie{
		Name: sessionCookie, Value: v, Path: "/ui/", Expires: exp,
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil,
	})
	http.Redirect(w, r, "/ui/", http.StatusSeeOther)
}

func (c *Console) logout(w http.ResponseWriter, r *http.Request) {
	if p := principalOf(r); p.Who == "session" {
		c.endSession(p.SessionID)
	}
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: "", Path: "/ui/", MaxAge: -1, HttpOnly: true, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, "/ui/login", http.StatusSeeOther)
}

// cleanName keeps a client-supplied name short and printable: it is stored
// in redriven_by and the history.
func cleanName(s string) string {
	// Printable runes only: no control, format (bidi) or invalid bytes,
	// which could disguise one operator as another in a listing.
	s = strings.TrimSpace(strings.Map(func(r rune) rune {
		if r == utf8.RuneError || !unicode.IsPrint(r) {
			return -1
		}
		return r
	}, s))
	for len(s) > maxNameLen {
		_, n := utf8.DecodeLastRuneInString(s)
		s = s[:len(s)-n]
	}
	return s
}

// who is what an action records as redriven_by: the name the operator
// typed, how they authenticated, and from where.
func who(r *http.Request, name string) string {
	p := principalOf(r)
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	via := "console " + p.Who + " from " + host
	if name = cleanName(name); name != "" {
		return name + " (" + via + ")"
	}
	return via
}
