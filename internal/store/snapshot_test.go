package store

import "testing"

func TestSnapshotVisible(t *testing.T) {
	cases := []struct {
		snap string
		xid  uint32
		want bool
	}{
		{"100:105:100,103", 99, true},   // before xmin
		{"100:105:100,103", 100, false}, // in progress
		{"100:105:100,103", 101, true},  // completed between xmin and xmax
		{"100:105:100,103", 103, false},
		{"100:105:100,103", 105, false}, // at xmax: not yet completed
		{"100:100:", 100, false},        // the only running transaction, xmax == xid
		{"100:100:", 99, true},
		// Epoch 1: full xids above 2^32 while pgoutput sends the low 32 bits.
		{"4294967396:4294967400:4294967398", 100, true},  // 2^32+100
		{"4294967396:4294967400:4294967398", 102, false}, // in xip
		{"4294967396:4294967400:4294967398", 104, false}, // at xmax
		// A 32-bit xid from just before the wrap, seen after it.
		{"4294967290:4294967300:", 4294967295, true},
	}
	for _, c := range cases {
		s, err := ParseSnapshot(c.snap)
		if err != nil {
			t.Fatalf("ParseSnapshot(%q): %v", c.snap, err)
		}
		if got := s.Visible(c.xid); got != c.want {
			t.Errorf("snapshot %s: Visible(%d) = %v, want %v", c.snap, c.xid, got, c.want)
		}
	}
}

func TestParseSnapshotErrors(t *testing.T) {
	for _, s := range []string{"", "1:2", "a:2:", "1:2:x"} {
		if _, err := ParseSnapshot(s); err == nil {
			t.Errorf("ParseSnapshot(%q): want error", s)
		}
	}
}
