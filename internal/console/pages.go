package console

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/termsafe"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// Work IDs travel in forms and links base64url-encoded: a browser rewrites
// line breaks in form values (CR and LF become CRLF), and an ID must come
// back byte for byte to select the row it names.
func encodeID(id string) string { return base64.RawURLEncoding.EncodeToString([]byte(id)) }

func decodeID(s string) (string, error) {
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return "", fmt.Errorf("bad work ID encoding %q", s)
	}
	return string(b), nil
}

var pages = []string{"login", "overview", "rows", "row", "history", "preview", "result", "error"}

// formatTS shows a row's time. A row written before migration 0008 may
// hold 'infinity' or '-infinity' (the store reads them as wire.Infinity and
// wire.NegInfinity): shown as such, not as a year no one wrote.
func formatTS(t time.Time) string {
	if t.Equal(wire.Infinity) || t.Equal(wire.NegInfinity) {
		return wire.FormatTime(t)
	}
	return t.UTC().Format("2006-01-02 15:04:05.000Z")
}

func parseTemplates() (map[string]*template.Template, error) {
	funcs := template.FuncMap{
		// show makes control, bidi and other invisible characters visible
		// (as Go escapes, in quotes); html/template then escapes the rest.
		"show": termsafe.String,
		"id":   encodeID,
		"ts": func(t time.Time) string {
			if t.IsZero() {
				return ""
			}
			return formatTS(t)
		},
		"tsp": func(t *time.Time) string {
			if t == nil {
				return ""
			}
			return formatTS(*t)
		},
		"i64p": func(v *int64) string {
			if v == nil {
				return ""
			}
			return strconv.FormatInt(*v, 10)
		},
		"secs":  func(f float64) string { return strconv.FormatFloat(f, 'f', 1, 64) + "s" },
		"bytes": formatBytes,
		"runes": utf8.RuneCountInString,
	}
	out := map[string]*template.Template{}
	for _, p := range pages {
		t, err := template.New("layout.html").Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/"+p+".html")
		if err != nil {
			return nil, fmt.Errorf("console: parse template %s: %w", p, err)
		}
		out[p] = t
	}
	return out, nil
}

func formatBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return strconv.FormatFloat(float64(n)/(1<<30), 'f', 1, 64) + " GiB"
	case n >= 1<<20:
		return strconv.FormatFloat(float64(n)/(1<<20), 'f', 1, 64) + " MiB"
	case n >= 1<<10:
		return strconv.FormatFloat(float64(n)/(1<<10), 'f', 1, 64) + " KiB"
	}
	return strconv.FormatInt(n, 10) + " B"
}

// page is what every template gets.
type page struct {
	Title    string
	Who      string
	CSRF     string
	Writable bool
	ReadOnly bool
	NoToken  bool
	LoggedIn bool // a session cookie: offer a logout
	Refresh  int  // seconds, for the overview's script
	Data     any
}

func (c *Console) render(w http.ResponseWriter, r *http.Request, name string, data any, status int) {
	p := principalOf(r)
	pg := page{
		Title: name, Who: p.Who, Writable: p.Writable, ReadOnly: c.o.ReadOnly, NoToken: c.o.Token == "",
		LoggedIn: p.Who == "session", Refresh: int(c.o.Refresh / time.Second), Data: data,
	}
	if p.SessionID != "" {
		pg.CSRF = c.csrfToken(p)
	}
	var buf bytes.Buffer
	if err := c.tmpl[name].Execute(&buf, pg); err != nil {
		http.Error(w, "render "+name+": "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

// fail shows an error page. msg is plain text: the template escapes it.
func (c *Console) fail(w http.ResponseWriter, r *http.Request, status int, msg string) {
	c.render(w, r, "error", msg, status)
}

func (c *Console) overview(w http.ResponseWriter, r *http.Request) {
	c.render(w, r, "overview", c.cachedHealth(r.Context()), http.StatusOK)
}

// parseAge reads an age: a Go duration or whole days ("7d").
func parseAge(s string) (time.Duration, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, nil
	}
	if d, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(d)
		if err != nil || n < 0 || n > 100000 {
			return 0, fmt.Errorf("age %q: want a duration like 90m, 24h or 7d", s)
		}
		return time.Duration(n) * 24 * time.Hour, nil
	}
	v, err := time.ParseDuration(s)
	if err != nil || v < 0 {
		return 0, fmt.Errorf("age %q: want a duration like 90m, 24h or 7d", s)
	}
	return v, nil
}

// filterForm is the rows table's filter, as the query string and the action
// form carry it.
type filterForm struct {
	State, Kind, Error, MinAge, MaxAge string
}

// "any" state is spelled out so that the default, failed (the dead
// letters), can be the empty form's.
const anyState = "any"

func readFilter(v url.Values) filterForm {
	f := filterForm{State: v.Get("state"), Kind: v.Get("kind"), Error: v.Get("error"), MinAge: v.Get("min_age"), MaxAge: v.Get("max_age")}
	if f.State == "" {
		f.State = store.StateFailed
	}
	return f
}

func (f filterForm) store() (store.ListFilter, error) {
	var lf store.ListFilter
	if f.State != anyState {
		known := false
		for _, s := range store.States {
			known = known || s == f.State
		}
		if !known {
			return lf, fmt.Errorf("state %q: want one of %s or %s", f.State, strings.Join(store.States, ", "), anyState)
		}
		lf.State = f.State
	}
	lf.Kind, lf.ErrorClass = f.Kind, f.Error
	var err error
	if lf.MinAge, err = parseAge(f.MinAge); err != nil {
		return lf, fmt.Errorf("older than: %w", err)
	}
	if lf.MaxAge, err = parseAge(f.MaxAge); err != nil {
		return lf, fmt.Errorf("newer than: %w", err)
	}
	return lf, nil
}

func (f filterForm) query() url.Values {
	v := url.Values{}
	v.Set("state", f.State)
	for k, s := range map[string]string{"kind": f.Kind, "error": f.Error, "min_age": f.MinAge, "max_age": f.MaxAge} {
		if s != "" {
			v.Set(k, s)
		}
	}
	return v
}

type rowsData struct {
	Filter       filterForm
	States       []string
	ErrorClasses []string
	Rows         []store.ListedRow
	// Next and First link the next and the first page ("" on the last and
	// the first). Built from url.Values, so safe as a URL: html/template
	// would otherwise escape the query's & and = as data.
	Next      template.URL
	First     template.URL
	Limit     int
	MaxAction int
	Err       string
	// Watermark is the newest watermark (--on-publish none), read when a
	// row on the page is covered by it: the evidence those rows have.
	Watermark *store.Watermark
}

// watermarkFor reads the newest watermark when one of rows is covered by it.
// It is read after the rows: a watermark only grows, so the one read covers
// every row the rows' statement saw covered.
func (c *Console) watermarkFor(ctx context.Context, rows ...store.ListedRow) (*store.Watermark, error) {
	for _, r := range rows {
		if r.Covered {
			w, found, err := c.src.Store.LatestWatermark(ctx)
			if err != nil || !found {
				return nil, err
			}
			return &w, nil
		}
	}
	return nil, nil
}

func (c *Console) rows(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := readFilter(q)
	d := rowsData{Filter: f, States: append([]string{anyState}, store.States...), ErrorClasses: append(append([]string{}, store.ErrorClasses...), store.ErrorClassNone),
		Limit: c.o.PageSize, MaxAction: c.o.MaxActionRows}
	if l, err := strconv.Atoi(q.Get("limit")); err == nil && l > 0 {
		d.Limit = min(l, MaxPageSize)
	}
	lf, err := f.store()
	if err != nil {
		d.Err = err.Error()
		c.render(w, r, "rows", d, http.StatusBadRequest)
		return
	}
	if at := q.Get("after_t"); at != "" {
		t, terr := time.Parse(time.RFC3339Nano, at)
		id, ierr := decodeID(q.Get("after_id"))
		if terr != nil || ierr != nil {
			d.Err = "bad page cursor"
			c.render(w, r, "rows", d, http.StatusBadRequest)
			return
		}
		lf.After = &store.Cursor{CreatedAt: t, WorkID: id}
		d.First = template.URL("/ui/rows?" + f.query().Encode())
	}
	lf.Limit, lf.PayloadChars = d.Limit+1, DefaultPayloadChars
	rows, err := c.src.Store.ListRows(r.Context(), lf)
	if errors.Is(err, store.ErrBadFilter) {
		d.Err = strings.TrimPrefix(err.Error(), store.ErrBadFilter.Error()+": ")
		c.render(w, r, "rows", d, http.StatusBadRequest)
		return
	}
	if err != nil {
		c.fail(w, r, http.StatusInternalServerError, "list rows: "+safeError(err))
		return
	}
	if len(rows) > d.Limit {
		rows = rows[:d.Limit]
		last := rows[len(rows)-1]
		nq := f.query()
		nq.Set("after_t", last.CreatedAt.UTC().Format(time.RFC3339Nano))
		nq.Set("after_id", encodeID(last.WorkID))
		if d.Limit != c.o.PageSize {
			nq.Set("limit", strconv.Itoa(d.Limit))
		}
		d.Next = template.URL("/ui/rows?" + nq.Encode())
	}
	d.Rows = rows
	if d.Watermark, err = c.watermarkFor(r.Context(), rows...); err != nil {
		c.fail(w, r, http.StatusInternalServerError, "read the watermark: "+safeError(err))
		return
	}
	c.render(w, r, "rows", d, http.StatusOK)
}

type rowData struct {
	Row       store.ListedRow
	History   []store.History
	Watermark *store.Watermark // set when the row is covered by it
	// NoHistory says why the history cannot be read (historyGrant).
	NoHistory string
}

// historyGrant is what to do when the console's role may not read the
// history: `run --console` serves it on the relay's role, which
// sql/roles.sql did not grant the read before. ok is false for any other
// error.
func historyGrant(err error) (msg string, ok bool) {
	var g *store.HistoryGrantError
	if !errors.As(err, &g) {
		return "", false
	}
	return "this console's database role may not read the redrive and cancel history " + g.Table + ": run " + g.Grant() +
		" as the table's owner (the grants `outbox-relay migrate --print-grants` prints now give it to the relay role), " +
		"or serve the console with `outbox-relay console` as the operator role", true
}

func (c *Console) row(w http.ResponseWriter, r *http.Request) {
	id, err := decodeID(r.URL.Query().Get("id"))
	if err != nil {
		c.fail(w, r, http.StatusBadRequest, err.Error())
		return
	}
	row, ok, err := c.src.Store.Row(r.Context(), id)
	if err != nil {
		c.fail(w, r, http.StatusInternalServerError, "read the row: "+safeError(err))
		return
	}
	if !ok {
		c.fail(w, r, http.StatusNotFound, "no row with work ID "+termsafe.String(id))
		return
	}
	d := rowData{Row: row}
	if d.History, err = c.src.Store.History(r.Context(), id); err != nil {
		// The row itself is what the page is for: without the read of the
		// history it still shows, with why the history does not.
		msg, ok := historyGrant(err)
		if !ok {
			c.fail(w, r, http.StatusInternalServerError, "read the row's history: "+safeError(err))
			return
		}
		d.NoHistory = msg
	}
	if d.Watermark, err = c.watermarkFor(r.Context(), row); err != nil {
		c.fail(w, r, http.StatusInternalServerError, "read the watermark: "+safeError(err))
		return
	}
	c.render(w, r, "row", d, http.StatusOK)
}

type historyData struct {
	WorkID  string
	Recent  bool
	History []store.History
}

// historyRecent is how many history rows the page shows without a search.
const historyRecent = 100

func (c *Console) history(w http.ResponseWriter, r *http.Request) {
	id := r.URL.Query().Get("work_id")
	d := historyData{WorkID: id}
	var err error
	if id == "" {
		d.Recent = true
		d.History, err = c.src.Store.RecentHistory(r.Context(), historyRecent)
	} else {
		d.History, err = c.src.Store.History(r.Context(), id)
	}
	if msg, ok := historyGrant(err); ok {
		c.fail(w, r, http.StatusForbidden, msg)
		return
	}
	if err != nil {
		c.fail(w, r, http.StatusInternalServerError, "read the history: "+safeError(err))
		return
	}
	c.render(w, r, "history", d, http.StatusOK)
}
