package console

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/store"
)

// Actions. A redrive or cancel is two requests: the preview runs the
// store's statement as a dry run (a rolled-back transaction) on the work IDs
// the operator selected or the filter matched, and shows what would change
// and what would be refused and why. The action never touches a row the
// operator did not see would change: a confirmation of ticked rows carries
// exactly the work IDs the preview said would change; a confirmation of a
// filter carries the filter and a digest of those work IDs (500 long IDs do
// not fit in a request), and is applied only if the same dry run under the
// same filter finds the same set. A row that moved in between is refused by
// the statement's guard and reported.

// actionForm is a preview's or confirmation's request.
type actionForm struct {
	Action   store.Action
	IDs      []string
	Reason   string
	Name     string
	Deadline string // keep, new or none
	// ExpiresAt is the new deadline, RFC3339; a preview resolves a
	// duration ("2h") to the time it names, so the confirmation applies
	// the deadline the preview showed.
	ExpiresAt string
	// Filter: set when the action's scope is the rows table's filter.
	Filter *filterForm
	More   bool // the filter matched more rows than one action takes
	// Digest is a filter confirmation's setDigest of the rows its preview
	// would change.
	Digest string
}

func (c *Console) readAction(r *http.Request, preview bool) (actionForm, error) {
	v := r.PostForm
	a := actionForm{Reason: strings.TrimSpace(v.Get("reason")), Name: cleanName(v.Get("name")),
		Deadline: v.Get("deadline"), ExpiresAt: strings.TrimSpace(v.Get("expires_at"))}
	switch v.Get("action") {
	case string(store.ActionRedrive):
		a.Action = store.ActionRedrive
	case string(store.ActionCancel):
		a.Action = store.ActionCancel
	default:
		return a, errors.New("choose redrive or cancel")
	}
	if a.Reason == "" {
		return a, errors.New("a reason is required: it is kept with each row and in its history")
	}
	if a.Deadline == "" {
		a.Deadline = "keep"
	}
	switch a.Deadline {
	case "keep", "none":
	case "new":
		if _, err := parseDeadline(a.ExpiresAt, time.Now()); err != nil {
			return a, err
		}
	default:
		return a, fmt.Errorf("deadline %q: want keep, new or none", a.Deadline)
	}
	if a.Action == store.ActionCancel {
		a.Deadline = "keep"
	}
	seen := map[string]bool{}
	for _, e := range v["id"] {
		id, err := decodeID(e)
		if err != nil {
			return a, err
		}
		if !seen[id] {
			seen[id] = true
			a.IDs = append(a.IDs, id)
		}
	}
	if v.Get("scope") == "filter" {
		if len(a.IDs) > 0 {
			return a, errors.New("choose the selected rows or the whole filter, not both")
		}
		if a.Digest = strings.TrimSpace(v.Get("digest")); !preview && a.Digest == "" {
			return a, errors.New("a confirmation of a filter needs its preview's digest of the rows: preview again")
		}
		f := readFilter(v)
		lf, err := f.store()
		if err != nil {
			return a, err
		}
		a.Filter = &f
		if a.IDs, a.More, err = c.src.Store.ListWorkIDs(r.Context(), lf, c.o.MaxActionRows); err != nil {
			return a, fmt.Errorf("select the filter's rows: %s", safeError(err))
		}
		if len(a.IDs) == 0 {
			if !preview {
				// The rows left the filter since the preview: the
				// digest check says so.
				return a, nil
			}
			return a, errors.New("the filter matches no rows")
		}
	}
	if len(a.IDs) == 0 {
		return a, errors.New("nothing selected: tick rows, or choose the whole filter")
	}
	if len(a.IDs) > c.o.MaxActionRows {
		return a, fmt.Errorf("%d rows selected: the console takes at most %d per action (use the CLI's --limit for more)", len(a.IDs), c.o.MaxActionRows)
	}
	return a, nil
}

// parseDeadline reads a new deadline: RFC3339, or a positive duration from
// now, as the CLI's --expires-at.
func parseDeadline(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 {
		return time.Time{}, fmt.Errorf("new deadline %q: want an RFC3339 time like 2026-12-01T12:00:00Z or a duration from now like 2h", s)
	}
	return now.Add(d), nil
}

func (c *Console) request(r *http.Request, a actionForm, dry bool) (store.OpRequest, error) {
	req := store.OpRequest{
		Selection: store.Selection{WorkIDs: a.IDs},
		By:        who(r, a.Name), Reason: a.Reason, DryRun: dry,
	}
	if a.Action == store.ActionRedrive {
		req.Stagger = c.o.Stagger
		switch a.Deadline {
		case "none":
			req.NoDeadline = true
		case "new":
			t, err := parseDeadline(a.ExpiresAt, time.Now())
			if err != nil {
				return req, err
			}
			req.ExpiresAt = t
		}
	}
	return req, nil
}

func (c *Console) run(r *http.Request, a actionForm, req store.OpRequest) (store.OpResult, error) {
	if !req.DryRun {
		// The operator's next look at the overview shows what they did.
		defer c.forgetHealth()
	}
	if a.Action == store.ActionRedrive {
		return c.src.Store.Redrive(r.Context(), req)
	}
	return c.src.Store.Cancel(r.Context(), req)
}

type refusedRow struct {
	WorkID string
	State  string
	Why    string
}

type resultData struct {
	Form      actionForm
	Result    store.OpResult
	Refused   []refusedRow
	Uncertain int      // changed rows whose last attempt's outcome is unknown
	Confirm   []string // the work IDs the preview would change
	// Digest is what a filter's confirmation carries instead of Confirm.
	Digest string
	By     string
}

func (c *Console) result(a actionForm, req store.OpRequest, res store.OpResult) resultData {
	d := resultData{Form: a, Result: res, By: req.By}
	for _, f := range res.Refused {
		why := f.Why(a.Action)
		// The store words it for the CLI; name the console's controls.
		why = strings.NewReplacer("(--expires-at)", "(new deadline)", "(--no-deadline)", "(no deadline)").Replace(why)
		d.Refused = append(d.Refused, refusedRow{WorkID: f.WorkID, State: f.State, Why: why})
	}
	for _, ch := range res.Changed {
		d.Confirm = append(d.Confirm, ch.WorkID)
		if ch.Uncertain() {
			d.Uncertain++
		}
	}
	return d
}

// preview runs the action as a dry run: the page lists exactly what would
// change and what would be refused, and carries those work IDs to apply.
func (c *Console) preview(w http.ResponseWriter, r *http.Request) { c.act(w, r, true) }

// apply runs the previewed action on the work IDs the preview listed.
func (c *Console) apply(w http.ResponseWriter, r *http.Request) { c.act(w, r, false) }

func (c *Console) act(w http.ResponseWriter, r *http.Request, preview bool) {
	a, err := c.readAction(r, preview)
	if err != nil {
		c.fail(w, r, http.StatusBadRequest, err.Error())
		return
	}
	if !preview && a.Filter != nil {
		// The filter again, as a dry run: confirmed only if it would
		// change exactly the rows the preview showed, and then only those.
		var ids []string
		if len(a.IDs) > 0 {
			_, res, ok := c.runOp(w, r, a, true)
			if !ok {
				return
			}
			ids = changedIDs(res)
		}
		if now := setDigest(a, ids); now != a.Digest || len(ids) == 0 {
			shown, _, _ := strings.Cut(a.Digest, ":")
			if _, err := strconv.Atoi(shown); err != nil {
				shown = "other"
			}
			c.fail(w, r, http.StatusConflict, fmt.Sprintf("the set changed, preview again: the rows this filter would %s are not the ones the preview showed "+
				"(%s rows then, %d now, or other rows); nothing was changed", a.Action, shown, len(ids)))
			return
		}
		a.IDs = ids
	}
	if preview && a.Deadline == "new" {
		// Fixed now, so the apply uses the deadline the preview showed.
		t, _ := parseDeadline(a.ExpiresAt, time.Now())
		a.ExpiresAt = t.UTC().Format(time.RFC3339Nano)
	}
	req, res, ok := c.runOp(w, r, a, preview)
	if !ok {
		return
	}
	page := "result"
	d := c.result(a, req, res)
	if preview {
		page = "preview"
		if a.Filter != nil {
			d.Digest = setDigest(a, d.Confirm)
		}
	}
	c.render(w, r, page, d, http.StatusOK)
}

// runOp runs a's operation (a dry run when dryRun); false: it failed and
// the answer is written.
func (c *Console) runOp(w http.ResponseWriter, r *http.Request, a actionForm, dryRun bool) (store.OpRequest, store.OpResult, bool) {
	req, err := c.request(r, a, dryRun)
	if err != nil {
		c.fail(w, r, http.StatusBadRequest, err.Error())
		return req, store.OpResult{}, false
	}
	res, err := c.run(r, a, req)
	if err != nil {
		c.opFailed(w, r, err)
		return req, store.OpResult{}, false
	}
	return req, res, true
}

func changedIDs(res store.OpResult) []string {
	ids := make([]string, 0, len(res.Changed))
	for _, ch := range res.Changed {
		ids = append(ids, ch.WorkID)
	}
	return ids
}

// setDigest names what a filter's confirmation confirms: the action, its
// deadline decision, the filter, and the work IDs it would change, as
// "count:sha256". It needs no key: the server recomputes it and compares,
// so a client can only choose to confirm a set it could have previewed.
func setDigest(a actionForm, ids []string) string {
	sorted := slices.Clone(ids)
	slices.Sort(sorted)
	h := sha256.New()
	field := func(s string) {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		h.Write([]byte(s))
	}
	field("outbox-relay console filter confirmation")
	field(string(a.Action))
	field(a.Deadline)
	field(a.ExpiresAt)
	if a.Filter != nil {
		field(a.Filter.query().Encode())
	}
	field(strconv.Itoa(len(sorted)))
	for _, id := range sorted {
		field(id)
	}
	return strconv.Itoa(len(sorted)) + ":" + hex.EncodeToString(h.Sum(nil))
}

func (c *Console) opFailed(w http.ResponseWriter, r *http.Request, err error) {
	if errors.Is(err, store.ErrBadSelection) {
		c.fail(w, r, http.StatusBadRequest, strings.TrimPrefix(err.Error(), store.ErrBadSelection.Error()+": "))
		return
	}
	c.fail(w, r, http.StatusInternalServerError, safeError(err))
}
