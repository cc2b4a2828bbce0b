package bigtable

import (
	"os"
	"path/filepath"
	"testing"
)

// A plan is matched to pg_stat_statements' text of the same statement,
// which has its constants as parameters.
func TestTextKeyMatchesPgStatStatements(t *testing.T) {
	raw := "SELECT coalesce(extract(epoch FROM clock_timestamp() - min(least(greatest(available_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'))), 0)::float8\n\t\tFROM \"public\".\"outbox\" WHERE state = 'ready' AND coalesce(x, false) AND y IS NULL AND z = NULL LIMIT $1 - 1"
	pgss := "SELECT coalesce(extract($2 FROM clock_timestamp() - min(least(greatest(available_at, $3), $4))), $5)::float8 FROM \"public\".\"outbox\" WHERE state = $6 AND coalesce(x, $8) AND y IS NULL AND z = $9 LIMIT $1 - $7"
	// epoch is a keyword in the raw text and a constant in pg_stat_statements'.
	if a, b := textKey(raw), textKey(pgss); a != b {
		t.Errorf("keys differ:\n%s\n%s", a, b)
	}
	raw = "SELECT x FROM \"public\".\"outbox_2\" WHERE a IN ('s', 'r') AND b = E'[\\x01]' AND c > 10.5 AND d = $2"
	pgss = "SELECT x FROM \"public\".\"outbox_2\" WHERE a IN ($3, $4) AND b = $5 AND c > $6 AND d = $2"
	if a, b := textKey(raw), textKey(pgss); a != b {
		t.Errorf("keys differ:\n%s\n%s", a, b)
	}
}

func TestReadPlansFindsSeqScansAndCancellations(t *testing.T) {
	log := `2026-12-01 14:26:52.150 UTC [1974] LOG:  duration: 8.659 ms  plan:
	{
	  "Query Text": "SELECT count(*) FROM outbox WHERE state = 'failed'",
	  "Plan": {"Node Type": "Aggregate", "Plans": [{"Node Type": "Seq Scan", "Relation Name": "outbox"}]}
	}
2026-12-01 14:26:52.171 UTC [2274] LOG:  duration: 0.271 ms  plan:
	{
	  "Query Text": "SELECT 1 FROM outbox WHERE work_id = $1",
	  "Query Identifier": 9223372036854775001,
	  "Plan": {"Node Type": "Index Scan", "Relation Name": "outbox"}
	}
2026-12-01 14:26:53.000 UTC [2275] ERROR:  canceling statement due to statement timeout
2026-12-01 14:26:53.000 UTC [2275] STATEMENT:  SELECT state, count(*)
	FROM outbox GROUP BY state
2026-12-01 14:26:54.000 UTC [2275] LOG:  something else
`
	path := filepath.Join(t.TempDir(), "pg.log")
	if err := os.WriteFile(path, []byte("before the window: plan:\n{\"Plan\": {\"Node Type\": \"Seq Scan\", \"Relation Name\": \"outbox\"}}\n"+log), 0o644); err != nil {
		t.Fatal(err)
	}
	off := int64(len("before the window: plan:\n{\"Plan\": {\"Node Type\": \"Seq Scan\", \"Relation Name\": \"outbox\"}}\n"))
	p := readPlans(path, off, "outbox")
	if pc := p.lookup(0, "SELECT count(*) FROM outbox WHERE state = $1"); pc == nil || pc.plans != 1 || pc.seqScans != 1 {
		t.Errorf("the counting plan: %+v, want 1 plan with a seq scan", pc)
	}
	if pc := p.lookup(9223372036854775001, "another text"); pc == nil || pc.plans != 1 || pc.seqScans != 0 {
		t.Errorf("the plan by query identifier: %+v, want 1 plan, no seq scan", pc)
	}
	if n := p.cancelled["SELECT state, count(*) FROM outbox GROUP BY state"]; n != 1 || len(p.cancelled) != 1 {
		t.Errorf("cancelled: %v", p.cancelled)
	}
}
