package bench

import "testing"

// TestWALStatsLines pins the pg_waldump --stats=record lines (PostgreSQL 15)
// the decode case reads.
func TestWALStatsLines(t *testing.T) {
	rec := "Btree/SPLIT_R                                 33 (  0.12)                61533 (  1.72)                 7368 (  0.07)                68901 (  0.49)"
	m := walRecord.FindStringSubmatch(rec)
	if m == nil || m[1] != "Btree/SPLIT_R" || m[2] != "33" || m[3] != "61533" || m[4] != "7368" || m[5] != "68901" {
		t.Fatalf("record line: %q", m)
	}
	full := "Heap/HOT_UPDATE                            18519 ( 92.01)              6814948 (100.00)                    0 (  0.00)              6814948 ( 87.12)"
	if m := walRecord.FindStringSubmatch(full); m == nil || m[5] != "6814948" {
		t.Fatalf("record line with 100.00: %q", m)
	}
	total := "Total                                      26549                       3570244 [25.48%]             10443496 [74.52%]             14013740 [100%]"
	m = walTotal.FindStringSubmatch(total)
	if m == nil || m[1] != "3570244" || m[2] != "10443496" || m[3] != "14013740" {
		t.Fatalf("total line: %q", m)
	}
	if walRecord.MatchString(total) || walTotal.MatchString(rec) {
		t.Error("a total line read as a record, or a record as the total")
	}
}
