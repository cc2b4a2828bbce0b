package main

import (
	"strings"
	"testing"
	"time"
)

// The operator's way out of rows a producer could write before migration
// 0008 (issue 20, items 3 and 4): cancel frees an aggregate held by a row
// whose available_at is 'infinity', status reads '-infinity', prune takes
// an expired row with a '-infinity' deadline, and redrive --expires-at
// refuses a deadline already past with the reason, the row untouched.
func TestOpsOnInfiniteTimes(t *testing.T) {
	url, pool := migrated(t)
	mustExec(t, pool, `ALTER TABLE outbox DISABLE TRIGGER outbox_times_check`)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, available_at, expires_at, aggregate_type, aggregate_id, aggregate_seq) VALUES
		('never-due', 'k', '{}', 'scheduled', 'infinity', NULL, 'order', '7', 1),
		('behind',    'k', '{}', 'scheduled', clock_timestamp(), NULL, 'order', '7', 2),
		('always',    'k', '{}', 'ready', '-infinity', NULL, NULL, NULL, NULL),
		('gone',      'k', '{}', 'expired', clock_timestamp(), '-infinity', NULL, NULL, NULL),
		('dead',      'k', '{}', 'failed', clock_timestamp(), NULL, NULL, NULL, NULL)`)
	mustExec(t, pool, `ALTER TABLE outbox ENABLE TRIGGER outbox_times_check`)

	if code, out, _ := run(t, "status", "--database-url", url); code != 0 || !strings.Contains(out, "never-due") {
		t.Errorf("status exited %d; want 0 and the blocking row named:\n%s", code, out)
	}
	if code, _, _ := run(t, "cancel", "--database-url", url, "--reason", "never due", "--work-id", "never-due"); code != 0 {
		t.Fatalf("cancel of a row with available_at infinity exited %d", code)
	}
	if st, _, _ := stateOf(t, pool, "never-due"); st != "cancelled" {
		t.Fatalf("never-due: %s, want cancelled", st)
	}
	if code, out, _ := run(t, "status", "--database-url", url); code != 0 || strings.Contains(out, "never-due") {
		t.Errorf("status after the cancel exited %d; want 0 and the aggregate no longer blocked:\n%s", code, out)
	}

	past := time.Now().Add(-time.Hour).UTC().Format(time.RFC3339)
	for _, at := range []string{past, "1970-01-01T00:00:00Z", "10000-01-01T00:00:00Z"} {
		code, _, errOut := run(t, "redrive", "--database-url", url, "--reason", "retry", "--work-id", "dead", "--expires-at", at)
		// Year 10000 has no RFC 3339 form: the flag's parser names it.
		if code == 0 || !(strings.Contains(errOut, "not in the future on the database clock") || strings.Contains(errOut, `--expires-at "10000`)) {
			t.Errorf("redrive --expires-at %s exited %d; want a refusal naming the reason:\n%s", at, code, errOut)
		}
	}
	if st, _, _ := stateOf(t, pool, "dead"); st != "failed" || historyRows(t, pool) != 1 {
		t.Errorf("dead after the refused redrives: %s with %d history rows; want failed, untouched (one history row: the cancel)", st, historyRows(t, pool))
	}

	if code, out, _ := run(t, "prune", "--database-url", url, "--older-than", "1s", "--include-cancelled"); code != 0 || !strings.Contains(out, "1 expired") {
		t.Errorf("prune exited %d; want the -infinity expired row pruned:\n%s", code, out)
	}
}
