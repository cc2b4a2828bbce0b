package bench

import (
	"slices"
	"testing"
)

func TestFormatCombos(t *testing.T) {
	var got []string
	for _, c := range formatCombos(true) {
		got = append(got, c.String())
	}
	want := []string{
		"baseline jsonb × outbox",
		"jsonb × outbox", "jsonb × cloudevents", "jsonb × cloudevents-structured",
		"json × outbox",
		"bytea × outbox", "bytea × cloudevents", "bytea × cloudevents-structured",
	}
	if !slices.Equal(got, want) {
		t.Fatalf("formatCombos(true) = %q, want %q", got, want)
	}
	if c := formatCombos(false); len(c) != len(want)-1 || c[0].Baseline {
		t.Errorf("formatCombos(false) = %v, want the same without the baseline", c)
	}

	combos := formatCombos(true)
	if o := formatOrder(combos, 1); !slices.Equal(o, combos) {
		t.Errorf("round 1: %v, want the combos as listed", o)
	}
	o := formatOrder(combos, 2)
	if o[0] != combos[len(combos)-1] || o[len(o)-1] != combos[0] {
		t.Errorf("round 2: %v, want them reversed", o)
	}
	if !slices.Equal(formatOrder(combos, 3), combos) || combos[0] != formatCombos(true)[0] {
		t.Error("round 3 is not round 1's order, or formatOrder changed its argument")
	}
}

func TestFormatRows(t *testing.T) {
	base := FormatCombo{PayloadType: "jsonb", Format: "outbox", Baseline: true}
	jsonb := FormatCombo{PayloadType: "jsonb", Format: "outbox"}
	bytea := FormatCombo{PayloadType: "bytea", Format: "cloudevents"}
	run := func(c FormatCombo, rate, us, stored float64) FormatRun {
		return FormatRun{Combo: c, Result: Result{Rows: 1000, MsgsPerSec: rate, PubCPUPerMsgUS: us, WalsenderCPU: us / 1000}, StreamBytesPerMsg: stored, DataBytes: 200}
	}
	runs := []FormatRun{
		run(base, 100, 5, 300), run(jsonb, 110, 6, 300), run(bytea, 50, 9, 400),
		run(bytea, 40, 7, 400), run(jsonb, 90, 4, 300), run(base, 80, 5, 300),
		run(base, 120, 3, 300), run(jsonb, 100, 5, 300), run(bytea, 60, 8, 400),
	}
	rows := formatRows([]FormatCombo{base, jsonb, {PayloadType: "json", Format: "outbox"}, bytea}, runs)
	if len(rows) != 3 {
		t.Fatalf("%d rows, want 3 (json × outbox did not run): %+v", len(rows), rows)
	}
	b, j, y := rows[0], rows[1], rows[2]
	if b.Combo != base || j.Combo != jsonb || y.Combo != bytea {
		t.Fatalf("rows out of the combos' order: %+v", rows)
	}
	if b.MsgsPerSec != 100 || j.MsgsPerSec != 100 || y.MsgsPerSec != 50 || y.PubUSPerMs != 8 || y.WSUSPerMsg != 8 || y.Runs != 3 {
		t.Errorf("medians: %+v", rows)
	}
	if !slices.Equal(y.Rates, []float64{50, 40, 60}) {
		t.Errorf("rates by round: %v", y.Rates)
	}
	if b.OverBaseline != 1 || y.OverBaseline != 0.5 || y.OverJSONB != 0.5 || y.StreamBytesPerMsg != 400 || y.DataBytes != 200 {
		t.Errorf("ratios or sizes: %+v", y)
	}
	// Without a baseline the ratio to it is left out, not NaN (-json).
	rows = formatRows([]FormatCombo{jsonb, bytea}, runs)
	if rows[1].OverBaseline != 0 || rows[1].OverJSONB != 0.5 {
		t.Errorf("no baseline: %+v", rows[1])
	}
}
