package bench

import (
	"math"
	"sort"
	"time"
)

// Latency summarises commit-to-ack latencies.
type Latency struct {
	N   int     `json:"n"`
	P50 float64 `json:"p50_ms"`
	P95 float64 `json:"p95_ms"`
	P99 float64 `json:"p99_ms"`
	Max float64 `json:"max_ms"`
}

// Percentile returns the q-quantile (0 <= q <= 1) of sorted by the
// nearest-rank method: the smallest value with at least q of the samples at
// or below it. It returns 0 for no samples.
func Percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	if q <= 0 {
		return sorted[0]
	}
	rank := int(math.Ceil(q * float64(len(sorted))))
	if rank > len(sorted) {
		rank = len(sorted)
	}
	return sorted[rank-1]
}

// Summarize sorts d in place and returns its percentiles in milliseconds.
func Summarize(d []time.Duration) Latency {
	if len(d) == 0 {
		return Latency{}
	}
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	ms := func(x time.Duration) float64 { return float64(x) / float64(time.Millisecond) }
	return Latency{
		N:   len(d),
		P50: ms(Percentile(d, 0.50)),
		P95: ms(Percentile(d, 0.95)),
		P99: ms(Percentile(d, 0.99)),
		Max: ms(d[len(d)-1]),
	}
}

// Median returns the median of xs (the mean of the middle two for an even
// count), ignoring NaNs; 0 when there is nothing.
func Median(xs []float64) float64 {
	v := make([]float64, 0, len(xs))
	for _, x := range xs {
		if !math.IsNaN(x) {
			v = append(v, x)
		}
	}
	if len(v) == 0 {
		return 0
	}
	sort.Float64s(v)
	m := len(v) / 2
	if len(v)%2 == 1 {
		return v[m]
	}
	return (v[m-1] + v[m]) / 2
}

// MedianIndex returns the index in xs of the round whose value is the median
// (the lower middle for an even count), so that a whole round's figures can be
// reported together rather than medians mixed from different rounds.
func MedianIndex(xs []float64) int {
	if len(xs) == 0 {
		return -1
	}
	idx := make([]int, len(xs))
	for i := range idx {
		idx[i] = i
	}
	sort.SliceStable(idx, func(a, b int) bool { return xs[idx[a]] < xs[idx[b]] })
	return idx[(len(xs)-1)/2]
}

// Ratio is a/b, or NaN when b is zero.
func Ratio(a, b float64) float64 {
	if b == 0 {
		return math.NaN()
	}
	return a / b
}
