package bench

import (
	"math"
	"strings"
	"testing"
	"time"
)

func TestPercentile(t *testing.T) {
	var d []time.Duration
	for i := 1; i <= 100; i++ {
		d = append(d, time.Duration(101-i)*time.Millisecond) // unsorted on purpose
	}
	got := Summarize(d)
	want := Latency{N: 100, P50: 50, P95: 95, P99: 99, Max: 100}
	if got != want {
		t.Fatalf("Summarize = %+v, want %+v", got, want)
	}
	if p := Percentile([]time.Duration{7}, 0.99); p != 7 {
		t.Errorf("one sample: p99 = %v, want 7ns", p)
	}
	if p := Percentile(nil, 0.5); p != 0 {
		t.Errorf("no samples: %v, want 0", p)
	}
	if s := Summarize(nil); s != (Latency{}) {
		t.Errorf("Summarize(nil) = %+v", s)
	}
}

func TestMedian(t *testing.T) {
	for _, tc := range []struct {
		in   []float64
		want float64
		idx  int
	}{
		{[]float64{3, 1, 2}, 2, 2},
		{[]float64{4, 1, 3, 2}, 2.5, 3},
		{[]float64{5}, 5, 0},
	} {
		if got := Median(tc.in); got != tc.want {
			t.Errorf("Median(%v) = %v, want %v", tc.in, got, tc.want)
		}
		if got := MedianIndex(tc.in); got != tc.idx {
			t.Errorf("MedianIndex(%v) = %v, want %v", tc.in, got, tc.idx)
		}
	}
	if !math.IsNaN(Ratio(1, 0)) {
		t.Error("Ratio(1, 0) is not NaN")
	}
}

func TestFormatTable(t *testing.T) {
	got := FormatTable([]string{"case", "msg/s"}, [][]string{{"cdc-backlog", num(31234.6)}, {"x", num(0)}})
	want := "| case        | msg/s |\n" +
		"| ----------- | ----- |\n" +
		"| cdc-backlog | 31235 |\n" +
		"| x           | -     |\n"
	if got != want {
		t.Fatalf("FormatTable:\n%s\nwant:\n%s", got, want)
	}
	if r := ratio(3, 2); r != "1.50x" {
		t.Errorf("ratio(3, 2) = %q", r)
	}
	if !strings.HasPrefix(num(0.0123), "0.012") {
		t.Errorf("num(0.0123) = %q", num(0.0123))
	}
}

func TestParseStatCPU(t *testing.T) {
	// comm with spaces and a parenthesis; utime 250, stime 50 ticks.
	line := "1234 (a b) c) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 100 1000 10"
	got, err := parseStatCPU(line)
	if err != nil || got != 3.0 {
		t.Fatalf("parseStatCPU = %v, %v; want 3.0", got, err)
	}
}

func TestWorkID(t *testing.T) {
	if i, ok := parseWorkID(workID(4711)); !ok || i != 4711 {
		t.Fatalf("parseWorkID(workID(4711)) = %d, %v", i, ok)
	}
	if _, ok := parseWorkID("x1"); ok {
		t.Error("parseWorkID accepted x1")
	}
	if p := makePayload(200); len(p) != 200 {
		t.Errorf("makePayload(200) is %d bytes", len(p))
	}
	if got := throughput([]int64{0, int64(50 * time.Millisecond), int64(260 * time.Millisecond)}); len(got) != 3 || got[0] != 1 || got[2] != 1 {
		t.Errorf("throughput = %v", got)
	}
}
